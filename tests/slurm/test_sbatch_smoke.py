"""examples/slurm/train.sbatch and convert.sbatch under a real SLURM (a single-node cluster from Debian's slurm-wlm and
munge that .ci/slurm_up.sh starts): srun's tasks rendezvous and report their layout, SIGUSR1 from
the scheduler makes every rank checkpoint and exit 75, the script requeues the job, and the requeued
job resumes from that checkpoint and finishes. Also: the launch errors a cluster user can make.

The smoke mode (``jetrl train --smoke``) runs the real launch path without the GPU model. CI sets
JETRL_REQUIRE_SLURM=1, so there a missing cluster is a failure, not a skip.
"""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
CONFIG = ROOT / "examples" / "configs" / "tiny_countdown.yaml"
# the script's #SBATCH lines ask for 8 GPUs a node; this cluster has 4 CPUs and no GPU
CPU_OPTIONS = ["--nodes=1", "--ntasks-per-node=4", "--gpus-per-node=0", "--cpus-per-task=1", "--partition=debug",
               "--time=30", "--mem=0"]  # --time > the script's 10-minute SIGUSR1 lead
LAYOUT = ["actor.parallel.tp=2", "model.config.num_key_value_heads=2"]


def _cluster_up() -> str | None:
    if shutil.which("sbatch") is None:
        return "SLURM is not installed (bash .ci/slurm_up.sh starts a single-node cluster)"
    out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=30)
    if out.returncode != 0 or not ({"idle", "mix", "alloc"} & set(out.stdout.split())):
        return f"no SLURM node is up (sinfo: {out.stdout.strip() or out.stderr.strip()}); bash .ci/slurm_up.sh"
    return None


_why = _cluster_up()
if _why is not None and os.environ.get("JETRL_REQUIRE_SLURM") == "1":
    pytest.fail(f"JETRL_REQUIRE_SLURM=1 but {_why}", pytrace=False)
pytestmark = pytest.mark.skipif(_why is not None, reason=_why or "")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # the jetrl of this venv
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _submit(workdir: Path, name: str, *args: str, options=()) -> str:
    (workdir / "logs").mkdir(exist_ok=True)
    out = subprocess.run(["sbatch", "--parsable", f"--job-name={name}", f"--chdir={workdir}", *CPU_OPTIONS, *options,
                          str(SBATCH), str(CONFIG), *args], capture_output=True, text=True, env=_env(), timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def _state(job: str) -> str:
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=30)
    return out.stdout.strip()


def _wait_for(predicate, timeout: float, what: str, logs: Path, job: str | None = None):
    """Poll ``predicate``; fail with every log when it times out or ``job`` ended first."""
    deadline = time.monotonic() + timeout
    while not predicate():
        ended = job is not None and _state(job) == ""
        if ended or time.monotonic() > deadline:
            texts = "\n".join(f"== {p}\n{p.read_text()[-3000:]}" for p in sorted(logs.rglob("*")) if p.is_file())
            pytest.fail(f"{'the job ended' if ended else 'timed out'} waiting for {what}\n{texts}")
        time.sleep(0.5)


