"""The console view of a run: one compact line per step, plus live progress bars on a terminal.

Two modes, because a run is watched two ways:
- live (stdout is a terminal): a rich ``Progress`` pinned at the bottom shows the run's step bar
  (k/N, elapsed, ETA) and one row per phase of the current step (a bar when the phase has a
  total, a spinner otherwise; a check mark and its seconds once done). Step lines and messages
  print above the bars.
- plain (SLURM log files, pipes): the same step lines through ``print(..., flush=True)``; no
  bars, no ANSI codes, nothing per phase.

The view only displays: the trainer measures (``timing.PhaseTimer``) and passes the numbers in.
Non-zero ranks build it with ``enabled=False``, which makes every method a no-op.

Step line format (``step_done``), e.g. ``step 12/100 | reward 0.41 | len 17.2 | kl 1e-4 |
gen 1.2s upd 0.4s sync 0.01s | 5.1k tok/s/gpu | eta 0:41:10``. Each entry of ``keys`` is a metric
name, optionally labelled ``"label=metric/name"``; the default label is the name after its last
``/``. A label holding ``{}`` is a template for the value (``"{} tok/s/gpu=perf/tok_per_s_gpu"``).
Names ending in ``_s`` are seconds (the suffix is dropped from the default label); consecutive
seconds entries share one ``|`` group. A metric absent this step shows as ``-``.
"""

from __future__ import annotations

import math
import sys
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Iterator, Mapping, Optional, Sequence

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, SpinnerColumn, Task, TaskID, TextColumn
from rich.text import Text


def format_value(v: float) -> str:
    """Compact, about 3 significant digits: ``0.41``, ``17.2``, ``123``, ``5.12k``, ``1e-4``."""
    if not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    a = abs(v)
    if a == 0:
        return "0"
    if a >= 1e3:
        for div, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
            if a >= div:
                return f"{v / div:.3g}{suffix}"
    if a >= 100:
        return f"{v:.0f}"
    if a >= 1e-2:
        return f"{v:.3g}"
    mantissa, exponent = f"{v:.1e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def format_seconds(s: float) -> str:
    """``12ms``, ``1.2s``, ``59.9s``, ``3m07s``, ``2h05m``."""
    if not math.isfinite(s):
        return format_value(s) + "s"
    if s < 0.01:
        return f"{s * 1e3:.2g}ms"
    if s < 60:
        return f"{s:.3g}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def _clock(seconds: Optional[float]) -> str:
    return "-:--:--" if seconds is None else str(timedelta(seconds=max(0, int(seconds))))


def format_step_line(step: int, total_steps: int, metrics: Mapping[str, float], keys: Sequence[str],
                     eta_s: Optional[float] = None) -> str:
    """The one-line summary of a step (format in the module docstring)."""
    groups: list[str] = []
    last_was_seconds = False
    for entry in keys:
        label, name = entry.split("=", 1) if "=" in entry else ("", entry)
        seconds = name.endswith("_s")
        if not label:
            label = name.rsplit("/", 1)[-1]
            label = label[:-2] if seconds and len(label) > 2 else label
        value = metrics.get(name)
        shown = "-" if value is None else (format_seconds(float(value)) if seconds else format_value(float(value)))
        text = label.format(shown) if "{}" in label else f"{label} {shown}"
        if seconds and last_was_seconds:
            groups[-1] += " " + text
        else:
            groups.append(text)
        last_was_seconds = seconds
    if eta_s is not None:
        groups.append(f"eta {_clock(eta_s)}")
    return " | ".join([f"step {step}/{total_steps}", *groups])


class _Status(SpinnerColumn):
    def render(self, task: Task):
        if not task.fields.get("running", True):
            return Text("✓", style="green")
        return super().render(task)


class _Bar(BarColumn):
    def render(self, task: Task):
        return Text("") if task.total is None else super().render(task)


class _Count(ProgressColumn):
    def render(self, task: Task) -> Text:
        if task.total is None:
            return Text("")
        return Text(f"{int(task.completed)}/{int(task.total)}", style="progress.download")


class _Time(ProgressColumn):
    def render(self, task: Task) -> Text:
        if task.fields.get("kind") == "step":
            return Text(f"{_clock(task.elapsed)} eta {task.fields.get('eta', '-:--:--')}", style="progress.elapsed")
        seconds = task.fields["acc"]
        if task.fields["running"]:
            seconds += time.perf_counter() - task.fields["entered"]
        return Text(format_seconds(seconds), style="progress.elapsed")


