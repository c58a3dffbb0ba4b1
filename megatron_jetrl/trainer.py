"""The RL loop. One step, on every rank of the job (colocated: trainer and engine share the GPUs):

    generate   engine awake, actor offloaded: sample group_size responses per prompt
    score      their rewards (and overlong penalty); groups with equal rewards are refilled by
               another generate + score round (dynamic sampling)
    advantages group-relative, from the rewards
    logprobs   engine asleep, actor on the GPU: the trainer's log π_old of every response token
               (and the FP8 KV-cache scales), mismatch metrics against the engine's logprobs,
               rollout correction weights; skipped with an exact rollout (``precision.exact``),
               whose logprobs are the trainer's bit for bit: they are π_old
    update     one optimizer step with the policy loss (on-policy); with an exact rollout the
               mismatch metrics come from this step's own forward (the rollout's weights)
    sync       the trainer's weights (its own FP8 bytes and scales) into the engine
    colocate   the hand-overs of the GPU between them (the engine's wake and sleep, the actor's
               offload and reload), timed so that a step's seconds are its whole wall time
    evaluate   every run.eval_every steps

then a checkpoint every run.save_every steps, at the end, and when SIGTERM/SIGUSR1 asks (SLURM
preemption); rerunning the same command continues with the exact next batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megatron_jetrl.algo import advantages as compute_advantages
from megatron_jetrl.algo import make_policy_loss, mismatch_metrics, rollout_correction
from megatron_jetrl.data.datasets import Prompt
from megatron_jetrl.data.filters import overlong_penalty
from megatron_jetrl.data.rewards import build_reward
from megatron_jetrl.data.sampler import PromptSampler
from megatron_jetrl.job import JobConfig, JobData, Resolved
from megatron_jetrl.rollout import RolloutEngine, SamplingParams, build_engine, engine_kind
from megatron_jetrl.colocation import Colocation
from megatron_jetrl.experience import Group, Response, StepRollouts, prompt_major, replica_share, training_batch
from megatron_jetrl.runtime.atomic import save_json_atomic
from megatron_jetrl.runtime.run_checkpoints import RunCheckpoints
from megatron_jetrl.runtime.console import ConsoleView
from megatron_jetrl.runtime.phase_memory import PhaseMemory
from megatron_jetrl.runtime.metric_sinks import MetricsLogger
from megatron_jetrl.runtime.profiling import StepProfiler
from megatron_jetrl.runtime.rng import load_rng, save_rng
from megatron_jetrl.runtime.signals import EXIT_PREEMPTED, PreemptionSignal, any_rank
from megatron_jetrl.runtime.timing import PhaseTimer
from megatron_jetrl.sync import SyncPlan, WeightSync
from megatron_jetrl.sft import Warmup


CONSOLE_KEYS = ("reward/mean", "len=response/length_mean", "entropy=actor/entropy", "k3_kl=rollout_corr/k3_kl",
                "eval=eval/reward", "gen=timing/generate_s", "lp=timing/logprobs_s", "upd=timing/update_s",
                "sync=timing/sync_s", "{} tok/s/gpu=perf/tokens_per_s_per_gpu")


class ExactMismatch(RuntimeError):
    """An exact rollout's logprobs were not the trainer's (``precision.exact_mismatch: stop``, or the
    start-up self-check): the job stops before an update on them; the message is one line."""


class Trainer:
    """Build on every rank after ``torch.distributed`` is initialised (``cli.py`` does it);
    ``run()`` returns the process exit status. ``device`` and ``actor_cls`` default to the GPU and
    the megatron ``Actor``; tests pass others to run the loop's plumbing on a CPU."""

    def __init__(self, job: JobConfig, resolved: Resolved, data: JobData, *, run_dir: Path,
                 device: Optional[torch.device] = None, actor_cls: Optional[type] = None):
        self.job, self.resolved, self.run_dir = job, resolved, run_dir
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
        if actor_cls is None:
            from megatron_jetrl.actor import Actor as actor_cls
        self._actor_cls = actor_cls
        self.replica, self.replicas = self.rank // resolved.rollout_tp, resolved.rollout_replicas
        self.tokenizer, self.train_set, self.eval_set = data.tokenizer, data.train, data.eval
        self.sampler = PromptSampler(len(self.train_set), job.data.seed, job.data.shuffle)
        self.reward = build_reward(job.reward)
        eos = () if job.rollout.sampling.ignore_eos else (self.tokenizer.eos_token_id,)
        stops = tuple(sorted({*job.rollout.sampling.stop_token_ids, *eos}))
        self.sampling = dataclasses.replace(job.rollout.sampling, n=job.algo.group_size, stop_token_ids=stops)
        self.loss_fn = make_policy_loss(job.algo.loss)
        self.checkpoints = RunCheckpoints(run_dir, job.run.keep_last, self.rank, self.world, barrier=dist.barrier)
        self.console = ConsoleView(job.run.steps, enabled=self.rank == 0 and job.log.console)
        self.timer = PhaseTimer(sync=torch.cuda.synchronize if self.device.type == "cuda" else None)
        self.memory = PhaseMemory(self.device)
        self.profiler = StepProfiler(job.run.profile_steps if self.rank == 0 else (), self.device)
        """Rank 0's kernels stand for the step's (the other ranks run unprofiled)."""
        self.warmup = Warmup(job, resolved, data, run_dir, actor_cls=actor_cls, console=self.console)
        self.step = 0
        self.kv_scales = torch.ones(resolved.bridge.dims.num_layers, 3)
        """The FP8 KV-cache scales the engine holds ([num_layers, 3]: q, k, v; with
        rollout.vllm.kv_cache_dtype=fp8): ones until a step measures them; checkpointed."""
        self.actor = None
        self.colocation: Optional[Colocation] = None
        self.metrics: Optional[MetricsLogger] = None

    @property
    def engine(self) -> Optional[RolloutEngine]:
        """The rollout engine (the colocation's, once started)."""
        return None if self.colocation is None else self.colocation.engine

    @property
    def engine_description(self) -> str:
        """The rollout engine and its version, for a message."""
        return engine_kind(self.job.rollout).describe()

    # ------------------------------------------------------------------ the loop

    def run(self, preemption: Optional[PreemptionSignal] = None) -> int:
        """The job to its last step, or to a stop signal (checkpoint, then ``EXIT_PREEMPTED``).
        ``preemption``: handlers the launcher installed before start-up (a signal that arrives
        while the model is built is honoured after the first step); default: installed here."""
        with contextlib.ExitStack() as stack:
            if preemption is None:
                preemption = stack.enter_context(PreemptionSignal())
            if not self._start(preemption):
                return self._stop(preemption, saved=False)
            while self.step < self.job.run.steps:
                metrics = self.train_step()
                self._write_profile()
                evaluated = bool(self.job.run.eval_every and self.step % self.job.run.eval_every == 0)
                if evaluated:
                    metrics.update(self.evaluate())
                stop = preemption.agreed(self._any_rank)
                # log.every: and always the last step, an evaluated one, and the one a stop ends with
                shown = (self.step % self.job.log.every == 0 or self.step == self.job.run.steps or evaluated or stop)
                if shown:
                    self.metrics.log(self.step, metrics)
                self.console.step_done(self.step, metrics, CONSOLE_KEYS, show=shown)
                final_save = self.step == self.job.run.steps and self.job.run.save_at_end
                if stop or final_save or (self.job.run.save_every and self.step % self.job.run.save_every == 0):
                    self.save()
                if stop:
                    return self._stop(preemption, saved=True)
        self.console.log(f"done: {self.step} steps; run directory {self.run_dir}")
        return 0

    def train_step(self) -> dict[str, float]:
        """One RL step (see the module docstring); returns its metrics."""
        self.step += 1
        self.timer.reset()
        with self._phase("colocate"):  # the engine's wake and the actor's offload: part of the step's wall
            self.colocation.rollout_mode()
        rollouts = self.collect(self.job.data.prompts_per_step)  # phases generate and score, per round
        with self._phase("advantages"):
            rewards = torch.tensor([r.reward for r in rollouts.responses])
            adv = compute_advantages(self.job.algo.advantage, rewards, self.job.algo.group_size)
            batch = training_batch(rollouts.groups, adv, mask_truncated=self.job.data.overlong.mode == "filter")
        with self._phase("colocate"):
            self.colocation.train_mode()
        metrics = rollouts.metrics()
        with self._phase("logprobs"):
            batch, extra, kv_scales = self.prepare_update(batch)
        metrics.update(extra)
        with self._phase("update"):
            update_metrics, measured = self.update(batch)
            metrics.update(update_metrics)
        with self._phase("sync"):
            self.sync_weights(measured if measured is not None else kv_scales)
        seconds = self.timer.seconds
        seconds["step"] = sum(seconds.values())
        metrics.update({f"timing/{k}_s": v for k, v in seconds.items()})
        for phase, cpu in self.timer.cpu_seconds.items():  # where a host loop sets the pace: whose CPU time
            metrics.update({f"cpu/{phase}_{who}_s": v for who, v in cpu.items()})
        metrics["perf/tokens_per_step"] = float(batch.tokens.numel())
        metrics["perf/tokens_per_s_per_gpu"] = batch.tokens.numel() / seconds["step"] / self.world
        metrics["actor/steps"] = float(self.actor.steps)
        metrics.update(self.memory.metrics())
        return metrics

    # ------------------------------------------------------------------ phases

    def collect(self, num_prompts: int) -> StepRollouts:
        """Sample prompts, generate and score until ``num_prompts`` groups carry a learning signal
        (dynamic sampling), or its round limit is reached."""
        ds = self.job.data.dynamic_sampling
        out = StepRollouts()
        while True:
            need = num_prompts - len(out.groups)
            indices = self.sampler.next(need)
            prompts = [self.train_set[i] for i in indices]
            with self._phase("generate"):
                mine, samples = self.generate(prompts, self.sampling, seed=self._seed(out.rounds))
            with self._phase("score"):
                groups, timeouts, errors = self.score(prompts, mine, samples, self.sampling)
            out.rounds += 1
            out.prompts_sampled += len(prompts)
            out.groups_generated += len(groups)
            out.reward_timeouts += timeouts
            out.reward_errors += errors
            if not ds.enabled:
                out.groups.extend(groups)
                return out
            out.groups.extend(g for g in groups if not g.uniform)
            if len(out.groups) >= num_prompts or out.rounds >= ds.max_rounds:
                break
        if not out.groups:  # every group uniform: train on the last round's (zero advantages)
            out.groups = groups
        out.groups = out.groups[:num_prompts]
        return out

    def generate(self, prompts: list[Prompt], sampling: SamplingParams, *, seed: int
                 ) -> tuple[list[int], list]:
        """This rank's rollout replica generates its share of ``prompts``: (their indices, the
        engine's samples, prompt-major)."""
        mine = replica_share(prompts, self.replica, self.replicas)
        samples = self.engine.generate([list(prompts[i].token_ids) for i in mine],
                                       dataclasses.replace(sampling, seed=seed))
        return mine, samples

    def score(self, prompts: list[Prompt], mine: list[int], samples: list, sampling: SamplingParams
              ) -> tuple[list[Group], int, int]:
        """Rewards (and the overlong penalty) of every replica's samples; every rank gets all groups
        back in prompt order, with the reward timeouts and errors."""
        part: tuple = ([], 0, 0)  # a rollout-TP follower: its replica's leader scores and reports
        if self.rank % self.resolved.rollout_tp == 0:
            texts = [self.tokenizer.decode(self._strip_stop(s.tokens)) for s in samples]
            scored = self.reward(texts, [prompts[mine[s.prompt_index]].answer for s in samples])
            penalty = self._overlong_penalty([len(s.tokens) for s in samples], sampling.max_new_tokens)
            local: dict[int, list[Response]] = {}
            for s, score, pen in zip(samples, scored.scores, penalty, strict=True):
                local.setdefault(mine[s.prompt_index], []).append(
                    Response(list(s.tokens), list(s.logprobs), s.finish_reason == "length", score, score + pen))
            part = (list(local.items()), scored.timeouts, scored.errors)
        parts: list = [None] * self.world
        dist.all_gather_object(parts, part)
        responses = prompt_major([p[0] for p in parts])
        groups = [Group(p.index, p.token_ids, r) for p, r in zip(prompts, responses, strict=True)]
        return groups, sum(p[1] for p in parts), sum(p[2] for p in parts)

    def prepare_update(self, batch, *, recompute: bool = False):
        """Old logprobs (the rollout's in bypass mode and with an exact rollout, unless ``recompute``:
        a step whose exact rollout did not hold), reference logprobs for the KL penalty, rollout
        correction and the mismatch metrics; returns the batch with those fields, the metrics and the
        FP8 KV-cache scales the logprob pass calibrated (None without that pass or without an FP8 KV
        cache)."""
        corr_settings = self.job.algo.correction
        fields = dict(batch.fields)
        metrics: dict = {}
        kv_scales = None
        rollout_lp, mask = fields["rollout_logprobs"], fields["loss_mask"]
        if not recompute and (corr_settings.bypass or self.job.precision.exact):
            fields["old_logprobs"] = rollout_lp
        else:
            out = self.actor.compute_logprobs(batch, kv_scales=self.job.rollout.fp8_kv_cache)
            fields["old_logprobs"] = out.logprobs
            metrics.update(mismatch_metrics(out.logprobs, rollout_lp, mask))
            kv_scales = out.kv_scales
            corr = rollout_correction(out.logprobs, rollout_lp, mask, batch.cu_seqlens, corr_settings)
            metrics.update(corr.metrics)
            if corr_settings.mode != "none":
                fields["is_weights"], fields["loss_mask"] = corr.weights, corr.loss_mask
        if self.job.algo.loss.kl_coef > 0:
            fields["ref_logprobs"] = self.actor.reference_logprobs(batch)
        return dataclasses.replace(batch, fields=fields), metrics, kv_scales

    def update(self, batch) -> tuple[dict[str, float], Optional[torch.Tensor]]:
        """One optimizer step; its metrics, and the FP8 KV-cache scales its forward measured (None
        unless the rollout is exact with an FP8 KV cache: then no logprob pass measures them). With
        an exact rollout, also the mismatch metrics of the step's forward (computed with the weights
        the rollout used) against the rollout's logprobs: ``rollout_corr/k3_kl`` 0 and
        ``rollout_corr/unequal_tokens`` 0 when it holds. Where they are not 0 the rollout's logprobs
        are not π_old, and the optimizer step is not taken on them: ``precision.exact_mismatch``
        stops the job (``ExactMismatch``) or updates again with recomputed, corrected old logprobs."""
        if not self.job.precision.exact:
            return {f"actor/{k}": v for k, v in self.actor.update(batch, self.loss_fn).items()}, None
        measure = self.job.rollout.fp8_kv_cache
        rollout_lp, mask = batch.fields["rollout_logprobs"], batch.fields["loss_mask"]
        mismatch: dict[str, float] = {}

        def exact(logprobs: torch.Tensor) -> bool:  # before the optimizer step; every rank sees the whole batch
            mismatch.update(mismatch_metrics(logprobs, rollout_lp, mask))
            return not self._any_rank(mismatch["rollout_corr/unequal_tokens"] > 0)

        with self.actor.kv_scale_meter() if measure else contextlib.nullcontext() as meter:
            out, _ = self.actor.update(batch, self.loss_fn, with_logprobs=True, before_step=exact)
        metrics = {f"actor/{k}": v for k, v in out.items()}
        metrics.update(mismatch)
        metrics["exact/corrected_step"] = 0.0
        if mismatch["rollout_corr/unequal_tokens"] > 0:
            problem = self._exact_mismatch_line(mismatch)
            if self.job.precision.exact_mismatch == "stop":
                raise ExactMismatch(problem + "; the step's update was not applied and this step is not saved. "
                                    "Continue from the last checkpoint with precision.exact_mismatch=correct "
                                    "(such steps recompute and correct their old logprobs) or precision.exact=false")
            self.console.warn(f"{problem}; recomputing this step's old logprobs and updating with "
                              f"algo.correction (mode {self.job.algo.correction.mode})")
            corrected, extra, _ = self.prepare_update(batch, recompute=True)
            metrics = {f"actor/{k}": v for k, v in self.actor.update(corrected, self.loss_fn).items()}
            metrics.update({**extra, **{f"exact/{k.rpartition('/')[2]}": v for k, v in mismatch.items()},
                            "exact/corrected_step": 1.0})
        return metrics, meter.scales if measure else None

    def _exact_mismatch_line(self, mismatch: dict[str, float]) -> str:
        """What a step whose rollout was not exact found, in one line (the engine and its version included)."""
        unequal, dlogp = mismatch["rollout_corr/unequal_tokens"], mismatch["rollout_corr/max_abs_dlogp"]
        return (f"precision.exact: at step {self.step} the update's forward gave {unequal:.0f} response tokens "
                f"other logprobs than the rollout (max |Δlogp| {dlogp:.3g}, k3 {mismatch['rollout_corr/k3_kl']:.3g}; "
                f"{self.engine_description})")

    def sync_weights(self, kv_scales: Optional[torch.Tensor] = None) -> None:
        """The actor's weights (its FP8 bytes and scales) into the engine and, when the engine keeps
        an FP8 KV cache, the KV-cache scales: this step's measured ones, else those it holds already
        (``self.kv_scales``: ones at a fresh start, the checkpoint's after a resume). An exact actor
        then computes with the same scales. The engine retakes only its weight memory here; its KV
        cache waits until the actor has left the GPU (``Colocation.rollout_mode``)."""
        if kv_scales is not None:
            self.kv_scales = kv_scales
        scales = self.kv_scales if self.job.rollout.fp8_kv_cache else None
        self.sync.sync(self.actor.weight_shards(), self.engine, kv_scales=scales)
        if scales is not None and self.job.precision.exact:
            self.actor.use_rollout_kv_scales(scales)
        self.colocation.synced()

    def evaluate(self) -> dict[str, float]:
        """Mean score of one greedy response per evaluation prompt."""
        if self.eval_set is None:
            return {}
        self.colocation.rollout_mode()
        start = time.perf_counter()
        n = min(len(self.eval_set), self.job.data.eval_size or len(self.eval_set))
        prompts = [self.eval_set[i] for i in range(n)]
        greedy = dataclasses.replace(self.sampling, n=1, temperature=0.0)
        mine, samples = self.generate(prompts, greedy, seed=0)
        groups, _, _ = self.score(prompts, mine, samples, greedy)
        scores = [g.responses[0].score for g in groups]
        lengths = [len(g.responses[0].tokens) for g in groups]
        return {"eval/reward": sum(scores) / n, "eval/response_length": sum(lengths) / n,
                "timing/eval_s": time.perf_counter() - start}

    # ------------------------------------------------------------------ start, save, stop

    def _start(self, preemption: PreemptionSignal) -> bool:
        """Resume from the newest complete checkpoint, or start fresh (initial weights, optional
        supervised warm-up); then the first weight sync and, on a fresh run, a step-0 evaluation.
        False when a signal stopped the warm-up."""
        fresh = self.checkpoints.resume_point(self.job.run.resume) is None
        if fresh and self.job.sft.steps and not self.warmup.run(preemption, self._any_rank):
            return False
        self.actor = self._actor_cls(self.resolved.bridge, self.job.actor)
        initial = self._initial_weights()
        if initial is not None:
            self.actor.load(initial, model_only=True)
        if self.job.algo.loss.kl_coef > 0:
            self.actor.keep_reference()
        if not fresh:
            self._resume()
            self.console.close()
            self.console = ConsoleView(self.job.run.steps, enabled=self.rank == 0 and self.job.log.console,
                                       start_step=self.step)
        self.metrics = MetricsLogger(self.run_dir, tensorboard=self.job.log.tensorboard, wandb=self.job.log.wandb,
                                     enabled=self.rank == 0, config=self.job.to_dict(), start_step=self.step)
        self.colocation = Colocation(self.actor, offload_actor=self.job.rollout.offload_actor, sync=self.sync_weights)
        self.colocation.start_engine(self._build_engine)
        plan = SyncPlan(self.resolved.bridge, self.job.precision, self.job.actor.parallel,
                        self.resolved.rollout_tp, self.world)
        self.sync = WeightSync(plan, self.rank, device=self.device)
        self.colocation.train_mode()
        self.sync_weights()
        if self.job.precision.exact:
            self.exact_self_check()
        if fresh and self.job.run.eval_every:
            metrics = self.evaluate()
            self.metrics.log(0, metrics)
            self.console.step_done(0, metrics, CONSOLE_KEYS)
        return True

    SELF_CHECK_PROMPTS = 8
    SELF_CHECK_TOKENS = 32

    def exact_self_check(self) -> dict[str, float]:
        """Before the first step of an exact job: the engine samples a response to each of the first
        ``SELF_CHECK_PROMPTS`` training prompts (temperature 1, ``SELF_CHECK_TOKENS`` new tokens) and
        the trainer scores them; any response token whose logprob is not the engine's ends the start
        with ``ExactMismatch`` (whatever ``precision.exact_mismatch`` says: a job must not begin on a
        rollout it cannot trust), naming the engine and its version. Returns the mismatch metrics."""
        prompts = [self.train_set[i] for i in range(min(self.SELF_CHECK_PROMPTS, len(self.train_set)))]
        sampling = dataclasses.replace(self.sampling, n=1, temperature=1.0, top_p=1.0, top_k=-1,
                                       max_new_tokens=self.SELF_CHECK_TOKENS, stop_token_ids=())
        self.colocation.rollout_mode()
        mine, samples = self.generate(prompts, sampling, seed=self._seed(0))
        groups, _, _ = self.score(prompts, mine, samples, sampling)
        self.colocation.train_mode()
        batch = training_batch(groups, torch.zeros(sum(len(g.responses) for g in groups)), mask_truncated=False)
        logprobs = self.actor.compute_logprobs(batch).logprobs
        metrics = mismatch_metrics(logprobs, batch.fields["rollout_logprobs"], batch.fields["loss_mask"])
        if self._any_rank(metrics["rollout_corr/unequal_tokens"] > 0):
            raise ExactMismatch(
                f"precision.exact: the start-up self-check found {metrics['rollout_corr/unequal_tokens']:.0f} of "
                f"{batch.fields['loss_mask'].sum():.0f} sampled tokens whose trainer logprob is not the engine's "
                f"(max |Δlogp| {metrics['rollout_corr/max_abs_dlogp']:.3g}; {self.engine_description}): the exact "
                "rollout does not hold on this machine and engine; run with precision.exact=false (the default FP8 "
                "rollout, with its recompute and correction), and report the engine version and GPU")
        self.console.log(f"precision.exact: the start-up self-check's {batch.fields['loss_mask'].sum():.0f} sampled "
                         f"tokens have the trainer's logprobs bit for bit ({self.engine_description})")
        return metrics

    def _initial_weights(self) -> Optional[Path]:
        if self.job.sft.steps:
            return self.warmup.weights()
        return Path(self.job.model.checkpoint) if self.job.model.checkpoint else None

    def save(self) -> None:
        """A checkpoint of this step: the actor (model, optimizer, scheduler), the data position and
        every rank's RNG states; written to a staging directory and renamed when complete. A write that
        fails on any rank (a full disk) raises ``RunSaveError`` on every rank, nothing of it kept."""
        self.colocation.train_mode()
        start = time.perf_counter()
        self.checkpoints.save(self.step, self._write_checkpoint, any_rank=self._any_rank)
        self.console.log(f"checkpoint step {self.step} saved in {time.perf_counter() - start:.1f} s")

    def _write_checkpoint(self, staging: Path) -> None:
        self.actor.save(staging / "actor", extra={"step": self.step})
        save_rng(staging, self.rank)
        if self.rank == 0:
            state = {"step": self.step, "sampler": self.sampler.state_dict(), "config": self.job.to_dict(),
                     "kv_scales": self.kv_scales.tolist()}
            save_json_atomic(staging / "trainer_state.json", state)

    def _resume(self) -> None:
        """Restore the newest checkpoint every rank can read; an unreadable one (a file missing,
        truncated or corrupt) is named and the one before it is tried. Raises, naming each
        checkpoint and its problem, when none can be read."""
        self.checkpoints.restore_newest(
            self._restore, any_rank=self._any_rank,
            warn=lambda checkpoint, problem: self.console.log(
                f"WARNING: checkpoint {checkpoint} cannot be read ({problem}); trying the one before it"))

    def _restore(self, checkpoint: Path) -> None:
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        extra = self.actor.load(checkpoint / "actor")
        if extra.get("step") != state["step"]:
            raise RuntimeError(f"{checkpoint}: actor checkpoint is of step {extra.get('step')}, trainer state of "
                               f"step {state['step']}")
        self.step = state["step"]
        self.sampler.load_state_dict(state["sampler"])
        if "kv_scales" in state:  # checkpoints written before the scales were kept: ones, as at a start
            self.kv_scales = torch.tensor(state["kv_scales"], dtype=torch.float32)
        load_rng(checkpoint, self.rank)
        self.console.log(f"resumed from {checkpoint} (step {self.step})")

    def _stop(self, preemption: PreemptionSignal, *, saved: bool) -> int:
        what = f"checkpoint of step {self.step} saved" if saved else "stopped before training started"
        self.console.log(f"{preemption.signal_name or 'a signal'} received: {what}; "
                         "run the same command to continue")
        return EXIT_PREEMPTED

    def close(self) -> None:
        self.reward.close()
        if self.metrics is not None:
            self.metrics.close()
        self.console.close()
        if self.actor is not None:  # first: the engine's close takes its whole share of the GPU back for a moment
            self.actor.close()
        if self.engine is not None:
            self.engine.close()

    # ------------------------------------------------------------------ helpers

    def _build_engine(self) -> RolloutEngine:
        return build_engine(self.job.rollout, self.job.precision, self.resolved.hf_config, device=self.device,
                            max_model_len=self.job.longest_sequence)

    @contextlib.contextmanager
    def _phase(self, name: str):
        """Time a phase of the step (CUDA-synchronised), show it in the console view, record the
        GPU memory it peaked at, and its kernels in a profiled step (``run.profile_steps``)."""
        with self.timer.phase(name), self.console.phase(name), self.memory.track(name), \
                self.profiler.phase(self.step, name):
            yield

    def _write_profile(self) -> None:
        path = self.profiler.write(self.step, self.run_dir)
        if path is not None:
            self.console.log(f"step {self.step}: kernel time per phase -> {path}")

    def _seed(self, round_: int) -> int:
        """The sampling seed of this step's round: a function of run.seed, step, round and replica."""
        text = f"{self.job.run.seed}/{self.step}/{round_}/{self.replica}".encode()
        return int.from_bytes(hashlib.sha256(text).digest()[:4], "little")

    def _strip_stop(self, tokens: list[int]) -> list[int]:
        return tokens[:-1] if tokens and tokens[-1] in self.sampling.stop_token_ids else tokens

    def _overlong_penalty(self, lengths: list[int], max_new_tokens: int) -> list[float]:
        o = self.job.data.overlong
        if o.mode != "soft":
            return [0.0] * len(lengths)
        return overlong_penalty(torch.tensor(lengths), max_new_tokens, o.buffer_tokens, o.penalty).tolist()

    def _any_rank(self, flag: bool) -> bool:
        return any_rank(flag, device=self.device if self.device.type == "cuda" else None)
