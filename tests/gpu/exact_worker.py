"""The exact rollout (``precision.exact``) inside real vLLM on a GPU, run under torchrun by
tests/gpu/test_exact.py (one engine per process, so one scenario per launch):

    torchrun --nproc-per-node 1 tests/gpu/exact_worker.py --root DIR --scenarios NAME   (2 for *_tp2, 4 for *_tp4)

- exact_<mode> (bf16, fp8): the tiny Qwen3 (4 layers, random weights sharpened by three supervised
  steps), vLLM with torch.compile and CUDA graphs as a job runs it. vLLM samples (temperature 1) for
  one prompt alone and for 64 prompts x 4 samples (256 sequences at once); the trainer recomputes
  every sampled token's logprob in packed micro-batches, and the update's own forward computes
  them again: each must equal vLLM's bit for bit. Then two optimizer steps on those rollouts, a
  sync, and the same again.
- exact_fp8_8b6 / exact_bf16_8b6: 6 layers at Qwen3-8B widths (vocabulary 151,936), random
  weights from megatron's initialisation (not vLLM's dummy weights, whose logits are uniform).
- unsegmented_fp8_kv_8b6: the negative control of exact_fp8_kv_8b6, vLLM's prefills unsegmented.
- exact_fp8_kv / exact_fp8_kv_8b6: with an FP8 KV cache; the KV-cache scales the engine holds are
  the trainer's exact attention's too: first measured on a batch, then by each round's update.
- exact_fp8_tp2 / exact_bf16_tp2 / exact_fp8_8b6_tp2: the same at trainer TP 2 (sequence parallel)
  = rollout TP 2, two GPUs, one engine over both ranks; each rank's logprobs equal vLLM's.
- exact_fp8_tp4 / exact_bf16_tp4 / exact_fp8_8b6_tp4 / exact_bf16_8b6_tp4: at trainer TP 4 (sequence
  parallel) = rollout TP 4, four GPUs: the row-parallel outputs reduced in the contract's order on
  both sides; unordered_fp8_8b6_tp4, the negative control: the same with each side's own reduction.
- exact_fallback: an engine whose norm / activation / rotary replacements were not installed (as
  if vLLM ignored them) must refuse to start, naming the modules; an actor whose modules are not
  all exact must refuse too.
- grad_<mode>_<exact|default>: one update's gradients (no optimizer step) of 2 layers at Qwen3-8B
  widths from the same initialisation and batch, saved for the test to compare across processes.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_jetrl.actor import Actor, ActorSettings, OptimizerSettings, PackedBatch  # noqa: E402
from megatron_jetrl.algo import cross_entropy_loss  # noqa: E402
from megatron_jetrl.models import ParallelLayout, bridge_for  # noqa: E402
from megatron_jetrl.precision import PrecisionRecipe  # noqa: E402
from megatron_jetrl.rollout import SamplingParams  # noqa: E402
from megatron_jetrl.rollout import vllm_exact  # noqa: E402
from megatron_jetrl.rollout.vllm_engine import VllmEngine, VllmOptions  # noqa: E402
from megatron_jetrl.sync import SyncPlan, WeightSync  # noqa: E402
from tests.gpu.actor_worker import main, make_batch  # noqa: E402
from tests.gpu.sync_worker import ARCH  # noqa: E402
from tests.gpu.vllm_worker import Scenarios as VllmScenarios  # noqa: E402


def rollout_batch(prompts, samples) -> tuple[PackedBatch, torch.Tensor]:
    """The samples as the trainer packs them (prompt + response, loss on the response, advantages
    alternating in sign), and the engine's logprob of every token (0 on prompt tokens)."""
    seqs, masks, adv, rollout = [], [], [], []
    for i, s in enumerate(samples):
        p = prompts[s.prompt_index]
        seqs.append(torch.tensor(p + s.tokens))
        masks.append(torch.tensor([0.0] * len(p) + [1.0] * len(s.tokens)))
        adv.append(torch.full((len(p) + len(s.tokens),), 1.0 if i % 2 else -1.0))
        rollout.append(torch.tensor([0.0] * len(p) + list(s.logprobs), dtype=torch.float32))
    batch = PackedBatch.from_sequences(seqs, loss_mask=masks, advantages=adv)
    return batch, torch.cat(rollout)


def equality(trainer_lp: torch.Tensor, rollout_lp: torch.Tensor, mask: torch.Tensor) -> dict:
    """Exactness of the trainer's logprobs against the engine's over response tokens: unequal
    tokens (fp32 comparison), max |Δlogp|, k3 KL."""
    keep = mask > 0
    t, g = trainer_lp[keep].float(), rollout_lp[keep].float()
    log_r = (t.double() - g.double()).clamp(-20, 20)
    return {"tokens": int(keep.sum()), "equal": bool(torch.equal(t, g)), "unequal": int((t != g).sum()),
            "max_abs_dlogp": float((t - g).abs().max()), "k3": float((log_r.exp() - log_r - 1).mean()),
            "mean_logp": float(t.mean())}


