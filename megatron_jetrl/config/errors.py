"""The error types for bad input: a config value (``ConfigError``) and a checkpoint on disk
(``CheckpointError``)."""

from __future__ import annotations

import math


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


class CheckpointError(ValueError):
    """A checkpoint on disk is missing something or has the wrong shape; the message names it.
    Three kinds of checkpoint, one subclass each, so a message and a handler say which (``kind``)."""

    kind = "checkpoint"


class HfCheckpointError(CheckpointError):
    """An HF checkpoint (``config.json`` + safetensors): a downloaded model, a conversion's output,
    an FP8 block export."""

    kind = "HF checkpoint"


class MegatronCheckpointError(CheckpointError):
    """A megatron-core checkpoint (``torch.distributed.checkpoint``): converted weights
    (``model.checkpoint``) or the ``actor/`` of a run checkpoint."""

    kind = "megatron checkpoint"


class RunCheckpointError(CheckpointError):
    """A run's checkpoints (``run.dir/checkpoints/step_N``: actor, trainer state, RNG states)."""

    kind = "run checkpoint"


def check_integer(key: str, value: object, *, minimum: int | None = None) -> None:
    """``ConfigError`` naming ``key`` unless ``value`` is an int (not a bool), ``>= minimum`` when
    given: "must be an integer" / "must be an integer >= N"."""
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        raise ConfigError(key, value, "must be an integer" + ("" if minimum is None else f" >= {minimum}"))


def check_number(key: str, value: object, *, low: float = -math.inf, high: float = math.inf,
                 low_open: bool = False, high_open: bool = False) -> None:
    """``ConfigError`` naming ``key`` unless ``value`` is a finite real (int or float, not a bool)
    in the interval; the message states it: "must be a finite number in (0, 1)"."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        left = "(" if low_open or low == -math.inf else "["
        right = ")" if high_open or high == math.inf else "]"
        raise ConfigError(key, value, f"must be a finite number in {left}{low:g}, {high:g}{right}")
