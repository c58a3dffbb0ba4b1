#!/usr/bin/env python3
"""Convert a Hugging Face checkpoint (Llama / Qwen2 / Qwen3) to a megatron-core distributed checkpoint.

    python tools/convert_hf_to_megatron.py --hf-dir Qwen3-8B --out-dir ckpt/qwen3-8b [--force]

The output loads into the actor at any TP/PP and keeps the HF config and tokenizer files (under
hf/), so it converts back losslessly. Tensors stream one decoder layer at a time; the output is
written to a temporary directory and renamed at the end, so a failed run leaves nothing behind.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-dir", required=True, help="HF model directory (config.json + safetensors)")
    parser.add_argument("--out-dir", required=True, help="where to write the megatron-core checkpoint")
    parser.add_argument("--force", action="store_true", help="replace --out-dir if it exists")
    args = parser.parse_args(argv)
    # imported after the arguments are parsed: --help and argument errors answer at once
    from megatron_jetrl.actor.hf_conversion import save_hf_as_megatron
    from megatron_jetrl.config import ConfigError
    from megatron_jetrl.models import bridge_for
    from megatron_jetrl.models.hf_checkpoint import CheckpointError, HFCheckpoint, NoSpaceError, atomic_output_dir

    try:
        hf = HFCheckpoint(args.hf_dir)
        bridge = bridge_for(hf.config)
        start = time.time()
        with atomic_output_dir(args.out_dir, force=args.force, inputs=(args.hf_dir,)) as tmp:
            save_hf_as_megatron(bridge, hf, tmp, progress=True)
        print(f"wrote {args.out_dir} ({bridge.architecture}, {bridge.dims.num_layers} layers) "
              f"in {time.time() - start:.1f}s")
    except (CheckpointError, ConfigError, FileExistsError, NoSpaceError, ValueError) as e:
        print(f"convert_hf_to_megatron: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
