"""Run checkpoints (the step directories of ``run.dir``) that a crash can never leave half-published.

Layout under ``run_dir/checkpoints/``::

    step_00000100/            a complete checkpoint: whatever the trainer wrote, plus COMPLETE
      COMPLETE                JSON {step, world_size, time}; written last, fsynced
      actor/ trainer_state.json rng/rank_00000.pt ...   (the trainer's content, not this module's)
    step_00000200.tmp/        staging for a checkpoint being written (or one a crash abandoned)
    latest                    one line: the name of the newest committed step directory

The protocol, ``save(step, write, any_rank=...)`` run by every rank (SPMD) on a filesystem all ranks
share, the ranks agreeing after each phase (``any_rank``, a collective):

1. rank 0 makes a fresh ``step_XXXXXXXX.tmp/`` (a stale one is removed);
2. every rank writes into it (``write(staging)``);
3. rank 0 writes ``COMPLETE``, renames ``.tmp`` to the final name (atomic), rewrites ``latest``
   atomically and prunes old checkpoints.

A step directory without ``.tmp`` exists only after its contents and ``COMPLETE`` were durable, and
``latest`` is only ever replaced whole, so an exception or a kill at any point leaves ``latest()``
returning the last complete checkpoint. Each writer is responsible for the durability of its own
files (``torch.distributed.checkpoint`` fsyncs by default; ``save_rng`` and ``save_json_atomic``
do); ``COMPLETE`` says "every rank returned from writing", not "every byte is on disk".

Collective methods (``save``, ``clean_stale``) must be called by every rank. ``save`` agrees on
failures across ranks: a phase that fails on any rank (a full disk, a quota, a directory turned
read-only) removes the staging directory and raises ``RunSaveError`` on every rank, with the
complete checkpoints untouched. A process killed in any phase leaves at most a staging directory
(or a complete step ``latest`` does not name yet): nothing half-written is published.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

from torch.distributed.checkpoint.api import CheckpointException

from megatron_jetrl.config import ConfigError, RunCheckpointError
from megatron_jetrl.runtime.atomic import (fsync_dir, human_size, save_json_atomic, space_errno, space_problem,
                                          tree_bytes, write_atomic)

logger = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
LATEST = "latest"
_STEP_RE = re.compile(r"^step_(\d{8,})$")


class RunSaveError(OSError):
    """Saving a run checkpoint failed (on this rank when ``local``, else on another); nothing of it
    was kept and the earlier checkpoints are as they were. The message names the directory, the
    cause and the fix in one line."""

    def __init__(self, message: str, *, local: bool):
        super().__init__(message)
        self.local = local

    def __str__(self) -> str:
        return self.args[0]


def pointer_problem(root: Path) -> Optional[ConfigError]:
    """A ``latest`` under ``root`` (a ``checkpoints`` directory) that the next save could not replace
    (a directory, say): the error naming it and the fix, else None. Checked before a run starts."""
    pointer = Path(root) / LATEST
    if os.path.lexists(pointer) and not pointer.is_file():
        kind = "a directory" if pointer.is_dir() else "not a regular file"
        return ConfigError("run.dir", str(root.parent), f"{pointer} is {kind}, where jetrl keeps the name of the "
                           "newest checkpoint: move it away (the step_* directories are what resuming reads)")
    return None


def resume_refused(run_dir: Path, latest: Path) -> ConfigError:
    """The error of a fresh start (``run.resume`` false) in a run directory that has checkpoints."""
    return ConfigError("run.resume", False, f"{run_dir} has checkpoints ({latest.name}); use a new run.dir, or "
                       "run.resume=true to continue")


class RunCheckpoints:
    """The save protocol for ``run_dir/checkpoints`` (see the module docstring).

    ``barrier`` is ``torch.distributed.barrier`` in a job (or ``lambda: None`` in one process);
    ``keep_last`` >= 1 complete checkpoints survive each save.
    """

    def __init__(self, run_dir: Path, keep_last: int, rank: int, world_size: int,
                 barrier: Callable[[], None]):
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last must be an integer >= 1, got {keep_last!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last
        self.rank = rank
        self.world_size = world_size
        self._barrier = barrier
        self._warned: Optional[str] = None

    def step_dir(self, step: int) -> Path:
        """Where the complete checkpoint of ``step`` lives (whether or not it exists)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        return self.root / f"step_{step:08d}"

    @staticmethod
    def step_of(path: Path) -> int:
        """The step a checkpoint directory holds: ``step_00000100`` -> 100."""
        m = _STEP_RE.match(Path(path).name)
        if m is None:
            raise ValueError(f"{path} is not a step directory (step_XXXXXXXX)")
        return int(m.group(1))

    def _staging(self, step: int) -> Path:
        return self.step_dir(step).with_name(self.step_dir(step).name + ".tmp")

    def save(self, step: int, write: Callable[[Path], object], *, any_rank: Callable[[bool], bool]) -> Path:
        """Collective. The checkpoint of ``step``: a fresh staging directory, ``write(staging)`` on
        every rank, then published (``_publish``); returns the final directory. ``any_rank`` reduces
        a flag over all ranks (``signals.any_rank``); it is how the ranks agree after each phase.

        When a phase fails on any rank, rank 0 removes the staging directory and every rank raises
        ``RunSaveError`` (the failing rank's names its cause: no space, quota, an unwritable
        path); the complete checkpoints are as they were. Any other exception (a bug) is re-raised
        as it is on the rank that hit it, after the others have raised ``RunSaveError``."""
        staging = self._staging(step)
        phases = [lambda: self._open_staging(step) if self.rank == 0 else None, lambda: write(staging),
                  lambda: self._publish(step) if self.rank == 0 else None]
        for phase in phases:
            error: Optional[BaseException] = None
            try:
                phase()
            except (Exception, CheckpointException) as e:  # dcp's CheckpointException is a BaseException
                error = e
            if any_rank(error is not None):
                written = 0
                if self.rank == 0:
                    written = tree_bytes(staging)
                    shutil.rmtree(staging, ignore_errors=True)
                failure = self._save_failed(step, error, written)
                if failure is error:
                    raise error
                raise failure from error
        return self.step_dir(step)

    def _save_failed(self, step: int, error: Optional[BaseException], written: int) -> BaseException:
        """The error ``save`` raises on this rank: its own cause in one line, or the other ranks'."""
        last = self.latest()
        resume = f"run the same command to continue from {last.name}" if last else "run the same command to start over"
        where = f"saving the checkpoint of step {step} in {self.root}"
        published = (self.step_dir(step) / COMPLETE).is_file()
        kept = "it was published all the same" if published else "nothing of it was kept"
        if error is None:
            return RunSaveError(f"{where} failed on another rank (its log says why); {kept}: {resume}", local=False)
        code = space_errno(error)
        if code is not None:
            what, fix = space_problem(code)
            free = shutil.disk_usage(self.root).free if self.root.is_dir() else 0
            wrote = f"{human_size(written)} written, removed; " if written >= 2**10 and not published else ""
            return RunSaveError(f"{what} while {where} ({wrote}{human_size(free)} free): {fix} (or move run.dir "
                                f"to a larger file system), then {resume}", local=True)
        if isinstance(error, OSError):
            name = f" {error.filename}" if error.filename else ""
            return RunSaveError(f"{where}: cannot write{name} ({error.strerror or error}); {kept}: make run.dir "
                                f"writable, then {resume}", local=True)
        return error

    def _open_staging(self, step: int) -> None:
        staging = self._staging(step)
        problem = pointer_problem(self.root)
        if problem is not None:
            raise problem
        self.root.mkdir(parents=True, exist_ok=True)
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir()
        fsync_dir(self.root)

    def _publish(self, step: int) -> None:
        """Publish the staging directory of ``step`` (rank 0). A complete checkpoint of the same step
        is replaced. Pruning keeps the ``keep_last`` newest complete checkpoints not newer than
        ``step``; newer ones can only be a future that was rolled back (``latest`` edited by hand to
        an older step) and are removed, so that neither the pointer nor the fallback scan can lead
        back to them."""
        staging, final = self._staging(step), self.step_dir(step)
        if not staging.is_dir():
            raise FileNotFoundError(f"{staging} does not exist: the staging directory went away while saving")
        save_json_atomic(staging / COMPLETE, {"step": step, "world_size": self.world_size, "time": time.time()})
        replaced = None
        if final.exists():
            replaced = final.with_name(final.name + ".replaced.tmp")
            if replaced.exists():
                shutil.rmtree(replaced)
            os.rename(final, replaced)
        os.rename(staging, final)
        fsync_dir(self.root)
        write_atomic(self.root / LATEST, final.name + "\n")
        self._prune(step)
        if replaced is not None:
            shutil.rmtree(replaced)

    def _complete_steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        steps = []
        for entry in self.root.iterdir():
            m = _STEP_RE.match(entry.name)
            if m and (entry / COMPLETE).is_file():
                steps.append(int(m.group(1)))
        return sorted(steps)

    def _prune(self, step: int) -> None:
        steps = self._complete_steps()
        older = [s for s in steps if s <= step]
        doomed = older[: max(0, len(older) - self.keep_last)] + [s for s in steps if s > step]
        for s in doomed:
            # Renamed first so a crash mid-rmtree cannot leave a half-deleted dir that looks complete.
            victim = self.step_dir(s)
            trash = victim.with_name(victim.name + ".deleting.tmp")
            os.rename(victim, trash)
            shutil.rmtree(trash)

    def latest(self) -> Optional[Path]:
        """The newest complete checkpoint, or None. Local (no collective).

        Follows ``latest`` when it names a complete step directory, which also lets a person roll
        a run back by editing it; otherwise (missing, unreadable, not UTF-8, garbage, pointing at a
        deleted or incomplete directory) the newest step directory holding ``COMPLETE``, with a
        warning from rank 0 naming the pointer when there was one. ``.tmp`` dirs are never chosen.
        """
        pointer = self.root / LATEST
        problem = None
        if pointer.is_file():
            try:
                name = pointer.read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as e:
                problem = f"cannot be read ({e})"
            else:
                if _STEP_RE.match(name) and (self.root / name / COMPLETE).is_file():
                    return self.root / name
                problem = f"names {name[:80]!r}, not a complete step directory"
        steps = self._complete_steps()
        found = self.step_dir(steps[-1]) if steps else None
        if problem is not None and self.rank == 0:
            warning = (f"{pointer} {problem}; falling back to the newest complete checkpoint: "
                       f"{found.name if found else 'there is none'}")
            if warning != self._warned:  # once, though a resume asks twice (latest, then candidates)
                logger.warning(warning)
                self._warned = warning
        return found

    def resume_point(self, resume: bool) -> Optional[Path]:
        """Collective. Start of a run: what a crash left is cleaned up (``clean_stale``), then the
        newest complete checkpoint to resume from, or None for a fresh start. ConfigError on
        ``run.resume`` when ``resume`` is false and there is one, or naming a ``latest`` that
        cannot be replaced (``pointer_problem``)."""
        problem = pointer_problem(self.root)
        if problem is not None:
            raise problem
        self.clean_stale()
        latest = self.latest()
        if latest is not None and not resume:
            raise resume_refused(self.root.parent, latest)
        return latest

    def restore_newest(self, restore: Callable[[Path], object], *, any_rank: Callable[[bool], bool],
                       warn: Callable[[Path, str], None], label: Callable[[Path], str] = lambda c: c.name) -> Path:
        """Collective. ``restore`` the newest checkpoint every rank can read (``candidates()`` order),
        and return it. One that fails on any rank (a file missing, truncated or corrupt) is passed
        to ``warn`` with its problem (``label(checkpoint): error``) and the one before it is tried;
        ``RunCheckpointError`` naming each checkpoint and its problem when none can be read."""
        problems = []
        for checkpoint in self.candidates():
            try:
                restore(checkpoint)
                problem = None
            except (Exception, CheckpointException) as e:  # dcp's CheckpointException is a BaseException
                problem = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            if not any_rank(problem is not None):
                return checkpoint
            problems.append(f"{label(checkpoint)}: {problem or 'unreadable on another rank'}")
            warn(checkpoint, problems[-1])
        raise RunCheckpointError(f"no checkpoint in {self.root} can be read ({'; '.join(problems)}); "
                              "move the broken ones away, or start over in a new run.dir")

    def candidates(self) -> list[Path]:
        """Complete checkpoints to resume from, best first: ``latest()``, then the older complete
        ones, newest first (to fall back on when one cannot be read). Local (no collective)."""
        first = self.latest()
        if first is None:
            return []
        return [first] + [self.step_dir(s) for s in reversed(self._complete_steps()) if s < self.step_of(first)]

    def clean_stale(self) -> list[Path]:
        """Collective. Rank 0 removes what a crash left: every ``*.tmp`` entry of ``checkpoints/``
        (staging dirs, half-pruned dirs, temp files of atomic writes). Call once at start, before
        ``latest()``. Step directories without ``COMPLETE`` are left alone (not this protocol's;
        ``latest()`` ignores them). Returns what rank 0 removed (empty on other ranks)."""
        removed = []
        if self.rank == 0 and self.root.is_dir():
            for entry in sorted(self.root.iterdir()):
                if entry.name.endswith(".tmp"):
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.rmtree(entry)
                    else:
                        entry.unlink()
                    removed.append(entry)
            if removed:
                fsync_dir(self.root)
        self._barrier()
        return removed
