"""Math answer checking and reward functions (data/math_answer.py, data/rewards.py,
data/timed_pool.py): right and wrong answers, normalisation, hostile model output, and the time
limit (enforced by the worker's alarm and, for code that blocks it, by killing the worker)."""

import os
import signal
import time

import pytest

from megatron_jetrl.config import ConfigError
from megatron_jetrl.data import math_answer, synthetic
from megatron_jetrl.data.math_answer import answers_match, check_builtin, extract_boxed, normalize
from megatron_jetrl.data.rewards import MathReward, RewardBatch, SyntheticReward, build_reward
from megatron_jetrl.data.settings import RewardSettings
from megatron_jetrl.data.timed_pool import TimedPool

# ------------------------------------------------------------------ checkers run in the pool's workers
# (module level: spawned workers import them by name)


def sleepy_check(response, answer):
    if response == "slow":
        time.sleep(30)
    return check_builtin(response, answer)


def stubborn_check(response, answer):
    """Blocks SIGALRM, as C code that never returns to the interpreter effectively does."""
    if response == "stuck":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(30)
    return check_builtin(response, answer)


def failing_check(response, answer):
    if response == "crash":
        os._exit(3)
    if response == "raise":
        raise RuntimeError("checker bug")
    return check_builtin(response, answer)


def swallowing_check(response, answer):
    """``except Exception`` in checked code must not swallow the time limit."""
    try:
        time.sleep(30)
    except Exception:
        return True
    return True


# ------------------------------------------------------------------ extraction and normalisation


@pytest.mark.parametrize("text, want", [
    ("so the answer is \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\fbox{7}", "7"),
    ("\\boxed {x^{2}}", "x^{2}"),
    ("$\\boxed 5$ done", "5"),
    ("no box", None),
    ("\\boxed{", None),
    ("\\boxed{\\frac{1}{2}", None),
    ("\\boxed", None),
    ("\\boxedfoo", None),
])
def test_extract_boxed(text, want):
    assert extract_boxed(text) == want


@pytest.mark.parametrize("pred, ref", [
    ("\\frac{1}{2}", "0.5"),
    ("\\dfrac{1}{2}", "1/2"),
    ("\\frac12", "\\frac{1}{2}"),
    ("1,000", "1000"),
    ("1{,}000", "1000"),
    ("-\\frac{3}{4}", "-0.75"),
    ("x = 5", "5"),
    ("5\\text{ cm}", "5"),
    ("10^{\\circ}", "10"),
    ("50\\%", "50"),
    ("\\$12", "12"),
    ("\\left( 1, 2 \\right)", "(1,2)"),
    ("{7}", "7"),
    ("3.", "3"),
    (".5", "\\frac{1}{2}"),
    ("\\sqrt3", "\\sqrt{3}"),
    ("\\text{(B)}", "(B)"),
    ("2\\!\\,\\pi", "2\\pi"),
])
def test_answers_match(pred, ref):
    assert answers_match(pred, ref), (normalize(pred), normalize(ref))


@pytest.mark.parametrize("pred, ref", [
    ("3", "4"), ("\\frac{1}{3}", "0.333"), ("(1,2)", "(2,1)"), ("", ""), ("1,2", "12"), ("\\frac{1}{0}", "0"),
])
def test_answers_differ(pred, ref):
    assert not answers_match(pred, ref)


def test_check_builtin():
    assert check_builtin("... hence \\boxed{\\dfrac{1}{2}}.", "0.5") is True
    assert check_builtin("\\boxed{3}", 4) is False
    assert check_builtin("\\boxed{1,000}", 1000) is True
    assert check_builtin("I think it is 4", 4) is None


HOSTILE = [
    "x" * 5_000_000,                                              # 5 MB
    "\\boxed{" + "{" * 4_000 + "1" + "}" * 4_000 + "}",           # deep nesting inside the tail
    "\\boxed{" + "{" * 10_000 + "}" * 10_000 + "}",               # deeper than the tail
    "\\boxed{" * 3_000,                                           # unbalanced, many boxes
    "\\boxed{\\frac{{}{\\sqrt[}{\\left(\\right",                   # malformed LaTeX
    "\\boxed{" + "9" * 5_000 + "}",                               # a number past int-parsing limits
    "\\boxed{\\frac{" + "1" * 200 + "}{" + "0" * 200 + "}}",
    "\\boxed{" + "\\text{" * 2_000 + "}",
    "\\boxed{" + " " * 9_000 + "\\text{a}}",
    "\x00\ud800\\boxed{\u202e5}",
]


@pytest.mark.parametrize("text", HOSTILE, ids=range(len(HOSTILE)))
def test_builtin_checker_survives_hostile_input(text):
    t = time.monotonic()
    assert check_builtin(text, "5") in (None, False)
    assert time.monotonic() - t < 1.0


# ------------------------------------------------------------------ the math reward (worker pool)


