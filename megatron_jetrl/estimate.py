"""A per-GPU memory estimate of a job's layout, from the model's shapes alone (no GPU).

What ``jetrl check`` prints. Terms, per GPU (P = this rank's parameters = total / (TP x PP)):

    trainer weights     P x 2 bytes (BF16/FP16 model parameters)
    trainer grads       P x 4 (megatron's fp32 gradient buffer)
    optimizer           P x 12 / DP (fp32 master weights + Adam's two moments, sharded over DP by
                        the distributed optimizer)
    fp8 weight copies   linear parameters / (TP x PP) x 2 (the FProp and DGrad FP8 copies), FP8 only
    activations         a rough bound: tokens per micro-batch x hidden x layers per stage x 34
                        bytes / TP (Korthikanti et al.'s per-layer estimate without recompute), plus
                        the fp32 logits of one micro-batch: tokens x vocab / TP x 8
    rollout weights     total parameters / rollout TP (1 byte for FP8 linears, 2 otherwise)
    rollout KV cache    hf: max_batch_tokens slots x layers x 2 (K, V) x kv heads x head_dim x 2
                        bytes; vLLM: its gpu_memory_utilization share, which it reserves itself

With ``rollout.offload_actor`` the trainer's terms and the engine's are not resident together
(the peak is the larger side plus the engine's sleeping share); without it they add up. This is an
estimate: the allocator's fragmentation, NCCL buffers and CUDA graphs are not in it.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_jetrl.actor.settings import ActorSettings
from megatron_jetrl.data.settings import DataSettings
from megatron_jetrl.models import ModelBridge
from megatron_jetrl.rollout.settings import RolloutSettings

GB = 1e9


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
    vllm_share: float | None
    offload_actor: bool

    @property
    def trainer_total(self) -> float:
        return self.trainer_weights + self.trainer_grads + self.optimizer + self.fp8_copies + self.activations

    @property
    def rollout_total(self) -> float:
        return self.rollout_weights + self.rollout_kv_cache

    @property
    def peak(self) -> float:
        """Bytes resident at the worst moment of a step (see the module docstring)."""
        if self.offload_actor:
            return max(self.trainer_total, self.rollout_total)
        return self.trainer_total + self.rollout_total

    def rows(self) -> list[tuple[str, float]]:
        rows = [("trainer weights", self.trainer_weights), ("trainer grads (fp32)", self.trainer_grads),
                ("optimizer (fp32, /DP)", self.optimizer), ("fp8 weight copies", self.fp8_copies),
                ("activations (rough)", self.activations), ("rollout weights", self.rollout_weights),
                ("rollout kv cache", self.rollout_kv_cache), ("peak", self.peak)]
        return [(name, value / GB) for name, value in rows]


def estimate_memory(bridge: ModelBridge, actor: ActorSettings, rollout: RolloutSettings,
                    data: DataSettings, world_size: int) -> MemoryEstimate:
    d = bridge.dims
    par = actor.parallel
    dp = actor.data_parallel_size(world_size)
    shapes = [(spec, _numel(spec.shape)) for spec in bridge.tensor_map()]
    total = sum(n for _, n in shapes)
    linear = sum(n for spec, n in shapes if spec.linear)
    model_parallel = par.tp * par.pp
    local = total / model_parallel
    fp8_train = actor.precision.train_fp8
    longest = data.train.max_prompt_tokens + rollout.sampling.max_new_tokens
    mb_tokens = max(actor.max_tokens_per_microbatch, longest)
    layers_per_stage = d.num_layers / par.pp
    activations = mb_tokens * d.hidden_size * layers_per_stage * 34 / par.tp
    activations += mb_tokens * bridge.padded_vocab_size(par.tp) / par.tp * 8
    rollout_bytes = linear * (1 if actor.precision.rollout_fp8 else 2) + (total - linear) * 2
    kv_cache, vllm_share = 0.0, None
    if rollout.engine == "hf":
        kv_cache = float(rollout.hf.max_batch_tokens * d.num_layers * 2 * d.num_groups * d.head_dim * 2)
    else:
        vllm_share = rollout.vllm.gpu_memory_utilization
    return MemoryEstimate(
        total_params=total,
        trainer_weights=local * 2,
        trainer_grads=local * 4,
        optimizer=local * 12 / dp,
        fp8_copies=(linear / model_parallel * 2) if fp8_train else 0.0,
        activations=activations,
        rollout_weights=rollout_bytes / rollout.tp,
        rollout_kv_cache=kv_cache,
        vllm_share=vllm_share,
        offload_actor=rollout.offload_actor,
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
