"""Summarise RL runs from their metrics.jsonl: reward curve, mismatch, and step time by phase.

    python -m benchmarks.rl_summary RUN.metrics.jsonl [...] [--json OUT]

Per run: train reward (means of the first and last 10 steps), the held-out eval curve, mean
rollout-vs-trainer k3 KL and token_mult_prob_error, and the mean seconds per phase of a step with
tokens/s/GPU (steps 2.. : step 1 includes CUDA-graph capture and allocator warm-up). ``summarise``
is also what scale_summary.py and mismatch_study.py read runs with.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PHASES = ("generate", "score", "advantages", "logprobs", "update", "sync", "colocate", "step")
TABLE_PHASES = ("generate", "logprobs", "update", "sync", "colocate", "step")
"""The phases the study and scale tables show (advantages take milliseconds)."""


def read_rows(path: Path) -> list[dict]:
    """The records of a ``metrics.jsonl``."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_rows(rows: list[dict]) -> list[dict]:
    """The RL steps' records (not the step-0 evaluation, nor an evaluation-only record)."""
    return [r for r in rows if "timing/step_s" in r]


def eval_points(rows: list[dict]) -> list[tuple[int, float]]:
    """(step, eval reward) of every evaluation."""
    return [(r["step"], r["eval/reward"]) for r in rows if r.get("eval/reward") is not None]


def warm_up_steps(offload_actor: bool) -> tuple[int, ...]:
    """Steps after the first (CUDA graphs, compiles, the caching allocator; never timed) that warm up
    too: with the actor offloaded during rollout, step 2, whose offload is the first with the
    optimizer's state (made by step 1's update) and allocates its pinned host buffers, once (40 s for
    16 layers at 8B widths on an H200; 2.5 s at every later step). Pass them to ``summarise`` as
    ``untimed``."""
    return (2,) if offload_actor else ()


UPDATE_SPLIT = ("update_time_s", "forward_backward_s", "microbatch_gpu_ms_median", "microbatch_gpu_ms_max")
"""The actor's account of its update's time (``Actor.update``): the whole, the forward and backward of
every micro-batch until the GPU finished them, and the GPU time a micro-batch took (median, maximum)."""


CPU_PHASES = ("generate", "logprobs", "update")
"""The phases whose CPU seconds (``cpu/<phase>_{process,machine}_s``, runtime/timing.py) a summary keeps:
this process's and the whole machine's, a timed step each."""


