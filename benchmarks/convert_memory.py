"""Peak memory of the checkpoint conversions against the model's size, on a 1B-class random model.

Builds a random model with Llama-3.2-1B's shapes (no download), saves it sharded, then runs each
conversion in a child process and reports its peak RSS (ru_maxrss of the child):

    python -m benchmarks.convert_memory [--work-dir /tmp/convert_memory] [--layers 16]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]


def build(directory: Path, layers: int) -> int:
    config = transformers.LlamaConfig(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
        max_position_embeddings=131072,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, torch_dtype=torch.bfloat16)
    model.save_pretrained(directory, max_shard_size="1GB")
    return sum(p.numel() * p.element_size() for p in model.parameters())


_MEASURE = (
    "import resource, subprocess, sys, time; t = time.time(); "
    "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
    "print(time.time() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)


def run(args: list[str]) -> tuple[float, float]:
    """Seconds and peak RSS (GiB) of one tool run, measured by a fresh parent (ru_maxrss of
    RUSAGE_CHILDREN is a maximum over all children, so each run gets its own parent)."""
    out = subprocess.run([sys.executable, "-c", _MEASURE, sys.executable, *args], check=True, cwd=ROOT,
                         capture_output=True, text=True).stdout.split()
    return float(out[0]), int(out[1]) / 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", default="/tmp/convert_memory")
    parser.add_argument("--layers", type=int, default=16)
    args = parser.parse_args()
    work = Path(args.work_dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    nbytes = build(work / "hf", args.layers)
    print(f"model: Llama-3.2-1B shapes, {args.layers} layers, {nbytes / 2**30:.2f} GiB of bf16 weights", flush=True)
    rows = []
    for name, argv in (
        ("imports only (--help)", ["tools/convert_hf_to_megatron.py", "--help"]),
        ("HF -> Megatron", ["tools/convert_hf_to_megatron.py", "--hf-dir", str(work / "hf"), "--out-dir",
                            str(work / "mg")]),
        ("Megatron -> HF", ["tools/convert_megatron_to_hf.py", "--ckpt-dir", str(work / "mg"), "--out-dir",
                            str(work / "back")]),
        ("Megatron -> HF FP8", ["tools/convert_megatron_to_hf.py", "--ckpt-dir", str(work / "mg"), "--out-dir",
                                str(work / "fp8"), "--fp8-block"]),
    ):
        rows.append((name, *run(argv)))
        print(f"{name}: {rows[-1][1]:.1f}s, peak RSS {rows[-1][2]:.2f} GiB", flush=True)
    print(f"{'conversion':<22} {'seconds':>8} {'peak RSS GiB':>13} {'RSS / model':>12}")
    for name, secs, rss in rows:
        print(f"{name:<22} {secs:8.1f} {rss:13.2f} {rss / (nbytes / 2**30):11.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
