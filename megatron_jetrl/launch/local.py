"""``jetrl train --nproc-per-node N``: one process per GPU of this machine, started and ended the
way a long RL job needs, which torchrun does not do.

torchrun, on SIGTERM, forwards it to its workers, kills them 30 s later (a large model's checkpoint
takes minutes) and exits 1 with a ``SignalException`` traceback, so a preempted job neither saves
reliably nor says "requeue me" (75). This launcher gives each worker torchrun's variables (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR/PORT``), so
``placement.detect`` reads them as torchrun's, and then only forwards signals and waits:

- SIGTERM, SIGUSR1, SIGINT reach every worker once (the workers run in their own process group,
  so a terminal's Ctrl-C is not delivered twice); they agree, checkpoint and exit 75 in their own
  time. A second SIGTERM is forwarded too, and kills them at once, as it does a single process.
- A worker that fails (a status other than 0 and 75) gives the others ``GRACE_S`` to end (a dead
  peer ends theirs through NCCL's error handling); then they are killed.
- The exit status is the job's: the first failure's status if any worker failed, else 75 if any
  stopped for a signal, else 0. Nothing is printed beyond what the workers print.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Mapping, Optional, Sequence

from megatron_jetrl.launch.placement import free_port
from megatron_jetrl.runtime.signals import EXIT_PREEMPTED

GRACE_S = 120.0
"""How long the other workers get to end after one failed (srun's ``--wait=120`` in train.sbatch)."""

FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

def worker_env(environ: Mapping[str, str], rank: int, nproc: int, port: int) -> dict[str, str]:
    """The environment of worker ``rank`` of ``nproc`` on this machine: ``environ`` and torchrun's
    variables for a one-node job (its SLURM step variables left out: this launcher places them)."""
    env = {k: v for k, v in environ.items() if k not in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_ID")}
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
               GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return env


def job_status(codes: Sequence[Optional[int]]) -> int:
    """The job's exit status from its workers' (None: still running, counted as killed)."""
    done = [c if c is not None else -signal.SIGKILL for c in codes]
    failed = [c for c in done if c not in (0, EXIT_PREEMPTED)]
    if failed:
        return failed[0] if failed[0] > 0 else 128 - failed[0]  # a signal's death as the shell reports it
    return EXIT_PREEMPTED if EXIT_PREEMPTED in done else 0


def run_local(command: Sequence[str], nproc: int, environ: Mapping[str, str] = os.environ) -> int:
    """Run ``command`` (``python -m megatron_jetrl.cli train ...``) as ``nproc`` workers; returns
    the job's exit status (module docstring)."""
    port = free_port()
    workers = [subprocess.Popen(list(command), env=worker_env(environ, rank, nproc, port), process_group=0)
               for rank in range(nproc)]

    def forward(signum, frame):
        for w in workers:
            if w.poll() is None:
                try:
                    os.kill(w.pid, signum)
                except ProcessLookupError:
                    pass

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        failed_at = None
        while any(w.poll() is None for w in workers):
            codes = [w.poll() for w in workers]
            if failed_at is None and any(c not in (None, 0, EXIT_PREEMPTED) for c in codes):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
                for w in workers:
                    if w.poll() is None:
                        w.kill()
                        w.wait()
                break
            time.sleep(0.2)
        return job_status([w.poll() for w in workers])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for w in workers:  # an exception here (none expected) must not leave workers behind
            if w.poll() is None:
                w.kill()


def worker_command(argv: Sequence[str]) -> list[str]:
    """This Python running ``jetrl`` with ``argv`` (the ``--nproc-per-node`` option removed)."""
    return [sys.executable, "-m", "megatron_jetrl.cli", *argv]
