"""Hugging Face checkpoint files: lazy sharded-safetensors reading and streaming, atomic writing.

Reading returns one tensor (or a row range of one) at a time with positioned reads, not a memory
map: a converter then holds only what it asked for, and its RSS shows exactly that (pages of a
mapped file count as resident once touched). Writing streams too: the tensors to write are planned
up front (names, dtypes, shapes), so shard headers are known before any data and each tensor goes
to disk as it arrives; everything is written inside a temporary directory that replaces the
output only when complete.
"""

from __future__ import annotations

import glob
import json
import os
import shlex
import shutil
import socket
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from megatron_jetrl.config import CheckpointError, HfCheckpointError  # noqa: F401  (CheckpointError: the tools catch it here)
from megatron_jetrl.runtime.atomic import human_size, space_errno, space_problem, tree_bytes

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
           "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
"""safetensors dtype codes this reader reads; which of them a tensor may have is the caller's check."""


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; a ``CheckpointError`` naming the file when it is not one."""
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HfCheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise HfCheckpointError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


class SafetensorsFile:
    """One .safetensors file: header parsed once, tensors read with pread."""

    MAX_HEADER_BYTES = 100_000_000
    """safetensors' own limit."""

    def __init__(self, path: Path):
        self.path = path
        size = path.stat().st_size
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or not 2 <= n <= min(self.MAX_HEADER_BYTES, size - 8):
                raise HfCheckpointError(f"{path}: not a safetensors file (its header claims {n} bytes; the file has "
                                      f"{size}): truncated or corrupt, download or convert it again")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise HfCheckpointError(f"{path}: the safetensors header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise HfCheckpointError(f"{path}: the safetensors header is not a JSON object")
        header.pop("__metadata__", None)
        self.header: dict[str, Any] = header
        self.data_start = 8 + n
        data_bytes = size - self.data_start
        for name, h in header.items():
            try:
                begin, end = (int(x) for x in h["data_offsets"])
                shape = [int(x) for x in h["shape"]]
                dtype = h["dtype"]
            except (KeyError, TypeError, ValueError):
                raise HfCheckpointError(f"{path}: tensor {name!r} has a malformed header entry {h!r}") from None
            if not 0 <= begin <= end:
                raise HfCheckpointError(f"{path}: tensor {name!r} has data offsets [{begin}, {end}]")
            if end > data_bytes:
                raise HfCheckpointError(f"{path}: the file is truncated: tensor {name!r} ends at byte {end} of the "
                                      f"data, the file holds {data_bytes}; download or convert it again")
            if dtype in _DTYPES:
                want = _nbytes(_DTYPES[dtype], tuple(shape))
                if end - begin != want:
                    raise HfCheckpointError(f"{path}: tensor {name!r} ({dtype} {shape}) needs {want} bytes; its header "
                                          f"gives {end - begin}")

    def keys(self) -> list[str]:
        return list(self.header)

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor ``name``, or only its rows [r0, r1) (rows are contiguous in a row-major file)."""
        h = self.header[name]
        if h["dtype"] not in _DTYPES:
            raise HfCheckpointError(f"{self.path}: tensor {name!r} has dtype {h['dtype']}, which this reader does not "
                                  f"read (it reads {', '.join(_DTYPES)})")
        dtype, shape = _DTYPES[h["dtype"]], list(h["shape"])
        begin, end = h["data_offsets"]
        if rows is not None:
            row_bytes = (end - begin) // shape[0] if shape and shape[0] else 0
            begin, end = begin + rows[0] * row_bytes, begin + rows[1] * row_bytes
            shape[0] = rows[1] - rows[0]
        buf = bytearray(end - begin)
        view, done = memoryview(buf), 0
        with open(self.path, "rb", buffering=0) as f:
            while done < len(buf):
                got = os.preadv(f.fileno(), [view[done:]], self.data_start + begin + done)
                if got <= 0:
                    raise HfCheckpointError(f"{self.path}: file ends inside tensor {name!r}")
                done += got
        if not buf:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(shape)


class HFCheckpoint:
    """Read access to an HF model directory (config.json + safetensors, sharded or not)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise HfCheckpointError(f"HF checkpoint directory {self.path} does not exist")
        config_path = self.path / "config.json"
        if not config_path.is_file():
            raise HfCheckpointError(f"{self.path} has no config.json; is it a Hugging Face model directory?")
        self.config: dict[str, Any] = read_json(config_path)
        index = self.path / INDEX
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise HfCheckpointError(f"{index}: has no \"weight_map\" object")
            self.weight_map: dict[str, str] = weight_map
        elif (self.path / SINGLE).is_file():
            self.weight_map = {name: SINGLE for name in SafetensorsFile(self.path / SINGLE).keys()}
        else:
            raise HfCheckpointError(f"{self.path} has neither {INDEX} nor {SINGLE}")
        for shard in sorted(set(self.weight_map.values())):
            if not (self.path / shard).is_file():
                raise HfCheckpointError(f"{self.path}/{INDEX} lists shard {shard}, which does not exist")
        self._files: dict[str, SafetensorsFile] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _file(self, name: str) -> SafetensorsFile:
        shard = self.weight_map.get(name)
        if shard is None:
            raise HfCheckpointError(f"HF checkpoint {self.path} has no tensor {name!r}")
        if shard not in self._files:
            self._files[shard] = SafetensorsFile(self.path / shard)
        if name not in self._files[shard].header:
            raise HfCheckpointError(f"{self.path}/{shard} has no tensor {name!r}, though the index lists it there")
        return self._files[shard]

    def get(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor ``name`` (or its rows [r0, r1)), read from disk now."""
        return self._file(name).read(name, rows)

    def shape(self, name: str) -> tuple[int, ...]:
        """From the safetensors header; reads no data."""
        return tuple(self._file(name).header[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        """From the safetensors header; reads no data."""
        code = self._file(name).header[name]["dtype"]
        if code not in _DTYPES:
            raise HfCheckpointError(f"{self.path}: tensor {name!r} has dtype {code}, which this reader does not read "
                                  f"(it reads {', '.join(_DTYPES)})")
        return _DTYPES[code]

    def copy_side_files(self, out: Path) -> list[str]:
        """Tokenizer and generation files next to the weights, copied to ``out``."""
        copied = []
        for name in TOKENIZER_FILES:
            if (self.path / name).is_file():
                shutil.copy2(self.path / name, out / name)
                copied.append(name)
        return copied


class StreamingSafetensorsWriter:
    """Writes a sharded safetensors checkpoint whose tensors (names, dtypes, shapes, order) are
    planned up front, so each tensor's bytes go to disk as it arrives and nothing is buffered.

    The plan is split into shards of at most ``max_shard_bytes`` in order; each shard's header is
    written when its first tensor arrives. ``add`` must follow the plan's order. Use it in a
    ``with`` block, which closes the open shard however the block ends.
    """

    def __init__(self, directory: Path, plan: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 max_shard_bytes: int = 5 * 2**30):
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive; got {max_shard_bytes}")
        names = [name for name, _, _ in plan]
        if len(set(names)) != len(names):
            raise ValueError("the plan names a tensor twice")
        self.directory = directory
        self.plan = plan
        self.shards: list[list[int]] = [[]]
        size = 0
        for i, (_, dtype, shape) in enumerate(plan):
            nbytes = _nbytes(dtype, shape)
            if self.shards[-1] and size + nbytes > max_shard_bytes:
                self.shards.append([])
                size = 0
            self.shards[-1].append(i)
            size += nbytes
        n = len(self.shards)
        self.files = [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
        self.total_bytes = sum(_nbytes(d, s) for _, d, s in plan)
        self._next = 0
        self._shard = -1
        self._stream = None

    def __enter__(self) -> "StreamingSafetensorsWriter":
        return self

    def __exit__(self, *exc) -> None:
        """Closes the open shard, on an error too: a partial shard removed while still open keeps
        its disk space (on a full disk, the space the error message reports as free)."""
        self._close()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self.plan):
            raise ValueError(f"tensor {name} is not in the plan (all {len(self.plan)} already written)")
        want_name, want_dtype, want_shape = self.plan[self._next]
        if (name, tensor.dtype, tuple(tensor.shape)) != (want_name, want_dtype, want_shape):
            raise ValueError(f"expected {want_name} {want_dtype} {list(want_shape)} next; got {name} "
                             f"{tensor.dtype} {list(tensor.shape)}")
        shard = next(k for k, idx in enumerate(self.shards) if self._next in idx)
        if shard != self._shard:
            self._open(shard)
        data = tensor.detach().contiguous().cpu()
        if data.numel():
            self._stream.write(data.view(torch.uint8).reshape(-1).numpy())  # buffer protocol: no copy
        self._next += 1

    def _open(self, shard: int) -> None:
        self._close()
        header, offset = {}, 0
        for i in self.shards[shard]:
            name, dtype, shape = self.plan[i]
            end = offset + _nbytes(dtype, shape)
            header[name] = {"dtype": _ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
            offset = end
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._stream = open(self.directory / self.files[shard], "wb")
        self._stream.write(len(raw).to_bytes(8, "little") + raw)
        self._shard = shard

    def _close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def finish(self) -> None:
        """Checks every planned tensor was written and writes the index."""
        self._close()
        if self._next != len(self.plan):
            raise ValueError(f"{len(self.plan) - self._next} planned tensors were not written, "
                             f"first {self.plan[self._next][0]}")
        weight_map = {self.plan[i][0]: self.files[k] for k, idx in enumerate(self.shards) for i in idx}
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")


_ST_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = dtype.itemsize
    for s in shape:
        n *= s
    return n


_OWNER = ".owner"
"""In a temporary output directory: ``host pid`` of the process writing it; removed once the
directory is complete, just before the swap."""


class NoSpaceError(OSError):
    """Writing an output ran out of disk space or quota; the message names the output, what was
    written and what is free, and the fix. ``atomic_output_dir`` raises it in place of the error
    the writer hit, which often hides the errno: torch.save reports a full disk as a zip-position
    mismatch, torch.distributed.checkpoint wraps it in a multi-traceback CheckpointException."""


def _no_space(out: Path, code: int, written: int) -> NoSpaceError:
    free = shutil.disk_usage(out.parent).free
    what, fix = space_problem(code)
    return NoSpaceError(f"{what} while writing {out} ({human_size(written)} written, now removed; {human_size(free)} "
                        f"free at {out.parent}): {fix} or choose another --out-dir")


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():  # a directory named after this process is a dead namesake's: nothing made it yet
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def recover_stale_outputs(out: Path) -> list[str]:
    """Clean up after writers of ``out`` that were killed (no cleanup ran); returns one line per
    action, and per directory left alone, for the user.

    ``atomic_output_dir`` keeps two invariants: a ``.NAME.tmp-PID`` directory is disposable (a
    partial output, a finished one not yet swapped in, or the previous output being deleted after
    the swap), and a ``.NAME.old-PID`` directory is the complete previous output, moved aside for
    the moment between the two renames of the swap. So for a writer on this host that no longer
    runs: its ``.tmp-PID`` is removed; its ``.old-PID`` is removed if ``out`` exists (the swap
    finished) and renamed back to ``out`` if not (the swap was cut in half: the killed run never
    took effect). Directories of live writers, or of writers on other hosts (whose processes this
    host cannot check; the ``.owner`` file names the host), are named with the command that
    removes them, and left alone.
    """
    if not out.parent.is_dir():
        return []
    host = socket.gethostname()
    by_pid: dict[int, dict[str, Path]] = {}
    for kind in ("tmp", "old"):
        for path in out.parent.glob(f".{glob.escape(out.name)}.{kind}-*"):
            pid_text = path.name.rpartition("-")[2]
            if path.is_dir() and not path.is_symlink() and pid_text.isdigit():
                by_pid.setdefault(int(pid_text), {})[kind] = path
    lines = []
    for pid, paths in sorted(by_pid.items()):
        tmp, old = paths.get("tmp"), paths.get("old")
        owner = _read_owner(tmp) if tmp is not None else None
        owner_host = owner or host  # none yet, or removed before the swap: written on this host
        if owner_host != host or _pid_alive(pid):
            writer = (f"process {pid} on this host, which is running" if owner_host == host else
                      f"process {pid} on host {owner_host}, which this host cannot check")
            for path in paths.values():
                lines.append(f"note: left {path} alone: it was written by {writer}; if that is no conversion "
                             f"writing {out} now, remove it: rm -rf {shlex.quote(str(path))}")
            continue
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            lines.append(f"removed {tmp}, the partial output of a conversion that was killed (pid {pid})")
        if old is None:
            continue
        if out.exists():
            shutil.rmtree(old, ignore_errors=True)
            lines.append(f"removed {old}, the previous output, which a conversion killed after replacing it "
                         f"(pid {pid}) had not yet deleted")
        else:
            os.replace(old, out)
            lines.append(f"restored {out} from {old}: a conversion replacing it (pid {pid}) was killed between "
                         "moving it aside and moving the new output in, so the previous output stands")
    return lines


def _read_owner(directory: Path) -> str | None:
    """The host named in ``directory``'s owner file; None when it has none (or an unreadable one)."""
    try:
        fields = (directory / _OWNER).read_text().split()
    except (OSError, UnicodeDecodeError):
        return None
    return fields[0] if fields else None


def check_output_dir(out: str | os.PathLike, inputs: tuple[str | os.PathLike, ...] = ()) -> Path:
    """``out`` as a path a converter may replace: not the working directory or a parent of it,
    neither an input nor a directory holding one (replacing it would delete the input), not a file
    or a symlink (the swap would move it aside and fail to delete it), and under a writable
    directory (the nearest one that exists), so a bad --out-dir fails before any conversion work."""
    out_path = Path(out)
    resolved = out_path.resolve()
    if resolved == Path.cwd().resolve() or resolved in Path.cwd().resolve().parents:
        raise ValueError(f"--out-dir {out} is the working directory or holds it; name a new directory")
    for source in inputs:
        src = Path(source).resolve()
        if resolved == src or resolved in src.parents:
            raise ValueError(f"--out-dir {out} is the input {source} or holds it; writing there would replace "
                             "the input: name another directory")
    if out_path.is_symlink():
        raise ValueError(f"--out-dir {out} is a symbolic link (to {resolved}); name the directory itself, or another")
    if out_path.exists() and not out_path.is_dir():
        raise ValueError(f"--out-dir {out} exists and is not a directory; name another path, or remove it first")
    base = next(p for p in out_path.parents if os.path.lexists(p))
    if not base.is_dir():
        raise ValueError(f"--out-dir {out}: {base} is a file, not a directory; name a path under a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ValueError(f"--out-dir {out}: {base} is not writable (permissions, or a read-only file system); "
                         "name a directory you can write to")
    return out_path


@contextmanager
def atomic_output_dir(out: str | os.PathLike, *, force: bool,
                      inputs: tuple[str | os.PathLike, ...] = ()) -> Iterator[Path]:
    """A temporary directory ``.NAME.tmp-PID`` next to ``out`` that becomes ``out`` only if the block
    succeeds.

    Refuses an ``out`` that is the working directory, an input, a file or a symlink, or not under a
    writable directory (``check_output_dir``). Before anything else, what killed writers left next
    to ``out`` is cleaned up and reported (``recover_stale_outputs``), so a run that then refuses
    leaves no hidden partial directory behind, and a swap cut in half is rolled back: ``out`` is
    the previous complete output again (back, not forward: nothing then replaces an output without
    this run's ``force``, and the user sees the state the killed run started from). Then an
    existing ``out`` is refused unless ``force`` ("pass --force to replace it").

    With ``force``, the old ``out`` is replaced only after the new one is complete: ``out`` is
    renamed to ``.NAME.old-PID``, the new directory to ``out``, and the old one to ``.NAME.tmp-PID``
    before it is deleted, so an ``.old-`` directory always holds a complete output and a ``.tmp-``
    one never needs keeping. On any error the temporary directory, and the parents of ``out`` this
    run created, are removed and ``out`` is untouched; a directory that cannot be created is a
    ``ValueError`` naming --out-dir; a full disk or quota (ENOSPC, EDQUOT, also when wrapped or
    hidden by the writer) becomes a ``NoSpaceError`` naming the output, the bytes written and the
    space left.
    """
    out = check_output_dir(out, inputs)
    for line in recover_stale_outputs(out):
        print(line, file=sys.stderr)
    if out.exists() and not force:
        raise FileExistsError(f"output {out} already exists; pass --force to replace it")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    created: list[Path] = []
    try:
        for parent in [p for p in reversed(out.parents) if not os.path.lexists(p)]:
            parent.mkdir()
            created.append(parent)
        tmp.mkdir()
        (tmp / _OWNER).write_text(f"{socket.gethostname()} {os.getpid()}\n")
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(created)
        raise ValueError(f"--out-dir {out}: cannot create {e.filename or tmp} ({e.strerror}); name a directory "
                         "you can write to") from None
    try:
        yield tmp
        if out.exists() and not force:
            raise FileExistsError(f"output {out} appeared while converting (another conversion?); it was left "
                                  "as it is: pass --force to replace it")
        (tmp / _OWNER).unlink()
    except BaseException as e:
        written = tree_bytes(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        code = space_errno(e)
        error = _no_space(out, code, written) if code is not None else None
        _remove_empty(created)
        if error is not None:
            raise error from e
        raise
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    replacing = out.exists()
    if replacing:
        os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:
        if replacing:
            os.replace(old, out)
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(created)
        raise
    if replacing:
        os.replace(old, tmp)
        shutil.rmtree(tmp)


def _remove_empty(created: list[Path]) -> None:
    """Remove the parent directories ``atomic_output_dir`` created (outermost first in ``created``),
    deepest first, while they are empty: a failed run leaves no new directories behind."""
    for directory in reversed(created):
        try:
            directory.rmdir()
        except OSError:
            return
