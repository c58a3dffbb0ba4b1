"""The exact engine's fused norm and activation kernels against vLLM's for the same work, µs a call.

The exact decode's profile puts its gap to the default engine here: ``rms_norm_quant`` took 10.2 µs a
call at 128 rows (Qwen3-8B × 36, batch 128), where a 1x128 quantization of the same rows took 3.3 µs.
This suite times each op alone, so a kernel change is measured in a minute instead of a decode run.

Ops, each at Qwen3-8B widths and at decode and prefill row counts (``--rows``):
- **add + RMSNorm + 1x128 FP8 quantization** (before the QKV and gate/up linears):
  - exact: ``ops.exact.rms_norm_quant``, one kernel;
  - exact in two kernels: ``add_rms_norm`` then the trainer's quantization (the same bytes, tested);
  - vLLM's fused kernel, ``rms_norm_per_block_quant``;
  - vLLM's ``fused_add_rms_norm`` then the trainer's quantization: what the default engine runs
    with ``activation_quant: trainer``.
- **SiLU·mul + 1x128 FP8 quantization** (before the down projection):
  - exact: ``ops.exact.silu_mul_quant``;
  - exact in two kernels: ``silu_mul`` then the trainer's quantization (the same bytes, tested);
  - vLLM's fused ``silu_and_mul_per_block_quant``;
  - vLLM's ``silu_and_mul`` then the trainer's quantization.
- **q/k norm + rotary embedding** (each head of q and k, head dim 128, Qwen3-8B's 32 + 8 heads a token):
  - exact: ``ops.exact.qk_norm_rope``, one kernel (a warp a head);
  - exact in two kernels: the head norm then ``rope`` (what the trainer runs; the same bytes, tested);
  - Inductor: torch.compile of the eager reference, as the default engine compiles its q/k norms and
    rotary embedding into Triton kernels (an approximation: vLLM fuses them with what surrounds them).
- **floor**: a device copy of the bytes the op must read and write.

Timing: ``--calls`` back-to-back calls of one variant captured in a CUDA graph, as vLLM's decode
replays them (no launch gaps), replayed once per repeat. The variants take turns each repeat, so
clock drift affects them alike. The table gives µs a call: the median over ``--repeats`` and the
spread. Without vLLM only the exact kernels and the floor run.

Usage (GPU):  python -m benchmarks.bench_exact_kernels [--rows 128,256,8192] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch

from benchmarks.headline import command_line
from megatron_jetrl.runtime.atomic import save_json_atomic

HIDDEN, INTERMEDIATE = 4096, 12288  # Qwen3-8B
HEADS_Q, HEADS_KV, HEAD_DIM, ROPE_THETA = 32, 8, 128, 1e6  # Qwen3-8B
EPS, QUANT_EPS, M_ALIGN = 1e-6, 0.0, 4  # the exact engine's arguments on DeepGEMM (fp32 scales, TMA-aligned)


def graph_of(fn: Callable[[], object], calls: int) -> torch.cuda.CUDAGraph:
    """``calls`` back-to-back calls of ``fn`` in one CUDA graph (after warm-up calls outside it)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    return graph


def time_variants(variants: dict[str, Callable[[], object]], calls: int, repeats: int) -> dict[str, list[float]]:
    """µs a call of each variant, one value per repeat (graphs replayed in turn)."""
    graphs = {name: graph_of(fn, calls) for name, fn in variants.items()}
    out: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, graph in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            out[name].append(1e3 * start.elapsed_time(end) / calls)
    return out


def vllm_ops():
    """vLLM's custom ops, or None where vLLM does not import (the table then leaves its columns out)."""
    try:
        import vllm._custom_ops as ops
    except ImportError:
        return None
    return ops


