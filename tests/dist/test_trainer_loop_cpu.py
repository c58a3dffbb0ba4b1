"""The RL loop's plumbing on CPU: ``Trainer`` with the real data, rewards, rollout engine (the hf
engine, FP8 emulated), weight sync, checkpoints, metrics and console, around a test double of the
megatron actor (megatron-core's GPTModel needs CUDA; tests/gpu/test_rl_loop.py runs the real one).

What it pins down: a run completes and logs every metric family; a run stopped by a signal and
rerun continues exactly as an uninterrupted run (same batches, same samples, same rewards); a
finished run extended with more steps continues; run.resume=false refuses a used directory; the
two-process loop splits generation over rollout replicas and agrees on every rank.
"""

from __future__ import annotations

import json
import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_jetrl.algo import LossInputs
from megatron_jetrl.config import ConfigError
from megatron_jetrl.job import load_data, load_job, resolve
from megatron_jetrl.runtime import EXIT_PREEMPTED
from megatron_jetrl.sync.local import shard_state

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "configs" / "tiny_countdown.yaml"
SMALL = ("run.steps=4", "run.save_every=0", "run.eval_every=2", "data.prompts_per_step=4", "algo.group_size=4",
         "rollout.sampling.max_new_tokens=8", "sft.steps=2", "sft.batch_size=4", "data.eval_size=4",
         "model.config.num_hidden_layers=2", "log.tensorboard=false", "rollout.hf.max_num_seqs=16")


@dataclass(frozen=True)
class _Logprobs:
    logprobs: torch.Tensor
    entropy: Optional[torch.Tensor] = None
    kv_scales: Optional[torch.Tensor] = None


class FakeActor:
    """Stands in for ``megatron_jetrl.actor.Actor``: a full state dict of random weights, sharded
    for the sync by ``sync.local.shard_state`` (with the trainer's FP8 weights); ``update`` runs
    the real loss on the batch and moves the weights by a deterministic amount; logprobs are the
    engine's (the double has no model). It enforces the colocation protocol: nothing touches the
    weights while they are offloaded."""

    signal_at_update: Optional[int] = None

    def __init__(self, bridge, settings):
        self.bridge, self.settings = bridge, settings
        self.steps, self.offloaded, self.reference = 0, False, None
        g = torch.Generator().manual_seed(settings.seed)
        dtype = settings.precision.compute_dtype
        self.full = {}
        for spec in bridge.tensor_map():
            if len(spec.shape) == 1:  # norms (and biases): ones keep activations sane
                t = torch.ones(spec.shape)
            else:
                t = torch.randn(spec.shape, generator=g) * 0.05
            self.full[spec.megatron] = t.to(dtype)

    def _check(self):
        assert not self.offloaded, "the actor was used while offloaded"

    def compute_logprobs(self, batch, *, with_entropy=False, kv_scales=False):
        self._check()
        return _Logprobs(batch.fields["rollout_logprobs"].clone() if "rollout_logprobs" in batch.fields
                         else torch.zeros(batch.tokens.numel()))

    def update(self, batch, loss_fn):
        self._check()
        mask = batch.fields["loss_mask"]
        base = batch.fields.get("old_logprobs", torch.zeros(batch.tokens.numel()))
        lp = base.clone().float().requires_grad_()
        inp = LossInputs(logprobs=lp, entropy=torch.zeros_like(lp), fields=dict(batch.fields),
                         cu_seqlens=batch.cu_seqlens, global_tokens=max(1.0, float(mask.sum())),
                         global_sequences=batch.num_sequences)
        loss, metrics = loss_fn(inp)
        loss.backward()
        g = torch.Generator().manual_seed(1000 + self.steps)
        for t in self.full.values():
            t += (torch.randn(t.shape, generator=g) * 1e-3).to(t.dtype)
        self.steps += 1
        if self.signal_at_update == self.steps and "advantages" in batch.fields:
            os.kill(os.getpid(), signal.SIGUSR1)
        out = {k: float(v) for k, v in metrics.items()}
        out.update(grad_norm=float(lp.grad.norm()), lr=self.settings.optimizer.lr)
        return out

    def weight_shards(self):
        self._check()
        world = dist.get_world_size()
        dp = self.settings.data_parallel_size(world)
        return shard_state(self.bridge, self.settings.precision, self.full, self.settings.parallel,
                           dp_size=dp)[dist.get_rank()]

    def offload(self, need=None):
        self._check()
        self.offloaded = True

    def onload(self):
        self.offloaded = False

    def keep_reference(self):
        self.reference = {k: v.clone() for k, v in self.full.items()}

    def reference_logprobs(self, batch):
        return torch.zeros(batch.tokens.numel())

    def save(self, directory, *, extra=None):
        self._check()
        Path(directory).mkdir(parents=True, exist_ok=True)
        torch.save({"full": self.full, "steps": self.steps, "extra": extra or {}},
                   Path(directory) / f"fake_rank{dist.get_rank()}.pt")

    def load(self, directory, *, model_only=None):
        data = torch.load(Path(directory) / f"fake_rank{dist.get_rank()}.pt")
        self.full = data["full"]
        if not model_only:
            self.steps = data["steps"]
        return data["extra"]

    def close(self):
        pass


