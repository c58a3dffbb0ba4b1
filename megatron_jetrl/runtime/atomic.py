"""Atomic file replacement: a reader (or a resumed job) sees the old file or the new one, never half.

The recipe is the POSIX one: write a temporary file in the same directory, fsync it, ``os.replace``
it over the target (atomic within one filesystem), then fsync the directory so the rename itself
survives a power loss. Temporary names end in ``.tmp`` so ``RunCheckpoints.clean_stale`` sweeps
those a crash left behind.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Union


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
