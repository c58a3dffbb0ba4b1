"""GPU kernel time: of a ``torch.profiler`` profile (the benchmarks' kernel-time splits), and of whole
training steps, phase by phase (``run.profile_steps``).

A profiled step runs each of its phases (generate, score, advantages, logprobs, update, sync)
under its own ``torch.profiler`` profile of CUDA activity: the kernels of the rollout engine (an
in-process vLLM, CUDA graphs included) and of the trainer alike. Its seconds include the
profiler's overhead; compare the kernel milliseconds, not the step time, with other steps. The
result, ``<run dir>/profiles/step_<N>.json`` (rank 0), holds per phase the wall seconds, the kernel
milliseconds by class (``STEP_KERNEL_CLASSES``), the 12 longest kernels and the host's side (below);
for the trainer's phases (``OPERATOR_PHASES``) also the 12 torch operators whose own kernels took
longest, which name the call behind an elementwise or copy kernel. On a CPU device there are no
kernels to record.

The host's side of a profiled phase (``HostSampler``): where the main thread spent the phase's wall
time, by Python function, sampled from a background thread (the in-process vLLM engine's scheduler,
model runner and output processing all run on it), and the time Python's garbage collector took.
A phase whose wall time exceeds its kernel time is host-bound; these say on what.
"""

from __future__ import annotations

import contextlib
import gc
import re
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from megatron_jetrl.runtime.atomic import save_json_atomic

COMMUNICATION = ("communication", r"nccl|cross_device_reduce|all_?reduce|all_?gather|reduce_?scatter|send_?recv")
"""NCCL's kernels and vLLM's custom all-reduce (``cross_device_reduce_1stage``: its time includes the
wait for the slowest rank). First in every class list: "reduce_scatter" would match elementwise's
"reduce" and copies' "cat"."""

STEP_KERNEL_CLASSES = (  # first match wins; names of cuBLAS, CUTLASS, FlashAttention 3, vLLM's and our ops
    COMMUNICATION,
    ("kv cache write", r"reshape_and_cache|cache_kernel"),  # vLLM's is "reshape_and_cache_flash": first
    ("attention", r"flash|fmha|attn|attention|paged"),  # FA3 kernels are CUTLASS kernels: before gemm
    ("gemm", r"gemm|cutlass|nvjet|xmma|sm90_|deep_gemm|scaled_mm|splitk|cublas|matmul"),
    # Inductor names a fused kernel after the ops around it, the quantization it feeds included: its
    # RMSNorm and SiLU-mul kernels in an FP8 engine are norm / activation work, as in BF16
    ("norm / rope / activation", r"^triton_\w*(silu|rms_norm|rsqrt|rotary|rope)"),
    ("fp8 quantization", r"quant|fp8|e4m3|amax|cast_to"),
    ("sampling", r"sampl|topk|top_k|argmax|gumbel|exponential|multinomial"),
    ("norm / rope / activation", r"norm|rotary|rope|silu|act_and_mul|gelu|softmax"),
    ("copies", r"copy_segments|copy|cat"),
    ("elementwise", r"elementwise|vectorized|unrolled|reduce|add|mul|fill|triton"),
)


OPERATOR_PHASES = ("logprobs", "update")
"""Phases whose kernels are also attributed to the torch operators that launched them: the trainer's
eager ops. Generate's kernels run from vLLM's CUDA graphs, which the profiler cannot attribute, and
recording the CPU side of its host-bound loop would slow it."""


def _kernel_events(prof) -> Iterator:
    """The kernel entries of a finished ``torch.profiler`` profile's averages: device activity only,
    without CUDA-graph launches, memcpys, memsets and the GPU user annotations that span kernels
    (c10d marks each collective's kernel as ``nccl:_all_gather_base`` too: counted, it doubled the
    collectives' time, as torch's own totals know)."""
    for e in prof.key_averages():
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CPU or getattr(e, "is_user_annotation", False):
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


def operator_ms(prof) -> dict[str, float]:
    """Device milliseconds of the kernels each ``aten::`` operator launched itself (not its callees')
    in a finished ``torch.profiler`` profile that recorded CPU activity too."""
    return {e.key: e.self_device_time_total / 1e3 for e in prof.key_averages()
            if e.key.startswith("aten::") and getattr(e, "self_device_time_total", 0) > 0}


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


def _where(code) -> str:
    """A function as ``package/module.py:name`` (the file's last two path parts)."""
    parts = code.co_filename.replace("\\", "/").rsplit("/", 2)
    return f"{'/'.join(parts[-2:])}:{code.co_name}"


