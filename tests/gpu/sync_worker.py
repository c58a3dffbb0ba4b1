"""The weight-sync contract on GPUs, run under torchrun by tests/gpu/test_weight_sync.py:

    torchrun --nproc-per-node N tests/gpu/sync_worker.py --root DIR --scenarios NAME[,NAME...]

- byte_identity: an FP8 actor (native backend) syncs into the hf engine; every FP8 weight and
  ``weight_scale_inv`` inside the engine hashes equal to the trainer's FProp weights of that step,
  reconstructed from the trainer's shards with plain torch (not the sync's code); again after an
  optimizer step. With 2 GPUs: train TP=2 -> rollout TP=1 (every rank's engine holds the full
  model) and -> rollout TP=2 (each rank holds vLLM's shard).
- byte_identity_te: the same with the te backend (Transformer Engine's linears; tests/gpu/test_te_backend.py).
- mismatch: for bf16, fp8 (unified), bf16-train+fp8-rollout and fp16, the engine samples
  responses and reports rollout logprobs; the trainer recomputes them; rank 0 records mean
  |Δlogp|, k3 KL and token_mult_prob_error over response tokens.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_jetrl.actor import PackedBatch  # noqa: E402
from megatron_jetrl.algo import cross_entropy_loss  # noqa: E402
from megatron_jetrl.models.bridge import FC1, QKV  # noqa: E402
from megatron_jetrl.models.layout import split_qkv  # noqa: E402
from megatron_jetrl.rollout import HfEngine, SamplingParams  # noqa: E402
from megatron_jetrl.sync import SyncPlan, WeightSync  # noqa: E402
from tests.gpu.actor_worker import Scenarios as ActorScenarios  # noqa: E402
from tests.gpu.actor_worker import main, make_batch  # noqa: E402

ARCH = "Qwen3ForCausalLM"  # head_dim 128: the trainer's FP8 blocks re-slice exactly


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def trainer_fp8_hashes(actor, rollout_tp: int, rollout_rank: int) -> dict[str, str]:
    """sha256 of every FP8 linear's codes and scale_inv as the engine must hold them, rebuilt from
    all TP ranks' FProp weights with plain torch: gather, undo megatron's layout, cut vLLM's shard."""
    from megatron.core import parallel_state

    bridge, d = actor.bridge, actor.bridge.dims
    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group()
    shards = actor.weight_shards()
    out = {}
    for spec in bridge.tensor_map():
        if not spec.linear:
            continue
        fp8 = shards[spec.megatron][1]
        parts = {}
        for kind, t in (("data", fp8.data.view(torch.uint8)), ("scale", fp8.scale_inv.contiguous())):
            pieces = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(pieces, t, group=group)
            unit = 1 if kind == "data" else 128  # scale rows are 128-row blocks
            if spec.fuse == QKV:
                full = torch.cat(pieces)
                hf = split_qkv(full, d.num_heads, d.num_groups, d.head_dim // unit)
            elif spec.fuse == FC1:
                half = pieces[0].shape[0] // 2
                hf = (torch.cat([p[:half] for p in pieces]), torch.cat([p[half:] for p in pieces]))
            else:
                hf = (torch.cat(pieces, dim=spec.tp_dim),)
            for name, full_t in zip(spec.hf, hf, strict=True):
                key = name if kind == "data" else name + "_scale_inv"
                parts[key] = full_t.chunk(rollout_tp, dim=spec.tp_dim)[rollout_rank]
        out.update({k: sha(v) for k, v in parts.items()})
    return out


class Recorder:
    """An engine that keeps what it is given (rollout TP > 1 shards, which the hf engine cannot run)."""

    def __init__(self, specs):
        self.specs, self.tensors = specs, {}

    def weight_specs(self):
        return self.specs

    def update_weights(self, tensors):
        self.tensors.update((n, t.clone()) for n, t in tensors)

    def weight_buffers(self):  # handed-over tensors only
        return {}


def engine_vs_trainer(actor, prompts, samples, *, kv_scales: bool = False) -> tuple[dict, torch.Tensor | None]:
    """The trainer recomputes the logprobs of an engine's samples: mean |Δlogp|, k3 KL,
    token_mult_prob_error, mean |Δp| and the trainer's mean logp over response tokens; with
    ``kv_scales`` also the FP8 KV-cache scales that pass measured."""
    seqs = [prompts[s.prompt_index] + s.tokens for s in samples]
    masks = [[0] * len(prompts[s.prompt_index]) + [1] * len(s.tokens) for s in samples]
    rollout = [[0.0] * len(prompts[s.prompt_index]) + s.logprobs for s in samples]
    batch = PackedBatch.from_sequences([torch.tensor(x) for x in seqs], loss_mask=masks)
    out = actor.compute_logprobs(batch, kv_scales=kv_scales)
    mask = batch.fields["loss_mask"].bool()
    lp_train, lp_roll = out.logprobs[mask].double(), torch.tensor([v for r in rollout for v in r]).double()[mask]
    log_r = (lp_train - lp_roll).clamp(-20, 20)
    r = log_r.exp()
    return {
        "tokens": int(mask.sum()),
        "mean_abs_dlogp": (lp_train - lp_roll).abs().mean().item(),
        "k3_kl": (r - log_r - 1).mean().item(),
        "token_mult_prob_error": (lp_train - lp_roll).abs().exp().mean().item(),
        "probs_diff_mean": (lp_train.exp() - lp_roll.exp()).abs().mean().item(),
        "mean_logp": lp_train.mean().item(),
    }, out.kv_scales


class Scenarios(ActorScenarios):
    def sync_for(self, actor, recipe, rollout_tp: int, engine=None):
        plan = SyncPlan(actor.bridge, recipe, actor.settings.parallel, rollout_tp, self.world)
        sync = WeightSync(plan, dist.get_rank(), device=actor.device, bucket_mb=1)
        shards = actor.weight_shards()
        return sync, shards

    def _engine_hashes(self, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
        return {n: sha(t) for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn or n.endswith("_scale_inv")}

    def _identity_round(self, actor, recipe, rollout_tp: int, in_place: bool) -> dict:
        sync, shards = self.sync_for(actor, recipe, rollout_tp)
        if rollout_tp == 1:
            engine = HfEngine(actor.bridge.hf_config, recipe, device=actor.device)
            tensors = engine.named_weights
        else:
            engine = Recorder(sync.engine_specs())
            tensors = engine.tensors
        sync.check(shards, engine)
        report = sync.sync(shards, engine, in_place=in_place)
        got = self._engine_hashes(dict(tensors() if callable(tensors) else tensors))
        want = trainer_fp8_hashes(actor, rollout_tp, dist.get_rank() % rollout_tp)
        return {"engine": got, "trainer": want, "report": report, "engine_obj": engine, "sync": sync}

    def byte_identity(self, backend: str = "native"):
        """Engine FP8 bytes and scales == the trainer's FProp weights, before and after a step."""
        recipe_mode = "fp8"
        layouts = [(1, 1)] if self.world == 1 else [(2, 1), (2, 2)]
        for tp, rollout_tp in layouts:
            actor = self.actor(ARCH, mode=recipe_mode, tp=tp, lr=1e-3, backend=backend)
            recipe = actor.settings.precision
            # in place into the hf engine's own tensors, then (after a step) handed over through
            # update_weights: both paths must deliver the trainer's bytes
            first = self._identity_round(actor, recipe, rollout_tp, in_place=True)
            batch = make_batch(actor.bridge.dims.vocab_size)
            actor.update(batch, cross_entropy_loss)
            second = self._identity_round(actor, recipe, rollout_tp, in_place=False)
            ok = []
            for r in (first, second):
                ok.append(bool(r["engine"]) and r["engine"] == r["trainer"])
            flags = torch.tensor([int(all(ok))], device=actor.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)
            changed = sum(first["engine"][k] != second["engine"][k] for k in first["engine"])
            self.record(f"identity/{'te_' if backend == 'te' else ''}tp{tp}_rollout{rollout_tp}", {
                "all_ranks_identical": bool(flags.item()), "fp8_tensors": len(first["engine"]),
                "changed_after_step": changed, "rounds": second["report"].rounds,
                "in_place_tensors": first["report"].in_place,
                "engine_gb": second["report"].engine_bytes / 1e9, "sync_s": second["report"].total_s,
                "first_diff": next((k for k in first["trainer"] if first["engine"].get(k) != first["trainer"][k]),
                                   None),
            })
            actor.close()

    def byte_identity_te(self):
        """The same with the te backend: the engine holds TE's FP8 bytes of the step."""
        self.byte_identity(backend="te")

    def mismatch(self):
        """Engine rollout logprobs vs the trainer's recomputation, per precision mode."""
        prompts_g = torch.Generator().manual_seed(1)
        for mode in ("bf16", "fp8", "bf16-train+fp8-rollout", "fp16"):
            actor = self.actor(ARCH, mode=mode, lr=1e-3)
            recipe = actor.settings.precision
            vocab = actor.bridge.dims.vocab_size
            # a few supervised steps so the model's distributions are not near uniform
            for step in range(3):
                actor.update(make_batch(vocab, seed=100 + step), cross_entropy_loss)
            sync, shards = self.sync_for(actor, recipe, 1)
            engine = HfEngine(actor.bridge.hf_config, recipe, device=actor.device)
            sync.check(shards, engine)
            sync.sync(shards, engine)
            prompts = [torch.randint(0, vocab, (int(n),), generator=prompts_g).tolist() for n in (16, 40, 7, 64)]
            samples = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=96, seed=0))
            engine.close()
            result, _ = engine_vs_trainer(actor, prompts, samples)
            self.record(f"mismatch/{mode}", result)
            actor.close()


if __name__ == "__main__":
    sys.exit(main(Scenarios))
