"""The mismatch study's plumbing (benchmarks/mismatch_study.py, mismatch_plots.py): every run it
starts is a valid job, the speed config fits an H100, and its summary, tables and plots compute
what they say from metrics.jsonl files. The metrics here are made up for the arithmetic; the
study's real numbers come from the GPU host (docs/results.md)."""

import json
import sys
from pathlib import Path

import pytest

from benchmarks import mismatch_plots as plots
from benchmarks import mismatch_study as study
from megatron_jetrl.job import load_data, load_job, resolve
from megatron_jetrl.job.estimate import GPU_MEMORY_GIB, GiB

ROOT = Path(__file__).resolve().parents[2]


def test_every_run_is_a_valid_job(tmp_path):
    runs = study.study_runs(tmp_path, tmp_path / "warmup" / "actor", steps=5)
    assert len(runs) == 8 and len({r.name for r in runs}) == 8
    seen = set()
    for run in runs:
        job = load_job(run.config, list(run.overrides))
        resolved = resolve(job, 1)
        assert job.run.dir == str(tmp_path / run.name) and job.run.steps == 5 and job.sft.steps == 0
        assert job.model.checkpoint == str(tmp_path / "warmup" / "actor")
        seen.add((job.precision.mode.value, job.algo.correction.mode))
        assert job.rollout.sampling.max_new_tokens >= 3 * 40  # chain's 119-character answers fit
    assert seen == {(m, c) for m in study.MODES for c in study.CORRECTIONS}
    load_data(job, resolved)  # the chain data and its tokenizer load


def test_speed_runs_fit_an_h100():
    for run in study.speed_runs(Path("/tmp/x")):
        job = load_job(run.config, list(run.overrides))
        resolved = resolve(job, 1)
        assert resolved.memory.fits(GPU_MEMORY_GIB["H100"] * GiB), run.name
        assert resolved.bridge.dims.hidden_size == 4096


def _rows(n, reward, k3, seconds):
    rows = []
    for step in range(1, n + 1):
        rows.append({"step": step, "reward/mean": reward(step), "rollout_corr/k3_kl": k3,
                     "training/rollout_probs_diff_mean": k3 * 10, "token_mult_prob_error": 1 + k3,
                     "response/length_mean": 100.0, "actor/entropy": 0.5,
                     **{f"timing/{p}_s": v for p, v in seconds.items()}, "perf/tokens_per_s_per_gpu": 1000.0})
        if step % 10 == 0:
            rows.append({"step": step, "eval/reward": reward(step) / 2})
    return rows


