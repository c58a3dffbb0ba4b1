"""bench_tp_reduce's vLLM custom all-reduce variant, on the CPU: the chunks stay under the size up to
which vLLM runs its one-stage kernel, the spread inputs make the order of an fp32 sum show in the
bits (so the whole-tensor control can fail), and the option is refused off CUDA. (The timing and the
bit check themselves run on 4 GPUs: hosts/offline/vllm.sh --tp-reduce.)"""

import pytest
import torch

from benchmarks import bench_tp_reduce as bench
from megatron_jetrl.ops.exact import ordered_sum


@pytest.mark.parametrize("tp, hidden, rows", [(4, 4096, 63), (8, 4096, 31), (4, 5120, 51), (8, 5120, 25)])
def test_chunks_stay_under_the_one_stage_size(tp, hidden, rows):
    got = bench.one_stage_rows(tp, hidden, 2)
    assert got == rows
    assert got * hidden * 2 < bench.ONE_STAGE_BYTES[tp] <= (got + 1) * hidden * 2
    assert got * hidden * 2 % 16 == 0


def test_at_tp_2_any_size_is_one_stage_and_a_row_too_wide_is_refused():
    assert bench.one_stage_rows(2, 4096, 2) >= 1 << 20
    with pytest.raises(ValueError, match="over the one-stage size"):
        bench.one_stage_rows(8, 200_000, 2)


def test_spread_inputs_make_the_order_of_an_fp32_sum_show():
    parts = torch.stack([bench.spread_values(64, 4096, 100 + r, torch.device("cpu")) for r in range(4)])
    in_order = ordered_sum(parts)
    # the two-stage kernel sums rank r's part of the tensor starting from rank r: here from rank 1
    rotated = ordered_sum(parts[[1, 2, 3, 0]])
    assert not torch.equal(in_order, rotated)
    plain = torch.stack([torch.randn(64, 4096, generator=torch.Generator().manual_seed(r)).bfloat16()
                         for r in range(4)])
    differ_plain = (ordered_sum(plain) != ordered_sum(plain[[1, 2, 3, 0]])).sum().item()
    assert (in_order != rotated).sum().item() > 10 * max(differ_plain, 1)  # far more than ordinary inputs show


def test_the_custom_variant_is_refused_off_cuda(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--vllm-custom", "--device", "cpu"])
    assert e.value.code == 2 and "--vllm-custom runs vLLM's CUDA kernel" in capsys.readouterr().err
