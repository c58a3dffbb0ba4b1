"""DeepGEMM's WGrad for the native FP8 linears (``actor.fp8_wgrad: deep_gemm``).

WGrad contracts over the tokens with 1x128 groups along them on both operands (``precision/linear.py``).
torch's blockwise ``scaled_mm`` runs that "1x128 x 1x128" GEMM at about 1.23x BF16, the slowest of
the three FP8 GEMMs (docs/benchmarks.md). DeepGEMM's SM90 1D1D kernel takes the same operands and
scales and accumulates in fp32 into its output, which here is megatron's fp32 ``main_grad``. So it
also replaces the separate fp32 add that megatron's DDP hook makes of a BF16 dW. Numerics: dW is no
longer rounded to BF16 before that add. The sum is otherwise the same (per-128-token partial
products, fp32 accumulation), in DeepGEMM's order.

DeepGEMM comes from a pip install or the copy vLLM vendors (``vllm.third_party.deep_gemm``); it
JIT-compiles its kernels on first use (cached under ``DG_JIT_CACHE_DIR``). Hopper only.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch

from megatron_jetrl.precision import Fp8Tensor

SOURCES = ("deep_gemm", "vllm.third_party.deep_gemm")
"""Where DeepGEMM is imported from, in order."""

RECIPE_1D1D = (1, 1, 128)
"""DeepGEMM's (m, n, k) scale granularity: 1x128 groups along K on both operands."""


class DeepGemmUnavailable(RuntimeError):
    """DeepGEMM cannot be imported, or has no FP8 GEMM."""


@functools.lru_cache(maxsize=None)
def deep_gemm() -> ModuleType:
    """The DeepGEMM module (``SOURCES``), or an error naming what each source said."""
    reasons = []
    for name in SOURCES:
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            reasons.append(f"{name}: {e}")
            continue
        if hasattr(module, "fp8_gemm_nt"):
            return module
        reasons.append(f"{name} has no fp8_gemm_nt")
    raise DeepGemmUnavailable("DeepGEMM is not importable (" + "; ".join(reasons) + "): pip install deep_gemm, or "
                              "use the vLLM build that vendors it")


def wgrad_into(dy_col: Fp8Tensor, x_col: Fp8Tensor, main: torch.Tensor) -> None:
    """``main += dyᵀ·x`` in place: ``main`` [N, K] fp32 (contiguous) accumulates ``dy_col.data``
    [N, M] times ``x_col.data`` [K, M] transposed, both with 1x128 fp32 scales along the tokens M
    (a multiple of 128), through DeepGEMM's SM90 1D1D kernel (``precision.linear.WgradInto``)."""
    if main.dtype != torch.float32 or not main.is_contiguous():
        raise ValueError(f"wgrad_into: main must be contiguous fp32; got {main.dtype} with strides {main.stride()}")
    deep_gemm().fp8_gemm_nt((dy_col.data, dy_col.scale_inv), (x_col.data, x_col.scale_inv), main, c=main,
                            recipe=RECIPE_1D1D, disable_ue8m0_cast=True)
