"""vLLM's side of the exact forward (``precision.exact``): vLLM computes every op with the kernel the
trainer's forward computes it with, so the logprob of every sampled token equals the trainer's
bit for bit.

How:
- ``VLLM_BATCH_INVARIANT=1`` (the launcher sets it, ``PrecisionRecipe.vllm_env``): vLLM's own
  batch-invariant mode. Its BF16 GEMMs (LM head, linears of BF16 layers) run its Triton persistent
  matmul, its log-softmax a Triton kernel, its FlashAttention one KV split; block-FP8 GEMMs keep
  the kernel vLLM picks (DeepGEMM by default, ``rollout.vllm.fp8_gemm``), which gives every row the
  same bits whatever the number of rows. The trainer calls these same kernels
  (``ops.exact.VllmKernels``).
- Out-of-tree replacements (``CustomOp.register_oot``, as ``vllm_activation_quant`` does for ``QuantFP8``) for
  the ops vLLM would otherwise compute its own way: ``RMSNorm`` (with its residual add) runs
  ``jetrl::rms_norm`` / ``jetrl::add_rms_norm``, ``SiluAndMul`` runs ``jetrl::silu_mul`` and the
  rotary embedding runs ``jetrl::rope`` (``ops/exact.py``): opaque custom ops, so torch.compile and
  CUDA graphs run them as they are.
- ``llm_kwargs``: FlashAttention as the attention backend, KV-cache pages of ``precision.exact.KV_PAGE``
  tokens (the trainer's paged view uses the same), no prefix caching across weight updates
  (kept), cascade attention off (vLLM does that itself in this mode); with FP8 linears, the fusion
  pass (``vllm_fusion.py``) that runs each norm / SiLU·mul and the quantization after it as one
  kernel, as the default engine fuses them.
- With an FP8 KV cache, the query's static quantization runs ``jetrl::static_fp8_quant``
  (``vllm_activation_quant.install(exact=True)``); vLLM's cache kernel writes K/V as usual, and the trainer's
  attention calls that same kernel. The attention metadata of a step with longer queries is cut
  into segments of at most ``precision.exact.fp8_kv_query_chunk`` queries of a request
  (``fp8_kv_segmented``, ``ops.exact.query_segments``), which keeps FlashAttention's FP8 kernel on
  one tile shape (``precision.exact.FP8_KV_QUERY_ROWS``) while vLLM schedules whole prefills; the
  trainer attends in the same segments.
- Above TP 2, the TP group's all-reduce (every row-parallel output, the embedding) gathers the
  ranks' partial results and sums them in rank order (``ops.exact.ordered_sum``, as the trainer's
  ``actor.exact.ordered_tp_reduce`` does), in place of vLLM's custom / NCCL all-reduce, whose order
  differs; ``llm_kwargs`` turns off the compile passes that would rewrite the all-reduce (sequence
  parallelism, async TP, the fused all-reduce + norm).
- vLLM's batch-invariant mode also sets NCCL variables for the whole process (one channel, one
  thread, the Simple protocol, tree all-reduce, no NVLink SHARP; ``VLLM_NCCL_PINS``). The contract
  needs none of them (its reductions above TP 2 are the gather + ``ordered_sum``, at TP 2 one
  addition), but in a colocated job they would govern the trainer's collectives too: NCCL keeps
  most of them from its first communicator on, and reads the others at each new one. So an exact
  engine starts NCCL with the job's settings before vLLM starts (``initialize_nccl``) and puts the
  job's values back once vLLM has started (``job_nccl_environment``).
- ``check_engine``: after vLLM built the model, every norm, activation and rotary module must be
  one of the replacements, every block-FP8 linear must run the GEMM the trainer's FProp calls for
  its shape, and every attention layer must run FlashAttention of the trainer's version (with an
  FP8 KV cache: quantizing its query with the exact op); anything else is an error at engine
  start, never a silent fallback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from typing import Any, Callable, Iterator, Optional

import torch

from megatron_jetrl.ops.exact import custom_ops, ordered_sum, query_segments, rope_inv_freq, vllm_kernels
from megatron_jetrl.precision.exact import ATTENTION_KERNEL, KV_PAGE, fp8_kv_query_chunk, ordered_tp_reduction
from megatron_jetrl.rollout.settings import VLLM_ATTENTION
from megatron_jetrl.rollout.vllm_model import fp8_cache

_REPLACED = ("RMSNorm", "SiluAndMul", "RotaryEmbedding")

FP8_KERNEL_CLASSES = {"deep_gemm": "DeepGemmFp8BlockScaledMMKernel", "cutlass": "CutlassFp8BlockScaledMMKernel"}
"""vLLM's block-FP8 linear kernel class for each GEMM ``ops.exact.VllmKernels.fp8_kernel`` names."""


