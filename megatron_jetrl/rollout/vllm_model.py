"""Functions of a live vLLM model, run on the engine's worker (through ``collective_rpc``) and,
by the contract tests, on a bare model built on the CPU.

Names are HF checkpoint names throughout. vLLM fuses q/k/v into ``qkv_proj`` and gate/up into
``gate_up_proj`` (its ``packed_modules_mapping``), keeps each projection as a contiguous row
range of the fused tensor (``output_partition_sizes``), pads the vocabulary of embeddings and the
LM head, and under rollout TP holds this rank's shard of each split linear. On Hopper a
block-FP8 weight is kept exactly in the checkpoint layout: ``weight`` e4m3 [N, K] and
``weight_scale_inv`` fp32 [N/128, K/128] (``model_weight_specs`` raises if a kernel re-laid it
out). So every checkpoint tensor is a view of a live parameter, and an update can be written
into those views directly (``DirectTargets``), the way vLLM's own reload copies processed values
"into original tensor storage" to keep CUDA graphs valid. ``LayerwiseUpdate`` is the other way:
vLLM's own loaders through its layerwise reload (slower; any layout vLLM can load).

Legend: ``rows`` = a (start, stop) row range of the full checkpoint tensor that this rank holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch

from megatron_jetrl.rollout.base import TensorMeta, WeightMismatch

KV_SCALES = ("q_scale", "k_scale", "v_scale")
"""Per-layer FP8 KV-cache scales, loadable as ``<layer>.self_attn.attn.<name>`` (fp32 scalars)."""


def model_weight_specs(model: torch.nn.Module) -> dict[str, TensorMeta]:
    """Every checkpoint tensor this rank's vLLM ``model`` loads, by HF name, with the shape and dtype
    it must have: fused linears split back into their projections with the packed-modules mapping
    and the layer's partition sizes (this rank's shard under TP), ``weight_scale_inv`` for FP8
    linears, full embeddings / LM head (vLLM shards those itself), norms as held, and the FP8
    KV-cache scales of each attention layer when the KV cache is FP8.

    Raises ``RuntimeError`` when a parameter is held in a layout the checkpoint format does not
    describe (a kernel that transposes, pads or repacks: then the shipped bytes would not be the
    bytes computed with)."""
    specs = {name: TensorMeta(shape, view.dtype) for name, shape, view, _ in _checkpoint_tensors(model)}
    for attn_name in fp8_kv_attention(model):
        specs.update({f"{attn_name}.{s}": TensorMeta((), torch.float32) for s in KV_SCALES})
    return specs


def _checkpoint_tensors(model: torch.nn.Module
                        ) -> Iterator[tuple[str, tuple[int, ...], torch.Tensor, tuple[int, int] | None]]:
    """(HF name, full checkpoint shape on this rank, view of the live parameter holding it, rows)
    of every checkpoint weight of ``model``; ``rows`` is the (start, stop) range of a full
    vocabulary tensor this rank holds, None where the view takes the whole tensor."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    for name, param in model.named_parameters():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        data = param.data
        if isinstance(module, LinearBase):
            for hf_name, (shape, first) in _linear_parts(module_name, module, attr, param, packed).items():
                yield hf_name, shape, data.narrow(0, first, shape[0]), None
        elif isinstance(module, VocabParallelEmbedding):
            shard = module.shard_indices
            start, stop = shard.org_vocab_start_index, shard.org_vocab_end_index
            whole = (start, stop) == (0, module.org_vocab_size)
            yield (name, (module.org_vocab_size, module.embedding_dim), data.narrow(0, 0, stop - start),
                   None if whole else (start, stop))
        else:
            yield name, tuple(param.shape), data, None


def fp8_cache(kv_cache_dtype: Any) -> bool:
    """Whether vLLM's ``kv_cache_dtype`` (``fp8``, ``fp8_e4m3``, ... or a torch dtype's name) is an FP8 KV cache."""
    return str(kv_cache_dtype).startswith("fp8")


