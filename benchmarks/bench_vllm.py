"""vLLM rollout, FP8 vs BF16, at Qwen3-8B shapes on one GPU: decode throughput, weight sync into
vLLM, and a whole RL step with vLLM rollout. One table, printed last; the headline ratios go to
docs/results/headline.json.

    python -m benchmarks.bench_vllm decode --modes bf16,fp8,fp8kv[,fp8-vq,fp8kv-vq] [--cases 64x512,...] [--warm-start]
        [--cold-start]
    python -m benchmarks.bench_vllm sync [--train-tp 2 --rollout-tp 2]  # 8B FP8 shards -> vLLM, each path
    python -m benchmarks.bench_vllm step                 # jetrl train, Qwen3-8B layer shapes, FP8 and BF16
    python -m benchmarks.bench_vllm table [--headline docs/results/headline.json]

Results accumulate as JSON in ``--work`` (default /tmp/bench_vllm: the GPU host keeps /tmp while a
machine stays warm, so the parts may run in separate calls) and are copied to ``--out`` if given.

decode: one process per mode (vLLM's state lives for a process), each an in-process ``VllmEngine``
exactly as the trainer builds it (external launcher, CUDA graphs, sleep mode) with random weights
written through ``weight_buffers()`` (norms 1, the rest N(0, 0.02), FP8 linears quantized by the
recipe), all 36 layers, prefix caching off. A case BxT generates T tokens (no stop) for B distinct
random prompts of ``--prompt-len`` tokens in one ``generate`` call; throughput = B*T / wall time
(prefill included; vLLM admits as many sequences as its KV cache holds, so at long responses batch
capacity counts). ``--profile`` adds a kernel-time split of 32 decode steps at batch 256
(prefill subtracted). ``--warm-start`` starts each mode's engine again after its measured run
(``--warm-start-repeats`` times, default 3), each in a child that only builds and closes it: those
starts (``engine_start_warm_s``, their median) find vLLM's torch.compile artifacts and DeepGEMM's JIT
kernels in their on-disk caches (VLLM_CACHE_ROOT), as an RL job's restart does; ``engine_start_s`` is
the first start, cold on a fresh machine (unless DeepGEMM's kernels were carried in: ``dg_jit_seeded``).
``--cold-start`` starts it ``--cold-start-repeats`` times more with empty caches (``COLD_CACHES``), as a
first start on a new machine
(``vllm_engine_start_cold_s``: their median; without it, no cold figure: a run's first start may find
caches an earlier run on the machine filled).

sync: the trainer's shards of the whole 8B model at TP 1 (random BF16 + their FP8 FProp weights),
synced into an FP8 engine: ``in_place`` (the copy kernels write into vLLM's parameters),
``update_weights`` (the engine copies each round's tensors into its parameters) and ``reload``
(vLLM's own loaders through its layerwise reload; a second engine). Against the copy floor: the
engine's bytes over the GPU's copy bandwidth measured in the same process.

step: ``jetrl train benchmarks/configs/qwen3_8b_dims.yaml`` (6 of Qwen3-8B's layers, its vocab, 16
prompts x 8 samples x 512 tokens) with ``rollout.engine=vllm`` and ``rollout.sampling.ignore_eos=true``
(every response ``max_new_tokens`` long), per mode of ``--step-modes``; step 1 warms up (and step 2
with ``--step-offload``: ``rl_summary.warm_up_steps``), the next ``--step-steps`` are timed: the median seconds
per phase and the range. A ratio becomes a headline figure only when every mode generated the same
tokens at every timed step.

table: every result in ``--work`` as one table; with ``--headline`` their figures are merged into
the headline file (medians of the repeats, paired spreads, each result's device and command).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

from benchmarks.headline import Figure, command_line
from benchmarks.rl_summary import UPDATE_SPLIT, profile_lines, same_work
from megatron_jetrl.runtime.profiling import COMMUNICATION

ROOT = Path(__file__).resolve().parents[1]

MODES = {  # name -> (precision.mode, kv_cache_dtype, rollout.vllm.activation_quant, precision.exact,
    #          rollout.vllm.attention_backend)
    "bf16": ("bf16", "auto", "trainer", False, "auto"),
    "fp8": ("fp8", "auto", "trainer", False, "auto"),  # the default: the trainer's activation quantization in vLLM
    "fp8kv": ("fp8", "fp8", "trainer", False, "auto"),
    "fp8-vq": ("fp8", "auto", "vllm", False, "auto"),  # vLLM's own activation quantization (and its fusions)
    "fp8kv-vq": ("fp8", "fp8", "vllm", False, "auto"),
    "fp8-exact": ("fp8", "auto", "trainer", True, "auto"),  # the exact rollout: batch-invariant kernels, trainer's ops
    "bf16-exact": ("bf16", "auto", "trainer", True, "auto"),
    "fp8kv-exact": ("fp8", "fp8", "trainer", True, "auto"),  # exact with an FP8 KV cache
    "bf16-tri": ("bf16", "auto", "trainer", False, "triton_attn"),  # vLLM's Triton attention instead of FA3
    "fp8kv-tri": ("fp8", "fp8", "trainer", False, "triton_attn"),  # its FP8-KV decode against FA3's
}
KERNEL_CLASSES = (  # first match wins; names of cuBLAS, CUTLASS, DeepGEMM, FlashAttention 3, vLLM's ops
    # vLLM's KV-cache write is "reshape_and_cache_flash": first; FlashAttention 3 kernels are
    # CUTLASS device kernels ("cutlass::device_kernel<flash::..."): before gemm
    COMMUNICATION,  # at TP > 1: vLLM's custom all-reduce, NCCL
    ("kv cache write", r"reshape_and_cache|cache_kernel"),
    ("attention", r"flash|fmha|attn|attention|paged"),
    ("gemm", r"gemm|cutlass|nvjet|xmma|sm90_|deep_gemm|scaled_mm|splitk|cublas|matmul"),  # matmul: the exact LM head's
    ("fp8 quant", r"quant|fp8|per_token_group"),
    ("norm / rope / act", r"norm|rotary|rope|silu|act_and_mul|gelu"),
    ("sampling", r"sampl|topk|top_k|softmax|argmax|gumbel|exponential|multinomial|sort|cumsum"),
)


def _device() -> str:
    import torch

    return torch.cuda.get_device_name()


def _gpu_name() -> str:
    """The name of this process's first GPU, from nvidia-smi: the step benchmark's parent leaves
    CUDA to its ``jetrl train`` children (a context here would hold GPU memory)."""
    index = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", index],
                             capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    return out or "?"


# ------------------------------------------------------------------------------------------ children


def _launch_env(args, mode: str = "fp8") -> dict[str, str]:
    """One process as torchrun would start it (vLLM's external launcher reads these), with the
    variables vLLM must see for ``mode``'s recipe and the FP8 kernel (what ``jetrl train`` sets)."""
    from megatron_jetrl.launch import free_port
    from megatron_jetrl.rollout.vllm_engine import VllmOptions, engine_env

    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
            **engine_env(_recipe(mode), VllmOptions(fp8_gemm=args.fp8_gemm))}


