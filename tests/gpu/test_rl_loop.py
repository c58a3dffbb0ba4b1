"""The RL loop end to end on one GPU: ``jetrl train examples/configs/tiny_countdown.yaml`` learns
(reward rises clearly) in unified FP8 and in BF16, with the hf engine and with vLLM (also with the
exact rollout, whose k3 is 0 at every step, with a BF16 and an FP8 KV cache), and a run killed by
SIGTERM (SLURM preemption) continues from its checkpoint exactly where an uninterrupted run goes,
with either engine and in the exact modes.

Each run is a real ``jetrl train`` process. Metrics files are copied to $JETRL_GPU_OUT/rl/ when
that is set (hosts/offline/check.sh sets it, and summarises them with benchmarks/rl_summary.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_jetrl.runtime import EXIT_PREEMPTED
from tests.gpu.conftest import requires_vllm

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "configs" / "tiny_countdown.yaml"


def _cmd(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "megatron_jetrl.cli", "train", str(CONFIG), f"run.dir={run_dir}", *overrides]


def _env() -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def _train(run_dir: Path, *overrides: str, timeout: int = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run(_cmd(run_dir, *overrides), env=_env(), capture_output=True, text=True, timeout=timeout)
    (run_dir.parent / f"{run_dir.name}.log").write_text(proc.stdout + proc.stderr)
    return proc


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _keep(run_dir: Path, name: str) -> None:
    out = os.environ.get("JETRL_GPU_OUT")
    if out:
        dest = Path(out) / "rl"
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy(run_dir / "metrics.jsonl", dest / f"{name}.metrics.jsonl")


def _check_ok(proc: subprocess.CompletedProcess, code: int = 0) -> None:
    assert proc.returncode == code, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


MODES = {"fp8": ("precision.mode=fp8", "precision.exact=false"),  # the default rollout (auto would be exact on vLLM)
         "bf16": ("precision.mode=bf16", "precision.exact=false"),
         "fp8-exact": ("precision.mode=fp8", "precision.exact=true"),
         "fp8kv-exact": ("precision.mode=fp8", "precision.exact=true", "rollout.vllm.kv_cache_dtype=fp8")}
"""Precision overrides per mode; ``fp8-exact``: the exact rollout (vLLM's logprobs are the trainer's);
``fp8kv-exact``: the same with an FP8 KV cache (its scales measured by the update, checkpointed)."""

RESUME_RUNS = {"hf": ("hf", "fp8"), "vllm": ("vllm", "fp8"), "vllm-exact": ("vllm", "fp8-exact"),
               "vllm-exact-kv": ("vllm", "fp8kv-exact")}
"""Kill-and-resume runs: engine and mode of each."""


@pytest.mark.parametrize("mode, engine", [
    ("fp8", "hf"), ("bf16", "hf"), pytest.param("fp8", "vllm", marks=requires_vllm),
    pytest.param("fp8-exact", "vllm", marks=requires_vllm), pytest.param("fp8kv-exact", "vllm", marks=requires_vllm)])
def test_tiny_example_learns(tmp_path, mode, engine):
    run_dir = tmp_path / f"tiny_{mode}_{engine}"
    start = time.perf_counter()
    proc = _train(run_dir, *MODES[mode], f"rollout.engine={engine}", "log.console=true")
    wall = time.perf_counter() - start
    _check_ok(proc)
    rows = _metrics(run_dir)
    (run_dir / "wall_seconds").write_text(f"{wall:.1f}\n")
    _keep(run_dir, f"tiny_{mode}_{engine}")
    train = [r for r in rows if "reward/mean" in r]
    evals = [r for r in rows if r.get("eval/reward") is not None]
    assert len(train) == 100, [r["step"] for r in train]
    first = sum(r["reward/mean"] for r in train[:10]) / 10
    last = sum(r["reward/mean"] for r in train[-10:]) / 10
    print(f"{mode} {engine}: train reward first10 {first:.3f} last10 {last:.3f}; eval "
          f"{[round(r['eval/reward'], 3) for r in evals]}; wall {wall:.0f} s")
    # single steps jump by about +-0.08 (64 prompts), so compare 10-step means; the held-out greedy
    # reward (256 prompts) must end higher than where RL started
    assert last >= first + 0.08, (first, last)
    assert evals[-1]["eval/reward"] >= evals[0]["eval/reward"] + 0.05, evals
    k3 = [r["rollout_corr/k3_kl"] for r in train]
    if mode == "fp8":
        # unified FP8: the engine computes with the trainer's bytes, so the mismatch stays tiny
        assert max(k3) < 1e-3, k3
    if mode.endswith("exact"):  # every token's logprob equal, every step
        assert set(k3) == {0.0}, k3
        assert {r["rollout_corr/max_abs_dlogp"] for r in train} == {0.0}
        assert {r["rollout_corr/unequal_tokens"] for r in train} == {0.0}
    assert (run_dir / "tensorboard").is_dir() and any((run_dir / "tensorboard").iterdir())
    assert (run_dir / "config.yaml").is_file()
    assert (run_dir / "checkpoints" / "latest").is_file()


@pytest.mark.parametrize("engine", ["hf", *(pytest.param(e, marks=requires_vllm) for e in RESUME_RUNS if e != "hf")])
def test_kill_and_resume_continues_exactly(tmp_path, engine):
    """Killed after step 2 and run again: the same prompts, samples and rewards at every step (with an
    FP8 KV cache, the resumed engine gets the scales the checkpoint kept, not fresh ones)."""
    rollout_engine, mode = RESUME_RUNS[engine]
    short = ("run.steps=6", "run.save_every=0", "run.eval_every=0", "sft.steps=40",
             f"rollout.engine={rollout_engine}", *MODES[mode])
    whole = tmp_path / "whole"
    _check_ok(_train(whole, *short))
    want = {r["step"]: r for r in _metrics(whole)}

    killed = tmp_path / "killed"
    log = open(tmp_path / "killed_first.log", "w")
    proc = subprocess.Popen(_cmd(killed, *short), env=_env(), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        path = killed / "metrics.jsonl"
        if path.exists() and any(json.loads(x).get("step") == 2 for x in path.read_text().splitlines() if x):
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=300) == EXIT_PREEMPTED, (tmp_path / "killed_first.log").read_text()[-4000:]
    latest = (killed / "checkpoints" / "latest").read_text().strip()
    saved_step = int(latest.rsplit("_", 1)[1])
    assert 2 <= saved_step < 6, latest

    proc = _train(killed, *short)
    _check_ok(proc)
    assert "resumed from" in proc.stdout + proc.stderr
    got = {r["step"]: r for r in _metrics(killed)}
    _keep(whole, f"resume_whole_{engine}")
    _keep(killed, f"resume_killed_{engine}")
    assert sorted(got) == sorted(want) == list(range(1, 7)), (sorted(got), sorted(want))
    for step in range(1, 7):
        # the exact next batch: same prompts in the same order, every step
        assert got[step]["data/prompt_index_fingerprint"] == want[step]["data/prompt_index_fingerprint"], step
        # same weights after the resume: the samples and their rewards repeat
        assert got[step]["reward/mean"] == want[step]["reward/mean"], (step, got[step], want[step])
        if mode.endswith("exact"):
            assert got[step]["rollout_corr/k3_kl"] == 0.0, (step, got[step])


def test_kl_penalty_correction_dynamic_sampling_and_overlong(tmp_path):
    """The optional paths on the real actor: KL to the reference (parameters swapped in for one
    pass), token TIS, dynamic sampling, the soft overlong penalty; three steps."""
    run_dir = tmp_path / "options"
    proc = _train(run_dir, "run.steps=3", "run.eval_every=0", "sft.steps=20", "algo.loss.kl_coef=0.01",
                  "algo.correction.mode=token_tis", "data.dynamic_sampling.enabled=true",
                  "data.overlong.mode=soft", "data.overlong.buffer_tokens=8")
    _check_ok(proc)
    rows = [r for r in _metrics(run_dir) if "reward/mean" in r]
    _keep(run_dir, "options")
    assert len(rows) == 3
    for r in rows:
        assert r["actor/kl"] >= 0 and r["rollout_corr/is_weight_mean"] > 0, r
        assert r["dynamic_sampling/rounds"] >= 1
    # the first step's policy is the reference: the KL to it starts at ~0 and grows
    assert rows[0]["actor/kl"] < 1e-3 and rows[-1]["actor/kl"] > rows[0]["actor/kl"], [r["actor/kl"] for r in rows]