def _registry() -> dict:
    from vllm.model_executor.custom_op import CustomOp

    return sys.modules[CustomOp.__module__].op_registry_oot


def install() -> None:
    """Make vLLM build its ``RMSNorm``, ``SiluAndMul`` and ``RotaryEmbedding`` modules as the exact ops
    (call before ``vllm.LLM`` builds the model; installing again is a no-op)."""
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    registry = _registry()
    if all(getattr(registry.get(name), "jetrl_exact", False) for name in _REPLACED):
        return
    taken = [name for name in _REPLACED if name in registry]
    if taken:
        raise RuntimeError(f"vLLM's {', '.join(taken)} already have out-of-tree replacements "
                           f"({[registry[n].__qualname__ for n in taken]}); precision.exact needs its own")
    ops = custom_ops()

    class ExactRMSNorm(RMSNorm):
        """``RMSNorm`` computing ``jetrl::rms_norm`` (with a residual: the BF16 add, then the norm)."""

        jetrl_exact = True

        def forward_native(self, x, residual=None):
            if self.variance_size_override is not None or not self.has_weight:
                raise RuntimeError("precision.exact: an RMSNorm with a partial variance or no weight has no "
                                   "exact kernel")
            if residual is None:
                return ops.rms_norm(x, self.weight, self.variance_epsilon)
            return ops.add_rms_norm(x, residual, self.weight, self.variance_epsilon)

        forward_cuda = forward_native

    class ExactSiluAndMul(SiluAndMul):
        """``SiluAndMul`` computing ``jetrl::silu_mul`` (megatron's SwiGLU rounding)."""

        jetrl_exact = True

        def forward_native(self, x):
            return ops.silu_mul(x)

        forward_cuda = forward_native

    class ExactRotaryEmbedding(RotaryEmbedding):
        """``RotaryEmbedding`` computing ``jetrl::rope`` (megatron's formula, frequencies from positions)."""

        jetrl_exact = True

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if not self.is_neox_style or self.rotary_dim != self.head_size:
                raise RuntimeError(f"precision.exact: rotary embedding with is_neox_style={self.is_neox_style}, "
                                   f"rotary_dim={self.rotary_dim} of head_size={self.head_size} has no exact "
                                   "kernel (the whole head, non-interleaved halves)")
            # the trainer's frequencies, computed once where vLLM builds the model (the GPU), by the
            # same torch ops; a buffer, so vLLM keeps it across a level-2 sleep as its own cos/sin cache
            inv_freq = rope_inv_freq(self.head_size, float(self.base), self.cos_sin_cache.device)
            self.register_buffer("jetrl_inv_freq", inv_freq, persistent=False)

        def forward_native(self, positions, query, key=None):
            if key is None:
                raise RuntimeError("precision.exact: a rotary embedding without key has no exact kernel")
            return ops.rope(positions, query, key, self.jetrl_inv_freq)

        forward_cuda = forward_native

    _patch(_group_coordinator(), "_all_reduce_out_place", _ordered_all_reduce)
    _patch(_metadata_builder(), "build", _segmenting_build)
    RMSNorm.register_oot(ExactRMSNorm)
    SiluAndMul.register_oot(ExactSiluAndMul)
    RotaryEmbedding.register_oot(ExactRotaryEmbedding)
    for cls, base in ((ExactRMSNorm, RMSNorm), (ExactSiluAndMul, SiluAndMul),
                      (ExactRotaryEmbedding, RotaryEmbedding)):
        cls.name = base.name  # enabled / disabled by vLLM's own settings, like the original
    _forget_rotary_embeddings()


def _forget_rotary_embeddings() -> None:
    """vLLM's ``get_rope`` hands out one cached module per rotary configuration for the process:
    without forgetting them, a model built after ``install`` (or ``uninstall``) would get one made
    before it. ``check_engine`` would refuse such a model; this keeps it from being built."""
    import vllm.model_executor.layers.rotary_embedding as rotary

    cache = getattr(rotary, "_ROPE_DICT", None)
    if cache is None:
        raise RuntimeError("precision.exact: this vLLM keeps no _ROPE_DICT; the exact rotary embedding cannot make "
                           "sure vLLM builds it afresh (update rollout/vllm_exact.py for this version)")
    cache.clear()


