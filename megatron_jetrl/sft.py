"""The supervised warm-up before RL (``sft``): ``sft.steps`` of cross-entropy on the train
records' responses, with an actor of its own (constant ``sft.lr``), saved once under
``run_dir/sft``; the RL actor starts from it. A stop signal ends it unsaved: a rerun starts the
warm-up again."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_jetrl.actor import OptimizerSettings
from megatron_jetrl.algo import cross_entropy_loss
from megatron_jetrl.experience import supervised_batch
from megatron_jetrl.job import JobConfig, JobData, Resolved
from megatron_jetrl.runtime.run_checkpoints import RunCheckpoints
from megatron_jetrl.runtime.console import ConsoleView
from megatron_jetrl.runtime.metric_sinks import MetricsLogger
from megatron_jetrl.runtime.signals import PreemptionSignal


class Warmup:
    """The warm-up of one job (every rank builds one); ``run`` trains and saves it unless a
    complete one exists, ``weights`` is where the RL actor loads it from."""

    def __init__(self, job: JobConfig, resolved: Resolved, data: JobData, run_dir: Path, *,
                 actor_cls: type, console: ConsoleView):
        self.job, self.resolved, self.data, self.actor_cls, self.console = job, resolved, data, actor_cls, console
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.run_dir = run_dir
        self.checkpoints = RunCheckpoints(run_dir / "sft", 1, self.rank, self.world, barrier=dist.barrier)

    def weights(self) -> Path:
        """The warmed-up actor's checkpoint (after ``run`` returned True)."""
        return self.checkpoints.latest() / "actor"

    def run(self, preemption: PreemptionSignal, any_rank: Callable[[bool], bool]) -> bool:
        """Train and save the warm-up unless a complete one exists; False when a signal stopped it."""
        sft, ckpts, job = self.job.sft, self.checkpoints, self.job
        ckpts.clean_stale()
        if ckpts.latest() is not None:
            return True
        optimizer = OptimizerSettings(lr=sft.lr, weight_decay=job.actor.optimizer.weight_decay,
                                      clip_grad=job.actor.optimizer.clip_grad,
                                      initial_loss_scale=job.actor.optimizer.initial_loss_scale)
        actor: Any = self.actor_cls(self.resolved.bridge, dataclasses.replace(job.actor, optimizer=optimizer))
        if job.model.checkpoint:
            actor.load(job.model.checkpoint, model_only=True)
        train_set, tokenizer = self.data.train, self.data.tokenizer
        responses = train_set.records_field(sft.response_key, "sft.response_key")
        g = torch.Generator().manual_seed(job.data.seed)
        log = MetricsLogger(self.run_dir / "sft", tensorboard=job.log.tensorboard, enabled=self.rank == 0)
        eos = tokenizer.eos_token_id
        try:
            for k in range(1, sft.steps + 1):
                idx = torch.randint(0, len(train_set), (sft.batch_size,), generator=g).tolist()
                batch = supervised_batch([train_set[i].token_ids for i in idx],
                                         [tokenizer.encode(responses[i]) + [eos] for i in idx])
                with self.console.phase("sft"):
                    m = actor.update(batch, cross_entropy_loss)
                log.log(k, {f"sft/{n}": v for n, v in m.items()})
                if k % max(1, sft.steps // 10) == 0 or k == sft.steps:
                    self.console.log(f"sft {k}/{sft.steps} | loss {m['loss']:.4f}")
                if preemption.agreed(any_rank):
                    return False
            ckpts.save(sft.steps, lambda staging: actor.save(staging / "actor", extra={"sft_steps": sft.steps}),
                       any_rank=any_rank)
            return True
        finally:
            log.close()
            actor.close()
