"""The trainer half: the megatron-core policy model (logprobs, updates, colocation offload,
checkpoints) and checkpoint conversion. May import megatron.core."""

from megatron_jetrl.actor.actor import Actor, TokenLogprobs
from megatron_jetrl.actor.memory import OffloadReport
from megatron_jetrl.actor.packing import PackedBatch
from megatron_jetrl.actor.settings import ActorSettings, OptimizerSettings

__all__ = ["Actor", "ActorSettings", "OffloadReport", "OptimizerSettings", "PackedBatch", "TokenLogprobs"]
