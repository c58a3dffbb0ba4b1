"""The ``rollout`` section of a job: the engine's name and each engine's options section
(``rollout.hf``, ``rollout.vllm``). What differs between engines in sizing and validation is read
from the options object (rollout TP, FP8 KV cache, context limit, memory); what they can do and how
they are built is their entry in ``engines.ENGINES``.

The number of samples per prompt is ``algo.group_size`` and the sampling seed derives from
``run.seed`` and the step, so ``rollout.sampling`` holds neither (the job sets them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Optional, Union

from megatron_jetrl.config import ConfigError, check_fields, check_integer, check_number
from megatron_jetrl.precision.exact import ATTENTION_KERNEL
from megatron_jetrl.rollout.base import SamplingParams

if TYPE_CHECKING:

    from megatron_jetrl.models import ModelDims


@dataclass(frozen=True)
class HfOptions:
    """The ``rollout.hf`` section (see ``HfEngine``): batch limits of the transformers engine, and
    what its sleep does with the weights: drop them (default; the next sync overwrites them all
    anyway, so copying them to host and back each step would only cost time and host memory) or,
    with ``sleep_keeps_weights``, keep them in (pinned) host memory for a later wake."""

    section: ClassVar[str] = "rollout.hf"
    tp_key: ClassVar[str] = "rollout.engine"  # the hf engine runs at TP 1: its TP has no key
    kv_cache_key: ClassVar[Optional[str]] = None
    share_key: ClassVar[Optional[str]] = None

    max_num_seqs: int = 256
    max_batch_tokens: int = 131072
    max_prefill_tokens: int = 16384
    cuda_graphs: bool = True
    gemm: Literal["auto", "scaled_mm", "emulate"] = "auto"
    sleep_keeps_weights: bool = False

    def __post_init__(self) -> None:
        check_fields(self, "rollout.hf")
        for name in ("max_num_seqs", "max_batch_tokens", "max_prefill_tokens"):
            check_integer(f"rollout.hf.{name}", getattr(self, name), minimum=1)

    @property
    def tp(self) -> int:
        """Tensor-parallel size of one engine: the hf engine runs whole on one GPU."""
        return 1

    @property
    def fp8_kv_cache(self) -> bool:
        return False

    @property
    def in_place_weights(self) -> bool:
        """The weight sync writes into the engine's own tensors (``RolloutEngine.weight_buffers``)."""
        return True

    @property
    def fp8_gemm_label(self) -> Optional[str]:
        """The block-FP8 GEMM library the engine runs, for the layout line (None: its own)."""
        return None

    def check_sequence(self, longest: int) -> None:
        """The engine holds one prompt + response of ``longest`` tokens; ConfigError naming its key."""
        slots = longest - 1  # KV slots of one prompt + response (the last token is not cached)
        if self.max_batch_tokens < slots:
            raise ConfigError(f"{self.section}.max_batch_tokens", self.max_batch_tokens,
                              f"must hold one prompt + response ({slots} KV-cache slots: data max_prompt_tokens + "
                              "rollout.sampling.max_new_tokens - 1)")

    def exact_rules(self, trainer_tp: int) -> list[tuple[str, Any, bool, str]]:
        """(key, value, holds, fix) of what an exact rollout needs of these options: the hf engine
        cannot run one (``EngineKind.exact``), so none."""
        return []

    def memory(self, dims: "ModelDims") -> tuple[float, Optional[float]]:
        """(KV-cache bytes, share of the GPU the engine claims): its cache holds ``max_batch_tokens``."""
        kv = float(self.max_batch_tokens * dims.num_layers * 2 * dims.num_groups * dims.head_dim * 2)
        return kv, None