def fp8_kv_attention(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The attention layers of ``model`` whose KV cache is FP8, by module name."""
    from vllm.model_executor.layers.attention import Attention

    return {n: m for n, m in model.named_modules() if isinstance(m, Attention) and fp8_cache(m.kv_cache_dtype)}


def _linear_parts(module_name: str, layer: torch.nn.Module, attr: str, param: torch.Tensor,
                  packed: Mapping[str, Sequence[str]]) -> dict[str, tuple[tuple[int, ...], int]]:
    """HF name -> (checkpoint shape on this rank, first row in ``param``) of every projection a
    vLLM linear's parameter ``attr`` holds."""
    prefix, _, leaf = module_name.rpartition(".")
    parts = list(packed.get(leaf, [leaf]))
    sizes = list(layer.output_partition_sizes)
    if len(parts) != len(sizes):
        raise RuntimeError(f"vLLM layer {module_name}: packed modules {parts} but {len(sizes)} output partitions")
    names = [f"{prefix}.{p}" if prefix else p for p in parts]
    k = getattr(layer, "input_size_per_partition", None) or layer.input_size
    block = getattr(layer, "weight_block_size", None)
    if attr == "weight":
        expected = [(n, k) for n in sizes]
        if param.dtype not in (torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.float32):
            raise RuntimeError(f"vLLM holds {module_name}.weight as {param.dtype}; the checkpoint format is "
                               "float8_e4m3fn or the model dtype (an FNUZ platform?)")
    elif attr == "weight_scale_inv" and block:
        expected = [(math.ceil(n / block[0]), math.ceil(k / block[1])) for n in sizes]
    elif attr == "bias":
        expected = [(n,) for n in sizes]
    else:
        raise RuntimeError(f"vLLM layer {module_name} has parameter {attr!r}, which this engine cannot update")
    held = (sum(s[0] for s in expected), *expected[0][1:])
    if tuple(param.shape) != held:
        raise RuntimeError(f"vLLM holds {module_name}.{attr} as {list(param.shape)}; the checkpoint layout of "
                           f"{names} gives {list(held)} (a kernel re-laid it out; its bytes would not be the "
                           "trainer's)")
    out, first = {}, 0
    for n, shape in zip(names, expected, strict=True):
        out[f"{n}.{attr}"] = (shape, first)
        first += shape[0]
    return out


# ---------------------------------------------------------------------------------------------------
# Writing an update straight into the live parameters.


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor lives: ``view`` of a live parameter, which takes ``rows`` of the
    full checkpoint tensor (None: the whole tensor, whose shape is the view's)."""

    view: torch.Tensor
    rows: tuple[int, int] | None = None


class DirectTargets:
    """Every checkpoint tensor of ``model_weight_specs`` as a place in vLLM's live parameters, and
    the copies into them. Built once per engine: the views stay valid across sleep and wake (vLLM's
    sleep allocator unmaps and maps back the same device addresses) and across updates (nothing
    replaces the parameters). The weights may be discarded by a level-2 sleep; every tensor must
    then be written again before the next forward."""

    def __init__(self, model: torch.nn.Module):
        self.targets = {name: Target(view, rows) for name, _, view, rows in _checkpoint_tensors(model)}
        self.attention = fp8_kv_attention(model)

    def buffers(self) -> dict[str, torch.Tensor]:
        """The views a caller may write whole, in place, as raw bytes: those that take a whole
        checkpoint tensor and are contiguous (a weight sync's copy kernel writes into them)."""
        return {n: t.view for n, t in self.targets.items() if t.rows is None and t.view.is_contiguous()}

    def write(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into the live parameters (this rank's rows of full vocabulary
        tensors) and KV-cache scales into the attention layers. Names and shapes were checked
        against ``model_weight_specs`` by the caller."""
        scales: list[tuple[str, torch.Tensor]] = []
        with torch.no_grad():
            for name, t in tensors:
                target = self.targets.get(name)
                if target is None:
                    scales.append((name, t))
                    continue
                src = t if target.rows is None else t.narrow(0, target.rows[0], target.rows[1] - target.rows[0])
                if src.data_ptr() != target.view.data_ptr():  # not already written in place
                    target.view.copy_(src)
            if scales:
                self._write_kv_scales(scales)

    def _write_kv_scales(self, scales: list[tuple[str, torch.Tensor]]) -> None:
        """What vLLM's ``BaseKVCacheMethod.process_weights_after_loading`` sets from loaded scales:
        the device tensors the kernels read, their host copies and floats."""
        values = torch.stack([t.reshape(()).float() for _, t in scales]).tolist()  # one host sync
        for (name, _), value in zip(scales, values, strict=True):
            attn_name, _, kind = name.rpartition(".")
            attn = self.attention.get(attn_name)
            if attn is None or kind not in KV_SCALES:
                raise WeightMismatch(f"vllm engine: tensor {name} has no place in the model")
            if not (math.isfinite(value) and value > 0):
                raise WeightMismatch(f"vllm engine: KV-cache scale {name} is {value}; it must be finite and > 0")
            getattr(attn, f"_{kind}").fill_(value)
            setattr(attn, f"_{kind}_float", value)
            if kind != "q_scale":
                getattr(attn, f"_{kind}_cpu").fill_(value)


# ---------------------------------------------------------------------------------------------------
# vLLM's own loaders, through its layerwise reload.


class LayerwiseUpdate:
    """One checkpoint-format weight update of a live vLLM model (vLLM's layerwise reload):
    ``load`` any number of times, then ``finish`` once.

    ``initialize_layerwise_reload`` puts every layer back in checkpoint layout (on the meta device,
    keeping the live kernel tensors aside), ``model.load_weights`` runs vLLM's own loaders (q/k/v
    into ``qkv_proj``, gate/up into ``gate_up_proj``, scales alongside), each layer is processed as
    soon as all its tensors arrived and copied into the live tensors (CUDA graphs stay valid), and
    ``finalize_layerwise_reload`` closes the update. A plain second ``load_weights`` fails: the FP8
    method replaced the parameters by plain ``torch.nn.Parameter``s, whose kept loaders need
    vLLM's parameter classes. Tensors of a layer still incomplete at the end of a ``load`` are held
    by reference until the layer completes.

    ``presharded``: the tensors of TP-split linears are this rank's shards (shapes of
    ``model_weight_specs``), not full tensors. vLLM's linear loaders always cut a full tensor at
    ``tp_rank * shard``; for the duration of the update each split linear parameter's ``tp_rank``
    is set to 0 (``is_sharded_weight`` for loaders that read that), so a shard is copied whole (vLLM
    loads its replicated MLA latents the same way). Embeddings and the LM head still take full
    tensors."""

    def __init__(self, model: torch.nn.Module, vllm_config: Any, *, presharded: bool):
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.model, self.vllm_config = model, vllm_config
        with set_current_vllm_config(vllm_config):
            initialize_layerwise_reload(model)
        self._undo = _take_shards_whole(model) if presharded else []

    def load(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            self.model.load_weights(tensors)

    def finish(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        try:
            with set_current_vllm_config(self.vllm_config), torch.no_grad():
                finalize_layerwise_reload(self.model, self.vllm_config.model_config)
        finally:
            for obj, attr, value in reversed(self._undo):
                setattr(obj, attr, value)


def _take_shards_whole(model: torch.nn.Module) -> list[tuple[torch.Tensor, str, Any]]:
    """Make the loaders of every TP-split linear copy a given shard whole; returns what to undo."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.parameter import BasevLLMParameter

    undo: list[tuple[torch.Tensor, str, Any]] = []
    for module in model.modules():
        if not isinstance(module, LinearBase) or getattr(module, "tp_size", 1) == 1:
            continue
        for param in module._parameters.values():
            if param is None:
                continue
            if isinstance(param, BasevLLMParameter):
                undo.append((param, "tp_rank", param.tp_rank))
                param.tp_rank = 0
            else:
                undo.append((param, "is_sharded_weight", getattr(param, "is_sharded_weight", False)))
                param.is_sharded_weight = True
    return undo
