"""Actor training-step time, FP8 vs BF16, for a model with Qwen3 shapes.

    torchrun --nproc-per-node 1 -m benchmarks.bench_actor_step --layers 12
    NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 torchrun --nproc-per-node 1 -m benchmarks.bench_actor_step \
        --layers 12 --modes bf16,fp8,fp8-te                       # + Transformer Engine's FP8 (te backend)
    torchrun --nproc-per-node 1 -m benchmarks.bench_actor_step --model qwen3-4b --profile   # all 36 layers
    torchrun --nproc-per-node 2 -m benchmarks.bench_actor_step --layers 12 --tp 2
    torchrun --nproc-per-node 1 -m benchmarks.bench_actor_step --layers 16 --modes bf16,fp8,fp8-dgw  # DeepGEMM WGrad

``--model`` qwen3-8b (default; ``--layers`` of its 36) or qwen3-4b (36 layers, hidden 2560, tied
embeddings, real vocab). The table states the LM head's share of the linear FLOPs (BF16 in every
mode: a shallow model gives it far more than a real one). ``--profile`` adds a kernel-time split of
one step per mode (GEMMs / FP8 quantization / attention / elementwise / other); ``--find-syncs``
lists where one step waits for the GPU from the host, by source line; ``--headline PATH``
writes the ``RATIOS`` whose two modes ran (benchmarks/headline.py): actor_step_fp8_over_bf16 and
logprob_fp8_over_bf16; with fp8-te, TE's FP8 step over native BF16 (other attention) and over
native FP8; with bf16-te too, over TE's BF16 (the same attention: what TE's FP8 itself gains); with
fp8-dgw (``actor.fp8_wgrad=deep_gemm``), that step over BF16; with fp8-exact / bf16-exact (the exact mode's
trainer, in vLLM's batch-invariant mode as in a job; needs vLLM, listed after the other modes), the default
step's time over the exact one's.

Random weights (megatron's init), no checkpoint. One step = ``Actor.update``: forward + backward
over packed micro-batches, DistributedOptimizer step (fp32 Adam, clipping), FP8 re-quantization.
Also timed: the forward-only logprob pass the RL loop runs for old logprobs. Both modes run in
the same process on the same device, so their ratio is measured in one run. Prints a table and
writes JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Mapping

import torch
import torch.distributed as dist


from megatron_jetrl.actor import Actor, ActorSettings, OptimizerSettings, PackedBatch  # noqa: E402
from megatron_jetrl.actor.layers import PackedCoreAttention  # noqa: E402
from megatron_jetrl.algo import ppo_clip_loss  # noqa: E402
from megatron_jetrl.models import ParallelLayout, bridge_for  # noqa: E402
from benchmarks.headline import Figure, command_line, update  # noqa: E402
from benchmarks.model_shapes import lm_head_flop_share, qwen3_shaped  # noqa: E402
from megatron_jetrl.precision import PrecisionRecipe  # noqa: E402
from megatron_jetrl.runtime.profiling import COMMUNICATION  # noqa: E402


def make_batch(vocab: int, seqs: int, seq_len: int) -> PackedBatch:
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, vocab, (seq_len,), generator=g) for _ in range(seqs)]
    mask = [torch.cat([torch.zeros(seq_len // 4), torch.ones(seq_len - seq_len // 4)]) for _ in range(seqs)]
    adv = [torch.full((seq_len,), float(torch.randn((), generator=g))) for _ in range(seqs)]
    return PackedBatch.from_sequences(tokens, loss_mask=mask, advantages=adv)


def log(what: str) -> None:
    if dist.get_rank() == 0:
        print(f"[bench] {what}: allocated {torch.cuda.memory_allocated() / 2**30:.1f} GiB, "
              f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", file=sys.stderr, flush=True)


def timed(fn, steps: int) -> list[float]:
    """Seconds of each of ``steps`` calls (the GPU synchronized around each)."""
    out = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - start)
    return out


MODES = {"bf16": ("bf16", "native", "gemm", "torch"), "fp8": ("fp8", "native", "gemm", "torch"),
         "fp8-te": ("fp8", "te", "gemm", "torch"), "bf16-te": ("bf16", "te", "gemm", "torch"),
         "fp8-dgw": ("fp8", "native", "deep_gemm", "torch"),
         "bf16-ta": ("bf16", "native", "gemm", "te"), "fp8-ta": ("fp8", "native", "gemm", "te")}
EXACT_MODES = {"fp8-exact": "fp8", "bf16-exact": "bf16"}
"""--modes with ``precision.exact``: the native layers of that mode computing their forward with the kernels
vLLM's exact engine runs (``ops/exact.py``). As in an RL job, the process is in vLLM's batch-invariant mode
(``init_batch_invariance``, which vLLM's worker calls in a job; process-wide: cuBLAS without split-K, vLLM's
softmax / mean / bmm kernels), so exact modes run after all others."""
MODES.update({name: MODES[base] for name, base in EXACT_MODES.items()})

"""--modes: name -> (precision.mode, actor.fp8_backend, actor.fp8_wgrad, actor.attention_impl). fp8-dgw is
the native FP8 step with DeepGEMM's WGrad accumulating into the fp32 main grads. fp8-te is Transformer
Engine's layer spec; TE must be imported with the recipe's environment: NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1
torchrun ... bf16-te is TE's layer spec in BF16 (its fused norms and cuDNN attention, BF16 GEMMs): TE's
FP8 against it gains only what FP8 GEMMs gain. bf16-ta / fp8-ta are the native layers attending with TE's
DotProductAttention (cuDNN), the attention TE's layer spec runs. A te mode whose actor built the native
layers stops before timing rather than time them under TE's name."""