@dataclass(frozen=True)
class VllmOptions:
    """The ``rollout.vllm`` section: how the engine runs (precision is the recipe's, not here)."""

    section: ClassVar[str] = "rollout.vllm"
    tp_key: ClassVar[str] = "rollout.vllm.tensor_parallel_size"
    kv_cache_key: ClassVar[Optional[str]] = "rollout.vllm.kv_cache_dtype"
    share_key: ClassVar[Optional[str]] = "rollout.vllm.gpu_memory_utilization"

    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    """Share of GPU memory for weights + KV cache while awake; the trainer gets it back in sleep."""
    max_model_len: Optional[int] = None
    """Longest prompt + response; default: the job's longest prompt (``data.train`` or ``data.eval``
    ``max_prompt_tokens``) + ``rollout.sampling.max_new_tokens``."""
    max_num_seqs: int = 256
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    """``fp8`` stores the KV cache in E4M3 with per-layer scales the trainer measures each step."""
    enforce_eager: bool = False
    """No CUDA graphs / torch.compile: faster start, slower decode (tests, debugging)."""
    cuda_graph_max_batch: Optional[int] = None
    """Capture CUDA graphs up to this many sequences per decode step (default: vLLM's, up to
    ``max_num_seqs``); fewer graphs start faster."""
    enable_prefix_caching: bool = True
    seed: int = 0
    sleep_level: Literal[1, 2] = 2
    """1: weights kept in host memory while asleep; 2: weights discarded (every update after a sleep
    must then send all of them; the weight sync does)."""
    weight_update: Literal["in_place", "reload"] = "in_place"
    """``in_place``: the sync writes into vLLM's parameters; ``reload``: vLLM's own loaders."""
    fp8_gemm: Literal["auto", "cutlass", "deep_gemm"] = "auto"
    """vLLM's block-FP8 GEMM on Hopper: ``deep_gemm`` (DeepGEMM), ``cutlass``, or ``auto`` (the
    default): DeepGEMM. Both compute with the trainer's FP8 bytes (GPU-tested); with
    ``precision.exact`` the trainer's FProp calls the GEMM vLLM runs for each linear
    (``ops.exact.VllmKernels.fp8_gemm``). DeepGEMM decodes ~7 % faster (docs/rollout.md); it
    JIT-compiles its kernels at the first start on a machine (~3.5 extra minutes for Qwen3-8B) into
    its on-disk cache, which later starts reuse."""
    attention_backend: Literal["auto", "flash_attn", "triton_attn"] = "auto"
    """vLLM's attention kernels: ``auto`` (vLLM's pick: FlashAttention 3 on Hopper), ``flash_attn`` or
    ``triton_attn`` (vLLM's unified Triton kernel; with an FP8 KV cache both quantize the query with
    its scale and read FP8 K/V). ``precision.exact`` computes FlashAttention's forward: auto or
    flash_attn there."""
    activation_quant: Literal["trainer", "vllm"] = "trainer"
    """Who quantizes a linear's input in FP8 rollout: ``trainer`` (default: the trainer's 1x128
    kernel and TE's rule, with vLLM's norm/activation+quant fusions off: the codes the trainer's
    FProp makes from the same input; ``vllm_activation_quant.py``) or ``vllm`` (its own kernels and rule).
    Measured on an H200 (docs/rollout.md): ``trainer`` halves the engine-vs-trainer k3 KL and
    decodes ~6 % faster (its kernel takes 30 ms of 32 decode steps at batch 256, vLLM's 50 ms)."""

    def __post_init__(self) -> None:
        k = "rollout.vllm"
        check_fields(self, k)
        for name in ("tensor_parallel_size", "max_num_seqs"):
            check_integer(f"{k}.{name}", getattr(self, name), minimum=1)
        for name in ("max_model_len", "cuda_graph_max_batch"):
            if getattr(self, name) is not None:
                check_integer(f"{k}.{name}", getattr(self, name), minimum=1)
        check_number(f"{k}.gpu_memory_utilization", self.gpu_memory_utilization, low=0.0, high=1.0, low_open=True,
                     high_open=True)
        check_integer(f"{k}.seed", self.seed)

    @property
    def tp(self) -> int:
        return self.tensor_parallel_size

    @property
    def attention_config(self) -> Optional[dict[str, str]]:
        """``vllm.LLM``'s ``attention_config`` for ``attention_backend`` (None: vLLM picks)."""
        return None if self.attention_backend == "auto" else {"backend": self.attention_backend.upper()}

    @property
    def fp8_gemm_kernel(self) -> Literal["cutlass", "deep_gemm"]:
        """The block-FP8 GEMM this engine runs (``fp8_gemm`` with ``auto`` resolved)."""
        return "deep_gemm" if self.fp8_gemm == "auto" else self.fp8_gemm

    @property
    def fp8_kv_cache(self) -> bool:
        return self.kv_cache_dtype == "fp8"

    @property
    def in_place_weights(self) -> bool:
        return self.weight_update == "in_place"

    @property
    def fp8_gemm_label(self) -> Optional[str]:
        return "DeepGEMM" if self.fp8_gemm_kernel == "deep_gemm" else "CUTLASS"

    def check_sequence(self, longest: int) -> None:
        if self.max_model_len is not None and self.max_model_len < longest:
            raise ConfigError(f"{self.section}.max_model_len", self.max_model_len,
                              f"must hold the longest prompt + response ({longest} tokens: data max_prompt_tokens + "
                              "rollout.sampling.max_new_tokens); leave it unset to use that")

    def exact_rules(self, trainer_tp: int) -> list[tuple[str, Any, bool, str]]:
        """(key, value, holds, fix) of what an exact rollout needs of vLLM: the trainer's layout,
        the contract's attention kernel (``VLLM_ATTENTION``) and the trainer's activation
        quantization."""
        k, backends = self.section, VLLM_ATTENTION[ATTENTION_KERNEL].options
        return [
            (f"{k}.tensor_parallel_size", self.tensor_parallel_size, self.tensor_parallel_size == trainer_tp,
             f"the exact rollout needs the trainer's layout in the engine (each rank the same slices of every "
             f"GEMM): set {k}.tensor_parallel_size={trainer_tp} (actor.parallel.tp)"),
            (f"{k}.attention_backend", self.attention_backend, self.attention_backend in backends,
             f"the trainer's exact attention is FlashAttention's forward: set {k}.attention_backend="
             + " or ".join(backends)),
            (f"{k}.activation_quant", self.activation_quant, self.activation_quant == "trainer",
             f"vLLM must quantize activations with the trainer's kernel: set {k}.activation_quant=trainer"),
        ]

    def memory(self, dims: "ModelDims") -> tuple[float, Optional[float]]:
        """vLLM sizes its own KV cache within ``gpu_memory_utilization`` of the GPU."""
        return 0.0, self.gpu_memory_utilization