def _gemm(args, mode: str) -> str:
    """The block-FP8 GEMM ``mode``'s engine runs: ``--fp8-gemm``, ``auto`` resolved as the engine
    resolves it (DeepGEMM)."""
    from megatron_jetrl.rollout.vllm_engine import VllmOptions

    return VllmOptions(fp8_gemm=args.fp8_gemm).fp8_gemm_kernel


def decode_name(mode: str, gemm: str) -> str:
    """A decode result's name (``decode_<name>.json``, its table column): the mode, and for an FP8 mode
    on DeepGEMM the mode with ``-deep_gemm`` (its own column beside CUTLASS's)."""
    return mode if gemm == "cutlass" or MODES[mode][0] == "bf16" else f"{mode}-{gemm}"


def _recipe(mode: str):
    from megatron_jetrl.precision import PrecisionRecipe

    precision, _, _, exact, _ = MODES[mode]
    return PrecisionRecipe(mode=precision, exact=exact)


def _engine(mode: str, args, **overrides):
    """A VllmEngine of the 8B model in ``mode`` (torch.distributed up first, as in the trainer)."""
    import torch
    import torch.distributed as dist

    from benchmarks.model_shapes import qwen3_8b_shaped
    from megatron_jetrl.rollout.vllm_engine import VllmEngine, VllmOptions

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl")
    _, kv, activation_quant, _, attention = MODES[mode]
    recipe = _recipe(mode)
    options = VllmOptions(gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
                          max_model_len=args.prompt_len + args.max_len, kv_cache_dtype=kv,
                          activation_quant=activation_quant, attention_backend=attention,
                          enable_prefix_caching=False, fp8_gemm=args.fp8_gemm,
                          cuda_graph_max_batch=args.max_num_seqs,
                          tensor_parallel_size=getattr(args, "rollout_tp", 1), **overrides)
    start = time.perf_counter()
    engine = VllmEngine(qwen3_8b_shaped(args.layers), recipe, options)
    return engine, recipe, time.perf_counter() - start


def fill_random(engine, seed: int = 0) -> None:
    """Random weights into the engine's own parameters: norms 1, the rest N(0, 0.02); an FP8
    linear gets the recipe's 128x128 quantization of such a weight."""
    import torch

    from megatron_jetrl.precision import WEIGHT_BLOCK, quantize_fp8_blockwise

    buffers = engine.weight_buffers()
    g = torch.Generator(device="cuda").manual_seed(seed)
    for name, buf in buffers.items():
        if name.endswith("_scale_inv"):
            continue
        if name.endswith("norm.weight"):
            buf.fill_(1.0)
        elif buf.dtype == torch.float8_e4m3fn:
            w = torch.empty(buf.shape, dtype=torch.bfloat16, device=buf.device).normal_(0, 0.02, generator=g)
            data, scale = quantize_fp8_blockwise(w, WEIGHT_BLOCK)
            buf.copy_(data)
            buffers[name + "_scale_inv"].copy_(scale)
        else:
            buf.normal_(0, 0.02, generator=g)
    missing = {n for n in engine.weight_specs() if n not in buffers and not n.endswith(("q_scale", "k_scale",
                                                                                        "v_scale"))}
    if missing:
        raise RuntimeError(f"engine offers no buffer for {sorted(missing)[:3]} (rollout TP 1 should give all)")
    torch.cuda.synchronize()


def decode_child(args) -> dict:
    import torch

    from megatron_jetrl.rollout import SamplingParams

    engine, _, start_s = _engine(args.mode, args)
    fill_random(engine)
    engine.wake()
    vocab = engine.bridge.dims.vocab_size
    g = torch.Generator().manual_seed(0)
    engine.generate(torch.randint(0, vocab, (8, args.prompt_len), generator=g).tolist(),
                    SamplingParams(max_new_tokens=16, seed=0))  # warm-up
    free, total = torch.cuda.mem_get_info()
    out = {"mode": args.mode, "fp8_gemm": _gemm(args, args.mode), "engine_start_s": start_s,
           "kv_cache_tokens": engine.kv_cache_tokens, "used_gib": (total - free) / 2**30, "cases": {},
           "device": _device(), "layers": args.layers}
    if os.environ.get("JETRL_DG_JIT_SEEDED") == "1":  # hosts/offline/jit_cache.sh: the first start found its kernels
        out["dg_jit_seeded"] = True
    for case in args.cases.split(","):
        b, t = (int(x) for x in case.split("x"))
        prompts = torch.randint(0, vocab, (b, args.prompt_len), generator=g).tolist()
        walls = []
        for _ in range(args.repeats):  # the same prompts each time: the same work
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            samples = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=t, seed=1))
            walls.append(time.perf_counter() - t0)
            short = [len(s.tokens) for s in samples if len(s.tokens) != t]
            if short:  # not the same work in every mode: no tok/s to compare
                raise RuntimeError(f"decode {args.mode} {case}: {len(short)} of {len(samples)} samples have "
                                   f"{min(short)}-{max(short)} tokens, not {t} (a stop token ended them)")
        wall = statistics.median(walls)
        out["cases"][case] = {"batch": b, "tokens": t, "wall_s": wall, "tok_s": b * t / wall,
                              "tok_s_repeats": [b * t / w for w in walls]}
        print(f"[{args.mode}] {case}: {b * t / wall:.0f} tok/s (median of {len(walls)}, "
              f"{min(walls):.1f}-{max(walls):.1f} s)", flush=True)
        args.result.write_text(json.dumps({**out, "complete": False}, indent=1))  # kept if a later case is cut off
    if args.profile:
        out["profile"] = profile_decode(engine, vocab, args.prompt_len, batch=args.profile_batch)
    if args.host_profile:
        out["host_profile"] = host_profile(engine, vocab, args.prompt_len, batch=args.profile_batch)
        print("\n".join(host_profile_lines(args.mode, out["host_profile"], top=20)), flush=True)
    engine.close()
    return {**out, "complete": True}


def start_child(args) -> dict:
    """Seconds to build the engine exactly as ``decode_child`` does, and nothing else: no weights
    filled, no generate (what a warm start measures is the start alone)."""
    engine, _, start_s = _engine(args.mode, args)
    engine.close()
    return {"mode": args.mode, "fp8_gemm": _gemm(args, args.mode), "engine_start_s": start_s, "device": _device()}