def summarise(path: Path, untimed: tuple[int, ...] = ()) -> dict:
    """One run's numbers from its ``metrics.jsonl`` (shared by scale_summary.py and
    mismatch_study.py): train reward (first and last 10 steps), eval curve, mean mismatch,
    response length and entropy, mean seconds per phase and tokens/s/GPU over steps 2.. (without
    the ``untimed`` steps, e.g. profiled ones; each of those steps' seconds and tokens too), tokens
    per step, the largest value of every ``memory/*`` metric, each timed step's allocation retries
    per phase and the actor's ``UPDATE_SPLIT`` where it logged them. Missing metrics are NaN."""
    rows = read_rows(path)
    train = train_rows(rows)
    evals = eval_points(rows)
    warm = [r for r in train[1:] if r.get("step") not in untimed] or train

    def mean(key, rs):
        vals = [r[key] for r in rs if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else float("nan")

    memory_keys = sorted({k for r in train for k in r if k.startswith("memory/") and k.endswith("_gib")})
    retry_keys = sorted({k for r in train for k in r if k.startswith("memory/") and k.endswith("_alloc_retries")})
    return {
        "run": path.name.replace(".metrics.jsonl", ""),
        "steps": len(train),
        "reward_first10": mean("reward/mean", train[:10]),
        "reward_last10": mean("reward/mean", train[-10:]),
        "eval": evals,
        "k3_kl": mean("rollout_corr/k3_kl", train),
        "probs_diff": mean("training/rollout_probs_diff_mean", train),
        "token_mult_prob_error": mean("token_mult_prob_error", train),
        "seconds": {p: mean(f"timing/{p}_s", warm) for p in PHASES},
        "seconds_per_step": {p: [r.get(f"timing/{p}_s", float("nan")) for r in warm] for p in PHASES},
        "tokens_per_timed_step": [r.get("perf/tokens_per_step", float("nan")) for r in warm],
        "tokens_per_s_per_gpu": mean("perf/tokens_per_s_per_gpu", warm),
        "tokens_per_s_per_gpu_per_step": [r.get("perf/tokens_per_s_per_gpu", float("nan")) for r in warm],
        "tokens_per_step": mean("perf/tokens_per_step", warm),
        "response_length": mean("response/length_mean", train),
        "entropy": mean("actor/entropy", train),
        "memory_gib": {k[len("memory/"):-len("_gib")]: max(r[k] for r in train if r.get(k) is not None)
                       for k in memory_keys},
        "alloc_retries_per_step": {k[len("memory/"):-len("_alloc_retries")]: [r.get(k, float("nan")) for r in warm]
                                   for k in retry_keys},
        "update_split_per_step": {k: [r.get(f"actor/{k}", float("nan")) for r in warm] for k in UPDATE_SPLIT
                                  if any(r.get(f"actor/{k}") is not None for r in warm)},
        "cpu_per_step": {p: {who: [r.get(f"cpu/{p}_{who}_s", float("nan")) for r in warm]
                             for who in ("process", "machine") if any(f"cpu/{p}_{who}_s" in r for r in warm)}
                         for p in CPU_PHASES if any(f"cpu/{p}_process_s" in r for r in warm)},
        "loss_finite": all(r.get("actor/loss") is not None for r in train),
    }


def same_work(runs) -> bool:
    """Whether the runs (``summarise``'s results) processed the same tokens at every timed step, so
    their times compare: the condition of every step ratio that becomes a headline figure."""
    tokens = [tuple(r.get("tokens_per_timed_step") or ()) for r in runs]
    return bool(tokens) and bool(tokens[0]) and all(t == tokens[0] for t in tokens)


HOST_PHASES, HOST_TOP = ("generate", "logprobs", "update"), 6
"""The profiled step's phases whose host split ``profile_lines`` shows, and how many functions (and
torch operators, where the phase recorded them) of each."""


def profile_lines(run: str, prof: dict) -> list[str]:
    """A profiled step (``run.profile_steps``: ``<run dir>/profiles/step_<N>.json``, runtime/profiling.py)
    as table lines: per phase its wall time and kernel time by class, the host's functions by own
    time and the torch operators whose own kernels took longest."""
    lines = [f"-- kernel time of step {prof['step']} ({run}, profiled), ms by phase and class:"]
    for phase, ph in prof["phases"].items():
        top = ", ".join(f"{c} {ms:.0f}" for c, ms in list(ph["classes_ms"].items())[:5])
        lines.append(f"   {phase:<11} wall {ph['wall_s']:>7.3f} s, kernels {ph['kernel_ms']:>8.1f} ms: {top}")
        host = ph.get("host")
        if host and phase in HOST_PHASES:
            own = ", ".join(f"{f} {sec:.2f}" for f, sec in list(host["self_s"].items())[:HOST_TOP])
            lines.append(f"   {'':<11} host s by function (own time): {own}; "
                         f"GC {host['gc_s']:.2f} s in {host['gc_collections']} collections")
        ops = list(ph.get("top_ops_ms", {}).items())[:HOST_TOP]
        if ops:
            lines.append(f"   {'':<11} kernel ms by torch operator (own kernels): "
                         + ", ".join(f"{op} {ms:.0f}" for op, ms in ops))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", nargs="+", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    runs = [summarise(p) for p in args.metrics]
    print(f"{'run':<14} {'steps':>5} {'reward 1-10':>11} {'last 10':>8} {'eval first':>10} {'eval last':>9} "
          f"{'k3 KL':>9} {'tok_mult_err':>12}")
    for r in runs:
        e0, e1 = (r["eval"][0][1], r["eval"][-1][1]) if r["eval"] else (float("nan"),) * 2
        print(f"{r['run']:<14} {r['steps']:>5} {r['reward_first10']:>11.3f} {r['reward_last10']:>8.3f} "
              f"{e0:>10.3f} {e1:>9.3f} {r['k3_kl']:>9.1e} {r['token_mult_prob_error']:>12.6f}")
    print(f"\n{'run':<14} " + " ".join(f"{p + ' s':>12}" for p in PHASES) + f" {'tok/s/GPU':>10}")
    for r in runs:
        print(f"{r['run']:<14} " + " ".join(f"{r['seconds'][p]:>12.4f}" for p in PHASES)
              + f" {r['tokens_per_s_per_gpu']:>10.0f}")
    for r in runs:
        if r["eval"]:
            print(f"\n{r['run']} eval curve: " + ", ".join(f"{s}:{v:.3f}" for s, v in r["eval"]))
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
