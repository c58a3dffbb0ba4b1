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
  it and refuses otherwise. The weight sync reads TE's own FP8 bytes of each linear
  (``te_fp8_weight``), equal to the reference quantization byte for byte
  (tests/gpu/test_te_backend.py, with TE 2.20.2).
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
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from megatron_jetrl.actor.exact import ExactRMSNorm, ExactSwiGLU, bind_exact_forward
from megatron_jetrl.actor.layers import (COMPILED_ROPE_ATTR, EXACT_ATTR, TE_ATTENTION_ATTR, PackedCoreAttention,
                                         _Fp8LinearMixin, local_layer_spec, norm_class)
from megatron_jetrl.actor.settings import ActorSettings
from megatron_jetrl.config import ConfigError
from megatron_jetrl.models import ModelBridge
from megatron_jetrl.ops import NativeQuantizer
from megatron_jetrl.precision import (
    WEIGHT_BLOCK,
    Fp8Tensor,
    PrecisionMode,
    PrecisionRecipe,
    resolve_gemm_backend,
    scaled_mm_supported,
)

ONE_YEAR_OF_STEPS = 10**9
"""decay_steps of a constant schedule (megatron's scheduler wants a positive horizon)."""


def check_fp8_device(settings: ActorSettings, device: torch.device) -> None:
    """FP8 training needs a GPU with block-scaled FP8 GEMMs; name what would work otherwise (and
    check ``actor.fp8_wgrad`` can run, before the model is built)."""
    if not settings.precision.train_fp8:
        return
    if settings.fp8_backend == "te":
        return
    if settings.fp8_gemm == "emulate":
        fp8_wgrad_into(settings, "emulate")
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
    fp8_wgrad_into(settings, "scaled_mm")


def check_te_backend(settings: ActorSettings, num_layers: int) -> dict:
    """TransformerConfig kwargs of the te backend, after checking TE is importable and, when it
    trains in FP8, was (or will be) imported with the recipe's environment. BF16 and FP16 modes get
    TE's layers with no FP8 kwargs."""
    if importlib.util.find_spec("transformer_engine") is None:
        raise ConfigError("actor.fp8_backend", "te",
                          "Transformer Engine is not installed; install it or use fp8_backend='native'")
    te = settings.precision.te_settings(num_layers)
    if te is None:  # not training in FP8: TE's layers in the compute dtype
        return {}
    for name, value in te.env.items():
        if os.environ.get(name) != value:
            state = "was already imported" if "transformer_engine" in sys.modules else "will be imported"
            raise ConfigError("actor.fp8_backend", "te",
                              f"set {name}={value} in the launcher before Transformer Engine is imported "
                              f"(it {state} with {name}={os.environ.get(name)!r})")
    return te.megatron_kwargs


def check_te_attention(settings: ActorSettings) -> bool:
    """Whether the native layers attend with Transformer Engine (``actor.attention_impl=te``), after
    checking TE is importable (``ActorSettings`` refuses it beside the te backend and the exact mode)."""
    if settings.attention_impl != "te":
        return False
    if importlib.util.find_spec("transformer_engine") is None:
        raise ConfigError("actor.attention_impl", "te",
                          "Transformer Engine is not installed; install it or set actor.attention_impl=torch")
    return True


def transformer_config(bridge: ModelBridge, settings: ActorSettings) -> TransformerConfig:
    recipe = settings.precision
    dtype = recipe.compute_dtype
    kwargs = bridge.transformer_config_kwargs(settings.parallel, params_dtype=dtype)
    fused = settings.elementwise_impl == "compiled" and not recipe.exact  # the exact forward is ops.exact's
    kwargs.update(
        pipeline_dtype=dtype,
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # no MoE here; megatron rejects the default with variable lengths
        gradient_accumulation_fusion=False,
        deallocate_pipeline_outputs=True,
        calculate_per_token_loss=False,
        bias_activation_fusion=fused,  # megatron's torch.compile'd SwiGLU (no bias here)
        # the exact mode's SwiGLU is a module of its layer spec (actor.exact.ExactSwiGLU), which megatron's MLP
        # calls on fc1's output under this flag (named after TE's activation modules; no TE is involved)
        use_te_activation_func=recipe.exact,
    )
    if settings.recompute == "full":
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if settings.fp8_backend == "te":
        kwargs.update(check_te_backend(settings, bridge.dims.num_layers))
    config = TransformerConfig(**kwargs)
    # actor/layers.py reads these: the packed RoPE the first two, the packed attention the third
    setattr(config, EXACT_ATTR, float(bridge.dims.rope_theta) if recipe.exact else None)
    setattr(config, COMPILED_ROPE_ATTR, fused)
    setattr(config, TE_ATTENTION_ATTR, check_te_attention(settings))
    return config


