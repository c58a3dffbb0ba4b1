"""The exact mode's TP reduction above TP 2 on a gloo group of 4 ranks: the trainer's
``ordered_tp_reduce`` gives every rank, for every element, the fp32 sum of the 4 partial values in
rank order rounded once (``ops.exact.ordered_sum``, what vLLM's all-reduce computes in the exact
mode: tests/contract/test_vllm_exact.py), with and without sequence parallelism; its gradients are
megatron's mappings' (the identity; an all-gather). The exact row-parallel linear reduces with it.
Negative control: the same partials summed as an all-reduce in BF16 sums them (each step rounded to
BF16, as NCCL's ring does) give other bits, so the equality above would catch such a reduction."""

import os

import pytest
import torch

from megatron_jetrl.launch import free_port
from tests.helpers import run_ranks

pytest.importorskip("megatron.core")

TP, ROWS, COLS = 4, 8, 256


def _partials() -> torch.Tensor:
    """[TP, ROWS, COLS] BF16 partial results of very different magnitudes, so that the order of the
    additions changes the rounding."""
    g = torch.Generator().manual_seed(5)
    scales = torch.tensor([1.0, 300.0, 0.01, 37.0]).view(TP, 1, 1)
    return (torch.randn(TP, ROWS, COLS, generator=g) * scales).to(torch.bfloat16)


def _worker(rank, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=TP)
    try:
        from megatron.core import parallel_state

        from megatron_jetrl.actor.exact import ordered_tp_reduce

        parallel_state.initialize_model_parallel(TP, 1)
        group = parallel_state.get_tensor_model_parallel_group()
        parts = _partials()
        mine = parts[rank].clone().requires_grad_()
        reduced = ordered_tp_reduce(mine, group, scatter=False)
        dy = torch.full_like(reduced, float(rank + 1))
        reduced.backward(dy)
        grad = mine.grad.clone()
        mine.grad = None
        scattered = ordered_tp_reduce(mine, group, scatter=True)  # this rank's ROWS / TP rows of the sum
        scattered.backward(torch.full_like(scattered, float(rank + 1)))
        linear = _row_parallel_linear_output(rank)
        got = (reduced.detach(), grad, scattered.detach(), mine.grad.clone(), linear)
        results.put((rank, *_bytes(got), None))  # tensors in a queue die with the process: their bytes instead
    except Exception as e:  # reported to the test
        import traceback

        results.put((rank, None, None, None, None, None, f"{e!r}\n{traceback.format_exc()}"))
    finally:
        torch.distributed.destroy_process_group()


def _bytes(tensors) -> list:
    import io

    out = []
    for t in tensors:
        buf = io.BytesIO()
        torch.save(t, buf)
        out.append(buf.getvalue())
    return out


def _loaded(blob: bytes):
    import io

    return torch.load(io.BytesIO(blob))


def _row_parallel_linear_output(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact mode's row-parallel linear at TP 4 (its GEMM a stand-in for vLLM's BF16 matmul):
    (its output, this rank's partial product)."""
    from types import SimpleNamespace

    from megatron.core.transformer import TransformerConfig

    from megatron_jetrl.actor.layers import Fp8RowParallelLinear

    config = TransformerConfig(num_layers=1, hidden_size=COLS, num_attention_heads=4, use_cpu_initialization=True,
                               params_dtype=torch.bfloat16, tensor_model_parallel_size=TP)
    torch.manual_seed(0)
    linear = Fp8RowParallelLinear(4 * 64, COLS, config=config, init_method=torch.nn.init.normal_, bias=False,
                                  input_is_parallel=True, skip_bias_add=True)
    linear.fp8_enabled = False
    linear.exact_kernels = SimpleNamespace(bf16_gemm=lambda x, w, b: x @ w.t())
    g = torch.Generator().manual_seed(10 + rank)
    x = (torch.randn(3, 2, 64, generator=g) * (1.0, 300.0, 0.01, 37.0)[rank]).to(torch.bfloat16)
    with torch.no_grad():
        out, bias = linear(x)
    assert bias is None
    return out, x @ linear.weight.detach().t()


def test_ordered_tp_reduce_sums_in_rank_order_with_megatrons_gradients():
    from megatron_jetrl.ops.exact import ordered_sum

    out = run_ranks(_worker, TP, free_port(), timeout=240)
    for rank, *_, err in out:
        assert err is None, f"rank {rank}: {err}"
    parts = _partials()
    want = ordered_sum(parts)
    stepwise = parts[0]
    for part in parts[1:]:
        stepwise = stepwise + part  # each partial sum rounded to BF16
    assert not torch.equal(want, stepwise), "the negative control: a BF16 all-reduce's rounding gives other bits"
    out = [(o[0], *(None if b is None else _loaded(b) for b in o[1:6]), o[6]) for o in out]
    rows = ROWS // TP
    for rank, reduced, grad, scattered, scattered_grad, _linear, _ in out:
        assert torch.equal(reduced, want), f"rank {rank}: the all-reduce is not the rank-order sum"
        assert torch.equal(grad, torch.full_like(grad, float(rank + 1))), "an all-reduce's gradient is the identity"
        assert torch.equal(scattered, want[rank * rows:(rank + 1) * rows]), f"rank {rank}: reduce-scatter rows"
        gathered = torch.cat([torch.full((rows, COLS), float(r + 1)) for r in range(TP)]).to(torch.bfloat16)
        assert torch.equal(scattered_grad, gathered), "a reduce-scatter's gradient is the all-gather"
    partial_products = torch.stack([o[5][1] for o in out])
    for rank, *_, (linear, _), _ in out:
        assert torch.equal(linear, ordered_sum(partial_products)), f"rank {rank}: the exact row-parallel linear"


def _bench_worker(rank, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    try:
        import contextlib
        import io

        from benchmarks.bench_tp_reduce import main

        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            rc = main(["--device", "cpu", "--models", "8b", "--cases", "decode", "--repeats", "3", "--iters", "1"])
        results.put((rank, rc, printed.getvalue(), None))
    except BaseException as e:  # reported to the test
        results.put((rank, None, None, repr(e)))


def test_the_reduction_benchmark_runs_and_prints_its_table():
    """bench_tp_reduce end to end on gloo (its CPU mode: the numbers mean nothing here, the GPU host
    measures them): rank 0 prints one row per case with both times and their ratio."""
    out = run_ranks(_bench_worker, 2, free_port(), timeout=240)
    assert all(err is None and rc == 0 for _, rc, _, err in out), out
    table = out[0][2]
    assert "== TP 2: the ordered reduction" in table and table.count("    8b    decode") == 2, table
    assert out[1][2] == ""