@pytest.fixture
def process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _run(run_dir: Path, *overrides: str, actor_cls=FakeActor) -> int:
    from megatron_jetrl.trainer import Trainer

    given = {o.partition("=")[0] for o in overrides}  # a key is given once: the test's value replaces SMALL's
    job = load_job(TINY, [*(o for o in SMALL if o.partition("=")[0] not in given), f"run.dir={run_dir}", *overrides])
    resolved = resolve(job, dist.get_world_size())
    trainer = Trainer(job, resolved, load_data(job, resolved), run_dir=run_dir, device=torch.device("cpu"),
                      actor_cls=actor_cls)
    try:
        return trainer.run()
    finally:
        trainer.close()


def _rows(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    return {r["step"]: r for r in rows}


SAME = ("data/prompt_index_fingerprint", "reward/mean", "response/length_mean", "actor/loss",
        "rollout_corr/k3_kl")


def test_loop_runs_logs_and_checkpoints(tmp_path, process_group):
    assert _run(tmp_path / "a") == 0
    rows = _rows(tmp_path / "a")
    assert sorted(rows) == [0, 1, 2, 3, 4]
    assert "eval/reward" in rows[0] and "eval/reward" in rows[2] and "eval/reward" in rows[4]
    for key in ("reward/mean", "actor/loss", "actor/clip_fraction", "timing/generate_s", "timing/score_s",
                "timing/sync_s", "timing/colocate_s",
                "token_mult_prob_error", "rollout_corr/k3_kl", "perf/tokens_per_s_per_gpu",
                "dynamic_sampling/rounds", "cpu/generate_process_s", "cpu/update_process_s"):
        assert key in rows[3], key
    assert rows[3]["cpu/update_process_s"] > 0  # the update computes on this process's CPU
    # the double returns the engine's logprobs as the trainer's: no mismatch
    assert rows[3]["token_mult_prob_error"] == pytest.approx(1.0)
    assert (tmp_path / "a" / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    assert (tmp_path / "a" / "sft" / "checkpoints" / "latest").is_file()
    assert (tmp_path / "a" / "sft" / "metrics.jsonl").is_file()


def test_log_every_logs_every_nth_step_and_always_the_last_and_evaluated_ones(tmp_path, process_group, capsys):
    """``log.every``: the console line and metrics.jsonl get every n-th step, and always the last
    step and a step with an evaluation (whose figures would otherwise be lost)."""
    assert _run(tmp_path / "n", "run.steps=5", "run.eval_every=0", "log.every=3") == 0
    assert sorted(_rows(tmp_path / "n")) == [3, 5]
    assert re.findall(r"^step (\d)/5", capsys.readouterr().out, flags=re.M) == ["3", "5"]
    assert _run(tmp_path / "e", "run.steps=5", "run.eval_every=2", "log.every=3") == 0
    assert sorted(_rows(tmp_path / "e")) == [0, 2, 3, 4, 5]


def test_a_profiled_step_writes_its_phases(tmp_path, process_group):
    """``run.profile_steps``: the chosen step's phases go to profiles/step_<N>.json (on a CPU
    device their wall seconds only: there are no kernels to time)."""
    assert _run(tmp_path / "p", "run.profile_steps=[2]") == 0
    assert sorted(p.name for p in (tmp_path / "p" / "profiles").iterdir()) == ["step_2.json"]
    profile = json.loads((tmp_path / "p" / "profiles" / "step_2.json").read_text())
    assert profile["step"] == 2 and profile["device"] == "cpu"
    assert set(profile["phases"]) == {"colocate", "generate", "score", "advantages", "logprobs", "update", "sync"}
    for phase in profile["phases"].values():
        assert phase["wall_s"] > 0 and phase["kernel_ms"] == 0 and phase["classes_ms"] == {}


def test_signal_stops_with_a_checkpoint_and_rerun_continues_exactly(tmp_path, process_group):
    assert _run(tmp_path / "whole") == 0
    want = _rows(tmp_path / "whole")

    class Interrupted(FakeActor):
        signal_at_update = 2

    assert _run(tmp_path / "cut", actor_cls=Interrupted) == EXIT_PREEMPTED
    assert (tmp_path / "cut" / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    assert sorted(_rows(tmp_path / "cut")) == [0, 1, 2]
    assert _run(tmp_path / "cut") == 0
    got = _rows(tmp_path / "cut")
    assert sorted(got) == sorted(want)
    for step in range(1, 5):
        for key in SAME:
            assert got[step][key] == want[step][key], (step, key, got[step][key], want[step][key])


def test_extending_a_finished_run_and_refusing_a_used_directory(tmp_path, process_group):
    assert _run(tmp_path / "whole") == 0
    want = _rows(tmp_path / "whole")
    assert _run(tmp_path / "ext", "run.steps=2") == 0
    assert _run(tmp_path / "ext", "run.steps=4") == 0
    got = _rows(tmp_path / "ext")
    for step in (3, 4):
        for key in SAME:
            assert got[step][key] == want[step][key], (step, key)
    with pytest.raises(ConfigError, match="run.resume"):
        _run(tmp_path / "ext", "run.resume=false")


def _two_ranks(rank: int, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg2", rank=rank, world_size=2)
    try:
        assert _run(Path(tmp) / "two", "run.steps=2", "run.eval_every=0") == 0
    finally:
        dist.destroy_process_group()


def test_two_processes_split_generation_and_agree(tmp_path):
    mp.start_processes(_two_ranks, args=(str(tmp_path),), nprocs=2, start_method="spawn")
    rows = _rows(tmp_path / "two")
    assert sorted(rows) == [1, 2]
    # 4 prompts x 4 samples generated by 2 replicas, all present in the batch
    assert rows[1]["data/prompts_sampled"] == 4.0 and rows[1]["dynamic_sampling/kept_fraction"] == 1.0


def test_optional_paths_run(tmp_path, process_group):
    """KL penalty, token TIS, dynamic sampling and the soft overlong penalty go through the loop."""
    assert _run(tmp_path / "opt", "run.steps=2", "algo.loss.kl_coef=0.01", "algo.correction.mode=token_tis",
                "data.dynamic_sampling.enabled=true", "data.dynamic_sampling.max_rounds=2",
                "data.overlong.mode=soft", "data.overlong.buffer_tokens=4") == 0
    rows = _rows(tmp_path / "opt")
    assert "actor/kl" in rows[2] and "rollout_corr/is_weight_mean" in rows[2]
    assert 1 <= rows[2]["dynamic_sampling/rounds"] <= 2


class DiscardingEngine:
    """The real hf engine behind vLLM's level-2 sleep rule: a sleep drops the weights, and
    ``generate`` refuses until every tensor arrived again (through ``weight_buffers`` or
    ``update_weights``)."""

    def __init__(self, inner):
        self.inner, self.missing = inner, set(inner.weight_specs())

    @property
    def weights_discarded(self) -> bool:
        return bool(self.missing)

    def weight_specs(self):
        return self.inner.weight_specs()

    def weight_buffers(self):
        buffers = self.inner.weight_buffers()
        self.missing -= set(buffers)
        return buffers

    def update_weights(self, tensors):
        items = list(tensors)
        self.inner.update_weights(items)
        self.missing -= {name for name, _ in items}

    def generate(self, prompts, sampling):
        assert not self.missing, f"generate with {len(self.missing)} discarded weight tensors"
        return self.inner.generate(prompts, sampling)

    def sleep(self):
        self.inner.sleep()
        self.missing = set(self.inner.weight_specs())

    def wake(self):
        self.inner.wake()

    def wake_bytes(self):
        return self.inner.wake_bytes()

    def close(self):
        self.inner.close()


def test_an_engine_that_discards_its_weights_in_sleep_gets_them_again(tmp_path, process_group, monkeypatch):
    """A checkpoint after an evaluation puts the engine to sleep after the step's sync: an engine
    that drops its weights then (vLLM, sleep level 2) is synced again before it generates, and the
    run equals one with an engine that keeps them."""
    from megatron_jetrl.trainer import Trainer

    assert _run(tmp_path / "keeps", "run.save_every=2") == 0
    want = _rows(tmp_path / "keeps")
    build = Trainer._build_engine
    monkeypatch.setattr(Trainer, "_build_engine", lambda self: DiscardingEngine(build(self)))
    assert _run(tmp_path / "drops", "run.save_every=2") == 0
    got = _rows(tmp_path / "drops")
    assert sorted(got) == sorted(want) == [0, 1, 2, 3, 4]
    for step in range(1, 5):
        for key in SAME:
            assert got[step][key] == want[step][key], (step, key)


@pytest.mark.parametrize("damage", ["trainer state not JSON", "actor file missing", "actor file truncated"])
def test_an_unreadable_checkpoint_falls_back_to_the_one_before(tmp_path, process_group, capsys, damage):
    """Resuming skips a damaged newest checkpoint, naming it, and continues from the one before,
    exactly as a run resumed from that one would; with none readable it stops naming each."""
    assert _run(tmp_path / "whole", "run.steps=6", "run.save_every=2", "run.keep_last=3") == 0
    want = _rows(tmp_path / "whole")
    assert _run(tmp_path / "cut", "run.steps=4", "run.save_every=2", "run.keep_last=3") == 0
    newest = tmp_path / "cut" / "checkpoints" / "step_00000004"
    state, actor_file = newest / "trainer_state.json", newest / "actor" / "fake_rank0.pt"
    if damage == "trainer state not JSON":
        state.write_text(state.read_text()[:20])
    elif damage == "actor file missing":
        actor_file.unlink()
    else:
        actor_file.write_bytes(actor_file.read_bytes()[:100])
    capsys.readouterr()
    assert _run(tmp_path / "cut", "run.steps=6", "run.save_every=2", "run.keep_last=3") == 0
    out = capsys.readouterr()
    assert f"checkpoint {newest} cannot be read" in out.out + out.err
    got = _rows(tmp_path / "cut")
    for step in range(3, 7):  # redone from step 2's checkpoint: the same steps as the whole run
        for key in SAME:
            assert got[step][key] == want[step][key], (step, key)

    from megatron_jetrl.models.hf_checkpoint import CheckpointError

    for step_dir in (tmp_path / "cut" / "checkpoints").glob("step_*"):
        (step_dir / "trainer_state.json").write_text("{")
    with pytest.raises(CheckpointError, match="no checkpoint in .* can be read .*step_00000006.*step_00000004"):
        _run(tmp_path / "cut", "run.steps=8")
