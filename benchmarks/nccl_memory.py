"""GPU memory that NCCL communicators take outside PyTorch's allocator, with megatron's process
groups made eagerly (``init_process_group(device_id=...)``) or lazily (the default; what
``jetrl train`` does), one process, one GPU:

    python -m benchmarks.nccl_memory            # prints a table (GiB used on the device)

Each mode runs in a fresh process; the table reads ``torch.cuda.mem_get_info`` after the CUDA
context, ``init_process_group``, ``initialize_model_parallel`` and one all-reduce on each of the
groups a 1-GPU actor step uses.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

STAGES = ("CUDA context", "init_process_group", "initialize_model_parallel", "all-reduce on 6 groups")


def _probe(eager: bool) -> list[float]:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    def used() -> float:
        free, total = torch.cuda.mem_get_info()
        return (total - free) / 2**30

    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")
    out = [used()]
    dist.init_process_group("nccl", rank=0, world_size=1,
                            **({"device_id": torch.device("cuda", 0)} if eager else {}))
    out.append(used())
    ps.initialize_model_parallel(1, 1)
    out.append(used())
    x = torch.ones(1024, device="cuda")
    for group in (ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group(),
                  ps.get_pipeline_model_parallel_group(), ps.get_model_parallel_group(), ps.get_embedding_group(),
                  ps.get_data_parallel_group(with_context_parallel=True)):
        dist.all_reduce(x, group=group)
    torch.cuda.synchronize()
    out.append(used())
    dist.destroy_process_group()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--probe", choices=("eager", "lazy"), help="(internal) measure one mode in this process")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.nccl_memory: needs a CUDA GPU (it measures NCCL's device memory); none is "
                         "visible here: run it on the GPU host")
    if args.probe:
        print(json.dumps(_probe(args.probe == "eager")))
        return 0
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": os.environ.get("MASTER_PORT", "29555")}
    rows = {}
    for mode in ("eager", "lazy"):
        res = subprocess.run([sys.executable, "-m", "benchmarks.nccl_memory", "--probe", mode], env=env,
                             capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
        if res.returncode != 0:
            print(res.stderr[-2000:], file=sys.stderr)
            return 1
        rows[mode] = json.loads(res.stdout.strip().splitlines()[-1])
    print("| GiB used on the GPU after | " + " | ".join(STAGES) + " |")
    print("|---|" + "---|" * len(STAGES))
    for mode, values in rows.items():
        print(f"| {mode} | " + " | ".join(f"{v:.2f}" for v in values) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
