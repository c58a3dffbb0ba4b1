"""Preemption: turn SIGTERM / SIGUSR1 into "checkpoint and stop at the next step boundary".

SLURM sends SIGTERM on ``scancel`` and preemption (and, with ``--signal=USR1@120``, SIGUSR1 ahead of
the time limit); torchrun forwards SIGTERM to its workers. The handler only records the signal:
the trainer polls ``agreed(any_rank)`` between steps, so all ranks stop at the same step and save
one consistent checkpoint. A second SIGTERM while a stop is already requested means "now": the
default handler is restored and the signal re-raised, killing the process at once (a checkpoint
being written stays unpublished; resume uses the previous one).

Handlers can only be installed from the main thread (a Python rule).
"""

from __future__ import annotations

import signal
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

EXIT_PREEMPTED = 75
"""Exit status after a preemption checkpoint (EX_TEMPFAIL: run the same command again; the SLURM
script requeues the job on it)."""


class PreemptionSignal:
    """Context manager: installs the handlers on enter, restores the previous ones on exit."""

    def __init__(self, signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGUSR1)):
        self.signals = tuple(signal.Signals(s) for s in signals)
        self._received: Optional[signal.Signals] = None
        self._previous: dict = {}

    def __enter__(self) -> "PreemptionSignal":
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        while self._previous:
            s, handler = self._previous.popitem()
            signal.signal(s, handler)

    def _handle(self, signum: int, frame) -> None:
        if self._received is not None and signum == signal.SIGTERM:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        self._received = signal.Signals(signum)

    @property
    def requested(self) -> bool:
        """Whether a stop signal arrived in this process."""
        return self._received is not None

    @property
    def signal_name(self) -> Optional[str]:
        """The first signal received (``"SIGTERM"``, ``"SIGUSR1"``), or None."""
        return None if self._received is None else self._received.name

    def agreed(self, reduce: Callable[[bool], bool]) -> bool:
        """Whether any rank was signalled; ``reduce`` is a collective OR, e.g. ``any_rank``.
        Every rank must call it at the same step boundary."""
        return bool(reduce(self.requested))


def any_rank(flag: bool, device: Optional[torch.device] = None, group=None) -> bool:
    """All-reduce MAX of ``flag`` over ``group``: True on every rank if True on any.

    Without an initialised process group, returns ``flag``. NCCL reduces only CUDA tensors: pass
    the rank's device, or leave ``device`` None to use the current CUDA device when the group's
    backend is NCCL-only (CPU otherwise: gloo, or a ``cpu:gloo,cuda:nccl`` group).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return bool(flag)
    if device is None:
        backend = str(dist.get_backend(group))
        nccl_only = "nccl" in backend and "gloo" not in backend
        device = torch.device("cuda", torch.cuda.current_device()) if nccl_only else torch.device("cpu")
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())
