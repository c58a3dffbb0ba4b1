"""Hugging Face checkpoint files: lazy sharded-safetensors reading and streaming, atomic writing.

Reading opens shards lazily and returns one tensor at a time, so a converter holds about one
layer, never the model. Writing fills shards up to a size limit as tensors arrive, names them
``model-0000i-of-0000n.safetensors`` once n is known, writes the index, config and tokenizer files,
all inside a temporary directory that replaces the output only when everything is written.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

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


class HFCheckpoint:
    """Read access to an HF model directory (config.json + safetensors, sharded or not)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"HF checkpoint directory {self.path} does not exist")
        config_path = self.path / "config.json"
        if not config_path.is_file():
            raise CheckpointError(f"{self.path} has no config.json; is it a Hugging Face model directory?")
        self.config: dict[str, Any] = json.loads(config_path.read_text())
        index = self.path / INDEX
        if index.is_file():
            self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif (self.path / SINGLE).is_file():
            with safe_open(self.path / SINGLE, framework="pt") as f:
                self.weight_map = {name: SINGLE for name in f.keys()}
        else:
            raise CheckpointError(f"{self.path} has neither {INDEX} nor {SINGLE}")
        for shard in sorted(set(self.weight_map.values())):
            if not (self.path / shard).is_file():
                raise CheckpointError(f"{self.path}/{INDEX} lists shard {shard}, which does not exist")
        self._open: dict[str, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        shard = self.weight_map.get(name)
        if shard is None:
            raise CheckpointError(f"HF checkpoint {self.path} has no tensor {name!r}")
        if shard not in self._open:
            self._open[shard] = safe_open(self.path / shard, framework="pt")
        return self._open[shard].get_tensor(name)

    def total_bytes(self) -> int:
        return sum((self.path / s).stat().st_size for s in set(self.weight_map.values()))

    def copy_side_files(self, out: Path) -> list[str]:
        """Tokenizer and generation files next to the weights, copied to ``out``."""
        copied = []
        for name in TOKENIZER_FILES:
            if (self.path / name).is_file():
                shutil.copy2(self.path / name, out / name)
                copied.append(name)
        return copied


class ShardedSafetensorsWriter:
    """Writes tensors into safetensors shards of at most ``max_shard_bytes`` as they arrive."""

    def __init__(self, directory: Path, max_shard_bytes: int = 5 * 2**30):
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive; got {max_shard_bytes}")
        self.directory = directory
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._pending or any(name in s for s in self._shards):
            raise ValueError(f"tensor {name} written twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().contiguous().cpu()
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        save_file(self._pending, str(self.directory / f"shard-{len(self._shards):05d}.tmp"), metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def finish(self) -> None:
        """Names the shards ``model-0000i-of-0000n.safetensors`` and writes the index."""
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        weight_map = {}
        for i, names in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.directory / f"shard-{i:05d}.tmp", self.directory / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")


@contextmanager
def atomic_output_dir(out: str | os.PathLike, *, force: bool) -> Iterator[Path]:
    """A temporary directory next to ``out`` that becomes ``out`` only if the block succeeds.

    Refuses an existing ``out`` unless ``force``; then the old directory is replaced only after the
    new one is complete. On any error the temporary directory is removed and ``out`` is untouched.
    """
    out = Path(out)
    if out.exists() and not force:
        raise FileExistsError(f"output {out} already exists; pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    if old.exists():
        shutil.rmtree(old)
