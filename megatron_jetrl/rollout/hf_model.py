"""The model the ``hf`` rollout engine computes with: a transformers model whose decoder linears
compute like the trainer's FProp.

``build_model`` builds the transformers model of the checkpoint's architecture in the recipe's
compute dtype and, when the recipe rolls out in FP8, replaces every decoder linear the recipe does
not keep in BF16 with ``Fp8InferenceLinear``: the checkpoint layout's FP8 codes and
``weight_scale_inv`` as buffers, and a forward that *is* the trainer's FProp
(``Fp8BlockLinear.forward``): the same quantizer call on the activation (1x128 groups) and the same
``fp8_gemm``. Given the weight bytes the sync ships, an engine linear's output is bit for bit the
trainer linear's output for the same input.

Two departures from the stock transformers modules, both towards the trainer: RMSNorms are
torch's fused ``nn.RMSNorm`` in the model dtype (what the actor's megatron layers run, instead of
transformers' fp32 formula), and q/k/v and gate/up each run as one GEMM over their stacked rows
(``FusedProjection``), as the trainer's fused ``linear_qkv`` and ``linear_fc1`` do, which also
halves the GEMM launches of a decode step. Weights keep their HF checkpoint names: each name is a
row range of the tensor that holds it (``WeightSlot``); an FP8 projection is fused only where
its rows are whole 128-row blocks, so its ``weight_scale_inv`` is a row range too.

The supported architectures are the bridge registry's (``models.families``): each bridge names its
transformers model class (``architecture``) and RMSNorm class (``hf_norm``), resolved by
``hf_classes``.

Shape legend: M rows of an activation (tokens), K in features, N out features.
"""

from __future__ import annotations

import functools
import importlib
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch
import transformers

from megatron_jetrl.models import ModelBridge
from megatron_jetrl.models.fp8_export import SCALE_SUFFIX
from megatron_jetrl.precision import WEIGHT_BLOCK, Fp8Quantizer, Fp8Tensor, PrecisionRecipe, fp8_gemm


