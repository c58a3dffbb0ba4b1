"""FP8 block-scaled linear vs BF16 at Qwen3-8B linear shapes, and the quantization kernels' bandwidth.

Prints one table per section, all measured in this one run on one device:
  1. TFLOP/s of FProp, DGrad and WGrad: BF16 (torch matmul) vs FP8 (blockwise scaled_mm on
     pre-quantized operands).
  2. The whole linear forward + backward: BF16 autograd vs ``fp8_block_linear`` with the native
     quantizer, including activation and gradient quantization; once with the weight quantized
     every iteration (one micro-batch per step) and once with it cached (the step's other
     micro-batches), and the speedup of each.
  3. Quantization kernels: GB/s (bytes read + written) against a device-to-device copy's GB/s.
Where DeepGEMM imports (a pip install or vLLM's vendored copy), also WGrad into an fp32 main grad:
today's scaled_mm + fp32 add against DeepGEMM's SM90 1D1D kernel, which accumulates in place
(``actor.fp8_wgrad=deep_gemm``, ``ops/deep_gemm.py``: the candidate for a faster WGrad, which bounds
the FP8 step).

Usage (GPU host):  python -m benchmarks.bench_fp8_linear [--tokens 16384] [--json out.json] [--headline PATH]
``--headline`` writes linear_fp8_over_bf16 (a whole layer's linears, fwd+bwd incl. quantization, weight
cached as in a step's micro-batches) into docs/results/headline.json's format (benchmarks/headline.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch


from megatron_jetrl.ops import NativeQuantizer, quantize_1x128, quantize_128x128  # noqa: E402
from megatron_jetrl.ops.deep_gemm import DeepGemmUnavailable, deep_gemm, wgrad_into  # noqa: E402
from megatron_jetrl.precision import Fp8WeightCache, fp8_block_linear, fp8_gemm  # noqa: E402

SHAPES = {  # name: (in_features K, out_features N), Qwen3-8B
    "qkv": (4096, 6144),
    "o": (4096, 4096),
    "gate+up": (4096, 24576),
    "down": (12288, 4096),
}


def bench(fn, warmup: int = 3, iters: int = 15) -> float:
    """Median milliseconds of ``fn`` over ``iters`` runs (see ``bench_interleaved``)."""
    return bench_interleaved({"fn": fn}, warmup, iters)["fn"]


def bench_interleaved(fns: dict, warmup: int = 3, iters: int = 15) -> dict:
    """Median milliseconds of each function, each call timed with its own pair of CUDA events.

    Calls are issued back to back and synchronized only at the end, as in training, where the host
    runs ahead of the GPU: a host-side cost per call (Python, cuBLASLt's heuristic query) counts
    only if it starves the GPU. Variants are timed round-robin so clock and power drift over the
    run affect every variant alike.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    events = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {name: statistics.median(s.elapsed_time(e) for s, e in pairs) for name, pairs in events.items()}


def gemm_rows(tokens: int, name: str, K: int, N: int, q: NativeQuantizer) -> list[dict]:
    x = torch.randn(tokens, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5
    dy = torch.randn(tokens, N, device="cuda", dtype=torch.bfloat16)
    x_row, x_col = q.quantize_groups(x, rowwise=True, columnwise=True)
    dy_row, dy_col = q.quantize_groups(dy, rowwise=True, columnwise=True)
    fw = q.quantize_weight(w)
    t = bench_interleaved(
        {
            "bf16 fprop": lambda: x @ w.t(),
            "bf16 dgrad": lambda: dy @ w,
            "bf16 wgrad": lambda: dy.t() @ x,
            "fp8 fprop": lambda: fp8_gemm(x_row, fw.fprop, torch.bfloat16, "scaled_mm"),
            "fp8 dgrad": lambda: fp8_gemm(dy_row, fw.dgrad, torch.bfloat16, "scaled_mm"),
            "fp8 wgrad": lambda: fp8_gemm(dy_col, x_col, torch.bfloat16, "scaled_mm"),
        }
    )
    flop = 2 * tokens * K * N
    return [
        {
            "shape": name,
            "gemm": gemm,
            "bf16_tflops": flop / t[f"bf16 {gemm}"] / 1e9,
            "fp8_tflops": flop / t[f"fp8 {gemm}"] / 1e9,
            "speedup": t[f"bf16 {gemm}"] / t[f"fp8 {gemm}"],
            "bf16_ms": t[f"bf16 {gemm}"],
            "fp8_ms": t[f"fp8 {gemm}"],
        }
        for gemm in ("fprop", "dgrad", "wgrad")
    ]


def wgrad_row(tokens: int, name: str, K: int, N: int, q: NativeQuantizer) -> dict:
    """WGrad as training runs it, into an fp32 main grad: torch's blockwise ``scaled_mm`` to BF16
    then the fp32 add (today's path) against DeepGEMM's SM90 1D1D kernel (1x128 groups along the
    tokens on both operands, as the trainer quantizes them), which accumulates in fp32 into the
    main grad itself. Same operands; ``rel_diff``: one product, DeepGEMM's fp32 result against
    scaled_mm's BF16-rounded one, relative to its largest value."""
    x = torch.randn(tokens, K, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(tokens, N, device="cuda", dtype=torch.bfloat16)
    _, x_col = q.quantize_groups(x, rowwise=False, columnwise=True)
    _, dy_col = q.quantize_groups(dy, rowwise=False, columnwise=True)
    main_a = torch.zeros(N, K, device="cuda", dtype=torch.float32)
    main_b = torch.zeros_like(main_a)
    t = bench_interleaved({
        "scaled_mm + add": lambda: main_a.add_(fp8_gemm(dy_col, x_col, torch.bfloat16, "scaled_mm")),
        "deep_gemm": lambda: wgrad_into(dy_col, x_col, main_b),
    })
    one = torch.zeros_like(main_a)
    wgrad_into(dy_col, x_col, one)
    ref = fp8_gemm(dy_col, x_col, torch.bfloat16, "scaled_mm").float()
    return {"shape": name, "scaled_mm_add_ms": t["scaled_mm + add"], "deep_gemm_ms": t["deep_gemm"],
            "deep_gemm_tflops": 2 * tokens * K * N / t["deep_gemm"] / 1e9,
            "speedup": t["scaled_mm + add"] / t["deep_gemm"],
            "rel_diff": ((one - ref).abs().max() / ref.abs().max()).item()}


def gemm_section(tokens: int) -> list[dict]:
    q = NativeQuantizer()
    rows = [row for name, (K, N) in SHAPES.items() for row in gemm_rows(tokens, name, K, N, q)]
    torch.cuda.empty_cache()
    return rows


def linear_row(tokens: int, name: str, K: int, N: int, q: NativeQuantizer) -> dict:
    x = torch.randn(tokens, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    # Megatron's model parameters are BF16 (fp32 master copies live in the optimizer), so both
    # paths take the same BF16 weight and produce a BF16 weight gradient.
    w = (torch.randn(N, K, device="cuda") * K**-0.5).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(tokens, N, device="cuda", dtype=torch.bfloat16)
    cache = Fp8WeightCache()
    t = bench_interleaved(
        {
            "bf16": lambda: torch.nn.functional.linear(x, w).backward(dy),
            "requant": lambda: fp8_block_linear(x, w, quantizer=q).backward(dy),
            "cached": lambda: fp8_block_linear(x, w, quantizer=q, cache=cache).backward(dy),
        },
        iters=21,
    )
    return {
        "shape": name,
        "bf16_ms": t["bf16"],
        "fp8_ms_weight_quant": t["requant"],
        "fp8_ms_weight_cached": t["cached"],
        "speedup_weight_quant": t["bf16"] / t["requant"],
        "speedup_weight_cached": t["bf16"] / t["cached"],
    }


def linear_section(tokens: int) -> list[dict]:
    q = NativeQuantizer()
    rows = []
    for name, (K, N) in SHAPES.items():
        rows.append(linear_row(tokens, name, K, N, q))
        torch.cuda.empty_cache()
    return rows


def layer_total(linears: list[dict]) -> dict:
    """The layer's row of the linear table: the four linears' milliseconds summed, and its speed-ups."""
    keys = ("bf16_ms", "fp8_ms_weight_quant", "fp8_ms_weight_cached")
    total = {"shape": "layer", **{k: sum(r[k] for r in linears) for k in keys}}
    total["speedup_weight_quant"] = total["bf16_ms"] / total["fp8_ms_weight_quant"]
    total["speedup_weight_cached"] = total["bf16_ms"] / total["fp8_ms_weight_cached"]
    return total


def copy_gbs() -> float:
    """Device-to-device copy of 1 GiB: bytes read + written per second, the bandwidth ceiling."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / bench(lambda: dst.copy_(src)) / 1e6


def quant_section(tokens: int) -> tuple[float, list[dict]]:
    copy = copy_gbs()
    rows = []
    x = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(tokens, 24576, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(24576, 4096, device="cuda", dtype=torch.float32)
    def cdiv(a, b):
        return (a + b - 1) // b

    def out_bytes(t, rowwise=False, columnwise=False, block=False, transpose=False):
        M, K = t.shape
        n = 0
        if rowwise:
            n += M * K + 4 * M * cdiv(K, 128)
        if columnwise:
            n += M * K + 4 * K * cdiv(M, 128)
        if block:
            n += M * K * (2 if transpose else 1) + 4 * cdiv(M, 128) * cdiv(K, 128)
        return t.numel() * t.element_size() + n

    cases = [
        ("act 1x128 rowwise", x, lambda: quantize_1x128(x, rowwise=True, columnwise=False), out_bytes(x, rowwise=True)),
        ("act 1x128 along tokens", x, lambda: quantize_1x128(x, rowwise=False, columnwise=True),
         out_bytes(x, columnwise=True)),
        ("grad 1x128 both (fused)", dy, lambda: quantize_1x128(dy, rowwise=True, columnwise=True),
         out_bytes(dy, rowwise=True, columnwise=True)),
        ("weight 128x128 fp32", w, lambda: quantize_128x128(w), out_bytes(w, block=True)),
        ("weight 128x128 + transpose", w, lambda: quantize_128x128(w, with_transpose=True),
         out_bytes(w, block=True, transpose=True)),
    ]
    for name, t, fn, nbytes in cases:
        M, K = t.shape
        ms = bench(fn)
        gbs = nbytes / ms / 1e6
        rows.append({"kernel": name, "shape": f"{M}x{K} {str(t.dtype).split('.')[-1]}", "ms": ms, "gbs": gbs,
                     "of_copy": gbs / copy})
    return copy, rows


def profile_section(tokens: int, shape: str) -> list[tuple[str, float, int]]:
    """Per-kernel CUDA time of one FP8 linear forward+backward (weight cached), to show where the
    time goes: the three GEMMs, the quantization kernels, and everything else."""
    from torch.profiler import ProfilerActivity, profile

    K, N = SHAPES[shape]
    q = NativeQuantizer()
    x = torch.randn(tokens, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(N, K, device="cuda") * K**-0.5).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(tokens, N, device="cuda", dtype=torch.bfloat16)
    cache = Fp8WeightCache()
    for _ in range(3):
        fp8_block_linear(x, w, quantizer=q, cache=cache).backward(dy)
    torch.cuda.synchronize()
    steps = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fp8_block_linear(x, w, quantizer=q, cache=cache).backward(dy)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0 and e.count > 0:
            rows.append((e.key, us / steps / 1000.0, e.count // steps))
    rows.sort(key=lambda r: -r[1])
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384, help="tokens (rows of x) per GEMM; default 16384")
    parser.add_argument("--json", help="also write all numbers to this JSON file")
    parser.add_argument("--profile", default="gate+up", choices=[*SHAPES, "none"],
                        help="shape whose FP8 linear step is broken down per kernel (default gate+up)")
    parser.add_argument("--headline", help="write linear_fp8_over_bf16 into this headline JSON file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fp8_linear: needs a CUDA GPU (Hopper for FP8 GEMMs)", file=sys.stderr)
        return 2
    if args.tokens <= 0:
        parser.error("--tokens must be positive")
    device = torch.cuda.get_device_name()
    print(f"device: {device}; torch {torch.__version__}; tokens {args.tokens}", flush=True)

    gemms = gemm_section(args.tokens)
    print("\n== GEMM TFLOP/s (pre-quantized operands) ==")
    print(f"{'shape':<8} {'gemm':<6} {'bf16':>8} {'fp8':>8} {'fp8/bf16':>9}")
    for r in gemms:
        print(f"{r['shape']:<8} {r['gemm']:<6} {r['bf16_tflops']:8.0f} {r['fp8_tflops']:8.0f} {r['speedup']:8.2f}x")
    bf16_ms = sum(r["bf16_ms"] for r in gemms)
    fp8_ms = sum(r["fp8_ms"] for r in gemms)
    print(f"all 12 GEMMs of a layer: bf16 {bf16_ms:.3f} ms, fp8 {fp8_ms:.3f} ms, {bf16_ms / fp8_ms:.2f}x "
          "(the ceiling for the whole linear: quantization only adds to the fp8 side)")

    wgrads = []
    try:
        dg = deep_gemm()
    except DeepGemmUnavailable as e:
        print(f"\n(no DeepGEMM WGrad rows: {e})")
    else:
        q = NativeQuantizer()
        try:  # a probe of a third-party kernel: its failure is reported, the suite goes on
            wgrads = [wgrad_row(args.tokens, name, K, N, q) for name, (K, N) in SHAPES.items()]
        except Exception as e:  # noqa: BLE001
            print(f"\n(DeepGEMM WGrad rows failed: {type(e).__name__}: {e})")
        if wgrads:
            print(f"\n== WGrad into an fp32 main grad: scaled_mm + add vs DeepGEMM 1D1D ({dg.__name__}) ==")
            print(f"{'shape':<8} {'scaled_mm+add':>14} {'deep_gemm':>10} {'TFLOP/s':>8} {'speedup':>8} "
                  f"{'rel diff':>9}")
        for r in wgrads:
            print(f"{r['shape']:<8} {r['scaled_mm_add_ms']:11.3f} ms {r['deep_gemm_ms']:7.3f} ms "
                  f"{r['deep_gemm_tflops']:8.0f} {r['speedup']:7.2f}x {r['rel_diff']:9.1e}")

    linears = linear_section(args.tokens)
    print("\n== Linear forward+backward incl. quantization (ms) ==")
    print(f"{'shape':<8} {'bf16':>7} {'fp8+wq':>7} {'fp8':>7} {'speedup+wq':>11} {'speedup':>8}")
    total = layer_total(linears)
    for r in [*linears, total]:
        print(f"{r['shape']:<8} {r['bf16_ms']:7.3f} {r['fp8_ms_weight_quant']:7.3f} {r['fp8_ms_weight_cached']:7.3f} "
              f"{r['speedup_weight_quant']:10.2f}x {r['speedup_weight_cached']:7.2f}x")

    if args.headline:
        from benchmarks.headline import Figure, command_line, update

        # the layer's speed-up again, twice more (each a sum of per-shape medians): three repeats
        again = [total["speedup_weight_cached"]]
        again += [layer_total(linear_section(args.tokens))["speedup_weight_cached"] for _ in range(2)]
        figure = Figure.of(again).against("the BF16 linear (the same shapes and tokens, calls interleaved)")
        update(args.headline, {"linear_fp8_over_bf16": figure}, device=device,
               command=command_line("benchmarks.bench_fp8_linear"))

    copy, quants = quant_section(args.tokens)
    print(f"\n== Quantization kernels (device copy: {copy:.0f} GB/s read+write) ==")
    print(f"{'kernel':<28} {'input':<20} {'ms':>7} {'GB/s':>7} {'of copy':>8}")
    for r in quants:
        print(f"{r['kernel']:<28} {r['shape']:<20} {r['ms']:7.3f} {r['gbs']:7.0f} {r['of_copy']:7.0%}")

    profile = []
    if args.profile != "none":
        profile = profile_section(args.tokens, args.profile)
        total = sum(ms for _, ms, _ in profile)
        print(f"\n== Profile: FP8 linear fwd+bwd, {args.profile}, weight cached ({total:.3f} ms of kernels) ==")
        print(f"{'kernel':<70} {'ms':>7} {'share':>6} {'calls':>5}")
        for name, ms, calls in profile[:12]:
            print(f"{name[:70]:<70} {ms:7.3f} {ms / total:6.1%} {calls:5d}")

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "torch": torch.__version__, "tokens": args.tokens, "gemm": gemms,
                       "wgrad_deep_gemm": wgrads,
                       "linear": linears, "copy_gbs": copy, "quant": quants,
                       "profile": [{"kernel": k, "ms": ms, "calls": c} for k, ms, c in profile]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
