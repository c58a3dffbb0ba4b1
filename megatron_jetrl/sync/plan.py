"""The reshard plan: where every tensor the rollout engine loads comes from.

Computed once per job from (bridge, recipe, train layout, rollout TP, world size); pure rank and
slice arithmetic, identical on every rank, so each rank knows what it sends as well as what it
receives without asking anyone.

    engine tensor   one HF-named tensor as one engine rank loads it: the full tensor, or with
                    rollout TP > 1 that rank's shard of a linear (rows of q/k/v/gate/up and the
                    QKV bias, columns of o/down: vLLM's split)
    piece           a run of consecutive indices along the split dim that comes from one train
                    rank's shard, contiguous there too

Index maps (HF index -> (train TP rank, index in its shard)) come from the bridge
(``ModelBridge.index_map``: its own conversion run over index tensors), so the layout rules of
``models/layout.py`` (linear_qkv interleaves [q heads | k | v] per query group and TP splits whole
groups; linear_fc1 holds [gate_r; up_r] on rank r; vocab tensors are padded to 128 x TP) are
stated once.

Sources: the engine on global rank g reads from the train ranks of g's own data-parallel replica
(megatron's rank order tp-dp-pp: rank = tp + TP * (dp + DP * pp)), so traffic stays within a
replica. With TP = rollout TP = 1 and PP = 1 every piece is local.

FP8: the engine gets the trainer's own FP8 bytes (each train rank's shard, quantized once per
step with 128x128 blocks). That is exact only if every piece starts and ends on a 128 boundary of
both its source shard and its destination (true for head_dim 128 and 128-multiple shard sizes).
When it is not, the engine tensor is ``requantized``: assembled in BF16 and quantized as one
projection, and the plan logs it (those bytes then differ from the trainer's FProp). The
bf16-train+fp8-rollout ablation requantizes every FP8 tensor by design.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property

import torch

from megatron_jetrl.config import ConfigError, check_integer
from megatron_jetrl.models import ModelBridge, ParallelLayout, TensorSpec
from megatron_jetrl.models.bridge import VOCAB
from megatron_jetrl.models.fp8_export import SCALE_SUFFIX
from megatron_jetrl.models.layout import pp_layer_range
from megatron_jetrl.precision import WEIGHT_BLOCK, PrecisionRecipe

log = logging.getLogger(__name__)
BLOCK = WEIGHT_BLOCK[0]


@dataclass(frozen=True)
class Piece:
    """``length`` indices along the engine tensor's split dim: source [src_start, +length) of the
    shard of ``src`` (a Megatron name) on global rank ``src_rank`` -> [dst_start, +length)."""

    src_rank: int
    src: str
    src_start: int
    dst_start: int
    length: int


@dataclass(frozen=True)
class EngineTensor:
    """One HF-named tensor as one engine rank loads it.

    ``fp8``: delivered as codes (``name``) + ``name + "_scale_inv"``; otherwise in the model dtype.
    ``requantize``: the pieces are BF16 and the receiver quantizes the assembled tensor (the
    trainer's FP8 bytes cannot be re-sliced exactly, or training is not FP8).
    """

    name: str
    shape: tuple[int, ...]
    dim: int
    fp8: bool
    requantize: bool
    pieces: tuple[Piece, ...]

    @property
    def scale_name(self) -> str:
        return self.name + SCALE_SUFFIX

    @property
    def scale_shape(self) -> tuple[int, ...]:
        return tuple(-(-s // BLOCK) for s in self.shape)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def wire_bytes(self, dense_itemsize: int = 2) -> int:
        """Bytes that travel and are assembled for this tensor: codes + scales, or dense (a
        re-quantized tensor is assembled dense)."""
        if self.fp8 and not self.requantize:
            n = 1
            for s in self.scale_shape:
                n *= s
            return self.numel + 4 * n
        return self.numel * dense_itemsize


def train_rank(tp_rank: int, pp_rank: int, dp_rank: int, train: ParallelLayout, dp_size: int) -> int:
    """Global rank of a train rank in megatron-core's default order (tp fastest, then dp, then pp)."""
    return tp_rank + train.tp * (dp_rank + dp_size * pp_rank)


class SyncPlan:
    """Every engine rank's tensors, in the same name order on every rank.

    Args:
        bridge: the model's bridge (names, shapes, layouts).
        recipe: which tensors are FP8 in rollout, and whether training is FP8 (trainer bytes).
        train: the trainer's TP / PP; DP is ``world_size / (tp * pp)``.
        rollout_tp: the engine's TP; engines are consecutive groups of ``rollout_tp`` ranks.
        world_size: number of ranks, every one hosting a trainer rank and an engine rank.
    """

    def __init__(self, bridge: ModelBridge, recipe: PrecisionRecipe, train: ParallelLayout, rollout_tp: int,
                 world_size: int):
        bridge.check_layout(train)
        d = bridge.dims
        check_integer("rollout.tp", rollout_tp, minimum=1)
        for what, n in (("num_attention_heads", d.num_heads), ("num_key_value_heads", d.num_groups),
                        ("intermediate_size", d.ffn_hidden_size)):
            if n % rollout_tp:
                raise ConfigError("rollout.tp", rollout_tp, f"must divide {what} ({n}); KV heads are not "
                                  "replicated across rollout ranks")
        model_size = train.tp * train.pp
        if world_size % model_size:
            raise ConfigError("parallel", f"tp={train.tp} pp={train.pp}",
                              f"tp * pp must divide the world size ({world_size})")
        if world_size % rollout_tp:
            raise ConfigError("rollout.tp", rollout_tp, f"must divide the world size ({world_size})")
        self.bridge, self.recipe, self.train = bridge, recipe, train
        self.rollout_tp, self.world_size = rollout_tp, world_size
        self.dp_size = world_size // model_size
        self._per_rollout_rank = [self._tensors_for(r) for r in range(rollout_tp)]
        requantized = sorted({t.name for ts in self._per_rollout_rank for t in ts if t.requantize})
        if requantized and recipe.train_fp8:
            log.warning("weight sync: %d FP8 tensors cannot reuse the trainer's FP8 bytes (a q/k/v, gate/up or "
                        "shard boundary is not on a multiple of 128) and are re-quantized per projection, so the "
                        "engine's bytes differ from the trainer's for them: %s", len(requantized),
                        ", ".join(requantized[:8]) + (" ..." if len(requantized) > 8 else ""))
        self.requantized = tuple(requantized)

    # ------------------------------------------------------------------ queries

    def tensors(self, rank: int) -> list[EngineTensor]:
        """The engine tensors of global rank ``rank``, with their pieces' global source ranks."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world size {self.world_size}")
        dp = (rank // self.train.tp) % self.dp_size
        local = self._per_rollout_rank[rank % self.rollout_tp]
        return [self._placed(t, dp) for t in local]

    @cached_property
    def names(self) -> list[str]:
        return [t.name for t in self._per_rollout_rank[0]]

    def rounds(self, bucket_bytes: int) -> list[range]:
        """Consecutive runs of tensor indices, each at most ``bucket_bytes`` on any rank (a larger
        tensor gets a round of its own). Every rank walks the same rounds."""
        if bucket_bytes <= 0:
            raise ConfigError("sync.bucket_mb", bucket_bytes, "must be > 0")
        per_index = [max(ts[i].wire_bytes(self._dense_itemsize) for ts in self._per_rollout_rank)
                     for i in range(len(self.names))]
        out, start, acc = [], 0, 0
        for i, b in enumerate(per_index):
            if acc and acc + b > bucket_bytes:
                out.append(range(start, i))
                start, acc = i, 0
            acc += b
        if start < len(per_index):
            out.append(range(start, len(per_index)))
        return out

    @property
    def _dense_itemsize(self) -> int:
        return torch.empty((), dtype=self.recipe.compute_dtype).element_size()

    # ---------------------------------------------------------------- building

    def _placed(self, t: EngineTensor, dp: int) -> EngineTensor:
        pieces = tuple(Piece(train_rank(p.src_rank % self.train.tp, p.src_rank // self.train.tp, dp, self.train,
                                        self.dp_size), p.src, p.src_start, p.dst_start, p.length)
                       for p in t.pieces)
        return EngineTensor(t.name, t.shape, t.dim, t.fp8, t.requantize, pieces)

    def _tensors_for(self, r: int) -> list[EngineTensor]:
        """Rollout TP rank ``r``'s tensors; pieces carry ``tp + TP * pp`` as a placeholder source
        rank (``_placed`` maps it to a global rank of the right replica)."""
        out = []
        for spec in self.bridge.tensor_map():
            pp = self._pp_stage(spec)
            fp8 = self._rollout_fp8(spec)
            for part, (hf_name, hf_shape) in enumerate(zip(spec.hf, self.bridge.hf_shapes(spec), strict=True)):
                dim, src_tp, src_local = self.bridge.index_map(spec, part, self.train.tp)
                lo, hi = 0, hf_shape[dim]
                if spec.tp_dim is not None and spec.fuse != VOCAB:
                    per = hi // self.rollout_tp
                    lo, hi = r * per, (r + 1) * per
                shape = list(hf_shape)
                shape[dim] = hi - lo
                pieces = _runs(src_tp[lo:hi], src_local[lo:hi], spec.megatron, pp, self.train.tp)
                exact = fp8 and self.recipe.train_fp8 and self._blocks_align(spec, dim, pieces, shape)
                out.append(EngineTensor(hf_name, tuple(shape), dim, fp8, fp8 and not exact, pieces))
        return out

    def _pp_stage(self, spec: TensorSpec) -> int:
        n, pp = self.bridge.dims.num_layers, self.train.pp
        if spec.layer is not None:
            return next(p for p in range(pp) if spec.layer in pp_layer_range(n, pp, p))
        return 0 if spec.megatron.startswith("embedding.") else pp - 1

    def _rollout_fp8(self, spec: TensorSpec) -> bool:
        return spec.linear and self.recipe.rollout_layer_in_fp8(spec.layer, self.bridge.dims.num_layers)

    def _blocks_align(self, spec: TensorSpec, dim: int, pieces: tuple[Piece, ...], shape: list[int]) -> bool:
        """Whether every piece covers whole 128-blocks of its source shard and of its destination
        (a partial tail block only where both the shard and the destination end)."""
        src_len = self.bridge.shard_shape(spec, self.train.tp)[dim]
        for p in pieces:
            if p.src_start % BLOCK or p.dst_start % BLOCK:
                return False
            if p.length % BLOCK and not (p.src_start + p.length == src_len and p.dst_start + p.length == shape[dim]):
                return False
        return True


def _runs(src_tp: torch.Tensor, src_local: torch.Tensor, src: str, pp: int, tp_size: int) -> tuple[Piece, ...]:
    """Split the index maps of one destination range into maximal runs contiguous in one shard."""
    n = src_tp.numel()
    if n == 0:
        return ()
    breaks = (src_tp[1:] != src_tp[:-1]) | (src_local[1:] != src_local[:-1] + 1)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), breaks.nonzero().flatten() + 1]).tolist()
    ends = starts[1:] + [n]
    tps, locs = src_tp.tolist(), src_local.tolist()
    return tuple(Piece(tps[s] + tp_size * pp, src, locs[s], s, e - s) for s, e in zip(starts, ends, strict=True))