class PhaseHandle:
    """What ``ConsoleView.phase`` yields: report progress within the phase (no-op unless live)."""

    def __init__(self, progress: Optional[Progress] = None, task: Optional[TaskID] = None):
        self._progress = progress
        self._task = task

    def advance(self, n: float = 1) -> None:
        if self._progress is not None:
            self._progress.update(self._task, advance=n)

    def set_total(self, n: float) -> None:
        if self._progress is not None:
            self._progress.update(self._task, total=n)


class ConsoleView:
    """See the module docstring. ``live`` defaults to whether the console is a terminal;
    ``console`` is injectable (tests, or a shared rich Console). ``step`` counts completed steps:
    the bar starts at ``start_step``/``total_steps`` and ``step_done(k)`` moves it to k."""

    def __init__(self, total_steps: int, *, enabled: bool, live: Optional[bool] = None, start_step: int = 0,
                 console: Optional[Console] = None):
        self.total_steps = total_steps
        self.enabled = enabled
        self._start_step = start_step
        self._t0 = time.perf_counter()
        self._progress: Optional[Progress] = None
        self._phases: dict[str, TaskID] = {}
        self._acc: dict[str, float] = {}
        if not enabled:
            self.live = False
            return
        console = console if console is not None else Console()
        self.live = console.is_terminal if live is None else live
        if self.live:
            self._progress = Progress(
                _Status(finished_text="✓"), TextColumn("{task.description:<12}", markup=False), _Bar(bar_width=32),
                _Count(), _Time(), console=console, refresh_per_second=4,
            )
            self._step_task = self._progress.add_task("step", total=total_steps, completed=start_step, kind="step")
            self._progress.start()

    @contextmanager
    def phase(self, name: str, total: Optional[int] = None) -> Iterator[PhaseHandle]:
        """A row for phase ``name`` while its body runs; entering it again in the same step reuses
        the row and adds to its time."""
        if self._progress is None:
            yield PhaseHandle()
            return
        entered = time.perf_counter()
        acc = self._acc.get(name, 0.0)
        fields = dict(kind="phase", acc=acc, running=True, entered=entered)
        task = self._phases.get(name)
        if task is None:
            task = self._phases[name] = self._progress.add_task(name, total=total, **fields)
        else:
            self._progress.reset(task, total=total, completed=0, **fields)
        try:
            yield PhaseHandle(self._progress, task)
        finally:
            self._acc[name] = acc + time.perf_counter() - entered
            self._progress.update(task, running=False, acc=self._acc[name])

    def _eta(self, step: int) -> Optional[float]:
        done = step - self._start_step
        if done <= 0 or step >= self.total_steps:
            return None
        return (time.perf_counter() - self._t0) / done * (self.total_steps - step)

    def step_done(self, step: int, metrics: Mapping[str, float], keys: Sequence[str], show: bool = True) -> None:
        """Advance the step bar, clear the phase rows and, with ``show``, print the step line."""
        if not self.enabled:
            return
        eta = self._eta(step)
        line = format_step_line(step, self.total_steps, metrics, keys, eta)
        if self._progress is None:
            if show:
                print(line, flush=True)
            return
        for task in self._phases.values():
            self._progress.remove_task(task)
        self._phases.clear()
        self._acc.clear()
        self._progress.update(self._step_task, completed=step, eta=_clock(eta))
        if show:
            self._progress.console.print(line, markup=False, highlight=False)

    def log(self, message: str) -> None:
        """Any other message, printed above the bars (as plain text: no rich markup)."""
        if not self.enabled:
            return
        if self._progress is None:
            print(message, flush=True)
        else:
            self._progress.console.print(message, markup=False, highlight=False)

    def warn(self, message: str) -> None:
        """A warning: ``WARNING: message``, shown also with the console view off (on stderr then),
        since what it says changes what the run computes."""
        if self._progress is not None:
            self._progress.console.print(f"WARNING: {message}", markup=False, highlight=False)
        else:
            print(f"WARNING: {message}", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Stop the live display (leaves the final bars on screen). Idempotent."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __enter__(self) -> "ConsoleView":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
