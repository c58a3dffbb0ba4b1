"""FP8 block checkpoint export: linear weights as float8_e4m3fn + ``weight_scale_inv``.

The layout vLLM and transformers load (DeepSeek-V3 / Qwen-FP8 style): every linear ``*_proj.weight``
[N, K] becomes e4m3 codes plus ``*_proj.weight_scale_inv`` fp32 [ceil(N/128), ceil(K/128)], from
``quantize_fp8_blockwise`` (so the bytes equal the trainer's FProp weights); embeddings, norms and
the LM head stay BF16; config.json gets the recipe's ``quantization_config``.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from megatron_jetrl.models.bridge import ModelBridge
from megatron_jetrl.config import HfCheckpointError
from megatron_jetrl.precision import WEIGHT_BLOCK, PrecisionRecipe, quantize_fp8_blockwise

SCALE_SUFFIX = "_scale_inv"


def fp8_weight_names(bridge: ModelBridge, recipe: PrecisionRecipe) -> dict[str, tuple[int, ...]]:
    """HF names (and shapes) of the weights the export quantizes: every linear weight of every
    layer the recipe runs in FP8."""
    if not recipe.rollout_fp8:
        raise ValueError(f"precision mode {recipe.mode.value!r} has no FP8 rollout; nothing to export in FP8")
    n = bridge.dims.num_layers
    names = {}
    for spec in bridge.tensor_map():
        if spec.linear and recipe.rollout_layer_in_fp8(spec.layer, n):
            names.update(zip(spec.hf, bridge.hf_shapes(spec), strict=True))
    return names


def check_fp8_exportable(bridge: ModelBridge, recipe: PrecisionRecipe) -> None:
    """Every quantized projection must have both dims a multiple of 128 (vLLM's block layout, and
    whole blocks shared with the trainer's fused tensors); name the ones that do not."""
    bad = sorted({
        f"{name.split('.', 3)[-1]} {list(shape)}"
        for name, shape in fp8_weight_names(bridge, recipe).items()
        if any(s % WEIGHT_BLOCK[0] for s in shape)
    })
    if bad:
        raise HfCheckpointError(
            "FP8 block export needs every projection's dims to be multiples of 128; not so here: "
            + ", ".join(bad)
            + ". Export in BF16 (without --fp8-block), or keep those layers in BF16."
        )


def to_fp8_block(
    bridge: ModelBridge, recipe: PrecisionRecipe, tensors: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensors with each FP8 linear weight replaced by its codes and ``weight_scale_inv``."""
    quantized = fp8_weight_names(bridge, recipe)
    for name, t in tensors:
        if name in quantized:
            data, scale_inv = quantize_fp8_blockwise(
                t, WEIGHT_BLOCK, pow2_scales=recipe.fp8.pow2_scales, eps=recipe.fp8.amax_epsilon
            )
            yield name, data
            yield name + SCALE_SUFFIX, scale_inv
        else:
            yield name, t


def fp8_plan(
    bridge: ModelBridge, recipe: PrecisionRecipe, plan: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]
) -> Iterator[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The tensors ``to_fp8_block`` yields (name, dtype, shape) for the BF16 ``plan``."""
    quantized = fp8_weight_names(bridge, recipe)
    for name, dtype, shape in plan:
        if name in quantized:
            yield name, torch.float8_e4m3fn, shape
            blocks = tuple(-(-s // b) for s, b in zip(shape, WEIGHT_BLOCK, strict=True))
            yield name + SCALE_SUFFIX, torch.float32, blocks
        else:
            yield name, dtype, shape


def fp8_hf_config(bridge: ModelBridge, recipe: PrecisionRecipe, hf_config: dict) -> dict:
    config = dict(hf_config)
    config["quantization_config"] = recipe.quantization_config(bridge.dims.num_layers,
                                                               linear_names=bridge.linear_names)
    return config