def layer_spec(bridge: ModelBridge, settings: ActorSettings, config: TransformerConfig, exact_kernels=None):
    """The TE layer spec (te backend, in every precision mode: TE's linears, fused norms and
    attention, so that its FP8 and BF16 steps differ only in the GEMMs), or this stage's decoder
    block of local layers with the project's norm, attention and (fp8) linears; in the exact mode
    the exact layer, its modules built with vLLM's kernels (``exact_kernels``, ``ops.exact.VllmKernels``)."""
    if settings.fp8_backend == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=bridge.dims.qk_norm)
    exact = settings.precision.exact
    spec = local_layer_spec(qk_layernorm=bridge.dims.qk_norm,
                            fp8=settings.precision.train_fp8 and settings.fp8_backend == "native", exact=exact,
                            exact_kernels=exact_kernels)
    layers = get_num_layers_to_build(config)
    return TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=norm_class(exact))


def build_gpt(bridge: ModelBridge, settings: ActorSettings, config: TransformerConfig, *, pre_process: bool,
              post_process: bool, exact_kernels=None) -> GPTModel:
    """This stage's model; in the exact mode built with vLLM's kernels (``exact_kernels``): the layer
    spec's modules take them at construction, the LM head (which GPTModel builds itself) gets its
    exact GEMM here, and ``check_exact`` refuses a model with a module left on another kernel."""
    model = GPTModel(config=config, transformer_layer_spec=layer_spec(bridge, settings, config, exact_kernels),
                     pre_process=pre_process, post_process=post_process, parallel_output=True,
                     **bridge.gpt_model_kwargs(settings.parallel))
    if settings.precision.exact:
        if exact_kernels is None:
            raise ValueError("precision.exact: the exact model is built with vLLM's kernels (ops.exact.vllm_kernels())")
        if getattr(model, "output_layer", None) is not None:
            bind_exact_forward(model.output_layer, exact_kernels)
        check_exact(model)
    return model.cuda(torch.cuda.current_device())


def fp8_wgrad_into(settings: ActorSettings, gemm: str):
    """The WGrad into the fp32 main grad that ``actor.fp8_wgrad`` asks for (None: ``gemm``'s dW), after
    checking it can run: DeepGEMM importable, beside the Hopper GEMMs."""
    if settings.fp8_wgrad == "gemm":
        return None
    if gemm != "scaled_mm":
        raise ConfigError("actor.fp8_wgrad", settings.fp8_wgrad,
                          f"DeepGEMM's WGrad runs on Hopper beside torch's blockwise GEMMs; this actor's FP8 GEMMs are "
                          f"{gemm!r}: set actor.fp8_wgrad=gemm")
    from megatron_jetrl.ops.deep_gemm import DeepGemmUnavailable, deep_gemm, wgrad_into

    try:
        deep_gemm()
    except DeepGemmUnavailable as e:
        raise ConfigError("actor.fp8_wgrad", settings.fp8_wgrad, f"{e}; or set actor.fp8_wgrad=gemm") from e
    return wgrad_into


def configure_fp8_linears(model: GPTModel, settings: ActorSettings, num_layers: int, device) -> int:
    """Give every native FP8 linear its quantizer and GEMM backend, and switch the linears of the
    recipe's BF16 layers to BF16. Returns how many linears run in FP8."""
    recipe = settings.precision
    quantizer = NativeQuantizer(pow2_scales=recipe.fp8.pow2_scales, eps=recipe.fp8.amax_epsilon)
    gemm = resolve_gemm_backend(settings.fp8_gemm, device)
    wgrad_into = fp8_wgrad_into(settings, gemm)
    n_fp8 = 0
    for layer in model.decoder.layers:
        enabled = recipe.layer_in_fp8(layer.layer_number - 1, num_layers)
        for m in layer.modules():
            if isinstance(m, _Fp8LinearMixin):
                m.configure_fp8(quantizer=quantizer, gemm=gemm, enabled=enabled, wgrad_into=wgrad_into)
                n_fp8 += enabled
    return n_fp8


def check_exact(model: torch.nn.Module) -> None:
    """Raise, naming the modules, unless every norm of an exact-mode model is ``ExactRMSNorm``, every
    MLP's activation ``ExactSwiGLU``, every linear and core attention computes with vLLM's kernels and
    the LM head is bound to the exact GEMM: a module left on another kernel would make the rollout
    silently inexact."""
    wrong = []
    output_layer = getattr(model, "output_layer", None)
    for name, m in model.named_modules():
        if "Norm" in type(m).__name__ and not isinstance(m, ExactRMSNorm):
            wrong.append(f"{name} ({type(m).__name__})")
        elif isinstance(m, MLP) and not isinstance(m.activation_func, ExactSwiGLU):
            act = m.activation_func
            wrong.append(f"{name}.activation_func ({getattr(act, '__name__', type(act).__name__)})")
        elif isinstance(m, (_Fp8LinearMixin, PackedCoreAttention)):
            if m.exact_kernels is None:
                wrong.append(f"{name} ({type(m).__name__} without the exact kernels)")
        elif m is output_layer:
            if "_forward_impl" not in vars(m):
                wrong.append(f"{name} (the LM head's GEMM is not the exact one)")
        elif isinstance(m, (ColumnParallelLinear, RowParallelLinear)) or name.endswith("core_attention"):
            wrong.append(f"{name} ({type(m).__name__})")
    if wrong:
        raise RuntimeError("precision.exact: modules outside the exact forward: " + "; ".join(wrong[:8]))


