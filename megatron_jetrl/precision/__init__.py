"""The precision contract, defined once: recipe, reference quantizer, FP8 linear, TE/vLLM settings.

Everything that touches FP8 weights (trainer FProp, rollout engine, weight sync, checkpoint
export) derives its bytes from ``quantize_fp8_blockwise`` and its settings from
``PrecisionRecipe``. This package imports torch only.
"""

from megatron_jetrl.precision.gemm import GEMM_BACKENDS, fp8_gemm, resolve_gemm_backend, scaled_mm_supported
from megatron_jetrl.precision.linear import (
    Fp8BlockLinear,
    Fp8Linear,
    Fp8Quantizer,
    Fp8Weight,
    Fp8WeightCache,
    ReferenceQuantizer,
    Shard,
    fp8_block_linear,
)
from megatron_jetrl.precision.blockwise import (
    E4M3_MAX,
    GROUP_1x128,
    NAN_CODE,
    WEIGHT_BLOCK,
    Fp8Tensor,
    dequantize_fp8_blockwise,
    quantize_fp8_blockwise,
    transpose_blocks,
)
from megatron_jetrl.precision.recipe import (
    Fp8Options,
    PrecisionMode,
    PrecisionRecipe,
    TeSettings,
    VllmSettings,
)

__all__ = [
    "E4M3_MAX",
    "GEMM_BACKENDS",
    "GROUP_1x128",
    "NAN_CODE",
    "WEIGHT_BLOCK",
    "Fp8BlockLinear",
    "Fp8Linear",
    "Fp8Options",
    "Fp8Quantizer",
    "Fp8Tensor",
    "Fp8Weight",
    "Fp8WeightCache",
    "PrecisionMode",
    "PrecisionRecipe",
    "ReferenceQuantizer",
    "Shard",
    "TeSettings",
    "VllmSettings",
    "dequantize_fp8_blockwise",
    "fp8_block_linear",
    "fp8_gemm",
    "quantize_fp8_blockwise",
    "resolve_gemm_backend",
    "scaled_mm_supported",
    "transpose_blocks",
]
