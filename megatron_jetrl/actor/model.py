"""Builds the policy model: megatron-core ``GPTModel`` for this rank's pipeline stage, wrapped in
megatron's ``DistributedDataParallel``, with its ``DistributedOptimizer`` and LR scheduler.

Precision modes (``PrecisionRecipe.mode``):
- ``bf16``: BF16 params and compute; fp32 master weights, grads reduced in fp32.
- ``fp16``: FP16 params and compute; fp32 master weights; megatron's dynamic loss scaling.
- ``fp8`` + ``native`` backend: BF16 as above, and the decoder linears (qkv, proj, fc1, fc2) of
  every layer the recipe keeps in FP8 run ``fp8_block_linear``; embeddings, norms, attention and
  the LM head stay BF16.
- ``fp8`` + ``te`` backend: Transformer Engine's layer spec with ``fp8="e4m3"``,
  ``fp8_recipe="blockwise"`` (megatron enters TE's autocast per layer, honouring the first/last
  BF16 layers). TE reads ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES`` when it is imported, so the
  launcher must set ``recipe.te_settings(...).env`` before anything imports TE; this module checks
  it and refuses otherwise. Not run on this project's GPU host (no TE there).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Optional

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from megatron_jetrl.actor.layers import RMSNorm, _Fp8LinearMixin, local_layer_spec
from megatron_jetrl.actor.settings import ActorSettings
from megatron_jetrl.config import ConfigError
from megatron_jetrl.models import ModelBridge
from megatron_jetrl.ops import NativeQuantizer
from megatron_jetrl.precision import Fp8Weight, PrecisionMode, resolve_gemm_backend, scaled_mm_supported

ONE_YEAR_OF_STEPS = 10**9
"""decay_steps of a constant schedule (megatron's scheduler wants a positive horizon)."""


def check_fp8_device(settings: ActorSettings, device: torch.device) -> None:
    """FP8 training needs a GPU with block-scaled FP8 GEMMs; name what would work otherwise."""
    if not settings.precision.train_fp8:
        return
    if settings.fp8_backend == "te":
        return
    if settings.fp8_gemm == "emulate":
        return
    if not scaled_mm_supported(device):
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
        cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        hint = ("on Blackwell use actor.fp8_backend='te' (MXFP8 emulation, needs precision.fp8.pow2_scales=true)"
                if cap is not None and cap[0] >= 10 else
                "use precision.mode='bf16' (or actor.fp8_gemm='emulate' for an exact but slow check)")
        raise ConfigError(
            "actor.fp8_backend", settings.fp8_backend,
            f"the native FP8 backend needs torch's blockwise scaled_mm (Hopper sm_90, torch >= 2.10); "
            f"{name} (capability {cap}) with torch {torch.__version__} has none: {hint}",
        )


def check_te_backend(settings: ActorSettings, num_layers: int) -> dict:
    """TransformerConfig kwargs of the te backend, after checking TE is importable and was (or will
    be) imported with the recipe's environment."""
    if importlib.util.find_spec("transformer_engine") is None:
        raise ConfigError("actor.fp8_backend", "te",
                          "Transformer Engine is not installed; install it or use fp8_backend='native'")
    te = settings.precision.te_settings(num_layers)
    for name, value in te.env.items():
        if os.environ.get(name) != value:
            state = "was already imported" if "transformer_engine" in sys.modules else "will be imported"
            raise ConfigError("actor.fp8_backend", "te",
                              f"set {name}={value} in the launcher before Transformer Engine is imported "
                              f"(it {state} with {name}={os.environ.get(name)!r})")
    return te.megatron_kwargs


def transformer_config(bridge: ModelBridge, settings: ActorSettings) -> TransformerConfig:
    recipe = settings.precision
    dtype = recipe.compute_dtype
    kwargs = bridge.transformer_config_kwargs(settings.parallel, params_dtype=dtype)
    kwargs.update(
        pipeline_dtype=dtype,
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # no MoE here; megatron rejects the default with variable lengths
        gradient_accumulation_fusion=False,
        deallocate_pipeline_outputs=True,
        calculate_per_token_loss=False,
    )
    if settings.recompute == "full":
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if recipe.train_fp8 and settings.fp8_backend == "te":
        kwargs.update(check_te_backend(settings, bridge.dims.num_layers))
    return TransformerConfig(**kwargs)


def layer_spec(bridge: ModelBridge, settings: ActorSettings, config: TransformerConfig):
    """The TE layer spec (te backend), or this stage's decoder block of local layers with the
    project's norm, attention and (fp8) linears."""
    if settings.fp8_backend == "te" and settings.precision.train_fp8:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=bridge.dims.qk_norm)
    spec = local_layer_spec(qk_layernorm=bridge.dims.qk_norm,
                            fp8=settings.precision.train_fp8 and settings.fp8_backend == "native")
    layers = get_num_layers_to_build(config)
    return TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=RMSNorm)


