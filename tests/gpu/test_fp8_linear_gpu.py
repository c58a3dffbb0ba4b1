"""On Hopper: the native quantizer gives the reference's bytes; the blockwise scaled_mm GEMMs and the
whole Fp8BlockLinear equal the emulation within the GEMM's accumulation error."""

import hashlib
import os
import warnings

import pytest
import torch

from megatron_jetrl.ops import NativeQuantizer
from megatron_jetrl.precision import (
    Fp8WeightCache,
    ReferenceQuantizer,
    fp8_block_linear,
    fp8_gemm,
    quantize_fp8_blockwise,
)
from tests.helpers import assert_same_bytes

pytestmark = pytest.mark.gpu


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def test_native_quantizer_equals_reference_quantizer():
    x = torch.randn(1000, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(6144, 4096, device="cuda", dtype=torch.float32) * 0.02
    native, ref = NativeQuantizer(), ReferenceQuantizer()
    groups = [q.quantize_groups(x, rowwise=True, columnwise=True) for q in (native, ref)]
    for a, b in zip(*groups, strict=True):
        assert_same_bytes(a.data, b.data, "groups codes")
        assert_same_bytes(a.scale_inv, b.scale_inv, "groups scale_inv")
    nw, rw = native.quantize_weight(w), ref.quantize_weight(w)
    for part in ("fprop", "dgrad"):
        assert_same_bytes(getattr(nw, part).data, getattr(rw, part).data, f"{part} codes")
        assert_same_bytes(getattr(nw, part).scale_inv, getattr(rw, part).scale_inv, f"{part} scale_inv")


@pytest.mark.parametrize("b_block", [(128, 128), (1, 128)])
@pytest.mark.parametrize("mnk", [(256, 256, 256), (2048, 6144, 4096), (100, 256, 384), (7, 130, 200), (1000, 896, 896)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_scaled_mm_equals_emulation(hopper, b_block, mnk, out_dtype):
    M, N, K = mnk
    q = NativeQuantizer()
    a, _ = q.quantize_groups(torch.randn(M, K, device="cuda", dtype=torch.bfloat16), rowwise=True, columnwise=False)
    b_hp = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    if b_block == (128, 128):
        b = q.quantize_weight(b_hp).fprop
    else:
        b, _ = q.quantize_groups(b_hp, rowwise=True, columnwise=False)
    fast = fp8_gemm(a, b, out_dtype, "scaled_mm").float()
    emulated = (a.dequantize(torch.float64) @ b.dequantize(torch.float64).t())
    rel = ((fast.double() - emulated).norm() / emulated.norm()).item()
    # Hopper FP8 MMAs accumulate with reduced precision inside a 128-wide K block (measured
    # ~1.3e-4 relative on H200 even at K=256; cuBLAS promotes to fp32 between blocks), plus the
    # output rounding (bf16: ~2^-9 relative).
    bound = 4e-3 if out_dtype == torch.bfloat16 else 5e-4
    assert rel < bound, f"relative error {rel:.2e} vs exact product of the FP8 operands"


@pytest.mark.parametrize("shape", [(2, 1024, 4096, 6144), (1, 333, 896, 640)])
def test_linear_on_hopper_equals_emulation(hopper, shape):
    B, T, K, N = shape
    torch.manual_seed(0)
    x = torch.randn(B, T, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(N, K, device="cuda") * K**-0.5).requires_grad_()
    dy = torch.randn(B, T, N, device="cuda", dtype=torch.bfloat16)
    results = {}
    for gemm in ("scaled_mm", "emulate"):
        x.grad = w.grad = None
        y = fp8_block_linear(x, w, quantizer=NativeQuantizer(), gemm=gemm)
        y.backward(dy)
        results[gemm] = (y.float(), x.grad.float(), w.grad.float())
    for name, fast, emu in zip(("y", "dx", "dw"), results["scaled_mm"], results["emulate"], strict=True):
        rel = ((fast - emu).norm() / emu.norm()).item()
        assert rel < 4e-3, f"{name}: relative difference {rel:.2e} between scaled_mm and emulation"


def test_fprop_uses_exactly_the_cached_weight_bytes(hopper):
    """The bytes the trainer's FProp multiplies with are the quantizer's bytes of the current weight,
    shared by all micro-batches of a step, and refreshed after the optimizer step."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(1024, 512, device="cuda") * 0.05)
    cache, q = Fp8WeightCache(), NativeQuantizer()
    opt = torch.optim.SGD([w], lr=0.1)
    for _ in range(2):
        seen = []
        for _ in range(3):
            x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
            fp8_block_linear(x, w, quantizer=q, cache=cache).float().sum().backward()
            seen.append(cache.get(w, q).fprop)
        assert all(s is seen[0] for s in seen), "micro-batches of one step must share one quantization"
        data, scale = quantize_fp8_blockwise(w.detach(), (128, 128))
        assert _digest(seen[0].data) == _digest(data) and _digest(seen[0].scale_inv) == _digest(scale)
        opt.step()
        opt.zero_grad()
    assert _digest(cache.get(w, q).fprop.data) == _digest(quantize_fp8_blockwise(w.detach(), (128, 128))[0])


def test_linear_step_never_synchronizes_the_device(hopper):
    """A host-device sync in the linear would stall the pipeline every micro-batch."""
    x = torch.randn(333, 896, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(640, 896, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(333, 640, device="cuda", dtype=torch.bfloat16)
    cache, q = Fp8WeightCache(), NativeQuantizer()
    fp8_block_linear(x, w, quantizer=q, cache=cache).backward(dy)
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype feature")
        torch.cuda.set_sync_debug_mode("error")
    try:
        for c in (cache, None):
            fp8_block_linear(x, w, quantizer=q, cache=c).backward(dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _deep_gemm_or_skip():
    from megatron_jetrl.ops.deep_gemm import DeepGemmUnavailable, deep_gemm

    try:
        return deep_gemm()
    except DeepGemmUnavailable as e:
        if os.environ.get("JETRL_REQUIRE_VLLM") == "1":  # the GPU host's vLLM vendors DeepGEMM: it must import
            raise
        pytest.skip(f"{e} (actor.fp8_wgrad=deep_gemm is not tested here)")


@pytest.mark.parametrize("nkm", [(6144, 4096, 4096), (4096, 12288, 2048), (384, 256, 128)])
def test_deep_gemm_wgrad_accumulates_the_exact_product_into_the_main_grad(hopper, nkm):
    """``actor.fp8_wgrad=deep_gemm``: DeepGEMM's 1D1D kernel adds dyᵀ·x of the trainer's own WGrad
    operands (1x128 groups along the tokens) into an fp32 main grad, within the FP8 MMAs'
    accumulation error of the exact product, and a second call adds it again."""
    from megatron_jetrl.ops.deep_gemm import wgrad_into

    _deep_gemm_or_skip()
    N, K, M = nkm
    q = NativeQuantizer()
    dy, x = (torch.randn(M, n, device="cuda", dtype=torch.bfloat16) for n in (N, K))
    _, dy_col = q.quantize_groups(dy, rowwise=False, columnwise=True)
    _, x_col = q.quantize_groups(x, rowwise=False, columnwise=True)
    exact = dy_col.dequantize(torch.float64) @ x_col.dequantize(torch.float64).t()
    start = torch.randn(N, K, device="cuda", dtype=torch.float32)
    main = start.clone()
    wgrad_into(dy_col, x_col, main)
    rel = ((main.double() - start.double() - exact).norm() / exact.norm()).item()
    assert rel < 5e-4, f"relative error {rel:.2e} vs the exact product of the FP8 operands"
    wgrad_into(dy_col, x_col, main)
    rel2 = ((main.double() - start.double() - 2 * exact).norm() / (2 * exact).norm()).item()
    assert rel2 < 5e-4, f"after a second call: relative error {rel2:.2e}"
