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
import shutil
import socket
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

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


class CheckpointError(ValueError):
    """A checkpoint on disk is missing something or has the wrong shape; the message names it."""


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "F8_E4M3": torch.float8_e4m3fn, "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8}


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; a ``CheckpointError`` naming the file when it is not one."""
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(data).__name__}")
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
                raise CheckpointError(f"{path}: not a safetensors file (its header claims {n} bytes; the file has "
                                      f"{size}): truncated or corrupt, download or convert it again")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{path}: the safetensors header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
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
                raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry {h!r}") from None
            if not 0 <= begin <= end:
                raise CheckpointError(f"{path}: tensor {name!r} has data offsets [{begin}, {end}]")
            if end > data_bytes:
                raise CheckpointError(f"{path}: the file is truncated: tensor {name!r} ends at byte {end} of the "
                                      f"data, the file holds {data_bytes}; download or convert it again")
            if dtype in _DTYPES:
                want = _nbytes(_DTYPES[dtype], tuple(shape))
                if end - begin != want:
                    raise CheckpointError(f"{path}: tensor {name!r} ({dtype} {shape}) needs {want} bytes; its header "
                                          f"gives {end - begin}")

    def keys(self) -> list[str]:
        return list(self.header)

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor ``name``, or only its rows [r0, r1) (rows are contiguous in a row-major file)."""
        h = self.header[name]
        if h["dtype"] not in _DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {h['dtype']}")
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
                    raise CheckpointError(f"{self.path}: file ends inside tensor {name!r}")
                done += got
        if not buf:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(shape)


class HFCheckpoint:
    """Read access to an HF model directory (config.json + safetensors, sharded or not)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"HF checkpoint directory {self.path} does not exist")
        config_path = self.path / "config.json"
        if not config_path.is_file():
            raise CheckpointError(f"{self.path} has no config.json; is it a Hugging Face model directory?")
        self.config: dict[str, Any] = read_json(config_path)
        index = self.path / INDEX
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: has no \"weight_map\" object")
            self.weight_map: dict[str, str] = weight_map
        elif (self.path / SINGLE).is_file():
            self.weight_map = {name: SINGLE for name in SafetensorsFile(self.path / SINGLE).keys()}
        else:
            raise CheckpointError(f"{self.path} has neither {INDEX} nor {SINGLE}")
        for shard in sorted(set(self.weight_map.values())):
            if not (self.path / shard).is_file():
                raise CheckpointError(f"{self.path}/{INDEX} lists shard {shard}, which does not exist")
        self._files: dict[str, SafetensorsFile] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _file(self, name: str) -> SafetensorsFile:
        shard = self.weight_map.get(name)
        if shard is None:
            raise CheckpointError(f"HF checkpoint {self.path} has no tensor {name!r}")
        if shard not in self._files:
            self._files[shard] = SafetensorsFile(self.path / shard)
        if name not in self._files[shard].header:
            raise CheckpointError(f"{self.path}/{shard} has no tensor {name!r}, though the index lists it there")
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
            raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {code}")
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
    written when its first tensor arrives. ``add`` must follow the plan's order.
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
"""In a temporary output directory: ``host pid`` of the process writing it."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_outputs(out: Path) -> list[Path]:
    """Remove ``.NAME.tmp-PID`` / ``.NAME.old-PID`` directories next to ``out`` left by a writer on
    this host that no longer runs (a conversion killed before it could clean up); returns them.
    Directories of live writers, or of writers on other hosts, are left alone."""
    removed = []
    host = socket.gethostname()
    for kind in ("tmp", "old"):
        for path in out.parent.glob(f".{glob.escape(out.name)}.{kind}-*"):
            pid_text = path.name.rpartition("-")[2]
            if not (path.is_dir() and pid_text.isdigit()):
                continue
            owner = (path / _OWNER).read_text().split() if (path / _OWNER).is_file() else []
            owner_host = owner[0] if owner else host
            # an .old- directory is the previous output until the new one took its place
            if owner_host == host and not _pid_alive(int(pid_text)) and (kind == "tmp" or out.exists()):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def check_output_dir(out: str | os.PathLike, inputs: tuple[str | os.PathLike, ...] = ()) -> Path:
    """``out`` as a path a converter may replace: not the working directory or a parent of it, and
    neither an input nor a directory holding one (replacing it would delete the input)."""
    out_path = Path(out)
    resolved = out_path.resolve()
    if resolved == Path.cwd().resolve() or resolved in Path.cwd().resolve().parents:
        raise ValueError(f"--out-dir {out} is the working directory or holds it; name a new directory")
    for source in inputs:
        src = Path(source).resolve()
        if resolved == src or resolved in src.parents:
            raise ValueError(f"--out-dir {out} is the input {source} or holds it; writing there would replace "
                             "the input: name another directory")
    return out_path


@contextmanager
def atomic_output_dir(out: str | os.PathLike, *, force: bool,
                      inputs: tuple[str | os.PathLike, ...] = ()) -> Iterator[Path]:
    """A temporary directory next to ``out`` that becomes ``out`` only if the block succeeds.

    Refuses an ``out`` that is the working directory or an input (``check_output_dir``), and an
    existing ``out`` unless ``force``; then the old directory is replaced only after the new one is
    complete. On any error the temporary directory is removed and ``out`` is untouched; one left
    by a killed writer is removed by the next run (``remove_stale_outputs``).
    """
    out = check_output_dir(out, inputs)
    if out.exists() and not force:
        raise FileExistsError(f"output {out} already exists; pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in remove_stale_outputs(out):
        print(f"removed {stale}, the partial output of a conversion that was killed", file=sys.stderr)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    (tmp / _OWNER).write_text(f"{socket.gethostname()} {os.getpid()}\n")
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (tmp / _OWNER).unlink()
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    if old.exists():
        shutil.rmtree(old)