COLD_CACHES = ("VLLM_CACHE_ROOT", "DG_JIT_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
"""The on-disk caches an engine start fills and a later start reads: vLLM's compiled graphs, DeepGEMM's
JIT kernels, Inductor's and Triton's kernels. A cold start gets a fresh empty directory for each."""


def _extra_starts(args, mode: str, name: str, *, cold: bool) -> None:
    """Start ``mode``'s engine again, one process each (``start_child``), ``--warm-start-repeats``
    times after its measured run left vLLM's compile and JIT caches on disk, or ``--cold-start-repeats``
    times with empty caches (``COLD_CACHES`` pointed at a fresh directory, removed after), as a job's
    first start on a new machine. The seconds go into the mode's result (``decode_NAME.json``) after each
    start, so that a run cut off (the device time spent, the machine taken back) keeps the starts it
    finished: ``engine_start_warm_s_all`` and their median ``engine_start_warm_s``, or
    ``engine_start_cold_s_all``. The mode's ``engine_start_s`` stays its first start."""
    import tempfile

    kind = "cold" if cold else "warm"
    field, child = f"engine_start_{kind}_s_all", f"{name}-{'cold' if cold else 'start'}"
    starts = []
    for _ in range(args.cold_start_repeats if cold else args.warm_start_repeats):
        fresh = Path(tempfile.mkdtemp(prefix="cold-start-", dir=args.work)) if cold else None
        try:
            env = {var: str(fresh / var.lower()) for var in COLD_CACHES} if cold else None
            start = run_child("decode", args, [mode, "--start-only"], name=child, env_extra=env)
        finally:
            if fresh is not None:
                shutil.rmtree(fresh, ignore_errors=True)
        if start is None:
            break
        (Path(args.work) / f"decode_{child}.json").unlink()  # the number lives in the mode's result
        starts.append(start["engine_start_s"])
        extra = {field: starts} if cold else {field: starts, "engine_start_warm_s": statistics.median(starts)}
        out = Path(args.work) / f"decode_{name}.json"
        out.write_text(json.dumps({**json.loads(out.read_text()), **extra}, indent=1))
    if not starts:
        print(f"decode {name}: the {kind} start wrote no result; {field} left out", flush=True)
        return
    print(f"decode {name}: {kind} engine start {statistics.median(starts):.0f} s (median of {len(starts)})",
          flush=True)


def warm_generate_s(engine, prompts, params) -> float:
    """Seconds of one ``generate`` of ``prompts`` after a warm-up call of the same work."""
    import torch

    engine.generate(prompts, params)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.generate(prompts, params)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def host_profile(engine, vocab: int, prompt_len: int, batch: int = 256, steps: int = 256, top: int = 30) -> dict:
    """Host time of ``steps`` decode steps at ``batch`` (and their prefill) by Python function
    (cProfile, after a warm-up): ms a decode step of each of the ``top`` functions with the most time
    of their own (``self_ms``) and with their callees (``total_ms``), beside the step's wall time
    without the profiler. Where the engine's loop, not the GPU, sets the pace, this says which host
    work does."""
    import cProfile
    import pstats

    import torch

    from megatron_jetrl.rollout import SamplingParams

    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, vocab, (batch, prompt_len), generator=g).tolist()
    params = SamplingParams(temperature=1.0, max_new_tokens=steps, seed=4)
    wall = warm_generate_s(engine, prompts, params)
    profiler = cProfile.Profile()
    profiler.enable()
    engine.generate(prompts, params)
    torch.cuda.synchronize()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive calls, self s, total s, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return {"batch": batch, "steps": steps, "wall_ms_per_step": wall * 1e3 / steps,
            "functions": [{"function": f"{Path(file).name}:{line}:{name}", "calls_per_step": calls / steps,
                           "self_ms": self_s * 1e3 / steps, "total_ms": total_s * 1e3 / steps}
                          for (file, line, name), (_, calls, self_s, total_s, _) in rows]}


def host_profile_lines(name: str, hp: dict, top: int = 12) -> list[str]:
    """``host_profile``'s result as table lines: the step's wall time, then the ``top`` functions by
    their own time (ms a decode step under cProfile, which slows Python calls: compare them with each
    other and between modes, not with the wall time)."""
    lines = [f"-- host time, {name}, {hp['steps']} decode steps at batch {hp['batch']}: "
             f"{hp['wall_ms_per_step']:.2f} ms wall a step (unprofiled); by function, ms a step under cProfile:",
             f"   {'self':>7} {'total':>7} {'calls':>8}  function"]
    lines += [f"   {f['self_ms']:>7.3f} {f['total_ms']:>7.3f} {f['calls_per_step']:>8.1f}  {f['function']}"
              for f in hp["functions"][:top]]
    return [re.sub(r" at 0x[0-9a-f]+>", ">", line) for line in lines]  # a built-in's address says nothing


