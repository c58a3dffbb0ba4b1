"""A per-GPU memory plan of a job's layout, from the model's shapes alone (no GPU).

What ``jetrl check`` prints and ``jetrl train`` checks against the GPU before building anything.
Terms, per GPU, for the most loaded pipeline stage (P = its parameters: its layers / TP, plus the
embedding and/or LM head it holds / TP):

    trainer weights     P x 2 bytes (BF16/FP16 model parameters)
    trainer grads       P x 4 (megatron's fp32 gradient buffer)
    optimizer           P x 12 / DP (fp32 master weights + Adam's two moments, sharded over DP by
                        the distributed optimizer)
    fp8 weight copies   the stage's linear parameters / TP x 2 (the FProp and DGrad FP8 copies), FP8
                        training only
    activations         per layer and token, hidden x (10 + 24 / TP) bytes, or hidden x 34 / TP with
                        sequence parallelism (Korthikanti et al., flash attention: no s^2 term), for
                        the micro-batch's tokens and the stage's layers; with ``actor.recompute=full``
                        only each layer's input (hidden x 2 bytes, / TP with SP) plus one layer's full
                        set. Pipeline stage 0 holds up to PP micro-batches in flight (1F1B). Plus the
                        logits of one micro-batch: tokens x padded vocab / TP x 8 bytes
    exact transients    with the exact rollout (``precision.exact``), what its trainer forward holds
                        besides: the larger of one chunk of whole logit rows gathered for the engine's
                        logprob kernel under TP (``actor.logprobs.CHUNK_ELEMENTS`` x 2 bytes) and one
                        layer's paged K/V copy plus, above TP 2, the ordered TP reduction's gathered
                        partial outputs and fp32 sum (``actor.exact.ordered_tp_reduce``)
    rollout weights     all parameters / rollout TP (1 byte for FP8 linears, 2 otherwise)
    rollout kv cache    hf: max_batch_tokens slots x layers x 2 (K, V) x kv heads x head_dim x 2 bytes;
                        vLLM: weights and cache together take gpu_memory_utilization of the GPU
    runtime             RUNTIME_RESERVE_GIB for the CUDA context, NCCL and cuBLAS workspaces and CUDA
                        graph pools, plus ALLOCATOR_SLACK of the resident bytes for the caching
                        allocator's reserved-but-unallocated blocks (both calibrated on the GPU host
                        against the Qwen3-32B-dims runs: docs/benchmarks.md)

With ``rollout.offload_actor`` (colocation) the trainer's terms and the engine's are not resident
together: the peak is the larger side; the trainer's weights and optimizer state wait in pinned
host memory meanwhile (the ``host`` row). Without it they add up. It is an estimate, built to err
on the high side; the GPU host's measurements beside it are in docs/benchmarks.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_jetrl.actor.settings import ActorSettings
from megatron_jetrl.config import ConfigError
from megatron_jetrl.models import ModelBridge
from megatron_jetrl.rollout.settings import RolloutSettings

GiB = 2**30
RUNTIME_RESERVE_GIB = 8.0
"""Device memory outside PyTorch's allocator, per process: CUDA context, NCCL communicators and
buffers, cuBLAS workspaces (measured 8 GiB at TP=4 and at TP=2 x PP=2 on 4 H200s)."""
ALLOCATOR_SLACK = 0.08
"""The caching allocator's reserved-but-unallocated share (measured 12 and 17 GiB over 103 and
106 GiB allocated in those runs, where the plan's terms summed to 107 and 115 GiB)."""
GPU_MEMORY_GIB = {"H100": 79.1, "H200": 139.8}
"""What torch reports as total memory (``mem_get_info``) on the 80 GB and 141 GB parts."""


