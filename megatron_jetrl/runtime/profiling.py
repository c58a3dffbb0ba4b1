"""GPU kernel time: of a ``torch.profiler`` profile (the benchmarks' kernel-time splits), and of whole
training steps, phase by phase (``run.profile_steps``).

A profiled step runs each of its phases (generate, score, advantages, logprobs, update, sync)
under its own ``torch.profiler`` profile of CUDA activity: the kernels of the rollout engine (an
in-process vLLM, CUDA graphs included) and of the trainer alike. Its seconds include the
profiler's overhead; compare the kernel milliseconds, not the step time, with other steps. The
result, ``<run dir>/profiles/step_<N>.json`` (rank 0), holds per phase the wall seconds, the kernel
milliseconds by class (``STEP_KERNEL_CLASSES``) and the 12 longest kernels. On a CPU device only
the wall seconds are recorded.
"""

from __future__ import annotations

import contextlib
import re
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from megatron_jetrl.runtime.atomic import save_json_atomic

STEP_KERNEL_CLASSES = (  # first match wins; names of cuBLAS, CUTLASS, FlashAttention 3, vLLM's and our ops
    ("kv cache write", r"reshape_and_cache|cache_kernel"),  # vLLM's is "reshape_and_cache_flash": first
    ("attention", r"flash|fmha|attn|attention|paged"),  # FA3 kernels are CUTLASS kernels: before gemm
    ("gemm", r"gemm|cutlass|nvjet|xmma|sm90_|deep_gemm|scaled_mm|splitk|cublas|matmul"),
    ("fp8 quantization", r"quant|fp8|e4m3|amax|cast_to"),
    ("sampling", r"sampl|topk|top_k|argmax|gumbel|exponential|multinomial"),
    ("norm / rope / activation", r"norm|rotary|rope|silu|act_and_mul|gelu|softmax"),
    ("copies", r"copy_segments|copy|cat"),
    ("elementwise", r"elementwise|vectorized|unrolled|reduce|add|mul|fill|triton"),
)


def _kernel_events(prof) -> Iterator:
    """The kernel entries of a finished ``torch.profiler`` profile's averages: device activity only,
    without CUDA-graph launches, memcpys and memsets."""
    for e in prof.key_averages():
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CPU:
            continue
        if not e.key.startswith("cudaGraph") and "Memcpy" not in e.key and "Memset" not in e.key:
            yield e


def kernel_ms(prof) -> dict[str, float]:
    """Device milliseconds per kernel name (first 90 characters) of a finished ``torch.profiler``
    profile, without CUDA-graph launches, memcpys and memsets; a profile that also recorded CPU
    activity contributes its kernels only (not the device time its operators add up)."""
    kernels: dict[str, float] = {}
    for e in _kernel_events(prof):
        us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        if us > 0:
            kernels[e.key[:90]] = kernels.get(e.key[:90], 0.0) + us / 1e3
    return kernels


def kernel_launches(prof) -> int:
    """How many kernels a finished ``torch.profiler`` profile saw run (the kernels of ``kernel_ms``)."""
    return sum(e.count for e in _kernel_events(prof))


def by_class(kernels: dict[str, float], classes: Sequence[tuple[str, str]]) -> dict[str, float]:
    """Kernel milliseconds summed per class: the first ``(class, regex)`` whose pattern the kernel
    name matches (case-insensitive), else ``other``."""
    out: dict[str, float] = {}
    for name, ms in kernels.items():
        cls = next((c for c, pat in classes if re.search(pat, name, re.I)), "other")
        out[cls] = out.get(cls, 0.0) + ms
    return out


class StepProfiler:
    """Kernel time of the chosen steps, per phase (see the module docstring)."""

    def __init__(self, steps: Sequence[int], device: torch.device):
        self.steps = frozenset(steps)
        self.device = device
        self._phases: dict[str, dict] = {}

    @contextlib.contextmanager
    def phase(self, step: int, name: str) -> Iterator[None]:
        """Profile phase ``name`` when ``step`` is one of the chosen; a phase entered again in the
        step (dynamic sampling's rounds) adds up."""
        if step not in self.steps:
            yield
            return
        cuda = self.device.type == "cuda"
        record = self._phases.setdefault(name, {"wall_s": 0.0, "kernels_ms": {}})
        start = time.perf_counter()
        if not cuda:
            yield
            record["wall_s"] += time.perf_counter() - start
            return
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            yield
            torch.cuda.synchronize(self.device)
        record["wall_s"] += time.perf_counter() - start
        for kernel, ms in kernel_ms(prof).items():
            record["kernels_ms"][kernel] = record["kernels_ms"].get(kernel, 0.0) + ms

    def write(self, step: int, run_dir: Path) -> Optional[Path]:
        """Write what ``step``'s phases recorded to ``run_dir/profiles/step_<step>.json`` and forget
        it; None when the step was not profiled."""
        if not self._phases:
            return None
        phases = {}
        for name, r in self._phases.items():
            kernels = r["kernels_ms"]
            classes = by_class(kernels, STEP_KERNEL_CLASSES)
            phases[name] = {"wall_s": r["wall_s"], "kernel_ms": sum(kernels.values()),
                            "classes_ms": dict(sorted(classes.items(), key=lambda kv: -kv[1])),
                            "top_kernels_ms": dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:12])}
        device = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        path = Path(run_dir) / "profiles" / f"step_{step}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_json_atomic(path, {"step": step, "device": device, "phases": phases})
        self._phases = {}
        return path