RATIOS = {  # headline key -> (baseline mode, measured mode, timings)
    "actor_step_fp8_over_bf16": ("bf16", "fp8", "step_s_all"),
    "logprob_fp8_over_bf16": ("bf16", "fp8", "logprob_s_all"),
    "actor_step_te_fp8_over_bf16": ("bf16", "fp8-te", "step_s_all"),
    "actor_step_te_fp8_over_te_bf16": ("bf16-te", "fp8-te", "step_s_all"),
    "actor_step_te_fp8_over_fp8": ("fp8", "fp8-te", "step_s_all"),
    "actor_step_fp8_deep_gemm_wgrad_over_bf16": ("bf16", "fp8-dgw", "step_s_all"),
    "actor_step_fp8_over_bf16_te_attention": ("bf16-ta", "fp8-ta", "step_s_all"),
    "actor_step_te_fp8_over_fp8_te_attention": ("fp8-ta", "fp8-te", "step_s_all"),
    "actor_step_exact_fp8_over_fp8": ("fp8", "fp8-exact", "step_s_all"),
    "actor_step_exact_bf16_over_bf16": ("bf16", "bf16-exact", "step_s_all"),
}
"""The speed-ups the benchmark reports: median baseline time / median measured time (> 1: the
measured mode is faster), spread over the paired repeats (``Figure.ratio``)."""


def speedups(by_mode: Mapping[str, Mapping]) -> dict[str, Figure]:
    """The ``RATIOS`` whose two modes both ran, from each mode's row (``run_mode``)."""
    return {key: Figure.ratio(by_mode[base][timings], by_mode[measured][timings]).against(
                f"the {base} mode's {timings.split('_')[0]} in the same process, steps paired one by one")
            for key, (base, measured, timings) in RATIOS.items() if base in by_mode and measured in by_mode}


def actor_settings(mode: str, args) -> ActorSettings:
    """The actor of ``mode`` as the benchmark builds it (and plans its memory)."""
    precision, backend, wgrad, attention = MODES[mode]
    return ActorSettings(
        parallel=ParallelLayout(tp=args.tp, sequence_parallel=args.tp > 1),
        precision=PrecisionRecipe(mode=precision, exact=mode in EXACT_MODES), max_tokens_per_microbatch=args.mb_tokens,
        optimizer=OptimizerSettings(lr=1e-6), fp8_backend=backend, fp8_wgrad=wgrad, logprob_impl=args.logprob_impl,
        elementwise_impl=args.elementwise_impl, attention_impl=attention,
    )


