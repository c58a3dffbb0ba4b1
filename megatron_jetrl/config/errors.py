"""The one error type for invalid configuration."""

from __future__ import annotations


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


def check_integer(key: str, value: object, *, minimum: int | None = None) -> None:
    """``ConfigError`` naming ``key`` unless ``value`` is an int (not a bool), ``>= minimum`` when
    given: "must be an integer" / "must be an integer >= N"."""
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        raise ConfigError(key, value, "must be an integer" + ("" if minimum is None else f" >= {minimum}"))