@dataclass(frozen=True)
class MemoryEstimate:
    total_params: int
    trainer_weights: float
    trainer_grads: float
    optimizer: float
    fp8_copies: float
    activations: float
    rollout_weights: float
    rollout_kv_cache: float
    engine_share: float | None
    """The share of the GPU an engine that sizes its own memory claims (vLLM), or None: then its
    weights and KV cache are the terms above."""
    share_key: str | None
    """The config key of ``engine_share``."""
    offload_actor: bool
    host_offload: float
    exact_transients: float = 0.0

    @property
    def trainer_total(self) -> float:
        return (self.trainer_weights + self.trainer_grads + self.optimizer + self.fp8_copies + self.activations
                + self.exact_transients)

    def rollout_total(self, capacity: float | None = None) -> float:
        """Bytes of the engine while it generates; one with a share claims it of ``capacity``."""
        if self.engine_share is not None:
            return self.engine_share * capacity if capacity is not None else 0.0
        return self.rollout_weights + self.rollout_kv_cache

    def peak(self, capacity: float | None = None) -> float:
        """Bytes resident at the worst moment of a step, runtime reserve included."""
        resident = self.resident(capacity)
        return resident + self.runtime_reserve(capacity)

    def resident(self, capacity: float | None = None) -> float:
        """The plan's terms at the worst moment (colocated: the larger side; otherwise both)."""
        rollout = self.rollout_total(capacity)
        return max(self.trainer_total, rollout) if self.offload_actor else self.trainer_total + rollout

    def runtime_reserve(self, capacity: float | None = None) -> float:
        return RUNTIME_RESERVE_GIB * GiB + ALLOCATOR_SLACK * self.resident(capacity)

    def moved_to_host(self, capacity: float | None = None) -> float | None:
        """Bytes the colocated actor copies to host memory and back at each rollout (``actor.offload``
        with the engine's wake need): what its weights, gradients and optimizer state and the engine's
        share leave short of the GPU, the runtime's fixed reserve kept, less the gradients (dropped,
        no copy); at most its weights and optimizer state. None where the engine's need is not known
        before it runs (an engine without a share: the whole actor moves)."""
        if not self.offload_actor or self.engine_share is None or capacity is None:
            return None
        state = self.trainer_weights + self.trainer_grads + self.optimizer
        short = state + self.rollout_total(capacity) + RUNTIME_RESERVE_GIB * GiB - capacity
        return min(max(0.0, short - self.trainer_grads), self.trainer_weights + self.optimizer)

    def fits(self, capacity: float) -> bool:
        return self.peak(capacity) <= capacity

    def problems(self, capacity: float) -> list[str]:
        """Why the plan does not fit a GPU of ``capacity`` bytes, with what to change; empty if it fits."""
        peak = self.peak(capacity)
        if peak <= capacity:
            return []
        gib = lambda b: f"{b / GiB:.1f} GiB"  # noqa: E731
        out = [f"the estimated peak per GPU is {gib(peak)}, over the GPU's {gib(capacity)}"]
        if self.engine_share is not None and not self.offload_actor:
            out.append(f"the engine keeps {self.share_key}={self.engine_share} of the GPU next to "
                       f"the trainer's {gib(self.trainer_total)}: set rollout.offload_actor=true or lower it")
        elif not self.offload_actor:
            out.append(f"trainer ({gib(self.trainer_total)}) and engine ({gib(self.rollout_total(capacity))}) are "
                       "resident together: set rollout.offload_actor=true")
        if self.activations > 0.25 * self.trainer_total:
            out.append(f"activations take {gib(self.activations)}: set actor.recompute=full, a smaller "
                       "actor.max_tokens_per_microbatch, or a larger actor.parallel.tp (with sequence_parallel)")
        if self.optimizer + self.trainer_grads > 0.5 * self.trainer_total:
            out.append(f"weights, gradients and optimizer state take "
                       f"{gib(self.trainer_weights + self.trainer_grads + self.optimizer)}: spread the model over "
                       "more GPUs (larger actor.parallel.tp or pp, or more nodes for a larger DP)")
        return out

    def rows(self, capacity: float | None = None) -> list[tuple[str, float]]:
        rows = [("trainer weights", self.trainer_weights), ("trainer grads (fp32)", self.trainer_grads),
                ("optimizer (fp32, /DP)", self.optimizer), ("fp8 weight copies", self.fp8_copies),
                ("activations", self.activations)]
        if self.exact_transients:
            rows.append(("exact transients", self.exact_transients))
        rows.append(("trainer total", self.trainer_total))
        if self.engine_share is not None:
            rows.append((f"engine share ({self.engine_share:g} x GPU)", self.rollout_total(capacity)))
        else:
            rows += [("rollout weights", self.rollout_weights), ("rollout kv cache", self.rollout_kv_cache)]
        rows += [("runtime reserve", self.runtime_reserve(capacity)),
                 ("peak" + (" (colocated: max)" if self.offload_actor else " (sum)"), self.peak(capacity))]
        if self.offload_actor:
            rows.append(("host (pinned) for offload", self.host_offload))
            moved = self.moved_to_host(capacity)
            if moved is not None:
                rows.append(("moved a step (each way)", moved))
        return [(name, value / GiB) for name, value in rows]


