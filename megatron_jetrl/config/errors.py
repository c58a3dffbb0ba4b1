"""The one error type for invalid configuration."""


class ConfigError(ValueError):
    """A configuration value is invalid.

    The message always says which key is wrong, what was given and what is allowed, e.g.
    ``precision.fp8.amax_epsilon: got -1.0; must be a finite number >= 0``.
    """

    def __init__(self, key: str, got: object, allowed: str):
        self.key = key
        self.got = got
        self.allowed = allowed
        super().__init__(f"{key}: got {got!r}; {allowed}")