class Fp8InferenceLinear(torch.nn.Module):
    """``y = x·Wᵀ (+ b)`` from FP8 block weights: the trainer's FProp without autograd.

    Buffers: ``weight`` float8_e4m3fn [N, K], ``weight_scale_inv`` fp32 [ceil(N/128), ceil(K/128)]
    (the checkpoint layout), optional ``bias`` [N] in the model dtype. The activation is quantized
    per call (1x128 groups, ``quantizer.quantize_groups``); the output has the input's dtype.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: torch.dtype,
                 quantizer: Fp8Quantizer, gemm: str, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.quantizer, self.gemm = quantizer, gemm
        grid = (math.ceil(out_features / WEIGHT_BLOCK[0]), math.ceil(in_features / WEIGHT_BLOCK[1]))
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn,
                                                   device=device))
        self.register_buffer("weight_scale_inv", torch.empty(grid, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype, device=device) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_MK = x.reshape(-1, self.in_features)
        if not x_MK.is_contiguous():
            x_MK = x_MK.contiguous()
        x_row, _ = self.quantizer.quantize_groups(x_MK, rowwise=True, columnwise=False)
        y = fp8_gemm(x_row, Fp8Tensor(self.weight, self.weight_scale_inv, WEIGHT_BLOCK), x.dtype, self.gemm)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, fp8"


class FusedProjection(torch.nn.Module):
    """Several projections of the same input as one GEMM over their stacked rows (``linear``); the
    model's modules for the parts (``ProjectionPart``) return column ranges of its output.

    The attention calls ``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)`` (the MLP ``gate_proj(x)``,
    ``up_proj(x)``) on one tensor: the first call computes the whole output, and the others, seeing
    the same input object, take their part of it. The output is dropped once every part is taken.
    """

    def __init__(self, linear: torch.nn.Module, sizes: Sequence[int]):
        super().__init__()
        self.linear = linear
        self.sizes = tuple(sizes)
        self._input: torch.Tensor | None = None
        self._parts: tuple[torch.Tensor, ...] = ()
        self._pending: set[int] = set()

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if x is not self._input or index not in self._pending:
            self._parts = self.linear(x).split(self.sizes, dim=-1)
            self._input, self._pending = x, set(range(len(self.sizes)))
        self._pending.discard(index)
        out = self._parts[index]
        if not self._pending:
            self._input, self._parts = None, ()
        return out


class ProjectionPart(torch.nn.Module):
    """Stands where an HF linear was; its weights live in the ``FusedProjection`` (not a child)."""

    def __init__(self, fused: FusedProjection, index: int):
        super().__init__()
        self._fused = (fused,)
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fused[0].part(self.index, x)

    def extra_repr(self) -> str:
        return f"part {self.index} of {self._fused[0].sizes}"


@dataclass(frozen=True)
class WeightSlot:
    """Where a checkpoint tensor lives: attribute ``attr`` of ``module``, or its rows [r0, r1)."""

    module: torch.nn.Module
    attr: str
    rows: tuple[int, int] | None = None

    def storage(self) -> torch.Tensor:
        return getattr(self.module, self.attr)

    def view(self) -> torch.Tensor:
        t = self.storage()
        return t if self.rows is None else t[self.rows[0] : self.rows[1]]


class HfClasses(NamedTuple):
    """The transformers classes of one architecture."""

    model: type[transformers.PreTrainedModel]
    norm: type[torch.nn.Module]


def hf_classes(bridge: ModelBridge | type[ModelBridge]) -> HfClasses:
    """The bridge's ``architecture`` class from ``transformers`` and its ``hf_norm`` class from
    ``transformers.models.<model_type>.modeling_<model_type>``; an ImportError naming the
    architecture where the installed transformers lacks either."""
    arch, model_type, norm_name = bridge.architecture, bridge.model_type, bridge.hf_norm
    fix = f"the hf engine needs a transformers version that has {arch}"
    model_cls = getattr(transformers, arch, None)
    if model_cls is None:
        raise ImportError(f"architecture {arch}: transformers {transformers.__version__} has no {arch}; {fix}")
    modeling = f"transformers.models.{model_type}.modeling_{model_type}"
    try:
        norm_cls = getattr(importlib.import_module(modeling), norm_name)
    except (ModuleNotFoundError, AttributeError) as e:
        if isinstance(e, ModuleNotFoundError) and e.name and not modeling.startswith(e.name):
            raise
        raise ImportError(f"architecture {arch}: transformers {transformers.__version__} has no "
                          f"{modeling}.{norm_name}; {fix}") from e
    return HfClasses(model_cls, norm_cls)


def fp8_module_names(bridge: ModelBridge, recipe: PrecisionRecipe) -> set[str]:
    """HF module names of the linears that run in FP8: those the recipe's quantization_config
    does not ignore."""
    n = bridge.dims.num_layers
    qc = recipe.quantization_config(n, linear_names=bridge.linear_names)
    if qc is None:
        return set()
    ignored = set(qc.get("ignored_layers", ()))
    return {f"model.layers.{i}.{name}" for i in range(n) for name in bridge.linear_names} - ignored


def build_model(bridge: ModelBridge, *, attention: str, dtype: torch.dtype, device: torch.device,
                fp8_modules: set[str], quantizer: Fp8Quantizer | None,
                gemm: str | None) -> tuple[transformers.PreTrainedModel, dict[str, WeightSlot]]:
    """The bridge's model on ``device`` with uninitialized weights (built on the meta device: no
    random init; FP8 linears, fused projections and torch norms swapped in, then storage allocated
    once), and the slot of every checkpoint tensor.

    ``attention``: the transformers attention implementation (registered by the caller);
    ``fp8_modules``: HF names of the linears built as ``Fp8InferenceLinear`` with ``quantizer`` and
    the ``gemm`` backend (both unused when it is empty).
    """
    dims = bridge.dims
    model_cls, norm_cls = hf_classes(bridge)
    raw = {k: v for k, v in bridge.hf_config.items() if k not in ("quantization_config", "dtype", "torch_dtype")}
    config = model_cls.config_class.from_dict(raw)
    config._attn_implementation = attention
    with torch.device("meta"):
        model = model_cls(config)
    model.to(dtype)
    for name, norm in list(model.named_modules()):
        if isinstance(norm, norm_cls):
            parent, child = name.rsplit(".", 1)
            setattr(model.get_submodule(parent), child, torch.nn.RMSNorm(
                tuple(norm.weight.shape), eps=norm.variance_epsilon, device="meta", dtype=dtype))
    new_linear = functools.partial(_meta_linear, dtype=dtype, quantizer=quantizer, gemm=gemm)
    slots: dict[str, WeightSlot] = {}
    for i in range(dims.num_layers):
        for block_name, fused_name, parts in bridge.fused_projections:
            block = model.get_submodule(f"model.layers.{i}.{block_name}")
            prefix = f"model.layers.{i}.{block_name}."
            linears = [getattr(block, p) for p in parts]
            fp8 = {prefix + p in fp8_modules for p in parts}
            biased = {lin.bias is not None for lin in linears}
            whole_blocks = all(lin.out_features % WEIGHT_BLOCK[0] == 0 for lin in linears)
            if len(fp8) == 1 and len(biased) == 1 and (whole_blocks or fp8 == {False}):
                _fuse(block, fused_name, parts, prefix, fp8.pop(), biased.pop(), new_linear, slots)
        for name in bridge.linear_names:
            full = f"model.layers.{i}.{name}"
            if full + ".weight" not in slots:
                slots.update(_plain_linear(model, full, full in fp8_modules, new_linear))
    model.to_empty(device=device)
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=model.config).to(device)
    if dims.tied_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.requires_grad_(False)
    claimed = {id(slot.storage()) for slot in slots.values()}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in claimed:
            claimed.add(id(t))
            module_name, attr = name.rsplit(".", 1)
            slots[name] = WeightSlot(model.get_submodule(module_name), attr)
    if any(t.is_meta for t in model.buffers()):
        raise AssertionError("a model buffer was left on the meta device")
    return model.eval(), slots


def _meta_linear(in_features: int, out_features: int, *, bias: bool, fp8: bool, dtype: torch.dtype,
                 quantizer: Fp8Quantizer | None, gemm: str | None) -> torch.nn.Module:
    if fp8:
        return Fp8InferenceLinear(in_features, out_features, bias=bias, dtype=dtype, quantizer=quantizer,
                                  gemm=gemm, device="meta")
    return torch.nn.Linear(in_features, out_features, bias=bias, device="meta", dtype=dtype)


def _fuse(block, fused_name: str, parts: Sequence[str], prefix: str, fp8: bool, bias: bool,
          new_linear: Callable[..., torch.nn.Module], slots: dict[str, WeightSlot]) -> None:
    linears = [getattr(block, p) for p in parts]
    sizes = [lin.out_features for lin in linears]
    fused = FusedProjection(new_linear(linears[0].in_features, sum(sizes), bias=bias, fp8=fp8), sizes)
    setattr(block, fused_name, fused)
    row = 0
    for index, (part, size) in enumerate(zip(parts, sizes, strict=True)):
        setattr(block, part, ProjectionPart(fused, index))
        rows = (row, row + size)
        slots[f"{prefix}{part}.weight"] = WeightSlot(fused.linear, "weight", rows)
        if fp8:
            block_rows = (row // WEIGHT_BLOCK[0], (row + size) // WEIGHT_BLOCK[0])
            slots[f"{prefix}{part}.weight{SCALE_SUFFIX}"] = WeightSlot(fused.linear, "weight_scale_inv", block_rows)
        if bias:
            slots[f"{prefix}{part}.bias"] = WeightSlot(fused.linear, "bias", rows)
        row += size


def _plain_linear(model, name: str, fp8: bool, new_linear: Callable[..., torch.nn.Module]) -> dict[str, WeightSlot]:
    parent_name, child = name.rsplit(".", 1)
    parent = model.get_submodule(parent_name)
    linear = old = getattr(parent, child)
    if fp8:
        linear = new_linear(old.in_features, old.out_features, bias=old.bias is not None, fp8=True)
        setattr(parent, child, linear)
    slots = {f"{name}.weight": WeightSlot(linear, "weight")}
    if fp8:
        slots[f"{name}.weight{SCALE_SUFFIX}"] = WeightSlot(linear, "weight_scale_inv")
    if old.bias is not None:
        slots[f"{name}.bias"] = WeightSlot(linear, "bias")
    return slots


__all__ = ["Fp8InferenceLinear", "FusedProjection", "HfClasses", "ProjectionPart", "WeightSlot", "build_model",
           "fp8_module_names", "hf_classes"]
