"""Wall-clock seconds per named phase of one training step, and the CPU seconds spent meanwhile.

GPU work is asynchronous: without a device synchronize the clock measures launch time, not work.
Pass ``sync=torch.cuda.synchronize`` on a GPU; it is called before each clock read.

Beside the wall clock, each phase records the CPU seconds of this process (every thread,
``time.process_time``) and of the whole machine (every core busy outside idle and I/O wait, from
``/proc/stat``; Linux): where the engine's host loop sets a phase's pace, ``process`` near the wall
time says one thread is busy throughout, and ``machine - process`` is what other processes took
from the cores meanwhile (a compiler, a data loader, another job).
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

PROC_STAT = Path("/proc/stat")
BUSY_FIELDS = (0, 1, 2, 5, 6, 7)
"""The fields of /proc/stat's ``cpu`` line that count busy time: user, nice, system, irq, softirq, steal."""


def machine_cpu_seconds(stat: Path = PROC_STAT) -> Optional[float]:
    """Busy CPU seconds of all cores since boot (``BUSY_FIELDS`` of /proc/stat's first line), or None
    where there is no /proc/stat (not Linux) or it reads as something else."""
    try:
        fields = stat.read_text().split("\n", 1)[0].split()
        if fields[0] != "cpu":
            return None
        ticks = [int(fields[1 + i]) for i in BUSY_FIELDS]
    except (OSError, ValueError, IndexError):
        return None
    return sum(ticks) / os.sysconf("SC_CLK_TCK")


class PhaseTimer:
    """Accumulates seconds per phase name until ``reset()`` (call it at each step start). A phase
    entered twice in a step adds up; nested phases each count their own (overlapping) time."""

    def __init__(self, sync: Optional[Callable[[], None]] = None,
                 machine_cpu: Callable[[], Optional[float]] = machine_cpu_seconds):
        self._sync = sync
        self._machine_cpu = machine_cpu
        self._seconds: dict[str, float] = {}
        self._cpu: dict[str, dict[str, float]] = {}

    def _now(self) -> float:
        if self._sync is not None:
            self._sync()
        return time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start, process, machine = self._now(), time.process_time(), self._machine_cpu()
        try:
            yield
        finally:
            end = self._now()
            self._seconds[name] = self._seconds.get(name, 0.0) + end - start
            cpu = self._cpu.setdefault(name, {})
            cpu["process"] = cpu.get("process", 0.0) + time.process_time() - process
            after = self._machine_cpu() if machine is not None else None
            if after is not None:
                cpu["machine"] = cpu.get("machine", 0.0) + after - machine

    @property
    def seconds(self) -> dict[str, float]:
        """A copy: phase name -> seconds this step, in first-entered order."""
        return dict(self._seconds)

    @property
    def cpu_seconds(self) -> dict[str, dict[str, float]]:
        """A copy: phase name -> CPU seconds this step of ``process`` (this process, every thread) and
        ``machine`` (every core; absent where the machine's counters cannot be read)."""
        return {name: dict(cpu) for name, cpu in self._cpu.items()}

    def reset(self) -> None:
        self._seconds.clear()
        self._cpu.clear()