def _write(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_summary_and_tables(tmp_path):
    secs = {"generate": 2.0, "logprobs": 1.0, "update": 3.0, "sync": 0.5, "step": 6.5}
    rows = _rows(20, lambda s: s / 100, 1e-3, secs)
    rows[0]["timing/step_s"] = 100.0  # step 1 (warm-up) is left out of the timing means
    rows[3]["memory/update_peak_allocated_gib"] = 7.0
    rows[5]["memory/update_peak_allocated_gib"] = 9.0
    for row in rows:
        if "timing/step_s" in row:
            row["memory/update_alloc_retries"] = float(row["step"] % 3)
            row["actor/forward_backward_s"] = 2.5 + row["step"] / 100
    s = study.summarise(_write(tmp_path / "fp8__none.metrics.jsonl", rows))
    assert s["alloc_retries_per_step"] == {"update": [float(step % 3) for step in range(2, 21)]}  # timed: 2..
    assert s["update_split_per_step"] == {"forward_backward_s": [2.5 + step / 100 for step in range(2, 21)]}
    assert s["steps"] == 20
    assert s["reward_first10"] == pytest.approx(sum(range(1, 11)) / 10 / 100)
    assert s["reward_last10"] == pytest.approx(sum(range(11, 21)) / 10 / 100)
    assert s["eval"] == [(10, 0.05), (20, 0.1)]
    assert s["k3_kl"] == pytest.approx(1e-3) and s["probs_diff"] == pytest.approx(1e-2)
    assert s["seconds"]["step"] == pytest.approx(6.5)
    assert s["memory_gib"] == {"update_peak_allocated": 9.0}
    fast = {"generate": 1.0, "logprobs": 0.5, "update": 1.5, "sync": 0.5, "step": 3.5}
    results = {"fp8__none": s,
               "speed_fp8": study.summarise(_write(tmp_path / "a.jsonl", _rows(4, lambda s: 0, 0, fast))),
               "speed_bf16": study.summarise(_write(tmp_path / "b.jsonl", _rows(4, lambda s: 0, 0, secs)))}
    text = study.tables(results)
    assert "| fp8__none | 0.055 | 0.155 | 0.100 | 1.00e-03 | 1.00e-02 | 1.0010 | 100.0 | 0.500 |" in text
    assert "| speed-up | 2.00× | 2.00× | 1.00× | 1.86× |" in text


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib draws the study plots: pip install matplotlib")
    secs = {"generate": 1.0, "logprobs": 1.0, "update": 1.0, "sync": 0.1, "step": 3.1}
    for mode in ("bf16", "fp8", "bf16-train_fp8-rollout"):
        for corr in ("none", "token_tis"):
            d = tmp_path / f"{mode}__{corr}"
            d.mkdir()
            k3 = 1e-2 if mode.startswith("bf16-train") else 1e-7
            _write(d / "metrics.jsonl", _rows(20, lambda s: s / 20, k3, secs))
    seed2 = tmp_path / "seed2"
    for mode in ("bf16", "fp8"):  # a second seed of part of the study: drawn and averaged where present
        d = seed2 / f"{mode}__none"
        d.mkdir(parents=True)
        _write(d / "metrics.jsonl", _rows(20, lambda s: s / 40, 1e-6, secs))
    written = plots.plot([tmp_path, seed2], tmp_path / "fig")
    assert [p.name for p in written] == ["mismatch_reward.png", "mismatch_k3.png", "mismatch_probs_diff.png"]
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000
    assert plots.smooth([1, 2, 3, 4, 5, 6], 3) == [1, 1.5, 2, 3, 4, 5]
    assert plots.mean_series([([1, 2, 3], [1.0, 2.0, 3.0]), ([2, 3], [4.0, 5.0])]) == ([2, 3], [3.0, 4.0])


def test_mean_over_seeds(tmp_path):
    secs = {"generate": 2.0, "logprobs": 1.0, "update": 3.0, "sync": 0.5, "step": 6.5}
    a = study.summarise(_write(tmp_path / "a.jsonl", _rows(20, lambda s: 0.1, 1e-3, secs)))
    b = study.summarise(_write(tmp_path / "b.jsonl", _rows(20, lambda s: 0.3, 3e-3, {**secs, "step": 8.5})))
    mean = study.mean_results([{"fp8__none": a, "bf16__none": a}, {"fp8__none": b}])
    assert mean["fp8__none"]["reward_last10"] == pytest.approx(0.2) and mean["fp8__none"]["seeds"] == 2
    assert mean["fp8__none"]["k3_kl"] == pytest.approx(2e-3)
    assert mean["fp8__none"]["seconds"]["step"] == pytest.approx(7.5)
    assert mean["fp8__none"]["eval"] == [(20, pytest.approx(0.1))]  # the mean last eval (0.05, 0.15)
    assert mean["bf16__none"]["seeds"] == 1 and mean["bf16__none"]["reward_last10"] == pytest.approx(0.1)
    assert "| fp8__none | 0.200 | 0.200 | 0.100 | 2.00e-03 |" in study.tables(mean)


def test_runs_past_the_budget_are_stopped_and_the_rest_not_started(tmp_path, monkeypatch):
    import time

    sleeper, never = study.Run("sleeper", Path("-"), ()), study.Run("never", Path("-"), ())
    monkeypatch.setattr(study, "_command", lambda run: [sys.executable, "-c", "import time; time.sleep(60)"])
    t0 = time.monotonic()
    codes = study.run_all([sleeper, never], tmp_path, parallel=1, timeout_s=600, deadline=time.monotonic() + 2)
    assert codes == {"sleeper": 124, "never": None} and time.monotonic() - t0 < 30
    assert (tmp_path / "sleeper" / "train.log").is_file() and not (tmp_path / "never").exists()
