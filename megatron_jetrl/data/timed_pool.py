"""A pool of worker processes that runs one function per item under a wall-clock limit.

Answer checking parses untrusted model output; a pathological input can make a parser run for
minutes in C code that no signal interrupts. So each check runs in a worker process:

- inside the worker, ``SIGALRM`` fires after ``time_limit_s`` and ends the call (cheap: the worker
  survives);
- the parent gives each item ``time_limit_s + grace_s`` from the moment an idle worker received it
  and kills the worker when that passes (the backstop for code the alarm cannot interrupt), then
  starts a replacement. A worker that dies (crash, OOM) costs its item an ``error``; nothing raises
  for a bad item.

Workers are started with ``spawn`` (safe after CUDA is initialised in the parent), are daemonic,
and exit when the parent goes away. A worker's start-up (interpreter, imports, ``initializer``)
does not count against any item's limit. Stdlib only, so workers start fast.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Optional, Sequence

OK, TIMEOUT, ERROR = "ok", "timeout", "error"
_READY = "ready"
_STARTUP_HINT = ("see its traceback above; spawned workers re-import the main script, which therefore needs an "
                 "`if __name__ == '__main__':` guard")


@dataclass(frozen=True)
class Outcome:
    """What became of one item: ``status`` is ``ok`` (``value`` holds the result), ``timeout`` or
    ``error`` (``error`` says what)."""

    status: str
    value: Any = None
    error: str = ""


class _TimeLimit(BaseException):
    """Raised by the worker's SIGALRM handler; a BaseException so ``except Exception`` in the
    checked code cannot swallow it."""


def _on_alarm(signum, frame):
    raise _TimeLimit()


def _worker_main(conn: Connection, fn: Callable, initializer: Optional[Callable], time_limit_s: float) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if initializer is not None:
        initializer()
    signal.signal(signal.SIGALRM, _on_alarm)
    conn.send(_READY)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        index, args = msg
        try:
            try:
                signal.setitimer(signal.ITIMER_REAL, time_limit_s)
                reply = (index, OK, fn(*args), "")
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _TimeLimit:
            reply = (index, TIMEOUT, None, "")
        except BaseException as e:  # untrusted input: any failure is this item's outcome, not the worker's end
            reply = (index, ERROR, None, f"{type(e).__name__}: {e}"[:500])
        conn.send(reply)


class _Worker:
    def __init__(self, ctx, fn, initializer, time_limit_s: float):
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child, fn, initializer, time_limit_s), daemon=True)
        self.proc.start()
        child.close()
        self.ready = False
        self.job: Optional[int] = None
        self.deadline = 0.0

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class TimedPool:
    """``map(calls)`` runs ``fn(*call)`` for every call tuple and returns one ``Outcome`` each, in
    order. ``fn`` and ``initializer`` must be importable module-level functions (spawn pickles them
    by name); ``initializer`` runs once per worker before it takes work (e.g. heavy imports).
    Started lazily on the first ``map``; ``close()`` (or leaving the ``with`` block) stops it."""

    def __init__(self, fn: Callable, *, workers: int, time_limit_s: float, grace_s: float = 1.0,
                 initializer: Optional[Callable] = None, start_timeout_s: float = 120.0):
        if workers < 1:
            raise ValueError(f"workers must be >= 1; got {workers}")
        if not time_limit_s > 0 or grace_s < 0:
            raise ValueError(f"time_limit_s must be > 0 and grace_s >= 0; got {time_limit_s}, {grace_s}")
        self.fn, self.initializer = fn, initializer
        self.num_workers, self.time_limit_s, self.grace_s = workers, time_limit_s, grace_s
        self.start_timeout_s = start_timeout_s
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker] = []
        self.restarts = 0
        """Workers killed and replaced so far (timeouts past the alarm, crashes)."""

    def __enter__(self) -> "TimedPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _spawn(self) -> _Worker:
        return _Worker(self._ctx, self.fn, self.initializer, self.time_limit_s)

    def _await_ready(self, workers: Sequence[_Worker]) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        pending = [w for w in workers if not w.ready]
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"{len(pending)} check worker(s) did not start within {self.start_timeout_s} s")
            for conn in wait([w.conn for w in pending], timeout=left):
                w = next(w for w in pending if w.conn is conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    w.proc.join(timeout=5)
                    raise RuntimeError(f"a check worker exited while starting (exit code {w.proc.exitcode}): its "
                                       f"imports or initializer failed ({_STARTUP_HINT})") from None
                if msg != _READY:
                    raise RuntimeError(f"a starting check worker sent {msg!r} instead of {_READY!r}")
                w.ready = True
            pending = [w for w in pending if not w.ready]

    def _replace(self, w: _Worker) -> _Worker:
        w.kill()
        self.restarts += 1
        fresh = self._spawn()
        self._workers[self._workers.index(w)] = fresh
        return fresh

    def map(self, calls: Sequence[tuple]) -> list[Outcome]:
        try:
            return self._map(calls)
        except BaseException:
            self.close()
            raise

    def _map(self, calls: Sequence[tuple]) -> list[Outcome]:
        if not calls:
            return []
        if not self._workers:
            self._workers = [self._spawn() for _ in range(self.num_workers)]
        self._await_ready(self._workers)
        results: list[Optional[Outcome]] = [None] * len(calls)
        todo = deque(range(len(calls)))
        while todo or any(w.job is not None for w in self._workers):
            for w in list(self._workers):
                if todo and w.ready and w.job is None:
                    index = todo.popleft()
                    try:
                        w.conn.send((index, tuple(calls[index])))
                    except (BrokenPipeError, OSError):
                        todo.appendleft(index)
                        self._replace(w)
                        continue
                    w.job, w.deadline = index, time.monotonic() + self.time_limit_s + self.grace_s
            busy = [w for w in self._workers if w.job is not None]
            starting = [w for w in self._workers if not w.ready]
            if starting and not busy:
                self._await_ready(starting)
                continue
            timeout = max(0.0, min(w.deadline for w in busy) - time.monotonic()) if busy else None
            ready_conns = wait([w.conn for w in busy + starting], timeout=timeout)
            for w in list(busy + starting):
                if w.conn not in ready_conns:
                    continue
                try:
                    msg = w.conn.recv()
                except (EOFError, OSError):
                    if w.job is None:
                        raise RuntimeError(f"a check worker exited while starting: its imports or initializer "
                                           f"failed ({_STARTUP_HINT})") from None
                    code = w.proc.exitcode
                    results[w.job] = Outcome(ERROR, error=f"check worker died (exit code {code})")
                    self._replace(w)
                    continue
                if msg == _READY:
                    w.ready = True
                    continue
                index, status, value, error = msg
                results[index] = Outcome(status, value, error)
                w.job = None
            now = time.monotonic()
            for w in list(self._workers):
                if w.job is not None and now >= w.deadline:
                    results[w.job] = Outcome(TIMEOUT, error="killed past the time limit")
                    self._replace(w)
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    def close(self) -> None:
        """Stops every worker (politely, then by force); the pool can be used again afterwards."""
        for w in self._workers:
            try:
                w.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 1.0
        for w in self._workers:
            w.proc.join(timeout=max(0.0, deadline - time.monotonic()))
            w.kill()
        self._workers = []
