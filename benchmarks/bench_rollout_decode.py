"""Decode throughput of the hf rollout engine, FP8 vs BF16, at Qwen3-8B layer shapes.

Builds the engine twice on one GPU, in BF16 and in FP8 (the recipe's W8A8 block linears; weights
quantized from the BF16 engine's), with random weights made on the device (no downloads) and the
first ``--layers`` of Qwen3-8B's 36 layers. For every batch size it generates ``--max-new-tokens``
from random ``--prompt-len``-token prompts, no stop tokens, and times decoding alone: a whole call
minus a call that only prefills (max_new_tokens=1), median of ``--repeats``.

Usage (GPU host):  python -m benchmarks.bench_rollout_decode [--layers 8] [--batch-sizes 16,64]
                   [--prompt-len 256] [--max-new-tokens 256] [--eager] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


import torch


from benchmarks.model_shapes import qwen3_8b_shaped  # noqa: E402
from megatron_jetrl.ops import NativeQuantizer  # noqa: E402
from megatron_jetrl.precision import PrecisionRecipe  # noqa: E402
from megatron_jetrl.rollout import HfEngine, HfOptions, SamplingParams  # noqa: E402



def random_weights(engine: HfEngine, seed: int) -> dict[str, torch.Tensor]:
    """BF16 weights on the engine's device: norms 1, everything else N(0, 0.02)."""
    g = torch.Generator(device=engine.device).manual_seed(seed)
    weights = {}
    for name, meta in engine.weight_specs().items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(meta.shape, dtype=meta.dtype, device=engine.device)
        else:
            w = torch.empty(meta.shape, dtype=meta.dtype, device=engine.device)
            weights[name] = w.normal_(0.0, 0.02, generator=g)
    return weights


def load(engine: HfEngine, bf16: dict[str, torch.Tensor], quantizer: NativeQuantizer | None) -> None:
    """One tensor per update call (as the sync's buckets arrive); FP8 weights quantized on the GPU."""
    for name, meta in engine.weight_specs().items():
        if meta.dtype == torch.float8_e4m3fn:
            fprop = quantizer.quantize_weight(bf16[name]).fprop
            engine.update_weights([(name, fprop.data), (name + "_scale_inv", fprop.scale_inv)])
        elif not name.endswith("_scale_inv"):
            engine.update_weights([(name, bf16[name])])


def timed_generate(engine: HfEngine, prompts, max_new_tokens: int) -> float:
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=0)
    torch.cuda.synchronize()
    start = time.perf_counter()
    samples = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    short = [len(s.tokens) for s in samples if len(s.tokens) != max_new_tokens]
    if short:  # not the same work in every mode: no tok/s to compare
        raise RuntimeError(f"{len(short)} of {len(samples)} samples have {min(short)}-{max(short)} tokens, not "
                           f"{max_new_tokens} (a stop token ended them)")
    return elapsed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch-sizes", default="16,64")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (every decode step launched from Python)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    config = qwen3_8b_shaped(args.layers)
    fp8_recipe = PrecisionRecipe(mode="fp8")
    quantizer = NativeQuantizer(pow2_scales=fp8_recipe.fp8.pow2_scales, eps=fp8_recipe.fp8.amax_epsilon)
    options = HfOptions(max_num_seqs=max(batch_sizes), cuda_graphs=not args.eager)
    engines = {"bf16": HfEngine(config, PrecisionRecipe(mode="bf16"), options, device=device),
               "fp8": HfEngine(config, fp8_recipe, options, device=device, quantizer=quantizer)}
    weights = random_weights(engines["bf16"], seed=0)
    load(engines["bf16"], weights, None)
    load(engines["fp8"], weights, quantizer)
    del weights
    torch.cuda.empty_cache()

    g = torch.Generator().manual_seed(0)
    results = []
    T = args.max_new_tokens
    for B in batch_sizes:
        prompts = torch.randint(0, config["vocab_size"], (B, args.prompt_len), generator=g).tolist()
        row = {"batch": B}
        for name, engine in engines.items():
            timed_generate(engine, prompts, min(T, 8))  # warm-up: kernels, cuBLAS heuristics, allocator
            prefill = statistics.median(timed_generate(engine, prompts, 1) for _ in range(args.repeats))
            full = statistics.median(timed_generate(engine, prompts, T) for _ in range(args.repeats))
            decode = full - prefill
            row[name] = {"prefill_s": prefill, "total_s": full, "decode_s": decode,
                         "decode_tok_s": B * (T - 1) / decode, "step_ms": 1e3 * decode / (T - 1)}
        row["speedup"] = row["fp8"]["decode_tok_s"] / row["bf16"]["decode_tok_s"]
        results.append(row)

    name = torch.cuda.get_device_name(device)
    print(f"\nhf engine decode, Qwen3-8B shapes x {args.layers} layers, prompt {args.prompt_len}, {T} new tokens, "
          f"{'eager' if args.eager else 'CUDA graphs'}, {name}, torch {torch.__version__}")
    print(f"{'batch':>6} {'BF16 tok/s':>11} {'FP8 tok/s':>10} {'FP8/BF16':>9} {'BF16 ms/step':>13} "
          f"{'FP8 ms/step':>12} {'prefill BF16 s':>15} {'prefill FP8 s':>14}")
    for r in results:
        print(f"{r['batch']:>6} {r['bf16']['decode_tok_s']:>11.0f} {r['fp8']['decode_tok_s']:>10.0f} "
              f"{r['speedup']:>8.2f}x {r['bf16']['step_ms']:>13.2f} {r['fp8']['step_ms']:>12.2f} "
              f"{r['bf16']['prefill_s']:>15.3f} {r['fp8']['prefill_s']:>14.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "args": vars(args), "results": results}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
