"""Weight sync: the trainer's shards -> the rollout engine's tensors, every step.

``SyncPlan`` (pure rank and slice arithmetic, computed once) says where every engine tensor comes
from; ``WeightSync`` runs it each step with the ``ops.copy_segments`` kernel and NCCL. Under
unified FP8 the engine receives the trainer's own FP8 bytes and scales. May import the actor,
the rollout engines and the extension.
"""

from megatron_jetrl.sync.local import engine_tensors_from_full, shard_state, simulate
from megatron_jetrl.sync.plan import EngineTensor, Piece, SyncPlan, train_rank
from megatron_jetrl.sync.transfer import Shard, SyncReport, WeightSync

__all__ = [
    "EngineTensor",
    "Piece",
    "Shard",
    "SyncPlan",
    "SyncReport",
    "WeightSync",
    "engine_tensors_from_full",
    "shard_state",
    "simulate",
    "train_rank",
]