VLLM_NCCL_PINS = ("NCCL_LAUNCH_MODE", "NCCL_COLLNET_ENABLE", "NCCL_NVLS_ENABLE", "NCCL_P2P_NET_DISABLE",
                  "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_PROTO", "NCCL_ALGO", "NCCL_NTHREADS",
                  "NCCL_SOCKET_NTHREADS", "NCCL_NO_CACHE")
"""The NCCL variables vLLM's batch-invariant mode sets in the process (``override_envs_for_invariance``
in 0.26 and 0.32; 0.32 adds ``NCCL_NO_CACHE`` to have them re-read): none of them is part of the
contract, and ``job_nccl_environment`` gives each back its value from before the engine's start."""


def initialize_nccl() -> None:
    """Start NCCL in this process with the job's settings, before vLLM's batch-invariant mode sets
    its own (``VLLM_NCCL_PINS``): NCCL keeps most of its variables from the first communicator it
    creates, so the job's collectives (the trainer's, colocated) keep the job's channels and threads.
    A barrier over the job's NCCL world creates that communicator; nothing to do without one (one
    process, or another backend)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])


@contextlib.contextmanager
def job_nccl_environment() -> Iterator[dict[str, Optional[str]]]:
    """Around the engine's start: afterwards every ``VLLM_NCCL_PINS`` variable has its value from
    before again (unset where it was unset), so the communicators created later (the trainer's
    groups, on first use) are made with the job's settings. Yields the values it undid, filled in on
    exit (name -> what vLLM had set, None for a variable vLLM removed)."""
    before = {name: os.environ.get(name) for name in VLLM_NCCL_PINS}
    undone: dict[str, Optional[str]] = {}
    try:
        yield undone
    finally:
        for name, value in before.items():
            now = os.environ.get(name)
            if now == value:
                continue
            undone[name] = now
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _patch(owner: type, attr: str, make: Callable[[Callable], Callable]) -> None:
    """Replace ``owner.attr`` by ``make(original)``, marked as the exact mode's (installing again is a
    no-op; ``_unpatch`` puts the original back)."""
    original = getattr(owner, attr)
    if getattr(original, "jetrl_exact", False):
        return
    replacement = make(original)
    replacement.jetrl_exact = True
    replacement.jetrl_original = original
    setattr(owner, attr, replacement)


def _unpatch(owner: type, attr: str) -> None:
    original = getattr(getattr(owner, attr), "jetrl_original", None)
    if original is not None:
        setattr(owner, attr, original)


def _patched(owner: type, attr: str) -> bool:
    return getattr(getattr(owner, attr), "jetrl_exact", False)


def _group_coordinator() -> type:
    from vllm.distributed.parallel_state import GroupCoordinator

    return GroupCoordinator


def _ordered_all_reduce(original: Callable) -> Callable:
    """The TP group's all-reduce (``GroupCoordinator._all_reduce_out_place``, behind vLLM's
    ``all_reduce`` custom op, which its compiled graph calls) in the exact order above TP 2: an
    all-gather of the ranks' partial results (vLLM's own, capturable in CUDA graphs), then
    ``ordered_sum``. Other groups and TP 2 keep vLLM's all-reduce."""
    def _all_reduce_out_place(self, input_: torch.Tensor) -> torch.Tensor:
        if not (self.unique_name.startswith("tp:") and ordered_tp_reduction(self.world_size)):
            return original(self, input_)
        return ordered_sum(self.device_communicator.all_gather(input_.unsqueeze(0), 0))

    return _all_reduce_out_place


def _metadata_builder() -> type:
    """vLLM's metadata builder of the contract's attention kernel (``VLLM_ATTENTION``)."""
    import importlib

    module, _, name = VLLM_ATTENTION[ATTENTION_KERNEL].builder.partition(":")
    return getattr(importlib.import_module(module), name)