def profile_decode(engine, vocab: int, prompt_len: int, batch: int = 256, steps: int = 32) -> dict:
    """GPU kernel time of ``steps`` decode steps at ``batch``, by class: a profile of prefill plus
    ``steps`` new tokens minus one of the same prefill with one new token (after a warm-up);
    ``top_kernels_ms`` and ``launches`` name where the time goes and how many kernels ran,
    ``other_kernels_ms`` the largest that no class names (e.g. Inductor's fused Triton kernels)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from megatron_jetrl.runtime.profiling import by_class, kernel_launches, kernel_ms, largest
    from megatron_jetrl.rollout import SamplingParams

    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, vocab, (batch, prompt_len), generator=g).tolist()

    def profiled(new_tokens: int) -> tuple[dict[str, float], int, float]:
        params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=2)
        wall = warm_generate_s(engine, prompts, params)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.generate(prompts, params)
        return kernel_ms(prof), kernel_launches(prof), wall

    (prefill, prefill_n, prefill_s), (whole, whole_n, whole_s) = profiled(1), profiled(1 + steps)
    kernels = {k: v - prefill.get(k, 0.0) for k, v in whole.items()}
    classes = by_class(kernels, KERNEL_CLASSES)
    top = largest(kernels)
    other = largest({k: ms for k, ms in kernels.items() if by_class({k: ms}, KERNEL_CLASSES).keys() == {"other"}}, 8)
    return {"batch": batch, "steps": steps, "classes_ms": classes, "top_kernels_ms": top, "other_kernels_ms": other,
            "prefill_ms": sum(prefill.values()), "kernels_per_step": (whole_n - prefill_n) / steps,
            "wall_ms_per_step": 1e3 * (whole_s - prefill_s) / steps}


def sync_child(args) -> dict:
    """Median seconds of a sync into a level-2-asleep engine (the slowest rank's, when several):
    train TP ``--train-tp`` -> rollout TP ``--rollout-tp`` on max(train, rollout) GPUs."""
    import torch
    import torch.distributed as dist

    from benchmarks.bench_weight_sync import copy_bandwidth, make_shards
    from megatron_jetrl.models import ParallelLayout
    from megatron_jetrl.sync import SyncPlan, WeightSync

    path = args.path
    args.gpu_memory_utilization = args.sync_gpu_memory_utilization  # the trainer's shards share the GPU
    engine, recipe, start_s = _engine("fp8", args, enforce_eager=True,
                                      weight_update="reload" if path == "reload" else "in_place")
    device = torch.device("cuda", torch.cuda.current_device())
    plan = SyncPlan(engine.bridge, recipe, ParallelLayout(args.train_tp, 1), args.rollout_tp, dist.get_world_size())
    sync = WeightSync(plan, dist.get_rank(), bucket_mb=args.bucket_mb, device=device)
    shards, _ = make_shards(sync, "fp8", device)
    in_place = path == "in_place"
    engine.sleep()  # as in the RL step: the engine sleeps (level 2) while the actor trains
    report = sync.sync(shards, engine, in_place=in_place)  # warm-up
    totals, reports = [], []
    for _ in range(args.iters):
        engine.sleep()
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        reports.append(sync.sync(shards, engine, in_place=in_place))
        if path == "reload":
            engine.wake()  # closes vLLM's layerwise update
        torch.cuda.synchronize()
        took = torch.tensor([time.perf_counter() - t0], device=device)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the sync is done when its slowest rank is
        totals.append(took.item())
    engine.wake()
    copy_bw = copy_bandwidth(device)
    report = reports[-1]
    total = statistics.median(totals)
    engine.close()
    return {"path": path, "train_tp": args.train_tp, "rollout_tp": args.rollout_tp, "gpus": dist.get_world_size(),
            "total_s": total, "all_s": totals, "engine_gb": report.engine_bytes / 1e9,
            "in_place_tensors": report.in_place, "tensors": len(engine.weight_specs()),
            "phases_s": dict(report.seconds), "copy_gbps": copy_bw / 1e9,
            "floor_s": report.engine_bytes / copy_bw, "engine_start_s": start_s, "device": _device()}


def sync_name(path: str, train_tp: int, rollout_tp: int) -> str:
    """The result's name: the path alone at TP 1 -> 1 (the headline's), else with its layout."""
    return path if (train_tp, rollout_tp) == (1, 1) else f"{path}_tp{train_tp}to{rollout_tp}"


def run_child(kind: str, args, extra: list[str], *, name: str | None = None, gpus: int = 1,
              env_extra: dict[str, str] | None = None) -> dict | None:
    """Run this script as a child (one engine per process; ``gpus`` > 1: under torchrun, rank 0
    writes the result) and return its JSON, or None. ``env_extra``: more environment for the child."""
    name = name or extra[0]
    out = Path(args.work) / f"{kind}_{name}.json"
    env = {**os.environ, **_launch_env(args, extra[0] if kind == "decode" else "fp8"), "PYTHONUNBUFFERED": "1",
           **(env_extra or {})}
    script = ["-m", "benchmarks.bench_vllm", "_child", kind, *extra, "--result", str(out), *_common(args)]
    if gpus == 1:
        cmd = [sys.executable, *script]
    else:  # torchrun sets the ranks and the rendezvous
        env = {k: v for k, v in env.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                                         "MASTER_ADDR", "MASTER_PORT")}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}", *script]
    log = Path(args.work) / f"{kind}_{name}.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout,
                            cwd=ROOT).returncode
    print(f"{kind} {name}: rc={rc} in {time.perf_counter() - t0:.0f} s (log {log})", flush=True)
    if rc != 0 or not out.is_file():
        print("\n".join(log.read_text(errors="replace").splitlines()[-40:]), flush=True)
    if not out.is_file():
        return None
    result = {**json.loads(out.read_text()), "command": command_line("benchmarks.bench_vllm"),
              "invocation": args.invocation}
    out.write_text(json.dumps(result, indent=1))  # the cases that finished, when cut off
    return result


def _common(args) -> list[str]:
    return ["--layers", str(args.layers), "--prompt-len", str(args.prompt_len), "--max-len", str(args.max_len),
            "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--max-num-seqs", str(args.max_num_seqs),
            "--fp8-gemm", args.fp8_gemm, "--repeats", str(args.repeats), "--profile-batch", str(args.profile_batch)]


# ------------------------------------------------------------------------------------------ RL step


STEP_MODES = {  # name -> jetrl train overrides; the default engine's modes opt out of the exact rollout (auto)
    "fp8": ["precision.mode=fp8", "precision.exact=false"],
    "bf16": ["precision.mode=bf16", "precision.exact=false"],
    "mixed": ["precision.mode=bf16-train+fp8-rollout"],  # the off-policy recipe, for its mismatch
    "fp8-vq": ["precision.mode=fp8", "precision.exact=false",
               "rollout.vllm.activation_quant=vllm"],  # vLLM's own quantization
    "fp8kv": ["precision.mode=fp8", "precision.exact=false",
              "rollout.vllm.kv_cache_dtype=fp8"],  # + the FP8 KV cache, trainer's scales
    "fp8-exact": ["precision.mode=fp8", "precision.exact=true"],  # exact rollout: no recompute pass
    "fp8kv-exact": ["precision.mode=fp8", "rollout.vllm.kv_cache_dtype=fp8", "precision.exact=true"],
    "fp8kv-tri": ["precision.mode=fp8", "precision.exact=false", "rollout.vllm.kv_cache_dtype=fp8",
                  "rollout.vllm.attention_backend=triton_attn"],  # vLLM's Triton attention (table only)
    # the trainer attending with Transformer Engine's cuDNN kernels (table only; vllm.sh --with-te)
    "bf16-ta": ["precision.mode=bf16", "precision.exact=false", "actor.attention_impl=te"],
    "fp8-ta": ["precision.mode=fp8", "precision.exact=false", "actor.attention_impl=te"],
    "fp8kv-ta": ["precision.mode=fp8", "precision.exact=false", "rollout.vllm.kv_cache_dtype=fp8",
                 "actor.attention_impl=te"],
}


STEP_HEADLINE = {"fp8": "rl_step_vllm_fp8_over_bf16", "fp8kv": "rl_step_vllm_fp8kv_over_bf16",
                 "fp8-exact": "rl_step_exact_fp8_over_bf16", "fp8kv-exact": "rl_step_exact_fp8kv_over_bf16"}
"""The step modes whose time over BF16's (with its recompute pass) is a headline figure."""

STEP_BASELINES = {"fp8-ta": "bf16-ta", "fp8kv-ta": "bf16-ta"}
"""Step modes compared with another BF16 run than ``bf16``: the trainer attending with Transformer
Engine on both sides."""


def step_baseline(mode: str, modes) -> str:
    """The BF16 run a step mode is compared with: its ``STEP_BASELINES`` entry when that mode ran, else ``bf16``."""
    base = STEP_BASELINES.get(mode, "bf16")
    return base if base in modes else "bf16"


def env_pair(text: str) -> tuple[str, str]:
    """``--step-env``'s ``NAME=VALUE`` (VALUE may be empty) as a pair."""
    name, eq, value = text.partition("=")
    if not eq or not name or not name.replace("_", "").isalnum():
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=VALUE, e.g. "
                                         "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False")
    return name, value