def enter_exact_process(recipe: PrecisionRecipe) -> None:
    """Put this process where an exact job's trainer runs: vLLM's environment for the recipe (the
    launcher's ``engine_env``) and vLLM's batch-invariant mode, as vLLM's worker enters it at engine start."""
    import importlib

    from megatron_jetrl.ops.exact import BATCH_INVARIANT_MODULES
    from megatron_jetrl.rollout.vllm_engine import VllmOptions, engine_env

    os.environ.update(engine_env(recipe, VllmOptions()))
    for name in BATCH_INVARIANT_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        module.init_batch_invariance()
        return
    raise SystemExit("bench_actor_step: the exact modes need vLLM (its batch-invariant kernels)")


def run_mode(mode: str, args, bridge) -> dict:
    precision, backend, _, _ = MODES[mode]
    actor = Actor(bridge, actor_settings(mode, args))
    if backend == "te" and any(isinstance(m, PackedCoreAttention) for m in actor.gpt.modules()):
        actor.close()
        raise SystemExit(f"bench_actor_step: --modes {mode}: actor.fp8_backend=te with precision.mode {precision} "
                         "built the native layers (megatron_jetrl/actor/build.py layer_spec); timing them would "
                         "not measure Transformer Engine")
    log(f"{mode}: built")
    batch = make_batch(bridge.dims.vocab_size, args.seqs, args.seq_len)
    batch.fields["old_logprobs"] = actor.compute_logprobs(batch).logprobs  # type: ignore[index]
    log(f"{mode}: logprobs")
    for i in range(args.warmup):
        actor.update(batch, ppo_clip_loss)
        log(f"{mode}: warmup step {i}")
    torch.cuda.reset_peak_memory_stats()
    step_all = timed(lambda: actor.update(batch, ppo_clip_loss), args.steps)
    logprob_all = timed(lambda: actor.compute_logprobs(batch), args.steps)
    step_s, logprob_s = statistics.median(step_all), statistics.median(logprob_all)
    peak = torch.cuda.max_memory_allocated()
    if dist.get_rank() == 0:
        print(f"[bench] {mode}: step {step_s:.3f} s ({min(step_all):.3f}-{max(step_all):.3f}), logprobs "
              f"{logprob_s:.3f} s ({min(logprob_all):.3f}-{max(logprob_all):.3f}), median of {args.steps}",
              file=sys.stderr, flush=True)
    profile = kernel_split(lambda: actor.update(batch, ppo_clip_loss)) if args.profile else None
    lp_profile = kernel_split(lambda: actor.compute_logprobs(batch)) if args.profile else None
    syncs = host_syncs(lambda: actor.update(batch, ppo_clip_loss)) if args.find_syncs else None
    actor.close()
    gc.collect()
    torch.cuda.empty_cache()
    log(f"{mode}: closed")
    tokens = batch.tokens.numel()
    world = dist.get_world_size()
    return {"mode": mode, "step_s": step_s, "logprob_s": logprob_s, "step_s_all": step_all,
            "logprob_s_all": logprob_all, "tokens": tokens,
            "step_tok_s_gpu": tokens / step_s / world, "logprob_tok_s_gpu": tokens / logprob_s / world,
            "peak_gib": peak / 2**30, "profile_ms": profile and profile["classes"],
            "top_kernels_ms": profile and profile["top"], "top_ops_ms": profile and profile["ops"],
            "logprob_profile_ms": lp_profile and lp_profile["classes"],
            "logprob_top_kernels_ms": lp_profile and lp_profile["top"], "host_syncs": syncs}


def write_json(args, device: str, rows: list[dict], complete: bool) -> None:
    """``--json``: the arguments, the device and the rows of the modes run so far (``complete``: all of them)."""
    plain = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    args.json.write_text(json.dumps({"args": plain, "device": device, "complete": complete, "rows": rows}, indent=1))


