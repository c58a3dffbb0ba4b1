"""What the actor is given: typed, validated settings (the ``actor`` section of a job config).

Validation happens at construction and names the key, so a bad value fails before any GPU work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from megatron_jetrl.config import ConfigError, check_fields, check_integer, check_number
from megatron_jetrl.models import ParallelLayout
from megatron_jetrl.precision import PrecisionRecipe



@dataclass(frozen=True)
class OptimizerSettings:
    """Adam with decoupled weight decay (megatron's DistributedOptimizer), global-norm clipping and
    an LR schedule: linear warmup over ``warmup_steps``, then ``decay_style`` down to ``min_lr`` at
    ``decay_steps`` (``constant`` keeps ``lr``)."""

    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    warmup_steps: int = 0
    decay_steps: Optional[int] = None
    decay_style: Literal["constant", "linear", "cosine"] = "constant"
    initial_loss_scale: float = 2.0**16
    """FP16 only: the starting dynamic loss scale (megatron halves it on overflow, grows it after
    ``loss_scale_window`` clean steps)."""
    loss_scale_window: int = 1000

    def __post_init__(self) -> None:
        k = "actor.optimizer"
        check_fields(self, k, ("decay_style",))
        check_number(f"{k}.lr", self.lr, low=0.0, low_open=True)
        check_number(f"{k}.min_lr", self.min_lr, low=0.0)
        if self.min_lr > self.lr:
            raise ConfigError(f"{k}.min_lr", self.min_lr, f"must be <= lr ({self.lr})")
        check_number(f"{k}.weight_decay", self.weight_decay, low=0.0)
        for name in ("adam_beta1", "adam_beta2"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
                raise ConfigError(f"{k}.{name}", v, "must be in [0, 1)")
        check_number(f"{k}.adam_eps", self.adam_eps, low=0.0, low_open=True)
        check_number(f"{k}.clip_grad", self.clip_grad, low=0.0)
        check_integer(f"{k}.warmup_steps", self.warmup_steps, minimum=0)
        if self.decay_steps is not None:
            check_integer(f"{k}.decay_steps", self.decay_steps, minimum=1)
            if self.decay_steps <= self.warmup_steps:
                raise ConfigError(f"{k}.decay_steps", self.decay_steps,
                                  f"must exceed warmup_steps ({self.warmup_steps})")
        elif self.decay_style != "constant":
            raise ConfigError(f"{k}.decay_steps", None, f"decay_style {self.decay_style!r} needs decay_steps")
        check_number(f"{k}.initial_loss_scale", self.initial_loss_scale, low=0.0, low_open=True)
        check_integer(f"{k}.loss_scale_window", self.loss_scale_window, minimum=1)


@dataclass(frozen=True)
class ActorSettings:
    """The trainer: parallel layout, precision, micro-batching and the optimizer.

    ``fp8_backend`` picks the decoder layers: ``native`` (this project's: its norms, packed attention
    and, in the ``fp8`` mode, FP8 linears on its kernels + torch's blockwise ``scaled_mm``, Hopper) or
    ``te`` (Transformer Engine's layers in every mode: fused norm + linear, cuDNN attention, and in the
    ``fp8`` mode ``Float8BlockScaling``). ``fp8_gemm`` forces the native GEMM path (``emulate`` runs
    anywhere, exactly, slowly: for tests). ``max_tokens_per_microbatch`` is the packing budget; a longer
    sequence runs alone. ``max_seq_len`` defaults to the model's ``max_position_embeddings``.
    ``recompute``: ``full`` keeps only each layer's input through the forward pass and recomputes the
    layer in the backward pass (megatron's full uniform recompute, one layer per checkpoint): about a
    third more update time for activations that no longer grow with depth, what 8K-16K responses need;
    ``none`` keeps everything. ``logprob_impl``: how the per-token logprob and entropy over the
    vocabulary are computed (``actor/logprobs.py``): ``compiled`` (default; the same formulas fused by
    torch.compile: a few reads of the logits instead of ~40 fp32 passes per micro-batch; 10-12 % off the
    8B-shaped actor step on an H200) or ``eager`` torch ops (no compilation; the reference the compiled
    form is tested against). ``elementwise_impl``: the SwiGLU and RoPE of every decoder layer
    (``actor/layers.py``): ``compiled`` (default; megatron's fused SwiGLU, torch.compile'd, one kernel
    forward and one backward, rounded once; RoPE as one compiled kernel each way with megatron's
    roundings, so its bits are megatron's; 7 % off the 8B-shaped actor step on an H200) or ``eager``
    (megatron's eager ops: several strided kernels per SwiGLU and about ten per RoPE, forward and
    backward). The exact mode keeps its own forward (``ops.exact``) either way. ``attention_impl``: the
    native layers' causal attention over packed sequences (``actor/layers.py``): ``torch`` (default;
    torch's FlashAttention-2 varlen kernels) or ``te`` (Transformer Engine's ``DotProductAttention`` on
    the packed ``thd`` layout: cuDNN's fused attention on Hopper, the attention of the te backend;
    needs Transformer Engine installed, and not with ``precision.exact``).
    """

    parallel: ParallelLayout = field(default_factory=ParallelLayout)
    precision: PrecisionRecipe = field(default_factory=PrecisionRecipe)
    fp8_backend: Literal["native", "te"] = "native"
    fp8_gemm: Literal["auto", "scaled_mm", "emulate"] = "auto"
    fp8_wgrad: Literal["gemm", "deep_gemm"] = "gemm"
    """The native FP8 linears' WGrad: ``gemm`` (``fp8_gemm``'s, a BF16 dW that megatron adds to its fp32
    main grad) or ``deep_gemm`` (DeepGEMM's SM90 1D1D kernel accumulating into the main grad itself,
    ``ops/deep_gemm.py``; Hopper, DeepGEMM importable)."""
    max_tokens_per_microbatch: int = 8192
    max_seq_len: Optional[int] = None
    recompute: Literal["none", "full"] = "none"
    logprob_impl: Literal["eager", "compiled"] = "compiled"
    elementwise_impl: Literal["eager", "compiled"] = "compiled"
    attention_impl: Literal["torch", "te"] = "torch"
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    seed: int = 1234

    def __post_init__(self) -> None:
        check_fields(self, "actor", ("fp8_backend", "fp8_gemm", "fp8_wgrad", "recompute", "logprob_impl",
                                      "elementwise_impl", "attention_impl"))
        if self.fp8_wgrad != "gemm" and self.fp8_backend != "native":
            raise ConfigError("actor.fp8_wgrad", self.fp8_wgrad, f"is the native FP8 linears' WGrad; the "
                              f"{self.fp8_backend!r} backend runs its own: set actor.fp8_wgrad=gemm")
        if self.attention_impl != "torch" and self.fp8_backend != "native":
            raise ConfigError("actor.attention_impl", self.attention_impl, f"is the native layers' attention; the "
                              f"{self.fp8_backend!r} backend runs its own: set actor.attention_impl=torch")
        if not isinstance(self.parallel, ParallelLayout):
            raise ConfigError("actor.parallel", self.parallel, "must be a ParallelLayout")
        if not isinstance(self.precision, PrecisionRecipe):
            raise ConfigError("actor.precision", self.precision, "must be a PrecisionRecipe")
        if self.attention_impl != "torch" and self.precision.exact:
            raise ConfigError("actor.attention_impl", self.attention_impl, "precision.exact attends with vLLM's "
                              "FlashAttention forward, differentiated with torch's: set actor.attention_impl=torch")
        check_integer("actor.max_tokens_per_microbatch", self.max_tokens_per_microbatch, minimum=1)
        if self.max_seq_len is not None:
            check_integer("actor.max_seq_len", self.max_seq_len, minimum=1)
        if not isinstance(self.optimizer, OptimizerSettings):
            raise ConfigError("actor.optimizer", self.optimizer, "must be an OptimizerSettings")
        check_integer("actor.seed", self.seed)

    def data_parallel_size(self, world_size: int) -> int:
        """DP = world / (TP x PP); fails, naming the layout, when it does not divide."""
        model_parallel = self.parallel.tp * self.parallel.pp
        if world_size % model_parallel:
            raise ConfigError(
                "actor.parallel", f"tp={self.parallel.tp} pp={self.parallel.pp}",
                f"TP x PP = {model_parallel} must divide the world size ({world_size} processes)",
            )
        return world_size // model_parallel
