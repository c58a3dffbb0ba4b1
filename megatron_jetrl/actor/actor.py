"""The actor: one rank's share of the policy model, and the three things the RL loop asks of it.

    logprobs = actor.compute_logprobs(batch)          # old / reference log-probabilities
    metrics  = actor.update(batch, loss_fn)           # one optimizer step over the batch
    actor.offload(); ...rollout...; actor.onload()    # colocation

Every rank passes the same global ``PackedBatch`` and gets the same global results back. Inside,
the batch is split over data-parallel ranks (balanced by tokens), packed into micro-batches of at
most ``max_tokens_per_microbatch`` tokens, and run through megatron's pipeline schedule (1F1B
for PP > 1), so a pipeline stage only ever holds its own layers' activations.

Micro-batches are packed ``thd`` rows: no padding tokens are computed, except the few that
sequence parallelism needs to split a row evenly over TP ranks.

FP8: the native linears quantize their weights once after each optimizer step (and after a
load or an onload), and every micro-batch's FProp and DGrad read that one copy;
``fp8_weights()`` hands the same objects to the weight sync.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import ChainedOptimizer
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_jetrl.actor import build as model_lib
from megatron_jetrl.actor.layers import PackedCoreAttention, _Fp8LinearMixin, attach_packed_positions
from megatron_jetrl.actor.logprobs import vocab_parallel_logprobs
from megatron_jetrl.actor.offload import DeviceMemory, OffloadReport, release
from megatron_jetrl.actor.packing import (
    PackedBatch,
    align_to_tokens,
    next_token_labels,
    plan_batch,
)
from megatron_jetrl.actor.settings import ActorSettings
from megatron_jetrl.algo import LossFn, LossInputs
from megatron_jetrl.config import ConfigError
from megatron_jetrl.models import ModelBridge
from megatron_jetrl.ops.exact import vllm_kernels
from megatron_jetrl.precision import Fp8Weight, Shard
from megatron_jetrl.precision.kv_cache import KvAmaxObserver, kv_scales_from_amax

# FP8 training pads each rank's micro-batch to a multiple of 128 tokens. The WGrad GEMM contracts
# over tokens: at other counts cuBLAS's blockwise GEMM needs both operands copied into zero-padded
# buffers (precision/gemm.py), FProp and DGrad need their rows padded to 4, and the transposed
# quantization falls back to byte stores (M % 16). In the 16-layer RL step (micro-batches of ~4K
# tokens, arbitrary counts) that cost the FP8 update ~1 s of copies and made its quantization 4x
# slower per token than in the aligned actor benchmark. Transformer Engine refuses
# other counts outright (a multiple of 16: ``assert_dim_for_fp8_exec``). At most 127 padding tokens.
FP8_TOKEN_MULTIPLE = 128


def token_multiple(settings: ActorSettings, sequence_parallel: bool) -> int:
    """What each micro-batch's token count is padded to (with one masked padding sequence, its own
    attention segment, dropped from the results): sequence parallelism splits the tokens over the
    TP ranks, and FP8 training wants each rank's tokens a multiple of ``FP8_TOKEN_MULTIPLE``."""
    multiple = settings.parallel.tp if sequence_parallel else 1
    if settings.precision.train_fp8:
        multiple *= FP8_TOKEN_MULTIPLE
    return multiple


@dataclass(frozen=True)
class TokenLogprobs:
    """Per-token results of a global batch, aligned with its tokens ([T], fp32, on CPU), and, when
    asked for, the FP8 KV-cache scales measured on it ([num_layers, 3] for q, k, v; fp32, CPU;
    ``precision/kv_cache.py``)."""

    logprobs: torch.Tensor
    entropy: Optional[torch.Tensor]
    kv_scales: Optional[torch.Tensor] = None


@dataclass
class KvScaleMeter:
    """What ``Actor.kv_scale_meter`` measures: the observer its passes report to, and the scales
    ([num_layers, 3] fp32, CPU) set when the block ends."""

    observer: KvAmaxObserver
    scales: Optional[torch.Tensor] = None