def test_sbatch_smoke_preempt_requeue_resume(tmp_path):
    steps = 40
    job = _submit(tmp_path, "jetrl-smoke", "--smoke", "--smoke-step-seconds", "0.5", f"run.dir={tmp_path / 'run'}",
                  f"run.steps={steps}", "run.save_every=0", *LAYOUT)
    rank0 = tmp_path / "logs" / f"jetrl-smoke-{job}" / "rank-0.log"
    batch = tmp_path / "logs" / f"jetrl-smoke-{job}.out"
    _wait_for(lambda: rank0.is_file() and "step 3/" in rank0.read_text(), 120, "the first steps", tmp_path / "logs",
              job)
    sig = subprocess.run(["scancel", "--signal=USR1", job], capture_output=True, text=True, timeout=30)
    assert sig.returncode == 0, sig.stderr
    _wait_for(lambda: _state(job) == "", 240, "the requeued job to finish", tmp_path / "logs")

    text, log = batch.read_text(), rank0.read_text()
    assert "srun exited with 75" in text and f"requeueing job {job}" in text, text
    assert "restart 1" in text and text.rstrip().endswith("srun exited with 0"), text
    assert "SIGUSR1 received" in log, log[-3000:]
    stopped = int(re.search(r"checkpoint of step (\d+) saved; run the same command", log).group(1))
    assert 3 <= stopped < steps
    assert f"resumed from {tmp_path / 'run' / 'smoke' / 'checkpoints'}" in log and f"(step {stopped})" in log
    assert f"done, {steps} steps" in log
    assert "smoke: srun: 4 processes on 1 node(s) x 4, rendezvous " in log
    for rank, (tp, dp) in enumerate([(0, 0), (1, 0), (0, 1), (1, 1)]):
        line = re.search(rf"rank +{rank} host .*", log).group(0)
        assert f"local {rank} " in line and f"tp {tp} dp {dp} pp 0" in line, line
    assert (tmp_path / "run" / "smoke" / "checkpoints" / "latest").read_text().strip() == f"step_{steps:08d}"
    for rank in range(1, 4):  # every task ran twice, both runs in the same log
        assert (tmp_path / "logs" / f"jetrl-smoke-{job}" / f"rank-{rank}.log").read_text().count("Traceback") == 0


def test_srun_layout_error_before_any_work(tmp_path):
    out = subprocess.run(["srun", "--ntasks=3", "--cpus-per-task=1", "--gpus-per-node=0", "--partition=debug",
                          "--time=5", "jetrl", "train", str(CONFIG), "--smoke", f"run.dir={tmp_path / 'run'}", *LAYOUT],
                         capture_output=True, text=True, env=_env(), timeout=120, cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "must divide the world size (3 processes)" in out.stderr
    assert not (tmp_path / "run").exists()


def test_jetrl_in_the_batch_shell_is_refused(tmp_path):
    script = f"jetrl train {CONFIG} --smoke run.dir={tmp_path / 'run'}"
    out = subprocess.run(["sbatch", "--wait", "--parsable", "--ntasks=2", "--cpus-per-task=1", "--partition=debug",
                          "--time=5", f"--output={tmp_path / 'batch.out'}", "--wrap", script],
                         capture_output=True, text=True, env=_env(), timeout=120, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert "start it as `srun jetrl train ...`" in (tmp_path / "batch.out").read_text()


def test_convert_sbatch_round_trip(tmp_path):
    """examples/slurm/convert.sbatch both ways on a tiny Qwen3: HF -> megatron -> HF, bit-exact."""
    from safetensors.torch import load_file

    from tests.model_fixtures import save_tiny_hf

    save_tiny_hf("Qwen3ForCausalLM", tmp_path / "hf", num_layers=2)
    options = ["--wait", "--partition=debug", "--cpus-per-task=1", "--time=10"]
    script = str(ROOT / "examples" / "slurm" / "convert.sbatch")
    steps = (("to-megatron", tmp_path / "hf", tmp_path / "mg"), ("to-hf", tmp_path / "mg", tmp_path / "back"))
    for direction, src, dst in steps:
        log = tmp_path / f"{direction}.out"
        out = subprocess.run(["sbatch", *options, f"--output={log}", script, direction, str(src), str(dst)],
                             capture_output=True, text=True, env=_env(), timeout=300, cwd=ROOT)
        assert out.returncode == 0, out.stderr + (log.read_text() if log.exists() else "")
    original = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        original.update(load_file(f))
    back = {}
    for f in (tmp_path / "back").glob("*.safetensors"):
        back.update(load_file(f))
    assert original.keys() == back.keys()
    assert all(original[k].equal(back[k]) for k in original)
    bad = subprocess.run(["sbatch", *options, f"--output={tmp_path / 'bad.out'}", script, "to-nowhere", "a", "b"],
                         capture_output=True, text=True, env=_env(), timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "usage: sbatch" in (tmp_path / "bad.out").read_text()
