"""What the data side is given: typed, validated settings (the ``data`` and ``reward`` sections).

``DatasetSettings`` and ``SyntheticSettings`` appear under both ``data.train`` and ``data.eval``,
so they cannot name their own keys; ``DataSettings.__post_init__`` validates them with the right
prefix (``validate(key)``), and ``PromptDataset.from_settings`` validates again with the key it is
given. Every other section validates itself at construction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from megatron_jetrl.config import ConfigError, check_fields, check_integer, check_number

CHAT_TEMPLATE_MODES = ("auto", "on", "off")
"""``chat_template``'s choices, for the tokenizer's check (a test keeps them equal to its Literal)."""
MATH_REWARD = "math"


def _text(key: str, value) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(key, value, "must be a non-empty string")


def _synthetic_tasks() -> list[str]:
    from megatron_jetrl.data import synthetic

    return sorted(synthetic.TASKS)


@dataclass(frozen=True)
class SyntheticSettings:
    """A generated dataset: ``synthetic.TASKS[task].generate(size, seed, **options)``."""

    task: str = "countdown"
    size: int = 10000
    seed: int = 0
    options: dict = field(default_factory=dict)

    def validate(self, key: str) -> None:
        """Raises ConfigError naming ``{key}.<field>`` (``key`` is e.g. ``data.train.synthetic``)."""
        tasks = _synthetic_tasks()
        if self.task not in tasks:
            raise ConfigError(f"{key}.task", self.task, f"must be one of {tasks}")
        check_integer(f"{key}.size", self.size, minimum=1)
        check_integer(f"{key}.seed", self.seed)
        if not isinstance(self.options, dict) or not all(isinstance(k, str) for k in self.options):
            raise ConfigError(f"{key}.options", self.options, "must be a mapping of option names to values")


@dataclass(frozen=True)
class DatasetSettings:
    """One prompt set: a file (``path``: ``.jsonl``/``.json`` with one JSON object per line, or
    ``.parquet``) or a ``synthetic`` task, never both.

    ``prompt_key`` / ``answer_key`` name the record fields; a dotted name reaches into nested
    objects (``reward_model.ground_truth``) when no top-level field has that exact name. A prompt
    is a string or a list of ``{"role", "content"}`` chat messages (the latter needs a chat
    template). ``chat_template``: ``auto`` uses the tokenizer's template when it has one, ``on``
    requires one, ``off`` encodes the plain text (``system_prompt`` then goes in front, separated
    by a blank line). Prompts longer than ``max_prompt_tokens`` after rendering are dropped at load
    (counted and logged), so one long prompt cannot break a step mid-run.
    """

    path: Optional[str] = None
    synthetic: Optional[SyntheticSettings] = None
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    system_prompt: Optional[str] = None
    chat_template: Literal["auto", "on", "off"] = "auto"
    max_prompt_tokens: int = 1024

    def validate(self, key: str) -> None:
        """Raises ConfigError naming ``{key}.<field>`` (``key`` is ``data.train`` or ``data.eval``)."""
        if self.path is None and self.synthetic is None:
            raise ConfigError(f"{key}.path", None,
                              f"set {key}.path (a .jsonl or .parquet file) or {key}.synthetic (a generated task)")
        if self.path is not None and self.synthetic is not None:
            raise ConfigError(f"{key}.synthetic", self.synthetic, f"set either {key}.path or {key}.synthetic, not both")
        if self.path is not None:
            _text(f"{key}.path", self.path)
        if self.synthetic is not None:
            if not isinstance(self.synthetic, SyntheticSettings):
                raise ConfigError(f"{key}.synthetic", self.synthetic, "must be a SyntheticSettings")
            self.synthetic.validate(f"{key}.synthetic")
            for name, default in (("prompt_key", "prompt"), ("answer_key", "answer")):
                if getattr(self, name) != default:
                    raise ConfigError(f"{key}.{name}", getattr(self, name),
                                      f"synthetic records always use {default!r}; remove the setting")
        _text(f"{key}.prompt_key", self.prompt_key)
        _text(f"{key}.answer_key", self.answer_key)
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            raise ConfigError(f"{key}.system_prompt", self.system_prompt, "must be a string or unset")
        check_fields(self, key, ("chat_template",))
        check_integer(f"{key}.max_prompt_tokens", self.max_prompt_tokens, minimum=1)


@dataclass(frozen=True)
class DynamicSamplingSettings:
    """DAPO dynamic sampling: groups whose rewards are all equal carry no signal and are dropped;
    the trainer samples more prompts to refill, at most ``max_rounds`` generation rounds per step."""

    enabled: bool = False
    max_rounds: int = 4

    def __post_init__(self) -> None:
        check_fields(self, "data.dynamic_sampling", ("enabled",))
        check_integer("data.dynamic_sampling.max_rounds", self.max_rounds, minimum=1)


@dataclass(frozen=True)
class OverlongSettings:
    """What happens to responses that hit the length limit: ``none``; ``filter`` (excluded from the
    loss, see ``rollouts.training_batch``); ``soft`` (DAPO's linear penalty over the last
    ``buffer_tokens`` before ``max_new_tokens``, reaching ``-penalty``; see
    ``filters.overlong_penalty``). With ``soft``, ``buffer_tokens`` must not
    exceed the rollout's ``max_new_tokens`` (checked when the job is loaded: ``job/config.py``)."""

    mode: Literal["none", "filter", "soft"] = "none"
    buffer_tokens: int = 256
    penalty: float = 1.0

    def __post_init__(self) -> None:
        check_fields(self, "data.overlong", ("mode",))
        check_integer("data.overlong.buffer_tokens", self.buffer_tokens, minimum=1)
        check_number("data.overlong.penalty", self.penalty)
        if self.penalty < 0:
            raise ConfigError("data.overlong.penalty", self.penalty, "must be >= 0 (it is subtracted from the reward)")


