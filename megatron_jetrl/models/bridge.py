"""A model bridge: HF ``config.json`` -> megatron-core settings, and the HF <-> Megatron tensor map.

The tensor map (``ModelBridge.tensor_map``) is the one source of truth for names and layouts: the
conversion tools, the weight sync and the tests all use it. Megatron names are the keys of
megatron-core's GPT checkpoints (TE-style norm keys: ``...linear_qkv.layer_norm_weight``, which the
local layer spec maps its ``input_layernorm`` to), with an explicit layer index. The "full" layout
of a tensor is its TP=1 layout; ``tp_shard`` gives any rank's shard of it.

This module imports torch only; the actor turns the kwargs below into megatron-core objects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping

import torch

from megatron_jetrl.config import ConfigError, check_integer
from megatron_jetrl.models import layout

COPY, QKV, FC1, VOCAB = "copy", "qkv", "fc1", "vocab"


@dataclass(frozen=True)
class ModelDims:
    """The architecture facts read from an HF config, validated."""

    architecture: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_groups: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rope_scaling_factor: float | None
    norm_eps: float
    qkv_bias: bool
    qk_norm: bool
    tied_embeddings: bool

    @property
    def q_rows(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_rows(self) -> int:
        return self.num_groups * self.head_dim


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False


@dataclass(frozen=True)
class TensorSpec:
    """One Megatron tensor and where it comes from.

    ``fuse``: ``copy`` (one HF tensor as is), ``qkv`` (q, k, v interleaved per query group),
    ``fc1`` ([gate; up]), ``vocab`` (rows padded to the padded vocab). ``tp_dim``: the dim TP splits
    (0 column-parallel, 1 row-parallel), None when replicated. ``shape``: the full (TP=1) shape.
    """

    megatron: str
    hf: tuple[str, ...]
    fuse: str
    tp_dim: int | None
    shape: tuple[int, ...]
    layer: int | None = None
    linear: bool = False
    """A linear layer's weight: FP8 in training and rollout (unless its layer is kept in BF16)."""


