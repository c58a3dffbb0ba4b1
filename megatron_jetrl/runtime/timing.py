"""Wall-clock seconds per named phase of one training step.

GPU work is asynchronous: without a device synchronize the clock measures launch time, not work.
Pass ``sync=torch.cuda.synchronize`` on a GPU; it is called before each clock read.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional


class PhaseTimer:
    """Accumulates seconds per phase name until ``reset()`` (call it at each step start). A phase
    entered twice in a step adds up; nested phases each count their own (overlapping) time."""

    def __init__(self, sync: Optional[Callable[[], None]] = None):
        self._sync = sync
        self._seconds: dict[str, float] = {}

    def _now(self) -> float:
        if self._sync is not None:
            self._sync()
        return time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = self._now()
        try:
            yield
        finally:
            self._seconds[name] = self._seconds.get(name, 0.0) + self._now() - start

    @property
    def seconds(self) -> dict[str, float]:
        """A copy: phase name -> seconds this step, in first-entered order."""
        return dict(self._seconds)

    def reset(self) -> None:
        self._seconds.clear()