class _MicroBatchClock:
    """Where an update's time went, on a GPU: a CUDA event at each micro-batch's forward (queued, no
    synchronization) and one after the last backward. ``finish(start)`` waits for the GPU once and
    gives ``forward_backward_s`` (from ``start``, a ``perf_counter`` time, to the last backward's end on
    the GPU) and the GPU time from one micro-batch's forward to the next (its forward and backward,
    and any wait for the host or the allocator: a stall shows as a maximum far above the median).
    Off CUDA, or with fewer than one interval, only what it can say."""

    def __init__(self):
        self._events: list = []
        self._cuda = torch.cuda.is_available()

    def mark(self) -> None:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._events.append(event)

    def finish(self, start: float) -> dict[str, float]:
        if not self._cuda or not self._events:
            return {}
        self.mark()
        self._events[-1].synchronize()
        out = {"forward_backward_s": time.perf_counter() - start}
        ms = sorted(a.elapsed_time(b) for a, b in itertools.pairwise(self._events))
        if ms:
            out.update(microbatch_gpu_ms_median=ms[len(ms) // 2], microbatch_gpu_ms_max=ms[-1])
        return out


@dataclass
class _MicroBatch:
    real_tokens: int
    tokens: torch.Tensor
    labels: torch.Tensor
    cu_seqlens: torch.Tensor
    packed: PackedSeqParams
    fields: dict[str, torch.Tensor]


class Actor:
    """Build with ``Actor(bridge, settings)`` on every rank after ``torch.distributed`` is initialised
    (the launcher's job); ``close()`` releases megatron's parallel state."""

    def __init__(self, bridge: ModelBridge, settings: ActorSettings):
        if not dist.is_initialized():
            raise RuntimeError("initialise torch.distributed (NCCL) before building the Actor; the launcher does this")
        if not torch.cuda.is_available():
            raise RuntimeError("the Actor runs megatron-core's GPTModel, which needs a CUDA GPU")
        self.bridge = bridge
        self.settings = settings
        par = settings.parallel
        bridge.check_layout(par)
        settings.precision.layer_in_fp8(0, bridge.dims.num_layers)  # validates bf16_first/last_layers
        self.dp_size = settings.data_parallel_size(dist.get_world_size())
        self.device = torch.device("cuda", torch.cuda.current_device())
        model_lib.check_fp8_device(settings, self.device)
        self.max_seq_len = settings.max_seq_len or bridge.dims.max_position_embeddings
        if self.max_seq_len > bridge.dims.max_position_embeddings:
            raise ConfigError("actor.max_seq_len", self.max_seq_len,
                              f"must be <= the model's max_position_embeddings ({bridge.dims.max_position_embeddings})")

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=par.tp, pipeline_model_parallel_size=par.pp)
        tensor_parallel.model_parallel_cuda_manual_seed(settings.seed)
        self.config = model_lib.transformer_config(bridge, settings)
        self._exact = vllm_kernels() if settings.precision.exact else None
        """vLLM's kernels of the exact forward (``precision.exact``), which the layers and logprobs call."""
        gpt = model_lib.build_gpt(bridge, settings, self.config, pre_process=parallel_state.is_pipeline_first_stage(),
                                  post_process=parallel_state.is_pipeline_last_stage(), exact_kernels=self._exact)
        self.gpt = gpt
        self.num_fp8_linears = 0
        if (settings.precision.train_fp8 and settings.fp8_backend == "native") or settings.precision.exact:
            self.num_fp8_linears = model_lib.configure_fp8_linears(gpt, settings, bridge.dims.num_layers, self.device)
        self.model = model_lib.wrap_ddp(gpt, self.config)
        self.optimizer, self.scheduler = model_lib.build_optimizer(self.model, settings)
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.grad_scale_func = self.optimizer.scale_loss
        self.config.no_sync_func = self.model.no_sync
        self.steps = 0
        self._kv_observer: Optional[KvAmaxObserver] = None  # set inside _kv_observed
        self._reference: Optional[list[torch.Tensor]] = None
        self._memory = DeviceMemory()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self._vocab_start = tp_rank * bridge.padded_vocab_size(par.tp) // par.tp
        self._is_last_stage = parallel_state.is_pipeline_last_stage()
        self._refresh_fp8()

    # ---------------------------------------------------------------- public API

    def compute_logprobs(self, batch: PackedBatch, *, with_entropy: bool = False,
                         kv_scales: bool = False) -> TokenLogprobs:
        """log π(token_t | prefix) for every token of ``batch`` (0 at sequence starts), and the
        entropy of the distribution each token was drawn from, in fp32. With ``kv_scales``, the
        same pass also measures the FP8 KV-cache scales of every layer on this batch (all ranks
        get them)."""
        self._check_batch(batch, need_loss_mask=False)
        self.model.eval()
        plan = self._plan(batch)
        micro_batches = self._micro_batches(batch, plan[parallel_state.get_data_parallel_rank()])
        with torch.no_grad(), (self.kv_scale_meter() if kv_scales else contextlib.nullcontext()) as meter:
            outputs = self._run(micro_batches, forward_only=True,
                                loss_func=partial(self._collect_logprobs, with_entropy=with_entropy))
        names = ("logprobs", "entropy") if with_entropy else ("logprobs",)
        local = self._pipeline_results(outputs, micro_batches, names)
        full = self._gather_data_parallel(local, plan, batch)
        return TokenLogprobs(full["logprobs"], full.get("entropy"), meter.scales if kv_scales else None)

    @contextlib.contextmanager
    def kv_scale_meter(self) -> Iterator[KvScaleMeter]:
        """Inside the block every forward pass of this actor measures the FP8 KV-cache scales
        (``precision/kv_cache.py``); at its end ``meter.scales`` holds them ([num_layers, 3] fp32,
        CPU, alike on every rank). Collective: every rank of the job enters and leaves it."""
        meter = KvScaleMeter(KvAmaxObserver(self.bridge.dims.num_layers, self.device,
                                            tp_group=parallel_state.get_tensor_model_parallel_group()))
        with self._kv_observed(meter.observer):
            yield meter
        dist.all_reduce(meter.observer.amax, op=dist.ReduceOp.MAX)  # heads over TP, layers over PP, data over DP
        meter.scales = kv_scales_from_amax(meter.observer.amax).cpu()

    def use_rollout_kv_scales(self, scales: torch.Tensor) -> None:
        """The FP8 KV-cache scales ([num_layers, 3]: q, k, v) the engine computes with from now on:
        the exact forward (``precision.exact``) quantizes its q, k, v with them, as the engine does."""
        if self._exact is None:
            raise RuntimeError("rollout KV-cache scales are for the exact forward (precision.exact)")
        if tuple(scales.shape) != (self.bridge.dims.num_layers, 3):
            raise ValueError(f"KV-cache scales of shape {list(scales.shape)}; the model has "
                             f"[{self.bridge.dims.num_layers}, 3]")
        on_device = scales.to(self.device, torch.float32)
        for m in self.gpt.modules():
            if isinstance(m, PackedCoreAttention):
                m.exact_kv_scales = on_device[m.layer_number - 1].contiguous()

    def update(self, batch: PackedBatch, loss_fn: LossFn, *, with_logprobs: bool = False,
               before_step: Optional[Callable[[torch.Tensor], bool]] = None):
        """One optimizer step on ``batch`` with ``loss_fn`` (see ``megatron_jetrl.algo.LossInputs``);
        returns the batch's metrics: the loss function's, plus ``entropy``, ``grad_norm``, ``lr``,
        ``loss_scale``, ``update_skipped`` (FP16 overflow, or ``before_step`` said no), ``tokens``,
        ``micro_batches``, ``update_time_s``, and on a GPU where its time went (``_MicroBatchClock``):
        ``forward_backward_s``, ``microbatch_gpu_ms_median`` and ``microbatch_gpu_ms_max``. With
        ``with_logprobs``, returns (metrics, logprobs): also the per-token log π of the step's own
        forward ([T], fp32, CPU, as ``compute_logprobs``), computed with the weights before the step,
        i.e. the weights the batch was generated with.
        ``before_step(logprobs) -> bool`` (with ``with_logprobs``; called on every rank, which must
        answer alike): after the forward and backward, whether to take the optimizer step; False
        leaves the weights, the optimizer state and the schedule as they were."""
        if before_step is not None and not with_logprobs:
            raise ValueError("before_step looks at the step's own logprobs: pass with_logprobs=True")
        self._check_batch(batch, need_loss_mask=True)
        start = time.perf_counter()
        self.model.train()
        plan = self._plan(batch)
        micro_batches = self._micro_batches(batch, plan[parallel_state.get_data_parallel_rank()])
        mask = batch.fields["loss_mask"]
        global_tokens = float(mask.float().sum())
        scale = len(micro_batches) * self.dp_size
        loss_func = partial(self._policy_loss, loss_fn=loss_fn, global_tokens=global_tokens,
                            global_sequences=batch.num_sequences, scale=scale, keep_logprobs=with_logprobs)
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        clock = _MicroBatchClock()
        outputs = self._run(micro_batches, forward_only=False, loss_func=loss_func, clock=clock)
        timeline = clock.finish(start)
        logprobs = None
        if with_logprobs:
            local = self._pipeline_results(outputs, micro_batches, ("logprobs",))
            logprobs = self._gather_data_parallel(local, plan, batch)["logprobs"]
            outputs = [{k: v for k, v in o.items() if k != "logprobs"} for o in outputs]
        if before_step is None or before_step(logprobs):
            ok, grad_norm, _ = self.optimizer.step()
        else:  # the gradients are dropped unused: the next update zeroes them
            ok, grad_norm = False, None
        if ok:
            self.scheduler.step(increment=1)
            self.steps += 1
        self._refresh_fp8()
        metrics = self._reduce_metrics(outputs)
        metrics.update(
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            lr=float(self.optimizer.param_groups[0]["lr"]),
            loss_scale=float(self.optimizer.get_loss_scale()),
            update_skipped=float(not ok),
            tokens=float(batch.tokens.numel()),
            micro_batches=float(len(micro_batches)),
            update_time_s=time.perf_counter() - start,
            **timeline,
        )
        return (metrics, logprobs) if with_logprobs else metrics

    def keep_reference(self) -> None:
        """Remember the current parameters as the reference policy (pinned host memory) for
        ``reference_logprobs``: the KL penalty's anchor, usually the policy RL starts from."""
        torch.cuda.synchronize()
        self._reference = [p.detach().to("cpu", copy=True).pin_memory() for p in self.model.parameters()]

    def reference_logprobs(self, batch: PackedBatch) -> torch.Tensor:
        """log π_ref(token_t | prefix) of ``batch`` ([T], fp32, CPU), computed by this model with the
        reference parameters swapped in for the pass and swapped back after (an extra forward and
        two host copies of the parameters; no second model in memory)."""
        if self._reference is None:
            raise RuntimeError("no reference policy: call keep_reference() first")
        params = list(self.model.parameters())
        current = [p.detach().to("cpu", copy=True) for p in params]
        try:
            with torch.no_grad():
                for p, ref in zip(params, self._reference, strict=True):
                    p.copy_(ref, non_blocking=True)
            self._refresh_fp8()
            return self.compute_logprobs(batch).logprobs
        finally:
            with torch.no_grad():
                for p, cur in zip(params, current, strict=True):
                    p.copy_(cur)
            self._refresh_fp8()

    def fp8_weights(self) -> Iterator[tuple[str, Fp8Weight]]:
        """(parameter name, this rank's FP8 weight) for every linear computing in FP8 now: exactly the
        objects the next forward's GEMMs read. Empty unless the native FP8 backend is on."""
        for name, module in self._fp8_linears():
            yield f"{name}.weight", module.fp8_weight()

    def weight_shards(self) -> dict[str, Shard]:
        """This rank's shard of every model tensor under the bridge's Megatron name (global layer
        index), with the FP8 weight (checkpoint layout: codes + 128x128 ``scale_inv``) of each linear
        computing in FP8 -- the very bytes the next forward reads. What the weight sync sends."""
        if self._memory.offloaded:
            raise RuntimeError("the actor is offloaded; call onload() before syncing weights")
        shards = model_lib.named_shards(self.gpt, self.settings.precision, self.bridge.dims.num_layers)
        return {name: Shard(param, fp8) for name, (param, fp8) in shards.items()}

    def offload(self, need: Optional[int] = None) -> OffloadReport:
        """Free the FP8 caches, then free gradients and move optimizer state and parameters to pinned
        CPU memory (in that order, ``offload.choose``) until the device has ``need`` bytes free (None:
        all of them), so the rollout engine can use the GPU; ``onload()`` undoes it."""
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        for _, m in self._fp8_linears():
            m.fp8_cache.invalidate()
        state = self._state_tensors()
        released = self._memory.offload({
            "grads": (state["grads"], False),
            "optimizer": (state["optimizer"], True),
            "params": (state["params"], True),
        }, need=need)
        return OffloadReport(params_bytes=released["params"], grads_bytes=released["grads"],
                             optimizer_bytes=released["optimizer"], allocated_before=before,
                             allocated_after=torch.cuda.memory_allocated())

    def onload(self) -> None:
        self._memory.restore()
        self._refresh_fp8()

    def close(self) -> None:
        """Release the model, optimizer and megatron's parallel state (another Actor may follow in
        this process). The object is unusable afterwards. The GPU memory of parameters, gradients,
        optimizer state and FP8 caches is freed even where something else still refers to them
        (``memory.release``): a colocated engine may need all of it at once right after."""
        if self.model is not None:
            for _, m in self._fp8_linears():
                m.fp8_cache.invalidate()
            release([t for tensors in self._state_tensors().values() for t in tensors])
        self.config.finalize_model_grads_func = self.config.grad_scale_func = self.config.no_sync_func = None
        self.model = self.gpt = self.optimizer = self.scheduler = None
        self._memory = DeviceMemory()
        parallel_state.destroy_model_parallel()
        gc.collect()
        torch.cuda.empty_cache()

    # ----------------------------------------------------------- checkpoints

    def save(self, directory: str | Path, *, extra: Optional[dict] = None) -> None:
        """Model, optimizer and scheduler as one megatron distributed checkpoint (see ``state.py``)."""
        from megatron_jetrl.actor.state import save_actor

        save_actor(self, Path(directory), extra=extra or {})

    def load(self, directory: str | Path, *, model_only: Optional[bool] = None) -> dict:
        """Load a checkpoint written by ``save`` at any TP/PP, or a model-only checkpoint from
        ``tools/convert_hf_to_megatron.py``; returns the ``extra`` dict saved with it."""
        from megatron_jetrl.actor.state import load_actor

        extra = load_actor(self, Path(directory), model_only=model_only)
        self._refresh_fp8()
        return extra

    # -------------------------------------------------------------- internals

    def _fp8_linears(self) -> list[tuple[str, _Fp8LinearMixin]]:
        """(module name, linear) of every linear computing in FP8."""
        return [(n, m) for n, m in self.gpt.named_modules() if isinstance(m, _Fp8LinearMixin) and m.fp8_enabled]

    @contextlib.contextmanager
    def _kv_observed(self, observer: Optional[KvAmaxObserver]):
        """Every core-attention module of this stage reports q/k/v to ``observer`` inside the block."""
        if observer is None:
            yield
            return
        modules = [m for m in self.gpt.modules() if isinstance(m, PackedCoreAttention)]
        if not modules:
            raise ConfigError("actor.fp8_backend", self.settings.fp8_backend, "KV-cache scale calibration needs "
                              "the local layer spec's attention (Transformer Engine's is not instrumented)")
        for m in modules:
            m.kv_observer = observer
        self._kv_observer = observer
        try:
            yield
        finally:
            self._kv_observer = None
            for m in modules:
                m.kv_observer = None

    def _refresh_fp8(self) -> None:
        for _, m in self._fp8_linears():
            m.fp8_cache.invalidate()
            m.fp8_weight()

    def optimizers(self) -> list:
        """megatron's optimizers behind ``self.optimizer`` (a ChainedOptimizer holds several)."""
        if isinstance(self.optimizer, ChainedOptimizer):
            return list(self.optimizer.chained_optimizers)
        return [self.optimizer]

    def _state_tensors(self) -> dict[str, list]:
        """The actor's training state by kind: parameters, their gradients (``main_grad``, None
        where there is none) and the optimizer's tensors; what ``offload`` and ``close`` free."""
        params = list(self.model.parameters())
        return {"params": params, "grads": [getattr(p, "main_grad", None) for p in params],
                "optimizer": self._optimizer_tensors()}

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        tensors = []
        for opt in self.optimizers():
            inner = opt.optimizer
            for group in inner.param_groups:
                tensors.extend(group["params"])
            for state in inner.state.values():
                tensors.extend(v for v in state.values() if torch.is_tensor(v))
        return tensors

    def _check_batch(self, batch: PackedBatch, *, need_loss_mask: bool) -> None:
        if self._memory.offloaded:
            raise RuntimeError("the actor is offloaded; call onload() first")
        vocab = self.bridge.dims.vocab_size
        lo, hi = int(batch.tokens.min()), int(batch.tokens.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"token ids must be in [0, {vocab}) for this model; the batch has ids in [{lo}, {hi}]")
        lens = batch.seq_lens
        longest = max(lens)
        if longest > self.max_seq_len:
            raise ValueError(f"sequence {lens.index(longest)} has {longest} tokens; the model's limit is "
                             f"{self.max_seq_len} (actor.max_seq_len / max_position_embeddings)")
        if need_loss_mask:
            if "loss_mask" not in batch.fields:
                raise ValueError(f"update() needs a 'loss_mask' field; the batch has {sorted(batch.fields)}")
            if float(batch.fields["loss_mask"].float().sum()) <= 0:
                raise ValueError("the batch's loss_mask selects no token; there is nothing to train on")

    def _plan(self, batch: PackedBatch) -> list[list[list[int]]]:
        return plan_batch(batch.seq_lens, self.dp_size, self.settings.max_tokens_per_microbatch)

    def _micro_batches(self, batch: PackedBatch, groups: list[list[int]]) -> list[_MicroBatch]:
        """This rank's micro-batches (``groups`` of global sequence indices) on the device."""
        pad = token_multiple(self.settings, self.config.sequence_parallel)
        out = []
        for indices in groups:
            sub = batch.select(indices)
            real = sub.tokens.numel()
            sub = sub.padded_to(pad)
            cu = sub.cu_seqlens.to(self.device)
            cu32 = attach_packed_positions(cu.to(torch.int32), sub.tokens.numel())
            max_len = max(sub.seq_lens)
            tokens = sub.tokens.to(self.device, torch.int64)
            out.append(_MicroBatch(
                real_tokens=real, tokens=tokens, labels=next_token_labels(tokens, cu), cu_seqlens=cu,
                packed=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu32, cu_seqlens_kv=cu32,
                                       max_seqlen_q=max_len, max_seqlen_kv=max_len),
                fields={k: v.to(self.device) for k, v in sub.fields.items()},
            ))
        return out

    def _run(self, micro_batches: list[_MicroBatch], *, forward_only: bool, loss_func,
             clock: Optional["_MicroBatchClock"] = None) -> list[dict]:
        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            if clock is not None:
                clock.mark()
            if self._kv_observer is not None:
                self._kv_observer.tokens = mb.real_tokens  # not the padding sequence's q/k/v
            output = model(mb.tokens[None], None, None, packed_seq_params=mb.packed)
            return output, partial(loss_func, mb)

        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[self.model],
            num_microbatches=len(micro_batches), seq_length=max(mb.tokens.numel() for mb in micro_batches),
            micro_batch_size=1, forward_only=forward_only,
        )

    def _logprobs(self, mb: _MicroBatch, logits, with_entropy: bool):
        lp, ent = vocab_parallel_logprobs(
            logits[0], mb.labels, vocab_start=self._vocab_start, vocab_size=self.bridge.dims.vocab_size,
            group=parallel_state.get_tensor_model_parallel_group(), with_entropy=with_entropy,
            impl="exact" if self._exact is not None else self.settings.logprob_impl,
            token_logprobs=None if self._exact is None else self._exact.token_logprobs)
        lp = align_to_tokens(lp, mb.cu_seqlens)
        ent = align_to_tokens(ent, mb.cu_seqlens) if ent is not None else None
        return lp, ent

    def _collect_logprobs(self, mb: _MicroBatch, logits, *, with_entropy: bool):
        lp, ent = self._logprobs(mb, logits, with_entropy)
        out = {"logprobs": lp[: mb.real_tokens]}
        if ent is not None:
            out["entropy"] = ent[: mb.real_tokens]
        return torch.zeros((), device=logits.device), out

    def _policy_loss(self, mb: _MicroBatch, logits, *, loss_fn: LossFn, global_tokens: float, global_sequences: int,
                     scale: int, keep_logprobs: bool = False):
        lp, ent = self._logprobs(mb, logits, with_entropy=True)
        inputs = LossInputs(logprobs=lp, entropy=ent, fields=mb.fields, cu_seqlens=mb.cu_seqlens,
                            global_tokens=global_tokens, global_sequences=global_sequences)
        loss, metrics = loss_fn(inputs)
        metrics = {k: v.detach().float().reshape(()) for k, v in metrics.items()}
        mask = mb.fields["loss_mask"].float()
        metrics.setdefault("entropy", (ent.detach() * mask).sum() / global_tokens)
        if keep_logprobs:
            metrics["logprobs"] = lp.detach()[: mb.real_tokens]
        # megatron divides each micro-batch's loss by their count and averages gradients over DP
        # ranks; the loss function already normalised by the global batch, so undo both.
        return loss * scale, metrics

    def _pipeline_results(self, outputs: list[dict], micro_batches: list[_MicroBatch], names) -> dict:
        """This DP rank's per-token results in micro-batch order, on every pipeline stage."""
        total = sum(mb.real_tokens for mb in micro_batches)
        local = {}
        for name in names:
            if self._is_last_stage:
                local[name] = torch.cat([o[name] for o in outputs]).float()
            else:
                local[name] = torch.empty(total, device=self.device)
            if self.settings.parallel.pp > 1:
                dist.broadcast(local[name], src=parallel_state.get_pipeline_model_parallel_last_rank(),
                               group=parallel_state.get_pipeline_model_parallel_group())
        return local

    def _gather_data_parallel(self, local: dict, plan: list[list[list[int]]], batch: PackedBatch) -> dict:
        """Every DP rank's results placed at their sequences' positions in the global batch."""
        cu = batch.cu_seqlens.tolist()
        lens = batch.seq_lens
        orders = [[i for group in groups for i in group] for groups in plan]
        counts = [sum(lens[i] for i in o) for o in orders]
        out = {}
        for name, t in local.items():
            if self.dp_size > 1:
                buf = torch.zeros(max(counts), device=self.device)
                buf[: t.numel()] = t
                parts = [torch.empty_like(buf) for _ in range(self.dp_size)]
                dist.all_gather(parts, buf, group=parallel_state.get_data_parallel_group())
            else:
                parts = [t]
            full = torch.empty(batch.tokens.numel())
            for order, part, n in zip(orders, parts, counts, strict=True):
                part = part[:n].cpu()
                pos = 0
                for i in order:
                    full[cu[i]:cu[i + 1]] = part[pos:pos + lens[i]]
                    pos += lens[i]
            out[name] = full
        return out

    def _reduce_metrics(self, outputs: list[dict]) -> dict[str, float]:
        """Sum the metric shares over micro-batches and DP ranks; every rank gets the result."""
        names = [sorted(outputs[0])] if self._is_last_stage and outputs else [None]
        if self.settings.parallel.pp > 1:
            dist.broadcast_object_list(names, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                       group=parallel_state.get_pipeline_model_parallel_group())
        keys = names[0]
        values = torch.zeros(len(keys), device=self.device, dtype=torch.float64)
        if self._is_last_stage:
            for o in outputs:
                values += torch.stack([o[k].double() for k in keys])
            dist.all_reduce(values, group=parallel_state.get_data_parallel_group())
        if self.settings.parallel.pp > 1:
            dist.broadcast(values, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                           group=parallel_state.get_pipeline_model_parallel_group())
        return dict(zip(keys, values.tolist(), strict=True))