def named_shards(model: GPTModel, recipe: Optional[PrecisionRecipe] = None,
                 num_layers: Optional[int] = None) -> dict[str, tuple[torch.Tensor, Optional[Fp8Tensor]]]:
    """This rank's parameters under the bridge's Megatron names (global layer index, TE-style norm
    keys through the layer spec's own key map), each with the FP8 weight (checkpoint layout: codes +
    128x128 ``scale_inv``) its linear computes with, None for a BF16 tensor: what the weight sync
    reads. Native FP8 linears give their cached weight; Transformer Engine's linears (te backend)
    give TE's own quantization of theirs in the layers the ``recipe`` trains in FP8 (of the model's
    ``num_layers``; without a recipe they read as BF16)."""
    out: dict[str, tuple[torch.Tensor, Optional[Fp8Tensor]]] = {}
    te_linears = _te_linear_types() if recipe is not None and recipe.train_fp8 else ()
    for name, param in model.named_parameters():
        module_name = name.rsplit(".", 1)[0]
        module = model.get_submodule(module_name)
        fp8 = None
        if name.endswith(".weight") and isinstance(module, _Fp8LinearMixin):
            weight = module.fp8_weight()
            fp8 = weight.fprop if weight is not None else None
        if name.startswith(_LAYERS):
            local, rest = name[len(_LAYERS):].split(".", 1)
            layer = model.decoder.layers[int(local)]
            for old, new in layer.submodules_config.sharded_state_dict_keys_map.items():
                if rest.startswith(old):
                    rest = new + rest[len(old):]
            name = f"{_LAYERS}{layer.layer_number - 1}.{rest}"
            if (te_linears and isinstance(module, te_linears) and name.endswith(".weight")
                    and recipe.layer_in_fp8(layer.layer_number - 1, num_layers)):
                fp8 = te_fp8_weight(module, recipe)
        out[name] = (param.detach(), fp8)
    return out


def _te_linear_types() -> tuple[type, ...]:
    """Transformer Engine's linear module classes (megatron's TE linears derive from them)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return ()
    import transformer_engine.pytorch as te

    return (te.Linear, te.LayerNormLinear)


def te_fp8_weight(module, recipe: PrecisionRecipe) -> Fp8Tensor:
    """The FP8 weight a Transformer Engine linear's FProp computes with under ``Float8BlockScaling``,
    in the checkpoint layout: TE's own weight quantizer (the module's, made at its first FP8 forward;
    before that one with the recipe's settings) applied to the weight. TE's 128x128 block
    quantization is a pure function of the weight, so these are the bytes and scales of TE's GEMM
    (and of the weight it caches for a step's micro-batches). TE pads ``scale_inv``'s columns to a
    multiple of 4 with unwritten values: trimmed. A quantizer whose settings differ from the recipe
    (TE imported without the recipe's environment) is refused: the engine would get other bytes
    than the recipe promises."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    fwd = getattr(module, "quantizers", {}).get("scaling_fwd") or []
    if len(fwd) > 1 and isinstance(fwd[1], Float8BlockQuantizer):  # slot 1: GEMM1_WEIGHT
        quantizer = fwd[1].copy()  # the module's own flags (usage, internal) stay as its forward set them
    else:
        quantizer = Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=False,
                                         amax_epsilon=recipe.fp8.amax_epsilon,
                                         force_pow_2_scales=recipe.fp8.pow2_scales, block_scaling_dim=2)
    got = (quantizer.block_scaling_dim, float(quantizer.amax_epsilon), bool(quantizer.force_pow_2_scales))
    want = (2, float(recipe.fp8.amax_epsilon), recipe.fp8.pow2_scales)
    if got != want:
        raise ConfigError("actor.fp8_backend", "te",
                          f"Transformer Engine quantizes weights with (block dim, amax epsilon, power-of-2 scales) "
                          f"= {got}, the recipe asks for {want}; set {recipe.te_env} before TE is imported")
    quantizer.set_usage(rowwise=True, columnwise=False)
    quantizer.internal = False
    quantizer.optimize_for_gemm = False  # scales in the plain [blocks_n, blocks_k (padded)] layout
    with torch.no_grad():
        q = quantizer(module.weight.detach())
    blocks_k = -(-module.weight.shape[1] // WEIGHT_BLOCK[1])
    return Fp8Tensor(q._rowwise_data.view(torch.float8_e4m3fn), q._rowwise_scale_inv[:, :blocks_k].contiguous(),
                     WEIGHT_BLOCK)


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
