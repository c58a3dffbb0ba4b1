"""GPU kernel time from a torch profile, for the benchmarks' kernel-time splits."""

from __future__ import annotations

import re
from typing import Sequence


def kernel_ms(prof) -> dict[str, float]:
    """Device milliseconds per kernel name (first 90 characters) of a finished ``torch.profiler``
    profile, without CUDA-graph launches, memcpys and memsets."""
    kernels: dict[str, float] = {}
    for e in prof.key_averages():
        us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        if us > 0 and not e.key.startswith("cudaGraph") and "Memcpy" not in e.key and "Memset" not in e.key:
            kernels[e.key[:90]] = kernels.get(e.key[:90], 0.0) + us / 1e3
    return kernels


def by_class(kernels: dict[str, float], classes: Sequence[tuple[str, str]]) -> dict[str, float]:
    """Kernel milliseconds summed per class: the first ``(class, regex)`` whose pattern the kernel
    name matches (case-insensitive), else ``other``."""
    out: dict[str, float] = {}
    for name, ms in kernels.items():
        cls = next((c for c, pat in classes if re.search(pat, name, re.I)), "other")
        out[cls] = out.get(cls, 0.0) + ms
    return out
