"""The sync without processes: every train rank's shards in one process, for tests, the vLLM
contract test and tools. Runs the same ``WeightSync`` rounds and segment tables as the
distributed path; only the exchange is an in-memory hand-over."""

from __future__ import annotations

from typing import Iterator, Mapping, Optional

import torch

from megatron_jetrl.models import ModelBridge, ParallelLayout
from megatron_jetrl.models.layout import pp_layer_range
from megatron_jetrl.precision import Fp8Quantizer, PrecisionRecipe, ReferenceQuantizer
from megatron_jetrl.sync.plan import SyncPlan, train_rank
from megatron_jetrl.sync.transfer import CopyFn, Shard, SyncReport, WeightSync
from megatron_jetrl.ops import copy_segments_reference


def shard_state(bridge: ModelBridge, recipe: PrecisionRecipe, full: Mapping[str, torch.Tensor], train: ParallelLayout,
                *, quantizer: Optional[Fp8Quantizer] = None, dp_size: int = 1) -> dict[int, dict[str, Shard]]:
    """Every train rank's shards (keyed by global rank) of a full TP=1 Megatron state dict, with
    the FP8 weight a trainer computes for each FP8 linear shard (``quantizer.quantize_weight``)."""
    f = recipe.fp8
    quantizer = quantizer or ReferenceQuantizer(pow2_scales=f.pow2_scales, eps=f.amax_epsilon)
    n = bridge.dims.num_layers
    out: dict[int, dict[str, Shard]] = {}
    for pp in range(train.pp):
        layers = pp_layer_range(n, train.pp, pp)
        for tp in range(train.tp):
            shards = {}
            for spec in bridge.tensor_map():
                on_stage = (spec.layer in layers) if spec.layer is not None else (
                    pp == 0 if spec.megatron.startswith("embedding.") else pp == train.pp - 1)
                if not on_stage:
                    continue
                dense = bridge.tp_shard(spec, full[spec.megatron], tp, train.tp).contiguous()
                fp8 = None
                if spec.linear and recipe.layer_in_fp8(spec.layer, n):
                    fp8 = quantizer.quantize_weight(dense).fprop
                shards[spec.megatron] = Shard(dense, fp8)
            for dp in range(dp_size):
                out[train_rank(tp, pp, dp, train, dp_size)] = shards
    return out


def simulate(plan: SyncPlan, shards_by_rank: Mapping[int, Mapping[str, Shard]], dst_rank: int, *,
             copy: CopyFn = copy_segments_reference, bucket_mb: float = 64,
             report: Optional[SyncReport] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The engine tensors global rank ``dst_rank`` receives, computed in this process."""
    device = next(iter(shards_by_rank[dst_rank].values())).dense.device
    syncs = {r: WeightSync(plan, r, bucket_mb=bucket_mb, copy=copy, device=device) for r in range(plan.world_size)}
    report = report or SyncReport()
    me = syncs[dst_rank]
    for i in range(len(me.rounds)):
        sent = {r: s.pack(i, shards_by_rank[r], report=SyncReport()) for r, s in syncs.items() if r != dst_rank}
        _, outs = me.pack(i, shards_by_rank[dst_rank], report=report)
        received = {r: sends[dst_rank] for r, (sends, _) in sent.items() if dst_rank in sends}
        yield from me.unpack(i, received, outs, report=report)


def engine_tensors_from_full(bridge: ModelBridge, recipe: PrecisionRecipe, megatron_state: Mapping[str, torch.Tensor],
                             rollout_tp: int = 1, rollout_rank: int = 0, *,
                             train: Optional[ParallelLayout] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """What rollout rank ``rollout_rank`` of a ``rollout_tp`` engine loads, from a full TP=1 Megatron
    state dict trained at ``train`` (default TP=PP=1; shards and their FP8 weights computed here)."""
    train = train or ParallelLayout()
    world = max(train.tp * train.pp, rollout_tp)
    dp = world // (train.tp * train.pp)
    plan = SyncPlan(bridge, recipe, train, rollout_tp, world)
    shards = shard_state(bridge, recipe, megatron_state, train, dp_size=dp)
    return simulate(plan, shards, rollout_rank)
