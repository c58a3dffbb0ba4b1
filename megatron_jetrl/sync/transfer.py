"""The per-step weight transfer: trainer shards -> engine tensors, bucket by bucket.

Every rank runs the same rounds (``SyncPlan.rounds``). In a round, rank g

    1. packs, in one ``copy_segments`` launch, the pieces it sources for other ranks into one
       dense send buffer per peer and its own pieces straight into its engine tensors
       (QKV de-interleave, gate/up split and TP column joins are just segment offsets);
    2. exchanges the buffers with its peers (``batch_isend_irecv``; NCCL within a replica);
    3. unpacks what it received into its engine tensors (a second launch);
    4. re-quantizes the tensors the plan marks (BF16 assembled -> 128x128 FP8);
    5. hands the round's tensors to the engine, which copies them.

Each rank's sources are its own shards: the model-dtype parameter and, for a linear computing in
FP8, the FP8 weight its FProp reads (``Actor.weight_shards``). No rank holds more than one
round's tensors beyond its own shards. Wire format between two ranks, per round: for each of the
receiver's tensors in plan order, for each piece from that sender, the piece's data region then
(trainer FP8 bytes) its scale region, each dense.

The segment tables are built once (offsets, not pointers), so a step costs the allocations,
two launches and the exchange per round.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Optional

import torch
import torch.distributed as dist

from megatron_jetrl.ops import copy_segments, quantize_128x128
from megatron_jetrl.precision import WEIGHT_BLOCK, Shard
from megatron_jetrl.precision.kv_cache import kv_scale_names
from megatron_jetrl.precision.blockwise import block_grid
from megatron_jetrl.rollout.base import RolloutEngine, TensorMeta, WeightMismatch, check_against_specs
from megatron_jetrl.sync.plan import BLOCK, EngineTensor, Piece, SyncPlan

CopyFn = Callable[[list, list, torch.Tensor], None]


@dataclass
class SyncReport:
    """Seconds per phase (``pack`` and ``unpack`` are the copy kernels, ``exchange`` the NCCL
    transfer, ``requantize`` tensors the plan re-quantizes, ``load`` the engine's copy), the bytes
    delivered to the engine and sent to peers, and counts."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    engine_bytes: int = 0
    sent_bytes: int = 0
    tensors: int = 0
    rounds: int = 0
    in_place: int = 0
    """Engine tensors the kernels wrote straight into the engine's own buffers."""

    @property
    def total_s(self) -> float:
        return self.seconds.get("total", 0.0)


@dataclass(frozen=True)
class _Part:
    """One dense region of a piece along the split dim: ``start``/``length`` in units of the
    part's tensor (elements, or 128-blocks for scales), ``other`` = size of the other dim."""

    src_start: int
    dst_start: int
    length: int
    other: int
    itemsize: int
    kind: str  # "dense" | "data" | "scale"

    @property
    def nbytes(self) -> int:
        return self.length * self.other * self.itemsize


@dataclass
class _Round:
    mine: list[EngineTensor]
    sources: list[tuple[str, str]] = field(default_factory=list)
    peers_out: list[int] = field(default_factory=list)
    send_bytes: list[int] = field(default_factory=list)
    peers_in: list[int] = field(default_factory=list)
    recv_bytes: list[int] = field(default_factory=list)
    pack_table: Optional[torch.Tensor] = None
    unpack_table: Optional[torch.Tensor] = None


def _parts(t: EngineTensor, p: Piece, dense_itemsize: int) -> list[_Part]:
    other = t.shape[1 - t.dim] if len(t.shape) == 2 else 1
    if not t.fp8 or t.requantize:
        return [_Part(p.src_start, p.dst_start, p.length, other, dense_itemsize, "dense")]
    b0 = p.src_start // BLOCK
    nb = -(-(p.src_start + p.length) // BLOCK) - b0
    other_blocks = t.scale_shape[1 - t.dim] if len(t.shape) == 2 else 1
    return [_Part(p.src_start, p.dst_start, p.length, other, 1, "data"),
            _Part(b0, p.dst_start // BLOCK, nb, other_blocks, 4, "scale")]


def _region(dim: int, cols: int, start: int, length: int, other: int, itemsize: int) -> tuple[int, int, int, int]:
    """(offset, row stride, row bytes, rows) of ``length`` indices from ``start`` along ``dim`` of a
    row-major [rows, cols] tensor (1-D tensors are [n, 1])."""
    if dim == 0:
        return start * cols * itemsize, cols * itemsize, cols * itemsize, length
    return start * itemsize, cols * itemsize, length * itemsize, other


def _outputs(t: EngineTensor) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of the tensors the engine gets for ``t``; kind dense | data | scale."""
    if t.fp8 and not t.requantize:
        return [(t.name, t.shape, "data"), (t.scale_name, t.scale_shape, "scale")]
    return [(t.name, t.shape, "dense")]


class WeightSync:
    """Moves the trainer's weights into this rank's engine; build once per job on every rank.

    Args:
        plan: the job's ``SyncPlan``.
        rank: this process's global rank (``dist.get_rank()``).
        bucket_mb: bytes per round (the engine gets one ``update_weights`` call per round).
        device: where engine tensors are assembled (the engine's GPU).
        copy: the segment copy (``ops.copy_segments``; the pure-torch reference in tests).
        group: the process group of the whole job (None: the default group); unused when the
            plan needs no communication.
    """

    def __init__(self, plan: SyncPlan, rank: int, *, bucket_mb: float = 512, device: torch.device | str = "cpu",
                 copy: CopyFn = copy_segments, group=None):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.plan, self.rank, self.device, self.copy, self.group = plan, rank, device, copy, group
        self.dense_dtype = plan.recipe.compute_dtype
        self.dense_itemsize = torch.empty((), dtype=self.dense_dtype).element_size()
        self.mine = plan.tensors(rank)
        self._spec_by_name = {s.megatron: s for s in plan.bridge.tensor_map()}
        self._tensors_by_rank: dict[int, list[EngineTensor]] = {rank: self.mine}
        replica = (rank // plan.train.tp) % plan.dp_size
        self._replica_peers = [r for r in range(plan.world_size)
                               if r != rank and (r // plan.train.tp) % plan.dp_size == replica]
        self.rounds = [self._build_round(r) for r in plan.rounds(int(bucket_mb * 2**20))]

    # ------------------------------------------------------------------ specs

    def engine_specs(self) -> dict[str, TensorMeta]:
        """Every tensor this rank's engine receives, with shape and dtype."""
        dtypes = {"dense": self.dense_dtype, "data": torch.float8_e4m3fn, "scale": torch.float32}
        out = {}
        for t in self.mine:
            if t.fp8:
                out[t.name] = TensorMeta(t.shape, dtypes["data"])
                out[t.scale_name] = TensorMeta(t.scale_shape, dtypes["scale"])
            else:
                out[t.name] = TensorMeta(t.shape, dtypes["dense"])
        return out

    def source_specs(self) -> dict[str, tuple[tuple[int, ...], bool]]:
        """(shard shape, needs the FP8 weight) of every local source some rank reads from here."""
        need: dict[str, tuple[tuple[int, ...], bool]] = {}
        for rnd in self.rounds:
            for name, kind in rnd.sources:
                shape = self._shard_shape(name)
                need[name] = (shape, need.get(name, (shape, False))[1] or kind != "dense")
        return need

    def check(self, sources: Mapping[str, Shard], engine: Optional[RolloutEngine] = None) -> None:
        """Raise before any transfer when a source shard or the engine does not match the plan (all
        ranks raise together when torch.distributed is up, so none is left waiting)."""
        try:
            error = self._local_error(sources, engine)
        except Exception as e:  # reported through the all-reduce below, never left for peers to wait on
            error = f"weight sync check failed on rank {self.rank}: {e!r}"
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            flag = torch.tensor([1 if error else 0], device=self._comm_device())
            dist.all_reduce(flag, group=self.group)
            if flag.item() and not error:
                error = "another rank found a weight-sync mismatch (its error names the tensor)"
        if error:
            raise ValueError(error)

    def _local_error(self, sources: Mapping[str, Shard], engine: Optional[RolloutEngine]) -> Optional[str]:
        for name, (shape, needs_fp8) in self.source_specs().items():
            shard = sources.get(name)
            if shard is None:
                return f"weight sync: the trainer has no tensor {name} on rank {self.rank}"
            got = tuple(shard.dense.shape)
            if got != shape and not (len(shape) == 2 and shape[1] == 1 and got == shape[:1]):
                return f"weight sync: trainer tensor {name} is {list(got)}; the plan expects {list(shape)}"
            if shard.dense.dtype != self.dense_dtype:
                return (f"weight sync: trainer tensor {name} is {shard.dense.dtype}; the recipe's rollout dtype is "
                        f"{self.dense_dtype}")
            if shard.dense.device != self.device or not shard.dense.is_contiguous():
                return (f"weight sync: trainer tensor {name} must be contiguous on {self.device}; it is on "
                        f"{shard.dense.device} with strides {shard.dense.stride()}")
            if needs_fp8:
                if shard.fp8 is None:
                    return (f"weight sync: {name} has no FP8 weight on rank {self.rank}; unified FP8 needs the actor "
                            "in fp8 mode with the native backend")
                data, scale = shard.fp8.data, shard.fp8.scale_inv
                grid = block_grid(shape, WEIGHT_BLOCK)
                if tuple(data.shape) != shape or tuple(scale.shape) != grid or not data.is_contiguous():
                    return (f"weight sync: FP8 weight of {name} is {list(data.shape)} with scale_inv "
                            f"{list(scale.shape)}; the plan expects contiguous {list(shape)} with {list(grid)}")
                if data.device != self.device or scale.device != self.device:
                    return f"weight sync: FP8 weight of {name} is on {data.device}; the sync runs on {self.device}"
        if engine is not None:
            try:
                check_against_specs(engine.weight_specs(), self.engine_specs(), what="weight sync")
            except ValueError as e:
                return str(e)
        return None

    # ------------------------------------------------------------------ running

    def sync(self, sources: Mapping[str, Shard], engine: RolloutEngine, *, profile: bool = False,
             in_place: bool = True, kv_scales: Optional[torch.Tensor] = None) -> SyncReport:
        """One full transfer into ``engine``. With ``profile`` every phase is synchronised so the
        report attributes time to it (slightly slower). With ``in_place`` and an engine that offers
        ``weight_buffers()``, the copy kernels write straight into the engine's tensors (those whose
        shape, dtype, device and contiguity match); the rest go through ``update_weights``.
        ``kv_scales`` ([layers, 3]: q, k, v; every rank holds all) are the FP8 KV-cache scales the
        trainer measured this step; they go to the engine after the weights, under vLLM's names.

        ``check`` runs first on every call (one small all-reduce): nothing is written into the engine
        and no rank enters an exchange unless every rank's sources and engine match the plan."""
        report = SyncReport()
        start = time.perf_counter()
        self.check(sources, engine)
        direct = self._direct_buffers(engine) if in_place else {}
        report.in_place = len(direct)
        for tensors in self.iter_rounds(sources, report=report, profile=profile, direct=direct):
            if not tensors:
                continue
            t0 = time.perf_counter()
            engine.update_weights(tensors)
            self._sync_device(profile)
            report.seconds["load"] += time.perf_counter() - t0
        if kv_scales is not None:
            names = kv_scale_names(self.plan.bridge.dims.num_layers)
            if tuple(kv_scales.shape) != (len(names) // 3, 3):
                raise WeightMismatch(f"kv_scales has shape {list(kv_scales.shape)}; the model has "
                                     f"{len(names) // 3} layers x (q, k, v)")
            engine.update_weights(list(zip(names, kv_scales.flatten().unbind(0), strict=True)))
        self._sync_device(True)
        report.seconds["total"] = time.perf_counter() - start
        return report

    def iter_rounds(self, sources: Mapping[str, Shard], *, report: Optional[SyncReport] = None,
                    profile: bool = False, direct: Optional[Mapping[str, torch.Tensor]] = None,
                    ) -> Iterable[list[tuple[str, torch.Tensor]]]:
        """This rank's engine tensors of each round (those not written in place into ``direct``)."""
        report = report if report is not None else SyncReport()
        for i in range(len(self.rounds)):
            send, outs = self.pack(i, sources, report=report, profile=profile, direct=direct)
            t0 = time.perf_counter()
            received = self._exchange(i, send)
            self._sync_device(profile)
            report.seconds["exchange"] += time.perf_counter() - t0
            yield self.unpack(i, received, outs, report=report, profile=profile, direct=direct)

    def pack(self, i: int, sources: Mapping[str, Shard], *, report: SyncReport, profile: bool = False,
             direct: Optional[Mapping[str, torch.Tensor]] = None):
        """Launch 1 of round ``i``: send buffers per peer, and this rank's own pieces in place."""
        rnd = self.rounds[i]
        direct = direct or {}
        t0 = time.perf_counter()
        send = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in rnd.send_bytes]
        # a re-quantized tensor is assembled in the model dtype first, never in the engine's FP8 buffer
        outs = [direct[name] if name in direct and not t.requantize else self._alloc(shape, kind)
                for t in rnd.mine for name, shape, kind in _outputs(t)]
        srcs = [self._source(sources, name, kind) for name, kind in rnd.sources]
        if rnd.pack_table.shape[0]:
            self.copy(srcs, send + outs, rnd.pack_table)
        self._sync_device(profile)
        report.seconds["pack"] += time.perf_counter() - t0
        report.sent_bytes += sum(rnd.send_bytes)
        return dict(zip(rnd.peers_out, send, strict=True)), outs

    def unpack(self, i: int, received: Mapping[int, torch.Tensor], outs: list[torch.Tensor], *, report: SyncReport,
               profile: bool = False, direct: Optional[Mapping[str, torch.Tensor]] = None,
               ) -> list[tuple[str, torch.Tensor]]:
        """Launch 2 of round ``i`` and the re-quantization: the round's named engine tensors (those
        not already written in place into ``direct``)."""
        rnd = self.rounds[i]
        direct = direct or {}
        t0 = time.perf_counter()
        if rnd.unpack_table.shape[0]:
            self.copy([received[p] for p in rnd.peers_in], outs, rnd.unpack_table)
        self._sync_device(profile)
        report.seconds["unpack"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        named, k = [], 0
        for t in rnd.mine:
            made = outs[k : k + len(_outputs(t))]
            k += len(made)
            produced = self._requantize(t, made[0]) if t.fp8 and t.requantize else [
                (name, out) for (name, _, _), out in zip(_outputs(t), made, strict=True)]
            for name, out in produced:
                report.engine_bytes += out.numel() * out.element_size()
                if name not in direct:
                    named.append((name, out))
                elif direct[name] is not out:
                    direct[name].copy_(out)
        self._sync_device(profile)
        report.seconds["requantize"] += time.perf_counter() - t0
        report.tensors += len(rnd.mine)
        report.rounds += 1
        return named

    # --------------------------------------------------------------- internals

    def _requantize(self, t: EngineTensor, dense: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        f = self.plan.recipe.fp8
        q, _ = quantize_128x128(dense, pow2_scales=f.pow2_scales, eps=f.amax_epsilon)
        return [(t.name, q.data), (t.scale_name, q.scale_inv)]

    def _alloc(self, shape: tuple[int, ...], kind: str) -> torch.Tensor:
        dtype = {"dense": self.dense_dtype, "data": torch.float8_e4m3fn, "scale": torch.float32}[kind]
        return torch.empty(shape, dtype=dtype, device=self.device)

    @staticmethod
    def _source(sources: Mapping[str, Shard], name: str, kind: str) -> torch.Tensor:
        shard = sources[name]
        if kind == "dense":
            return shard.dense
        return shard.fp8.data if kind == "data" else shard.fp8.scale_inv.contiguous()

    def _exchange(self, i: int, send: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        rnd = self.rounds[i]
        recv = {p: torch.empty(n, dtype=torch.uint8, device=self.device)
                for p, n in zip(rnd.peers_in, rnd.recv_bytes, strict=True)}
        ops = [dist.P2POp(dist.isend, buf, p, self.group) for p, buf in send.items()]
        ops += [dist.P2POp(dist.irecv, buf, p, self.group) for p, buf in recv.items()]
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        return recv

    def _direct_buffers(self, engine: RolloutEngine) -> dict[str, torch.Tensor]:
        """The engine's tensors the kernels may write in place: those matching this rank's engine
        specs in shape and dtype, contiguous, on the sync's device."""
        specs = self.engine_specs()
        return {name: t for name, t in engine.weight_buffers().items()
                if name in specs and tuple(t.shape) == tuple(specs[name].shape) and t.dtype == specs[name].dtype
                and t.is_contiguous() and t.device == self.device}

    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend(self.group) == "nccl" else torch.device("cpu")

    def _sync_device(self, enabled: bool) -> None:
        if enabled and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _shard_shape(self, name: str) -> tuple[int, ...]:
        """A train rank's shard of Megatron tensor ``name`` (1-D tensors as [n, 1])."""
        shape = self.plan.bridge.shard_shape(self._spec_by_name[name], self.plan.train.tp)
        return shape if len(shape) == 2 else (shape[0], 1)

    def _build_round(self, indices: range) -> _Round:
        """Segment tables of one round: pack (local sources -> send buffers + own outputs) and
        unpack (received buffers -> own outputs)."""
        rnd = _Round(mine=[self.mine[i] for i in indices])
        pack_rows: list[list[int]] = []
        unpack_rows: list[list[int]] = []
        src_ids: dict[tuple[str, str], int] = {}

        def src_id(name: str, kind: str) -> int:
            key = (name, "dense" if kind == "dense" else kind)
            if key not in src_ids:
                src_ids[key] = len(src_ids)
                rnd.sources.append(key)
            return src_ids[key]

        def src_region(name: str, t: EngineTensor, part: _Part) -> tuple[int, int, int, int]:
            shard = self._shard_shape(name)
            cols = shard[1]
            if part.kind == "scale":
                cols = -(-cols // BLOCK)
            return _region(t.dim, cols, part.src_start, part.length, part.other, part.itemsize)

        out_index, k = [], 0
        for t in rnd.mine:
            out_index.append(k)
            k += len(_outputs(t))
        n_peers_out: dict[int, int] = {}

        # sends: every peer's tensors of this round, pieces sourced here, in the wire order (only
        # ranks of this rank's data-parallel replica read from it)
        for peer in self._replica_peers:
            cursor = 0
            for i in indices:
                t = self.plan_tensors(peer)[i]
                for p in t.pieces:
                    if p.src_rank != self.rank:
                        continue
                    for part in _parts(t, p, self.dense_itemsize):
                        if peer not in n_peers_out:
                            n_peers_out[peer] = len(rnd.peers_out)
                            rnd.peers_out.append(peer)
                            rnd.send_bytes.append(0)
                        off, stride, row_bytes, rows = src_region(p.src, t, part)
                        pack_rows.append([src_id(p.src, part.kind), off, stride, n_peers_out[peer], cursor,
                                          row_bytes, row_bytes, rows])
                        cursor += part.nbytes
            if peer in n_peers_out:
                rnd.send_bytes[n_peers_out[peer]] = cursor
        n_send = len(rnd.peers_out)

        # receives and local pieces into this rank's outputs
        cursors: dict[int, int] = {}
        peer_index: dict[int, int] = {}
        for j, t in enumerate(rnd.mine):
            for p in t.pieces:
                for part_no, part in enumerate(_parts(t, p, self.dense_itemsize)):
                    out_id = out_index[j] + part_no
                    dst_cols = (t.scale_shape if part.kind == "scale" else t.shape)
                    dst_cols = dst_cols[1] if len(dst_cols) == 2 else 1
                    d_off, d_stride, row_bytes, rows = _region(t.dim, dst_cols, part.dst_start, part.length,
                                                               part.other, part.itemsize)
                    if p.src_rank == self.rank:
                        s_off, s_stride, _, _ = src_region(p.src, t, part)
                        pack_rows.append([src_id(p.src, part.kind), s_off, s_stride, n_send + out_id, d_off,
                                          d_stride, row_bytes, rows])
                        continue
                    if p.src_rank not in peer_index:
                        peer_index[p.src_rank] = len(rnd.peers_in)
                        rnd.peers_in.append(p.src_rank)
                        cursors[p.src_rank] = 0
                    unpack_rows.append([peer_index[p.src_rank], cursors[p.src_rank], row_bytes, out_id, d_off,
                                        d_stride, row_bytes, rows])
                    cursors[p.src_rank] += part.nbytes
        rnd.recv_bytes = [cursors[p] for p in rnd.peers_in]
        rnd.pack_table = torch.tensor(pack_rows, dtype=torch.long).reshape(-1, 8)
        rnd.unpack_table = torch.tensor(unpack_rows, dtype=torch.long).reshape(-1, 8)
        return rnd

    def plan_tensors(self, rank: int) -> list[EngineTensor]:
        """The plan's tensors of ``rank`` (computed once per peer)."""
        if rank not in self._tensors_by_rank:
            self._tensors_by_rank[rank] = self.plan.tensors(rank)
        return self._tensors_by_rank[rank]
