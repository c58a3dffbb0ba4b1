"""Reward functions: responses + reference answers → scores.

``build_reward(settings)`` picks one by ``reward.type``:

- ``math``: the final answer is checked by ``math_answer`` with the checker ``reward.math_checker``
  names (math_verify or the built-in one; ``require_math_checker`` says early when the chosen one
  is not installed). Each check runs in a ``TimedPool`` worker under
  ``time_limit_s``; a check that runs over scores 0 and counts in ``timeouts``, one that fails
  scores 0 and counts in ``errors``. Model output is untrusted: nothing it contains can raise here
  or stall a step past the limit.
- a synthetic task name: that task's ``score(response, answer)``, in-process (cheap and pure).

A reward function owns resources (the worker pool); ``close()`` it, or use it as a context manager.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence

from megatron_jetrl.config import ConfigError
from megatron_jetrl.data import math_answer
from megatron_jetrl.data.settings import MATH_REWARD, RewardSettings
from megatron_jetrl.data.timed_pool import ERROR, OK, TIMEOUT, TimedPool

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RewardBatch:
    """``scores[i]`` for response i; ``timeouts`` and ``errors`` count responses scored 0 because
    their check ran past the limit or failed (report them: a rising count is a symptom)."""

    scores: list[float]
    timeouts: int = 0
    errors: int = 0


class RewardFn(Protocol):
    def __call__(self, responses: Sequence[str], answers: Sequence[Any]) -> RewardBatch: ...

    def close(self) -> None: ...


def _check_lengths(responses: Sequence[str], answers: Sequence[Any]) -> None:
    if len(responses) != len(answers):
        raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
    for i, r in enumerate(responses):
        if not isinstance(r, str):
            raise TypeError(f"response {i} is a {type(r).__name__}, not decoded text")


class MathReward:
    """1.0 for a correct final answer, ``format_score`` for a wrong one, 0.0 for none.

    ``checker`` is ``check(response, answer) -> Optional[bool]`` (see ``math_answer``), a
    module-level function because it runs in spawned workers (``MATH_CHECKERS`` maps the
    ``reward.math_checker`` names to one and its worker initializer). ``workers`` defaults to
    min(4, CPUs): a check takes milliseconds, and every data-parallel rank may hold its own pool.
    """

    def __init__(self, *, checker: Callable[[str, Any], Optional[bool]], time_limit_s: float = 5.0,
                 format_score: float = 0.0, initializer: Optional[Callable[[], None]] = None,
                 workers: Optional[int] = None):
        self.checker = checker
        self.format_score = float(format_score)
        self.timeouts_total = 0
        self.errors_total = 0
        self._pool = TimedPool(checker, workers=workers or min(4, os.cpu_count() or 1), time_limit_s=time_limit_s,
                               initializer=initializer)

    def __call__(self, responses: Sequence[str], answers: Sequence[Any]) -> RewardBatch:
        _check_lengths(responses, answers)
        calls = [(r[-math_answer.MAX_RESPONSE_CHARS:], a) for r, a in zip(responses, answers, strict=True)]
        scores, timeouts, errors = [], 0, 0
        for outcome in self._pool.map(calls):
            if outcome.status == OK:
                scores.append(0.0 if outcome.value is None else 1.0 if outcome.value else self.format_score)
                continue
            scores.append(0.0)
            if outcome.status == TIMEOUT:
                timeouts += 1
            else:
                assert outcome.status == ERROR
                if not errors:
                    logger.warning("math reward: an answer check failed (scored 0): %s", outcome.error)
                errors += 1
        self.timeouts_total += timeouts
        self.errors_total += errors
        return RewardBatch(scores=scores, timeouts=timeouts, errors=errors)

    def close(self) -> None:
        self._pool.close()

    def __enter__(self) -> "MathReward":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SyntheticReward:
    """A synthetic task's own verifier, in-process. A verifier that raises (a bug: they must not
    raise on model output) scores 0 and counts in ``errors``."""

    def __init__(self, task: str):
        from megatron_jetrl.data import synthetic

        self.task = synthetic.TASKS[task]

    def __call__(self, responses: Sequence[str], answers: Sequence[Any]) -> RewardBatch:
        _check_lengths(responses, answers)
        scores, errors = [], 0
        for response, answer in zip(responses, answers, strict=True):
            try:
                scores.append(float(self.task.score(response, answer)))
            except Exception as e:  # a verifier bug must not end the run; it is counted and logged
                if not errors:
                    logger.warning("synthetic reward %r raised (scored 0): %s: %s", self.task.name,
                                   type(e).__name__, e)
                errors += 1
                scores.append(0.0)
        return RewardBatch(scores=scores, timeouts=0, errors=errors)

    def close(self) -> None:
        pass

    def __enter__(self) -> "SyntheticReward":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


MATH_CHECKERS: dict[str, tuple[Callable[[str, Any], Optional[bool]], Optional[Callable[[], None]]]] = {
    "math_verify": (math_answer.check_math_verify, math_answer.import_math_verify),
    "builtin": (math_answer.check_builtin, None),
}
"""``reward.math_checker`` -> (check function, worker initializer)."""


def require_math_checker(settings: RewardSettings) -> None:
    """Raise ``ConfigError`` when the job scores math with math_verify and it is not installed."""
    if settings.type == MATH_REWARD and settings.math_checker == "math_verify" \
            and importlib.util.find_spec("math_verify") is None:
        raise ConfigError("reward.math_checker", "math_verify",
                          "is not installed here: pip install math-verify, or reward.math_checker=builtin (the "
                          "built-in \\boxed{} answer check; rewards differ from math_verify's on some answers)")


def build_reward(settings: RewardSettings) -> RewardFn:
    if settings.type == MATH_REWARD:
        require_math_checker(settings)
        checker, initializer = MATH_CHECKERS[settings.math_checker]
        return MathReward(checker=checker, initializer=initializer, time_limit_s=settings.time_limit_s,
                          format_score=settings.format_score)
    return SyntheticReward(settings.type)
