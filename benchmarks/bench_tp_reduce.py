"""The exact rollout's TP reduction against the usual one, at Qwen3-8B and Qwen3-32B widths.

Above TP 2 both sides of the exact rollout reduce a row-parallel output in one order
(``ops.exact.ordered_sum``): every rank's partial result gathered, then summed in rank order in fp32.
This measures what that costs against NCCL's collective for the same tensor, in one run on the same
GPUs, with the trainer's own ``actor.exact.ordered_reduce``: the all-reduce (vLLM's decode, the trainer
without sequence parallelism) against an all-gather plus ``ordered_sum``, and the reduce-scatter (the
trainer with sequence parallelism) against an all-to-all plus ``ordered_sum``. Each time is
CUDA-event timed over ``--iters`` calls after a warm-up, ``--repeats`` times; the table gives the
median and the range, and what the ordered reduction adds to a decode step of the whole model (two
reductions a layer).

    torchrun --nproc-per-node 4 -m benchmarks.bench_tp_reduce [--models 8b,32b] [--cases decode,train,train-sp]
        [--repeats 5] [--iters 50] [--json OUT] [--headline PATH]

``--vllm-custom`` (GPU, vLLM installed) adds vLLM's custom all-reduce for the decode cases, called on
row chunks under the size up to which it runs its one-stage kernel (``ONE_STAGE_BYTES``): that kernel
adds the ranks' values in rank order in fp32 and rounds once, the arithmetic of ``ordered_sum``. The
run checks it: on inputs whose magnitudes spread wide enough that fp32 sums round, the chunked result
must equal the ordered reduction bit for bit, and the whole tensor in one call (the two-stage kernel
above that size, each rank's part summed from its own rank on) is the negative control. Timed outside
CUDA graphs, so each call includes vLLM's copy of the input into its registered buffer (an engine
inside CUDA graphs skips that copy): an upper bound.

``--headline`` writes ``tp_ordered_reduce_over_nccl_8b_decode`` (the ordered reduction's time over NCCL's
all-reduce at 8B widths, 128 decode rows). ``--device cpu`` runs the same on gloo with wall-clock
timing (the CPU tests' check that it runs; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_jetrl.actor.exact import ordered_reduce

MODELS = {"8b": (4096, 36), "32b": (5120, 64)}
"""Model -> (hidden size, layers): Qwen3-8B's and Qwen3-32B's."""

CASES = (("decode", 128, False), ("decode", 256, False), ("train", 8192, False), ("train-sp", 8192, True))
"""(name, rows, sequence parallel): a decode step's rows at two batch sizes, a micro-batch of the trainer
without and with sequence parallelism (its rows split over the TP ranks after the reduce-scatter)."""

HEADLINE_KEY = "tp_ordered_reduce_over_nccl_8b_decode"

ONE_STAGE_BYTES = {4: 512 * 1024, 6: 256 * 1024, 8: 256 * 1024}
"""TP size -> the size below which vLLM's custom all-reduce runs its one-stage kernel on NVLink
(``CustomAllreduce::allreduce`` in vLLM's csrc/custom_all_reduce.cuh; at TP 2 it always does)."""


def one_stage_rows(tp: int, hidden: int, itemsize: int) -> int:
    """Rows of ``hidden`` values per call that keep vLLM's custom all-reduce on its one-stage kernel at
    ``tp`` (its byte size strictly below ``ONE_STAGE_BYTES``, a multiple of 16 bytes as the kernel needs)."""
    limit = ONE_STAGE_BYTES.get(tp)
    row = hidden * itemsize
    if limit is None:
        return 1 << 30  # TP 2: any size
    rows = (limit - 1) // row
    while rows > 1 and rows * row % 16:
        rows -= 1
    if rows < 1:
        raise ValueError(f"a row of {row} bytes is already over the one-stage size {limit} at TP {tp}")
    return rows


def spread_values(rows: int, hidden: int, seed: int, device: torch.device) -> torch.Tensor:
    """BF16 values with magnitudes 2^-24 .. 2^24: summed in fp32 in another order, some round otherwise."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g, device=device)
    scale = torch.exp2(torch.randint(-24, 25, (rows, hidden), generator=g, device=device).float())
    return (x * scale).to(torch.bfloat16)


@dataclass(frozen=True)
class Result:
    model: str
    case: str
    rows: int
    hidden: int
    tp: int
    nccl_us: list[float]
    ordered_us: list[float]
    custom_us: Optional[list[float]] = None
    """vLLM's custom all-reduce in one-stage chunks (``--vllm-custom``), with its copy into its buffer."""
    custom_equal: Optional[bool] = None
    """Whether the chunked custom all-reduce equals the ordered reduction bit for bit (spread inputs)."""
    custom_whole_equal: Optional[bool] = None
    """The same for the whole tensor in one call (two-stage above ``ONE_STAGE_BYTES``): the control."""

    @property
    def ratio(self) -> float:
        return statistics.median(self.ordered_us) / statistics.median(self.nccl_us)


def _usual(x: torch.Tensor, group, scatter: bool) -> torch.Tensor:
    if scatter:
        out = x.new_empty((x.shape[0] // dist.get_world_size(group), *x.shape[1:]))
        dist.reduce_scatter_tensor(out, x, group=group)
        return out
    dist.all_reduce(x, group=group)
    return x


def _time_us(fn, x: torch.Tensor, iters: int, device: torch.device) -> float:
    """Microseconds a call, over ``iters`` calls (CUDA events on a GPU, wall clock elsewhere)."""
    for _ in range(3):
        fn(x.clone())
    if device.type == "cuda":
        inputs = [x.clone() for _ in range(iters)]
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for t in inputs:
            fn(t)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / iters
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(x.clone())
    return (time.perf_counter() - t0) * 1e6 / iters


def vllm_custom_all_reduce(device: torch.device) -> Any:
    """vLLM's ``CustomAllreduce`` over the whole world (its handles exchanged on a gloo group); raises
    naming why where vLLM leaves it disabled (no NVLink between more than two GPUs, no P2P)."""
    from vllm.distributed.device_communicators.custom_all_reduce import CustomAllreduce

    ca = CustomAllreduce(group=dist.new_group(backend="gloo"), device=device)
    if ca.disabled:
        raise RuntimeError(f"vLLM's custom all-reduce is disabled at TP {dist.get_world_size()} on this host "
                           "(its log says why); --vllm-custom needs it")
    return ca


def _chunked(ca: Any, rows: int) -> Callable[[torch.Tensor], list[torch.Tensor]]:
    def reduce(x: torch.Tensor) -> list[torch.Tensor]:
        return [ca.custom_all_reduce(chunk) for chunk in x.split(rows)]
    return reduce


def measure(models: list[str], cases: list[str], repeats: int, iters: int, device: torch.device,
            custom: Any = None) -> list[Result]:
    tp = dist.get_world_size()
    out = []
    for model in models:
        hidden, _ = MODELS[model]
        for case, rows, scatter in (c for c in CASES if c[0] in cases):
            g = torch.Generator(device=device).manual_seed(dist.get_rank())
            x = torch.randn(rows, hidden, generator=g, device=device).to(torch.bfloat16)
            nccl, ordered, chunked_us = [], [], []
            usual = functools.partial(_usual, group=None, scatter=scatter)
            exact = functools.partial(ordered_reduce, group=None, scatter=scatter)
            chunked = _chunked(custom, one_stage_rows(tp, hidden, x.element_size())) if custom and not scatter else None
            for _ in range(repeats):  # alternating, so that drift over the run hits all alike
                nccl.append(_time_us(usual, x, iters, device))
                ordered.append(_time_us(exact, x, iters, device))
                if chunked is not None:
                    chunked_us.append(_time_us(chunked, x, iters, device))
            result = Result(model, case, rows, hidden, tp, nccl, ordered)
            if chunked is not None:
                spread = spread_values(rows, hidden, 100 + dist.get_rank(), device)
                want = ordered_reduce(spread.clone(), group=None, scatter=False)
                whole = custom.custom_all_reduce(spread)
                result = dataclasses.replace(
                    result, custom_us=chunked_us, custom_equal=bool(torch.equal(torch.cat(chunked(spread)), want)),
                    custom_whole_equal=None if whole is None else bool(torch.equal(whole, want)))
            out.append(result)
    return out


def table(results: list[Result]) -> str:
    lines = [f"== TP {results[0].tp}: the ordered reduction (gather + ordered_sum) against NCCL's collective, "
             f"µs a call, median (range) of {len(results[0].nccl_us)} repeats ==",
             f"{'model':>6} {'case':>9} {'rows':>6} {'NCCL':>18} {'ordered':>18} {'ordered/NCCL':>13} "
             f"{'+ms / decode step':>18}"]
    fmt = lambda s: f"{statistics.median(s):8.1f} ({min(s):.0f}-{max(s):.0f})"  # noqa: E731
    for r in results:
        layers = MODELS[r.model][1]
        added = (statistics.median(r.ordered_us) - statistics.median(r.nccl_us)) * 2 * layers / 1e3
        lines.append(f"{r.model:>6} {r.case:>9} {r.rows:>6} {fmt(r.nccl_us):>18} {fmt(r.ordered_us):>18} "
                     f"{r.ratio:>12.2f}x {added if r.case == 'decode' else float('nan'):>18.3f}")
    custom = [r for r in results if r.custom_us]
    if custom:
        lines.append("-- vLLM's custom all-reduce in one-stage chunks (outside CUDA graphs: + a copy into its "
                     "buffer), µs a call; its bits against the ordered reduction on spread inputs --")
        lines.append(f"{'model':>6} {'case':>9} {'rows':>6} {'custom, chunks':>18} {'custom/NCCL':>12} "
                     f"{'chunks equal':>13} {'whole call equal (control)':>27}")
        yesno = lambda b: "—" if b is None else ("yes" if b else "no")  # noqa: E731
        for r in custom:
            ratio = statistics.median(r.custom_us) / statistics.median(r.nccl_us)
            lines.append(f"{r.model:>6} {r.case:>9} {r.rows:>6} {fmt(r.custom_us):>18} {ratio:>11.2f}x "
                         f"{yesno(r.custom_equal):>13} {yesno(r.custom_whole_equal):>27}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="8b,32b", help="comma-separated: " + ", ".join(MODELS))
    ap.add_argument("--cases", default=",".join(dict.fromkeys(c[0] for c in CASES)),
                    help="comma-separated: " + ", ".join(dict.fromkeys(c[0] for c in CASES)))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--vllm-custom", action="store_true",
                    help="also vLLM's custom all-reduce in one-stage chunks, timed and bit-checked (GPU, vLLM)")
    ap.add_argument("--json", help="write the results here (rank 0)")
    ap.add_argument("--headline", help=f"write {HEADLINE_KEY} into this headline JSON file (rank 0)")
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        ap.error(f"--models: {','.join(unknown) or '(none)'} unknown; choose from {', '.join(MODELS)}")
    cases = [c for c in args.cases.split(",") if c]
    if not cases or any(c not in {name for name, _, _ in CASES} for c in cases):
        ap.error(f"--cases: {args.cases!r}; choose from {', '.join(dict.fromkeys(c[0] for c in CASES))}")
    if args.repeats < 3 or args.iters < 1:
        ap.error("--repeats must be at least 3 (a median and its range) and --iters at least 1")
    if args.vllm_custom and args.device != "cuda":
        ap.error("--vllm-custom runs vLLM's CUDA kernel: leave --device at cuda")
    if "RANK" not in os.environ:
        ap.error("run it under torchrun with the TP size as the process count: torchrun --nproc-per-node 4 -m "
                 "benchmarks.bench_tp_reduce")
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
        custom = None
        if args.vllm_custom:
            try:
                custom = vllm_custom_all_reduce(device)
            except RuntimeError as e:  # the host lacks it: the other two are still measured, and it says so
                if dist.get_rank() == 0:
                    print(f"--vllm-custom: {e}; measuring NCCL and the ordered reduction only", flush=True)
        results = measure(models, cases, args.repeats, args.iters, device, custom)
        if dist.get_rank() == 0:
            print(table(results), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump([asdict(r) for r in results], f, indent=1)
            if args.headline:
                _write_headline(args.headline, results, device)
    finally:
        dist.destroy_process_group()
    return 0


def _write_headline(path: str, results: list[Result], device: torch.device) -> None:
    from benchmarks.headline import Figure, command_line, update

    r = next((r for r in results if r.model == "8b" and r.case == "decode" and r.rows == 128), None)
    if r is None:
        return
    figure = Figure.ratio(r.ordered_us, r.nccl_us).against(
        f"NCCL's all-reduce of the same [{r.rows}, {r.hidden}] BF16 tensor at TP {r.tp}, the same run and GPUs")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (gloo)"
    update(path, {HEADLINE_KEY: figure}, device=name, command=command_line("benchmarks.bench_tp_reduce"))


if __name__ == "__main__":
    raise SystemExit(main())