def norm_variants(rows: int, ops) -> tuple[dict[str, Callable[[], object]], int]:
    """The add + RMSNorm + quantization variants at ``rows``, and the bytes the op moves."""
    from megatron_jetrl.ops.exact import rms_norm_quant
    from megatron_jetrl.ops.quantize import quantize_rows
    from megatron_jetrl.ops.rms_norm import add_rms_norm

    g = torch.Generator(device="cuda").manual_seed(rows)
    x, residual = (torch.randn(rows, HIDDEN, generator=g, device="cuda").bfloat16() for _ in range(2))
    w = (1 + 0.1 * torch.randn(HIDDEN, generator=g, device="cuda")).bfloat16()
    moved = rows * HIDDEN * (2 + 2 + 2 + 1) + rows * HIDDEN // 128 * 4  # x, residual in; sum, codes, scales out
    variants: dict[str, Callable[[], object]] = {
        "exact": lambda: rms_norm_quant(x, w, EPS, residual, pow2_scales=False, quant_eps=QUANT_EPS, m_align=M_ALIGN),
        "exact_two_kernels": lambda: quantize_rows(add_rms_norm(x, residual, w, EPS)[0], pow2_scales=False,
                                                   eps=QUANT_EPS, m_align=M_ALIGN)}
    if ops is not None:
        x2, r2 = x.clone(), residual.clone()  # vLLM's ops add into the residual in place
        variants["vllm_fused"] = lambda: ops.rms_norm_per_block_quant(
            x2, w, EPS, torch.float8_e4m3fn, [1, 128], residual=r2, is_scale_transposed=True, tma_alignment=M_ALIGN)
        x3, r3 = x.clone(), residual.clone()

        def unfused():
            ops.fused_add_rms_norm(x3, r3, w, EPS)
            return quantize_rows(x3, pow2_scales=False, eps=QUANT_EPS, m_align=M_ALIGN)

        variants["vllm_norm_then_quant"] = unfused
    return variants, moved


def silu_variants(rows: int, ops) -> tuple[dict[str, Callable[[], object]], int]:
    """The SiLU·mul + quantization variants at ``rows``, and the bytes the op moves."""
    from megatron_jetrl.ops.exact import silu_mul, silu_mul_quant
    from megatron_jetrl.ops.quantize import quantize_rows

    g = torch.Generator(device="cuda").manual_seed(rows + 1)
    x = torch.randn(rows, 2 * INTERMEDIATE, generator=g, device="cuda").bfloat16()
    moved = rows * 2 * INTERMEDIATE * 2 + rows * INTERMEDIATE + rows * INTERMEDIATE // 128 * 4
    variants: dict[str, Callable[[], object]] = {
        "exact": lambda: silu_mul_quant(x, pow2_scales=False, quant_eps=QUANT_EPS, m_align=M_ALIGN),
        "exact_two_kernels": lambda: quantize_rows(silu_mul(x), pow2_scales=False, eps=QUANT_EPS, m_align=M_ALIGN)}
    if ops is not None:
        variants["vllm_fused"] = lambda: ops.silu_and_mul_per_block_quant(x, 128, torch.float8_e4m3fn,
                                                                          is_scale_transposed=True)
        out = torch.empty(rows, INTERMEDIATE, device="cuda", dtype=torch.bfloat16)

        def unfused():
            torch.ops._C.silu_and_mul(out, x)
            return quantize_rows(out, pow2_scales=False, eps=QUANT_EPS, m_align=M_ALIGN)

        variants["vllm_silu_then_quant"] = unfused
    return variants, moved


