"""GPU memory per phase of a step: each phase's peak of PyTorch-allocated bytes, the allocator's
peak reservation, the device's used memory at the phase ends (PyTorch's plus the CUDA context,
NCCL, cuBLAS and CUDA graph pools), and each phase's allocation retries (``memory/<phase>_alloc_retries``:
cudaMalloc calls that failed and made the caching allocator free its cache and synchronize, the
sign of a phase running at the GPU's limit); the largest over ranks, once per step."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist


class PhaseMemory:
    """``track(name)`` around each phase; ``metrics()`` once per step (a collective: all ranks)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._bytes: dict[str, int] = {}
        self._retries: dict[str, int] = {}

    @contextlib.contextmanager
    def track(self, name: str) -> Iterator[None]:
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            retries = torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)
        yield
        if cuda:
            self._retries[name] = (self._retries.get(name, 0)
                                   + torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0) - retries)
            free, total = torch.cuda.mem_get_info(self.device)
            seen = self._bytes
            seen[f"{name}_peak_allocated"] = max(seen.get(f"{name}_peak_allocated", 0),
                                                 torch.cuda.max_memory_allocated(self.device))
            seen["peak_reserved"] = max(seen.get("peak_reserved", 0), torch.cuda.max_memory_reserved(self.device))
            seen["device_used"] = max(seen.get("device_used", 0), total - free)

    def metrics(self) -> dict[str, float]:
        """``memory/<what>_gib`` of the phases tracked since the last call, the largest over ranks
        (empty on a CPU)."""
        if not self._bytes:
            return {}
        names, counts = sorted(self._bytes), sorted(self._retries)
        t = torch.tensor([float(self._bytes[n]) for n in names] + [float(self._retries[n]) for n in counts],
                         dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        self._bytes, self._retries = {}, {}
        values = t.tolist()
        return {**{f"memory/{n}_gib": v / 2**30 for n, v in zip(names, values[:len(names)], strict=True)},
                **{f"memory/{n}_alloc_retries": v for n, v in zip(counts, values[len(names):], strict=True)}}