def host_syncs(step) -> dict[str, int]:
    """Where one ``step()`` waits for the GPU from the host: torch's sync debug mode warns at each
    synchronizing CUDA call; counted by the Python line that made it (most first)."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    root = str(Path(__file__).resolve().parents[1]) + os.sep
    where: dict[str, int] = {}
    for w in caught:
        if "synchroniz" in str(w.message):
            key = f"{w.filename.replace(root, '')}:{w.lineno}"
            where[key] = where.get(key, 0) + 1
    return dict(sorted(where.items(), key=lambda kv: -kv[1]))


KERNEL_CLASSES = (  # first match wins: FA3 kernels are CUTLASS kernels, FP8 GEMMs name e4m3
    COMMUNICATION,  # TP's collectives (their names hold "reduce" and "cat")
    ("attention", r"flash|fmha|attn|attention|softmax"),
    ("gemm", r"gemm|cutlass|nvjet|xmma|sm90_|scaled_mm|splitk|cublas|matmul"),
    ("fp8 quantization", r"quant|fp8|cast_to|e4m3|amax|scale"),
    ("elementwise", r"elementwise|vectorized|unrolled|reduce|norm|silu|rotary|rope|add|mul|copy|cat|fill"),
)


def kernel_split(step) -> dict[str, dict[str, float]]:
    """GPU kernel time (ms) of one ``step()``: ``classes`` (GEMMs, FP8 quantization, attention,
    elementwise, other), ``top`` (the 25 longest kernels) and ``ops`` (the 25 torch operators whose
    own kernels took longest: which ``aten::`` call launched the elementwise kernels)."""
    from torch.profiler import ProfilerActivity, profile

    from megatron_jetrl.runtime.profiling import by_class, kernel_ms, largest, operator_ms

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = kernel_ms(prof)
    top, ops = largest(kernels, 25), largest(operator_ms(prof), 25)
    return {"classes": by_class(kernels, KERNEL_CLASSES), "top": top, "ops": ops}


def trainer_gib(layers: int, mode: str, args) -> float:
    """The memory plan's trainer bytes (``job/estimate.py``: weights, fp32 grads and Adam, FP8
    copies, activations) of ``mode`` at ``layers``, in GiB, with the ~5 % the measured peaks add to
    it: at 16 layers of Qwen3-8B widths the plan says 99 / 105 GiB (BF16 / FP8) where an H200 measured
    103 / 108 GiB; 12 layers, 82 / 86 GiB by the plan, ran out of an H100's 79 GiB."""
    from megatron_jetrl.job.estimate import GiB, estimate_memory
    from megatron_jetrl.rollout.settings import RolloutSettings

    plan = estimate_memory(bridge_for(qwen3_shaped(args.model, layers)), actor_settings(mode, args),
                           RolloutSettings(offload_actor=True), args.seq_len, args.tp)
    return PEAK_OVER_PLAN * plan.trainer_total / GiB


PEAK_OVER_PLAN = 1.05
"""Measured peak over the plan's trainer bytes (1.045 BF16, 1.031 FP8 at 16 layers on an H200)."""


def check_memory(args, capacity_gib: float) -> None:
    """Stop before building anything when a mode's plan is over the GPU, naming the layer count that fits."""
    modes = args.modes.split(",")
    need = max(trainer_gib(args.layers, m, args) for m in modes)
    if need <= capacity_gib:
        return
    fits = next((n for n in range(args.layers - 1, 0, -1)
                 if max(trainer_gib(n, m, args) for m in modes) <= capacity_gib), None)
    fix = f"use --layers {fits}" if fits else "use a larger GPU or --tp"
    raise SystemExit(f"bench_actor_step: --layers {args.layers}: the trainer needs ~{need:.0f} GiB per GPU (memory "
                     f"plan) and this GPU has {capacity_gib:.0f} GiB: {fix} (or --skip-memory-check)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b", choices=["qwen3-8b", "qwen3-4b"])
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: 12 of Qwen3-8B; all of 4B)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--mb-tokens", type=int, default=8192)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--modes", default="bf16,fp8", help=f"of {', '.join(MODES)}")
    ap.add_argument("--logprob-impl", default="compiled", choices=["eager", "compiled"],
                    help="actor.logprob_impl for every mode (the vocabulary logprob/entropy arithmetic)")
    ap.add_argument("--elementwise-impl", default="compiled", choices=["eager", "compiled"],
                    help="actor.elementwise_impl for every mode (the decoder layers' SwiGLU and RoPE)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--headline", type=Path)
    ap.add_argument("--skip-memory-check", action="store_true",
                    help="build even where the memory plan says the modes do not fit the GPU")
    ap.add_argument("--find-syncs", action="store_true",
                    help="list where one step synchronizes the host with the GPU (torch's sync debug mode)")
    return ap


