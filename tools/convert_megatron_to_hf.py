#!/usr/bin/env python3
"""Convert a megatron-core checkpoint of this project back to a Hugging Face checkpoint.

    python tools/convert_megatron_to_hf.py --ckpt-dir ckpt/qwen3-8b --out-dir Qwen3-8B-out [--fp8-block]

Writes sharded safetensors + index + config.json + tokenizer files, bit-exact in BF16. With
--fp8-block every linear *_proj.weight becomes float8_e4m3fn plus *_proj.weight_scale_inv (fp32,
[ceil(N/128), ceil(K/128)]) from the project's quantizer -- the bytes the trainer's FProp uses --
and config.json gets the block-FP8 quantization_config that vLLM and transformers load.
Embeddings, norms and the LM head stay BF16.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from pathlib import Path

FP8_ONLY = ("--pow2-scales", "--bf16-first-layers", "--bf16-last-layers")
"""Options that shape the FP8 export and mean nothing without ``--fp8-block``."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt-dir", required=True, help="checkpoint written by convert_hf_to_megatron or the actor")
    parser.add_argument("--out-dir", required=True, help="where to write the HF checkpoint")
    parser.add_argument("--fp8-block", action="store_true", help="export linear weights as block-scaled FP8")
    parser.add_argument("--pow2-scales", action="store_true", help="FP8: power-of-two scales (default fp32)")
    parser.add_argument("--bf16-first-layers", type=int, default=0, help="FP8: first N layers stay BF16")
    parser.add_argument("--bf16-last-layers", type=int, default=0, help="FP8: last N layers stay BF16")
    parser.add_argument("--max-shard-gb", type=float, default=5.0, help="safetensors shard size limit (GB)")
    parser.add_argument("--force", action="store_true", help="replace --out-dir if it exists")
    args = parser.parse_args(argv)
    given = [flag for flag, value in zip(FP8_ONLY, (args.pow2_scales, args.bf16_first_layers, args.bf16_last_layers),
                                         strict=True) if value]
    negative = [f"{flag} {value}" for flag, value in (("--bf16-first-layers", args.bf16_first_layers),
                                                       ("--bf16-last-layers", args.bf16_last_layers)) if value < 0]
    problem = None
    if given and not args.fp8_block:
        problem = f"{', '.join(given)} only apply to the FP8 export: add --fp8-block, or drop them"
    elif negative:
        problem = f"{', '.join(negative)}: a number of layers to keep in BF16 must be 0 or more"
    elif not Path(args.ckpt_dir).is_dir():
        problem = (f"--ckpt-dir {args.ckpt_dir} does not exist (a directory written by convert_hf_to_megatron or a "
                   "run's checkpoints/step_*/actor)")
    elif not (math.isfinite(args.max_shard_gb) and args.max_shard_gb * 2**30 >= 1):
        problem = f"--max-shard-gb must be a finite number of GB above 0 (e.g. 5); got {args.max_shard_gb}"
    if problem:
        print(f"convert_megatron_to_hf: error: {problem}", file=sys.stderr)
        return 2
    # imported after the arguments are checked: --help and argument errors answer at once
    from megatron_jetrl.actor.hf_conversion import read_megatron_as_hf
    from megatron_jetrl.config import ConfigError
    from megatron_jetrl.models.hf_checkpoint import CheckpointError, NoSpaceError, atomic_output_dir
    from megatron_jetrl.precision import Fp8Options, PrecisionRecipe

    try:
        recipe = None
        if args.fp8_block:
            recipe = PrecisionRecipe(fp8=Fp8Options(pow2_scales=args.pow2_scales,
                                                    bf16_first_layers=args.bf16_first_layers,
                                                    bf16_last_layers=args.bf16_last_layers))
        start = time.time()
        with atomic_output_dir(args.out_dir, force=args.force, inputs=(args.ckpt_dir,)) as tmp:
            read_megatron_as_hf(args.ckpt_dir, tmp, fp8_recipe=recipe,
                                max_shard_bytes=int(args.max_shard_gb * 2**30), progress=True)
        print(f"wrote {args.out_dir}{' (FP8 block)' if recipe else ''} in {time.time() - start:.1f}s")
    except (CheckpointError, ConfigError, FileExistsError, NoSpaceError, ValueError) as e:
        print(f"convert_megatron_to_hf: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
