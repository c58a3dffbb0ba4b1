"""The CUDA RMSNorm kernel equals the torch reference computed on the CPU bit for bit, and a row's
bits do not depend on how many rows share the launch."""

import pytest
import torch

from megatron_jetrl.ops import cuda_kernels_available, load_extension
from megatron_jetrl.ops.rms_norm import add_rms_norm, rms_norm, rms_norm_reference
from tests.unit.test_rms_norm_kernel import DTYPES, assert_same_bits, weight_for, wide_range

pytestmark = pytest.mark.gpu

HIDDEN = [128, 4096, 5120]
ROWS = 8192


def test_extension_has_cuda_kernels():
    assert cuda_kernels_available(), "megatron_jetrl._C was built without CUDA; rebuild on the GPU host"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", HIDDEN)
@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_activations_match_cpu_reference(dtype, H, eps):
    g = torch.Generator().manual_seed(H)
    x = (torch.randn(ROWS, H, generator=g) * torch.rand(ROWS, 1, generator=g) * 8).to(dtype)
    w = weight_for(H, dtype, H)
    y = rms_norm(x.cuda(), w.cuda(), eps)
    assert_same_bits(y, rms_norm_reference(x, w, eps), f"{dtype} H={H} eps={eps}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", HIDDEN)
@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_wide_dynamic_range_matches_cpu_reference(dtype, H, eps):
    """Magnitudes 1e-3 .. 1e3 within a row: the case where a different summation order shows."""
    x = wide_range((ROWS, H), dtype, seed=H + 1)
    w = weight_for(H, dtype, H + 2)
    y = rms_norm(x.cuda(), w.cuda(), eps)
    assert_same_bits(y, rms_norm_reference(x, w, eps), f"{dtype} H={H} eps={eps}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", HIDDEN)
def test_row_bits_do_not_depend_on_the_number_of_rows(dtype, H):
    x = wide_range((ROWS, H), dtype, seed=H + 3).cuda()
    w = weight_for(H, dtype, H + 4).cuda()
    y = rms_norm(x, w, 1e-6)
    for i in (0, 1, 77, 4095, ROWS - 1):
        assert_same_bits(rms_norm(x[i : i + 1], w, 1e-6), y[i : i + 1], f"row {i} of a [1, H] call")
    for n in (2, 3, 31, 128, 257, 1000, 4097):
        assert_same_bits(rms_norm(x[:n], w, 1e-6), y[:n], f"first {n} rows")
    other = wide_range((ROWS, H), dtype, seed=H + 5).cuda()
    other[100] = x[5]
    assert_same_bits(rms_norm(other, w, 1e-6)[100], y[5], "row 5 among other rows")


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_on_cuda_equals_reference_on_cpu(dtype):
    x = wide_range((1024, 4096), dtype, seed=20)
    w = weight_for(4096, dtype, 21)
    assert_same_bits(rms_norm_reference(x.cuda(), w.cuda(), 1e-6), rms_norm_reference(x, w, 1e-6), "reference")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("eps", [1e-6, 1e-5, 0.0])
