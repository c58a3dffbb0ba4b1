"""Job configuration: the lowest layer of the package.

Every config error names the offending key and the fix, so a bad YAML or override fails at
start-up, before any GPU work (see ``ConfigError``).
"""

from megatron_jetrl.config.errors import ConfigError

__all__ = ["ConfigError"]
