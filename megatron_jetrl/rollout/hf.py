"""The ``hf`` rollout engine: a transformers model whose decoder linears compute like the trainer's FProp.

Where vLLM is absent (CPU machines, tests, small runs) rollouts come from this engine. It builds the
transformers model of the checkpoint's architecture in the recipe's compute dtype and, when the
recipe rolls out in FP8, replaces every decoder linear the recipe does not keep in BF16 with
``Fp8InferenceLinear``: the checkpoint layout's FP8 codes and ``weight_scale_inv`` as buffers, and a
forward that *is* the trainer's FProp (``Fp8BlockLinear.forward``): the same quantizer call on the
activation (1x128 groups) and the same ``fp8_gemm``. Given the weight bytes the sync ships, an
engine linear's output is bit for bit the trainer linear's output for the same input.

Two departures from the stock transformers modules, both towards the trainer: RMSNorms are
torch's fused ``nn.RMSNorm`` in the model dtype (what the actor's megatron layers run, instead of
transformers' fp32 formula), and q/k/v and gate/up each run as one GEMM over their stacked rows
(``FusedProjection``), as the trainer's fused ``linear_qkv`` and ``linear_fc1`` do, which also
halves the GEMM launches of a decode step. Weights keep their HF checkpoint names: each name is a
row range of the tensor that holds it (``WeightSlot``); an FP8 projection is fused only where
its rows are whole 128-row blocks, so its ``weight_scale_inv`` is a row range too.

Decoding runs the transformers model one token at a time over a KV cache of its own
(``SlotKvCache``). Prompts are left-padded, so slot ``s`` of every row holds column ``s`` of the
padded batch and one write position serves the whole batch: no per-row indexing, no per-step
allocation, and (on CUDA) a decode step that is captured once per batch as a CUDA graph and
replayed. Stops are checked on the device; the host looks every ``STOP_CHECK_EVERY`` steps, and
then also drops finished rows from the batch once they are half of it.

Shape legend: B rows of a batch (prompt x sample), U distinct prompts of a batch, L padded prompt
length, S cache slots (L + max_new_tokens - 1), V vocab, H KV heads, G query heads per KV head,
D head dim, T max_new_tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch
import transformers
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import AttentionInterface
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3

from megatron_jetrl.models import bridge_for
from megatron_jetrl.models.fp8_export import SCALE_SUFFIX
from megatron_jetrl.models.hf_checkpoint import CheckpointError, HFCheckpoint
from megatron_jetrl.ops import NativeQuantizer
from megatron_jetrl.precision import (
    WEIGHT_BLOCK,
    Fp8Quantizer,
    Fp8Tensor,
    PrecisionRecipe,
    dequantize_fp8_blockwise,
    fp8_gemm,
    quantize_fp8_blockwise,
    resolve_gemm_backend,
)
from megatron_jetrl.rollout.base import (
    MissingWeights,
    Sample,
    SamplingParams,
    TensorMeta,
    WeightMismatch,
    check_against_specs,
)
from megatron_jetrl.rollout.settings import HfOptions

ARCHITECTURES: dict[str, tuple[type[transformers.PreTrainedModel], type[torch.nn.Module]]] = {
    "LlamaForCausalLM": (transformers.LlamaForCausalLM, modeling_llama.LlamaRMSNorm),
    "Qwen2ForCausalLM": (transformers.Qwen2ForCausalLM, modeling_qwen2.Qwen2RMSNorm),
    "Qwen3ForCausalLM": (transformers.Qwen3ForCausalLM, modeling_qwen3.Qwen3RMSNorm),
}
"""The transformers model class and RMSNorm class of each supported ``architectures`` entry."""

ATTENTION = "jetrl_slot_attention"
"""Name under which ``slot_attention`` is registered with transformers' ``AttentionInterface``."""

STOP_CHECK_EVERY = 16
"""Decode steps between the host's looks at the device-side finished mask (one sync each)."""


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


