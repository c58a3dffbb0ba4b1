"""The mismatch and speed study (issue 8), one command on the GPU host:

    python benchmarks/mismatch_study.py --out DIR [--steps 60] [--parallel 8] [--no-speed]
    python benchmarks/mismatch_study.py --out DIR --summary-only      # tables from finished runs

1. Warm-up: the study config's supervised warm-up (``sft``), once, in BF16; its checkpoint is the
   starting policy of every run, so all modes start from the same weights.
2. Runs: ``jetrl train benchmarks/configs/mismatch_study.yaml`` for every precision mode (bf16,
   fp16, fp8 = unified, bf16-train+fp8-rollout) without and with token TIS, the same seed, data
   order and steps; ``--parallel`` of them at a time share the GPU (each is its own one-process job).
3. Speed: ``jetrl train benchmarks/configs/qwen3_8b_dims.yaml`` in FP8 and in BF16.
4. Summary: the tables, printed last, and ``DIR/study.json``. Every run keeps its log and
   ``metrics.jsonl`` in ``DIR/<run>/``. Plots: ``benchmarks/mismatch_plots.py DIR`` (matplotlib).

Per step every run records reward, response length, entropy and the mismatch metrics
(``rollout_corr/k3_kl``, ``training/rollout_probs_diff_mean``, ``token_mult_prob_error``);
``rl_summary.summarise`` reads them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from rl_summary import summarise  # benchmarks/, the script's own directory

ROOT = Path(__file__).resolve().parents[1]
STUDY_CONFIG = ROOT / "benchmarks" / "configs" / "mismatch_study.yaml"
SPEED_CONFIG = ROOT / "benchmarks" / "configs" / "qwen3_8b_dims.yaml"
MODES = ("bf16", "fp16", "fp8", "bf16-train+fp8-rollout")
CORRECTIONS = ("none", "token_tis")
PHASES = ("generate", "logprobs", "update", "sync", "step")


@dataclass(frozen=True)
class Run:
    name: str
    config: Path
    overrides: tuple[str, ...]


def study_runs(out: Path, checkpoint: Path, modes: Sequence[str] = MODES,
               corrections: Sequence[str] = CORRECTIONS, steps: int | None = None) -> list[Run]:
    """Every (mode, correction) run, from the warm-up's ``checkpoint``."""
    runs = []
    for mode in modes:
        for corr in corrections:
            name = f"{mode.replace('+', '_')}__{corr}"
            overrides = [f"run.dir={out / name}", f"precision.mode={mode}", f"algo.correction.mode={corr}",
                         f"model.checkpoint={checkpoint}", "sft.steps=0"]
            if steps is not None:
                overrides.append(f"run.steps={steps}")
            runs.append(Run(name, STUDY_CONFIG, tuple(overrides)))
    return runs


def speed_runs(out: Path, steps: int | None = None) -> list[Run]:
    extra = () if steps is None else (f"run.steps={steps}",)
    return [Run(f"speed_{mode}", SPEED_CONFIG, (f"run.dir={out / f'speed_{mode}'}", f"precision.mode={mode}", *extra))
            for mode in ("fp8", "bf16")]


def tables(results: dict[str, dict]) -> str:
    """The study's tables as text (markdown), from ``rl_summary.summarise`` results keyed by run
    name: reward (first and last 10 steps, last eval), mean mismatch, length and entropy; seconds
    per phase; and the FP8 speed-up of the Qwen3-8B-shape runs."""
    def f(v, fmt):
        return "—" if v is None or v != v else format(v, fmt)

    lines = ["| run | reward, first 10 | reward, last 10 | eval, last | k3 KL | probs diff | "
             "token_mult_prob_error | length | entropy |",
             "|---|---|---|---|---|---|---|---|---|"]
    study = {k: v for k, v in results.items() if not k.startswith("speed_")}
    for name, r in study.items():
        eval_last = r["eval"][-1][1] if r["eval"] else None
        lines.append(f"| {name} | {f(r['reward_first10'], '.3f')} | {f(r['reward_last10'], '.3f')} | "
                     f"{f(eval_last, '.3f')} | {f(r['k3_kl'], '.2e')} | {f(r['probs_diff'], '.2e')} | "
                     f"{f(r['token_mult_prob_error'], '.4f')} | {f(r['response_length'], '.1f')} | "
                     f"{f(r['entropy'], '.3f')} |")
    lines += ["", "| run | " + " | ".join(f"{p} s" for p in PHASES) + " | tokens/s/GPU |",
              "|---|" + "---|" * (len(PHASES) + 1)]
    for name, r in results.items():
        s = r["seconds"]
        lines.append(f"| {name} | " + " | ".join(f(s[p], ".3f") for p in PHASES)
                     + f" | {f(r['tokens_per_s_per_gpu'], ',.0f')} |")
    fp8, bf16 = results.get("speed_fp8"), results.get("speed_bf16")
    if fp8 and bf16:
        lines += ["", "| Qwen3-8B shapes, BF16 / FP8 time | training (logprobs + update) | rollout (generate) | "
                      "sync | step |", "|---|---|---|---|---|"]
        def ratio(*phases):
            a = sum(bf16["seconds"][p] or 0 for p in phases)
            b = sum(fp8["seconds"][p] or 0 for p in phases)
            return f"{a / b:.2f}×" if b else "—"
        lines.append(f"| speed-up | {ratio('logprobs', 'update')} | {ratio('generate')} | {ratio('sync')} | "
                     f"{ratio('step')} |")
    return "\n".join(lines)


