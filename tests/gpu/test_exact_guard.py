"""The exact rollout's guards on a real engine (``precision.exact``, vLLM): a fault put into the engine's
weights (tests/gpu/exact_guard_run.py sets the lowest bit of 128 of its FP8 codes) makes its logprobs
differ from the trainer's, and
- from the start (after the first sync): the start-up self-check refuses to begin (exit 3, one line);
- from step 2's rollout on, ``precision.exact_mismatch=stop`` (the default): step 2's update finds it and
  the job stops before that step's optimizer step (exit 3, one line, nothing of step 2 logged or saved);
- from step 2's rollout on, ``precision.exact_mismatch=correct``: steps 2 and 3 recompute their old
  logprobs, apply the configured correction and go on (``exact/corrected_step`` 1), exit 0;
- the negative control: no fault, every step exact (``rollout_corr/unequal_tokens`` 0, none corrected).
With the guard as the check, on two GPUs: several rollout replicas (trainer DP 2, one engine a rank)
and trainer pipeline stages (PP 2, an engine unstaged on each rank) run every step exact; on four,
trainer TP 2 × DP 2 with two engines of rollout TP 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu.conftest import requires_vllm

pytestmark = [pytest.mark.gpu, requires_vllm]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "configs" / "tiny_countdown.yaml"
RUN = Path(__file__).with_name("exact_guard_run.py")
EXACT = ("rollout.engine=vllm", "precision.mode=fp8", "precision.exact=true", "run.steps=3", "run.save_every=1",
         "run.eval_every=0", "sft.steps=0", "log.console=false")


def _run(tmp_path: Path, perturb_from: int, *overrides: str,
         nproc: int = 1) -> tuple[subprocess.CompletedProcess, list[dict]]:
    run_dir = tmp_path / "run"
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(nproc))).split(",")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(gpus[:nproc]))
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    given = {o.split("=", 1)[0] for o in overrides}  # the CLI refuses a key given twice: a test's own wins
    defaults = [o for o in EXACT if o.split("=", 1)[0] not in given]
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                     f"--nproc-per-node={nproc}"]
    proc = subprocess.run([*launcher, str(RUN), "--perturb-from", str(perturb_from), "--", str(CONFIG),
                           f"run.dir={run_dir}", *defaults, *overrides], env=env, capture_output=True, text=True,
                          timeout=900)
    (tmp_path / "run.log").write_text(proc.stdout + proc.stderr)
    metrics = run_dir / "metrics.jsonl"
    lines = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.is_file() else []
    return proc, [m for m in lines if m.get("step", 0) > 0]


def _errors(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("exact rollout error:")]


def test_an_engine_off_the_trainers_weights_at_start_is_refused(tmp_path):
    proc, steps = _run(tmp_path, 1)
    assert proc.returncode == 3, proc.stderr[-4000:]
    errors = _errors(proc)
    assert len(errors) == 1 and "start-up self-check found" in errors[0] and "vLLM 0.2" in errors[0], errors
    assert steps == []


def test_a_step_off_the_trainer_stops_the_job_before_its_update(tmp_path):
    proc, steps = _run(tmp_path, 2)
    assert proc.returncode == 3, proc.stderr[-4000:]
    errors = _errors(proc)
    assert len(errors) == 1 and "at step 2" in errors[0] and "not applied" in errors[0], errors
    assert [m["step"] for m in steps] == [1] and steps[0]["rollout_corr/unequal_tokens"] == 0
    saved = sorted(p.name for p in (tmp_path / "run").rglob("step_*") if p.is_dir())
    assert "step_00000001" in saved and not any(name.startswith("step_00000002") for name in saved), saved


def test_with_exact_mismatch_correct_the_steps_off_are_corrected(tmp_path):
    proc, steps = _run(tmp_path, 2, "precision.exact_mismatch=correct", "algo.correction.mode=token_tis")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert [m["exact/corrected_step"] for m in steps] == [0, 1, 1]
    assert all(m["exact/unequal_tokens"] > 0 for m in steps[1:]) and steps[0]["rollout_corr/unequal_tokens"] == 0
    assert "WARNING: precision.exact: at step 2" in proc.stdout + proc.stderr


def test_without_a_fault_every_step_is_exact(tmp_path):
    proc, steps = _run(tmp_path, 0, "log.console=true")  # the self-check's line is the console's
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all(m["rollout_corr/unequal_tokens"] == 0 and m["exact/corrected_step"] == 0 for m in steps)
    assert "start-up self-check's" in proc.stdout + proc.stderr


def _two_gpus() -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs; this host has {torch.cuda.device_count()}")


def _every_step_exact(proc, steps) -> None:
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all(m["rollout_corr/unequal_tokens"] == 0 and m["exact/corrected_step"] == 0 for m in steps), steps


def test_several_rollout_replicas_are_exact(tmp_path):
    """Trainer DP 2 at TP 1, rollout TP 1: two engines, one a rank, each sampling its share; the trainer
    packs every rank's samples its own way, and every token's logprob is the engine's."""
    _two_gpus()
    _every_step_exact(*_run(tmp_path, 0, nproc=2))


def test_tp_2_with_two_rollout_replicas_is_exact(tmp_path):
    """Trainer TP 2 × DP 2 on 4 GPUs, two engines of rollout TP 2 (the recipes' shape at small scale;
    the tiny model with 2 KV heads, so TP 2 splits them): every step exact."""
    import torch

    if torch.cuda.device_count() < 4:
        pytest.skip(f"TP 2 x DP 2 needs 4 GPUs; this host has {torch.cuda.device_count()}")
    _every_step_exact(*_run(tmp_path, 0, "actor.parallel.tp=2", "rollout.vllm.tensor_parallel_size=2",
                            "model.config.num_key_value_heads=2", nproc=4))


def test_trainer_pipeline_stages_are_exact(tmp_path):
    """Trainer PP 2 (two stages, the last one holding the LM head and the logprob), an engine unstaged on
    each rank (rollout TP 1): the per-layer math is the same, so every step must be exact (what lets
    precision.exact.EXACT_MAX_PP be 2)."""
    _two_gpus()
    _every_step_exact(*_run(tmp_path, 0, "actor.parallel.pp=2", nproc=2))
