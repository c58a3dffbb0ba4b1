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
        f"run checkpoint error: no checkpoint in {root} can be read ({root / 'step_00000003' / 'state.json'}: "
        f"ValueError: holds {{'step': 7}}, not {{'step': 3}}; {root / 'step_00000002' / 'state.json'}: "
        "JSONDecodeError: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)); "
        "move the broken ones away, or start over in a new run.dir"]
    assert "step 4/4" not in out


FULL_ON_RANK_1 = """
import errno, sys
import megatron_jetrl.launch.smoke as smoke

write = smoke._write


def full_on_rank_1(staging, *, rank, me, step):  # the disk fills while rank 1 writes its part of step 2
    if rank == 1 and step == 2:
        (staging / "rank_00001.json").write_bytes(b"x" * 4096)
        raise OSError(errno.ENOSPC, "No space left on device", str(staging / "rank_00001.json"))
    write(staging, rank=rank, me=me, step=step)


smoke._write = full_on_rank_1
from megatron_jetrl.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_full_disk_on_one_rank_stops_every_rank_with_one_line_and_keeps_the_last_checkpoint(tmp_path):
    """Rank 1 runs out of space while the step-2 checkpoint is written: both ranks stop (exit 4, not
    requeued), rank 1 names the cause in one line, rank 0 points at it; no staging directory is left
    and the step-1 checkpoint is what the next run resumes from."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", FULL_ON_RANK_1, "train", str(CONFIG), "--smoke",
                               "--smoke-step-seconds", "0", f"run.dir={tmp_path / 'run'}", "run.steps=3",
                               "run.save_every=1"],
                              env=slurm_env(80, 2, rank, MASTER_PORT=str(port), PYTHONUNBUFFERED="1"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
             for rank in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [4, 4], [err[-3000:] for _, err in outs]
    root = tmp_path / "run" / "smoke" / "checkpoints"
    errors = [err.strip().splitlines() for _, err in outs]
    assert errors[0] == [f"checkpoint save error: saving the checkpoint of step 2 in {root} failed on another "
                         "rank (its log says why); nothing of it was kept: run the same command to continue from "
                         "step_00000001"]
    assert len(errors[1]) == 1 and errors[1][0].startswith(
        f"checkpoint save error: no space left on device while saving the checkpoint of step 2 in {root} (")
    assert errors[1][0].endswith("then run the same command to continue from step_00000001")
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001"]
    code, out, err = smoke_once(tmp_path, "run.steps=3", "run.save_every=1")
    assert code == 0 and f"resumed from {root / 'step_00000001'} (step 1)" in out, err[-3000:]


def _local(tmp_path, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    return subprocess.Popen([sys.executable, "-m", "megatron_jetrl.cli", "train", str(CONFIG), "--smoke",
                             "--nproc-per-node", "2", "--smoke-step-seconds", "0.2", f"run.dir={tmp_path / 'run'}",
                             *args], env=dict(env, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)


def test_nproc_per_node_forwards_a_stop_signal_and_exits_75_without_a_traceback(tmp_path):
    """``jetrl train --nproc-per-node 2`` (this machine's launcher, in place of torchrun): SIGTERM
    to the launcher only reaches both workers once; they checkpoint and stop, the launcher exits 75
    with nothing but the workers' lines; the same command resumes."""
    proc = _local(tmp_path, "run.steps=200", "run.save_every=2")
    deadline = time.monotonic() + 60
    while not (tmp_path / "run" / "smoke" / "checkpoints" / "latest").is_file() and time.monotonic() < deadline:
        time.sleep(0.2)  # running: two steps done
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err, err[-3000:]
    assert "SIGTERM received: checkpoint of step" in out and out.count("smoke: done") == 0
    stopped = int(out.split("SIGTERM received: checkpoint of step ")[1].split(" ")[0])
    proc = _local(tmp_path, f"run.steps={stopped + 2}", "run.save_every=0")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and f"(step {stopped})" in out and f"step {stopped + 2}/{stopped + 2} ok" in out, err


def test_nproc_per_node_passes_on_a_workers_error_and_is_refused_under_another_launcher(tmp_path):
    proc = _local(tmp_path, "run.steps=1")
    assert proc.communicate(timeout=60) and proc.returncode == 0
    proc = _local(tmp_path, "run.steps=2", "run.resume=false")  # every worker refuses: one line, status 2
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and len(err.strip().splitlines()) == 1 and "run.resume: got False" in err, err
    nested = subprocess.run([sys.executable, "-m", "megatron_jetrl.cli", "train", str(CONFIG), "--smoke",
                             "--nproc-per-node", "2", f"run.dir={tmp_path / 'run'}"],
                            env=slurm_env(81, 2, 0), capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert nested.returncode == 2 and nested.stderr.strip() == (
        "config error: --nproc-per-node: got 2; this process is already one of a launch (started by srun): let "
        "that launcher start the processes (srun --ntasks-per-node, torchrun --nproc-per-node) and drop "
        "--nproc-per-node"), nested.stderr
