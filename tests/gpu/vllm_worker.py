"""The vllm rollout engine on a GPU with real vLLM, run under torchrun by tests/gpu/test_vllm_engine.py:

    torchrun --nproc-per-node 1 tests/gpu/vllm_worker.py --root DIR --scenarios NAME

One vLLM engine per process (vLLM's distributed state lives for the process), so each scenario
is one launch:

- engine_fp8: unified FP8, in-place updates, CUDA graphs. The byte identity inside vLLM: after
  each sync every FP8 weight and ``weight_scale_inv`` in vLLM's live parameters (read here from
  vLLM's modules, not through the engine's own map) hashes equal to the trainer's FProp bytes,
  rebuilt from the trainer's shards with plain torch; before and after an optimizer step, and
  after a level-2 sleep. Sampling semantics (n, seed, temperature 0, top-k/p, stop tokens), the
  memory a level-2 sleep frees (without copying weights to the host), and the engine-vs-trainer
  mismatch.
- engine_fp8_reload: the same through vLLM's own loaders (layerwise reload).
- engine_fp8_te: the te backend's FP8 bytes (Transformer Engine's linears) into vLLM, in place and
  through update_weights, before and after a step (tests/gpu/test_te_backend.py).
In both, every live tensor (norms and embeddings too) also hashes equal to what the sync shipped.
- engine_fp8_deep_gemm: engine_fp8's byte identity (in place and through update_weights, before
  and after optimizer steps) and mismatch (compiled, CUDA graphs) with vLLM's DeepGEMM block-FP8
  GEMM (``fp8_gemm=deep_gemm``; the launcher set VLLM_USE_DEEP_GEMM=1) in place of CUTLASS.
- tp2_to_vllm_tp2 / tp2_to_vllm_tp2_reload / tp2_to_vllm_tp1 (2 GPUs): trainer TP=2 into vLLM at
  rollout TP 2 (in place, update_weights, and vLLM's loaders fed presharded tensors) and at
  rollout TP 1, trainer and engine NCCL groups in the same processes: the byte identity on both
  ranks, a level-2 sleep, generation after the wake.
- mismatch_<mode>: engine-vs-trainer logprob mismatch for fp8, bf16, bf16-train+fp8-rollout and fp16
  (all eager, so alike);
  mismatch_fp8kv: unified FP8 with an FP8 KV cache whose q/k/v scales the trainer measured;
  mismatch_fp8_vllm_quant[_compiled]: unified FP8 with vLLM's own activation quantization
  (``activation_quant=vllm``; the default is the trainer's), eager and compiled.
"""

from __future__ import annotations

import dataclasses
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_jetrl.algo import cross_entropy_loss  # noqa: E402
from megatron_jetrl.rollout import SamplingParams  # noqa: E402
from megatron_jetrl.rollout.vllm_engine import VllmEngine, VllmOptions  # noqa: E402
from megatron_jetrl.sync import SyncPlan, WeightSync  # noqa: E402
from tests.gpu.actor_worker import main, make_batch  # noqa: E402
from tests.gpu.sync_worker import ARCH, Recorder, engine_vs_trainer, sha, trainer_fp8_hashes  # noqa: E402
from tests.gpu.sync_worker import Scenarios as SyncScenarios  # noqa: E402

PROMPT_LENS = (16, 40, 7, 64)
ENGINE_FP8_OPTIONS = VllmOptions(gpu_memory_utilization=0.25, max_model_len=512, max_num_seqs=64,
                                 cuda_graph_max_batch=64, fp8_gemm="cutlass")
"""engine_fp8's engine (and engine_fp8_deep_gemm's, but for the GEMM): CUDA graphs and torch.compile,
as in production; CUTLASS's block-FP8 GEMM, the one the exact rollout keeps and DeepGEMM is compared with."""