def main() -> int:
    ap = build_parser()
    args = ap.parse_args()
    if args.layers is None:
        args.layers = 12 if args.model == "qwen3-8b" else 36
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        raise SystemExit(f"bench_actor_step: --modes {','.join(unknown)}: choose from {', '.join(MODES)}")
    modes = args.modes.split(",")
    if any(m in EXACT_MODES for m in modes) and modes != sorted(modes, key=lambda m: m in EXACT_MODES):
        raise SystemExit(f"bench_actor_step: --modes {args.modes}: the exact modes ({', '.join(EXACT_MODES)}) turn "
                         "the process batch-invariant for good: list them after the others")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not args.skip_memory_check:
        check_memory(args, torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30)
    dist.init_process_group("nccl")
    config = qwen3_shaped(args.model, args.layers)
    bridge = bridge_for(config)
    name = torch.cuda.get_device_name()
    rows = []
    for m in args.modes.split(","):
        if m in EXACT_MODES:
            enter_exact_process(actor_settings(m, args).precision)
        rows.append(run_mode(m, args, bridge))
        if args.json and dist.get_rank() == 0:  # after every mode: a run cut off keeps the modes it finished
            write_json(args, name, rows, complete=len(rows) == len(args.modes.split(",")))
    if dist.get_rank() == 0:
        print(f"\nactor step, {args.model} shapes x {args.layers} layers (+ 151936 vocab; LM head "
              f"{100 * lm_head_flop_share(config):.1f}% of the linear FLOPs), TP={args.tp}, "
              f"{dist.get_world_size()} x {name}, {args.seqs} x {args.seq_len} tokens/step, "
              f"micro-batch {args.mb_tokens} tokens, logprob_impl {args.logprob_impl}, "
              f"elementwise_impl {args.elementwise_impl}")
        print(f"{'mode':10} {'step s':>8} {'tok/s/GPU':>10} {'logprob s':>10} {'tok/s/GPU':>10} {'peak GiB':>9}")
        for r in rows:
            print(f"{r['mode']:10} {r['step_s']:8.3f} {r['step_tok_s_gpu']:10.0f} {r['logprob_s']:10.3f} "
                  f"{r['logprob_tok_s_gpu']:10.0f} {r['peak_gib']:9.1f}")
        for what, key in (("one step", "profile_ms"), ("one logprob pass", "logprob_profile_ms")):
            for r in rows:
                if r[key]:
                    total = sum(r[key].values())
                    split = ", ".join(f"{c} {ms:.0f} ms ({100 * ms / total:.0f}%)"
                                      for c, ms in sorted(r[key].items(), key=lambda kv: -kv[1]))
                    print(f"kernel time of {what}, {r['mode']}: {total:.0f} ms = {split}")
        for r in rows:
            for kernel, ms in list((r["top_kernels_ms"] or {}).items())[:12]:
                print(f"  {r['mode']:10} {ms:8.1f} ms  {kernel}")
            for op, ms in list((r["top_ops_ms"] or {}).items())[:15]:
                print(f"  {r['mode']:10} {ms:8.1f} ms  {op} (its own kernels)")
        for r in rows:
            if r["host_syncs"] is not None:
                print(f"host synchronizations in one step, {r['mode']}: {sum(r['host_syncs'].values())}")
                for where, n in list(r["host_syncs"].items())[:15]:
                    print(f"  {n:>5}  {where}")
        figures = speedups({r["mode"]: r for r in rows})
        for key, fig in figures.items():
            base, measured, timings = RATIOS[key]
            print(f"{measured} over {base}, {timings.split('_')[0]}: {fig.value:.2f}x ({fig.spread[0]:.2f}-"
                  f"{fig.spread[1]:.2f}, median of {fig.repeats})  {key}")
        if args.headline and figures:
            update(args.headline, figures, device=name, command=command_line("benchmarks.bench_actor_step"))
        elif args.headline:
            print(f"--headline: no two modes of a headline ratio ran; {args.headline} not written", file=sys.stderr)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