def qk_variants(rows: int, ops) -> tuple[dict[str, Callable[[], object]], int]:
    """The q/k norm + rotary embedding variants at ``rows`` tokens (q and k as column slices of one qkv,
    as vLLM splits them), and the bytes the op moves."""
    from megatron_jetrl.ops.exact import qk_norm_rope, qk_norm_rope_reference, rope, rope_inv_freq
    from megatron_jetrl.ops.rms_norm import rms_norm

    g = torch.Generator(device="cuda").manual_seed(rows + 2)
    qkv = torch.randn(rows, (HEADS_Q + 2 * HEADS_KV) * HEAD_DIM, generator=g, device="cuda").bfloat16()
    q, k = qkv[:, : HEADS_Q * HEAD_DIM], qkv[:, HEADS_Q * HEAD_DIM: (HEADS_Q + HEADS_KV) * HEAD_DIM]
    wq, wk = ((1 + 0.1 * torch.randn(HEAD_DIM, generator=g, device="cuda")).bfloat16() for _ in range(2))
    positions = torch.randint(0, 40960, (rows,), generator=g, device="cuda")
    inv_freq = rope_inv_freq(HEAD_DIM, ROPE_THETA, torch.device("cuda"))
    moved = rows * (HEADS_Q + HEADS_KV) * HEAD_DIM * 2 * 2  # q and k in, their rotated norms out
    args = (positions, q, k, wq, wk, EPS, EPS, inv_freq)
    compiled = torch.compile(qk_norm_rope_reference, dynamic=False)

    def two_kernels():
        return tuple(rope(rms_norm(x.reshape(rows, -1, HEAD_DIM), w, EPS), positions, inv_freq)
                     for x, w in ((q, wq), (k, wk)))

    return {"exact": lambda: qk_norm_rope(*args), "exact_two_kernels": two_kernels,
            "inductor": lambda: compiled(*args)}, moved


def floor(moved: int) -> Callable[[], object]:
    """A device copy of ``moved`` bytes (half read, half written): the op's memory floor."""
    src = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def run(rows_list: list[int], calls: int, repeats: int) -> list[dict]:
    ops = vllm_ops()
    if ops is None:
        print("bench_exact_kernels: vLLM does not import here, so only the exact kernels and the floor are timed "
              "(pip install 'megatron-jetrl[vllm]' for vLLM's columns)", file=sys.stderr, flush=True)
    results = []
    for op, make in (("add+rmsnorm+quant", norm_variants), ("silu*mul+quant", silu_variants),
                     ("q/k norm+rope", qk_variants)):
        for rows in rows_list:
            variants, moved = make(rows, ops)
            variants["floor (copy)"] = floor(moved)
            times = time_variants(variants, calls, repeats)
            for name, us in times.items():
                results.append({"op": op, "rows": rows, "variant": name, "us": statistics.median(us),
                                "spread": [min(us), max(us)], "repeats": len(us), "bytes": moved})
    return results


def table(results: list[dict], device: str) -> str:
    lines = [f"== exact kernels against vLLM's, µs a call (median of repeats, in CUDA graphs), {device} =="]
    lines.append(f"{'op':<18} {'rows':>6} {'variant':<22} {'µs':>8} {'range':>16} {'GB/s':>7} {'x exact':>8}")
    for r in results:
        exact = next(e["us"] for e in results if e["op"] == r["op"] and e["rows"] == r["rows"]
                     and e["variant"] == "exact")
        lines.append(f"{r['op']:<18} {r['rows']:>6} {r['variant']:<22} {r['us']:>8.2f} "
                     f"{r['spread'][0]:>7.2f}-{r['spread'][1]:<8.2f} {r['bytes'] / r['us'] / 1e3:>7.0f} "
                     f"{r['us'] / exact:>7.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="128,256,2048,8192", help="row counts (tokens) to time, comma-separated")
    p.add_argument("--calls", type=int, default=50, help="calls of a variant in its CUDA graph")
    p.add_argument("--repeats", type=int, default=5, help="graph replays per variant (median, spread)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    try:
        rows_list = [int(r) for r in args.rows.split(",")]
    except ValueError:
        p.error(f"--rows {args.rows!r}: expected integers separated by commas, e.g. 128,256,8192")
    if any(r < 1 for r in rows_list) or args.calls < 1 or args.repeats < 3:
        p.error("--rows must be >= 1, --calls >= 1 and --repeats >= 3 (a median and a spread)")
    if not torch.cuda.is_available():
        print("bench_exact_kernels: no CUDA GPU visible; it times CUDA kernels", file=sys.stderr)
        return 2
    results = run(rows_list, args.calls, args.repeats)
    device = torch.cuda.get_device_name()
    if args.json:
        command = command_line("benchmarks.bench_exact_kernels", argv)
        save_json_atomic(Path(args.json), {"device": device, "command": command, "results": results})
    print(table(results, device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
