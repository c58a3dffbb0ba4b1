"""``jetrl train --smoke`` as srun would start it: four processes given only SLURM's variables
rendezvous over gloo, agree on the rank layout, stop together on a signal sent to one of them with a
checkpoint and exit 75, and resume from it. (The same path under a real SLURM: tests/slurm.)"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from megatron_jetrl.launch import free_port
from megatron_jetrl.runtime import EXIT_PREEMPTED

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "configs" / "tiny_countdown.yaml"


def slurm_env(job_id, ntasks, rank, **extra):
    """The variables srun gives task ``rank`` of a one-node step, and no other launcher's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env.update(SLURM_JOB_ID=str(job_id), SLURM_STEP_ID="0", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank),
               SLURM_NODEID="0", SLURM_NTASKS=str(ntasks), SLURM_STEP_NODELIST="localhost",
               SLURM_STEP_TASKS_PER_NODE=str(ntasks), **extra)
    return env


def start(tmp_path, steps, tag, **extra):
    port = free_port()
    procs = []
    for rank in range(4):
        env = slurm_env(77, 4, rank, MASTER_PORT=str(port), PYTHONUNBUFFERED="1", **extra)
        with open(tmp_path / f"{tag}_rank{rank}.log", "w") as log:  # the child keeps its own handle
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "megatron_jetrl.cli", "train", str(CONFIG), "--smoke", "--smoke-step-seconds",
                 "0.2", f"run.dir={tmp_path / 'run'}", f"run.steps={steps}", "run.save_every=0",
                 "actor.parallel.tp=2", "model.config.num_key_value_heads=2", "data.prompts_per_step=2"],
                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path))
    return procs


def wait_all(procs, timeout=120):
    """Exit codes of ``procs``; on a timeout every one of them is killed before the error."""
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(1, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise


def test_smoke_launch_signal_checkpoint_and_resume(tmp_path):
    procs = start(tmp_path, steps=200, tag="first")
    log0 = tmp_path / "first_rank0.log"
    deadline = time.monotonic() + 90
    while "step 3/200 ok" not in log0.read_text():
        assert time.monotonic() < deadline and procs[0].poll() is None, log0.read_text()[-3000:]
        time.sleep(0.1)
    procs[2].send_signal(signal.SIGUSR1)  # one rank is told; every rank must stop at the same step
    codes = wait_all(procs)
    text = log0.read_text()
    assert codes == [EXIT_PREEMPTED] * 4, text[-3000:]
    assert "SIGUSR1 received" in text or "a signal received" in text
    for rank, (tp, dp) in enumerate([(0, 0), (1, 0), (0, 1), (1, 1)]):
        assert f"rank    {rank} host" in text and f"local {rank} " in text
        assert f"tp {tp} dp {dp} pp 0" in text.split(f"rank    {rank} host", 1)[1].split("\n", 1)[0]
    latest = (tmp_path / "run" / "smoke" / "checkpoints" / "latest").read_text().strip()
    stopped_at = int(latest.split("_")[1])
    assert 3 <= stopped_at < 200
    assert sorted(p.name for p in (tmp_path / "run" / "smoke" / "checkpoints" / latest).iterdir()) == \
        ["COMPLETE", "rank_00000.json", "rank_00001.json", "rank_00002.json", "rank_00003.json", "state.json"]

    procs = start(tmp_path, steps=stopped_at + 2, tag="second", SLURM_RESTART_COUNT="1")
    codes = wait_all(procs)
    text = (tmp_path / "second_rank0.log").read_text()
    assert codes == [0] * 4, text[-3000:]
    assert "resumed from" in text and f"(step {stopped_at})" in text
    assert f"step {stopped_at + 1}/{stopped_at + 2} ok" in text and f"step {stopped_at}/" not in text
    assert "restart 1" in text


def test_smoke_refuses_a_layout_that_does_not_divide_the_world(tmp_path):
    env = slurm_env(78, 3, 0)
    out = subprocess.run([sys.executable, "-m", "megatron_jetrl.cli", "train", str(CONFIG), "--smoke",
                          f"run.dir={tmp_path / 'run'}", "actor.parallel.tp=2", "model.config.num_key_value_heads=2"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "actor.parallel" in out.stderr and "must divide the world size (3 processes)" in out.stderr
    assert not (tmp_path / "run").exists()