def live_hashes(engine: VllmEngine) -> tuple[dict[str, str], dict[str, tuple[int, int]]]:
    """sha256 of every tensor vLLM computes with, by HF name: fused q/k/v and gate/up split by the
    layer's partition sizes, FP8 scales by 128-row blocks, this rank's vocabulary rows; and those
    rows (start, stop) of each vocabulary tensor (the sync ships it whole; vLLM keeps its shard)."""

    def read(worker):
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        model = worker.get_model()
        packed = getattr(model, "packed_modules_mapping", {})
        out, rows = {}, {}
        for name, param in model.named_parameters():
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name)
            t = param.detach()
            if isinstance(module, LinearBase):
                prefix, _, leaf = module_name.rpartition(".")
                unit = 128 if attr == "weight_scale_inv" else 1
                sizes = [s // unit for s in module.output_partition_sizes]
                for part, piece in zip(packed.get(leaf, [leaf]), t.split(sizes), strict=True):
                    out[f"{prefix}.{part}.{attr}"] = sha(piece)
            elif isinstance(module, VocabParallelEmbedding):
                s = module.shard_indices
                out[name] = sha(t[: s.org_vocab_end_index - s.org_vocab_start_index])
                rows[name] = (s.org_vocab_start_index, s.org_vocab_end_index)
            else:
                out[name] = sha(t)
        return out, rows

    return engine._on_worker(read)


def kv_scales_held(engine: VllmEngine) -> list[list[float]]:
    """[layers][q, k, v] scales the attention layers compute with (device tensors; vLLM keeps them
    as module buffers in its weight memory, so the engine must be awake to read them)."""
    engine.wake()

    def read(worker):
        from vllm.model_executor.layers.attention import Attention

        layers = [m for m in worker.get_model().modules() if isinstance(m, Attention)]
        return [[float(getattr(m, f"_{k}_scale")) for k in "qkv"] for m in layers]

    return engine._on_worker(read)


def linear_kernels(engine: VllmEngine) -> dict[str, int]:
    """How many of vLLM's FP8 linears run each block-FP8 GEMM kernel class (vLLM picks one per layer
    at build time and may fall back from DeepGEMM to CUTLASS where a shape does not suit it)."""

    def read(worker):
        counts: dict[str, int] = {}
        for module in worker.get_model().modules():
            kernel = getattr(getattr(module, "quant_method", None), "fp8_linear", None)
            if kernel is not None:
                counts[type(kernel).__name__] = counts.get(type(kernel).__name__, 0) + 1
        return counts

    return engine._on_worker(read)


def used_gib() -> float:
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class Scenarios(SyncScenarios):
    def _setup(self, mode: str, options: VllmOptions, steps: int = 3, tp: int = 1, backend: str = "native"):
        """An actor (trainer TP ``tp``) after ``steps`` supervised steps (distributions not near
        uniform), the engine, and a sync between them (bucket 1 MB: many rounds)."""
        actor = self.actor(ARCH, mode=mode, tp=tp, lr=1e-3, backend=backend)
        recipe = actor.settings.precision
        for step in range(steps):
            actor.update(make_batch(actor.bridge.dims.vocab_size, seed=100 + step), cross_entropy_loss)
        start = time.perf_counter()
        engine = VllmEngine(actor.bridge.hf_config, recipe, options)
        self.record(f"{mode}/engine_start_s", time.perf_counter() - start)
        plan = SyncPlan(actor.bridge, recipe, actor.settings.parallel, options.tensor_parallel_size, self.world)
        sync = WeightSync(plan, dist.get_rank(), device=actor.device, bucket_mb=1)
        return actor, engine, sync

    def _prompts(self, vocab: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(1)
        return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]

    def _mismatch(self, actor, engine, *, kv_scales: bool = False) -> tuple[dict, torch.Tensor | None]:
        """Engine samples (temperature 1), the trainer recomputes their logprobs: mean |Δlogp|,
        k3 KL, token_mult_prob_error over response tokens."""
        prompts = self._prompts(actor.bridge.dims.vocab_size)
        engine.wake()
        samples = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=96, seed=0))
        engine.sleep()
        return engine_vs_trainer(actor, prompts, samples, kv_scales=kv_scales)

    def _identity(self, actor, engine, sync, *, in_place: bool, rollout_tp: int = 1) -> dict:
        """Sync, then compare vLLM's live bytes with the trainer's FProp weights (FP8 tensors) and
        with everything the sync shipped (all tensors, norms and embeddings included)."""
        shards = actor.weight_shards()
        report = sync.sync(shards, engine, in_place=in_place)
        engine.wake()  # closes a layerwise update (reload); vLLM's memory must be mapped to read it
        got, rows = live_hashes(engine)
        want = trainer_fp8_hashes(actor, rollout_tp, dist.get_rank() % rollout_tp)
        shipped = Recorder(sync.engine_specs())
        sync.sync(shards, shipped, in_place=False)
        shipped_hashes = {n: sha(t[slice(*rows[n])] if n in rows else t) for n, t in shipped.tensors.items()}
        fp8 = {k: got.get(k) for k in want}
        return {"equal": bool(want) and fp8 == want, "fp8_tensors": len(want), "in_place": report.in_place,
                "first_diff": next((k for k in want if fp8[k] != want[k]), None), "hashes": fp8,
                "live_equals_shipped": got == shipped_hashes, "tensors": len(got),
                "vocab_shards": sum(stop - start < shipped.tensors[n].shape[0] for n, (start, stop) in rows.items()),
                "first_shipped_diff": next((k for k in shipped_hashes if got.get(k) != shipped_hashes[k]), None),
                "sync_s": report.total_s}

    def _sync_across_steps(self, actor, engine, sync, first: dict) -> dict:
        """After ``first`` (the identity of an in-place sync): an optimizer step and the sync in place,
        another step and the sync through update_weights. The three identities (less their hashes)
        and how many FP8 tensors the first step changed."""
        vocab = actor.bridge.dims.vocab_size
        actor.update(make_batch(vocab, seed=7), cross_entropy_loss)
        second = self._identity(actor, engine, sync, in_place=True)
        actor.update(make_batch(vocab, seed=8), cross_entropy_loss)
        third = self._identity(actor, engine, sync, in_place=False)
        r = {key: {k: v for k, v in ident.items() if k != "hashes"}
             for key, ident in (("identity_first", first), ("identity_after_step", second),
                                ("identity_update_weights", third))}
        r["changed_after_step"] = sum(first["hashes"][k] != second["hashes"][k] for k in first["hashes"])
        return r

    # ---------------------------------------------------------------- scenarios

    def engine_fp8(self):
        actor, engine, sync = self._setup("fp8", ENGINE_FP8_OPTIONS)
        vocab = actor.bridge.dims.vocab_size
        prompts = self._prompts(vocab)
        r = {}
        engine.sleep()  # the trainer's order: the engine sleeps while the actor trains
        first = self._identity(actor, engine, sync, in_place=True)
        engine.wake()

        # sampling semantics
        seeded = SamplingParams(n=4, temperature=1.0, max_new_tokens=32, seed=7)
        a, b = engine.generate(prompts, seeded), engine.generate(prompts, seeded)
        c = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=32, seed=8))
        greedy = engine.generate(prompts, SamplingParams(n=2, temperature=0.0, max_new_tokens=32))
        top1 = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, top_k=1, max_new_tokens=32, seed=3))
        tiny_p = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, top_p=1e-6, max_new_tokens=32, seed=3))
        stop = greedy[0].tokens[5]
        stopped = engine.generate(prompts[:1], SamplingParams(n=1, temperature=0.0, max_new_tokens=32,
                                                               stop_token_ids=(stop,)))
        toks = lambda s: [x.tokens for x in s]  # noqa: E731
        r["samples"] = len(a)
        r["prompt_major"] = [x.prompt_index for x in a] == [i for i in range(len(prompts)) for _ in range(4)]
        r["lengths_ok"] = all(len(x.tokens) == 32 and len(x.logprobs) == 32 and x.finish_reason == "length" for x in a)
        r["seed_repeats"] = toks(a) == toks(b) and [x.logprobs for x in a] == [x.logprobs for x in b]
        r["seed_changes"] = toks(a) != toks(c)
        r["samples_of_a_prompt_differ"] = len({tuple(x.tokens) for x in a[:4]}) > 1
        r["greedy_samples_equal"] = all(greedy[2 * i].tokens == greedy[2 * i + 1].tokens for i in range(len(prompts)))
        r["top_k1_is_greedy"] = toks(top1) == toks(greedy)
        # not asserted: vLLM's Triton top-k/top-p kernel (batches >= 8) is not exact as p -> 0
        same = [x.tokens == y.tokens for x, y in zip(tiny_p, greedy, strict=True)]
        r["tiny_top_p_greedy_share"] = sum(same) / len(same)
        s = stopped[0]
        first_stop = greedy[0].tokens.index(stop)
        r["stop"] = s.finish_reason == "stop" and s.tokens == greedy[0].tokens[: first_stop + 1]
        r["logprobs_finite_nonpositive"] = all(v <= 0 and v == v for x in a for v in x.logprobs)
        r["mismatch_before"], _ = self._mismatch(actor, engine)

        # sleep level 2: weights and KV cache released, nothing copied to the host; generate then
        # refuses until every tensor arrived again
        engine.wake()
        awake = used_gib()
        rss = rss_gib()
        engine.sleep()
        r["sleep_freed_gib"] = awake - used_gib()
        r["sleep_host_rss_growth_gib"] = rss_gib() - rss
        engine.wake()
        try:
            engine.generate(prompts, seeded)
            r["refuses_after_discard"] = False
        except RuntimeError as e:
            r["refuses_after_discard"] = "never loaded" in str(e)
        engine.sleep()

        r.update(self._sync_across_steps(actor, engine, sync, first))
        engine.wake()
        after = engine.generate(prompts, seeded)
        r["generate_after_update_differs"] = toks(after) != toks(a)
        r["mismatch_after"], _ = self._mismatch(actor, engine)
        self.record("engine_fp8", r)
        engine.close()
        actor.close()

    def engine_fp8_deep_gemm(self):
        """engine_fp8's two promises with vLLM's DeepGEMM block-FP8 GEMM: its live FP8 weights and
        scales are the trainer's FProp bytes after every sync, and the engine-vs-trainer mismatch."""
        options = dataclasses.replace(ENGINE_FP8_OPTIONS, fp8_gemm="deep_gemm")
        actor, engine, sync = self._setup("fp8", options)
        engine.sleep()
        first = self._identity(actor, engine, sync, in_place=True)
        before, _ = self._mismatch(actor, engine)
        r = {**self._sync_across_steps(actor, engine, sync, first), "mismatch_before": before}
        r["mismatch_after"], _ = self._mismatch(actor, engine)
        r["linear_kernels"] = linear_kernels(engine)
        self.record("engine_fp8_deep_gemm", r)
        engine.close()
        actor.close()

    def engine_fp8_reload(self):
        """vLLM's own loaders (layerwise reload) hold the trainer's FP8 bytes too."""
        options = VllmOptions(gpu_memory_utilization=0.2, max_model_len=512, max_num_seqs=64, enforce_eager=True,
                              weight_update="reload")
        actor, engine, sync = self._setup("fp8", options)
        engine.sleep()
        ident = self._identity(actor, engine, sync, in_place=True)  # a reload engine offers no buffers
        mismatch, _ = self._mismatch(actor, engine)
        self.record("engine_fp8_reload", {**{k: v for k, v in ident.items() if k != "hashes"},
                                          "mismatch": mismatch})
        engine.close()
        actor.close()

    def engine_fp8_te(self):
        """The te backend (Transformer Engine's linears) into vLLM: vLLM's live FP8 bytes are TE's
        FProp bytes, in place and through update_weights, before and after optimizer steps; the
        engine-vs-trainer mismatch with TE as the trainer."""
        options = VllmOptions(gpu_memory_utilization=0.2, max_model_len=512, max_num_seqs=64, enforce_eager=True)
        actor, engine, sync = self._setup("fp8", options, backend="te")
        vocab = actor.bridge.dims.vocab_size
        engine.sleep()
        first = self._identity(actor, engine, sync, in_place=True)
        actor.update(make_batch(vocab, seed=7), cross_entropy_loss)
        second = self._identity(actor, engine, sync, in_place=False)
        mismatch, _ = self._mismatch(actor, engine)
        r = {key: {k: v for k, v in ident.items() if k != "hashes"}
             for key, ident in (("identity_first", first), ("identity_after_step", second))}
        r["changed_after_step"] = sum(first["hashes"][k] != second["hashes"][k] for k in first["hashes"])
        r["mismatch"] = mismatch
        self.record("engine_fp8_te", r)
        engine.close()
        actor.close()

    def _two_gpus(self, name: str, rollout_tp: int, weight_update: str):
        """Trainer TP=2 -> vLLM rollout TP ``rollout_tp`` in the same two processes (trainer and
        engine NCCL groups side by side): each rank's live vLLM bytes equal the trainer's FP8 bytes
        of that rank's rollout shard, before and after an optimizer step; a level-2 sleep frees
        memory on every rank and the engine generates after the wake. Rank 0 records every rank's
        result."""
        if self.world != 2:
            raise RuntimeError(f"{name} runs on 2 GPUs; launched with {self.world}")
        options = VllmOptions(tensor_parallel_size=rollout_tp, gpu_memory_utilization=0.2, max_model_len=512,
                              max_num_seqs=64, enforce_eager=True, weight_update=weight_update)
        actor, engine, sync = self._setup("fp8", options, steps=2, tp=2)
        vocab = actor.bridge.dims.vocab_size
        in_place = weight_update == "in_place"
        r = {"rank": dist.get_rank(), "vllm_tp_rank": engine.tp_rank}
        engine.sleep()
        first = self._identity(actor, engine, sync, in_place=in_place, rollout_tp=rollout_tp)
        engine.wake()
        awake, rss = used_gib(), rss_gib()
        engine.sleep()
        r["sleep_freed_gib"] = awake - used_gib()
        r["sleep_host_rss_growth_gib"] = rss_gib() - rss
        actor.update(make_batch(vocab, seed=7), cross_entropy_loss)
        second = self._identity(actor, engine, sync, in_place=False, rollout_tp=rollout_tp)
        engine.wake()
        samples = engine.generate(self._prompts(vocab), SamplingParams(n=2, temperature=1.0, max_new_tokens=32,
                                                                      seed=5))
        tokens = [s.tokens for s in samples]
        everyone = [None] * self.world
        dist.all_gather_object(everyone, tokens)
        r["generated"] = len(samples) == 2 * len(PROMPT_LENS) and all(len(t) == 32 for t in tokens)
        r["ranks_sample_alike"] = all(t == everyone[0] for t in everyone)  # reported (rollout TP 1: 2 engines)
        if rollout_tp == self.world:  # one engine: both trainer ranks see the same samples
            engine.sleep()
            r["mismatch"], _ = engine_vs_trainer(actor, self._prompts(vocab), samples)
        r["changed_after_step"] = sum(first["hashes"][k] != second["hashes"][k] for k in first["hashes"])
        for key, ident in (("identity_first", first), ("identity_after_step", second)):
            r[key] = {k: v for k, v in ident.items() if k != "hashes"}
        ranks = [None] * self.world
        dist.all_gather_object(ranks, r)
        self.record(name, ranks)
        engine.close()
        actor.close()

    def tp2_to_vllm_tp2(self):
        """In place into vLLM's TP-sharded parameters, then through update_weights."""
        self._two_gpus("tp2_to_vllm_tp2", 2, "in_place")

    def tp2_to_vllm_tp2_reload(self):
        """vLLM's own loaders, fed this rank's shards (the presharded update)."""
        self._two_gpus("tp2_to_vllm_tp2_reload", 2, "reload")

    def tp2_to_vllm_tp1(self):
        """Each rank's own engine holds the whole model, gathered from the trainer's two TP shards."""
        self._two_gpus("tp2_to_vllm_tp1", 1, "in_place")

    def _mismatch_mode(self, mode: str, label: str = "", **options):
        opts = VllmOptions(**{"gpu_memory_utilization": 0.2, "max_model_len": 512, "max_num_seqs": 64,
                              "enforce_eager": True, **options})
        actor, engine, sync = self._setup(mode, opts)
        engine.sleep()
        sync.sync(actor.weight_shards(), engine)
        fp8_kv = opts.kv_cache_dtype == "fp8"
        result, kv = self._mismatch(actor, engine, kv_scales=fp8_kv)
        name = f"mismatch/{mode}"
        if fp8_kv:  # default scales (1.0) first; then the trainer's, measured on those samples
            # a level-2 sleep discarded the weights: all again, the scales with them (as the trainer)
            sync.sync(actor.weight_shards(), engine, kv_scales=kv)
            calibrated, _ = self._mismatch(actor, engine)
            result = {**calibrated, "default_scales": result, "kv_scales": kv.tolist(),
                      "kv_scales_held_equal": kv_scales_held(engine) == kv.tolist()}
            name += "+fp8kv"
        self.record(name + label, result)
        engine.close()
        actor.close()

    def mismatch_fp8(self):
        """Unified FP8 with the same engine settings as the other modes (eager; engine_fp8's
        ``mismatch_before`` is with CUDA graphs and torch.compile, as in production)."""
        self._mismatch_mode("fp8")

    def mismatch_bf16(self):
        self._mismatch_mode("bf16")

    def mismatch_mixed(self):
        self._mismatch_mode("bf16-train+fp8-rollout")

    def mismatch_fp16(self):
        self._mismatch_mode("fp16")

    def mismatch_fp8kv(self):
        self._mismatch_mode("fp8", kv_cache_dtype="fp8")

    def mismatch_fp8_vllm_quant(self):
        """Unified FP8 with vLLM's own activation quantization (its kernels and rule, and under
        torch.compile its norm/activation+quant fusions), eager and compiled."""
        self._mismatch_mode("fp8", " vllm-quant", activation_quant="vllm")

    def mismatch_fp8_vllm_quant_compiled(self):
        self._mismatch_mode("fp8", " vllm-quant (compiled, CUDA graphs)", activation_quant="vllm",
                            enforce_eager=False, cuda_graph_max_batch=64)


if __name__ == "__main__":
    sys.exit(main(Scenarios))
