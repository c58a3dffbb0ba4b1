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

``--headline`` writes ``tp_ordered_reduce_over_nccl_8b_decode`` (the ordered reduction's time over NCCL's
all-reduce at 8B widths, 128 decode rows). ``--device cpu`` runs the same on gloo with wall-clock
timing (the CPU tests' check that it runs; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from megatron_jetrl.actor.exact import ordered_reduce

MODELS = {"8b": (4096, 36), "32b": (5120, 64)}
"""Model -> (hidden size, layers): Qwen3-8B's and Qwen3-32B's."""

CASES = (("decode", 128, False), ("decode", 256, False), ("train", 8192, False), ("train-sp", 8192, True))
"""(name, rows, sequence parallel): a decode step's rows at two batch sizes, a micro-batch of the trainer
without and with sequence parallelism (its rows split over the TP ranks after the reduce-scatter)."""

HEADLINE_KEY = "tp_ordered_reduce_over_nccl_8b_decode"


@dataclass(frozen=True)
class Result:
    model: str
    case: str
    rows: int
    hidden: int
    tp: int
    nccl_us: list[float]
    ordered_us: list[float]

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


def measure(models: list[str], cases: list[str], repeats: int, iters: int, device: torch.device) -> list[Result]:
    tp = dist.get_world_size()
    out = []
    for model in models:
        hidden, _ = MODELS[model]
        for case, rows, scatter in (c for c in CASES if c[0] in cases):
            g = torch.Generator(device=device).manual_seed(dist.get_rank())
            x = torch.randn(rows, hidden, generator=g, device=device).to(torch.bfloat16)
            nccl, ordered = [], []
            usual = functools.partial(_usual, group=None, scatter=scatter)
            exact = functools.partial(ordered_reduce, group=None, scatter=scatter)
            for _ in range(repeats):  # alternating, so that drift over the run hits both alike
                nccl.append(_time_us(usual, x, iters, device))
                ordered.append(_time_us(exact, x, iters, device))
            out.append(Result(model, case, rows, hidden, tp, nccl, ordered))
    return out


def table(results: list[Result]) -> str:
    lines = [f"== TP {results[0].tp}: the ordered reduction (gather + ordered_sum) against NCCL's collective, "
             f"µs a call, median (range) of {len(results[0].nccl_us)} repeats ==",
             f"{'model':>6} {'case':>9} {'rows':>6} {'NCCL':>18} {'ordered':>18} {'ordered/NCCL':>13} "
             f"{'+ms / decode step':>18}"]
    for r in results:
        layers = MODELS[r.model][1]
        added = (statistics.median(r.ordered_us) - statistics.median(r.nccl_us)) * 2 * layers / 1e3
        fmt = lambda s: f"{statistics.median(s):8.1f} ({min(s):.0f}-{max(s):.0f})"  # noqa: E731
        lines.append(f"{r.model:>6} {r.case:>9} {r.rows:>6} {fmt(r.nccl_us):>18} {fmt(r.ordered_us):>18} "
                     f"{r.ratio:>12.2f}x {added if r.case == 'decode' else float('nan'):>18.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="8b,32b", help="comma-separated: " + ", ".join(MODELS))
    ap.add_argument("--cases", default=",".join(dict.fromkeys(c[0] for c in CASES)),
                    help="comma-separated: " + ", ".join(dict.fromkeys(c[0] for c in CASES)))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
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
    if "RANK" not in os.environ:
        ap.error("run it under torchrun with the TP size as the process count: torchrun --nproc-per-node 4 -m "
                 "benchmarks.bench_tp_reduce")
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
        results = measure(models, cases, args.repeats, args.iters, device)
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
