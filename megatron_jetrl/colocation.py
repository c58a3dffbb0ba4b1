"""Who holds the GPU: the actor while it trains, the rollout engine while it generates.

With ``rollout.offload_actor`` (colocation) the actor's parameters and optimizer state wait in
host memory while the engine generates, and the engine sleeps while the actor trains. Only what
the engine's wake needs leaves the GPU (``engine.wake_bytes()``; the engine's start, which sizes
its KV cache, has the whole actor off it): a GPU with room for both copies nothing. A weight
sync wakes only the engine's weights; its KV cache comes back when the actor has left the GPU. An
engine whose sleep dropped its weights since the last sync (vLLM's level 2, e.g. a checkpoint
after an evaluation) is synced again before it generates, while the actor is still on the GPU.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from megatron_jetrl.rollout import RolloutEngine


class Colocation:
    """The GPU handover of one process: ``start_engine`` once, then ``rollout_mode`` before
    generating and ``train_mode`` before the actor computes; ``synced`` after every weight sync.
    ``sync`` is the trainer's weight sync (called when the engine lost its weights)."""

    def __init__(self, actor: Any, *, offload_actor: bool, sync: Callable[[], None]):
        self.actor, self.offload_actor, self._sync = actor, offload_actor, sync
        self.engine: Optional[RolloutEngine] = None
        self._actor_offloaded = False
        self._engine_awake = False

    def start_engine(self, build: Callable[[], RolloutEngine]) -> RolloutEngine:
        """Build the engine with the actor off the GPU when colocated: the engine sizes its KV cache
        from the free memory."""
        if self.offload_actor:
            self.actor.offload()
            self._actor_offloaded = True
        self.engine = build()
        self._engine_awake = True
        return self.engine

    def rollout_mode(self) -> None:
        """The engine gets the GPU: weights synced again if a sleep dropped them, the actor
        offloaded (when colocated), the engine awake."""
        if self.engine.weights_discarded:
            self.train_mode()
            self._sync()
        if self.offload_actor and not self._actor_offloaded:
            self.actor.offload(need=None if self._engine_awake else self.engine.wake_bytes())
            self._actor_offloaded = True
        if not self._engine_awake:
            self.engine.wake()
            self._engine_awake = True

    def train_mode(self) -> None:
        """The actor gets the GPU: the engine asleep (when colocated), the actor on the GPU."""
        if self.offload_actor and self._engine_awake:
            self.engine.sleep()
            self._engine_awake = False
        if self._actor_offloaded:
            self.actor.onload()
            self._actor_offloaded = False

    def synced(self) -> None:
        """A weight sync woke the engine's weights only: the rest wakes in ``rollout_mode``."""
        self._engine_awake = False
