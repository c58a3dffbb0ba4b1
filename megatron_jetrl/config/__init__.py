"""Job configuration: the lowest layer of the package.

Every config error names the offending key and the fix, so a bad YAML or override fails at
start-up, before any GPU work (see ``ConfigError``). ``loader`` builds the typed section
dataclasses from YAML and ``key=value`` overrides.
"""

from megatron_jetrl.config.errors import (
    CheckpointError, ConfigError, HfCheckpointError, MegatronCheckpointError, RunCheckpointError, check_integer,
    check_number,
)
from megatron_jetrl.config.loader import apply_overrides, build, check_fields, load_yaml, parse_override, to_plain

__all__ = ["CheckpointError", "ConfigError", "HfCheckpointError", "MegatronCheckpointError", "RunCheckpointError",
           "check_integer", "check_number", "apply_overrides", "build",
           "check_fields", "load_yaml", "parse_override", "to_plain"]
