"""The trainer half: the megatron-core policy model (logprobs, updates, colocation offload,
checkpoints) and checkpoint conversion. May import megatron.core.

``ActorSettings`` and ``PackedBatch`` are plain Python and import without megatron-core, so a job
config can be validated (``jetrl check``) quickly on a machine without a GPU; ``Actor`` and the
rest load megatron-core when first used.
"""

from megatron_jetrl.actor.packing import PackedBatch
from megatron_jetrl.actor.settings import ActorSettings, OptimizerSettings

_LAZY = {"Actor": "megatron_jetrl.actor.actor", "TokenLogprobs": "megatron_jetrl.actor.actor",
         "OffloadReport": "megatron_jetrl.actor.offload"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megatron_jetrl.actor' has no attribute {name!r}")


__all__ = ["Actor", "ActorSettings", "OffloadReport", "OptimizerSettings", "PackedBatch", "TokenLogprobs"]