class ModelBridge:
    """Base of the per-family bridges; a family sets its names and reads its config quirks."""

    architecture: ClassVar[str]
    model_type: ClassVar[str]
    hf_norm: ClassVar[str]
    """The family's RMSNorm class name in transformers' ``modeling_<model_type>``."""

    def __init__(self, hf_config: Mapping[str, Any]):
        self.hf_config = dict(hf_config)
        self.dims = self._read_dims(self.hf_config)

    # -- config -------------------------------------------------------------------------------
    def _read_dims(self, c: dict) -> ModelDims:
        def need(key: str) -> Any:
            if c.get(key) is None:
                raise ConfigError(f"config.json:{key}", None, f"required for {self.architecture}")
            return c[key]

        def dim(key: str, default: int | None = None) -> int:
            """A size: a positive integer; ``default`` when unset (no default: required)."""
            value = c.get(key)
            if value is None:
                value = need(key) if default is None else default
            return _positive_int(f"config.json:{key}", value)

        if _flag("config.json:use_sliding_window", c.get("use_sliding_window")):
            raise ConfigError("config.json:use_sliding_window", True, "sliding-window attention is not supported")
        hidden, heads = dim("hidden_size"), dim("num_attention_heads")
        groups = dim("num_key_value_heads", heads)
        if c.get("head_dim") is None and hidden < heads:
            raise ConfigError("config.json:num_attention_heads", heads,
                              f"must be at most hidden_size ({hidden}) when head_dim is not set (head_dim = "
                              "hidden_size // num_attention_heads); set head_dim, or fix the two sizes")
        head_dim = dim("head_dim", hidden // heads)
        if heads % groups:
            raise ConfigError("config.json:num_key_value_heads", groups, f"must divide num_attention_heads ({heads})")
        rope = _mapping("config.json:rope_parameters", c.get("rope_parameters"))
        theta_key, theta = "rope_theta", c.get("rope_theta")
        if theta is None:
            theta_key, theta = "rope_parameters.rope_theta", rope.get("rope_theta")
        if theta is None:
            raise ConfigError("config.json:rope_theta", None, "required (or rope_parameters.rope_theta)")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = _mapping("config.json:rope_scaling", c.get("rope_scaling"))
        eps = c.get("rms_norm_eps")
        return ModelDims(
            architecture=self.architecture,
            num_layers=dim("num_hidden_layers"),
            hidden_size=hidden,
            ffn_hidden_size=dim("intermediate_size"),
            num_heads=heads,
            num_groups=groups,
            head_dim=head_dim,
            vocab_size=dim("vocab_size"),
            max_position_embeddings=dim("max_position_embeddings", 4096),
            rope_theta=positive_number(f"config.json:{theta_key}", theta),
            rope_scaling_factor=self._rope_scaling_factor(scaling or (rope if rope_type != "default" else None)),
            norm_eps=1e-6 if eps is None else positive_number("config.json:rms_norm_eps", eps),
            qkv_bias=self._qkv_bias(c),
            qk_norm=self._qk_norm(c),
            tied_embeddings=_flag("config.json:tie_word_embeddings", c.get("tie_word_embeddings")),
        )

    def _rope_scaling_factor(self, scaling: Mapping[str, Any] | None) -> float | None:
        if scaling:
            raise ConfigError("config.json:rope_scaling", dict(scaling),
                              f"{self.architecture} supports no rope scaling")
        return None

    def _qkv_bias(self, c: dict) -> bool:
        return _flag("config.json:attention_bias", c.get("attention_bias"))

    def _qk_norm(self, c: dict) -> bool:
        return False

    def check_layout(self, par: ParallelLayout) -> None:
        """Fail early, naming the setting, when the model cannot be split this way (``par`` is the
        trainer's layout, ``actor.parallel``)."""
        d = self.dims
        for name, value in (("tp", par.tp), ("pp", par.pp)):
            check_integer(f"actor.parallel.{name}", value, minimum=1)
        divisible = (("num_attention_heads", d.num_heads), ("num_key_value_heads", d.num_groups),
                     ("intermediate_size", d.ffn_hidden_size))
        for what, n in divisible:
            if n % par.tp:
                raise ConfigError("actor.parallel.tp", par.tp, f"must divide {what} ({n}); choose a TP that divides it")
        if d.num_layers % par.pp:
            raise ConfigError("actor.parallel.pp", par.pp, f"must divide num_hidden_layers ({d.num_layers})")

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Vocab padded to a multiple of 128 x TP (megatron's make_vocab_size_divisible_by=128)."""
        unit = 128 * tp
        return math.ceil(self.dims.vocab_size / unit) * unit

    def transformer_config_kwargs(self, par: ParallelLayout, params_dtype: torch.dtype = torch.bfloat16) -> dict:
        """Keyword arguments of megatron-core's ``TransformerConfig`` for this model and layout."""
        self.check_layout(par)
        d = self.dims
        return {
            "num_layers": d.num_layers,
            "hidden_size": d.hidden_size,
            "ffn_hidden_size": d.ffn_hidden_size,
            "num_attention_heads": d.num_heads,
            "num_query_groups": d.num_groups,
            "kv_channels": d.head_dim,
            "normalization": "RMSNorm",
            "layernorm_epsilon": d.norm_eps,
            "gated_linear_unit": True,
            "activation_func": torch.nn.functional.silu,
            "add_bias_linear": False,
            "add_qkv_bias": d.qkv_bias,
            "qk_layernorm": d.qk_norm,
            "bias_activation_fusion": False,
            "masked_softmax_fusion": False,
            "persist_layer_norm": False,
            "apply_rope_fusion": False,
            "attention_dropout": 0.0,
            "hidden_dropout": 0.0,
            "tensor_model_parallel_size": par.tp,
            "pipeline_model_parallel_size": par.pp,
            "sequence_parallel": par.sequence_parallel,
            "params_dtype": params_dtype,
            "bf16": params_dtype == torch.bfloat16,
            "fp16": params_dtype == torch.float16,
        }

    def gpt_model_kwargs(self, par: ParallelLayout) -> dict:
        """Keyword arguments of megatron-core's ``GPTModel`` (besides config and layer spec)."""
        d = self.dims
        kwargs = {
            "vocab_size": self.padded_vocab_size(par.tp),
            "max_sequence_length": d.max_position_embeddings,
            "position_embedding_type": "rope",
            "rotary_percent": 1.0,
            "rotary_base": int(d.rope_theta) if float(d.rope_theta).is_integer() else d.rope_theta,
            "share_embeddings_and_output_weights": d.tied_embeddings,
        }
        if d.rope_scaling_factor is not None:
            kwargs.update(rope_scaling=True, rope_scaling_factor=d.rope_scaling_factor)
        return kwargs

    # -- tensor map ---------------------------------------------------------------------------
    def tensor_map(self) -> list[TensorSpec]:
        """Every Megatron tensor of the model with its HF sources, in checkpoint order."""
        d = self.dims
        vocab = self.padded_vocab_size(1)
        specs = [TensorSpec("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), VOCAB, 0,
                            (vocab, d.hidden_size))]
        for i in range(d.num_layers):
            specs += self.layer_map(i)
        specs.append(TensorSpec("decoder.final_layernorm.weight", ("model.norm.weight",), COPY, None, (d.hidden_size,)))
        if not d.tied_embeddings:
            specs.append(TensorSpec("output_layer.weight", ("lm_head.weight",), VOCAB, 0, (vocab, d.hidden_size)))
        return specs

    def layer_map(self, i: int) -> list[TensorSpec]:
        d = self.dims
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv_rows = d.q_rows + 2 * d.kv_rows
        attn = [f"{h}self_attn.{p}_proj" for p in "qkv"]
        specs = [
            TensorSpec(f"{m}self_attention.linear_qkv.layer_norm_weight", (f"{h}input_layernorm.weight",), COPY, None,
                       (d.hidden_size,), i),
            TensorSpec(f"{m}self_attention.linear_qkv.weight", tuple(f"{n}.weight" for n in attn), QKV, 0,
                       (qkv_rows, d.hidden_size), i, linear=True),
        ]
        if d.qkv_bias:
            specs.append(TensorSpec(f"{m}self_attention.linear_qkv.bias", tuple(f"{n}.bias" for n in attn), QKV, 0,
                                    (qkv_rows,), i))
        if d.qk_norm:
            specs += [
                TensorSpec(f"{m}self_attention.q_layernorm.weight", (f"{h}self_attn.q_norm.weight",), COPY, None,
                           (d.head_dim,), i),
                TensorSpec(f"{m}self_attention.k_layernorm.weight", (f"{h}self_attn.k_norm.weight",), COPY, None,
                           (d.head_dim,), i),
            ]
        specs += [
            TensorSpec(f"{m}self_attention.linear_proj.weight", (f"{h}self_attn.o_proj.weight",), COPY, 1,
                       (d.hidden_size, d.q_rows), i, linear=True),
            TensorSpec(f"{m}mlp.linear_fc1.layer_norm_weight", (f"{h}post_attention_layernorm.weight",), COPY, None,
                       (d.hidden_size,), i),
            TensorSpec(f"{m}mlp.linear_fc1.weight", (f"{h}mlp.gate_proj.weight", f"{h}mlp.up_proj.weight"), FC1, 0,
                       (2 * d.ffn_hidden_size, d.hidden_size), i, linear=True),
            TensorSpec(f"{m}mlp.linear_fc2.weight", (f"{h}mlp.down_proj.weight",), COPY, 1,
                       (d.hidden_size, d.ffn_hidden_size), i, linear=True),
        ]
        return specs

    @property
    def linear_names(self) -> tuple[str, ...]:
        """HF module names of a decoder layer's linears, relative to the layer
        (``self_attn.q_proj``, ...), in tensor-map order: from the layer map itself."""
        return tuple(n for spec in self.layer_map(0) if spec.linear for n in _layer_modules(spec))

    @property
    def fused_projections(self) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
        """Linears of one input that megatron fuses into one GEMM, as (block, fused module name,
        HF linears in row order): q/k/v -> ``self_attn.qkv_proj``, gate/up -> ``mlp.gate_up_proj``
        (the names vLLM and the hf engine give the fused modules)."""
        fused = {QKV: "qkv_proj", FC1: "gate_up_proj"}
        out = []
        for spec in self.layer_map(0):
            if spec.linear and spec.fuse in fused:
                names = _layer_modules(spec)
                out.append((names[0].rpartition(".")[0], fused[spec.fuse], tuple(n.rpartition(".")[2] for n in names)))
        return tuple(out)

    def hf_shapes(self, spec: TensorSpec) -> list[tuple[int, ...]]:
        """Expected shapes of ``spec``'s HF sources."""
        d = self.dims
        if spec.fuse == QKV:
            tail = spec.shape[1:]
            return [(d.q_rows, *tail), (d.kv_rows, *tail), (d.kv_rows, *tail)]
        if spec.fuse == FC1:
            return [(d.ffn_hidden_size, d.hidden_size)] * 2
        if spec.fuse == VOCAB:
            return [(d.vocab_size, *spec.shape[1:])]
        return [spec.shape]

    def check_sources(self, spec: TensorSpec, shape_of: Callable[[str], tuple[int, ...]]) -> None:
        """Raise, naming the tensor, if an HF source of ``spec`` has the wrong shape."""
        for name, shape in zip(spec.hf, self.hf_shapes(spec), strict=True):
            if tuple(shape_of(name)) != shape:
                raise ValueError(f"HF tensor {name} has shape {tuple(shape_of(name))}; {self.architecture} with "
                                 f"this config.json needs {shape}")

    def to_megatron(self, spec: TensorSpec, get_hf: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The full (TP=1) Megatron tensor of ``spec`` from its HF sources (shapes checked)."""
        sources = {name: get_hf(name) for name in spec.hf}
        self.check_sources(spec, lambda name: sources[name].shape)
        return self._fuse(spec, list(sources.values()))

    def _fuse(self, spec: TensorSpec, sources: list[torch.Tensor]) -> torch.Tensor:
        """HF sources (in ``spec.hf`` order) -> the full Megatron tensor; shapes unchecked."""
        if spec.fuse == QKV:
            return layout.interleave_qkv(*sources, num_groups=self.dims.num_groups)
        if spec.fuse == FC1:
            return torch.cat(sources)
        if spec.fuse == VOCAB:
            return layout.pad_rows(sources[0], spec.shape[0])
        return sources[0]

    def to_hf(self, spec: TensorSpec, full: torch.Tensor) -> dict[str, torch.Tensor]:
        """Inverse of ``to_megatron``: HF tensors from the full Megatron tensor."""
        if tuple(full.shape) != spec.shape:
            raise ValueError(f"Megatron tensor {spec.megatron} has shape {tuple(full.shape)}; expected {spec.shape}")
        d = self.dims
        if spec.fuse == QKV:
            parts = layout.split_qkv(full, d.num_heads, d.num_groups, d.head_dim)
        elif spec.fuse == FC1:
            parts = tuple(t.contiguous() for t in full.chunk(2))
        elif spec.fuse == VOCAB:
            parts = (full[: d.vocab_size].contiguous(),)
        else:
            parts = (full,)
        return dict(zip(spec.hf, parts, strict=True))

    def index_map(self, spec: TensorSpec, part: int, size: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """Where every index of HF tensor ``spec.hf[part]`` along the dim TP splits lives at TP
        ``size``: (that dim, the TP rank holding it, its index in that rank's shard). Derived by
        running this bridge's own conversion (``_fuse``, then ``tp_shard``) over index tensors, so
        a caller (the weight sync's plan) shares these layout rules instead of restating them. A
        tensor TP does not split is on every rank; rank 0 is named."""
        dim = spec.tp_dim if spec.tp_dim is not None else 0
        shapes = self.hf_shapes(spec)
        sources, first = [], 1  # ids start at 1: vocab padding rows are 0
        for shape in shapes:
            view = [1] * len(shape)
            view[dim] = shape[dim]
            sources.append(torch.arange(first, first + shape[dim]).reshape(view))
            first += shape[dim]
        full = self._fuse(spec, sources)
        lo = 1 + sum(shape[dim] for shape in shapes[:part])
        n = shapes[part][dim]
        src_tp = torch.full((n,), -1, dtype=torch.long)
        src_local = torch.full((n,), -1, dtype=torch.long)
        for rank in reversed(range(size)):  # reversed: rank 0 is named for what every rank holds
            ids = self.tp_shard(spec, full, rank, size).reshape(-1)  # one dim of length > 1
            local = ((ids >= lo) & (ids < lo + n)).nonzero().flatten()
            src_tp[ids[local] - lo] = rank
            src_local[ids[local] - lo] = local
        if (src_tp < 0).any():
            raise AssertionError(f"{spec.hf[part]}: {int((src_tp < 0).sum())} indices are on no TP rank")
        return dim, src_tp, src_local

    def shard_shape(self, spec: TensorSpec, size: int) -> tuple[int, ...]:
        """Shape of every TP rank's ``tp_shard`` of ``spec`` at TP ``size`` (vocab padded to 128 x TP)."""
        shape = list(spec.shape)
        if spec.tp_dim is not None:
            shape[spec.tp_dim] = (self.padded_vocab_size(size) if spec.fuse == VOCAB else shape[spec.tp_dim]) // size
        return tuple(shape)

    def tp_shard(self, spec: TensorSpec, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """TP rank ``rank``'s shard of the full tensor, as megatron-core holds it on that rank."""
        if spec.tp_dim is None:
            return full
        if spec.fuse == FC1:
            gate, up = full.chunk(2)
            return layout.fc1_shard(gate, up, rank, size)
        if spec.fuse == VOCAB:
            full = layout.pad_rows(full, self.padded_vocab_size(size))
        return layout.tp_chunk(full, spec.tp_dim, rank, size)


def _positive_int(key: str, value: Any) -> int:
    """``value`` when it is an integer >= 1 (an integral float too: JSON writers differ); else a
    ConfigError naming ``key``. Sizes of 0 or less build no model (or a silently empty one)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(key, value, "must be a positive integer")
    return value


def positive_number(key: str, value: Any) -> float:
    """``value`` as a float when it is a finite number > 0 (a numeric string too: YAML 1.1 reads an
    inline ``1e-6`` as one); else a ConfigError naming ``key``. An epsilon or RoPE base of 0 is no model."""
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number) or number <= 0:
        raise ConfigError(key, value, "must be a finite number > 0")
    return float(number)


def _flag(key: str, value: Any) -> bool:
    """``value`` when it is true or false, False when unset; else a ConfigError naming ``key``
    (``bool("false")`` is True)."""
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ConfigError(key, value, "must be true or false")
    return value


def _mapping(key: str, value: Any) -> Mapping[str, Any]:
    """``value`` when it is a mapping (a JSON object), {} when unset; else a ConfigError naming ``key``."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(key, value, "must be a mapping (a JSON object)")
    return value


def _layer_modules(spec: TensorSpec) -> list[str]:
    """The HF modules of a layer-0 weight spec, relative to the layer: ``self_attn.q_proj``, ..."""
    prefix = "model.layers.0."
    return [n[len(prefix):].rpartition(".")[0] for n in spec.hf]
