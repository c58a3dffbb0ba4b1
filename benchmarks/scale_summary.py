"""Summarise scale runs (jetrl train run directories): step time by phase, sync, tokens/s/GPU and
memory per GPU measured, next to the memory plan ``jetrl check`` gives for the same config.

    python -m benchmarks.scale_summary RUN_DIR [...] --world-size 4 [--json OUT]
        [--headline FILE --headline-key rl_step_8b_full --command "THE RUNS' COMMAND"]

Times are means over steps 2.. (step 1 includes CUDA-graph capture and allocator warm-up), and 3..
when the actor is offloaded during rollout (step 2's offload is the first with the optimizer's
state: it pins its host buffers, once; ``rl_summary.warm_up_steps``), without the config's profiled steps
(``run.profile_steps``; the last of them is printed by phase and kernel class after the tables). Memory
is the largest over ranks and steps: PyTorch's peak allocation in the generate phase and in the
update phase, and the device's used memory (PyTorch's reservation plus CUDA context, NCCL,
cuBLAS workspaces and graph pools).

``--headline``: with runs named ``fp8`` and ``bf16`` (the same work: equal tokens in every timed
step, else no figure), and optionally more rounds of both named ``fp8.r2`` / ``bf16.r2``, ...,
``KEY_fp8_over_bf16`` (BF16 step time over FP8's, paired step by step within a round) and
``KEY_tokens_per_s_per_gpu`` (the FP8 runs', per timed step) go into FILE: medians over the timed
steps of every round with their range, the device (GPU count and name, read on this host) and
``--command``.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from megatron_jetrl.job import load_job, resolve
from megatron_jetrl.job.estimate import gpu_capacity

from benchmarks import rl_summary
from benchmarks.headline import Figure, update

PHASES = rl_summary.TABLE_PHASES
MEASURED = ("generate_peak_allocated", "update_peak_allocated", "peak_reserved", "device_used")


def summarise(run_dir: Path, world_size: int, capacity: float) -> dict:
    """rl_summary's numbers of the run, with its layout and the memory plan of its config for GPUs
    of ``capacity`` bytes (vLLM's share is a fraction of it)."""
    job = load_job(run_dir / "config.yaml")
    untimed = (*rl_summary.warm_up_steps(job.rollout.offload_actor), *job.run.profile_steps)
    run = rl_summary.summarise(run_dir / "metrics.jsonl", untimed=untimed)
    resolved = resolve(job, world_size)
    plan = resolved.memory
    par = job.actor.parallel
    nan = float("nan")
    profiles = [run_dir / "profiles" / f"step_{n}.json" for n in job.run.profile_steps]
    profile = next((json.loads(p.read_text()) for p in reversed(profiles) if p.is_file()), None)
    return {
        **run,
        "run": run_dir.name,
        "layout": f"TP{par.tp} PP{par.pp} DP{resolved.dp}" + (" SP" if par.sequence_parallel else ""),
        "layers": resolved.bridge.dims.num_layers,
        "params_b": plan.total_params / 1e9,
        "measured_gib": {k: run["memory_gib"].get(k, nan) for k in MEASURED},
        "plan_gib": {"trainer": plan.trainer_total / 2**30, "rollout": plan.rollout_total(capacity) / 2**30,
                     "peak": plan.peak(capacity) / 2**30},
        "profile": profile,  # the last profiled step's (run.profile_steps), else None
    }


def _host_gpu() -> str | None:
    """This host's GPU memory in GiB (as ``--gpu-memory`` takes it), or None without a GPU."""
    import torch

    return f"{torch.cuda.mem_get_info()[1] / 2**30}" if torch.cuda.is_available() else None


def rounds(names) -> list[str]:
    """The round suffixes of the runs named ``fp8`` / ``bf16`` (round 1) and ``fp8.rN`` / ``bf16.rN``
    (round N), in round order: ``["", ".r2", ...]``; other names are not rounds."""
    found = {int(m[1] or 1) for n in names if (m := re.fullmatch(r"(?:fp8|bf16)(?:\.r(\d+))?", n))}
    return ["" if r == 1 else f".r{r}" for r in sorted(found)]


def headline_figures(runs: dict[str, dict], key: str) -> dict[str, Figure]:
    """``KEY_fp8_over_bf16`` and ``KEY_tokens_per_s_per_gpu`` from the ``fp8`` and ``bf16`` runs'
    timed steps (module docstring), pooled over rounds (``fp8.r2`` beside ``bf16.r2``, ...): the ratio
    is median over median of every round's steps, its spread the step-by-step ratios within each
    round, so run-to-run variation shows in it. Raises when a round misses a mode or its two runs did
    not do the same work."""
    if not {"fp8", "bf16"} <= set(runs):
        raise ValueError(f"--headline needs runs named fp8 and bf16; got {', '.join(runs)}")
    fp8_steps, bf16_steps, tok_s = [], [], []
    for r in rounds(runs):
        if not {f"fp8{r}", f"bf16{r}"} <= set(runs):
            raise ValueError(f"round {r[1:]} has {', '.join(n for n in runs if n.endswith(r))} alone: each round "
                             "needs both fp8 and bf16")
        fp8, bf16 = runs[f"fp8{r}"], runs[f"bf16{r}"]
        if not rl_summary.same_work((fp8, bf16)):
            raise ValueError(f"fp8{r} and bf16{r} did not process the same tokens per timed step "
                             f"({fp8['tokens_per_timed_step']} vs {bf16['tokens_per_timed_step']}): no headline "
                             "figure (fixed lengths: rollout.sampling.ignore_eos=true)")
        fp8_steps += fp8["seconds_per_step"]["step"]
        bf16_steps += bf16["seconds_per_step"]["step"]
        tok_s += fp8["tokens_per_s_per_gpu_per_step"]
    pooled = len(rounds(runs))
    return {f"{key}_fp8_over_bf16": Figure.ratio(bf16_steps, fp8_steps).against(
                f"the BF16 run of the same round and layout ({pooled} round{'s' if pooled > 1 else ''}, ABBA order; "
                "steps paired within a round)", runs=2 * pooled),
            f"{key}_tokens_per_s_per_gpu": Figure.of(tok_s).against("", runs=pooled)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--gpu-memory", help="the GPUs' memory for the plan: H100, H200 or GiB (default: this host's "
                                         "GPU, else H100)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--headline", type=Path, help="headline file for the fp8 / bf16 figures (module docstring)")
    ap.add_argument("--headline-key", help="the figures' key prefix, e.g. rl_step_8b_full")
    ap.add_argument("--command", help="the command that made the runs, recorded with the figures")
    args = ap.parse_args()
    if args.headline and not (args.headline_key and args.command):
        ap.error("--headline needs --headline-key and --command (what the figures are and how they were made)")
    capacity = gpu_capacity(args.gpu_memory or _host_gpu() or "H100")
    results = []
    for run in args.runs:
        if not (run / "metrics.jsonl").is_file():
            print(f"{run.name}: no metrics.jsonl (the run did not finish a step)")
            continue
        results.append(summarise(run, args.world_size, capacity))
    head = (f"{'run':<16} {'layout':<14} {'layers':>6} {'params':>7} {'steps':>5} "
            + " ".join(f"{p + '_s':>10}" for p in PHASES) + f" {'tok/s/GPU':>10}")
    print(head)
    for r in results:
        print(f"{r['run']:<16} {r['layout']:<14} {r['layers']:>6} {r['params_b']:>6.1f}B {r['steps']:>5} "
              + " ".join(f"{r['seconds'][p]:>10.2f}" for p in PHASES) + f" {r['tokens_per_s_per_gpu']:>10.0f}")
    print()
    print(f"{'run':<16} {'gen alloc':>10} {'upd alloc':>10} {'reserved':>10} {'device':>10}   "
          f"{'plan train':>10} {'plan roll':>10} {'plan peak':>10}   (GiB per GPU, max over ranks)")
    for r in results:
        m, p = r["measured_gib"], r["plan_gib"]
        print(f"{r['run']:<16} {m['generate_peak_allocated']:>10.1f} {m['update_peak_allocated']:>10.1f} "
              f"{m['peak_reserved']:>10.1f} {m['device_used']:>10.1f}   {p['trainer']:>10.1f} {p['rollout']:>10.1f} "
              f"{p['peak']:>10.1f}")
    for r in results:
        if r["profile"]:
            print()
            print("\n".join(rl_summary.profile_lines(r["run"], r["profile"])))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.headline:
        import torch

        figures = headline_figures({r["run"]: r for r in results}, args.headline_key)
        device = f"{args.world_size} × {torch.cuda.get_device_name()}"
        update(args.headline, figures, device=device, command=args.command)
        print(f"\nheadline -> {args.headline} ({device}): " + ", ".join(
            f"{k} {f.value:.4g} ({f.spread[0]:.4g}–{f.spread[1]:.4g}, {f.repeats})" for k, f in figures.items()))


if __name__ == "__main__":
    main()