@pytest.mark.parametrize("H", [128, 4096])  # 128: the warp-a-row kernel of head-sized rows
def test_zero_and_nonfinite_rows_match_cpu_reference(dtype, eps, H):
    x = wide_range((65, H), dtype, seed=22)
    x[1] = 0.0
    x[2] = -0.0
    x[3, 17] = float("nan")
    x[4, H - 96] = float("inf")
    x[5] = torch.finfo(dtype).max
    w = weight_for(H, dtype, 23)
    y = rms_norm(x.cuda(), w.cuda(), eps)
    assert_same_bits(y, rms_norm_reference(x, w, eps), f"{dtype} eps={eps}")
    if eps > 0:
        assert not y[1:3].any() and not torch.isnan(y[1:3]).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_and_leading_dims(dtype):
    base = wide_range((300, 5120 + 256), dtype, seed=24)
    base_cuda = base.cuda()
    w = weight_for(5120, dtype, 25)
    views = [
        lambda b: b[:, 128 : 128 + 5120],
        lambda b: b[::3, :5120],
        lambda b: b[7, :5120].expand(50, 5120),
        lambda b: b[:, :5120].reshape(3, 100, 5120).transpose(0, 1),
    ]
    for view in views:
        x, xc = view(base), view(base_cuda)
        assert xc.stride() == x.stride() and not xc.is_contiguous()
        y = rms_norm(xc, w.cuda(), 1e-6)
        assert y.shape == x.shape and y.is_contiguous()
        assert_same_bits(y, rms_norm_reference(x, w, 1e-6), f"shape {tuple(x.shape)} strides {x.stride()}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_heads(dtype):
    """The trainer's q/k norms: head rows of 128 inside a packed QKV row (row stride 6,144)."""
    qkv = wide_range((301, 48 * 128), dtype, seed=28)
    w = weight_for(128, dtype, 29)
    x, xc = qkv[:, 128:256], qkv.cuda()[:, 128:256]
    assert_same_bits(rms_norm(xc, w.cuda(), 1e-6), rms_norm_reference(x, w, 1e-6), "a head's column block")
    heads, heads_c = qkv[:, : 40 * 128].view(301, 40, 128), qkv.cuda()[:, : 40 * 128].view(301, 40, 128)
    assert_same_bits(rms_norm(heads_c, w.cuda(), 1e-6), rms_norm_reference(heads, w, 1e-6), "q and k heads")


def test_unaligned_rows():
    buf = wide_range((257 * 4096 + 1,), torch.bfloat16, seed=26)
    x = buf[1:].view(257, 4096)
    w = weight_for(4096, torch.bfloat16, 27)
    xc = buf.cuda()[1:].view(257, 4096)
    assert xc.data_ptr() % 16 != 0
    assert_same_bits(rms_norm(xc, w.cuda(), 1e-6), rms_norm_reference(x, w, 1e-6), "unaligned")


def test_capturable_in_a_cuda_graph():
    x = torch.zeros(512, 4096, dtype=torch.bfloat16, device="cuda")
    w = weight_for(4096, torch.bfloat16, 28).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        rms_norm(x, w, 1e-6)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = rms_norm(x, w, 1e-6)
    fresh = wide_range((512, 4096), torch.bfloat16, seed=29)
    x.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert_same_bits(y, rms_norm_reference(fresh, w.cpu(), 1e-6), "graph replay")


def test_empty_input():
    y = rms_norm(torch.empty(0, 256, device="cuda"), torch.ones(256, device="cuda"), 1e-6)
    assert y.shape == (0, 256) and y.is_cuda


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: (torch.randn(4, 256, device="cuda"), torch.ones(256), 1e-6), "must be on x's device"),
        (lambda: (torch.randn(256, 4, device="cuda").t(), torch.ones(256, device="cuda"), 1e-6),
         "last dim must be contiguous"),
        (lambda: (torch.randn(4, 200, device="cuda"), torch.ones(200, device="cuda"), 1e-6), "multiple of 128"),
        (lambda: (torch.randn(4, 256, device="cuda", dtype=torch.float64),
                  torch.ones(256, device="cuda", dtype=torch.float64), 1e-6), "bfloat16, float16 or float32"),
    ],
)
def test_bad_input_is_rejected_with_a_clear_error(make, message):
    with pytest.raises(RuntimeError, match=message):
        load_extension().rms_norm(*make())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", HIDDEN)
def test_add_rms_norm_equals_the_add_then_the_norm(dtype, H):
    """The fused residual add: its sum is torch's add of the two tensors, its norm the kernel's norm of
    that sum, bit for bit; residual rows of another stride (a column slice), as vLLM may pass them."""
    x = wide_range((ROWS, H), dtype, seed=H + 30).cuda()
    wide = wide_range((ROWS, 2 * H), dtype, seed=H + 31).cuda()
    residual = wide[:, H:]
    w = weight_for(H, dtype, H + 32).cuda()
    y, total = add_rms_norm(x, residual, w, 1e-6)
    want_total = x + residual
    assert_same_bits(total, want_total, f"{dtype} H={H} sum")
    assert_same_bits(y, rms_norm(want_total, w, 1e-6), f"{dtype} H={H} norm")
    for i in (0, 77, ROWS - 1):  # a row alone: the same bits
        y1, t1 = add_rms_norm(x[i : i + 1], residual[i : i + 1], w, 1e-6)
        assert_same_bits(y1, y[i : i + 1], f"row {i} alone")
        assert_same_bits(t1, total[i : i + 1], f"row {i} alone, sum")


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_with_zero_and_nonfinite_values(dtype):
    x = wide_range((64, 4096), dtype, seed=40)
    r = wide_range((64, 4096), dtype, seed=41)
    x[1], r[1] = 0.0, -0.0
    x[3, 17] = float("nan")
    x[4, 4000], r[4, 4000] = float("inf"), float("-inf")
    x[5], r[5] = torch.finfo(dtype).max, torch.finfo(dtype).max
    w = weight_for(4096, dtype, 42)
    y, total = add_rms_norm(x.cuda(), r.cuda(), w.cuda(), 1e-6)
    assert_same_bits(total, (x.cuda() + r.cuda()), f"{dtype} sum")
    assert_same_bits(y, rms_norm(x.cuda() + r.cuda(), w.cuda(), 1e-6), f"{dtype} norm")
