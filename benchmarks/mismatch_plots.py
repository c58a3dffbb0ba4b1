"""Plots of the mismatch study (benchmarks/mismatch_study.py): reward and mismatch vs step for the
four precision modes, without and with token TIS. PNG files, matplotlib.

    python -m benchmarks.mismatch_plots STUDY_DIR [STUDY_DIR ...] --out docs/figures

Several directories are several seeds of the same study: each seed is a thin line, their mean a
thick one. Writes ``mismatch_reward.png`` (train reward, smoothed over 5 steps, and greedy eval
reward), ``mismatch_k3.png`` (rollout-vs-trainer k3 KL per token, log scale) and
``mismatch_probs_diff.png`` (mean |p_rollout - p_trainer|, log scale); one column of panels per
correction (none, token TIS).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from benchmarks.rl_summary import eval_points, read_rows, train_rows

COLORS = {"bf16": "tab:blue", "fp16": "tab:green", "fp8": "tab:red", "bf16-train_fp8-rollout": "tab:orange"}
LABELS = {"bf16": "BF16", "fp16": "FP16", "fp8": "FP8 unified", "bf16-train_fp8-rollout": "BF16 train + FP8 rollout"}
CORRECTION_TITLES = {"none": "no correction", "token_tis": "token TIS (C = 2)"}

Series = tuple[list[int], list[float]]


def series(rows: list[dict], key: str) -> Series:
    """(steps, values) of ``key`` over the RL steps (not the step-0 eval row)."""
    pts = [(r["step"], r[key]) for r in train_rows(rows) if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def eval_series(rows: list[dict]) -> Series:
    pts = eval_points(rows)
    return [p[0] for p in pts], [p[1] for p in pts]


def smooth(values: list[float], k: int = 5) -> list[float]:
    """Trailing mean over up to ``k`` values."""
    return [sum(values[max(0, i - k + 1):i + 1]) / (i + 1 - max(0, i - k + 1)) for i in range(len(values))]


def mean_series(curves: Sequence[Series]) -> Series:
    """The mean over ``curves`` at the steps all of them have."""
    common = sorted(set.intersection(*(set(xs) for xs, _ in curves))) if curves else []
    lookups = [dict(zip(xs, ys, strict=True)) for xs, ys in curves]
    return common, [sum(d[s] for d in lookups) / len(lookups) for s in common]


def runs(studies: Sequence[Path]) -> dict[tuple[str, str], list[list[dict]]]:
    """(mode, correction) -> the metrics rows of that run in each study directory."""
    out: dict[tuple[str, str], list[list[dict]]] = {}
    for study in studies:
        for metrics in sorted(study.glob("*__*/metrics.jsonl")):
            mode, corr = metrics.parent.name.split("__")
            out.setdefault((mode, corr), []).append(read_rows(metrics))
    return out


def plot(studies: Sequence[Path] | Path, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    studies = [studies] if isinstance(studies, Path) else list(studies)
    data = runs(studies)
    if not data:
        raise SystemExit(f"no runs (<mode>__<correction>/metrics.jsonl) under {', '.join(map(str, studies))}")
    corrections = [c for c in CORRECTION_TITLES if any(k[1] == c for k in data)]
    seeds = max(len(v) for v in data.values())
    note = f" (mean of {seeds} seeds)" if seeds > 1 else ""
    out.mkdir(parents=True, exist_ok=True)
    written = []

    def draw(ax, mode, curves, transform=lambda ys: ys, **kw):
        color = COLORS.get(mode, "black")
        if len(curves) > 1:
            for xs, ys in curves:
                ax.plot(xs, transform(ys), color=color, alpha=0.25, linewidth=0.8)
        xs, ys = mean_series(curves)
        ax.plot(xs, transform(ys), color=color, label=LABELS.get(mode, mode), linewidth=1.8, **kw)

    fig, axes = plt.subplots(2, len(corrections), figsize=(6 * len(corrections), 8), squeeze=False, sharey="row")
    for col, corr in enumerate(corrections):
        for (mode, c), per_seed in data.items():
            if c != corr:
                continue
            draw(axes[0][col], mode, [series(rows, "reward/mean") for rows in per_seed], smooth)
            draw(axes[1][col], mode, [eval_series(rows) for rows in per_seed], marker="o", markersize=3)
        axes[0][col].set(title=f"train reward, 5-step mean: {CORRECTION_TITLES[corr]}{note}", xlabel="RL step",
                         ylabel="reward")
        axes[1][col].set(title=f"eval reward (greedy, fixed prompts): {CORRECTION_TITLES[corr]}", xlabel="RL step",
                         ylabel="reward")
        axes[0][col].legend(fontsize=8)
    fig.tight_layout()
    written.append(out / "mismatch_reward.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    for key, name, title in (("rollout_corr/k3_kl", "mismatch_k3.png", "k3 KL(rollout ‖ trainer) per token"),
                             ("training/rollout_probs_diff_mean", "mismatch_probs_diff.png",
                              "mean |p_rollout − p_trainer|")):
        fig, axes = plt.subplots(1, len(corrections), figsize=(6 * len(corrections), 4.5), squeeze=False,
                                 sharey=True)
        for col, corr in enumerate(corrections):
            ax = axes[0][col]
            for (mode, c), per_seed in data.items():
                if c == corr:
                    draw(ax, mode, [series(rows, key) for rows in per_seed], lambda ys: [max(y, 1e-12) for y in ys])
            ax.set(title=f"{title}: {CORRECTION_TITLES[corr]}{note}", xlabel="RL step", yscale="log")
            ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(out / name)
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("studies", type=Path, nargs="+", help="study directories (one per seed)")
    ap.add_argument("--out", type=Path, default=Path("docs/figures"))
    args = ap.parse_args()
    for path in plot(args.studies, args.out):
        print(path)


if __name__ == "__main__":
    main()
