"""``jetrl train`` with the exact rollout and a fault put into the engine for tests/gpu/test_exact_guard.py:
the lowest bit of the first 128 FP8 codes of one of vLLM's weight buffers is set, so the engine computes
with weights one E4M3 step off the trainer's in a few places and its logprobs are no longer the trainer's.
``--perturb-from 1``: after every weight sync, the start's included (the start-up self-check sees it);
``N`` > 1: before the rollout of every step from N on (whatever syncs the colocation makes in between);
0 changes nothing.

    python tests/gpu/exact_guard_run.py --perturb-from N -- CONFIG key=value ...   (exits with jetrl's status)
    torchrun --nproc-per-node 2 tests/gpu/exact_guard_run.py --perturb-from 0 -- CONFIG ...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_jetrl import cli, trainer  # noqa: E402


def perturb(trainer_: trainer.Trainer, why: str) -> None:
    """Set the lowest bit of the first 128 FP8 codes of the engine's first FP8 weight buffer (setting,
    not flipping: doing it twice changes nothing more)."""
    name, buf = next((n, b) for n, b in sorted(trainer_.engine.weight_buffers().items())
                     if b.dtype == torch.float8_e4m3fn)
    buf.view(torch.uint8).view(-1)[:128].bitwise_or_(1)
    print(f"exact_guard_run: {why}: set the lowest bit of 128 codes of {name}", flush=True)


def perturbing(perturb_from: int) -> None:
    """Wrap the trainer's weight sync (``perturb_from`` 1) or its rollout (later steps)."""
    sync, collect = trainer.Trainer.sync_weights, trainer.Trainer.collect

    def sync_weights(self, kv_scales=None):
        sync(self, kv_scales)
        if perturb_from == 1:
            perturb(self, f"after a weight sync at step {self.step}")

    def collecting(self, *args, **kwargs):
        if perturb_from and self.step >= perturb_from:
            perturb(self, f"before the rollout of step {self.step}")
        return collect(self, *args, **kwargs)

    trainer.Trainer.sync_weights = sync_weights
    trainer.Trainer.collect = collecting


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--perturb-from", type=int, required=True)
    ap.add_argument("train", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    perturbing(args.perturb_from)
    return cli.main(["train", *[a for a in args.train if a != "--"]])


if __name__ == "__main__":
    sys.exit(main())