@dataclass(frozen=True)
class VllmAttention:
    """How vLLM runs one attention kernel of the exact contract: the ``rollout.vllm.attention_backend``
    values that pick it, the backend an exact engine asks for, the class of its layers' ``impl``
    that ``vllm_exact.check_engine`` requires, and its metadata builder (``module:class``), whose
    batches an FP8 KV cache's exact attention cuts into decode-sized query segments."""

    options: tuple[str, ...]
    backend: str
    impl: str
    builder: str


VLLM_ATTENTION = {"flash_attention": VllmAttention(
    options=("auto", "flash_attn"), backend="FLASH_ATTN", impl="FlashAttentionImpl",
    builder="vllm.v1.attention.backends.flash_attn:FlashAttentionMetadataBuilder")}
"""vLLM's side of each attention kernel of the exact contract (``precision.exact.ATTENTION_KERNEL``):
the one place that names it (vLLM's pick on Hopper is FlashAttention 3)."""


EngineOptions = Union[HfOptions, VllmOptions]


@dataclass(frozen=True)
class RolloutSettings:
    """``engine``: a key of ``engines.ENGINES`` (``hf``: transformers, this project's FP8 linears, rollout TP 1;
    ``vllm``: production). ``offload_actor``: while the engine generates, the actor's parameters and
    optimizer state wait in host memory, as much of them as the engine's wake needs, and the engine
    sleeps while the actor trains (colocation; off only when both fit on the GPU at once, a
    generation's transients included)."""

    engine: Literal["hf", "vllm"] = "hf"
    sampling: SamplingParams = field(default_factory=SamplingParams)
    hf: HfOptions = field(default_factory=HfOptions)
    vllm: VllmOptions = field(default_factory=VllmOptions)
    offload_actor: bool = True

    def __post_init__(self) -> None:
        check_fields(self, "rollout", ("engine", "offload_actor"))
        if self.options is not self.vllm and self.vllm.fp8_kv_cache:
            raise ConfigError("rollout.vllm.kv_cache_dtype", self.vllm.kv_cache_dtype,
                              f"an FP8 KV cache needs rollout.engine=vllm (the {self.engine} engine keeps it in the "
                              "model dtype)")

    @property
    def options(self) -> EngineOptions:
        """The chosen engine's own section (``rollout.<engine>``)."""
        return getattr(self, self.engine)

    @property
    def tp(self) -> int:
        """Tensor-parallel size of one rollout engine."""
        return self.options.tp

    @property
    def fp8_kv_cache(self) -> bool:
        return self.options.fp8_kv_cache
