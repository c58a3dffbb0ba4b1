"""Shared test helpers: byte comparison and hand-made adversarial inputs."""

from __future__ import annotations

import torch


def assert_same_bytes(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Codes equal byte for byte; fp32 scales equal bit for bit, NaN where the other has NaN
    (NaN payloads carry no meaning and are not compared)."""
    assert tuple(actual.shape) == tuple(expected.shape), f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a, e = actual.detach().cpu().contiguous(), expected.detach().cpu().contiguous()
    if a.dtype == torch.float8_e4m3fn:
        diff = (a.view(torch.uint8) != e.view(torch.uint8)).nonzero()
        assert diff.numel() == 0, f"{what}: {diff.shape[0]} codes differ, first at {diff[0].tolist()}"
        return
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    assert torch.equal(nan_a, nan_e), f"{what}: NaN positions differ"
    bits_a = a.masked_fill(nan_a, 0).view(torch.int32)
    bits_e = e.masked_fill(nan_e, 0).view(torch.int32)
    diff = (bits_a != bits_e).nonzero()
    assert diff.numel() == 0, (
        f"{what}: {diff.shape[0]} values differ, first at {diff[0].tolist()}: "
        f"{a[tuple(diff[0])].item()!r} vs {e[tuple(diff[0])].item()!r}"
    )


E4M3_BOUNDARY_VALUES = [
    448.0, -448.0, 416.0, 432.0, 440.0,  # the largest codes and the 416|448 midpoint 432
    1.0, 1.0625, 1.125, 1.1875,  # 1.0625 is the 1.0/1.125 midpoint: ties to even (1.0)
    2.0 ** -6, 2.0 ** -7, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -11,  # e4m3 subnormal range
    0.0, -0.0,
]


def adversarial_matrix(dtype: torch.dtype) -> torch.Tensor:
    """A [259, 389] matrix (partial tail blocks on both dims) holding the cases the quantizer must
    get exactly right: an all-zero 128x128 block, the dtype's largest finite value, a block whose
    amax is so small that 448/amax overflows fp32 (or nearly), subnormals next to normals, exact
    e4m3 grid values and ties with amax exactly 448, and NaN, +Inf, -Inf in different blocks."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(259, 389, generator=g, dtype=torch.float32)
    info = torch.finfo(dtype)
    x[0:128, 0:128] = 0.0
    x[0:64:2, 0:128] = -0.0
    x[130, 5] = info.max
    x[131, 0:128] = info.max / 3
    tiny = info.smallest_normal * info.eps  # the smallest subnormal of dtype
    x[128:256, 128:256] = tiny * torch.randint(-3, 4, (128, 128), generator=g, dtype=torch.float32)
    x[3, 128:256] = tiny * torch.arange(128, dtype=torch.float32)
    x[3, 200] = 1.0
    row = torch.tensor(E4M3_BOUNDARY_VALUES, dtype=torch.float32)
    x[4, 256 : 256 + row.numel()] = row
    x[4, 256 + row.numel() : 384] = 0.5
    x[5, 130] = float("nan")
    x[200, 300] = float("inf")
    x[258, 388] = float("-inf")
    x[0:128, 384:389] = 0.0
    return x.to(dtype)