def fp8_kv_segmented(builder: Any, metadata: Any) -> Any:
    """``metadata`` of one step with an FP8 KV cache, every request's queries cut into segments of at
    most ``fp8_kv_query_chunk`` tokens (``ops.exact.query_segments``, the trainer's own segmenting),
    so a prefill calls FlashAttention's FP8 kernel with the tile shape a decode step uses (a query row's
    result does not depend on which rows share its segment); a step of decode-sized queries (the
    CUDA-graph-captured decode batches among them) is left as it is."""
    if not fp8_cache(builder.cache_config.cache_dtype) or getattr(metadata, "use_cascade", False):
        return metadata
    chunk = fp8_kv_query_chunk(builder.num_heads_q, builder.num_heads_kv)
    if metadata.max_query_len <= chunk:
        return metadata
    cu_q, used, table = query_segments(metadata.query_start_loc, metadata.seq_lens, metadata.block_table,
                                       metadata.num_actual_tokens, chunk)
    return dataclasses.replace(metadata, query_start_loc=cu_q, seq_lens=used, block_table=table, max_query_len=chunk)


def _segmenting_build(original: Callable) -> Callable:
    """The metadata builder's ``build``, its FP8-KV steps segmented (``fp8_kv_segmented``)."""
    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        return fp8_kv_segmented(self, original(self, common_prefix_len, common_attn_metadata, fast_build))

    return build


def _uninstall_fp8_kv_segments() -> None:
    _unpatch(_metadata_builder(), "build")


REWRITING_PASSES = ("enable_sp", "fuse_gemm_comms", "fuse_allreduce_rms")
"""vLLM compile passes that replace its TP all-reduce with other collectives or kernels (sequence
parallelism, async TP, FlashInfer's all-reduce + norm): off in an exact engine above TP 2 (the ones
this vLLM's ``PassConfig`` has)."""


def uninstall() -> None:
    """Undo ``install`` for modules built afterwards (tests; one engine per process otherwise)."""
    _unpatch(_group_coordinator(), "_all_reduce_out_place")
    _uninstall_fp8_kv_segments()
    registry = _registry()
    if any(getattr(registry.get(name), "jetrl_exact", False) for name in _REPLACED):
        for name in _REPLACED:
            registry.pop(name, None)
        _forget_rotary_embeddings()


def llm_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments of an exact engine, from the engine's usual ones."""
    out = dict(kwargs)
    out["block_size"] = KV_PAGE
    out["attention_config"] = {"backend": VLLM_ATTENTION[ATTENTION_KERNEL].backend}
    compilation = dict(kwargs.get("compilation_config") or {})
    if kwargs.get("quantization") and not kwargs.get("enforce_eager"):  # FP8 linears, compiled: fuse their input
        from megatron_jetrl.rollout.vllm_fusion import fusion_pass

        compilation["inductor_compile_config"] = {**compilation.get("inductor_compile_config", {}),
                                                  "post_grad_custom_post_pass": fusion_pass()}
    if ordered_tp_reduction(int(kwargs.get("tensor_parallel_size", 1))):  # the all-reduce stays one, the ordered one
        compilation["pass_config"] = {**compilation.get("pass_config", {}),
                                      **{name: False for name in _pass_config_fields() if name in REWRITING_PASSES}}
    if fp8_cache(kwargs.get("kv_cache_dtype", "auto")) and not kwargs.get("enforce_eager"):
        # whole-step CUDA graphs for uniform decode batches only: a step with longer queries runs its
        # attention outside a graph, with the segments fp8_kv_segmented makes for that step
        compilation["cudagraph_mode"] = "FULL_AND_PIECEWISE"
    if compilation:
        out["compilation_config"] = compilation
    return out


def _pass_config_fields() -> tuple[str, ...]:
    """The option names of this vLLM's compile ``PassConfig``."""
    from vllm.config.compilation import PassConfig

    return tuple(f.name for f in dataclasses.fields(PassConfig))


def reduction_problems(worker: Any) -> list[str]:
    """What keeps the worker's TP all-reduce from the exact order (empty at TP 2 or less): the
    ordered all-reduce not installed, or a compile pass left on that rewrites the all-reduce."""
    from vllm.distributed.parallel_state import get_tp_group

    tp = get_tp_group().world_size
    if not ordered_tp_reduction(tp):
        return []
    wrong = []
    if not _patched(_group_coordinator(), "_all_reduce_out_place"):
        wrong.append(f"TP {tp}: vLLM's all-reduce is not the ordered one (rollout.vllm_exact.install was not called)")
    passes = worker.vllm_config.compilation_config.pass_config
    on = [name for name in REWRITING_PASSES if getattr(passes, name, False)]
    if on:
        wrong.append(f"TP {tp}: compile passes {', '.join(on)} rewrite the all-reduce")
    return wrong


