"""FP8 KV-cache scales, calibrated by the trainer on every step's batch and shipped with the weights.

With an FP8 KV cache the rollout engine stores k and v (and vLLM also quantizes q) with one fp32
scale per layer; a scale that is too small clips, one too large wastes precision. The trainer's
old-logprob forward sees the step's exact sequences, so it measures them (FP8-RL's recipe):

    per layer and for each of q, k, v (after qk-norm and RoPE, as the cache holds them):
        a_t   = max |x_t|  over heads and head dims, for every token t of a micro-batch
                (heads split over TP ranks are reduced per token first, so TP does not change it)
        amax  = the 99.9th percentile of a_t (nearest rank), max over micro-batches and
                data-parallel / pipeline ranks
        scale = amax * 1.05 / 448          (1.0 where amax is 0: an all-zero input)

The percentile drops the rare outlier token that would otherwise dictate the scale of the whole
cache; the 5 % margin covers tokens the rollout produces that the batch did not hold. Scales are
what vLLM loads as ``model.layers.<i>.self_attn.attn.{q,k,v}_scale`` (fp32 scalars).
"""

from __future__ import annotations

import math

import torch

from megatron_jetrl.precision.blockwise import E4M3_MAX

KV_PERCENTILE = 0.999
KV_MARGIN = 1.05
KV_TENSORS = ("q", "k", "v")


def token_amax(x: torch.Tensor) -> torch.Tensor:
    """[T, ...] -> [T] fp32: every token's max |x| over its remaining dims."""
    if x.dim() < 2:
        raise ValueError(f"expected [tokens, ...]; got shape {tuple(x.shape)}")
    flat = x.detach().reshape(x.shape[0], -1)
    return torch.maximum(flat.amax(dim=1), -flat.amin(dim=1)).float()  # max |x| without an |x| copy


def nearest_rank_percentile(values: torch.Tensor, q: float = KV_PERCENTILE) -> torch.Tensor:
    """The ``q`` quantile of a 1-D tensor by nearest rank (an element of ``values``; any size)."""
    if values.dim() != 1 or values.numel() == 0:
        raise ValueError(f"expected a non-empty 1-D tensor; got shape {tuple(values.shape)}")
    if not 0 < q <= 1:
        raise ValueError(f"q must be in (0, 1]; got {q}")
    k = max(1, math.ceil(q * values.numel()))
    return values.float().kthvalue(k).values


def kv_scales_from_amax(amax: torch.Tensor, margin: float = KV_MARGIN) -> torch.Tensor:
    """scale = amax * margin / 448, and 1.0 where amax is 0 (any shape, fp32)."""
    amax = amax.float()
    return torch.where(amax > 0, amax * margin / E4M3_MAX, torch.ones_like(amax))


def kv_scale_names(num_layers: int, layer_prefix: str = "model.layers") -> list[str]:
    """vLLM's names of the [num_layers, 3] scales, row-major (q, k, v per layer)."""
    return [f"{layer_prefix}.{i}.self_attn.attn.{t}_scale" for i in range(num_layers) for t in KV_TENSORS]


class KvAmaxObserver:
    """Collects the per-layer percentile amax of q, k, v over the micro-batches of one pass.

    ``amax`` is [num_layers, 3] fp32 on ``device``; layers this rank does not hold stay 0, so a
    max-reduction over every rank of the job gives the model's values. ``tp_group``: the ranks
    that hold the other heads of the same tokens (per-token amax is max-reduced over it).
    """

    def __init__(self, num_layers: int, device: torch.device | str, tp_group=None):
        self.amax = torch.zeros(num_layers, len(KV_TENSORS), dtype=torch.float32, device=device)
        self.tp_group = tp_group
        self.tokens: int | None = None
        """Set per micro-batch by the actor: its real tokens; the rows after them (the padding
        sequence that aligns the micro-batch) are left out."""

    def observe(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """q, k, v as [tokens, heads, head_dim] (any leading token layout flattened by the caller):
        one TP all-reduce and one selection for the three."""
        if self.tokens is not None:
            q, k, v = q[: self.tokens], k[: self.tokens], v[: self.tokens]
        if q.shape[0] == 0:
            return
        a_3T = torch.stack([token_amax(q), token_amax(k), token_amax(v)])
        if self.tp_group is not None and torch.distributed.get_world_size(self.tp_group) > 1:
            torch.distributed.all_reduce(a_3T, op=torch.distributed.ReduceOp.MAX, group=self.tp_group)
        rank = max(1, math.ceil(KV_PERCENTILE * a_3T.shape[1]))
        self.amax[layer] = torch.maximum(self.amax[layer], a_3T.kthvalue(rank, dim=1).values)
