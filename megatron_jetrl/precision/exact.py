"""The exact rollout's contract (``precision.exact``), as facts every side reads: which kernel each
op of the forward runs, the KV-cache page, the FP8-KV query-chunk rule and the layouts that can be
exact. Config validation (``job/``), the kernels (``ops/exact.py``), the trainer's exact layers
(``actor/exact.py``) and the engine's replacements (``rollout/vllm_exact.py``) take them from here;
nothing else restates them. Plain Python: it imports nothing.

The contract: for the same tokens, the engine's logprob of every sampled token equals the
trainer's bit for bit. Each op below is one kernel on both sides (``EXACT_KERNELS``), every one
batch-invariant (a token's result depends only on that token's inputs, not on how many rows share
the call, decode or prefill, or where the trainer packs it).
"""

from __future__ import annotations

EXACT_KERNELS = {
    "embedding": "a gather (exact by itself)",
    "rms_norm": "jetrl::rms_norm (ops/rms_norm.py: one fixed reduction order), fused with the FP8 quantization "
                "of the next linear's input where that linear is FP8",
    "residual_add": "a BF16 add (in the engine: inside the norm's kernel, jetrl::add_rms_norm)",
    "qk_norm": "jetrl::rms_norm over each head (fused with rope: jetrl::qk_norm_rope)",
    "rope": "jetrl::rope: megatron's rotary formula and frequencies, from each token's position",
    "kv_quant": "with an FP8 KV cache: the engine's cache kernel with the layer's scales; the query by "
                "jetrl::static_fp8_quant",
    "attention": "FlashAttention's forward over a paged KV cache (pages of KV_PAGE tokens), one KV split",
    "silu_mul": "jetrl::silu_mul (megatron's SwiGLU rounding), fused with the FP8 quantization of fc2's input",
    "fp8_gemm": "the block-FP8 GEMM the engine picked for the linear (DeepGEMM or CUTLASS), called by both sides",
    "bf16_gemm": "the engine's batch-invariant BF16 GEMM (Triton persistent matmul, fixed tiles)",
    "lm_head": "the same BF16 GEMM",
    "token_logprob": "the engine sampler's Triton kernel (max and log-sum-exp of the BF16 logits, read once)",
    "tp_reduce": "above TP 2, the partial sums of a row-parallel linear gathered from every TP rank and added "
                 "in rank order in fp32, rounded once (ops.exact.ordered_sum); at TP 2 each side's all-reduce, "
                 "whose sum of two is one rounded addition",
}
"""Every op of a dense decoder's forward, in order, and the kernel it runs on both sides."""

EXACT_OPS = tuple(EXACT_KERNELS)

ATTENTION_KERNEL = "flash_attention"
"""The attention kernel of the contract: FlashAttention's forward (the engine's adapter maps it
to its backend; the trainer calls the same kernel)."""

KV_PAGE = 16
"""Tokens per KV-cache page: the engine's block size in the exact mode and the page size of the
trainer's paged view of its K/V, so both call FlashAttention the same way."""

FP8_KV_QUERY_ROWS = 64
"""FlashAttention 3 computes FP8 attention over a paged cache with 64-row query tiles and 96-key
blocks when a call's longest query times its query heads per KV head is at most this (one MMA
warpgroup), else with 128 x 160 tiles: the keys are then summed in other blocks and the FP8
probabilities round differently, so a decode step and a prefill would not agree. (Over a BF16
cache both kernels take 128-key blocks.) With an FP8 KV cache the exact mode keeps every call on the
first kernel: both sides attend in segments of at most ``fp8_kv_query_chunk`` queries of one sequence
(``ops.exact.query_segments``; vLLM's through ``rollout.vllm_exact.fp8_kv_segmented``)."""

EXACT_MAX_TP = 8
"""The largest tensor parallelism an exact rollout runs at (equal on both sides): the row-parallel
sums are reduced in one order on both sides (``EXACT_KERNELS["tp_reduce"]``)."""

ORDERED_REDUCTION_ABOVE_TP = 2
"""Above this TP both sides reduce row-parallel partial sums with ``tp_reduce``'s fixed order: a
sum of two partial results is one rounded addition, the same bits whichever rank adds, but more
ranks add in orders each side's all-reduce picks for itself (ring, tree, one-shot)."""


def ordered_tp_reduction(tp: int) -> bool:
    """Whether the exact mode replaces the TP all-reduce of row-parallel outputs at this TP."""
    return tp > ORDERED_REDUCTION_ABOVE_TP


EXACT_MAX_PP = 2
"""Pipeline parallelism the exact rollout is verified at (trainer stages, the engine unstaged: the
per-layer math is the same; GPU test ``test_trainer_pipeline_stages_are_exact``)."""

ROW_MULTIPLE = 128
"""The exact RMSNorm takes rows of a multiple of this many values (hidden size and head dim)."""


class ExactUnavailable(RuntimeError):
    """A kernel of the exact forward is missing or has no exact schedule: the exact mode refuses to
    run rather than fall back to a kernel that rounds differently."""


def fp8_kv_query_chunk(q_heads: int, kv_heads: int) -> int:
    """Query tokens per attention segment with an FP8 KV cache in the exact mode (``FP8_KV_QUERY_ROWS``)."""
    group = q_heads // kv_heads
    if group < 1 or q_heads % kv_heads or group > FP8_KV_QUERY_ROWS:
        raise ExactUnavailable(f"{q_heads} query heads over {kv_heads} KV heads: FP8 attention has no exact "
                               f"schedule for more than {FP8_KV_QUERY_ROWS} query heads per KV head")
    return FP8_KV_QUERY_ROWS // group


def model_problem(*, rope_scaling_factor: object, hidden_size: int, head_dim: int) -> str | None:
    """Why a model's shape cannot be exact (a sentence ending in the fix), or None: rotary
    embeddings the exact rope computes (plain, no scaling) and rows the exact norm takes."""
    if rope_scaling_factor is not None:
        return (f"the model scales its rotary embedding (factor {rope_scaling_factor}); the exact rope is the "
                "plain one: set precision.exact=false")
    for name, n in (("hidden_size", hidden_size), ("head_dim", head_dim)):
        if n % ROW_MULTIPLE:
            return (f"the exact RMSNorm takes rows of a multiple of {ROW_MULTIPLE} values; the model's {name} is "
                    f"{n}: set precision.exact=false")
    return None