def build_gpt(bridge: ModelBridge, settings: ActorSettings, config: TransformerConfig, *, pre_process: bool,
              post_process: bool) -> GPTModel:
    model = GPTModel(config=config, transformer_layer_spec=layer_spec(bridge, settings, config),
                     pre_process=pre_process, post_process=post_process, parallel_output=True,
                     **bridge.gpt_model_kwargs(settings.parallel))
    return model.cuda(torch.cuda.current_device())


def configure_fp8_linears(model: GPTModel, settings: ActorSettings, num_layers: int, device) -> int:
    """Give every native FP8 linear its quantizer and GEMM backend, and switch the linears of the
    recipe's BF16 layers to BF16. Returns how many linears run in FP8."""
    recipe = settings.precision
    quantizer = NativeQuantizer(pow2_scales=recipe.fp8.pow2_scales, eps=recipe.fp8.amax_epsilon)
    gemm = resolve_gemm_backend(settings.fp8_gemm, device)
    n_fp8 = 0
    for layer in model.decoder.layers:
        enabled = recipe.layer_in_fp8(layer.layer_number - 1, num_layers)
        for m in layer.modules():
            if isinstance(m, _Fp8LinearMixin):
                m.configure_fp8(quantizer=quantizer, gemm=gemm, enabled=enabled)
                n_fp8 += enabled
    return n_fp8


def named_shards(model: GPTModel) -> dict[str, tuple[torch.Tensor, Optional[Fp8Weight]]]:
    """This rank's parameters under the bridge's Megatron names (global layer index, TE-style norm
    keys through the layer spec's own key map), each with the FP8 weight its linear computes with
    (None for a BF16 tensor): what the weight sync reads."""
    out: dict[str, tuple[torch.Tensor, Optional[Fp8Weight]]] = {}
    for name, param in model.named_parameters():
        module_name = name.rsplit(".", 1)[0]
        module = model.get_submodule(module_name)
        fp8 = module.fp8_weight() if isinstance(module, _Fp8LinearMixin) and name.endswith(".weight") else None
        if name.startswith(_LAYERS):
            local, rest = name[len(_LAYERS):].split(".", 1)
            layer = model.decoder.layers[int(local)]
            for old, new in layer.submodules_config.sharded_state_dict_keys_map.items():
                if rest.startswith(old):
                    rest = new + rest[len(old):]
            name = f"{_LAYERS}{layer.layer_number - 1}.{rest}"
        out[name] = (param.detach(), fp8)
    return out


_LAYERS = "decoder.layers."


def wrap_ddp(model: GPTModel, config: TransformerConfig) -> DistributedDataParallel:
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True,
        check_for_nan_in_grad=False,
    )
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


def build_optimizer(model: DistributedDataParallel, settings: ActorSettings):
    o = settings.optimizer
    fp16 = settings.precision.mode is PrecisionMode.FP16
    opt_config = OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad, bf16=not fp16, fp16=fp16,
        params_dtype=settings.precision.compute_dtype, use_distributed_optimizer=True,
        initial_loss_scale=o.initial_loss_scale, loss_scale_window=o.loss_scale_window, loss_scale=None,
    )
    optimizer = get_megatron_optimizer(opt_config, [model])
    use_fused_torch_adam(optimizer)
    use_sync_free_grad_norm()
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if o.warmup_steps else o.lr, max_lr=o.lr, min_lr=o.min_lr,
        lr_warmup_steps=o.warmup_steps, lr_decay_steps=o.decay_steps or ONE_YEAR_OF_STEPS,
        lr_decay_style=o.decay_style, start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=1,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """The L2 norm of all tensors of ``tensor_lists[0]`` as a [1] fp32 tensor on their device, in the
    calling form of apex's ``multi_tensor_l2norm`` (what megatron's gradient clipping calls), without
    a host synchronization: megatron's fallback for hosts without apex or TE
    (``local_multi_tensor_l2_norm``) copies every parameter's norm to the host, one wait for the GPU
    per parameter (131 a step at 16 layers). Same value up to the order of fp32 summation."""
    if per_tensor:
        raise NotImplementedError("foreach_l2_norm: per-tensor norms are not used by megatron's clipping")
    norms = torch._foreach_norm(tensor_lists[0])
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


def use_sync_free_grad_norm() -> None:
    """Point megatron's gradient clipping at ``foreach_l2_norm`` where it fell back to its own
    host-synchronizing norm (no apex, no TE); apex's and TE's kernels are kept."""
    import megatron.core.optimizer.clip_grads as clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm

    if clip_grads.l2_norm_impl is local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm


def use_fused_torch_adam(optimizer) -> None:
    """Without apex or TE, megatron falls back to torch's Adam in its default ``foreach`` form,
    which allocates several fp32 temporaries the size of all parameters at every step (out of
    memory at a few billion parameters per GPU). torch's fused CUDA Adam updates in place; it is
    switched on through the param groups before the optimizer's first step creates any state."""
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    for opt in chained:
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam):
            continue
        for group in inner.param_groups:
            if all(p.is_cuda and p.dtype == torch.float32 for p in group["params"]):
                group["fused"] = True
                group["foreach"] = False
