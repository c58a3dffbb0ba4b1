"""The exact forward's elementwise CUDA kernels equal their eager torch references on CUDA bit for bit:
``silu_mul`` (megatron's SwiGLU: ``F.silu(gate) * up``, the value vLLM must compute in the exact mode)
``static_fp8_quant`` (an FP8 KV cache's query codes), the compiled cache values of the FP8 KV
backward and ``ordered_sum`` (the exact mode's TP reduction), over wide value ranges, special
values, odd shapes (the kernels' one-element path) and rows alone vs in a batch."""

import pytest
import torch
import torch.nn.functional as F

from megatron_jetrl.ops.exact import (ordered_sum, ordered_sum_reference, silu_mul, silu_mul_reference,
                                      static_fp8_quant, static_fp8_quant_reference)
from tests.unit.test_rms_norm_kernel import DTYPES, assert_same_bits

pytestmark = pytest.mark.gpu


def _values(shape, dtype, seed: int, spread: float = 8.0) -> torch.Tensor:
    """Normal values times magnitudes 10^(-4 .. 2): small, ordinary and large inputs of silu / exp."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, generator=g, device="cuda") * spread
    magnitude = 10 ** (torch.rand(shape, generator=g, device="cuda") * 6 - 4)
    return (x * magnitude).to(dtype)


def _same_codes(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """E4M3 codes equal byte for byte (NaN codes included: the kernel converts as torch does)."""
    a, e = actual.view(torch.uint8), expected.view(torch.uint8)
    diff = (a != e).nonzero()
    assert diff.numel() == 0, f"{what}: {diff.shape[0]} codes differ, first at {diff[0].tolist()}"


def _special(dtype) -> torch.Tensor:
    info = torch.finfo(dtype)
    return torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), info.max, -info.max, info.tiny,
                         -info.tiny, 88.0, -88.0, 100.0, -100.0, 1e-30, 20.0, -20.0], device="cuda").to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(4096, 12288), (333, 1536), (7, 100), (1, 12288)])
def test_silu_mul_equals_megatrons_eager_swiglu(dtype, rows, inter):
    x = _values((rows, 2 * inter), dtype, seed=rows + inter)
    gate, up = x.chunk(2, dim=-1)
    want = F.silu(gate) * up  # megatron's SwiGLU, eager
    assert_same_bits(silu_mul(x), want, f"{dtype} [{rows}, {2 * inter}]")
    assert_same_bits(silu_mul(x), silu_mul_reference(x), f"{dtype} [{rows}, {2 * inter}] reference")


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_special_values_and_strided_rows(dtype):
    s = _special(dtype)
    grid = torch.cartesian_prod(s.float(), s.float()).to(dtype)  # every (gate, up) pair of special values
    x = torch.cat([grid[:, :1].repeat(1, 8), grid[:, 1:].repeat(1, 8)], dim=1)  # [pairs, 16]
    assert_same_bits(silu_mul(x), silu_mul_reference(x), f"{dtype} special values")
    wide = _values((64, 3 * 4096), dtype, seed=5)
    rows = wide[:, : 2 * 4096]  # rows of a larger stride, as a slice of a wider output
    assert_same_bits(silu_mul(rows), silu_mul_reference(rows), f"{dtype} strided rows")
    batch = silu_mul(wide[:, : 2 * 4096].contiguous())
    assert_same_bits(silu_mul(wide[3:4, : 2 * 4096]), batch[3:4], f"{dtype} a row alone")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [1.0, 0.0173, 3.7e-3, 11.5])
def test_static_fp8_quant_equals_the_eager_ops(dtype, scale):
    x = _values((4096, 32 * 128), dtype, seed=int(scale * 1000), spread=4.0)
    s = torch.tensor([scale], device="cuda")
    _same_codes(static_fp8_quant(x, s), static_fp8_quant_reference(x, s), f"{dtype} scale {scale}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_static_fp8_quant_special_values_odd_shapes_and_scalar_scales(dtype):
    s = torch.tensor(0.25, device="cuda")  # a 0-d scale, as vLLM's layers hold it
    special = _special(dtype)
    _same_codes(static_fp8_quant(special, s), static_fp8_quant_reference(special, s), f"{dtype} special values")
    odd = _values((7, 3, 13), dtype, seed=9)  # 273 elements: the one-element path
    _same_codes(static_fp8_quant(odd, s), static_fp8_quant_reference(odd, s), f"{dtype} odd shape")
    x = _values((256, 4096), dtype, seed=10)
    _same_codes(static_fp8_quant(x[17:18], s), static_fp8_quant(x, s)[17:18], f"{dtype} a row alone")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_fp8_kv_backwards_cache_values_compiled_equal_the_eager_ops(dtype):
    """``fp8_cache_values`` on CUDA (one torch.compile kernel) against its eager ops: the cache's
    values and the in-range mask the FP8 KV attention's backward takes, at a micro-batch's q and at
    another token count (dynamic shapes), with special values."""
    from megatron_jetrl.actor.exact import cache_values_and_range, fp8_cache_values

    s = torch.tensor([2.5 / 448], device="cuda")
    for shape in ((8192, 32, 128), (777, 8, 128)):
        t = _values(shape, dtype, seed=shape[0], spread=2.0)
        t.view(-1)[:16] = _special(dtype)
        values, inside = fp8_cache_values(t, s)
        want_values, want_inside = cache_values_and_range(t, static_fp8_quant(t, s), s)
        assert_same_bits(values, want_values, f"{dtype} {shape} values")
        assert torch.equal(inside, want_inside), f"{dtype} {shape}: the in-range mask differs"
        assert (~inside).any() and inside.any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("shape", [(128, 4096), (333, 5120), (7, 9)])  # (7, 9): the one-element path
def test_ordered_sum_equals_its_eager_reference(dtype, tp, shape):
    """The TP ranks' partial results of very different magnitudes (so that the order and the rounding
    matter), special values among them; the kernel's sum equals the eager one bit for bit, and differs
    from a sum rounded to the dtype at every step (the negative control, above TP 2 in BF16)."""
    parts = torch.stack([_values(shape, dtype, seed=tp * 10 + r, spread=10.0 ** (r % 3)) for r in range(tp)])
    if parts.numel() >= 16:
        parts.view(-1)[:16] = _special(dtype)
    got, want = ordered_sum(parts), ordered_sum_reference(parts)
    assert got.shape == parts.shape[1:] and got.dtype == dtype
    assert_same_bits(got, want, f"ordered_sum {dtype} tp={tp} {shape}")
    if tp > 2 and dtype == torch.bfloat16 and shape[0] > 7:
        stepwise = parts[0]
        for part in parts[1:]:
            stepwise = stepwise + part
        assert not torch.equal(got, stepwise), "the negative control: a BF16 sum rounded at each step differs"
