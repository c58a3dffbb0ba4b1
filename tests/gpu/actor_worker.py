"""The actor's GPU scenarios, run under torchrun by tests/gpu/test_actor.py:

    torchrun --nproc-per-node N tests/gpu/actor_worker.py --root DIR --scenarios NAME[,NAME...]

Rank 0 writes DIR/results.json (numbers, flags, error tracebacks) for the test to assert on. One
launch runs many scenarios in one process group, each building its own Actor (parallel state is
torn down between them), because starting processes and importing megatron costs more than the
scenarios themselves.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_jetrl.actor import Actor, ActorSettings, OptimizerSettings, PackedBatch  # noqa: E402
from megatron_jetrl.actor.layers import PackedCoreAttention  # noqa: E402
from megatron_jetrl.algo import cross_entropy_loss, ppo_clip_loss  # noqa: E402
from megatron_jetrl.config import build  # noqa: E402
from megatron_jetrl.models import ParallelLayout, bridge_for  # noqa: E402
from megatron_jetrl.models.hf_checkpoint import HFCheckpoint  # noqa: E402
from megatron_jetrl.precision import PrecisionRecipe, quantize_fp8_blockwise  # noqa: E402
from tests.model_fixtures import FAMILIES, load_tool, save_tiny_hf  # noqa: E402

NUM_LAYERS = 4
SEQ_LENS = [37, 128, 5, 300, 64, 91, 200, 17]


def rank0() -> bool:
    return dist.get_rank() == 0


def make_batch(vocab: int, seed: int = 0) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (n,), generator=g) for n in SEQ_LENS]
    masks = [torch.cat([torch.zeros(min(4, n)), torch.ones(n - min(4, n))]) for n in SEQ_LENS]
    adv = [torch.full((n,), float(torch.randn((), generator=g))) for n in SEQ_LENS]
    return PackedBatch.from_sequences(seqs, loss_mask=masks, advantages=adv)


def hf_logprobs(model, batch: PackedBatch) -> torch.Tensor:
    """Per-token logprobs of the HF model, sequence by sequence (no packing), in its dtype."""
    out = torch.zeros(batch.tokens.numel())
    cu = batch.cu_seqlens.tolist()
    with torch.no_grad():
        for a, b in zip(cu[:-1], cu[1:], strict=True):
            ids = batch.tokens[a:b].cuda()[None]
            logits = model(ids).logits[0].float()
            lp = torch.log_softmax(logits, -1)[:-1].gather(1, ids[0, 1:, None]).squeeze(1)
            out[a + 1:b] = lp.cpu()
    return out


def _moved(report) -> tuple[int, int, int]:
    """The bytes an offload took off the GPU, by group (the FP8 caches, always freed, aside)."""
    return report.params_bytes, report.grads_bytes, report.optimizer_bytes


class Scenarios:
    def __init__(self, root: Path):
        self.root = root
        self.results: dict = {}
        self.world = dist.get_world_size()

    # ---------------------------------------------------------------- fixtures

    def converted(self, arch: str) -> Path:
        """A tiny HF model of ``arch`` converted by the tool (rank 0 writes, all wait)."""
        base = self.root / arch
        if rank0() and not (base / "mg").exists():
            save_tiny_hf(arch, base / "hf", num_layers=NUM_LAYERS)
            convert = load_tool("convert_hf_to_megatron")
            assert convert(["--hf-dir", str(base / "hf"), "--out-dir", str(base / "mg")]) == 0
        dist.barrier()
        return base

    def actor(self, arch: str, *, mode="bf16", tp=1, pp=1, sp=False, lr=1e-4, mb_tokens=256, recompute="none",
              backend="native", logprob_impl="eager", exact=False, **fp8) -> Actor:
        base = self.converted(arch)
        bridge = bridge_for(HFCheckpoint(base / "hf").config)
        recipe = build(PrecisionRecipe, {"mode": mode, "fp8": fp8, "exact": exact}, "precision")
        settings = ActorSettings(parallel=ParallelLayout(tp=tp, pp=pp, sequence_parallel=sp), precision=recipe,
                                 max_tokens_per_microbatch=mb_tokens, recompute=recompute, fp8_backend=backend,
                                 logprob_impl=logprob_impl,
                                 optimizer=OptimizerSettings(lr=lr, weight_decay=0.0, clip_grad=1.0,
                                                             initial_loss_scale=2.0**12))
        actor = Actor(bridge, settings)
        actor.load(base / "mg")
        return actor

    def record(self, name: str, value) -> None:
        self.results[name] = value

    # --------------------------------------------------------------- scenarios

    def hf_parity(self):
        """BF16 actor logprobs of every family vs the HF model's (fp32 and bf16)."""
        from tests.model_fixtures import tiny_hf_model

        for arch in FAMILIES:
            actor = self.actor(arch)
            batch = make_batch(actor.bridge.dims.vocab_size)
            got = actor.compute_logprobs(batch, with_entropy=True)
            actor.close()
            if rank0():
                model = tiny_hf_model(arch, NUM_LAYERS).cuda()
                ref_bf16 = hf_logprobs(model, batch)
                ref_fp32 = hf_logprobs(model.float(), batch)
                mask = batch.fields["loss_mask"].bool()
                self.record(f"hf_parity/{arch}", {
                    "actor_vs_fp32": (got.logprobs - ref_fp32)[mask].abs().mean().item(),
                    "hf_bf16_vs_fp32": (ref_bf16 - ref_fp32)[mask].abs().mean().item(),
                    "entropy_finite": bool(torch.isfinite(got.entropy).all()),
                    "first_tokens_zero": bool((got.logprobs[batch.cu_seqlens[:-1]] == 0).all()),
                })

    def precision_modes(self):
        """FP8 and FP16 logprobs vs BF16 of the same weights; FP8 weights are the reference
        quantization of the parameters; loss decreases over a few steps in each mode."""
        arch = "Qwen3ForCausalLM"
        base_lp = None
        for mode in ("bf16", "fp8", "fp16"):
            actor = self.actor(arch, mode=mode, lr=1e-3)
            batch = make_batch(actor.bridge.dims.vocab_size)
            mask = batch.fields["loss_mask"].bool()
            lp = actor.compute_logprobs(batch).logprobs
            if mode == "bf16":
                base_lp = lp
            entry = {"mean_abs_dlogp_vs_bf16": (lp - base_lp)[mask].abs().mean().item(),
                     "max_abs_dlogp_vs_bf16": (lp - base_lp)[mask].abs().max().item()}
            if mode == "fp8":
                entry["fp8_linears"] = actor.num_fp8_linears
                entry["fp8_weights_match_reference"] = self._fp8_weights_match(actor)
            losses, metrics = [], []
            for _ in range(4):
                losses.append(-(actor.compute_logprobs(batch).logprobs[mask]).mean().item())
                metrics.append(actor.update(batch, cross_entropy_loss))
            losses.append(-(actor.compute_logprobs(batch).logprobs[mask]).mean().item())
            entry.update(losses=losses, loss_scale=[m["loss_scale"] for m in metrics],
                         skipped=[m["update_skipped"] for m in metrics], grad_norm=[m["grad_norm"] for m in metrics],
                         reported_loss=[m["loss"] for m in metrics],
                         timeline={k: metrics[-1].get(k) for k in (
                             "micro_batches", "update_time_s", "forward_backward_s", "microbatch_gpu_ms_median",
                             "microbatch_gpu_ms_max")})
            if mode == "fp8":
                entry["fp8_weights_match_after_step"] = self._fp8_weights_match(actor)
            actor.close()
            self.record(f"precision/{mode}", entry)

    def recompute(self):
        """Full activation recompute against none, from the same weights: the same loss, gradient
        norm and updated weights (flash attention's backward may reorder its sums: tolerances)."""
        arch = "Qwen3ForCausalLM"
        for mode in ("bf16", "fp8"):
            out = {}
            for recompute in ("none", "full"):
                actor = self.actor(arch, mode=mode, lr=1e-3, recompute=recompute)
                batch = make_batch(actor.bridge.dims.vocab_size)
                torch.cuda.reset_peak_memory_stats()
                m = actor.update(batch, cross_entropy_loss)
                out[recompute] = {"loss": m["loss"], "grad_norm": m["grad_norm"],
                                  "logprobs": actor.compute_logprobs(batch).logprobs,
                                  "peak": torch.cuda.max_memory_allocated()}
                actor.close()
            a, b = out["none"], out["full"]
            self.record(f"recompute/{mode}", {
                "loss_rel_diff": abs(a["loss"] - b["loss"]) / abs(a["loss"]),
                "grad_norm_rel_diff": abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"],
                "max_abs_dlogp_after_step": (a["logprobs"] - b["logprobs"]).abs().max().item(),
                "identical_after_step": bool(torch.equal(a["logprobs"], b["logprobs"])),
                "peak_gib_none": a["peak"] / 2**30, "peak_gib_full": b["peak"] / 2**30,
            })

    def host_syncs(self):
        """Where the actor's compute makes the host wait for the GPU: torch's sync debug mode over
        the micro-batches of the logprob pass (forward) and of an update (forward + backward);
        micro-batch assembly before and the optimizer step after stay outside. Micro-batches of
        ~4K tokens, so the embedding's backward takes the sorting path the real steps take."""
        import warnings

        arch = "Qwen3ForCausalLM"
        for mode in ("bf16", "fp8"):
            for impl in ("eager", "compiled"):
                actor = self.actor(arch, mode=mode, mb_tokens=4096, logprob_impl=impl)
                seen = {}
                run = actor._run

                def watched(micro_batches, *, forward_only, loss_func, run=run, seen=seen, **more):
                    """The forward under "error" (the first sync raises where it happens: its
                    traceback is recorded, then the pass runs again unwatched); forward +
                    backward under "warn" (every sync, by the Python line it surfaced at)."""
                    torch.cuda.synchronize()
                    entry = seen["forward" if forward_only else "forward_backward"] = {
                        "micro_batches": len(micro_batches), "syncs": [], "first_sync": None}
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        torch.cuda.set_sync_debug_mode("error" if forward_only else "warn")
                        try:
                            return run(micro_batches, forward_only=forward_only, loss_func=loss_func, **more)
                        except RuntimeError as e:
                            if "synchroniz" not in str(e):
                                raise
                            entry["syncs"].append("raised")
                            entry["first_sync"] = traceback.format_exc()
                        finally:
                            torch.cuda.set_sync_debug_mode("default")
                            entry["syncs"] += [f"{Path(w.filename).name}:{w.lineno}: {str(w.message)[:160]}"
                                               for w in caught if "synchroniz" in str(w.message)]
                    return run(micro_batches, forward_only=forward_only, loss_func=loss_func, **more)

                g = torch.Generator().manual_seed(3)
                lens = [1900, 2100, 1500, 2500]
                vocab = actor.bridge.dims.vocab_size
                batch = PackedBatch.from_sequences(
                    [torch.randint(0, vocab, (n,), generator=g) for n in lens],
                    loss_mask=[torch.ones(n) for n in lens],
                    advantages=[torch.full((n,), float(torch.randn((), generator=g))) for n in lens])
                # The first calls, unwatched: lazy CUDA state, and torch.compile's first compilation of
                # each logprob chunk function (inductor's constant folding reads a scalar to the host,
                # once per compilation). Run under "warn" with their syncs recorded
                # apart, not asserted, so the debug-mode switch itself has been made once too.
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        batch.fields["old_logprobs"] = actor.compute_logprobs(batch, with_entropy=True).logprobs
                        actor.update(batch, ppo_clip_loss)
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                seen["warm_up"] = [f"{Path(w.filename).name}:{w.lineno}" for w in caught
                                   if "synchroniz" in str(w.message)]
                actor._run = watched
                actor.compute_logprobs(batch, with_entropy=True)
                actor.update(batch, ppo_clip_loss)
                actor.close()
                self.record(f"host_syncs/{mode}/{impl}", seen)

    def te_backend(self):
        """The te backend (Transformer Engine's layer spec, Float8BlockScaling with fp32 scales): the
        FP8 weights the sync reads are the reference quantization of the parameters byte for byte
        and the very bytes TE cached for its FProp; logprobs close to BF16's and to the native
        backend's; optimizer steps lower the loss and the synced weights follow them; in BF16 the
        te backend builds TE's layers too."""
        arch = "Qwen3ForCausalLM"
        logprobs = {}
        te_layers = {}
        for mode, backend in (("bf16", "native"), ("fp8", "native"), ("fp8", "te"), ("bf16", "te")):
            actor = self.actor(arch, mode=mode, backend=backend, lr=1e-3)
            batch = make_batch(actor.bridge.dims.vocab_size)
            logprobs[f"{mode}/{backend}"] = actor.compute_logprobs(batch).logprobs
            if backend == "te":  # TE's layer spec in every mode: none of the native attention modules
                te_layers[mode] = not any(isinstance(m, PackedCoreAttention) for m in actor.gpt.modules())
            if backend == "te":
                mask = batch.fields["loss_mask"].bool()
                entry = {"first": self._te_bytes(actor)}
                losses = []
                for _ in range(3):
                    losses.append(-(actor.compute_logprobs(batch).logprobs[mask]).mean().item())
                    actor.update(batch, cross_entropy_loss)
                losses.append(-(actor.compute_logprobs(batch).logprobs[mask]).mean().item())
                entry.update(losses=losses, after_steps=self._te_bytes(actor))
                self.record("te/backend", entry)
            actor.close()
        mask = batch.fields["loss_mask"].bool()  # the same batch in every mode
        d = lambda a, b: (logprobs[a] - logprobs[b])[mask].abs()  # noqa: E731
        self.record("te/logprobs", {
            "te_vs_bf16_mean": d("fp8/te", "bf16/native").mean().item(),
            "native_vs_bf16_mean": d("fp8/native", "bf16/native").mean().item(),
            "te_vs_native_mean": d("fp8/te", "fp8/native").mean().item(),
            "te_vs_native_max": d("fp8/te", "fp8/native").max().item(),
            "te_equals_native": bool(torch.equal(logprobs["fp8/te"], logprobs["fp8/native"])),
            "te_bf16_vs_bf16_mean": d("bf16/te", "bf16/native").mean().item(),
            "te_layers": te_layers,
        })

    def _te_bytes(self, actor: Actor) -> dict:
        """The te actor's synced FP8 weights against the reference quantization of each parameter and
        against the weight TE cached for the last forward's GEMMs (``_fp8_workspaces``)."""
        params = dict(actor.gpt.named_parameters())
        modules = dict(actor.gpt.named_modules())
        shards = actor.weight_shards()
        from megatron_jetrl.actor.build import named_shards

        by_ptr = {p.data_ptr(): n for n, p in params.items()}
        local = {name: by_ptr[param.data_ptr()] for name, (param, _) in named_shards(actor.gpt).items()}
        fp8 = {n: s.fp8 for n, s in shards.items() if s.fp8 is not None}
        codes_equal = scales_equal = cache_equal = cache_seen = 0
        first_diff = None
        for name, w in fp8.items():
            param = params[local[name]].detach()
            q, sc = quantize_fp8_blockwise(param, (128, 128))
            same_q = torch.equal(w.data.view(torch.uint8), q.view(torch.uint8))
            same_s = torch.equal(w.scale_inv, sc)
            codes_equal += same_q
            scales_equal += same_s
            if not (same_q and same_s) and first_diff is None:
                differ = int((w.data.view(torch.uint8) != q.view(torch.uint8)).sum())
                first_diff = {"name": name, "codes_differ": differ,
                              "max_scale_rel_diff": ((w.scale_inv - sc).abs() / sc.abs()).max().item()}
            cached = getattr(modules[local[name].rsplit(".", 1)[0]], "_fp8_workspaces", {}).get("weight")
            if cached is not None:
                cache_seen += 1
                k = w.data.shape[1]
                cache_equal += (torch.equal(cached._rowwise_data, w.data.view(torch.uint8))
                                and torch.equal(cached._rowwise_scale_inv[:, :-(-k // 128)], w.scale_inv))
        return {"fp8_tensors": len(fp8), "codes_equal": codes_equal, "scales_equal": scales_equal,
                "cache_seen": cache_seen, "cache_equal": cache_equal, "first_diff": first_diff}

    def _fp8_weights_match(self, actor: Actor) -> bool:
        ok = True
        n = 0
        for name, w in actor.fp8_weights():
            param = dict(actor.gpt.named_parameters())[name]
            q, s = quantize_fp8_blockwise(param.detach(), (128, 128))
            ok &= torch.equal(w.fprop.data.view(torch.uint8), q.view(torch.uint8)) and torch.equal(w.fprop.scale_inv, s)
            n += 1
        return bool(ok and n > 0)

    def memory_and_checkpoint(self):
        """Offload/onload frees memory and restores identical logprobs; save -> load at the same
        layout restores identical logprobs and the same next step."""
        arch = "Qwen3ForCausalLM"
        actor = self.actor(arch, mode="fp8", lr=3e-4)
        batch = make_batch(actor.bridge.dims.vocab_size)
        actor.update(batch, ppo_clip_loss_with_old(actor, batch))
        before = actor.compute_logprobs(batch).logprobs
        fp8_before = {n: w.fprop.data.view(torch.uint8).clone() for n, w in actor.fp8_weights()}
        report = actor.offload()
        offloaded_alloc = torch.cuda.memory_allocated()
        error = None
        try:
            actor.compute_logprobs(batch)
        except RuntimeError as e:
            error = str(e)
        actor.onload()
        after = actor.compute_logprobs(batch).logprobs
        fp8_after = {n: w.fprop.data.view(torch.uint8) for n, w in actor.fp8_weights()}
        self.record("offload", {
            "params_bytes": report.params_bytes, "grads_bytes": report.grads_bytes,
            "optimizer_bytes": report.optimizer_bytes, "freed_bytes": report.freed_bytes,
            "allocated_before": report.allocated_before, "allocated_offloaded": offloaded_alloc,
            "logprobs_identical": bool(torch.equal(before, after)),
            "fp8_identical": all(torch.equal(fp8_before[k], fp8_after[k]) for k in fp8_before),
            "offloaded_call_error": error,
        })
        # only what a need asks for (which storages: tests/gpu/test_offload_gpu.py), restored exactly
        need = torch.cuda.mem_get_info()[0] + report.grads_bytes
        partial = actor.offload(need=need)
        covered = torch.cuda.mem_get_info()[0] >= need or partial.params_bytes == report.params_bytes
        actor.onload()
        self.record("offload_partial", {
            "covered": covered, "moved": sum(_moved(partial)), "moved_all": sum(_moved(report)),
            "logprobs_identical": bool(torch.equal(before, actor.compute_logprobs(batch).logprobs)),
            "nothing_needed": sum(_moved(actor.offload(need=0))) == 0,
        })
        actor.onload()
        ckpt = self.root / "ckpt_same"
        actor.save(ckpt, extra={"note": "same-layout"})
        m1 = actor.update(batch, ppo_clip_loss_with_old(actor, batch))
        next_lp = actor.compute_logprobs(batch).logprobs
        actor.close()
        baseline = torch.cuda.memory_allocated()  # what this worker's own tensors hold, the actor aside
        actor = self.actor(arch, mode="fp8", lr=3e-4)
        extra = actor.load(ckpt)
        reloaded = actor.compute_logprobs(batch).logprobs
        m2 = actor.update(batch, ppo_clip_loss_with_old(actor, batch))
        next_reloaded = actor.compute_logprobs(batch).logprobs
        self.record("checkpoint_same_layout", {
            "extra": extra, "logprobs_identical": bool(torch.equal(reloaded, after)),
            "next_step_identical": bool(torch.equal(next_lp, next_reloaded)),
            "grad_norms": [m1["grad_norm"], m2["grad_norm"]], "steps": actor.steps,
        })
        lingering = list(actor.model.parameters())  # a reference that outlives the actor (a hook, a closure)
        open_alloc = torch.cuda.memory_allocated()
        actor.close()
        self.record("close", {"allocated_open": open_alloc - baseline,
                              "allocated_closed": torch.cuda.memory_allocated() - baseline,
                              "lingering_bytes": sum(p.untyped_storage().nbytes() for p in lingering)})

    def bad_input(self):
        arch = "LlamaForCausalLM"
        actor = self.actor(arch)
        errors = {}
        vocab = actor.bridge.dims.vocab_size
        for name, batch in {
            "token_out_of_range": PackedBatch.from_sequences([[1, vocab + 5]], loss_mask=[[0, 1]]),
            "too_long": PackedBatch.from_sequences([torch.zeros(actor.max_seq_len + 1, dtype=torch.long)]),
        }.items():
            try:
                actor.compute_logprobs(batch)
                errors[name] = None
            except ValueError as e:
                errors[name] = str(e)
        try:
            actor.update(PackedBatch.from_sequences([[1, 2]], loss_mask=[[0, 0]]), cross_entropy_loss)
            errors["empty_mask"] = None
        except ValueError as e:
            errors["empty_mask"] = str(e)
        actor.close()
        from megatron_jetrl.config import ConfigError

        try:
            self.actor(arch, tp=3)
            errors["tp3"] = None
        except ConfigError as e:
            errors["tp3"] = str(e)
        self.record("bad_input", errors)

    def parallel_layouts(self):
        """TP=2 (with and without sequence parallelism) and PP=2 give TP=1 logprobs; the same
        update at each layout moves them alike; save at TP=2 -> load at TP=1 keeps weights."""
        arch = "Qwen3ForCausalLM"
        out = {}
        ref = ref_after = None
        for name, kw in (("tp1", {}), ("tp2", {"tp": 2}), ("tp2_sp", {"tp": 2, "sp": True}), ("pp2", {"pp": 2})):
            for mode in ("bf16", "fp8"):
                actor = self.actor(arch, mode=mode, **kw)
                batch = make_batch(actor.bridge.dims.vocab_size)
                mask = batch.fields["loss_mask"].bool()
                first = actor.compute_logprobs(batch, kv_scales=True)
                lp = first.logprobs
                m = actor.update(batch, cross_entropy_loss)
                lp_after = actor.compute_logprobs(batch).logprobs
                if name == "tp1":
                    if mode == "bf16":
                        ref, ref_after, ref_kv = {}, {}, {}
                    ref[mode], ref_after[mode], ref_kv[mode] = lp, lp_after, first.kv_scales
                out[f"{name}/{mode}"] = {
                    "mean_abs_dlogp_vs_tp1": (lp - ref[mode])[mask].abs().mean().item(),
                    "mean_abs_dlogp_after_step_vs_tp1": (lp_after - ref_after[mode])[mask].abs().mean().item(),
                    "loss": m["loss"], "grad_norm": m["grad_norm"],
                    # FP8 KV-cache scales measured on the same batch: the layout must not change them
                    "kv_scales_shape": list(first.kv_scales.shape),
                    "kv_scales_max_rel_diff_vs_tp1": ((first.kv_scales - ref_kv[mode]).abs()
                                                      / ref_kv[mode]).max().item(),
                    "kv_scales_min": first.kv_scales.min().item(),
                }
                if name == "tp2" and mode == "bf16":
                    actor.save(self.root / "ckpt_tp2")
                    out["tp2_saved_logprobs_after"] = lp_after
                actor.close()
        saved_after = out.pop("tp2_saved_logprobs_after")
        actor = self.actor(arch, mode="bf16")
        actor.load(self.root / "ckpt_tp2")
        batch = make_batch(actor.bridge.dims.vocab_size)
        mask = batch.fields["loss_mask"].bool()
        lp = actor.compute_logprobs(batch).logprobs
        m = actor.update(batch, cross_entropy_loss)
        out["tp2_to_tp1_load"] = {"mean_abs_dlogp_vs_tp2": (lp - saved_after)[mask].abs().mean().item(),
                                  "steps": actor.steps, "grad_norm": m["grad_norm"]}
        actor.save(self.root / "ckpt_tp1_resaved")
        actor.close()
        if rank0():
            convert = load_tool("convert_megatron_to_hf")
            same = True
            for tag in ("ckpt_tp2", "ckpt_tp1_resaved"):
                assert convert(["--ckpt-dir", str(self.root / tag), "--out-dir", str(self.root / f"{tag}_hf")]) == 0
            from safetensors.torch import load_file

            def tensors(d):
                return {k: v for f in sorted((self.root / d).glob("*.safetensors")) for k, v in load_file(f).items()}

            a, b = tensors("ckpt_tp2_hf"), tensors("ckpt_tp1_resaved_hf")
            out["tp2_export_keys"] = len(a)
            # the TP=1 actor took one more step before re-saving: weights differ, keys and shapes do not
            same = sorted(a) == sorted(b) and all(a[k].shape == b[k].shape for k in a)
            out["exports_have_same_layout"] = bool(same)
        self.record("parallel", out)


def ppo_clip_loss_with_old(actor: Actor, batch: PackedBatch):
    if "old_logprobs" not in batch.fields:
        batch.fields["old_logprobs"] = actor.compute_logprobs(batch).logprobs  # type: ignore[index]
    return ppo_clip_loss


def main(scenarios_cls: type = None) -> int:
    """Run the named scenarios of ``scenarios_cls`` (default: this file's) in one process group;
    rank 0 writes results.json. Other workers (sync_worker.py) pass their subclass."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True, type=Path)
    ap.add_argument("--scenarios", required=True)
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=300))
    scenarios = (scenarios_cls or Scenarios)(args.root)
    errors = {}
    for name in args.scenarios.split(","):
        try:
            getattr(scenarios, name)()
        except (Exception, SystemExit):  # a tool's argparse exit must be reported, not kill the rank
            errors[name] = traceback.format_exc()
            print(f"[rank {dist.get_rank()}] scenario {name} failed:\n{errors[name]}", file=sys.stderr, flush=True)
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
    if rank0():
        (args.root / "results.json").write_text(json.dumps({"results": scenarios.results, "errors": errors},
                                                           indent=1, default=str))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
