"""The mismatch and speed study, one command on a GPU host:

    python -m benchmarks.mismatch_study --out DIR [--seed N] [--steps N] [--parallel 8] [--no-speed]
                                        [--budget SECONDS]
    python -m benchmarks.mismatch_study --summary-only --out DIR [--out DIR2 ...]   # tables (mean of seeds)

1. Warm-up: the study config's supervised warm-up (``sft``), once, in BF16; its checkpoint is the
   starting policy of every run, so all modes start from the same weights.
2. Runs: ``jetrl train benchmarks/configs/mismatch_study.yaml`` for every precision mode (bf16,
   fp16, fp8 = unified, bf16-train+fp8-rollout) without and with token TIS, the same seed, data
   order and steps; ``--parallel`` of them at a time share the GPU (each is its own one-process job).
3. Speed: ``jetrl train benchmarks/configs/qwen3_8b_dims.yaml`` in FP8 and in BF16.
4. Summary: the tables, printed last, and ``DIR/study.json``. Every run keeps its log and
   ``metrics.jsonl`` in ``DIR/<run>/``. Plots: ``python -m benchmarks.mismatch_plots DIR`` (matplotlib).

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

from benchmarks.rl_summary import TABLE_PHASES as PHASES
from benchmarks.rl_summary import summarise

ROOT = Path(__file__).resolve().parents[1]
STUDY_CONFIG = ROOT / "benchmarks" / "configs" / "mismatch_study.yaml"
SPEED_CONFIG = ROOT / "benchmarks" / "configs" / "qwen3_8b_dims.yaml"
MODES = ("bf16", "fp16", "fp8", "bf16-train+fp8-rollout")
CORRECTIONS = ("none", "token_tis")


@dataclass(frozen=True)
class Run:
    name: str
    config: Path
    overrides: tuple[str, ...]


def study_runs(out: Path, checkpoint: Path, modes: Sequence[str] = MODES,
               corrections: Sequence[str] = CORRECTIONS, steps: int | None = None,
               seed: int | None = None) -> list[Run]:
    """Every (mode, correction) run, from the warm-up's ``checkpoint``; ``seed`` (``run.seed``)
    changes the RL sampling, not the prompts (``data.seed``) or the starting weights."""
    runs = []
    for mode in modes:
        for corr in corrections:
            name = f"{mode.replace('+', '_')}__{corr}"
            overrides = [f"run.dir={out / name}", f"precision.mode={mode}", f"algo.correction.mode={corr}",
                         f"model.checkpoint={checkpoint}", "sft.steps=0"]
            if steps is not None:
                overrides.append(f"run.steps={steps}")
            if seed is not None:
                overrides.append(f"run.seed={seed}")
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


def mean_results(per_dir: Sequence[dict[str, dict]]) -> dict[str, dict]:
    """The mean over several studies (seeds) of each run's numbers that ``tables`` prints: a run
    missing from a study is left out of that mean; ``eval`` becomes one point, the mean last eval."""
    out = {}
    for name in dict.fromkeys(n for results in per_dir for n in results):
        rs = [results[name] for results in per_dir if name in results]

        def mean(values):
            values = [v for v in values if v is not None and v == v]
            return sum(values) / len(values) if values else float("nan")

        merged = {k: mean([r[k] for r in rs]) for k in ("reward_first10", "reward_last10", "k3_kl", "probs_diff",
                                                        "token_mult_prob_error", "response_length", "entropy",
                                                        "tokens_per_s_per_gpu")}
        merged["seconds"] = {p: mean([r["seconds"][p] for r in rs]) for p in PHASES}
        lasts = [r["eval"][-1] for r in rs if r["eval"]]
        merged["eval"] = [(lasts[0][0], mean([e[1] for e in lasts]))] if lasts else []
        merged["seeds"] = len(rs)
        out[name] = merged
    return out


def summaries(out: Path, modes: Sequence[str] = MODES) -> dict[str, dict]:
    """``rl_summary.summarise`` of every study and speed run with metrics under ``out``."""
    names = [r.name for r in (*study_runs(out, Path("-"), modes), *speed_runs(out))]
    return {n: summarise(out / n / "metrics.jsonl") for n in names if (out / n / "metrics.jsonl").is_file()}


# -- running ------------------------------------------------------------------------------------

def _command(run: Run) -> list[str]:
    return [sys.executable, "-m", "megatron_jetrl.cli", "train", str(run.config), *run.overrides]


def run_all(runs: Sequence[Run], out: Path, parallel: int, timeout_s: float,
            deadline: float = float("inf")) -> dict[str, int | None]:
    """Start ``runs`` ``parallel`` at a time (one-process jobs sharing the GPU); each writes
    ``out/<name>/train.log``. Returns exit status per run: 124 for one killed past ``timeout_s``
    or the ``deadline`` (``time.monotonic()``; its metrics so far stay), and None for one not
    started before the deadline."""
    pending, active, codes = list(runs), {}, {}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # Runs sharing the host's cores: each takes its share of CPU threads, not all of them.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, min(parallel, len(runs))))))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # each run is a job of its own
    while pending or active:
        if pending and time.monotonic() >= deadline:
            for run in pending:
                codes[run.name] = None
                print(f"[study] {run.name} not started: the study's --budget ran out", flush=True)
            pending = []
        while pending and len(active) < parallel:
            run = pending.pop(0)
            (out / run.name).mkdir(parents=True, exist_ok=True)
            log = open(out / run.name / "train.log", "w")
            active[run.name] = (subprocess.Popen(_command(run), stdout=log, stderr=subprocess.STDOUT, env=env,
                                                 cwd=ROOT), log, time.monotonic())
            print(f"[study] started {run.name}", flush=True)
        for name, (proc, log, start) in list(active.items()):
            code = proc.poll()
            if code is None and (time.monotonic() - start > timeout_s or time.monotonic() >= deadline):
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


def warmup_checkpoint(out: Path, timeout_s: float, steps: int | None = None,
                      deadline: float = float("inf")) -> Path:
    """The BF16 warm-up's actor checkpoint (run once; reused when it exists)."""
    root = out / "warmup"
    latest = root / "sft" / "checkpoints" / "latest"
    if not latest.is_file():
        overrides = (f"run.dir={root}", "precision.mode=bf16", "run.steps=1",
                     *(() if steps is None else (f"sft.steps={steps}",)))
        codes = run_all([Run("warmup", STUDY_CONFIG, overrides)], out, 1, timeout_s, deadline)
        if codes.get("warmup") != 0 or not latest.is_file():
            sys.exit(f"the warm-up failed (exit {codes.get('warmup')}); see {root / 'train.log'}")
    return root / "sft" / "checkpoints" / latest.read_text().strip() / "actor"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, action="append", required=True,
                    help="the study's directory; with --summary-only, one or more (seeds) to average")
    ap.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the config's)")
    ap.add_argument("--seed", type=int, default=None, help="run.seed of the RL runs (default: the config's)")
    ap.add_argument("--warmup-steps", type=int, default=None, help="supervised warm-up steps (default: the config's)")
    ap.add_argument("--speed-steps", type=int, default=None, help="steps of each speed run (default: the config's)")
    ap.add_argument("--parallel", type=int, default=8,
                    help="runs sharing the GPU at a time (default 8: all of them, so that every run sees the "
                         "same contention and their step times compare)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--no-speed", action="store_true", help="skip the Qwen3-8B-shape speed runs")
    ap.add_argument("--summary-only", action="store_true", help="only the tables of the runs in --out")
    ap.add_argument("--timeout", type=float, default=900, help="seconds a run may take (default 900)")
    ap.add_argument("--budget", type=float, default=float("inf"),
                    help="seconds the whole study may take: runs still going then are stopped (their metrics "
                         "so far are kept) and the tables printed, e.g. inside a device call's time limit")
    args = ap.parse_args()
    if args.summary_only:
        per_dir = [summaries(d.resolve(), args.modes) for d in args.out]
        if len(per_dir) > 1:
            for d, results in zip(args.out, per_dir, strict=True):
                print(f"## {d}\n\n{tables(results)}\n")
            print(f"## mean of {len(per_dir)} studies\n")
        print(tables(per_dir[0] if len(per_dir) == 1 else mean_results(per_dir)))
        return 0
    if len(args.out) != 1:
        ap.error("one --out runs a study (several are for --summary-only)")
    deadline = time.monotonic() + args.budget
    out = args.out[0].resolve()
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = warmup_checkpoint(out, args.timeout, args.warmup_steps, deadline)
    codes: dict[str, int | None] = {}
    codes.update(run_all(study_runs(out, checkpoint, args.modes, steps=args.steps, seed=args.seed), out,
                         args.parallel, args.timeout, deadline))
    if not args.no_speed:
        codes.update(run_all(speed_runs(out, args.speed_steps), out, 1, args.timeout, deadline))
    results = summaries(out, args.modes)
    for name, code in codes.items():
        if name not in results:
            print(f"[study] {name}: no metrics (exit {code}; {out / name / 'train.log'})")
    (out / "study.json").write_text(json.dumps({"results": results, "exit_codes": codes,
                                                "seed": args.seed}, indent=1))
    print(tables(results))
    return 0 if codes and all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
