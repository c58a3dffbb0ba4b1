"""The emulated FP8 linear (CPU): every GEMM equals a float64 product of the operands quantized as
the recipe says, up to fp32 accumulation and output rounding.

The float64 reference is built here from ``quantize_fp8_blockwise``; it names which operand is
quantized along which dimension, so a wrong grouping in the linear (e.g. WGrad grouped along K
instead of tokens) shows up as an error far above the tolerance.
"""

import pytest
import torch

from megatron_jetrl.ops import NativeQuantizer
from megatron_jetrl.precision import (
    Fp8Linear,
    Fp8Tensor,
    Fp8WeightCache,
    ReferenceQuantizer,
    dequantize_fp8_blockwise,
    fp8_block_linear,
    fp8_gemm,
    quantize_fp8_blockwise,
    resolve_gemm_backend,
)
from tests.helpers import assert_same_bytes

CPU = torch.device("cpu")
BF16_ROUNDING = 2.0**-8
NORM_TOLERANCE = 4e-3


def _deq64(x: torch.Tensor, block) -> torch.Tensor:
    """x quantized with ``block`` and dequantized in float64."""
    data, scale_inv = quantize_fp8_blockwise(x, block)
    return dequantize_fp8_blockwise(data, scale_inv, block, dtype=torch.float64)


def _reference(x, w, b, dy):
    """Forward and gradients of the FP8 linear in float64, from the quantization recipe."""
    K = x.shape[-1]
    x2, dy2 = x.reshape(-1, K), dy.reshape(-1, dy.shape[-1])
    w_q = _deq64(w.detach(), (128, 128))
    y = _deq64(x2, (1, 128)) @ w_q.t()
    if b is not None:
        y = y + b.detach().double()
    dx = _deq64(dy2, (1, 128)) @ w_q
    dw = _deq64(dy2.t(), (1, 128)) @ _deq64(x2.t(), (1, 128)).t()
    db = dy2.double().sum(0)
    return y.reshape(*x.shape[:-1], -1), dx.reshape(x.shape), dw, db


def _assert_close(actual, expected, what):
    """Elementwise rtol 1e-2 (bf16 output rounding is 2^-8) with a small absolute floor for
    cancellations, and a norm-relative error < 4e-3."""
    a = actual.detach().double()
    assert a.shape == expected.shape, f"{what}: shape {tuple(a.shape)} != {tuple(expected.shape)}"
    err = (a - expected).abs()
    atol = 1e-3 * expected.abs().max().item()
    assert (err <= 1e-2 * expected.abs() + atol).all(), f"{what}: max error {err.max().item():.3g}"
    rel = _norm_relative_error(a, expected)
    assert rel < NORM_TOLERANCE, f"{what}: norm-relative error {rel:.3g}"


def _norm_relative_error(actual, expected) -> float:
    return (torch.linalg.vector_norm(actual.detach().double() - expected) / torch.linalg.vector_norm(expected)).item()


