"""The ``hf`` rollout engine: a transformers model whose decoder linears compute like the trainer's FProp.

Where vLLM is absent (CPU machines, tests, small runs) rollouts come from this engine. This module
is its lifecycle as a ``RolloutEngine``: construction (from a config, or a checkpoint with
``from_checkpoint``), the weights under their HF checkpoint names (specs, the buffers an in-process
sync writes, updates, checkpoint loading with FP8 quantization or dequantization as the recipe
needs), sleep / wake / close, and ``generate``'s checks of its inputs. The rest lives beside it:

- ``hf_model``: the model the engine computes with: FP8 linears that are the trainer's FProp, fused
  q/k/v and gate/up projections, torch's RMSNorm, and where each checkpoint tensor lives.
- ``hf_decode``: decoding over the engine's own slot KV cache: batching, prefill, CUDA-graph decode
  steps, stop checks, sampling.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch
from transformers.modeling_utils import AttentionInterface

from megatron_jetrl.models import bridge_for
from megatron_jetrl.models.fp8_export import SCALE_SUFFIX
from megatron_jetrl.config import HfCheckpointError
from megatron_jetrl.models.hf_checkpoint import HFCheckpoint
from megatron_jetrl.ops import NativeQuantizer
from megatron_jetrl.precision import (
    WEIGHT_BLOCK,
    Fp8Quantizer,
    PrecisionRecipe,
    dequantize_fp8_blockwise,
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
from megatron_jetrl.rollout.hf_decode import ATTENTION, generate_samples, slot_attention
from megatron_jetrl.rollout.hf_model import build_model, fp8_module_names
from megatron_jetrl.rollout.settings import HfOptions


class HfEngine:
    """``RolloutEngine`` on a transformers model (see the module docstrings of hf, hf_model, hf_decode).

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
        self.fp8_modules = fp8_module_names(self.bridge, recipe)
        AttentionInterface.register(ATTENTION, slot_attention)
        self.model, self._slots = build_model(self.bridge, attention=ATTENTION, dtype=self.dtype, device=self.device,
                                              fp8_modules=self.fp8_modules, quantizer=self.quantizer, gemm=self.gemm)
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
            raise HfCheckpointError(f"{path}: quantization_config {qc} is not the FP8 block layout "
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
            raise HfCheckpointError(f"{checkpoint.path} lacks {len(missing)} tensor(s) the engine needs, "
                                  f"e.g. {missing[:3]}")
        known = set(self._specs) | {n + SCALE_SUFFIX for n in wanted} | ignored
        unknown = sorted(n for n in checkpoint.weight_map if n not in known)
        if unknown:
            raise HfCheckpointError(f"{checkpoint.path} has {len(unknown)} tensor(s) this {self.dims.architecture} "
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
                    raise HfCheckpointError(f"{checkpoint.path}: FP8 tensor {name} has no {name + SCALE_SUFFIX}")
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

    def wake_bytes(self) -> None:
        """None: the KV cache grows with each ``generate``, so no bound is known before it runs."""
        return None

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
        return generate_samples(self.model, prompts, sampling, dims=self.dims, options=self.options, dtype=self.dtype,
                                device=self.device)

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
            if t.numel() + T - 1 > self.options.max_batch_tokens:
                raise ValueError(f"prompt {i}: {t.numel()} tokens + max_new_tokens {T} need more KV-cache slots "
                                 f"than max_batch_tokens ({self.options.max_batch_tokens}); raise it")
            prompts.append(t)
        return prompts


__all__ = ["HfEngine"]