class HostSampler:
    """Where a thread's wall time goes, by Python function: a daemon thread reads the thread's stack
    every ``interval`` seconds and gives the time since its previous look to the function on top
    (``self``) and to every function on the stack (``inclusive``). A look waits for the GIL, so a
    stretch of Python without a release is seen late but still counted whole; a thread blocked in a
    CUDA synchronization shows the Python function that waits; a garbage collection shows as
    ``(garbage collection)``. Only the frames below the one that entered the sampler count (the
    callers' are on every sample). Also counts the collections and their seconds. Use as a context
    manager around the work, on the thread it samples, then ``result()``."""

    GC = "(garbage collection)"

    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self._target = threading.current_thread().ident
        self._outside: frozenset = frozenset()
        self.self_s: dict[str, float] = {}
        self.inclusive_s: dict[str, float] = {}
        self.sampled_s = 0.0
        self.gc_s = 0.0
        self.gc_collections = 0
        self._gc_start: Optional[float] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "HostSampler":
        frame, outside = sys._getframe(1), set()
        while frame is not None:  # held (not their ids, which a later frame may reuse) until exit
            outside.add(frame)
            frame = frame.f_back
        self._outside = frozenset(outside)
        gc.callbacks.append(self._on_gc)
        self._thread = threading.Thread(target=self._run, name="jetrl-host-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        gc.callbacks.remove(self._on_gc)
        self._outside = frozenset()

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            self.gc_s += time.perf_counter() - self._gc_start
            self.gc_collections += 1
            self._gc_start = None

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(self.interval):
            frame = sys._current_frames().get(self._target)
            now = time.perf_counter()
            dt, last = now - last, now
            if frame is None or self._stop.is_set():  # the thread has left the work (exit joins this one)
                continue
            self.sampled_s += dt
            if frame.f_code is self._on_gc.__code__:
                top, frame = self.GC, frame.f_back
            else:
                top = _where(frame.f_code)
            self.self_s[top] = self.self_s.get(top, 0.0) + dt
            seen = set()
            while frame is not None and frame not in self._outside:
                seen.add(_where(frame.f_code))
                frame = frame.f_back
            for where in seen:
                self.inclusive_s[where] = self.inclusive_s.get(where, 0.0) + dt

    def result(self, top: int = 15) -> dict:
        """The sampled seconds, the ``top`` functions by their own and by inclusive seconds, and the
        garbage collector's seconds and collections."""
        return {"sampled_s": self.sampled_s, "gc_s": self.gc_s, "gc_collections": self.gc_collections,
                "self_s": largest(self.self_s, top), "inclusive_s": largest(self.inclusive_s, top)}


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
        record = self._phases.setdefault(name, {"wall_s": 0.0, "kernels_ms": {}, "ops_ms": {}, "host": []})
        start = time.perf_counter()
        with contextlib.ExitStack() as stack:
            if cuda:
                from torch.profiler import ProfilerActivity, profile

                activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if name in OPERATOR_PHASES else [])
                prof = stack.enter_context(profile(activities=activities))
            host = stack.enter_context(HostSampler())
            yield
            if cuda:
                torch.cuda.synchronize(self.device)
        record["wall_s"] += time.perf_counter() - start
        record["host"].append(host)
        if cuda:
            for key, found in (("kernels_ms", kernel_ms(prof)), ("ops_ms", operator_ms(prof))):
                for what, ms in found.items():
                    record[key][what] = record[key].get(what, 0.0) + ms

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
                            "top_kernels_ms": largest(kernels),
                            "host": _merged_host(r["host"])}
            if r["ops_ms"]:
                phases[name]["top_ops_ms"] = largest(r["ops_ms"])
        device = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        path = Path(run_dir) / "profiles" / f"step_{step}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_json_atomic(path, {"step": step, "device": device, "phases": phases})
        self._phases = {}
        return path


def largest(values: dict[str, float], top: int = 12) -> dict[str, float]:
    """The ``top`` entries with the largest values, largest first."""
    return dict(sorted(values.items(), key=lambda kv: -kv[1])[:top])


def _merged_host(samplers: Sequence[HostSampler]) -> dict:
    """One phase's host samples (a phase entered more than once: its samplers added up)."""
    total = HostSampler()
    for h in samplers:
        for mine, theirs in ((total.self_s, h.self_s), (total.inclusive_s, h.inclusive_s)):
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0.0) + v
        total.sampled_s += h.sampled_s
        total.gc_s += h.gc_s
        total.gc_collections += h.gc_collections
    return total.result()
