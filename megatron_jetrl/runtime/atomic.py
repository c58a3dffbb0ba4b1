"""Atomic file replacement: a reader (or a resumed job) sees the old file or the new one, never half.

The recipe is the POSIX one: write a temporary file in the same directory, fsync it, ``os.replace``
it over the target (atomic within one filesystem), then fsync the directory so the rename itself
survives a power loss. Temporary names end in ``.tmp`` so ``RunCheckpoints.clean_stale`` sweeps
those a crash left behind.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any, Optional, Union


def fsync_dir(path: Path) -> None:
    """Persist a directory's entries (a rename or a new file inside it)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: Union[bytes, str]) -> None:
    """Replace ``path`` with ``data`` atomically (str is written as UTF-8)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    payload = data.encode("utf-8") if isinstance(data, str) else data
    with open(tmp, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def save_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON, atomically.

    Non-finite floats are written as Python's ``NaN``/``Infinity`` (``json.load`` reads them back;
    strict JSON parsers do not): this is for the project's own state files, where refusing to save
    a checkpoint because one metric was NaN would be worse. ``metrics.jsonl`` is strict JSON.
    """
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def space_errno(error: BaseException) -> Optional[int]:
    """ENOSPC or EDQUOT if ``error`` is, or was raised while handling, an OSError with that errno.
    Writers often hide it: torch.save reports a full disk as a zip-position mismatch, and
    torch.distributed.checkpoint wraps it in a CheckpointException."""
    seen: set[int] = set()
    stack: list[Optional[BaseException]] = [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return e.errno
        stack += [e.__cause__, e.__context__]
        # torch.distributed.checkpoint's CheckpointException keeps each rank's failure, not as a cause
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for failure in failures.values():
                stack.append(failure[0] if isinstance(failure, tuple) else failure)
    return None


def space_problem(code: int) -> tuple[str, str]:
    """What a space errno means and its fix: ("no space left on device", "free space")."""
    if code == errno.ENOSPC:
        return "no space left on device", "free space"
    return "disk quota exceeded", "free space within your quota"


def tree_bytes(path: Path) -> int:
    """The bytes of the files under ``path`` (0 when it is gone)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def human_size(nbytes: int) -> str:
    """``1.5 GiB`` / ``12.0 MiB`` / ``8 KiB``."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.1f} GiB"
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes // 2**10} KiB"