def step_runs(args) -> dict:
    """``jetrl train`` at Qwen3-8B layer shapes with vLLM rollout, per mode of ``--step-modes``;
    with ``--profile`` one more step, profiled (``run.profile_steps``) and left out of the means."""
    from benchmarks.rl_summary import summarise, warm_up_steps

    results = {}
    (Path(args.work) / "step.json").write_text("{}")  # no earlier run's results left behind if every mode fails
    warm_up = warm_up_steps(args.step_offload)
    steps = 1 + len(warm_up) + args.step_steps + (1 if args.profile else 0)
    for mode in args.step_modes.split(","):
        run_dir = Path(args.work) / f"step_{mode}"
        shutil.rmtree(run_dir, ignore_errors=True)
        cmd = [sys.executable, "-m", "megatron_jetrl.cli", "train", str(ROOT / "benchmarks/configs/qwen3_8b_dims.yaml"),
               f"run.dir={run_dir}", *STEP_MODES[mode], "rollout.engine=vllm",
               f"rollout.vllm.gpu_memory_utilization={args.step_gpu_memory_utilization}",
               f"rollout.vllm.fp8_gemm={args.fp8_gemm}", f"run.steps={steps}", "log.console=false",
               f"model.config.num_hidden_layers={args.step_layers}",
               f"rollout.sampling.max_new_tokens={args.step_response_len}",
               "rollout.sampling.ignore_eos=true",  # every response max_new_tokens long: the same work per mode
               f"rollout.offload_actor={str(args.step_offload).lower()}",
               *([f"actor.max_tokens_per_microbatch={args.step_mb_tokens}"] if args.step_mb_tokens else []),
               *([f"run.profile_steps=[{steps}]"] if args.profile else []), "--skip-memory-check"]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(dict(args.step_env))
        t0 = time.perf_counter()
        with open(Path(args.work) / f"step_{mode}.log", "w") as f:
            rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
        print(f"step {mode}: rc={rc} in {time.perf_counter() - t0:.0f} s", flush=True)
        metrics = run_dir / "metrics.jsonl"
        if rc != 0 or not metrics.is_file():
            print("\n".join((Path(args.work) / f"step_{mode}.log").read_text(errors="replace").splitlines()[-40:]))
            continue
        results[mode] = summarise(metrics, untimed=(*warm_up, *((steps,) if args.profile else ())))
        results[mode]["config"] = step_config(run_dir)
        results[mode]["command"] = command_line("benchmarks.bench_vllm")
        results[mode]["device"] = _gpu_name()
        profile = run_dir / "profiles" / f"step_{steps}.json"
        if profile.is_file():
            results[mode]["profile"] = json.loads(profile.read_text())
        # after every mode: a lane cut off by the machine's time keeps the modes that finished
        (Path(args.work) / "step.json").write_text(json.dumps(results, indent=1))
    return results


STEP_TARGET_LAYERS = 16
"""The decoder layers the RL-step targets are stated for (``--step-layers``' default)."""


def step_layers_note(layers: int) -> str:
    """The headline note of a step figure measured at another layer count than the targets'."""
    if layers == STEP_TARGET_LAYERS:
        return ""
    return f"measured at {layers} decoder layers; the target is stated for {STEP_TARGET_LAYERS}"


STEP_PHASE_SPREAD = 1.2
"""A phase whose slowest timed step took more than this times its fastest is noted in the headline:
the ratio's spread then comes mostly from that phase's step-to-step variance, not from the modes."""


STEP_PHASE_SHARE = 0.1
"""...of the phases that take at least this share of the step (the others cannot move the ratio much)."""


def step_spread_note(sides: Mapping[str, Mapping[str, Sequence[float]]], only: Sequence[str] = ()) -> str:
    """The headline note naming each phase of a ratio's two sides (mode -> phase -> seconds a timed
    step) that varied by more than ``STEP_PHASE_SPREAD`` over the timed steps ("" when none did);
    with ``only``, just those phases (a ratio of one phase)."""
    varied = [f"{mode} {phase} {min(sec):.2f}-{max(sec):.2f} s" for mode, phases in sides.items()
              for phase, sec in phases.items() if phase != "step" and (not only or phase in only)
              and sec and min(sec) > 0
              and statistics.median(sec) >= STEP_PHASE_SHARE * statistics.median(phases["step"])
              and max(sec) / min(sec) > STEP_PHASE_SPREAD]
    if not varied:
        return ""
    return (f"within the run, {'; '.join(varied)} over the timed steps: the ratio moves with that "
            "step-to-step variance")