def estimate_memory(bridge: ModelBridge, actor: ActorSettings, rollout: RolloutSettings,
                    longest_train_sequence: int, world_size: int) -> MemoryEstimate:
    d = bridge.dims
    par = actor.parallel
    dp = actor.data_parallel_size(world_size)
    layer_params, layer_linear, edge_params = 0, 0, {"embedding": 0, "output_layer": 0, "final_norm": 0}
    total = linear = 0
    for spec in bridge.tensor_map():
        n = _numel(spec.shape)
        total += n
        linear += n if spec.linear else 0
        if spec.layer is not None:
            layer_params += n
            layer_linear += n if spec.linear else 0
        else:
            key = "embedding" if "embedding" in spec.megatron else ("output_layer" if "output_layer" in spec.megatron
                                                                    else "final_norm")
            edge_params[key] += n
    per_layer, per_layer_linear = layer_params / d.num_layers, layer_linear / d.num_layers
    layers = -(-d.num_layers // par.pp)  # the largest stage
    edges = (edge_params["embedding"] + edge_params["output_layer"] if par.pp == 1
             else max(edge_params["embedding"], edge_params["output_layer"]))
    local = (per_layer * layers + edges) / par.tp
    local_linear = per_layer_linear * layers / par.tp

    tokens = max(actor.max_tokens_per_microbatch, longest_train_sequence)
    h = d.hidden_size
    full_layer = tokens * h * (34 / par.tp if par.sequence_parallel else 10 + 24 / par.tp)
    if actor.recompute == "full":
        stage = layers * tokens * h * 2 / (par.tp if par.sequence_parallel else 1) + full_layer
    else:
        stage = layers * full_layer
    activations = stage * par.pp + tokens * bridge.padded_vocab_size(par.tp) / par.tp * 8

    rollout_bytes = linear * (1 if actor.precision.rollout_fp8 else 2) + (total - linear) * 2
    kv_cache, engine_share = rollout.options.memory(d)
    return MemoryEstimate(
        total_params=total,
        trainer_weights=local * 2,
        trainer_grads=local * 4,
        optimizer=local * 12 / dp,
        fp8_copies=local_linear * 2 if actor.precision.train_fp8 else 0.0,
        activations=activations,
        rollout_weights=rollout_bytes / rollout.tp,
        rollout_kv_cache=kv_cache,
        engine_share=engine_share,
        share_key=rollout.options.share_key,
        offload_actor=rollout.offload_actor,
        host_offload=local * 2 + local * 12 / dp,
        exact_transients=exact_transients(bridge, actor, tokens) if actor.precision.exact else 0.0,
    )


def exact_transients(bridge: ModelBridge, actor: ActorSettings, tokens: int) -> float:
    """Bytes the exact forward holds for a moment besides the activations (see the module docstring):
    the gathered logit rows of one chunk under TP, or one layer's paged K/V copy and, above TP 2, its
    ordered reduction (the partial outputs of every rank and their fp32 sum)."""
    from megatron_jetrl.actor.logprobs import CHUNK_ELEMENTS
    from megatron_jetrl.precision.exact import ordered_tp_reduction

    d, par = bridge.dims, actor.parallel
    logits = CHUNK_ELEMENTS * 2 if par.tp > 1 else 0.0
    paged_kv = tokens * 2 * (d.num_groups / par.tp) * d.head_dim * 2
    reduction = 0.0
    if ordered_tp_reduction(par.tp):
        rows = tokens / par.tp if par.sequence_parallel else tokens
        gathered = tokens if par.sequence_parallel else tokens * par.tp  # all-to-all's chunks / all-gather's copies
        reduction = gathered * d.hidden_size * 2 + rows * d.hidden_size * 4
    return max(logits, paged_kv + reduction)


def gpu_capacity(spec: str) -> float:
    """Bytes of a GPU named on the command line: ``H100``, ``H200`` or a number of GiB; a
    ``ConfigError`` naming ``--gpu-memory`` otherwise."""
    key = spec.strip().upper()
    if key in GPU_MEMORY_GIB:
        return GPU_MEMORY_GIB[key] * GiB
    try:
        value = float(spec)
    except ValueError:
        raise ConfigError("--gpu-memory", spec, "give H100, H200 or a number of GiB") from None
    if not 0 < value < math.inf:
        raise ConfigError("--gpu-memory", spec, "must be a finite number of GiB > 0")
    return value * GiB


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
