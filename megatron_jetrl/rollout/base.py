"""The rollout engine interface: what the trainer and the weight sync ask of any engine.

    engine.wake()                                   # retake GPU memory (weights, KV cache)
    samples = engine.generate(prompts, sampling)    # n samples per prompt, with rollout logprobs
    engine.sleep()                                  # free GPU memory for the trainer
    engine.update_weights(tensors)                  # the sync's output, bucket by bucket

Tensor names are HF checkpoint names (``model.layers.3.self_attn.q_proj.weight``). An FP8 linear
weight arrives as its float8_e4m3fn codes under ``<name>.weight`` plus fp32 ``<name>.weight_scale_inv``
[ceil(N/128), ceil(K/128)] (the recipe's checkpoint layout); everything else in the model dtype.
With rollout TP > 1 each engine rank receives its own TP shard of every linear tensor (the shapes
``weight_specs()`` reports), and full tensors for embeddings, the LM head and norms.

Rollout logprobs are of the model's own next-token distribution (softmax of the raw logits,
before temperature, top-k and top-p: vLLM's ``logprobs_mode="raw_logprobs"``), so they compare
directly with the trainer's ``compute_logprobs``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Literal, Optional, Protocol, Sequence

import torch

from megatron_jetrl.config import ConfigError, check_integer

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``top_k <= 0`` and ``top_p == 1`` disable those filters; ``temperature == 0``
    is greedy. ``stop_token_ids`` end a sample (the stop token is part of the response).
    ``seed`` makes a call reproducible on the same engine and inputs. ``ignore_eos``: the trainer
    does not add the tokenizer's end-of-sequence token to the stops (responses run to
    ``max_new_tokens`` unless a listed stop ends them: a benchmark's fixed work)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        k = "rollout.sampling"
        if not isinstance(self.ignore_eos, bool):
            raise ConfigError(f"{k}.ignore_eos", self.ignore_eos, "must be true or false")
        check_integer(f"{k}.n", self.n, minimum=1)
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ConfigError(f"{k}.temperature", t, "must be a finite number >= 0 (0 = greedy)")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ConfigError(f"{k}.top_p", p, "must be in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ConfigError(f"{k}.top_k", self.top_k, "must be an integer (<= 0 disables top-k)")
        m = self.max_new_tokens
        check_integer(f"{k}.max_new_tokens", m, minimum=1)
        stops = tuple(self.stop_token_ids)
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in stops):
            raise ConfigError(f"{k}.stop_token_ids", self.stop_token_ids, "must be token ids (integers >= 0)")
        object.__setattr__(self, "stop_token_ids", stops)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ConfigError(f"{k}.seed", self.seed, "must be an integer or null")


@dataclass(frozen=True)
class Sample:
    """One response. ``tokens`` and ``logprobs`` have equal length; ``finish_reason`` is ``stop``
    when it ended on a stop token (included in ``tokens``) and ``length`` at max_new_tokens."""

    prompt_index: int
    tokens: list[int]
    logprobs: list[float]
    finish_reason: FinishReason


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype


class WeightMismatch(ValueError):
    """Tensors offered to an engine do not match what it holds; raised before anything is written."""


class RolloutEngine(Protocol):
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Sample]:
        """``n`` samples for every prompt, prompt-major: sample ``i * n + j`` is prompt ``i``'s ``j``-th."""
        ...

    def weight_specs(self) -> dict[str, TensorMeta]:
        """Every tensor ``update_weights`` accepts on this rank, with the shape and dtype it must have."""
        ...

    def update_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load named tensors (any subset of ``weight_specs()``; may be called once per bucket).
        The engine copies what it needs; the caller may free the tensors afterwards. A sleeping
        engine retakes its weight memory first (not the KV cache)."""
        ...

    def weight_buffers(self) -> dict[str, torch.Tensor]:
        """The engine's own tensors (a subset of ``weight_specs()`` names, plain contiguous buffers)
        that the weight sync writes in place instead of handing copies to ``update_weights``; empty
        for an engine that only takes handed-over tensors. The caller writes every returned tensor
        before the next ``generate``."""
        ...

    @property
    def weights_discarded(self) -> bool:
        """True when a sleep dropped the weights since the last full update: the next ``generate``
        needs every tensor of ``weight_specs()`` again (the trainer then syncs before it wakes the
        engine). Always False for an engine whose sleep keeps them."""
        ...

    def sleep(self) -> None:
        """Release GPU memory (KV cache dropped; weights kept off-GPU or dropped until the next
        ``update_weights``)."""
        ...

    def wake(self) -> None:
        """Retake all GPU memory; ``generate`` needs an awake engine."""
        ...

    def wake_bytes(self) -> Optional[int]:
        """GPU memory ``wake()`` may take at most, in bytes (0 when awake): what a colocated actor
        leaves free for it. None where the engine cannot bound it (the actor then leaves the GPU
        entirely)."""
        ...

    def close(self) -> None:
        ...


class MissingWeights:
    """Which weight tensors an engine has not received since its weights were created or dropped
    (a sleep that discards them): ``dropped`` marks all of ``required`` missing again, ``arrived``
    crosses names off, ``check`` refuses a ``generate`` while any is missing, naming some."""

    def __init__(self, engine: str, required: Iterable[str]):
        self.engine, self.required = engine, frozenset(required)
        self.names: set[str] = set(self.required)

    def __bool__(self) -> bool:
        return bool(self.names)

    def dropped(self) -> None:
        self.names = set(self.required)

    def arrived(self, names: Iterable[str]) -> None:
        self.names.difference_update(names)

    def check(self) -> None:
        if self.names:
            raise RuntimeError(f"{self.engine} engine: {len(self.names)} weight tensors were never loaded since the "
                               f"weights were created or dropped by a sleep (e.g. {sorted(self.names)[:3]}); "
                               "update_weights with all of weight_specs() (a weight sync) first")


def check_against_specs(specs: dict[str, TensorMeta], tensors: dict[str, TensorMeta], *, what: str) -> None:
    """Raise ``WeightMismatch`` naming the first tensor whose name, shape or dtype ``specs`` does not
    have, with both shapes."""
    for name, meta in tensors.items():
        expected = specs.get(name)
        if expected is None:
            close = sorted(s for s in specs if s.rsplit(".", 2)[-2:] == name.rsplit(".", 2)[-2:])[:3]
            raise WeightMismatch(f"{what}: tensor {name} {list(meta.shape)} is not in the engine"
                                 + (f" (similar: {close})" if close else ""))
        if tuple(expected.shape) != tuple(meta.shape) or expected.dtype != meta.dtype:
            raise WeightMismatch(f"{what}: tensor {name} is {list(meta.shape)} {meta.dtype}; the engine holds "
                                 f"{list(expected.shape)} {expected.dtype}")
