"""``jetrl train --smoke`` as srun would start it: four processes given only SLURM's variables
rendezvous over gloo, agree on the rank layout, stop together on a signal sent to one of them with a
checkpoint and exit 75, and resume from it. (The same path under a real SLURM: tests/slurm.)"""

import json
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


def smoke_once(tmp_path, *overrides):
    """One smoke process (a one-task srun step) on ``tmp_path/run``: its exit code, stdout, stderr."""
    env = slurm_env(79, 1, 0, MASTER_PORT=str(free_port()), PYTHONUNBUFFERED="1")
    out = subprocess.run([sys.executable, "-m", "megatron_jetrl.cli", "train", str(CONFIG), "--smoke",
                          "--smoke-step-seconds", "0", f"run.dir={tmp_path / 'run'}", *overrides],
                         env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    return out.returncode, out.stdout, out.stderr


def test_smoke_honours_run_resume_false(tmp_path):
    code, out, err = smoke_once(tmp_path, "run.steps=1")
    assert code == 0, err[-3000:]
    latest = tmp_path / "run" / "smoke" / "checkpoints" / "latest"
    assert latest.read_text() == "step_00000001\n"
    code, out, err = smoke_once(tmp_path, "run.steps=2", "run.resume=false")
    assert code == 2, err[-3000:]
    assert err.strip() == (f"config error: run.resume: got False; {tmp_path / 'run' / 'smoke'} has checkpoints "
                           "(step_00000001); use a new run.dir, or run.resume=true to continue")
    assert "step 1/2" not in out and latest.read_text() == "step_00000001\n"
    code, out, err = smoke_once(tmp_path, "run.steps=2", "run.resume=true")
    assert code == 0 and "resumed from" in out and "(step 1)" in out and "step 2/2 ok" in out, err[-3000:]


def test_smoke_skips_an_unreadable_state_and_names_it_then_refuses_when_none_is_readable(tmp_path):
    code, out, err = smoke_once(tmp_path, "run.steps=2", "run.save_every=1")
    assert code == 0, err[-3000:]
    root = tmp_path / "run" / "smoke" / "checkpoints"
    (root / "step_00000002" / "state.json").write_bytes(b"\xff\xfe{\"step\": 2}")  # not UTF-8
    code, out, err = smoke_once(tmp_path, "run.steps=3", "run.save_every=1")
    assert code == 0, err[-3000:]
    assert f"WARNING: {root / 'step_00000002' / 'state.json'}: UnicodeDecodeError" in out
    assert f"resumed from {root / 'step_00000001'} (step 1)" in out and "step 2/3 ok" in out and "step 3/3 ok" in out

    (root / "step_00000002" / "state.json").write_text("{half")
    (root / "step_00000003" / "state.json").write_text(json.dumps({"step": 7}))
    code, out, err = smoke_once(tmp_path, "run.steps=4", "run.save_every=1")
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines() == [
        f"checkpoint error: no checkpoint in {root} can be read ({root / 'step_00000003' / 'state.json'}: "
        f"ValueError: holds {{'step': 7}}, not {{'step': 3}}; {root / 'step_00000002' / 'state.json'}: "
        "JSONDecodeError: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)); "
        "move the broken ones away, or start over in a new run.dir"]
    assert "step 4/4" not in out
