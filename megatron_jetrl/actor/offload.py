"""Give the GPU to the colocated rollout engine between updates, and take it back.

Parameters and optimizer state (fp32 master weights, Adam moments) are copied to pinned CPU
memory; gradient buffers and the FP8 weight caches are freed outright (gradients are zeroed
before every update; FP8 weights are re-quantized from the restored parameters, the same bytes).

Only as much as the engine needs leaves the GPU (``offload(..., need=bytes)``): what costs no copy
first (the dropped groups), then the kept groups in their order, largest storage first, until the
device has ``need`` bytes free. A GPU with room for both keeps the actor where it is and pays no
copy over PCIe (about 1.2 s each way for 60 GB on an H200). ``need=None`` moves everything.

The trick that keeps every view valid: megatron's parameters and gradients are views into a few
large buffers, and the optimizer holds references to its tensors. Rather than replacing tensors,
each tensor's *storage* is resized to zero bytes and later back, so all views and references stay
the same Python objects and see the restored bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch


@dataclass(frozen=True)
class OffloadReport:
    """Bytes moved per kind, and what the CUDA caching allocator saw before and after."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    allocated_before: int
    allocated_after: int

    @property
    def freed_bytes(self) -> int:
        return self.allocated_before - self.allocated_after


class _Offloaded:
    def __init__(self, storage: torch.UntypedStorage, host: torch.Tensor | None):
        self.storage = storage
        self.nbytes = storage.nbytes()
        self.host = host


def _unique_storages(tensors: Iterable[torch.Tensor], cuda_only: bool = True) -> list[torch.UntypedStorage]:
    seen, out = set(), []
    for t in tensors:
        if t is None or (cuda_only and not t.is_cuda):
            continue
        s = t.untyped_storage()
        key = s.data_ptr()
        if key in seen or s.nbytes() == 0:
            continue
        seen.add(key)
        out.append(s)
    return out


def _bytes_view(storage: torch.UntypedStorage, device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def release(tensors: Iterable[torch.Tensor | None], cuda_only: bool = True) -> int:
    """Free the memory of ``tensors`` now, whoever still refers to them: each storage is resized to
    zero bytes, so every view of it (a parameter in megatron's buffer, an optimizer's reference)
    is left empty. Returns the bytes released. For an object about to be dropped: a reference kept
    elsewhere (a hook, a closure, a global) would otherwise keep its memory alive."""
    storages = _unique_storages(tensors, cuda_only)
    released = sum(s.nbytes() for s in storages)
    for storage in storages:
        storage.resize_(0)
    return released


def choose(groups: list[tuple[str, list[int], bool]], short: Optional[int]) -> list[tuple[str, int]]:
    """Which storages to move off the GPU so that ``short`` more bytes are free: ``groups`` is
    (name, storage sizes, keep) in the caller's order; the dropped groups (``keep`` False, no copy)
    come first, then the kept ones in order, each group's storages largest first. Returns (group,
    index into its sizes) in that order, up to the first that covers ``short``; everything when
    ``short`` is None."""
    order = [g for g in groups if not g[2]] + [g for g in groups if g[2]]
    out = []
    for name, sizes, _ in order:
        for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
            if short is not None and short <= 0:
                return out
            out.append((name, i))
            if short is not None:
                short -= sizes[i]
    return out


def free_bytes() -> int:
    """The device's free bytes once the caching allocator has given back its unused blocks
    (``empty_cache``): what another allocator (vLLM's) can map. Free space inside partly used
    segments does not count."""
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


class DeviceMemory:
    """Offloads and restores the named groups of GPU tensors of one actor."""

    def __init__(self) -> None:
        self._saved: dict[str, list[_Offloaded]] = {}

    @property
    def offloaded(self) -> bool:
        return bool(self._saved)

    def offload(self, groups: dict[str, tuple[list[torch.Tensor], bool]], need: Optional[int] = None) -> dict[str, int]:
        """``groups``: name -> (tensors, keep). Kept groups are copied to pinned CPU memory first;
        the others are dropped. With ``need`` (bytes), only until the device has that much free
        (``choose``); a second pass follows where fragmentation kept the first one short. Returns
        bytes released per group."""
        if self._saved:
            raise RuntimeError("already offloaded; restore() first")
        storages = {name: _unique_storages(tensors) for name, (tensors, _) in groups.items()}
        released = dict.fromkeys(groups, 0)
        while True:
            short = None if need is None else need - free_bytes()
            left = {name: [s for s in storages[name] if s.nbytes()] for name in groups}  # moved ones have 0 bytes
            picked = choose([(name, [s.nbytes() for s in left[name]], keep) for name, (_, keep) in groups.items()],
                            short)
            if not picked:
                return released
            items = []
            for name, i in picked:
                storage, host = left[name][i], None
                if groups[name][1]:
                    host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=True)
                    host.copy_(_bytes_view(storage, storage.device), non_blocking=True)
                items.append((name, _Offloaded(storage, host)))
            torch.cuda.synchronize()
            for name, item in items:
                item.storage.resize_(0)
                self._saved.setdefault(name, []).append(item)
                released[name] += item.nbytes
            if need is None:
                torch.cuda.empty_cache()
                return released

    def restore(self) -> None:
        """Re-allocate every storage at its old size; copy kept bytes back, zero the dropped ones."""
        if not self._saved:
            return
        for items in self._saved.values():
            for item in items:
                item.storage.resize_(item.nbytes)
                view = _bytes_view(item.storage, item.storage.device)
                if item.host is not None:
                    view.copy_(item.host, non_blocking=True)
                else:
                    view.zero_()
        torch.cuda.synchronize()
        self._saved.clear()