def test_math_reward_scores_and_format_score():
    responses = ["so \\boxed{\\frac{1}{2}}", "\\boxed{3}", "it is 4", "\\boxed{1,000}"]
    answers = ["0.5", 4, 4, 1000]
    with MathReward(time_limit_s=5.0, format_score=0.1, checker=check_builtin, workers=2) as reward:
        batch = reward(responses, answers)
        assert batch == RewardBatch(scores=[1.0, 0.1, 0.0, 1.0], timeouts=0, errors=0)
        assert reward([], []) == RewardBatch(scores=[], timeouts=0, errors=0)
        hostile = reward(HOSTILE, ["5"] * len(HOSTILE))
        assert set(hostile.scores) <= {0.0, 0.1} and (hostile.timeouts, hostile.errors) == (0, 0)
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        MathReward(checker=check_builtin)(["a", "b"], [1])


def test_build_reward_uses_the_configured_checker():
    """reward.math_checker decides, not what is installed: builtin is builtin everywhere; the
    default math_verify is used where installed and refused, naming the fix, where it is not."""
    with build_reward(RewardSettings(time_limit_s=20.0, math_checker="builtin")) as reward:
        batch = reward(["the answer is \\boxed{7}", "\\boxed{8}"], ["7", "7"])
    assert batch.scores == [1.0, 0.0] and batch.timeouts == 0 and reward.checker is check_builtin
    assert RewardSettings().math_checker == "math_verify"
    if _has_math_verify():
        with build_reward(RewardSettings(time_limit_s=20.0)) as reward:
            assert reward(["\\boxed{7}"], ["7"]).scores == [1.0]
        assert reward.checker is math_answer.check_math_verify
    else:
        with pytest.raises(ConfigError, match="reward.math_checker.*pip install math-verify.*builtin"):
            build_reward(RewardSettings())
    with pytest.raises(ConfigError, match="reward.math_checker"):
        RewardSettings(math_checker="sympy")


def _has_math_verify():
    import importlib.util

    return importlib.util.find_spec("math_verify") is not None


def test_time_limit_by_alarm():
    with MathReward(time_limit_s=0.5, checker=sleepy_check, workers=2) as reward:
        reward(["\\boxed{1}"], ["1"])  # workers started: start-up is not timed
        t = time.monotonic()
        batch = reward(["\\boxed{1}", "slow", "\\boxed{2}", "slow"], ["1", "1", "1", "1"])
        elapsed = time.monotonic() - t
        assert batch == RewardBatch(scores=[1.0, 0.0, 0.0, 0.0], timeouts=2, errors=0)
        assert elapsed < 3.0 and reward._pool.restarts == 0  # the alarm ended the calls, workers lived
        assert reward(["\\boxed{2}"], ["2"]).scores == [1.0]


def test_time_limit_survives_except_exception():
    with MathReward(time_limit_s=0.3, checker=swallowing_check, workers=1) as reward:
        assert reward(["x"], ["1"]) == RewardBatch(scores=[0.0], timeouts=1, errors=0)


def test_time_limit_when_the_alarm_is_blocked():
    with MathReward(time_limit_s=0.5, checker=stubborn_check, workers=2) as reward:
        reward(["\\boxed{1}"], ["1"])
        t = time.monotonic()
        batch = reward(["stuck", "\\boxed{1}", "\\boxed{1}", "\\boxed{1}"], ["1"] * 4)
        elapsed = time.monotonic() - t
        assert batch == RewardBatch(scores=[0.0, 1.0, 1.0, 1.0], timeouts=1, errors=0)
        assert elapsed < 5.0 and reward._pool.restarts == 1  # killed after limit + grace, replaced
        assert reward(["\\boxed{3}", "stuck"], ["3", "3"]).timeouts == 1
        assert reward._pool.restarts == 2


def test_worker_crash_and_checker_error_are_counted():
    with MathReward(time_limit_s=5.0, checker=failing_check, workers=2) as reward:
        batch = reward(["crash", "\\boxed{1}", "raise", "\\boxed{2}"], ["1"] * 4)
        assert batch == RewardBatch(scores=[0.0, 1.0, 0.0, 0.0], timeouts=0, errors=2)
        assert reward.errors_total == 2
        assert reward(["\\boxed{1}"], ["1"]).scores == [1.0]


def test_pool_close_and_reuse():
    pool = TimedPool(check_builtin, workers=1, time_limit_s=5.0)
    assert [o.value for o in pool.map([("\\boxed{1}", "1")])] == [True]
    pool.close()
    assert [o.value for o in pool.map([("\\boxed{2}", "1")])] == [False]
    pool.close()
    pool.close()


# ------------------------------------------------------------------ synthetic rewards


def test_synthetic_reward_countdown():
    task = synthetic.TASKS["countdown"]
    records = task.generate(4, 0)
    with build_reward(RewardSettings(type="countdown")) as reward:
        responses = [r["solution"] for r in records] + ["1+"]
        batch = reward(responses, [r["answer"] for r in records] + [records[0]["answer"]])
    assert batch == RewardBatch(scores=[1.0, 1.0, 1.0, 1.0, 0.0], timeouts=0, errors=0)


class _BuggyTask:
    name = "buggy"

    def score(self, response, answer):
        if response == "boom":
            raise KeyError("oops")
        return 1.0


def test_synthetic_reward_counts_verifier_errors(monkeypatch):
    monkeypatch.setitem(synthetic.TASKS, "buggy", _BuggyTask())
    batch = SyntheticReward("buggy")(["ok", "boom"], [None, None])
    assert batch == RewardBatch(scores=[1.0, 0.0], timeouts=0, errors=1)