def join_notes(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


def cpu_lines(mode: str, seconds: Mapping[str, Sequence[float]], cpu: Mapping[str, Mapping[str, Sequence[float]]]
              ) -> list[str]:
    """Per phase with CPU counts (``rl_summary.CPU_PHASES``), a timed step each: wall seconds, this
    process's CPU seconds and the other processes' (the machine's less this process's)."""
    lines = []
    for phase, who in cpu.items():
        process, machine = who.get("process", []), who.get("machine", [])
        steps = [f"wall {wall:.2f} / this process {own:.2f}"
                 + (f" / others {mach - own:.2f}" if not math.isnan(mach) else "")
                 for wall, own, mach in zip(seconds.get(phase, []), process, machine or [math.nan] * len(process),
                                            strict=False)]
        if steps:
            lines.append(f"{mode:>17} {phase} CPU s a timed step: " + ", ".join(steps))
    return lines


def step_config(run_dir: Path) -> dict:
    """What the table names of a step run, read from the config the run resolved (run_dir/config.yaml,
    written by ``jetrl train``), not restated from the benchmark's arguments and the YAML's defaults."""
    import yaml

    job = yaml.safe_load((run_dir / "config.yaml").read_text())
    return {"layers": job["model"]["config"]["num_hidden_layers"],
            "response_len": job["rollout"]["sampling"]["max_new_tokens"],
            "offload_actor": job["rollout"]["offload_actor"],
            "mb_tokens": job["actor"]["max_tokens_per_microbatch"],
            "fp8_gemm": job["rollout"]["vllm"]["fp8_gemm"]}


# ------------------------------------------------------------------------------------------ table


def table(args) -> str:
    work = Path(args.work)
    load = lambda p: json.loads(p.read_text()) if p.is_file() else None  # noqa: E731
    names = list(dict.fromkeys(decode_name(mode, gemm) for mode in MODES for gemm in ("cutlass", "deep_gemm")))
    decode = {m: load(work / f"decode_{m}.json") for m in names}  # FP8 modes with DeepGEMM: their own columns
    decode = {m: d for m, d in decode.items() if d}
    sync = {f.stem[len("sync_"):]: load(f) for f in sorted(work.glob("sync_*.json"))}
    sync = {p: s for p, s in sync.items() if s}
    step = load(work / "step.json") or {}
    lines, headline = [], {}
    device = next((d["device"] for d in (*decode.values(), *sync.values()) if d), "?")
    if decode:
        cases = list(next(iter(decode.values()))["cases"])
        shapes = {d.get("layers", args.layers) for d in decode.values()}  # older results: the table's --layers
        lines.append(f"== vLLM decode, Qwen3-8B shapes ({', '.join(map(str, sorted(shapes)))} layers), random "
                     f"weights, prompt {args.prompt_len}, {device} ==")
        lines.append(f"{'case BxT':>12} " + " ".join(f"{m + ' tok/s':>12}" for m in decode)
                     + "".join(f" {m + '/bf16':>10}" for m in decode if m != "bf16"))
        for c in cases:
            row = {m: d["cases"].get(c, {}).get("tok_s") for m, d in decode.items()}
            ratios = [(row[m] / row["bf16"]) if row.get("bf16") and row[m] else None for m in decode if m != "bf16"]
            lines.append(f"{c:>12} " + " ".join(f"{row[m] or float('nan'):>12.0f}" for m in decode)
                         + "".join(f" {r:>9.2f}x" if r else f" {'—':>10}" for r in ratios))
            spans = [_tok_s(d, c) if c in d["cases"] else [] for d in decode.values()]
            lines.append(f"{'range':>12} " + " ".join(f"{f'{min(v):.0f}-{max(v):.0f} ({len(v)})' if v else '':>12}"
                                                      for v in spans))
        lines.append(f"{'start s':>12} " + " ".join(f"{d['engine_start_s']:>12.0f}" for d in decode.values()))
        for kind in ("warm", "cold"):  # the extra starts' median (how many), where a mode has them
            starts = {m: extra_starts(d, kind) for m, d in decode.items()}
            if any(starts.values()):
                lines.append(f"{kind + ' start s':>12} " + " ".join(
                    f"{f'{statistics.median(v):.0f} ({len(v)})' if v else '—':>12}" for v in starts.values()))
        lines.append(f"{'KV tokens':>12} " + " ".join(f"{d['kv_cache_tokens'] or 0:>12}" for d in decode.values()))
        lines.append(f"{'GPU GiB':>12} " + " ".join(f"{d['used_gib']:>12.1f}" for d in decode.values()))
        seeded = [m for m, d in decode.items() if d.get("dg_jit_seeded")]
        if seeded:
            lines.append(f"(start s of {', '.join(seeded)}: DeepGEMM's kernels carried from an earlier machine "
                         "(hosts/offline/jit_cache.sh), so not a cold start; --cold-start's starts are)")
        cut = [m for m, d in decode.items() if d.get("complete") is False]
        if cut:
            lines.append(f"(cut off before all cases finished: {', '.join(cut)}; missing cases show nan)")
        if shapes != {HEADLINE_LAYERS}:
            lines.append(f"(decode at {', '.join(map(str, sorted(shapes)))} layers: no headline figure, those are "
                         f"of Qwen3-8B's {HEADLINE_LAYERS} layers)")
        else:
            headline.update(decode_headline(decode, args.headline_case))
        for m, d in decode.items():
            if "profile" in d:
                p = d["profile"]
                total = sum(p["classes_ms"].values())
                lines.append(f"-- kernel time, {m}, {p['steps']} decode steps at batch {p['batch']}: {total:.1f} ms"
                             + (f" ({p['kernels_per_step']:.0f} kernels and {p['wall_ms_per_step']:.2f} ms wall "
                                "a step, unprofiled)" if "kernels_per_step" in p else ""))
                for cls, ms in sorted(p["classes_ms"].items(), key=lambda kv: -kv[1]):
                    lines.append(f"   {cls:<20} {ms:>8.1f} ms {100 * ms / total:>5.1f}%")
                for name, ms in list(p.get("top_kernels_ms", {}).items())[:8]:
                    lines.append(f"      {ms:>8.1f} ms  {name}")
            if "host_profile" in d:
                lines += host_profile_lines(m, d["host_profile"])
    if sync:
        lines.append(f"\n== sync of the 8B FP8 model into vLLM (train TP -> rollout TP; GB and floor per rank), "
                     f"{device} ==")
        lines.append(f"{'path':>15} {'TP':>6} {'total s':>9} {'engine GB':>10} {'GB/s':>7} {'floor s':>8} "
                     f"{'x floor':>8} {'in place':>9}")
        for s in sync.values():
            tp = f"{s.get('train_tp', 1)}->{s.get('rollout_tp', 1)}"
            lines.append(f"{s['path']:>15} {tp:>6} {s['total_s']:>9.4f} {s['engine_gb']:>10.2f} "
                         f"{s['engine_gb'] / s['total_s']:>7.0f} {s['floor_s']:>8.4f} "
                         f"{s['total_s'] / s['floor_s']:>7.1f}x {s['in_place_tensors']:>4}/{s['tensors']}")
        single = [s for s in sync.values() if (s.get("train_tp", 1), s.get("rollout_tp", 1)) == (1, 1)]
        if single:
            fastest = min(single, key=lambda s: s["total_s"])
            headline["vllm_sync_8b_s"] = (Figure.of(fastest.get("all_s") or [fastest["total_s"]]), fastest)
    if step:
        conf = next(iter(step.values())).get("config", {"layers": 6, "response_len": 512})  # older runs: the defaults
        timed = {mode: _step_seconds(r) for mode, r in step.items()}
        layers_note = step_layers_note(conf["layers"])
        lines.append(f"\n== RL step with vLLM rollout, Qwen3-8B layer shapes ({conf['layers']} layers, responses "
                     f"of {conf['response_len']} tokens, micro-batches of {conf.get('mb_tokens', 4096)} tokens), "
                     "median s over the timed steps ==")
        colocate = all(not math.isnan(v) for sec in timed.values() for v in sec.get("colocate", [math.nan]))
        phases = ("generate", "logprobs", "update", "sync", *(("colocate",) if colocate else ()), "step")
        lines.append(f"{'mode':>17} " + " ".join(f"{p:>9}" for p in phases)
                     + f" {'step range':>15} {'steps':>5} {'tokens/step':>11} {'k3 KL':>9}")
        for mode, r in step.items():
            sec = timed[mode]
            tokens = r.get("tokens_per_timed_step") or [r.get("tokens_per_step", float("nan"))]
            lines.append(f"{mode:>17} " + " ".join(f"{statistics.median(sec[p]):>9.3f}" for p in phases)
                         + f" {min(sec['step']):>7.2f}-{max(sec['step']):<7.2f} {len(sec['step']):>5}"
                         f" {statistics.median(tokens):>11.0f} {r.get('k3_kl', float('nan')):>9.2e}")
        equal_work = same_work(step.values())
        if not equal_work:
            lines.append("(the modes did not generate the same tokens per step: no ratio is a headline figure; "
                         "rerun with responses of fixed length, rollout.sampling.ignore_eos=true)")
        for mode in step:
            base = step_baseline(mode, step)
            if mode == base or base not in step:
                continue
            ratios = {p: Figure.ratio(timed[base][p], timed[mode][p]) for p in phases}
            lines.append(f"{base + '/' + mode:>17} " + " ".join(f"{ratios[p].value:>8.2f}x" for p in phases)
                         + f" {ratios['step'].spread[0]:>6.2f}x-{ratios['step'].spread[1]:.2f}x")
            if equal_work and base == "bf16" and mode in STEP_HEADLINE:  # the product's FP8 rollouts over BF16
                against = "the BF16 step with its logprob recompute (the same run, one mode after the other)"
                sides = {base: timed[base], mode: timed[mode]}
                note = join_notes(layers_note, step_spread_note(sides))
                headline[STEP_HEADLINE[mode]] = (ratios["step"].against(against).noted(note), step[mode])
                if mode == "fp8":
                    generate_note = step_spread_note(sides, only=("generate",))
                    headline["rl_generate_fp8_over_bf16"] = (
                        ratios["generate"].against("BF16's generate phase")
                        .noted(join_notes(layers_note, generate_note)), step[mode])
        if "fp8" in step and "fp8-exact" in step:
            exact = Figure.ratio(timed["fp8"]["step"], timed["fp8-exact"]["step"])
            lines.append(f"{'fp8/exact':>17} {exact.value:>8.2f}x step ({exact.spread[0]:.2f}x-{exact.spread[1]:.2f}x; "
                         "the exact step skips the recompute of old logprobs)")
            if equal_work:
                gemm = step["fp8"].get("config", {}).get("fp8_gemm", "the command's --fp8-gemm")
                gemm = {"auto": "DeepGEMM", "deep_gemm": "DeepGEMM", "cutlass": "CUTLASS"}.get(gemm, gemm)
                note = join_notes(layers_note, step_spread_note({"fp8": timed["fp8"], "fp8-exact": timed["fp8-exact"]}))
                headline["rl_step_exact_over_default"] = (
                    exact.against(f"the default FP8 step ({gemm}; with its logprob recompute), the same run")
                    .noted(note), step["fp8-exact"])
        retried = {mode: {phase: counts for phase, counts in r.get("alloc_retries_per_step", {}).items()
                          if any(c for c in counts if c == c)} for mode, r in step.items()}
        for mode, phases_retried in retried.items():
            if phases_retried:  # the caching allocator at the GPU's limit: a cause of wall time without kernels
                lines.append(f"{mode:>17} allocation retries a timed step: " + ", ".join(
                    f"{phase} {'/'.join(f'{c:.0f}' for c in counts)}" for phase, counts in phases_retried.items()))
        for mode, r in step.items():
            split = r.get("update_split_per_step", {})
            if "forward_backward_s" in split:  # where the update's wall time went, step by step
                lines.append(f"{mode:>17} update a timed step: " + ", ".join(
                    f"{total:.2f} s ({fb:.2f} forward+backward; micro-batch GPU ms median {med:.0f}, max {top:.0f})"
                    for total, fb, med, top in zip(*(split.get(k, []) for k in UPDATE_SPLIT), strict=False)))
        for mode, r in step.items():
            lines.extend(cpu_lines(mode, timed[mode], r.get("cpu_per_step", {})))
        for mode, r in step.items():
            if "profile" in r:
                lines.extend(profile_lines(mode, r["profile"]))
    if args.headline and headline:
        from benchmarks.headline import update

        by_run: dict[tuple[str, str], dict[str, Figure]] = {}  # one update per (device, command)
        for key, (fig, result) in headline.items():
            run = (result.get("device", device), result.get("command", LEGACY_COMMAND))
            by_run.setdefault(run, {})[key] = fig
        for (dev, command), figures in by_run.items():
            update(args.headline, figures, device=dev, command=command)
        lines.append(f"\nheadline -> {args.headline}: " + ", ".join(
            f"{k} {fig.value:.3f} ({fig.spread[0]:.3f}-{fig.spread[1]:.3f}, {fig.repeats})"
            for k, (fig, _) in headline.items()))
    return "\n".join(lines)


HEADLINE_LAYERS = 36
"""The decoder layers of the decode headline keys (Qwen3-8B's)."""
EXACT_CASES = {"128x2048": "", "256x4096": "_256x4096"}
"""The decode cases of the exact-over-default keys, and each one's key suffix."""
EXACT_PAIRS = {"vllm_exact_decode_over_default": ("fp8-exact", "fp8"),
               "vllm_exact_fp8kv_decode_over_default": ("fp8kv-exact", "fp8kv")}
"""Exact decode over the engine's default, each on DeepGEMM (the default GEMM): key -> (exact mode,
default mode)."""
LEGACY_COMMAND = "python -m benchmarks.bench_vllm (its arguments were not recorded with this result)"


def decode_headline(decode: dict[str, dict], target: str) -> dict[str, tuple[Figure, dict]]:
    """The decode results' headline figures (key -> (figure, the result it came from)): FP8 and FP8 KV
    over BF16 at ``target`` with the engine's default GEMM, exact over default FP8 (and with an FP8 KV
    cache) at ``EXACT_CASES``, both on DeepGEMM and from one invocation of the benchmark (the same
    device, back to back), and the starts of the default FP8 engine and of the exact one (the rollout's
    default with precision.exact auto), warm and cold where measured."""
    out = {}
    if "bf16" in decode and target in decode["bf16"]["cases"]:
        for m in ("fp8-deep_gemm", "fp8kv-deep_gemm"):  # the engine's default GEMM; CUTLASS: the table only
            if m in decode and target in decode[m]["cases"]:
                out[f"vllm_decode_{m.replace('-', '_')}_over_bf16"] = (
                    Figure.ratio(_tok_s(decode[m], target), _tok_s(decode["bf16"], target)).against(
                        "the BF16 engine, its default kernels (one process per mode, one after the other)"), decode[m])
    for key, (exact, default) in EXACT_PAIRS.items():
        e, d = decode.get(f"{exact}-deep_gemm"), decode.get(f"{default}-deep_gemm")
        if e is None or d is None or e.get("invocation") is None or e.get("invocation") != d.get("invocation"):
            continue
        for case, suffix in EXACT_CASES.items():
            if case in e["cases"] and case in d["cases"]:
                out[key + suffix] = (Figure.ratio(_tok_s(e, case), _tok_s(d, case)).against(
                    f"the default {default} engine: DeepGEMM, the trainer's activation quantization, vLLM's "
                    "kernels elsewhere (the same invocation and GPU)"), e)
    default = next((decode[m] for m in ("fp8-deep_gemm", "fp8") if m in decode), None)  # the engine's GEMM first
    if default is not None:
        out.update(_start_figures(default, "vllm_engine_start"))
    exact = next((decode[m] for m in ("fp8-exact-deep_gemm", "fp8-exact") if m in decode), None)
    if exact is not None:
        out.update(_start_figures(exact, "vllm_exact_engine_start"))
    return out


def _start_figures(result: dict, key: str) -> dict[str, tuple[Figure, dict]]:
    """A mode's engine starts as headline figures: ``KEY_s`` from the warm caches (decode --warm-start),
    ``KEY_cold_s`` from empty ones (--cold-start; never a run's first start, which may find the caches
    an earlier run on the machine filled). Each start is a process of its own: ``runs`` counts them."""
    out = {}
    for suffix, starts in (("_s", extra_starts(result, "warm")), ("_cold_s", extra_starts(result, "cold"))):
        if starts:
            out[key + suffix] = (dataclasses.replace(Figure.of(starts), runs=len(starts)), result)
    return out


def extra_starts(result: dict, kind: str) -> list[float]:
    """Seconds of each of a decode result's ``kind`` ("warm" or "cold") extra starts (``_extra_starts``;
    older results: the warm starts' median alone), none where the run made none."""
    starts = result.get(f"engine_start_{kind}_s_all")
    if not starts and kind == "warm" and "engine_start_warm_s" in result:
        starts = [result["engine_start_warm_s"]]
    return list(starts or [])


def _tok_s(decode: dict, case: str) -> list[float]:
    """tok/s of each timed repeat of ``case`` (older results: the one median)."""
    c = decode["cases"][case]
    return c.get("tok_s_repeats") or [c["tok_s"]]


def _step_seconds(summary: dict) -> dict[str, list[float]]:
    """Seconds per phase of each timed step of a step run (older results: the mean, once)."""
    per_step = summary.get("seconds_per_step")
    return per_step if per_step else {p: [v] for p, v in summary["seconds"].items()}


# ------------------------------------------------------------------------------------------ main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["decode", "sync", "step", "table", "_child"])
    p.add_argument("rest", nargs="*")
    p.add_argument("--modes", default="bf16,fp8,fp8kv")
    p.add_argument("--cases", default="64x512,256x512,64x4096,256x4096")
    p.add_argument("--paths", default="in_place,update_weights,reload")
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-len", type=int, default=4096, help="longest response (sizes max_model_len)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--step-gpu-memory-utilization", type=float, default=0.2)
    p.add_argument("--sync-gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--step-steps", type=int, default=3, help="step: timed steps after the first (the repeats)")
    p.add_argument("--step-modes", default="fp8,bf16", help=f"step: of {', '.join(STEP_MODES)}")
    p.add_argument("--step-layers", type=int, default=6, help="step: decoder layers at Qwen3-8B widths")
    p.add_argument("--step-response-len", type=int, default=512, help="step: max new tokens per response")
    p.add_argument("--step-mb-tokens", type=int, default=None,
                   help="step: actor.max_tokens_per_microbatch (the config's 4096 when not given; the 8B recipe "
                        "uses 18432: fewer, larger micro-batches cut the per-micro-batch gradient accumulation)")
    p.add_argument("--step-offload", action="store_true",
                   help="step: rollout.offload_actor=true (the actor waits in host memory while vLLM generates)")
    p.add_argument("--step-env", action="append", default=[], metavar="NAME=VALUE", type=env_pair,
                   help="step: an environment variable of every mode's jetrl train (repeatable), e.g. "
                        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False against the launcher's default")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--fp8-gemm", default="auto", choices=["auto", "cutlass", "deep_gemm"],
                   help="vLLM's block-FP8 GEMM (rollout.vllm.fp8_gemm); auto: the engine's default, DeepGEMM. "
                        "A DeepGEMM mode's results are named MODE-deep_gemm")
    p.add_argument("--bucket-mb", type=float, default=1024)
    p.add_argument("--train-tp", type=int, default=1, help="sync: the trainer's TP (GPUs: max of the two TPs)")
    p.add_argument("--rollout-tp", type=int, default=1, help="sync: vLLM's TP")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="decode: timed generate calls per case (median)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--warm-start", action="store_true",
                   help="decode: start each mode's engine again after its run, from the caches it left "
                        "(engine_start_warm_s: the median of --warm-start-repeats starts)")
    p.add_argument("--warm-start-repeats", type=int, default=3, help="decode --warm-start: starts per mode")
    p.add_argument("--cold-start", action="store_true",
                   help="decode: start each mode's engine again with empty caches, --cold-start-repeats times "
                        "(vllm_engine_start_cold_s: their median)")
    p.add_argument("--cold-start-repeats", type=int, default=3, help="decode --cold-start: starts per mode")
    p.add_argument("--start-only", action="store_true", help=argparse.SUPPRESS)  # _child decode: build and close only
    p.add_argument("--host-profile", action="store_true",
                   help="decode: also the host time a decode step by Python function (cProfile; --profile-batch)")
    p.add_argument("--profile-batch", type=int, default=256, help="decode --profile: sequences in the profiled steps")
    p.add_argument("--headline-case", default="256x4096")
    p.add_argument("--headline", type=Path)
    p.add_argument("--work", default="/tmp/bench_vllm")
    p.add_argument("--out", type=Path)
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--result", type=Path)
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    args.invocation = f"{os.uname().nodename}:{os.getpid()}:{time.time():.0f}"
    """This run of the benchmark: its decode results carry it, and only results of one run are paired."""
    Path(args.work).mkdir(parents=True, exist_ok=True)
    if args.command == "_child":
        kind, value = args.rest
        if kind == "decode":
            args.mode = value
            result = start_child(args) if args.start_only else decode_child(args)
        else:
            args.path = value
            result = sync_child(args)
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_rank() == 0:
            args.result.write_text(json.dumps(result, indent=1))
        if dist.is_initialized():
            dist.destroy_process_group()
        return 0
    if args.command == "decode":
        unknown = [m for m in args.modes.split(",") if m not in MODES]
        if unknown:
            p.error(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(MODES)}")
        for mode in args.modes.split(","):
            gemm = _gemm(args, mode)
            name = decode_name(mode, gemm)
            result = run_child("decode", args, [mode, "--cases", args.cases] + (["--profile"] if args.profile else [])
                               + (["--host-profile"] if args.host_profile else []),
                               name=name)
            if args.warm_start and result is not None:
                _extra_starts(args, mode, name, cold=False)
            if args.cold_start and result is not None:
                _extra_starts(args, mode, name, cold=True)
    elif args.command == "sync":
        gpus = max(args.train_tp, args.rollout_tp)
        if gpus % min(args.train_tp, args.rollout_tp):
            p.error(f"--train-tp {args.train_tp} / --rollout-tp {args.rollout_tp}: one must divide the other")
        for path in args.paths.split(","):
            run_child("sync", args, [path, "--iters", str(args.iters), "--bucket-mb", str(args.bucket_mb),
                                     "--train-tp", str(args.train_tp), "--rollout-tp", str(args.rollout_tp)],
                      name=sync_name(path, args.train_tp, args.rollout_tp), gpus=gpus)
    elif args.command == "step":
        unknown = [m for m in args.step_modes.split(",") if m not in STEP_MODES]
        if unknown:
            p.error(f"--step-modes: unknown {', '.join(unknown)}; choose from {', '.join(STEP_MODES)}")
        step_runs(args)
    else:
        print(table(args))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        for f in Path(args.work).glob("*.json"):
            shutil.copy(f, args.out / f.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
