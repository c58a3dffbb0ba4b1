"""The precision recipe: which dtype each phase computes in, and the FP8 block-scaling options.

One ``PrecisionRecipe`` per job. The trainer's native FP8 linear, the Transformer Engine backend,
the rollout engine's ``quantization_config`` and the FP8 checkpoint export are all derived from
it here, so no two places can disagree on block sizes, scale rounding or the layers kept in BF16.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal, Sequence

import torch

from megatron_jetrl.config import ConfigError, check_integer

class PrecisionMode(str, Enum):
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"
    BF16_TRAIN_FP8_ROLLOUT = "bf16-train+fp8-rollout"
    """Ablation only: the off-policy baseline that unified FP8 is measured against."""


@dataclass(frozen=True)
class Fp8Options:
    """FP8 block scaling. Block sizes are fixed by the kernels, TE and vLLM; they are fields so the
    contract is written down and validated rather than implied."""

    format: str = "e4m3"
    weight_block: tuple[int, int] = (128, 128)
    activation_group: tuple[int, int] = (1, 128)
    grad_group: tuple[int, int] = (1, 128)
    pow2_scales: bool = False
    """fp32 scales by default: on Hopper, power-of-two scales measurably raise mismatch."""
    amax_epsilon: float = 0.0
    bf16_first_layers: int = 0
    bf16_last_layers: int = 0

    def __post_init__(self) -> None:
        key = "precision.fp8"
        if self.format != "e4m3":
            raise ConfigError(f"{key}.format", self.format, "only 'e4m3' is supported (E5M2 gradients are not)")
        object.__setattr__(self, "weight_block", _as_pair(f"{key}.weight_block", self.weight_block))
        object.__setattr__(self, "activation_group", _as_pair(f"{key}.activation_group", self.activation_group))
        object.__setattr__(self, "grad_group", _as_pair(f"{key}.grad_group", self.grad_group))
        if self.weight_block != (128, 128):
            raise ConfigError(f"{key}.weight_block", list(self.weight_block), "must be [128, 128]")
        for name in ("activation_group", "grad_group"):
            if getattr(self, name) != (1, 128):
                raise ConfigError(f"{key}.{name}", list(getattr(self, name)), "must be [1, 128]")
        if not isinstance(self.pow2_scales, bool):
            raise ConfigError(f"{key}.pow2_scales", self.pow2_scales, "must be true or false")
        eps = self.amax_epsilon
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
            raise ConfigError(f"{key}.amax_epsilon", eps, "must be a finite number >= 0")
        object.__setattr__(self, "amax_epsilon", float(eps))
        for name in ("bf16_first_layers", "bf16_last_layers"):
            n = getattr(self, name)
            check_integer(f"{key}.{name}", n, minimum=0)


@dataclass(frozen=True)
class TeSettings:
    """What the te backend needs: ``env`` must be set by the launcher before TE is imported
    (TE reads NVTE_FP8_BLOCK_SCALING_FP32_SCALES at class definition); ``recipe_kwargs`` go to
    ``Float8BlockScaling`` (``qparams`` to its three ``QParams``); ``megatron_kwargs`` to
    ``TransformerConfig``."""

    env: dict[str, str]
    recipe_kwargs: dict[str, Any]
    qparams: dict[str, Any]
    megatron_kwargs: dict[str, Any]


@dataclass(frozen=True)
class VllmSettings:
    """What the vLLM engine needs: ``env`` before vLLM is imported (keep our fp32 scales instead
    of DeepGEMM's UE8M0 re-quantization), the ``quantization_config`` for the HF config it loads,
    and its ``dtype`` for everything not quantized."""

    env: dict[str, str]
    quantization_config: dict[str, Any] | None
    dtype: str


EXACT_MODES = (PrecisionMode.BF16, PrecisionMode.FP8)
"""The modes with an exact rollout: trainer and engine compute with the same weights in both."""


@dataclass(frozen=True)
class PrecisionRecipe:
    """``exact``: the rollout engine and the trainer's forward compute every op with the same
    kernel, so the engine's logprob of every sampled token equals the trainer's bit for bit
    (``ops/exact.py``, ``rollout/vllm_exact.py``, ``actor/exact.py``); the rollout's logprobs are
    then the old policy's. Other job settings it needs are checked with the job (``job/config.py``).
    ``exact_mismatch``: what a step does when the update's own forward finds a token whose logprob is
    not the rollout's (the exact rollout does not hold there: another vLLM, GPU or driver): ``stop``
    (the default) ends the job before that step's optimizer step, saving nothing; ``correct``
    recomputes the step's old logprobs, applies ``algo.correction`` and updates with those, saying so."""

    mode: PrecisionMode = PrecisionMode.FP8
    fp8: Fp8Options = field(default_factory=Fp8Options)
    exact: bool = False
    exact_mismatch: Literal["stop", "correct"] = "stop"
    exact_auto: str | None = field(default=None, init=False, repr=False)
    """Set by the job loader where ``precision.exact`` is ``auto`` (a job's default): "" when it chose
    the exact rollout, else why the job's layout cannot have one (a sentence); None where ``exact``
    was given (true or false, or in code)."""

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "mode", PrecisionMode(self.mode))
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in PrecisionMode)
            raise ConfigError("precision.mode", self.mode, f"must be one of {allowed}") from None
        if not isinstance(self.fp8, Fp8Options):
            raise ConfigError("precision.fp8", self.fp8, "must be an Fp8Options (the loader builds one from a mapping)")
        if not isinstance(self.exact, bool):
            raise ConfigError("precision.exact", self.exact, "must be true or false")
        if self.exact and self.mode not in EXACT_MODES:
            modes = " and ".join(m.value for m in EXACT_MODES)
            raise ConfigError("precision.exact", True, f"an exact rollout exists for precision.mode {modes}; "
                              f"mode {self.mode.value!r} has none (set precision.exact=false)")
        if self.exact_mismatch not in ("stop", "correct"):
            raise ConfigError("precision.exact_mismatch", self.exact_mismatch, "must be 'stop' or 'correct'")
        if self.exact_mismatch != "stop" and not self.exact:
            raise ConfigError("precision.exact_mismatch", self.exact_mismatch,
                              "says what an exact rollout does when exactness fails; set precision.exact=true, or "
                              "leave precision.exact_mismatch out")

    def chosen_automatically(self, why_not: str) -> "PrecisionRecipe":
        """This recipe as ``precision.exact: auto`` chose it: ``why_not`` empty where it chose the exact
        rollout, else the reason it did not."""
        out = dataclasses.replace(self)
        object.__setattr__(out, "exact_auto", why_not)
        return out

    def to_dict(self) -> dict[str, Any]:
        fp8 = dataclasses.asdict(self.fp8)
        for k in ("weight_block", "activation_group", "grad_group"):
            fp8[k] = list(fp8[k])
        return {"mode": self.mode.value, "fp8": fp8, "exact": self.exact, "exact_mismatch": self.exact_mismatch}

    @property
    def train_fp8(self) -> bool:
        return self.mode is PrecisionMode.FP8

    @property
    def rollout_fp8(self) -> bool:
        return self.mode in (PrecisionMode.FP8, PrecisionMode.BF16_TRAIN_FP8_ROLLOUT)

    @property
    def compute_dtype(self) -> torch.dtype:
        """dtype of activations, gradients between operators, and every non-FP8 GEMM."""
        return torch.float16 if self.mode is PrecisionMode.FP16 else torch.bfloat16

    @property
    def loss_scaling(self) -> bool:
        return self.mode is PrecisionMode.FP16

    def layer_in_fp8(self, layer: int, num_layers: int) -> bool:
        """Whether decoder layer ``layer`` (0-based, of ``num_layers``) runs its linears in FP8
        during training; the first/last ``bf16_*_layers`` stay in BF16."""
        if not 0 <= layer < num_layers:
            raise ValueError(f"layer {layer} out of range for {num_layers} layers")
        self._check_layers(num_layers)
        if not self.train_fp8:
            return False
        return self.fp8.bf16_first_layers <= layer < num_layers - self.fp8.bf16_last_layers

    def rollout_layer_in_fp8(self, layer: int, num_layers: int) -> bool:
        """Whether decoder layer ``layer`` runs its linears in FP8 during rollout (and so in the FP8
        export): every layer but the first/last ``bf16_*_layers``, when rollout is FP8."""
        if not 0 <= layer < num_layers:
            raise ValueError(f"layer {layer} out of range for {num_layers} layers")
        self._check_layers(num_layers)
        if not self.rollout_fp8:
            return False
        first, last = self.fp8.bf16_first_layers, self.fp8.bf16_last_layers
        return first <= layer < num_layers - last

    def _check_layers(self, num_layers: int) -> None:
        if self.fp8.bf16_first_layers + self.fp8.bf16_last_layers > num_layers:
            raise ConfigError(
                "precision.fp8.bf16_first_layers",
                (self.fp8.bf16_first_layers, self.fp8.bf16_last_layers),
                f"bf16_first_layers + bf16_last_layers must be <= num_layers ({num_layers})",
            )

    @property
    def te_env(self) -> dict[str, str]:
        """The environment Transformer Engine must be imported with for this recipe's scales (TE reads
        its block-scaling scale format once, at import)."""
        return {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "0" if self.fp8.pow2_scales else "1"}

    def te_settings(self, num_layers: int) -> TeSettings | None:
        """Transformer Engine ``Float8BlockScaling`` settings equal to this recipe; None when
        training does not run in FP8."""
        if not self.train_fp8:
            return None
        self._check_layers(num_layers)
        q = {"power_2_scale": self.fp8.pow2_scales, "amax_epsilon": self.fp8.amax_epsilon}
        first, last = self.fp8.bf16_first_layers, self.fp8.bf16_last_layers
        megatron = {"fp8": "e4m3", "fp8_recipe": "blockwise", "first_last_layers_bf16": bool(first or last)}
        if first or last:
            megatron.update(num_layers_at_start_in_bf16=first, num_layers_at_end_in_bf16=last)
        return TeSettings(
            env=self.te_env,
            recipe_kwargs={
                "fp8_format": "E4M3",
                "x_block_scaling_dim": 1,
                "w_block_scaling_dim": 2,
                "grad_block_scaling_dim": 1,
            },
            qparams={"fp8_quant_fwd_inp": q, "fp8_quant_fwd_weight": dict(q), "fp8_quant_bwd_grad": dict(q)},
            megatron_kwargs=megatron,
        )

    def quantization_config(
        self,
        num_layers: int,
        *,
        linear_names: Sequence[str],
        layer_prefix: str = "model.layers",
    ) -> dict[str, Any] | None:
        """The HF / vLLM ``quantization_config`` of an FP8 block checkpoint of this recipe (the
        DeepSeek-V3 / Qwen-FP8 layout), or None when rollout is not FP8.

        Layers kept in BF16 are listed by module name under both ``ignored_layers`` (vLLM) and
        ``modules_to_not_convert`` (transformers): ``linear_names`` of each such layer (the model's
        fact: ``ModelBridge.linear_names``).
        """
        if not self.rollout_fp8:
            return None
        self._check_layers(num_layers)
        config: dict[str, Any] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(self.fp8.weight_block),
        }
        skipped = [
            f"{layer_prefix}.{i}.{name}"
            for i in range(num_layers)
            if not self.rollout_layer_in_fp8(i, num_layers)
            for name in linear_names
        ]
        if skipped:
            config["ignored_layers"] = skipped
            config["modules_to_not_convert"] = list(skipped)
        return config

    @property
    def vllm_env(self) -> dict[str, str]:
        """The environment vLLM must see for this recipe: DeepGEMM's scale format (FP8 rollout), and
        vLLM's batch-invariant mode and its V2 model runner (whose logprob kernel the trainer calls)
        for an exact rollout."""
        env = {"VLLM_USE_DEEP_GEMM_E8M0": "1" if self.fp8.pow2_scales else "0"} if self.rollout_fp8 else {}
        if self.exact:
            env.update(VLLM_BATCH_INVARIANT="1", VLLM_USE_V2_MODEL_RUNNER="1")
        return env

    def vllm_settings(self, num_layers: int, *, linear_names: Sequence[str],
                      layer_prefix: str = "model.layers") -> VllmSettings:
        dtype = "float16" if self.mode is PrecisionMode.FP16 else "bfloat16"
        config = self.quantization_config(num_layers, linear_names=linear_names, layer_prefix=layer_prefix)
        return VllmSettings(env=self.vllm_env, quantization_config=config, dtype=dtype)


def _as_pair(key: str, value: Any) -> tuple[int, int]:
    if not isinstance(value, (tuple, list)) or len(value) != 2 or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise ConfigError(key, value, "must be a pair of integers, e.g. [128, 128]")
    return int(value[0]), int(value[1])
