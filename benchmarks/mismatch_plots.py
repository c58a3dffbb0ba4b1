"""Plots of the mismatch study (benchmarks/mismatch_study.py): reward and mismatch vs step for the
four precision modes, without (solid) and with (dashed) token TIS. PNG files, matplotlib.

    python benchmarks/mismatch_plots.py STUDY_DIR --out docs/figures

Writes ``mismatch_reward.png`` (train reward, smoothed over 5 steps, and eval reward),
``mismatch_k3.png`` (rollout-vs-trainer k3 KL, log scale) and ``mismatch_probs_diff.png``
(mean |p_rollout - p_trainer|, log scale).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

COLORS = {"bf16": "tab:blue", "fp16": "tab:green", "fp8": "tab:red", "bf16-train_fp8-rollout": "tab:orange"}
LABELS = {"bf16": "BF16", "fp16": "FP16", "fp8": "FP8 unified", "bf16-train_fp8-rollout": "BF16 train + FP8 rollout"}
STYLES = {"none": "-", "token_tis": "--"}


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None and "timing/step_s" in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def smooth(values: list[float], k: int = 5) -> list[float]:
    """Trailing mean over up to ``k`` values."""
    return [sum(values[max(0, i - k + 1):i + 1]) / (i + 1 - max(0, i - k + 1)) for i in range(len(values))]


def runs(study: Path) -> dict[tuple[str, str], list[dict]]:
    out = {}
    for metrics in sorted(study.glob("*__*/metrics.jsonl")):
        mode, corr = metrics.parent.name.split("__")
        out[(mode, corr)] = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return out


def plot(study: Path, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = runs(study)
    if not data:
        raise SystemExit(f"no runs (<mode>__<correction>/metrics.jsonl) under {study}")
    out.mkdir(parents=True, exist_ok=True)
    written = []

    def line(ax, mode, corr, xs, ys, **kw):
        ax.plot(xs, ys, STYLES.get(corr, ":"), color=COLORS.get(mode, "black"),
                label=f"{LABELS.get(mode, mode)}{' + TIS' if corr == 'token_tis' else ''}", **kw)

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (mode, corr), rows in data.items():
        xs, ys = series(rows, "reward/mean")
        line(a, mode, corr, xs, smooth(ys))
        evals = [(r["step"], r["eval/reward"]) for r in rows if r.get("eval/reward") is not None]
        if evals:
            line(b, mode, corr, [e[0] for e in evals], [e[1] for e in evals], marker="o", markersize=3)
    a.set(title="train reward (5-step mean)", xlabel="RL step", ylabel="reward")
    b.set(title="eval reward (greedy, held-out)", xlabel="RL step")
    a.legend(fontsize=8)
    fig.tight_layout()
    written.append(out / "mismatch_reward.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    for key, name, title in (("rollout_corr/k3_kl", "mismatch_k3.png", "rollout vs trainer: k3 KL per token"),
                             ("training/rollout_probs_diff_mean", "mismatch_probs_diff.png",
                              "rollout vs trainer: mean |p_rollout - p_trainer|")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for (mode, corr), rows in data.items():
            xs, ys = series(rows, key)
            line(ax, mode, corr, xs, [max(y, 1e-12) for y in ys])
        ax.set(title=title, xlabel="RL step", yscale="log")
        ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(out / name)
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("study", type=Path)
    ap.add_argument("--out", type=Path, default=Path("docs/figures"))
    args = ap.parse_args()
    for path in plot(args.study, args.out):
        print(path)


if __name__ == "__main__":
    main()
