"""The Qwen3-8B job at full size with vLLM rollout on every GPU of one host: FP8 against BF16, then a
preemption and its exact resume, and the memory plan beside the measured peak.

Qwen3-8B at real shapes (``benchmarks/configs/qwen3_8b_dims.yaml``: 36 layers, vocabulary 151,936,
random weights), ``jetrl train`` under torchrun on ``--nproc`` GPUs:
- FP8 (unified; the exact rollout where the layout allows it, as ``precision.exact: auto`` decides:
  trainer TP = rollout TP) and BF16 (the default rollout, with its logprob recompute), ``--steps``
  steps each, ``--rounds`` times in ABBA order (fp8 bf16, bf16 fp8, ...: drift over the rounds hits
  both alike; two runs of one mode can differ by more than the modes do, so the headline pools rounds);
- responses of fixed length (``rollout.sampling.ignore_eos``), so both modes do the same work; the
  timed steps are 3..``--steps`` (step 1 captures CUDA graphs and compiles, step 2's offload pins the
  optimizer state's host memory, once);
- with ``--preempt`` (default): SIGUSR1 to the workers once step 2 is logged, which checkpoint after
  the step they are in and exit; the same command then continues to step 4 from that checkpoint;
- the tables last (``rl_summary``, ``scale_summary``: phases, tokens/s/GPU, memory measured against
  ``jetrl check``'s plan), and with ``--headline`` the keys ``rl_step_8b_full_*``.

    python -m benchmarks.bench_rl_full [--nproc 4] [--tp 4] [--rollout-tp TP] [--steps 5] [--rounds 2]
        [--limit 540] [--no-preempt] [--args "KEY=VALUE ..."] [--work DIR] [--headline PATH] [--dry-run]

A first FP8 start on a fresh machine JIT-compiles DeepGEMM's kernels (about 5 minutes at these
shapes): give that run a ``--limit`` of ~900 s. ``--dry-run`` prints the runs' commands and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "benchmarks" / "configs" / "qwen3_8b_dims.yaml"
MODES = {"fp8": ["precision.mode=fp8"], "bf16": ["precision.mode=bf16", "precision.exact=false"]}
"""Mode -> overrides: FP8 as the job's default decides (exact where the layout allows it), BF16 the
default rollout with its recompute (the baseline of ``rl_step_8b_full_fp8_over_bf16``)."""
PREEMPT_STEPS = 4


def layout(args) -> list[str]:
    """The overrides every run shares: the full model, the layout, colocation and fixed-length responses."""
    return ["model.config.num_hidden_layers=36", "rollout.engine=vllm", f"actor.parallel.tp={args.tp}",
            "actor.parallel.sequence_parallel=true", f"rollout.vllm.tensor_parallel_size={args.rollout_tp}",
            "rollout.offload_actor=true", "rollout.vllm.gpu_memory_utilization=0.7",
            "rollout.sampling.ignore_eos=true", "log.console=false", "run.save_every=0", *shlex.split(args.args)]


def train_command(args, run_dir: Path, *overrides: str) -> list[str]:
    return ["torchrun", "--standalone", f"--nproc-per-node={args.nproc}", "-m", "megatron_jetrl.cli", "train",
            str(CONFIG), f"run.dir={run_dir}", *layout(args), *overrides]


def runs(args) -> list[tuple[str, list[str]]]:
    """(name, overrides) of the timed runs in their order: ABBA over the rounds."""
    out = []
    for r in range(1, args.rounds + 1):
        order = ("fp8", "bf16") if r % 2 else ("bf16", "fp8")
        suffix = "" if r == 1 else f".r{r}"
        out += [(mode + suffix, [*MODES[mode], f"run.steps={args.steps}", "run.save_at_end=false"]) for mode in order]
    return out


def _run(cmd: list[str], log: Path, limit: float) -> int:
    """``cmd`` with its output appended to ``log``; stopped (its process group) after ``limit`` seconds."""
    with log.open("a") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        try:
            return proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            print(f"  {log.stem}: stopped after its {limit:.0f} s limit", flush=True)
            return 124


def _logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    return sum(1 for line in path.read_text().splitlines() if '"reward/mean"' in line)


def _workers(run_dir: Path) -> list[int]:
    """The training processes of ``run_dir`` (torchrun's workers, not torchrun itself)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "megatron_jetrl.cli" in cmdline and f"run.dir={run_dir}" in cmdline and "torchrun" not in cmdline \
                and "torch.distributed.run" not in cmdline:
            pids.append(int(entry.name))
    return pids


def preemption(args, work: Path) -> bool:
    """SIGUSR1 to the workers once step 2 is logged; they checkpoint and exit; the rerun continues to
    ``PREEMPT_STEPS``. True when the checkpoint was written, the stop came before the last step and
    the rerun finished every step."""
    run_dir, log = work / "runs" / "preempt", work / "preempt.log"
    cmd = train_command(args, run_dir, *MODES["fp8"], f"run.steps={PREEMPT_STEPS}")
    with log.open("a") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        end = time.monotonic() + args.limit
        while proc.poll() is None and _logged_steps(run_dir) < 2 and time.monotonic() < end:
            time.sleep(1)
        for pid in _workers(run_dir):
            os.kill(pid, signal.SIGUSR1)
        try:
            proc.wait(timeout=max(60.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    latest = run_dir / "checkpoints" / "latest"
    saved = latest.read_text().strip() if latest.is_file() else None
    stopped_at = _logged_steps(run_dir)
    rc = _run(cmd, log, args.limit)
    done = _logged_steps(run_dir)
    print(f"preempt: stopped after {stopped_at} steps with checkpoint {saved}; the rerun (rc={rc}) ended with "
          f"{done} logged steps", flush=True)
    return saved is not None and stopped_at < PREEMPT_STEPS and rc == 0 and done >= PREEMPT_STEPS


def main(argv: list[str] | None = None) -> int:
    from benchmarks.headline import command_line

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=None, help="GPUs (processes); default: every GPU of this host")
    ap.add_argument("--tp", type=int, default=4, help="the trainer's TP (default 4)")
    ap.add_argument("--rollout-tp", type=int, default=None, help="vLLM's TP (default: the trainer's: exact)")
    ap.add_argument("--steps", type=int, default=5, help="steps a run (timed: 3..steps; default 5)")
    ap.add_argument("--rounds", type=int, default=2, help="how many times both modes run (default 2)")
    ap.add_argument("--limit", type=float, default=540.0, help="seconds a training run may take (default 540)")
    ap.add_argument("--no-preempt", dest="preempt", action="store_false", help="skip the checkpoint/resume part")
    ap.add_argument("--args", default="", help="more overrides for every run, e.g. 'run.profile_steps=[6]'")
    ap.add_argument("--work", type=Path, default=Path("runs/bench_rl_full"), help="run directories and logs")
    ap.add_argument("--headline", help="write the rl_step_8b_full_* figures into this headline JSON file")
    ap.add_argument("--dry-run", action="store_true", help="print the runs' commands and exit")
    args = ap.parse_args(argv)
    if args.nproc is None:
        import torch

        args.nproc = torch.cuda.device_count()
    args.rollout_tp = args.rollout_tp or args.tp
    for name, value, minimum in (("--nproc", args.nproc, 1), ("--tp", args.tp, 1), ("--rollout-tp", args.rollout_tp, 1),
                                 ("--steps", args.steps, 3), ("--rounds", args.rounds, 1)):
        if value < minimum:
            ap.error(f"{name} {value}: give a whole number >= {minimum}" + (" (the timed steps are 3..steps)"
                                                                         if name == "--steps" else ""))
    for name, value in (("--tp", args.tp), ("--rollout-tp", args.rollout_tp)):
        if args.nproc % value:
            ap.error(f"{name} {value} must divide --nproc {args.nproc} (the GPUs this runs on)")
    planned = runs(args)
    work = args.work.resolve()
    if args.dry_run:
        for name, overrides in planned:
            print(shlex.join(train_command(args, work / "runs" / name, *overrides)))
        return 0
    if work.exists() and any(work.iterdir()):
        ap.error(f"--work {args.work} is not empty: give a new directory (the runs' steps are counted from it)")
    (work / "runs").mkdir(parents=True)
    command = command_line("benchmarks.bench_rl_full", argv)
    check = subprocess.run([sys.executable, "-m", "megatron_jetrl.cli", "check", str(CONFIG), "--world-size",
                            str(args.nproc), *layout(args), f"run.steps={args.steps}"], cwd=ROOT, capture_output=True,
                           text=True)
    (work / "plan.log").write_text(check.stdout + check.stderr)
    print(f"plan ({args.nproc} GPUs, TP={args.tp}, rollout TP={args.rollout_tp}):")
    print("\n".join(line for line in check.stdout.splitlines()
                    if any(w in line for w in ("precision", "peak", "trainer total", "WARNING"))), flush=True)
    if check.returncode:
        print(check.stderr.strip()[-2000:])
        return check.returncode
    ok = True
    for name, overrides in planned:
        start = time.monotonic()
        rc = _run(train_command(args, work / "runs" / name, *overrides), work / f"{name}.log", args.limit)
        print(f"train {name} rc={rc} ({time.monotonic() - start:.0f} s)", flush=True)
        ok &= rc == 0
    if args.preempt:
        ok &= preemption(args, work)
    metrics = sorted((work / "runs").glob("*/metrics.jsonl"))
    if metrics:
        subprocess.run([sys.executable, "-m", "benchmarks.rl_summary", *map(str, metrics),
                        "--json", str(work / "summary.json")], cwd=ROOT)
        headline = ["--headline", args.headline, "--headline-key", "rl_step_8b_full", "--command", command] \
            if args.headline else []
        summary = subprocess.run([sys.executable, "-m", "benchmarks.scale_summary",
                                  *(str(work / "runs" / name) for name, _ in planned), "--world-size", str(args.nproc),
                                  "--json", str(work / "scale.json"), *headline], cwd=ROOT)
        ok &= summary.returncode == 0
    (work / "result.json").write_text(json.dumps({"ok": ok, "command": command, "runs": [n for n, _ in planned]}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
