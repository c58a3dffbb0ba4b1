"""``jetrl train`` with the exact rollout and a fault put into the engine for tests/gpu/test_exact_guard.py:
from the ``--perturb-from``-th weight sync on (1: the start's), the lowest bit of the first 128 FP8 codes of
one of vLLM's weight buffers is flipped after the sync, so the engine computes with weights one E4M3 step
off the trainer's in a few places: its logprobs are no longer the trainer's. 0 flips nothing.

    python tests/gpu/exact_guard_run.py --perturb-from N -- CONFIG key=value ...   (exits with jetrl's status)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_jetrl import cli, trainer  # noqa: E402


def perturbing(perturb_from: int):
    real = trainer.Trainer.sync_weights
    syncs = [0]

    def sync_weights(self, kv_scales=None):
        real(self, kv_scales)
        syncs[0] += 1
        if perturb_from and syncs[0] >= perturb_from:
            name, buf = next((n, b) for n, b in sorted(self.engine.weight_buffers().items())
                             if b.dtype == torch.float8_e4m3fn)
            codes = buf.view(torch.uint8).view(-1)[:128]
            codes.bitwise_xor_(1)
            print(f"exact_guard_run: sync {syncs[0]}: flipped the lowest bit of 128 codes of {name}", flush=True)

    return sync_weights


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--perturb-from", type=int, required=True)
    ap.add_argument("train", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    trainer.Trainer.sync_weights = perturbing(args.perturb_from)
    return cli.main(["train", *[a for a in args.train if a != "--"]])


if __name__ == "__main__":
    sys.exit(main())