@dataclass(frozen=True)
class DataSettings:
    """The prompts of a job and how they are drawn.

    Each step takes ``prompts_per_step`` prompts from a ``PromptSampler`` over ``train``
    (reshuffled every epoch when ``shuffle``, seeded by ``seed``). ``eval`` is an optional held-out
    set; ``eval_size`` caps how many of its prompts (the first ones, in file order) an evaluation
    uses, and needs ``eval``.
    """

    train: DatasetSettings
    eval: Optional[DatasetSettings] = None
    prompts_per_step: int = 32
    shuffle: bool = True
    seed: int = 1
    dynamic_sampling: DynamicSamplingSettings = field(default_factory=DynamicSamplingSettings)
    overlong: OverlongSettings = field(default_factory=OverlongSettings)
    eval_size: Optional[int] = None

    def __post_init__(self) -> None:
        if not isinstance(self.train, DatasetSettings):
            raise ConfigError("data.train", self.train, "must be a DatasetSettings (set data.train.path or "
                              "data.train.synthetic)")
        self.train.validate("data.train")
        if self.eval is not None:
            if not isinstance(self.eval, DatasetSettings):
                raise ConfigError("data.eval", self.eval, "must be a DatasetSettings or unset")
            self.eval.validate("data.eval")
        check_integer("data.prompts_per_step", self.prompts_per_step, minimum=1)
        check_fields(self, "data", ("shuffle",))
        check_integer("data.seed", self.seed)
        if not isinstance(self.dynamic_sampling, DynamicSamplingSettings):
            raise ConfigError("data.dynamic_sampling", self.dynamic_sampling, "must be a DynamicSamplingSettings")
        if not isinstance(self.overlong, OverlongSettings):
            raise ConfigError("data.overlong", self.overlong, "must be an OverlongSettings")
        if self.eval_size is not None:
            check_integer("data.eval_size", self.eval_size, minimum=1)
            if self.eval is None:
                raise ConfigError("data.eval_size", self.eval_size, "needs data.eval (the held-out prompt set)")


@dataclass(frozen=True)
class RewardSettings:
    """How responses are scored. ``math``: 1.0 for a correct final answer (the last ``\\boxed{}``),
    ``format_score`` for a boxed answer that is wrong, 0.0 when none is found or the check runs
    past ``time_limit_s`` (enforced in worker processes). A synthetic task name scores with that
    task's own verifier (in-process; ``format_score`` and ``time_limit_s`` do not apply).
    ``math_checker``: who decides "correct" for ``math``: ``math_verify`` (Hugging Face's symbolic
    comparison; must be installed, ``pip install math-verify``) or ``builtin`` (this package's
    normalised string/number comparison of the boxed answer). A setting, not whatever is
    installed, so a run scores the same on every machine."""

    type: str = MATH_REWARD
    time_limit_s: float = 5.0
    format_score: float = 0.0
    math_checker: Literal["math_verify", "builtin"] = "math_verify"

    def __post_init__(self) -> None:
        check_fields(self, "reward", ("math_checker",))
        allowed = [MATH_REWARD, *_synthetic_tasks()]
        if self.type not in allowed:
            raise ConfigError("reward.type", self.type, f"must be one of {allowed}")
        check_number("reward.time_limit_s", self.time_limit_s, low=0.0, low_open=True)
        check_number("reward.format_score", self.format_score)