def _inputs(x_shape, n, w_dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = x_shape[-1]
    x = torch.randn(x_shape, generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(w_dtype).requires_grad_()
    b = (torch.randn(n, generator=g) * 0.1).to(w_dtype).requires_grad_() if bias else None
    dy = torch.randn(*x_shape[:-1], n, generator=g).to(torch.bfloat16)
    return x, w, b, dy


def _record_quantizer_calls(quantizer):
    calls = []
    original = quantizer.quantize_groups

    def quantize_groups(x, *, rowwise, columnwise):
        calls.append((tuple(x.shape), rowwise, columnwise))
        return original(x, rowwise=rowwise, columnwise=columnwise)

    quantizer.quantize_groups = quantize_groups
    return calls


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b_block", [(128, 128), (1, 128)])
def test_fp8_gemm_equals_float64_product_of_dequantized_operands(out_dtype, b_block):
    """Error bound: fp32 dequantization and K-term fp32 accumulation, (K+2)·2^-24·(|A|·|B|ᵀ),
    plus the output rounding (2^-8 relative for bf16)."""
    g = torch.Generator().manual_seed(1)
    a_x = torch.randn(70, 300, generator=g).to(torch.bfloat16)
    b_x = torch.randn(150, 300, generator=g).to(torch.bfloat16)
    a = Fp8Tensor(*quantize_fp8_blockwise(a_x, (1, 128)), (1, 128))
    b = Fp8Tensor(*quantize_fp8_blockwise(b_x, b_block), b_block)
    out = fp8_gemm(a, b, out_dtype, "emulate")
    assert out.dtype == out_dtype and out.shape == (70, 150)
    A = dequantize_fp8_blockwise(a.data, a.scale_inv, (1, 128), dtype=torch.float64)
    B = dequantize_fp8_blockwise(b.data, b.scale_inv, b_block, dtype=torch.float64)
    ref = A @ B.t()
    bound = (300 + 2) * 2.0**-24 * (A.abs() @ B.abs().t())
    if out_dtype == torch.bfloat16:
        bound = bound * (1 + BF16_ROUNDING) + BF16_ROUNDING * ref.abs()
    assert ((out.double() - ref).abs() <= bound).all()


def test_fp8_gemm_rejects_bad_operands():
    a = Fp8Tensor(*quantize_fp8_blockwise(torch.randn(4, 256), (1, 128)), (1, 128))
    w = Fp8Tensor(*quantize_fp8_blockwise(torch.randn(8, 256), (128, 128)), (128, 128))
    w_short = Fp8Tensor(*quantize_fp8_blockwise(torch.randn(8, 128), (128, 128)), (128, 128))
    with pytest.raises(ValueError, match="operand a must have 1x128 groups"):
        fp8_gemm(w, a, torch.float32, "emulate")
    with pytest.raises(ValueError, match=r"contraction dims differ: a \(4, 256\), b \(8, 128\)"):
        fp8_gemm(a, w_short, torch.float32, "emulate")
    odd = Fp8Tensor(w.data, w.scale_inv, (128, 64))
    with pytest.raises(ValueError, match="operand b must have 1x128 groups or 128x128 blocks"):
        fp8_gemm(a, odd, torch.float32, "emulate")


@pytest.mark.parametrize(
    "x_shape, n",
    [((64, 256), 384), ((2, 37, 200), 150), ((3, 5, 130), 129), ((1, 1), 1)],
)
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_forward_and_gradients_match_float64_reference(x_shape, n, w_dtype, bias):
    x, w, b, dy = _inputs(x_shape, n, w_dtype, bias)
    y = fp8_block_linear(x, w, b, quantizer=ReferenceQuantizer(), gemm="emulate")
    assert y.dtype == torch.bfloat16 and y.shape == (*x_shape[:-1], n)
    y.backward(dy)
    y_ref, dx_ref, dw_ref, db_ref = _reference(x, w, b, dy)
    _assert_close(y, y_ref, "y")
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == w_dtype
    _assert_close(x.grad, dx_ref, "dx")
    _assert_close(w.grad, dw_ref, "dW")
    if bias:
        assert b.grad.dtype == w_dtype
        _assert_close(b.grad, db_ref, "db")


def test_tolerance_rejects_other_quantization_choices():
    """The comparisons above would catch a linear that skipped quantization, grouped WGrad's
    operands along K instead of tokens, or quantized W in 1x128 groups: each of those is an
    order of magnitude outside the tolerance."""
    x, w, _, dy = _inputs((256, 256), 128, torch.float32, False, seed=3)
    y = fp8_block_linear(x, w, quantizer=ReferenceQuantizer(), gemm="emulate")
    y.backward(dy)
    x2, w2 = x.detach(), w.detach()
    y_ref, dx_ref, dw_ref, _ = _reference(x, w, None, dy)
    _assert_close(y, y_ref, "y")
    _assert_close(x.grad, dx_ref, "dx")
    _assert_close(w.grad, dw_ref, "dW")
    wrong = {
        "y without quantization": (y, x2.double() @ w2.double().t()),
        "y with 1x128 weight groups": (y, _deq64(x2, (1, 128)) @ _deq64(w2, (1, 128)).t()),
        "dx without quantization": (x.grad, dy.double() @ w2.double()),
        "dW grouped along K": (w.grad, _deq64(dy, (1, 128)).t() @ _deq64(x2, (1, 128))),
        "dW without quantization": (w.grad, dy.double().t() @ x2.double()),
    }
    for what, (actual, expected) in wrong.items():
        assert _norm_relative_error(actual, expected) > 5 * NORM_TOLERANCE, what


def test_weight_without_grad_skips_wgrad():
    x, w, b, dy = _inputs((2, 9, 200), 150, torch.float32, True)
    w.requires_grad_(False)
    q = ReferenceQuantizer()
    calls = _record_quantizer_calls(q)
    y = fp8_block_linear(x, w, b, quantizer=q, gemm="emulate")
    y.backward(dy)
    assert calls == [((18, 200), True, False), ((18, 150), True, False)]
    assert w.grad is None
    y_ref, dx_ref, _, db_ref = _reference(x, w, b, dy)
    _assert_close(y, y_ref, "y")
    _assert_close(x.grad, dx_ref, "dx")
    _assert_close(b.grad, db_ref, "db")


def test_input_without_grad_skips_dgrad():
    x, w, _, dy = _inputs((40, 200), 150, torch.float32, False)
    x.requires_grad_(False)
    q = ReferenceQuantizer()
    calls = _record_quantizer_calls(q)
    fp8_block_linear(x, w, quantizer=q, gemm="emulate").backward(dy)
    assert calls == [((40, 200), True, True), ((40, 150), False, True)]
    assert x.grad is None
    _assert_close(w.grad, _reference(x, w, None, dy)[2], "dW")


def _emulated_wgrad_into(calls: list):
    """A ``WgradInto`` for the CPU: the emulated WGrad product (fp32) added to ``main``."""

    def wgrad_into(dy_col, x_col, main):
        calls.append((tuple(dy_col.data.shape), tuple(x_col.data.shape), tuple(main.shape)))
        main.add_(fp8_gemm(dy_col, x_col, torch.float32, "emulate"))

    return wgrad_into


def test_wgrad_into_the_main_grad_where_the_weight_has_one():
    """With ``wgrad_into`` and megatron's fp32 ``main_grad`` on the weight, the WGrad accumulates
    there over micro-batches (megatron's fused-WGrad convention: ``grad_added_to_main_grad`` set,
    the weight's ``grad`` a placeholder its DDP hook does not add); a weight without one gets the
    ordinary dW. The sum is the ordinary dW's, without its rounding to the weight's dtype."""
    x, w, _, dy = _inputs((2, 128, 256), 384, torch.bfloat16, False)
    q = ReferenceQuantizer()
    plain = fp8_block_linear(x, w, quantizer=q, gemm="emulate")
    plain.backward(dy)
    want = w.grad.float().clone()
    w.grad = None

    calls: list = []
    w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
    for _ in range(2):  # two micro-batches into one main grad
        fp8_block_linear(x, w, quantizer=q, gemm="emulate", wgrad_into=_emulated_wgrad_into(calls)).backward(dy)
    assert calls == [((384, 256), (256, 256), (384, 256))] * 2
    assert w.grad_added_to_main_grad is True and w.grad.shape == w.shape
    _assert_close(w.main_grad, 2 * want, "main_grad after two micro-batches")

    del w.main_grad
    w.grad = None
    fp8_block_linear(x, w, quantizer=q, gemm="emulate", wgrad_into=_emulated_wgrad_into(calls)).backward(dy)
    assert len(calls) == 2 and torch.equal(w.grad.float(), want)  # no main grad: the ordinary dW


def test_backward_twice_with_retain_graph():
    """Like torch.nn.functional.linear, a retained graph can be differentiated again; the
    gradients accumulate to exactly twice the first ones."""
    x, w, b, dy = _inputs((16, 200), 150, torch.float32, True)
    y = fp8_block_linear(x, w, b, quantizer=ReferenceQuantizer(), gemm="emulate")
    y.backward(dy, retain_graph=True)
    first = [t.grad.clone() for t in (x, w, b)]
    y.backward(dy)
    for t, g, what in zip((x, w, b), first, ("dx", "dW", "db"), strict=True):
        assert torch.equal(t.grad, g + g), what


def test_weight_cache_reuses_until_the_weight_changes():
    w = torch.randn(150, 200, requires_grad=True)
    q = ReferenceQuantizer()
    cache = Fp8WeightCache()
    first = cache.get(w, q)
    assert cache.get(w, q) is first
    with torch.no_grad():
        w.add_(1)
    second = cache.get(w, q)
    assert second is not first
    data, scale_inv = quantize_fp8_blockwise(w.detach(), (128, 128))
    assert_same_bytes(second.fprop.data, data, "re-quantized codes")
    assert_same_bytes(second.fprop.scale_inv, scale_inv, "re-quantized scales")
    assert cache.get(w, q) is second
    cache.invalidate()
    third = cache.get(w, q)
    assert third is not second
    assert_same_bytes(third.fprop.data, data, "codes after invalidate")
    assert cache.get(w, ReferenceQuantizer(pow2_scales=True)) is not third


def test_weight_cache_sees_a_replaced_data_tensor():
    """Assigning ``.data`` changes the storage, which the cache key includes."""
    w = torch.nn.Parameter(torch.randn(64, 128))
    q = ReferenceQuantizer()
    cache = Fp8WeightCache()
    first = cache.get(w, q)
    w.data = torch.randn(64, 128) * 5
    second = cache.get(w, q)
    assert second is not first
    assert_same_bytes(second.fprop.data, quantize_fp8_blockwise(w.detach(), (128, 128))[0], "codes after .data=")


def test_linear_with_cache_is_fresh_after_optimizer_step():
    x, w, _, dy = _inputs((16, 200), 150, torch.float32, False)
    w = torch.nn.Parameter(w.detach())
    q = ReferenceQuantizer()
    cache = Fp8WeightCache()
    opt = torch.optim.SGD([w], lr=0.5)
    fp8_block_linear(x, w, quantizer=q, cache=cache, gemm="emulate").backward(dy)
    quantized_before = cache.get(w, q)
    opt.step()
    y = fp8_block_linear(x, w, quantizer=q, cache=cache, gemm="emulate")
    assert cache.get(w, q) is not quantized_before
    expected = fp8_block_linear(x, w, quantizer=q, gemm="emulate")
    assert torch.equal(y, expected)


def test_fp8_linear_module_matches_function():
    torch.manual_seed(0)
    m = Fp8Linear(200, 150, bias=True, quantizer=ReferenceQuantizer(), gemm="emulate")
    assert m.weight.shape == (150, 200) and m.bias.shape == (150,)
    assert {n for n, _ in m.named_parameters()} == {"weight", "bias"}
    x, _, _, dy = _inputs((2, 9, 200), 150, torch.float32, False)
    y = m(x)
    y.backward(dy)
    fp8_w = m.cache.get(m.weight, m.quantizer)
    assert m(x.detach()) is not None and m.cache.get(m.weight, m.quantizer) is fp8_w

    x2 = x.detach().clone().requires_grad_()
    w2 = m.weight.detach().clone().requires_grad_()
    b2 = m.bias.detach().clone().requires_grad_()
    y2 = fp8_block_linear(x2, w2, b2, quantizer=ReferenceQuantizer(), gemm="emulate")
    y2.backward(dy)
    assert torch.equal(y, y2)
    assert torch.equal(x.grad, x2.grad)
    assert torch.equal(m.weight.grad, w2.grad)
    assert torch.equal(m.bias.grad, b2.grad)
    y_ref, dx_ref, dw_ref, db_ref = _reference(x, m.weight, m.bias, dy)
    _assert_close(y, y_ref, "module y")
    _assert_close(m.weight.grad, dw_ref, "module dW")


def test_fp8_linear_module_without_bias():
    m = Fp8Linear(128, 64, quantizer=ReferenceQuantizer(), gemm="emulate", dtype=torch.bfloat16)
    assert m.bias is None and m.weight.dtype == torch.bfloat16
    x = torch.randn(8, 128, dtype=torch.bfloat16)
    _assert_close(m(x), _reference(x, m.weight, None, torch.zeros(8, 64))[0], "y")


def test_non_contiguous_input():
    x, w, _, dy = _inputs((40, 200), 150, torch.float32, False)
    xt = x.detach().t().contiguous().t().requires_grad_()
    assert not xt.is_contiguous()
    y = fp8_block_linear(xt, w, quantizer=ReferenceQuantizer(), gemm="emulate")
    y.backward(dy)
    y_ref, dx_ref, _, _ = _reference(x, w, None, dy)
    _assert_close(y, y_ref, "y")
    _assert_close(xt.grad, dx_ref, "dx")


@pytest.mark.parametrize(
    "x_shape, w_shape, b_shape, match",
    [
        ((4, 128), (2, 64, 128), None, r"weight must be 2-D \[N, K\]; got shape \(2, 64, 128\)"),
        ((4, 100), (64, 128), None, r"x's last dim 100 does not match weight in_features 128"),
        ((4, 128), (64, 128), (63,), r"bias must be \[64\]; got shape \(63,\)"),
        ((4, 128), (64, 128), (1, 64), r"bias must be \[64\]; got shape \(1, 64\)"),
    ],
)
def test_bad_inputs_raise_value_error(x_shape, w_shape, b_shape, match):
    b = None if b_shape is None else torch.zeros(b_shape)
    with pytest.raises(ValueError, match=match):
        fp8_block_linear(torch.zeros(x_shape), torch.zeros(w_shape), b, quantizer=ReferenceQuantizer(), gemm="emulate")


def test_gemm_backend_resolution_on_cpu():
    assert resolve_gemm_backend("auto", CPU) == "emulate"
    assert resolve_gemm_backend("emulate", CPU) == "emulate"
    with pytest.raises(RuntimeError, match="Hopper"):
        resolve_gemm_backend("scaled_mm", CPU)
    with pytest.raises(ValueError, match=r"gemm backend must be one of.*'cublas'"):
        resolve_gemm_backend("cublas", CPU)
    x = torch.randn(4, 128)
    w = torch.randn(8, 128)
    with pytest.raises(RuntimeError, match="Hopper"):
        fp8_block_linear(x, w, quantizer=ReferenceQuantizer(), gemm="scaled_mm")
    auto = fp8_block_linear(x, w, quantizer=ReferenceQuantizer(), gemm="auto")
    assert torch.equal(auto, fp8_block_linear(x, w, quantizer=ReferenceQuantizer(), gemm="emulate"))


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_reference_and_native_quantizers_give_identical_linears(pow2, w_dtype):
    outs = []
    for quantizer in (ReferenceQuantizer(pow2_scales=pow2), NativeQuantizer(pow2_scales=pow2)):
        x, w, b, dy = _inputs((3, 50, 200), 150, w_dtype, True, seed=9)
        y = fp8_block_linear(x, w, b, quantizer=quantizer, cache=Fp8WeightCache(), gemm="emulate")
        y.backward(dy)
        outs.append((y, x.grad, w.grad, b.grad))
    for ref, native, what in zip(*outs, ("y", "dx", "dW", "db"), strict=True):
        assert torch.equal(ref, native), what