def check_engine(worker: Any) -> dict[str, int]:
    """Raise unless the vLLM worker's model computes every op with the exact kernels and samples
    with the V2 model runner (whose logprob kernel the trainer calls); see the module docstring.
    Returns how many modules of each kind it checked."""
    if not worker.vllm_config.use_v2_model_runner:
        raise RuntimeError("precision.exact: vLLM runs its V1 model runner, whose logprob kernel is not the one the "
                           "trainer calls; export VLLM_USE_V2_MODEL_RUNNER=1 (jetrl train sets it)")
    counts, wrong = replaced_modules(worker.get_model())
    wrong += reduction_problems(worker)
    kernels = vllm_kernels()
    for name, module in counts.pop("fp8_linear_modules"):  # the block-FP8 GEMM the trainer's FProp will call
        kernel = type(module.quant_method.fp8_linear).__name__
        want = FP8_KERNEL_CLASSES[kernels.fp8_kernel(module.quant_method.fp8_linear.config.out_dtype,
                                                     *module.weight.shape)]
        if kernel != want:
            wrong.append(f"{name}: block-FP8 GEMM {kernel}; the trainer's exact FProp calls {want}'s")
    for name, attention in counts.pop("attention_modules"):
        impl, got = attention.impl, getattr(attention.impl, "vllm_flash_attn_version", None)
        if type(impl).__name__ != VLLM_ATTENTION[ATTENTION_KERNEL].impl or got != kernels.fa_version:
            wrong.append(f"{name}: attention {type(impl).__name__} (FlashAttention version {got}; the trainer's is "
                         f"{kernels.fa_version})")
        if fp8_cache(attention.kv_cache_dtype):  # q quantized by the exact op, passed with its scale
            counts["fp8_kv_attention"] += 1
            if not (getattr(attention.query_quant, "jetrl_exact_static", False) and impl.supports_quant_query_input
                    and kernels.descale_query):
                wrong.append(f"{name}: FP8 KV cache without the exact query quantization "
                             f"({type(attention.query_quant).__name__})")
            if not _patched(_metadata_builder(), "build"):
                wrong.append(f"{name}: FP8 KV cache without the exact query segments (vllm_exact.install)")
    if wrong:
        raise RuntimeError("precision.exact: vLLM built modules without their exact kernels (the rollout would "
                           "not be exact): " + "; ".join(wrong[:8]))
    if not counts["norms"] or not counts["attention"]:
        raise RuntimeError(f"precision.exact: found no norm or attention layer in vLLM's model ({counts}); "
                           "this architecture is not covered")
    return counts


def replaced_modules(model: Any) -> tuple[dict, list[str]]:
    """Count vLLM's norm, activation, rotary, attention and block-FP8 linear modules, and name every
    norm, activation or rotary module that is not one of the exact replacements.
    ``counts["attention_modules"]`` and ``counts["fp8_linear_modules"]`` list (name, module) for
    ``check_engine``."""
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

    counts: dict = {"norms": 0, "activations": 0, "rotary": 0, "attention": 0, "fp8_kv_attention": 0,
                    "fp8_linears": 0, "attention_modules": [], "fp8_linear_modules": []}
    wrong = []
    for name, module in model.named_modules():
        kind = None
        if getattr(getattr(module, "quant_method", None), "fp8_linear", None) is not None:
            counts["fp8_linears"] += 1
            counts["fp8_linear_modules"].append((name, module))
        if type(module).__name__.endswith("RMSNorm"):  # RMSNorm and its siblings (Gemma's, gated, ...)
            kind = "norms"
        elif isinstance(module, SiluAndMul):
            kind = "activations"
        elif isinstance(module, RotaryEmbeddingBase):
            kind = "rotary"
        elif isinstance(module, Attention):
            counts["attention"] += 1
            counts["attention_modules"].append((name, module))
        if kind is not None:
            counts[kind] += 1
            if not getattr(type(module), "jetrl_exact", False):
                wrong.append(f"{name}: {type(module).__qualname__}")
            elif kind == "rotary" and module.jetrl_inv_freq.dtype != torch.float32:
                wrong.append(f"{name}: rotary frequencies in {module.jetrl_inv_freq.dtype}, not float32")
    return counts, wrong