def policy_loss(inputs):
    """A loss that moves the weights: -advantage x logprob over the response tokens."""
    mask = inputs.fields["loss_mask"]
    loss = -(inputs.fields["advantages"] * inputs.logprobs * mask).sum() / inputs.global_tokens
    return loss, {"loss": loss.detach()}


class Scenarios(VllmScenarios):
    def _exact_actor(self, mode: str, hf_config: dict | None, mb_tokens: int, tp: int) -> Actor:
        if hf_config is None:  # the tiny model, from its converted checkpoint
            actor = self.actor(ARCH, mode=mode, lr=1e-3, exact=True, mb_tokens=mb_tokens, tp=tp, sp=tp > 1)
        else:  # megatron's random initialisation at real widths
            recipe = PrecisionRecipe(mode=mode, exact=True)
            settings = ActorSettings(precision=recipe, max_tokens_per_microbatch=mb_tokens,
                                     parallel=ParallelLayout(tp=tp, sequence_parallel=tp > 1),
                                     optimizer=OptimizerSettings(lr=1e-4, weight_decay=0.0, clip_grad=1.0))
            actor = Actor(bridge_for(hf_config), settings)
        vocab = actor.bridge.dims.vocab_size
        for step in range(3):  # distributions away from uniform
            actor.update(make_batch(vocab, seed=100 + step), cross_entropy_loss)
        return actor

    def _round(self, actor, engine, sync, prompts, n: int, new_tokens: int, seed: int, kv_scales=None) -> dict:
        """Sync (with ``kv_scales``: the FP8 KV cache's, into the engine and the actor), sample,
        compare: the recomputation and the update's own forward (which then steps, measuring the
        next scales as the trainer does)."""
        engine.sleep()
        sync.sync(actor.weight_shards(), engine, kv_scales=kv_scales)
        if kv_scales is not None:
            actor.use_rollout_kv_scales(kv_scales)
        engine.wake()
        torch.cuda.synchronize()
        start = time.perf_counter()
        samples = engine.generate(prompts, SamplingParams(n=n, temperature=1.0, max_new_tokens=new_tokens,
                                                          seed=seed))
        generate_s = time.perf_counter() - start
        engine.sleep()
        batch, rollout_lp = rollout_batch(prompts, samples)
        mask = batch.fields["loss_mask"]
        recomputed = equality(actor.compute_logprobs(batch).logprobs, rollout_lp, mask)
        with actor.kv_scale_meter() if kv_scales is not None else contextlib.nullcontext() as meter:
            _, update_lp = actor.update(batch, policy_loss, with_logprobs=True)
        torch.cuda.empty_cache()  # the engine takes its memory back at the next wake (colocation does the same)
        out = {"sequences": len(samples), "generate_s": generate_s, "recompute": recomputed,
               "update_forward": equality(update_lp, rollout_lp, mask)}
        if kv_scales is not None:
            out["kv_scales_used"], out["next_kv_scales"] = kv_scales[0].tolist(), meter.scales
        return out

    def _exact(self, name: str, mode: str, *, hf_config: dict | None = None, prompt_len: int = 48,
               new_tokens: int = 96, mb_tokens: int = 256, memory: float = 0.3, tp: int = 1, kv_fp8: bool = False,
               after_start=None):
        if self.world != tp:
            raise RuntimeError(f"{name} runs at trainer TP = rollout TP = {tp}, a GPU each; launched with {self.world}")
        actor = self._exact_actor(mode, hf_config, mb_tokens, tp)
        recipe = actor.settings.precision
        options = VllmOptions(gpu_memory_utilization=memory, max_model_len=prompt_len + new_tokens, max_num_seqs=256,
                              cuda_graph_max_batch=256, tensor_parallel_size=tp,
                              kv_cache_dtype="fp8" if kv_fp8 else "auto")
        start = time.perf_counter()
        job_nccl = {name: os.environ.get(name) for name in vllm_exact.VLLM_NCCL_PINS}
        engine = VllmEngine(actor.bridge.hf_config, recipe, options)
        r = {"engine_start_s": time.perf_counter() - start, "exact_modules": engine.exact_modules,
             "nccl_pins_undone": engine.nccl_pins_undone,
             "nccl_env_kept": all(os.environ.get(name) == value for name, value in job_nccl.items())}
        if after_start is not None:  # a negative control's change, after the engine's start-up check
            after_start()
        plan = SyncPlan(actor.bridge, recipe, actor.settings.parallel, tp, self.world)
        sync = WeightSync(plan, dist.get_rank(), device=actor.device)
        vocab = actor.bridge.dims.vocab_size
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(0, vocab, (int(n),), generator=g).tolist()
                   for n in torch.randint(8, prompt_len + 1, (64,), generator=g)]
        # with an FP8 KV cache: first scales measured on a batch, then each round's update measures the next
        scales = actor.compute_logprobs(make_batch(vocab, seed=5), kv_scales=True).kv_scales if kv_fp8 else None
        r["batch1"] = self._round(actor, engine, sync, prompts[:1], 1, new_tokens, seed=11, kv_scales=scales)
        scales = r["batch1"].pop("next_kv_scales", None)
        r["batch256"] = self._round(actor, engine, sync, prompts, 4, new_tokens, seed=12, kv_scales=scales)
        scales = r["batch256"].pop("next_kv_scales", None)
        actor.update(make_batch(vocab, seed=7), cross_entropy_loss)  # the rounds stepped once each already
        r["after_steps"] = self._round(actor, engine, sync, prompts, 4, new_tokens, seed=13, kv_scales=scales)
        r["after_steps"].pop("next_kv_scales", None)
        r["steps"] = actor.steps
        if tp > 1:  # one engine over both ranks; each trainer rank's logprobs must equal it
            cases = {case: r[case] | {"generate_s": None} for case in ("batch1", "batch256", "after_steps")}
            everyone = [None] * self.world
            dist.all_gather_object(everyone, cases)
            r["tp"], r["ranks_alike"] = tp, all(c == everyone[0] for c in everyone)
        self.record(name, r)
        engine.close()
        actor.close()

    def exact_fp8(self):
        self._exact("exact_fp8", "fp8")

    def exact_bf16(self):
        self._exact("exact_bf16", "bf16")

    def exact_fp8_8b6(self):
        from benchmarks.model_shapes import qwen3_8b_shaped

        self._exact("exact_fp8_8b6", "fp8", hf_config=qwen3_8b_shaped(6), new_tokens=128, mb_tokens=8192, memory=0.25)

    def exact_bf16_8b6(self):
        from benchmarks.model_shapes import qwen3_8b_shaped

        self._exact("exact_bf16_8b6", "bf16", hf_config=qwen3_8b_shaped(6), new_tokens=128, mb_tokens=8192,
                    memory=0.25)

    def exact_fp8_kv(self):
        """An FP8 KV cache: the engine and the trainer quantize q, k, v with the same scales."""
        self._exact("exact_fp8_kv", "fp8", kv_fp8=True)

    def exact_fp8_kv_8b6(self):
        """Prompts of up to 400 tokens: vLLM prefills each in one step, its attention cut into segments
        of 16 queries (``vllm_exact.fp8_kv_segmented``); a prompt's later samples start after its cached
        blocks (prefix caching), so their segments attend over a context."""
        from benchmarks.model_shapes import qwen3_8b_shaped

        self._exact("exact_fp8_kv_8b6", "fp8", hf_config=qwen3_8b_shaped(6), prompt_len=400, new_tokens=128,
                    mb_tokens=8192, memory=0.25, kv_fp8=True)

    def unsegmented_fp8_kv_8b6(self):
        """The negative control of exact_fp8_kv_8b6: once the engine has started (its check saw the
        segmenting metadata builder), vLLM's attention metadata is left as vLLM builds it, so a prompt's
        prefill runs FlashAttention's FP8 kernel over its whole query, with the other tile shape; the
        trainer still attends in segments. The test expects unequal tokens."""
        from benchmarks.model_shapes import qwen3_8b_shaped
        from megatron_jetrl.rollout import vllm_exact

        self._exact("unsegmented_fp8_kv_8b6", "fp8", hf_config=qwen3_8b_shaped(6), prompt_len=400, new_tokens=128,
                    mb_tokens=8192, memory=0.25, kv_fp8=True, after_start=vllm_exact._uninstall_fp8_kv_segments)

    def exact_fp8_tp2(self):
        self._exact("exact_fp8_tp2", "fp8", tp=2)

    def exact_bf16_tp2(self):
        self._exact("exact_bf16_tp2", "bf16", tp=2)

    def exact_fp8_8b6_tp2(self):
        """8B widths at TP 2: megatron pads the vocabulary to 152,064 (76,032 rows a rank), vLLM to
        151,936 (75,968): the LM head's slices differ, its logits per row must not."""
        from benchmarks.model_shapes import qwen3_8b_shaped

        self._exact("exact_fp8_8b6_tp2", "fp8", hf_config=qwen3_8b_shaped(6), new_tokens=128, mb_tokens=8192,
                    memory=0.25, tp=2)

    def exact_fp8_tp4(self):
        self._exact("exact_fp8_tp4", "fp8", tp=4)

    def exact_bf16_tp4(self):
        self._exact("exact_bf16_tp4", "bf16", tp=4)

    def exact_fp8_8b6_tp4(self):
        from benchmarks.model_shapes import qwen3_8b_shaped

        self._exact("exact_fp8_8b6_tp4", "fp8", hf_config=qwen3_8b_shaped(6), new_tokens=128, mb_tokens=8192,
                    memory=0.25, tp=4)

    def exact_bf16_8b6_tp4(self):
        from benchmarks.model_shapes import qwen3_8b_shaped

        self._exact("exact_bf16_8b6_tp4", "bf16", hf_config=qwen3_8b_shaped(6), new_tokens=128, mb_tokens=8192,
                    memory=0.25, tp=4)

    def unordered_fp8_8b6_tp4(self):
        """The negative control of the TP 4 scenarios: exact_fp8_8b6_tp4 with the ordered reduction off on
        both sides (NCCL's reduce-scatter in the trainer, vLLM's own all-reduce in the engine). The test
        expects unequal tokens."""
        from benchmarks.model_shapes import qwen3_8b_shaped
        from megatron_jetrl.precision import exact as contract

        contract.ORDERED_REDUCTION_ABOVE_TP = 8  # ordered_tp_reduction(4) is False on both sides
        self._exact("unordered_fp8_8b6_tp4", "fp8", hf_config=qwen3_8b_shaped(6), new_tokens=128, mb_tokens=8192,
                    memory=0.25, tp=4)

    def _gradients(self, name: str, mode: str, exact: bool) -> None:
        """One update's gradients (no optimizer step) of 2 layers at Qwen3-8B widths, megatron's
        initialisation from the actor's seed, on make_batch's packed sequences: every parameter's
        fp32 main grad saved to ``root/NAME.pt`` (the test compares the exact and default processes).
        The exact process runs in vLLM's batch-invariant mode, as an exact job's trainer does."""
        from benchmarks.bench_actor_step import enter_exact_process
        from benchmarks.model_shapes import qwen3_8b_shaped

        recipe = PrecisionRecipe(mode=mode, exact=exact)
        if exact:
            enter_exact_process(recipe)
        settings = ActorSettings(precision=recipe, max_tokens_per_microbatch=8192,
                                 optimizer=OptimizerSettings(lr=1e-4, weight_decay=0.0, clip_grad=1.0))
        actor = Actor(bridge_for(qwen3_8b_shaped(2)), settings)
        batch = make_batch(actor.bridge.dims.vocab_size, seed=21)
        metrics = actor.update(batch, cross_entropy_loss, with_logprobs=True, before_step=lambda logprobs: False)[0]
        grads = {n: p.main_grad.detach().float().cpu().clone() for n, p in actor.model.named_parameters()}
        torch.save(grads, self.root / f"{name}.pt")
        self.record(name, {"grad_norm": float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values()))),
                           "params": len(grads), "skipped": metrics["update_skipped"], "steps": actor.steps})
        actor.close()

    def grad_fp8_default(self):
        self._gradients("grad_fp8_default", "fp8", exact=False)

    def grad_fp8_exact(self):
        self._gradients("grad_fp8_exact", "fp8", exact=True)

    def grad_bf16_default(self):
        self._gradients("grad_bf16_default", "bf16", exact=False)

    def grad_bf16_exact(self):
        self._gradients("grad_bf16_exact", "bf16", exact=True)

    def exact_fallback(self):
        """Neither side starts with a module left on a non-exact kernel."""
        actor = self.actor(ARCH, mode="fp8", exact=True)
        recipe = actor.settings.precision
        r = {}
        real = vllm_exact.install
        vllm_exact.install = lambda: None  # vLLM builds its own RMSNorm, SiluAndMul, RotaryEmbedding
        try:
            VllmEngine(actor.bridge.hf_config, recipe, VllmOptions(gpu_memory_utilization=0.2, max_model_len=256,
                                                                   enforce_eager=True))
            r["engine_refused"] = False
        except RuntimeError as e:
            r["engine_refused"] = "without their exact kernels" in str(e)
            r["engine_error"] = str(e)[:400]
        finally:
            vllm_exact.install = real
        from megatron_jetrl.actor import build as model_lib
        from megatron_jetrl.actor.layers import RMSNorm

        norm = next(n for n, m in actor.gpt.named_modules() if type(m).__name__ == "ExactRMSNorm")
        parent, _, leaf = norm.rpartition(".")
        setattr(actor.gpt.get_submodule(parent), leaf, RMSNorm(actor.config, actor.bridge.dims.hidden_size))
        try:
            model_lib.check_exact(actor.gpt)
            r["actor_refused"] = False
        except RuntimeError as e:
            r["actor_refused"] = norm in str(e)
            r["actor_error"] = str(e)[:400]
        self.record("exact_fallback", r)
        actor.close()


if __name__ == "__main__":
    sys.exit(main(Scenarios))
