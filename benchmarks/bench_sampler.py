"""vLLM's seeded sampling against the engine's batched noise, ms of host and wall time a decode step.

The trainer seeds every rollout request. vLLM's sampler (``random_sample``) then fills each request's
row of the exponential noise with its own ``exponential_`` call: one Python iteration and one launch
per request, every decode step, while the GPU waits. ``rollout/vllm_sampling.py`` replaces it with one
kernel (``ops.sampling``). This suite calls both functions as vLLM's sampler does, on the same
probabilities (Qwen3's vocabulary, every row seeded, a fresh set of generators per variant), and
reports per call:
- **host ms**: until the call returns (what the engine's loop waits before it can go on);
- **wall ms**: until the GPU has finished it too.

Each repeat times ``--calls`` calls of each variant in turn; the table gives the median over
``--repeats`` and the spread. Needs vLLM (for its own function) and a CUDA GPU.

Usage (GPU):  python -m benchmarks.bench_sampler [--batches 64,128,256] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from benchmarks.headline import command_line
from megatron_jetrl.runtime.atomic import save_json_atomic

VOCAB = 151936  # Qwen3


def time_calls(fn: Callable[[], object], calls: int) -> tuple[float, float]:
    """(host ms, wall ms) a call over ``calls`` back-to-back calls."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return host * 1e3 / calls, wall * 1e3 / calls


def time_batch(batch: int, variants: dict[str, Callable], calls: int, repeats: int) -> list[dict]:
    """One result per variant at ``batch`` requests, each variant with its own fresh generators."""
    g = torch.Generator(device="cuda").manual_seed(batch)
    probs = torch.softmax(torch.randn(batch, VOCAB, device="cuda", generator=g), dim=-1)
    work = torch.empty_like(probs)
    gens = {name: {i: torch.Generator(device="cuda").manual_seed(1000 + i) for i in range(batch)} for name in variants}

    def call(name: str) -> Callable[[], object]:
        def once():
            work.copy_(probs)  # the sampler divides its input in place
            return variants[name](work, gens[name])
        return once

    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for name in variants:  # warm-up
        time_calls(call(name), 5)
    for _ in range(repeats):
        for name in variants:
            times[name].append(time_calls(call(name), calls))
    copy_ms = statistics.median(time_calls(lambda: work.copy_(probs), calls)[1] for _ in range(repeats))
    results = []
    for name, pairs in times.items():
        host, wall = [p[0] for p in pairs], [p[1] for p in pairs]
        results.append({"batch": batch, "variant": name, "host_ms": statistics.median(host),
                        "host_spread": [min(host), max(host)], "wall_ms": statistics.median(wall),
                        "wall_spread": [min(wall), max(wall)], "input_copy_ms": copy_ms, "calls": calls,
                        "repeats": repeats})
    return results


def run(batches: list[int], calls: int, repeats: int) -> list[dict]:
    from megatron_jetrl.rollout import vllm_sampling

    vllm_sampling.install()
    try:
        module = vllm_sampling.sampler_module()
        variants = {"vllm": module.random_sample.jetrl_original, "batched": module.random_sample}
        return [r for batch in batches for r in time_batch(batch, variants, calls, repeats)]
    finally:
        vllm_sampling.uninstall()


def table(results: list[dict], device: str) -> str:
    lines = [f"== seeded sampling, every row seeded, vocabulary {VOCAB}: ms a call (median of repeats), {device} ==",
             "(each call includes a copy of the probabilities: input_copy_ms)"]
    lines.append(f"{'batch':>6} {'variant':<9} {'host ms':>8} {'range':>13} {'wall ms':>8} {'range':>13} "
                 f"{'copy ms':>8} {'wall / batched':>15}")
    for r in results:
        batched = next(e["wall_ms"] for e in results if e["batch"] == r["batch"] and e["variant"] == "batched")
        lines.append(f"{r['batch']:>6} {r['variant']:<9} {r['host_ms']:>8.3f} "
                     f"{r['host_spread'][0]:>6.3f}-{r['host_spread'][1]:<6.3f} {r['wall_ms']:>8.3f} "
                     f"{r['wall_spread'][0]:>6.3f}-{r['wall_spread'][1]:<6.3f} {r['input_copy_ms']:>8.3f} "
                     f"{r['wall_ms'] / batched:>14.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="64,128,256", help="requests per decode step, comma-separated")
    p.add_argument("--calls", type=int, default=50, help="calls of a variant per repeat")
    p.add_argument("--repeats", type=int, default=5, help="repeats (median, spread)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        p.error(f"--batches {args.batches!r}: expected integers separated by commas, e.g. 64,128,256")
    if any(b < 1 for b in batches) or args.calls < 1 or args.repeats < 3:
        p.error("--batches must be >= 1, --calls >= 1 and --repeats >= 3 (a median and a spread)")
    if not torch.cuda.is_available():
        print("bench_sampler: no CUDA GPU visible; it times vLLM's sampler on CUDA", file=sys.stderr)
        return 2
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("bench_sampler: vLLM is not installed; it compares vLLM's own sampler: pip install vllm",
              file=sys.stderr)
        return 2
    results = run(batches, args.calls, args.repeats)
    device = torch.cuda.get_device_name()
    if args.json:
        command = command_line("benchmarks.bench_sampler", argv)
        save_json_atomic(Path(args.json), {"device": device, "command": command, "results": results})
    print(table(results, device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
