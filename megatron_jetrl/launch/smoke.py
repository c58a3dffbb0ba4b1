"""``jetrl train --smoke``: everything a launch does except the model, on CPUs.

What a cluster launch can get wrong is checked for real: every process starts (srun tasks or
torchrun workers), they rendezvous (gloo), each knows its node, GPU slot and TP/PP/DP coordinates
(megatron's rank order), the tensor-parallel groups sit inside one node, collectives over the world
and over every TP, DP and PP group give the expected sums, and a stop signal (SIGTERM, SIGUSR1)
leads to a checkpoint on every rank and exit status 75, after which the same command resumes from
that checkpoint. The step itself is a sleep of ``step_seconds``; checkpoints hold only the step and
go under ``run.dir/smoke/`` so that they never mix with a real run's. Starting and resuming follow
the trainer's rules (``Trainer._start``, ``Trainer._resume``): ``run.resume=false`` refuses a run
dir that has smoke checkpoints, and a checkpoint that cannot be read is named and the one before
it tried.

The job's config has already been checked (``job.resolve``, ``job.load_data``) by the time this
runs, the same checks ``jetrl train`` makes before any GPU work.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_jetrl.launch.placement import Placement
from megatron_jetrl.models import ParallelLayout
from megatron_jetrl.runtime.run_checkpoints import RunCheckpoints
from megatron_jetrl.runtime.signals import EXIT_PREEMPTED, PreemptionSignal, any_rank
from megatron_jetrl.sync.plan import train_rank


@dataclass(frozen=True)
class Coordinates:
    tp: int
    dp: int
    pp: int


def coordinates(rank: int, parallel: ParallelLayout, dp_size: int) -> Coordinates:
    """The inverse of ``train_rank`` (megatron-core's order: tp fastest, then dp, then pp)."""
    tp, rest = rank % parallel.tp, rank // parallel.tp
    c = Coordinates(tp=tp, dp=rest % dp_size, pp=rest // dp_size)
    assert train_rank(c.tp, c.pp, c.dp, parallel, dp_size) == rank
    return c


def groups(parallel: ParallelLayout, dp_size: int) -> dict[str, list[list[int]]]:
    """Every TP, DP and PP group as lists of global ranks."""
    tp, pp, dp = parallel.tp, parallel.pp, dp_size
    return {
        "tp": [[train_rank(t, p, d, parallel, dp) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "dp": [[train_rank(t, p, d, parallel, dp) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": [[train_rank(t, p, d, parallel, dp) for p in range(pp)] for d in range(dp) for t in range(tp)],
    }


def run_smoke(placement: Placement, run_dir: Path, preemption: PreemptionSignal, *, steps: int, save_every: int,
              keep_last: int, parallel: ParallelLayout, dp_size: int, rollout_tp: int, step_seconds: float,
              resume: bool) -> int:
    """The smoke job on an initialised gloo process group, with the launcher's signal handlers
    ``preemption`` (entered); returns the exit status. Raises ConfigError on ``run.resume`` when
    ``resume`` is false and the run dir has smoke checkpoints, CheckpointError when it has some
    but none can be read (on every rank alike)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    coords = coordinates(rank, parallel, dp_size)
    me = {"rank": rank, "host": socket.gethostname(), "node": placement.node_rank, "local": placement.local_rank,
          "pid": os.getpid(), "tp": coords.tp, "dp": coords.dp, "pp": coords.pp, "replica": rank // rollout_tp}
    table: list = [None] * world
    dist.all_gather_object(table, me)
    layout = groups(parallel, dp_size)
    _check_table(table, layout["tp"])
    say(f"smoke: {placement.describe()}", flush=True)
    for row in table:
        say("smoke: rank {rank:>4} host {host} node {node} local {local} pid {pid}: "
            "tp {tp} dp {dp} pp {pp}, rollout replica {replica}".format(**row), flush=True)

    handles = {kind: [(members, dist.new_group(members)) for members in ranks]
               for kind, ranks in layout.items()}
    checkpoints = RunCheckpoints(run_dir / "smoke", keep_last, rank, world, barrier=dist.barrier)
    step = 0 if checkpoints.resume_point(resume) is None else _resume(checkpoints, say)

    while step < steps:
        step += 1
        _collectives(rank, world, handles, step)
        time.sleep(step_seconds)
        say(f"smoke: step {step}/{steps} ok", flush=True)
        stop = preemption.agreed(any_rank)  # gloo: reduced on the CPU
        if stop or step == steps or (save_every and step % save_every == 0):
            checkpoints.save(step, functools.partial(_write, rank=rank, me=me, step=step), any_rank=any_rank)
            say(f"smoke: checkpoint step {step} saved", flush=True)
        if stop:
            say(f"smoke: {preemption.signal_name or 'a signal'} received: checkpoint of step {step} saved; "
                "run the same command to continue", flush=True)
            return EXIT_PREEMPTED
    say(f"smoke: done, {steps} steps", flush=True)
    return 0


def _write(staging: Path, rank: int, me: dict, step: int) -> None:
    (staging / f"rank_{rank:05d}.json").write_text(json.dumps(me))
    if rank == 0:
        (staging / "state.json").write_text(json.dumps({"step": step}))


def _resume(checkpoints: RunCheckpoints, say) -> int:
    """The step of the newest checkpoint whose ``state.json`` every rank can read; one that cannot
    be read (missing, not UTF-8, not JSON, another step) is named and the one before it tried."""

    def read(checkpoint: Path) -> None:
        step = checkpoints.step_of(checkpoint)
        state = json.loads((checkpoint / "state.json").read_text(encoding="utf-8"))
        if not (isinstance(state, dict) and type(state.get("step")) is int and state["step"] == step):
            raise ValueError(f"holds {str(state)[:80]}, not {{'step': {step}}}")

    checkpoint = checkpoints.restore_newest(
        read, any_rank=any_rank, label=lambda c: str(c / "state.json"),  # gloo: any_rank reduces on the CPU
        warn=lambda _, problem: say(f"smoke: WARNING: {problem}; trying the checkpoint before it", flush=True))
    step = checkpoints.step_of(checkpoint)
    say(f"smoke: resumed from {checkpoint} (step {step})", flush=True)
    return step


def _check_table(table: list[dict], tp_groups: list[list[int]]) -> None:
    """Every rank agrees on the layout: one process per (node, local rank), each node on one host,
    every TP group on one host."""
    by_slot = {(r["node"], r["local"]) for r in table}
    if len(by_slot) != len(table):
        raise RuntimeError(f"two processes claim the same (node, local rank): {sorted(by_slot)}")
    hosts_of_node: dict[int, set] = {}
    for r in table:
        hosts_of_node.setdefault(r["node"], set()).add(r["host"])
    if any(len(h) > 1 for h in hosts_of_node.values()):
        raise RuntimeError(f"one node rank spans several hosts: {hosts_of_node}")
    for members in tp_groups:
        hosts = {table[m]["host"] for m in members}
        if len(hosts) > 1:
            raise RuntimeError(f"TP group {members} spans hosts {sorted(hosts)}")


def _collectives(rank: int, world: int, handles: dict, step: int) -> None:
    """All-reduce (rank + step) over the world and each of this rank's groups; check the sums."""
    def reduce(members, group):
        t = torch.tensor([rank + step], dtype=torch.int64)
        dist.all_reduce(t, group=group)
        expected = sum(members) + step * len(members)
        if t.item() != expected:
            raise RuntimeError(f"all-reduce over {members}: got {t.item()}, expected {expected}")

    reduce(list(range(world)), None)
    for pairs in handles.values():
        for members, group in pairs:
            if rank in members:
                reduce(members, group)