# -- running ------------------------------------------------------------------------------------

def _command(run: Run) -> list[str]:
    return [sys.executable, "-m", "megatron_jetrl.cli", "train", str(run.config), *run.overrides]


def run_all(runs: Sequence[Run], out: Path, parallel: int, timeout_s: float) -> dict[str, int]:
    """Start ``runs`` ``parallel`` at a time (one-process jobs sharing the GPU); each writes
    ``out/<name>/train.log``. Returns exit status per run (124: past ``timeout_s``)."""
    pending, active, codes = list(runs), {}, {}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # Runs sharing the host's cores: each takes its share of CPU threads, not all of them.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, min(parallel, len(runs))))))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # each run is a job of its own
    while pending or active:
        while pending and len(active) < parallel:
            run = pending.pop(0)
            (out / run.name).mkdir(parents=True, exist_ok=True)
            log = open(out / run.name / "train.log", "w")
            active[run.name] = (subprocess.Popen(_command(run), stdout=log, stderr=subprocess.STDOUT, env=env,
                                                 cwd=ROOT), log, time.monotonic())
            print(f"[study] started {run.name}", flush=True)
        for name, (proc, log, start) in list(active.items()):
            code = proc.poll()
            if code is None and time.monotonic() - start > timeout_s:
                proc.kill()
                code = 124
            if code is not None:
                log.close()
                codes[name] = code
                del active[name]
                print(f"[study] {name} exited {code} after {time.monotonic() - start:.0f} s", flush=True)
                if code != 0:  # the reason, where the tables will show a gap
                    tail = (out / name / "train.log").read_text(errors="replace").splitlines()[-12:]
                    print("\n".join(f"[study]   {line}" for line in tail), flush=True)
        time.sleep(1)
    return codes


def warmup_checkpoint(out: Path, timeout_s: float, steps: int | None = None) -> Path:
    """The BF16 warm-up's actor checkpoint (run once; reused when it exists)."""
    root = out / "warmup"
    latest = root / "sft" / "checkpoints" / "latest"
    if not latest.is_file():
        overrides = (f"run.dir={root}", "precision.mode=bf16", "run.steps=1",
                     *(() if steps is None else (f"sft.steps={steps}",)))
        codes = run_all([Run("warmup", STUDY_CONFIG, overrides)], out, 1, timeout_s)
        if codes["warmup"] != 0 or not latest.is_file():
            sys.exit(f"the warm-up failed (exit {codes['warmup']}); see {root / 'train.log'}")
    return root / "sft" / "checkpoints" / latest.read_text().strip() / "actor"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the config's)")
    ap.add_argument("--warmup-steps", type=int, default=None, help="supervised warm-up steps (default: the config's)")
    ap.add_argument("--speed-steps", type=int, default=None, help="steps of each speed run (default: the config's)")
    ap.add_argument("--parallel", type=int, default=8,
                    help="runs sharing the GPU at a time (default 8: all of them, so that every run sees the "
                         "same contention and their step times compare)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--no-speed", action="store_true", help="skip the Qwen3-8B-shape speed runs")
    ap.add_argument("--summary-only", action="store_true", help="only the tables of the runs in --out")
    ap.add_argument("--timeout", type=float, default=900, help="seconds a run may take (default 900)")
    args = ap.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    codes: dict[str, int] = {}
    if not args.summary_only:
        checkpoint = warmup_checkpoint(out, args.timeout, args.warmup_steps)
        codes.update(run_all(study_runs(out, checkpoint, args.modes, steps=args.steps), out, args.parallel,
                             args.timeout))
        if not args.no_speed:
            codes.update(run_all(speed_runs(out, args.speed_steps), out, 1, args.timeout))
    results = {}
    for run in [*study_runs(out, Path("-"), args.modes), *speed_runs(out)]:
        metrics = out / run.name / "metrics.jsonl"
        if metrics.is_file():
            results[run.name] = summarise(metrics)
        elif not args.summary_only or run.name in codes:
            print(f"[study] {run.name}: no metrics (exit {codes.get(run.name)}; {out / run.name / 'train.log'})")
    (out / "study.json").write_text(json.dumps({"results": results, "exit_codes": codes}, indent=1))
    print(tables(results))
    return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
