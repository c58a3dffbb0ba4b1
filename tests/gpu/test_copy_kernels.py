"""The CUDA segment copy (csrc/copy_segments_cuda.cu) equals its pure-torch reference byte for byte:
16-, 4- and 1-byte unit paths, strided rows, views with storage offsets, many segments in one
launch, a large segment spanning many blocks; and the sync of a model on the GPU equals the CPU
simulation."""

import pytest
import torch

from megatron_jetrl.models import ParallelLayout
from megatron_jetrl.ops import copy_segments, copy_segments_reference
from megatron_jetrl.precision import PrecisionRecipe
from megatron_jetrl.sync import Shard, SyncPlan, shard_state, simulate
from tests.unit.test_sync import _model, _random_case

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("seed", range(8))
def test_cuda_copy_equals_reference(seed):
    srcs, dsts, table = _random_case(seed)
    expected = [d.clone() for d in dsts]
    copy_segments_reference(srcs, expected, table)
    cuda_dsts = [d.cuda() for d in dsts]
    copy_segments([s.cuda() for s in srcs], cuda_dsts, table)
    for a, e in zip(cuda_dsts, expected, strict=True):
        assert torch.equal(a.cpu(), e)


def test_cuda_copy_large_strided_and_offset_views():
    g = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randint(0, 255, (3 << 20,), generator=g, dtype=torch.uint8, device="cuda")
    src = base[17:]  # a view at an odd storage offset: the 1-byte path
    big = torch.randn(4096, 1024, generator=g, device="cuda")  # 16 MiB, 16-byte path over many blocks
    dst = torch.zeros(40 << 20, dtype=torch.uint8, device="cuda")
    table = torch.tensor([
        [0, 0, 4096, 0, 0, 4096, 4096, 4096],                      # 16 MiB contiguous
        [0, 2048, 4096, 0, 16 << 20, 2048, 2048, 4096],            # right halves of rows -> dense
        [1, 3, 1000, 0, (24 << 20) + 1, 999, 997, 777],            # unaligned bytes
        [0, 4, 4096, 0, 25 << 20, 1000, 996, 500],                 # 4-byte path
    ], dtype=torch.long)
    srcs = [big, src]
    expected = dst.clone()
    copy_segments_reference(srcs, [expected], table)
    copy_segments(srcs, [dst], table)
    assert torch.equal(dst, expected)
    assert dst[: 16 << 20].view(torch.float32).view(4096, 1024).equal(big)


def test_sync_on_gpu_equals_cpu_simulation():
    bridge, full, _ = _model("Qwen3ForCausalLM")
    recipe = PrecisionRecipe()
    train = ParallelLayout(2, 1)
    plan = SyncPlan(bridge, recipe, train, 1, 2)
    cpu = shard_state(bridge, recipe, full, train)
    gpu = {r: {n: Shard(s.dense.cuda(), None if s.fp8 is None else type(s.fp8)(
        s.fp8.data.cuda(), s.fp8.scale_inv.cuda(), s.fp8.block_shape)) for n, s in shards.items()}
        for r, shards in cpu.items()}
    want = dict(simulate(plan, cpu, 1))
    got = dict(simulate(plan, gpu, 1, copy=copy_segments))
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].is_cuda
        assert torch.equal(got[name].cpu().view(torch.uint8), t.view(torch.uint8)), name
