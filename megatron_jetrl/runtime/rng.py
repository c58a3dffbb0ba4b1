"""Per-rank random-number state, saved into a checkpoint so a resumed run draws the same numbers.

Covered: Python ``random``, numpy's global generator, torch's CPU generator and, where CUDA is
available, the default generator of every visible CUDA device. Not covered: megatron's
model-parallel CUDA RNG tracker and any generator objects a module owns (the actor checkpoints
those itself); data-loader worker seeds derive from the sampler state the trainer saves.

The file holds only tensors, ints, strings and lists, so it loads with ``weights_only=True``.
"""

from __future__ import annotations

import hashlib
import io
import random
from pathlib import Path

import numpy as np
import torch

from megatron_jetrl.runtime.atomic import write_atomic


def rng_path(directory: Path, rank: int) -> Path:
    """``directory/rng/rank_{rank:05d}.pt``."""
    return Path(directory) / "rng" / f"rank_{rank:05d}.pt"


def _capture() -> dict:
    version, mt_state, gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    state = {
        "python": {"version": version, "state": list(mt_state), "gauss": gauss},
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def save_rng(directory: Path, rank: int) -> Path:
    """Write this process's RNG state to ``rng_path(directory, rank)`` (atomically, fsynced)."""
    path = rng_path(directory, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(_capture(), buf)
    write_atomic(path, buf.getvalue())
    return path


def load_rng(directory: Path, rank: int) -> None:
    """Restore the RNG state ``save_rng(directory, rank)`` wrote.

    CUDA states are restored when both the file and this process have them; a different number of
    visible CUDA devices is an error (the streams could not continue as they were).
    """
    path = rng_path(directory, rank)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: no RNG state for rank {rank} (was the world size different?)")
    state = torch.load(path, weights_only=True)
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    npst = state["numpy"]
    np.random.set_state({
        "bit_generator": npst["bit_generator"],
        "state": {"key": npst["key"].numpy().astype(np.uint32), "pos": npst["pos"]},
        "has_gauss": npst["has_gauss"],
        "gauss": npst["gauss"],
    })
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        saved, here = len(state["cuda"]), torch.cuda.device_count()
        if saved != here:
            raise ValueError(f"{path} holds RNG states of {saved} CUDA devices; this process sees {here}")
        torch.cuda.set_rng_state_all(state["cuda"])


def rng_fingerprint() -> str:
    """A hash of the current RNG states (equal fingerprints: the next draws will be equal)."""
    h = hashlib.sha256()
    state = _capture()
    py = state["python"]
    h.update(repr((py["version"], py["state"], py["gauss"])).encode())
    npst = state["numpy"]
    h.update(npst["key"].numpy().tobytes())
    h.update(repr((npst["bit_generator"], npst["pos"], npst["has_gauss"], npst["gauss"])).encode())
    h.update(state["torch"].numpy().tobytes())
    for s in state.get("cuda", []):
        h.update(s.numpy().tobytes())
    return h.hexdigest()
