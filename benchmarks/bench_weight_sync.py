"""Weight-sync time for a model with Qwen3-8B shapes (36 layers by default), FP8 and BF16.

    torchrun --nproc-per-node 1 -m benchmarks.bench_weight_sync
    torchrun --nproc-per-node 2 -m benchmarks.bench_weight_sync --tp 2 --rollout-tp 1 2

Each rank holds only its own train shards (random BF16, plus the FP8 weights the trainer's FProp
computes, timed here as ``quantize``: in training they already exist after the optimizer step)
and an engine holding its rollout tensors, as an in-process engine does. Two paths: ``in-place``
(the engine offers ``weight_buffers()`` and the copy kernels write straight into them, as with
the hf engine) and ``handover`` (round tensors go through ``update_weights``, which copies them:
timed as ``load``; the vLLM path). Phases: quantize, pack (copy kernel), exchange (NCCL),
unpack (copy kernel), load. The bandwidth floor is the engine's bytes over the copy bandwidth of
the same GPU in the same run (one ``copy_`` of a 4 GiB buffer: every byte read once and written
once), i.e. the time to move exactly the engine's bytes once.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist


from megatron_jetrl.models import ParallelLayout, bridge_for  # noqa: E402
from megatron_jetrl.ops import NativeQuantizer  # noqa: E402
from benchmarks.model_shapes import qwen3_8b_shaped  # noqa: E402
from megatron_jetrl.precision import PrecisionRecipe  # noqa: E402
from megatron_jetrl.rollout.base import TensorMeta  # noqa: E402
from megatron_jetrl.sync import Shard, SyncPlan, WeightSync  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


class BufferEngine:
    """The load side of an in-process engine: its tensors preallocated, ``update_weights`` copies."""

    def __init__(self, specs: dict[str, TensorMeta], device):
        self.specs = specs
        self.tensors = {n: torch.empty(m.shape, dtype=m.dtype, device=device) for n, m in specs.items()}

    def weight_specs(self):
        return self.specs

    def update_weights(self, tensors):
        for name, t in tensors:
            self.tensors[name].copy_(t)

    def weight_buffers(self):
        return self.tensors


def make_shards(sync: WeightSync, mode: str, device) -> tuple[dict[str, Shard], float]:
    """Random BF16 shards of this rank, and the FP8 weights (time of quantizing them all)."""
    g = torch.Generator(device=device).manual_seed(dist.get_rank())
    dense = {}
    for name, (shape, _) in sync.source_specs().items():
        t = torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0, 0.02, generator=g)
        dense[name] = t.reshape(-1) if shape[1:] == (1,) else t
    _sync()
    start = time.perf_counter()
    fp8 = {}
    if mode == "fp8":
        q = NativeQuantizer()
        fp8 = {name: q.quantize_weight(dense[name]).fprop for name, (_, need) in sync.source_specs().items() if need}
    _sync()
    return {n: Shard(t, fp8.get(n)) for n, t in dense.items()}, time.perf_counter() - start


def copy_bandwidth(device) -> float:
    src = torch.empty(2**32 if device.type == "cuda" else 2**26, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync()
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    _sync()
    return 5 * src.numel() / (time.perf_counter() - start)


def run(args, mode: str, rollout_tp: int, device, copy_bw: float, in_place: bool) -> dict:
    bridge = bridge_for(qwen3_8b_shaped(args.layers))
    recipe = PrecisionRecipe(mode=mode)
    plan = SyncPlan(bridge, recipe, ParallelLayout(args.tp, 1), rollout_tp, dist.get_world_size())
    sync = WeightSync(plan, dist.get_rank(), bucket_mb=args.bucket_mb, device=device)
    shards, quantize_s = make_shards(sync, mode, device)
    engine = BufferEngine(sync.engine_specs(), device)
    sync.check(shards, engine)
    sync.sync(shards, engine, in_place=in_place)  # warm-up (allocator, NCCL channels)
    totals, reports = [], []
    for _ in range(args.iters):
        dist.barrier()
        reports.append(sync.sync(shards, engine, profile=True, in_place=in_place))
        dist.barrier()
        start = time.perf_counter()
        sync.sync(shards, engine, in_place=in_place)
        _sync()
        totals.append(time.perf_counter() - start)
    r = reports[-1]
    total = min(totals)
    floor = r.engine_bytes / copy_bw
    result = {
        "mode": mode, "path": "in-place" if in_place else "handover",
        "train_tp": args.tp, "rollout_tp": rollout_tp, "layers": args.layers,
        "engine_gb": r.engine_bytes / 1e9, "sent_gb": r.sent_bytes / 1e9, "rounds": r.rounds,
        "quantize_s": quantize_s, **{f"{k}_s": v for k, v in r.seconds.items() if k != "total"},
        "profiled_total_s": r.total_s, "total_s": total, "gbps": r.engine_bytes / total / 1e9,
        "floor_s": floor, "x_floor": total / floor,
    }
    del engine, shards, sync
    torch.cuda.empty_cache()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--tp", type=int, default=1, help="train TP (world = tp; PP 1)")
    p.add_argument("--rollout-tp", type=int, nargs="+", default=[1])
    p.add_argument("--modes", nargs="+", default=["fp8", "bf16"])
    p.add_argument("--bucket-mb", type=float, default=1024)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if torch.cuda.is_available():
        dist.init_process_group("nccl")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:  # a CPU smoke run of the script (numbers meaningless)
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    copy_bw = copy_bandwidth(device)
    results = [run(args, mode, rt, device, copy_bw, in_place) for rt in args.rollout_tp for mode in args.modes
               for in_place in (True, False)]
    if dist.get_rank() == 0:
        print(f"\nweight sync, Qwen3-8B shapes x {args.layers} layers, {_device_name()}, "
              f"world {dist.get_world_size()}, copy bandwidth {copy_bw / 1e9:.0f} GB/s, bucket {args.bucket_mb:g} MB")
        cols = ("mode", "path", "train_tp", "rollout_tp", "engine_gb", "sent_gb", "quantize_s", "pack_s", "exchange_s",
                "unpack_s", "load_s", "total_s", "gbps", "floor_s", "x_floor")
        print(" | ".join(f"{c:>10}" for c in cols))
        for r in results:
            print(" | ".join(f"{r.get(c, 0.0):>10.4f}" if isinstance(r.get(c, 0.0), float) else f"{r[c]!s:>10}"
                             for c in cols))
        if args.json:
            args.json.write_text(json.dumps({"device": _device_name(), "copy_gbps": copy_bw / 1e9,
                                             "results": results}, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