class SlotKvCache:
    """The KV cache of one left-padded batch, duck-typing the part of transformers' ``Cache`` the
    Llama / Qwen2 / Qwen3 attention calls (``update``).

    ``k[layer]``, ``v[layer]``: [B, H, S, D] in the model dtype, allocated once. During a prefill
    (``prefill_rows``) the attention sees the prefill batch's own keys and values, and each batch row
    gets its prompt's (one prefill serves all samples of a prompt). During decoding, every row writes
    slot ``write_pos`` (a device tensor, so a captured step replays at later slots) and attends over
    all S slots; the attention mask hides padding and slots not yet written.
    """

    def __init__(self, num_layers: int, rows: int, heads: int, slots: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (rows, heads, slots, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.write_pos = torch.zeros(1, dtype=torch.long, device=device)
        self._prefill: tuple[torch.Tensor, torch.Tensor] | None = None

    def prefill_rows(self, rows: torch.Tensor | None, src: torch.Tensor | None) -> None:
        """Next forwards are a prefill whose row ``src[i]`` fills batch row ``rows[i]``; None ends it."""
        self._prefill = None if rows is None else (rows, src)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self._prefill is not None:
            rows, src = self._prefill
            length = key_states.shape[2]
            self.k[layer_idx][:, :, :length].index_copy_(0, rows, key_states.index_select(0, src))
            self.v[layer_idx][:, :, :length].index_copy_(0, rows, value_states.index_select(0, src))
            return key_states, value_states
        self.k[layer_idx].index_copy_(2, self.write_pos, key_states)
        self.v[layer_idx].index_copy_(2, self.write_pos, value_states)
        return self.k[layer_idx], self.v[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise RuntimeError("SlotKvCache needs explicit position_ids")

    def keep_rows(self, keep: torch.Tensor) -> None:
        self.k = [t.index_select(0, keep) for t in self.k]
        self.v = [t.index_select(0, keep) for t in self.v]


def slot_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention for the engine's model: transformers' SDPA for a prefill; for a decode step (one
    query per row) the G query heads of each KV head are laid out as G queries, so SDPA reads the
    cache once instead of through transformers' per-step ``repeat_kv`` copy of it (G times the
    cache's bytes, more than the weights at long context)."""
    if query.shape[2] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    B, Hq, _, D = query.shape
    H = key.shape[1]
    q = query.reshape(B, H, Hq // H, D)
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(B, Hq, 1, D).transpose(1, 2).contiguous(), None


class HfEngine:
    """``RolloutEngine`` on a transformers model (see the module docstring).

    Args:
        hf_config: the checkpoint's ``config.json`` as a dict (an FP8 export's
            ``quantization_config`` is ignored: the recipe decides which layers run in FP8).
        recipe: precision recipe: compute dtype, FP8 rollout, layers kept in BF16, scale options.
        options: the ``rollout.hf`` section (``HfOptions``): ``max_num_seqs`` (most rows, prompt x
            sample, decoded together), ``max_batch_tokens`` (most KV-cache slots of a batch: rows x
            (padded prompt + max_new_tokens)), ``max_prefill_tokens`` (most padded prompt tokens in
            one prefill forward), ``cuda_graphs`` (capture the decode step; CUDA only), ``gemm``
            (FP8 GEMM backend; ``auto``: scaled_mm on Hopper, the emulation elsewhere).
        device: where the model, the cache and the sampling live.
        quantizer: activation quantizer of the FP8 linears; default ``NativeQuantizer`` with the
            recipe's scale options (the trainer's). Its options must equal the recipe's.
    """

    def __init__(
        self,
        hf_config: dict,
        recipe: PrecisionRecipe,
        options: HfOptions = HfOptions(),
        *,
        device: torch.device | str,
        quantizer: Fp8Quantizer | None = None,
    ):
        if not isinstance(recipe, PrecisionRecipe):
            raise TypeError(f"recipe must be a PrecisionRecipe; got {type(recipe).__name__}")
        if not isinstance(options, HfOptions):
            raise TypeError(f"options must be an HfOptions; got {type(options).__name__}")
        self.options = options
        self.bridge = bridge_for(hf_config)
        self.dims = self.bridge.dims
        self.recipe = recipe
        self.device = torch.device(device)
        self.dtype = recipe.compute_dtype
        self.max_num_seqs, self.max_batch_tokens, self.max_prefill_tokens = (
            options.max_num_seqs, options.max_batch_tokens, options.max_prefill_tokens)
        self.cuda_graphs = options.cuda_graphs and self.device.type == "cuda"
        self.quantizer: Fp8Quantizer | None = None
        self.gemm: str | None = None
        if recipe.rollout_fp8:
            self.gemm = resolve_gemm_backend(options.gemm, self.device)
            self.quantizer = quantizer if quantizer is not None else NativeQuantizer(
                pow2_scales=recipe.fp8.pow2_scales, eps=recipe.fp8.amax_epsilon)
            ours = (self.quantizer.pow2_scales, self.quantizer.eps)
            if ours != (recipe.fp8.pow2_scales, recipe.fp8.amax_epsilon):
                raise ValueError(
                    f"the quantizer has (pow2_scales, eps) = {ours}; the recipe has "
                    f"{(recipe.fp8.pow2_scales, recipe.fp8.amax_epsilon)}: the engine's activations must be "
                    "quantized as the trainer's are"
                )
        self.fp8_modules = self._fp8_module_names()
        self.model, self._slots = self._build_model(hf_config)
        self._specs = {name: TensorMeta(tuple(slot.view().shape), slot.view().dtype)
                       for name, slot in self._slots.items()}
        self._storages = list({id(slot.storage()): slot.storage() for slot in self._slots.values()}.values())
        self._shapes = [tuple(t.shape) for t in self._storages]
        self._host: list[torch.Tensor] = []
        self._weights_on_device = True
        self._missing = MissingWeights("hf", self._specs)
        self._awake = True
        self._closed = False

    @classmethod
    def from_checkpoint(cls, path: str | Path, recipe: PrecisionRecipe, options: HfOptions = HfOptions(),
                        **kwargs) -> "HfEngine":
        """An engine with the weights of an HF checkpoint directory (safetensors; BF16, or an FP8
        block export as ``tools/convert_megatron_to_hf.py --fp8-block`` writes). BF16 linears the
        engine runs in FP8 are quantized with the recipe; FP8 linears of layers it keeps in BF16 are
        dequantized."""
        checkpoint = HFCheckpoint(path)
        qc = checkpoint.config.get("quantization_config")
        if qc is not None and list(qc.get("weight_block_size") or []) != list(WEIGHT_BLOCK):
            raise CheckpointError(f"{path}: quantization_config {qc} is not the FP8 block layout "
                                  f"(quant_method fp8, weight_block_size {list(WEIGHT_BLOCK)})")
        engine = cls(checkpoint.config, recipe, options, **kwargs)
        engine.load_checkpoint(checkpoint)
        return engine

    # -- weights ------------------------------------------------------------------------------
    def weight_specs(self) -> dict[str, TensorMeta]:
        return dict(self._specs)

    def named_weights(self) -> dict[str, torch.Tensor]:
        """Every tensor of ``weight_specs()`` as the engine holds it now (views; do not keep them
        across ``sleep``/``wake``)."""
        self._check_open()
        return {name: slot.view() for name, slot in self._slots.items()}

    def weight_buffers(self) -> dict[str, torch.Tensor]:
        """The engine's own weight tensors, for an in-process weight sync to write in place (one
        copy instead of assembling then copying); retakes weight memory when asleep. Valid until
        the next ``sleep()``; never written while ``generate`` runs (the caller's loop is serial)."""
        self._check_open()
        if not self._weights_on_device:
            self._restore_weights()
        buffers = self.named_weights()
        self._missing.arrived(buffers)  # the caller writes all of them
        return buffers

    def update_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._check_open()
        batch = list(tensors)
        metas: dict[str, TensorMeta] = {}
        for item in batch:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
                raise TypeError(f"update_weights takes (name, tensor) pairs; got {type(item).__name__}")
            name, t = item
            if name in metas:
                raise WeightMismatch(f"hf engine update_weights: tensor {name} is given twice in one call")
            metas[name] = TensorMeta(tuple(t.shape), t.dtype)
        check_against_specs(self._specs, metas, what="hf engine update_weights")
        if not self._weights_on_device:
            self._restore_weights()
        with torch.no_grad():
            for name, t in batch:
                self._slots[name].view().copy_(t)
        self._missing.arrived(metas)

    def load_checkpoint(self, checkpoint: HFCheckpoint | str | Path, *, bucket_bytes: int = 1 << 30) -> None:
        """Load every engine tensor from an HF checkpoint (see ``from_checkpoint``); every name is
        checked to be present before anything is written."""
        if not isinstance(checkpoint, HFCheckpoint):
            checkpoint = HFCheckpoint(checkpoint)
        ignored = {"lm_head.weight"} if self.dims.tied_embeddings else set()
        wanted = {n for n in self._specs if not n.endswith(SCALE_SUFFIX)}
        missing = sorted(n for n in wanted if n not in checkpoint)
        if missing:
            raise CheckpointError(f"{checkpoint.path} lacks {len(missing)} tensor(s) the engine needs, "
                                  f"e.g. {missing[:3]}")
        known = set(self._specs) | {n + SCALE_SUFFIX for n in wanted} | ignored
        unknown = sorted(n for n in checkpoint.weight_map if n not in known)
        if unknown:
            raise CheckpointError(f"{checkpoint.path} has {len(unknown)} tensor(s) this {self.dims.architecture} "
                                  f"engine does not have, e.g. {unknown[:3]}; does config.json match the weights?")
        bucket, size = [], 0
        for name, t in self._checkpoint_tensors(checkpoint, sorted(wanted)):
            bucket.append((name, t))
            size += t.numel() * t.element_size()
            if size >= bucket_bytes:
                self.update_weights(bucket)
                bucket, size = [], 0
        if bucket:
            self.update_weights(bucket)

    def _checkpoint_tensors(self, checkpoint: HFCheckpoint, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        fp8 = self.recipe.fp8
        for name in names:
            t = checkpoint.get(name)
            stored_fp8 = t.dtype == torch.float8_e4m3fn
            if stored_fp8:
                if name + SCALE_SUFFIX not in checkpoint:
                    raise CheckpointError(f"{checkpoint.path}: FP8 tensor {name} has no {name + SCALE_SUFFIX}")
                scale_inv = checkpoint.get(name + SCALE_SUFFIX)
            if self._specs[name].dtype == torch.float8_e4m3fn:
                if not stored_fp8:
                    t, scale_inv = quantize_fp8_blockwise(t.to(self.device), WEIGHT_BLOCK,
                                                          pow2_scales=fp8.pow2_scales, eps=fp8.amax_epsilon)
                yield name, t
                yield name + SCALE_SUFFIX, scale_inv
            elif stored_fp8:
                yield name, dequantize_fp8_blockwise(t, scale_inv, WEIGHT_BLOCK, dtype=self.dtype)
            else:
                yield name, t.to(self._specs[name].dtype)

    # -- memory -------------------------------------------------------------------------------
    @property
    def weights_discarded(self) -> bool:
        """True while some weight tensor has not been loaded since the weights were created or
        dropped by a sleep (``generate`` refuses until it has)."""
        return bool(self._missing)

    def sleep(self) -> None:
        """The weights dropped (default: the next sync writes them all), or with
        ``sleep_keeps_weights`` moved to (pinned, on CUDA) host memory, kept there across steps;
        the cache allocator's free blocks back to the driver."""
        self._check_open()
        if self._weights_on_device and not self.options.sleep_keeps_weights:
            for t in self._storages:
                t.data = torch.empty(0, dtype=t.dtype, device=self.device)
            self._weights_on_device = False
            self._missing.dropped()
        if self._weights_on_device:
            pin = self.device.type == "cuda"
            if not self._host:
                self._host = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin) for t in self._storages]
            for t, host in zip(self._storages, self._host, strict=True):
                host.copy_(t, non_blocking=pin)
            if pin:
                torch.cuda.synchronize(self.device)
            for t, host in zip(self._storages, self._host, strict=True):
                t.data = host
            self._weights_on_device = False
        self._awake = False
        self._release_cache()

    def wake(self) -> None:
        self._check_open()
        if not self._weights_on_device:
            self._restore_weights()
        self._awake = True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._slots, self._storages, self._host, self.model = {}, [], [], None
        self._release_cache()

    def _restore_weights(self) -> None:
        """Weight memory back on the device: the kept host copy, or (dropped) uninitialised memory
        that ``_missing`` says must be written before the next ``generate``."""
        if self.options.sleep_keeps_weights:
            for t, host in zip(self._storages, self._host, strict=True):
                t.data = torch.empty(t.shape, dtype=t.dtype, device=self.device)
                t.copy_(host, non_blocking=True)
        else:
            for t, shape in zip(self._storages, self._shapes, strict=True):
                t.data = torch.empty(shape, dtype=t.dtype, device=self.device)
        self._weights_on_device = True

    def _release_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the hf engine is closed")

    # -- generation ---------------------------------------------------------------------------
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Sample]:
        self._check_open()
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be SamplingParams; got {type(sampling).__name__}")
        prompts = self._check_prompts(prompt_token_ids, sampling)
        if not self._awake:
            raise RuntimeError("the hf engine is asleep; call wake() before generate()")
        self._missing.check()
        n, T = sampling.n, sampling.max_new_tokens
        rows = [i for i in range(len(prompts)) for _ in range(n)]
        order = sorted(range(len(rows)), key=lambda r: -len(prompts[rows[r]]))
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        out: list[Sample | None] = [None] * len(rows)
        with torch.inference_mode():
            for chunk in self._chunks(order, [len(prompts[rows[r]]) for r in range(len(rows))], T):
                tokens, logprobs, lengths = self._generate_batch([prompts[rows[r]] for r in chunk], sampling,
                                                                 generator)
                for k, r in enumerate(chunk):
                    m = lengths[k]
                    stopped = m < T or tokens[k][m - 1] in sampling.stop_token_ids
                    out[r] = Sample(prompt_index=rows[r], tokens=tokens[k][:m], logprobs=logprobs[k][:m],
                                    finish_reason="stop" if stopped else "length")
        return out

    def _check_prompts(self, prompt_token_ids, sampling: SamplingParams) -> list[torch.Tensor]:
        """Every prompt as a CPU LongTensor; a ValueError naming the first bad prompt."""
        if isinstance(prompt_token_ids, (str, bytes)) or not isinstance(prompt_token_ids, Sequence):
            raise TypeError("prompt_token_ids must be a sequence of token-id sequences")
        if len(prompt_token_ids) == 0:
            raise ValueError("prompt_token_ids is empty: no prompts to generate from")
        V, max_pos, T = self.dims.vocab_size, self.dims.max_position_embeddings, sampling.max_new_tokens
        bad_stops = [s for s in sampling.stop_token_ids if s >= V]
        if bad_stops:
            raise ValueError(f"stop_token_ids {bad_stops} are outside the vocab [0, {V})")
        prompts = []
        for i, p in enumerate(prompt_token_ids):
            try:
                t = torch.as_tensor(p).reshape(-1)
            except (TypeError, ValueError, RuntimeError) as e:
                raise ValueError(f"prompt {i} is not a sequence of token ids ({e})") from None
            if t.numel() == 0:
                raise ValueError(f"prompt {i} is empty")
            if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
                raise ValueError(f"prompt {i} holds {t.dtype} values; token ids are integers")
            t = t.to(torch.long)
            lo, hi = int(t.min()), int(t.max())
            if lo < 0 or hi >= V:
                raise ValueError(f"prompt {i} has token id {lo if lo < 0 else hi} outside the vocab [0, {V})")
            if t.numel() + T > max_pos:
                raise ValueError(f"prompt {i}: {t.numel()} tokens + max_new_tokens {T} exceed "
                                 f"max_position_embeddings {max_pos}")
            if t.numel() + T - 1 > self.max_batch_tokens:
                raise ValueError(f"prompt {i}: {t.numel()} tokens + max_new_tokens {T} need more KV-cache slots "
                                 f"than max_batch_tokens ({self.max_batch_tokens}); raise it")
            prompts.append(t)
        return prompts

    def _chunks(self, order: list[int], lengths: list[int], T: int) -> Iterator[list[int]]:
        """Rows in ``order`` (longest prompt first) cut into batches within the row and slot budgets."""
        chunk: list[int] = []
        for r in order:
            slots = (lengths[chunk[0]] if chunk else lengths[r]) + T - 1
            if chunk and (len(chunk) == self.max_num_seqs or (len(chunk) + 1) * slots > self.max_batch_tokens):
                yield chunk
                chunk = []
            chunk.append(r)
        if chunk:
            yield chunk

    def _generate_batch(self, prompts: list[torch.Tensor], sampling: SamplingParams, generator):
        """Decode one batch (rows of equal prompts adjacent); returns host lists of tokens,
        logprobs and lengths per row."""
        dev, T = self.device, sampling.max_new_tokens
        B = len(prompts)
        lens = torch.tensor([p.numel() for p in prompts], device=dev)
        L = max(p.numel() for p in prompts)
        S = L + T - 1
        cache = SlotKvCache(self.dims.num_layers, B, self.dims.num_groups, S, self.dims.head_dim, self.dtype, dev)
        key_valid = torch.zeros(B, S, dtype=torch.bool, device=dev)
        key_valid[:, :L] = torch.arange(L, device=dev) >= (L - lens)[:, None]
        logits = self._prefill(cache, prompts, L)

        tokens = torch.zeros(B, T, dtype=torch.long, device=dev)
        logprobs = torch.zeros(B, T, dtype=torch.float32, device=dev)
        lengths = torch.full((B,), T, dtype=torch.long, device=dev)
        stops = torch.tensor(sampling.stop_token_ids, dtype=torch.long, device=dev)
        active = torch.arange(B, device=dev)
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        step = _DecodeStep(self.model, cache, key_valid, use_graph=self.cuda_graphs)
        for t in range(T):
            if t > 0:
                logits = step.run()
            tok, lp = sample_tokens(logits, sampling, generator)
            tokens[:, t].index_copy_(0, active, tok)
            logprobs[:, t].index_copy_(0, active, lp)
            if stops.numel():
                hit = torch.isin(tok, stops) & ~done
                lengths.index_copy_(0, active, torch.where(hit, t + 1, lengths.index_select(0, active)))
                done |= hit
            if t == T - 1:
                break
            step.feed(tok, lens if t == 0 else None, slot=L + t)
            if stops.numel() and (t + 1) % STOP_CHECK_EVERY == 0:
                left = int((~done).sum())
                if left == 0:
                    break
                if left <= done.numel() // 2:
                    keep = (~done).nonzero().squeeze(1)
                    active, done, lens = active[keep], done[keep], lens[keep]
                    step.keep_rows(keep)
        return tokens.tolist(), logprobs.tolist(), lengths.tolist()

    def _prefill(self, cache: SlotKvCache, prompts: list[torch.Tensor], L: int) -> torch.Tensor:
        """Run each distinct prompt once (left-padded to L, in forwards of at most
        ``max_prefill_tokens`` padded tokens); fill every row's cache; last-token logits [B, V] fp32."""
        dev = self.device
        distinct: list[torch.Tensor] = []
        src = []  # row -> its prompt's index in ``distinct`` (equal prompts are adjacent rows)
        for r, p in enumerate(prompts):
            if not (r > 0 and (prompts[r - 1] is p or torch.equal(prompts[r - 1], p))):
                distinct.append(p)
            src.append(len(distinct) - 1)
        src_B = torch.tensor(src, device=dev)
        logits_BV = torch.empty(len(prompts), self.dims.vocab_size, dtype=torch.float32, device=dev)
        group = max(1, self.max_prefill_tokens // L)
        causal = torch.ones(L, L, dtype=torch.bool, device=dev).tril_()
        diag = torch.eye(L, dtype=torch.bool, device=dev)
        for g0 in range(0, len(distinct), group):
            batch = distinct[g0 : g0 + group]
            ids = torch.zeros(len(batch), L, dtype=torch.long)
            for u, p in enumerate(batch):
                ids[u, L - p.numel() :] = p
            lens = torch.tensor([p.numel() for p in batch], device=dev)
            valid = torch.arange(L, device=dev) >= (L - lens)[:, None]
            positions = (valid.cumsum(-1) - 1).clamp_min_(0)
            # Pad queries attend to themselves only: a fully masked row would make NaNs.
            mask = causal & (valid[:, None, :] | diag)
            rows = ((src_B >= g0) & (src_B < g0 + len(batch))).nonzero().squeeze(1)
            rows_src = src_B[rows] - g0
            cache.prefill_rows(rows, rows_src)
            out = self.model(input_ids=ids.to(dev), attention_mask=mask[:, None], position_ids=positions,
                             past_key_values=cache, use_cache=True, logits_to_keep=1)
            logits_BV.index_copy_(0, rows, out.logits[:, -1].float().index_select(0, rows_src))
        cache.prefill_rows(None, None)
        return logits_BV

    # -- construction -------------------------------------------------------------------------
    def _fp8_module_names(self) -> set[str]:
        """HF module names of the linears that run in FP8: those the recipe's quantization_config
        does not ignore."""
        n = self.dims.num_layers
        qc = self.recipe.quantization_config(n, linear_names=self.bridge.linear_names)
        if qc is None:
            return set()
        ignored = set(qc.get("ignored_layers", ()))
        return {f"model.layers.{i}.{name}" for i in range(n) for name in self.bridge.linear_names} - ignored

    def _build_model(self, hf_config: dict) -> tuple[transformers.PreTrainedModel, dict[str, WeightSlot]]:
        """The architecture's model on ``device`` with uninitialized weights (built on the meta
        device: no random init; FP8 linears, fused projections and torch norms swapped in, then
        storage allocated once), and the slot of every checkpoint tensor."""
        model_cls, norm_cls = ARCHITECTURES[self.dims.architecture]
        raw = {k: v for k, v in hf_config.items() if k not in ("quantization_config", "dtype", "torch_dtype")}
        config = model_cls.config_class.from_dict(raw)
        AttentionInterface.register(ATTENTION, slot_attention)
        config._attn_implementation = ATTENTION
        with torch.device("meta"):
            model = model_cls(config)
        model.to(self.dtype)
        for name, norm in list(model.named_modules()):
            if isinstance(norm, norm_cls):
                parent, child = name.rsplit(".", 1)
                setattr(model.get_submodule(parent), child, torch.nn.RMSNorm(
                    tuple(norm.weight.shape), eps=norm.variance_epsilon, device="meta", dtype=self.dtype))
        slots: dict[str, WeightSlot] = {}
        for i in range(self.dims.num_layers):
            for block_name, fused_name, parts in self.bridge.fused_projections:
                block = model.get_submodule(f"model.layers.{i}.{block_name}")
                prefix = f"model.layers.{i}.{block_name}."
                linears = [getattr(block, p) for p in parts]
                fp8 = {prefix + p in self.fp8_modules for p in parts}
                biased = {lin.bias is not None for lin in linears}
                whole_blocks = all(lin.out_features % WEIGHT_BLOCK[0] == 0 for lin in linears)
                if len(fp8) == 1 and len(biased) == 1 and (whole_blocks or fp8 == {False}):
                    self._fuse(block, fused_name, parts, prefix, fp8.pop(), biased.pop(), slots)
            for name in self.bridge.linear_names:
                full = f"model.layers.{i}.{name}"
                if full + ".weight" not in slots:
                    slots.update(self._plain_linear(model, full, full in self.fp8_modules))
        model.to_empty(device=self.device)
        rotary = model.model.rotary_emb
        model.model.rotary_emb = type(rotary)(config=model.config).to(self.device)
        if self.dims.tied_embeddings:
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

    def _linear(self, in_features: int, out_features: int, *, bias: bool, fp8: bool) -> torch.nn.Module:
        if fp8:
            return Fp8InferenceLinear(in_features, out_features, bias=bias, dtype=self.dtype, quantizer=self.quantizer,
                                      gemm=self.gemm, device="meta")
        return torch.nn.Linear(in_features, out_features, bias=bias, device="meta", dtype=self.dtype)

    def _fuse(self, block, fused_name: str, parts: Sequence[str], prefix: str, fp8: bool, bias: bool,
              slots: dict[str, WeightSlot]) -> None:
        linears = [getattr(block, p) for p in parts]
        sizes = [lin.out_features for lin in linears]
        fused = FusedProjection(self._linear(linears[0].in_features, sum(sizes), bias=bias, fp8=fp8), sizes)
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

    def _plain_linear(self, model, name: str, fp8: bool) -> dict[str, WeightSlot]:
        parent_name, child = name.rsplit(".", 1)
        parent = model.get_submodule(parent_name)
        linear = old = getattr(parent, child)
        if fp8:
            linear = self._linear(old.in_features, old.out_features, bias=old.bias is not None, fp8=True)
            setattr(parent, child, linear)
        slots = {f"{name}.weight": WeightSlot(linear, "weight")}
        if fp8:
            slots[f"{name}.weight{SCALE_SUFFIX}"] = WeightSlot(linear, "weight_scale_inv")
        if old.bias is not None:
            slots[f"{name}.bias"] = WeightSlot(linear, "bias")
        return slots


class _DecodeStep:
    """One decode forward over fixed input buffers: ``feed`` sets them, ``run`` returns the logits
    [B, V] fp32. On CUDA the forward is captured once as a graph (again after ``keep_rows``)."""

    def __init__(self, model, cache: SlotKvCache, key_valid_BS: torch.Tensor, *, use_graph: bool):
        self.model, self.cache, self.key_valid = model, cache, key_valid_BS
        B, dev = key_valid_BS.shape[0], key_valid_BS.device
        self.input_ids = torch.zeros(B, 1, dtype=torch.long, device=dev)
        self.positions = torch.zeros(B, 1, dtype=torch.long, device=dev)
        self.use_graph = use_graph
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def feed(self, tokens_B: torch.Tensor, positions_B: torch.Tensor | None, *, slot: int) -> None:
        """The sampled tokens as the next input, at ``positions_B`` (None: one past the last)."""
        self.input_ids.copy_(tokens_B[:, None])
        if positions_B is None:
            self.positions.add_(1)
        else:
            self.positions.copy_(positions_B[:, None])
        self.cache.write_pos.fill_(slot)
        self.key_valid[:, slot] = True

    def keep_rows(self, keep: torch.Tensor) -> None:
        self.cache.keep_rows(keep)
        self.key_valid = self.key_valid.index_select(0, keep)
        self.input_ids = self.input_ids.index_select(0, keep)
        self.positions = self.positions.index_select(0, keep)
        self.graph = self.logits = None

    def _forward(self) -> torch.Tensor:
        out = self.model(input_ids=self.input_ids, attention_mask=self.key_valid[:, None, None, :],
                         position_ids=self.positions, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float()

    def run(self) -> torch.Tensor:
        if not self.use_graph:
            return self._forward()
        if self.graph is None:
            # Warm-up forwards on a side stream (allocator, cuBLAS workspaces) before the capture; a
            # forward only rewrites the slot it reads, so repeating one is harmless.
            side = torch.cuda.Stream(self.input_ids.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self._forward()
        self.graph.replay()
        return self.logits


def sample_tokens(logits_BV: torch.Tensor, sampling: SamplingParams,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from fp32 logits, and its logprob under the raw logits (before
    temperature, top-k and top-p). Sampling draws ``argmax(p / E)``, E ~ Exp(1) per entry, which
    picks index i with probability p_i and needs no host sync. Temperature 0 and top_k 1 are greedy
    (the first of tied maxima); top-k keeps ties with the k-th logit; top-p keeps the fewest most
    likely tokens whose mass reaches top_p (ties in index order)."""
    raw_logprobs = torch.log_softmax(logits_BV, dim=-1)
    if sampling.temperature == 0 or sampling.top_k == 1:
        tok = logits_BV.argmax(dim=-1)
    else:
        x = logits_BV / sampling.temperature
        V = x.shape[-1]
        if 0 < sampling.top_k < V:
            kth = torch.topk(x, sampling.top_k, dim=-1).values[:, -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if sampling.top_p < 1:
            sorted_x, idx = torch.sort(x, dim=-1, descending=True, stable=True)
            probs = torch.softmax(sorted_x, dim=-1)
            drop = (probs.cumsum(dim=-1) - probs) > sampling.top_p
            x = x.scatter(-1, idx, sorted_x.masked_fill(drop, float("-inf")))
        probs = torch.softmax(x, dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(torch.finfo(torch.float32).tiny)
        tok = (probs / noise).argmax(dim=-1)
    return tok, raw_logprobs.gather(-1, tok[:, None]).squeeze(1)


__all__ = ["ARCHITECTURES", "Fp8InferenceLinear", "FusedProjection", "HfEngine", "ProjectionPart", "SlotKvCache",
           "WeightSlot", "sample_tokens", "slot_attention"]
