"""HF <-> megatron-core conversion: distributed checkpoints of a bridged model's weights, written
and read without GPTModel (``tools/convert_*.py``; the actor's own state is ``state.py``).

The checkpoint holds exactly the ShardedTensors GPTModel's ``sharded_state_dict()`` produces, so a
model built at any TP/PP (local or Transformer Engine layer spec) loads it:

- decoder tensors share one key per kind, ``decoder.layers.<name>``, with the layer index as a
  prepended axis of size num_layers (a pipeline stage reads its own layers' slices);
- ``linear_fc1`` goes through megatron's own SwiGLU factory, which stores gate and up so that each
  TP size gets its [gate_r; up_r];
- embedding and output layer allow a shape mismatch, so the vocab padding (128 here, 128 x TP in
  the model) is reconciled on load;
- the modules' ``_extra_state`` objects GPTModel requests are stored empty (``[None]``).

Writing streams: megatron-core's own writer resolves every tensor before writing any, so the
converter writes the same on-disk format (torch.distributed.checkpoint files, ``common.pt``,
``metadata.json``) through DCP with a planner that converts each chunk only when it is written:
one decoder layer's tensor per key, and the vocab tensors in row blocks. Reading back reads one
layer's slice of every key at a time, straight through DCP (any chunking the writer used, e.g.
the actor's per-TP-rank pieces, is resolved by DCP's chunk overlap).

Next to the tensors, ``hf/`` keeps the source config.json and tokenizer files.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_jetrl.models import ModelBridge, TensorSpec, bridge_for
from megatron_jetrl.models.fp8_export import (
    SCALE_SUFFIX,
    check_fp8_exportable,
    fp8_hf_config,
    fp8_plan,
    to_fp8_block,
)
from megatron_jetrl.config import HfCheckpointError, MegatronCheckpointError
from megatron_jetrl.models.hf_checkpoint import (
    HFCheckpoint,
    TOKENIZER_FILES,
    StreamingSafetensorsWriter,
    read_json,
)
from megatron_jetrl.precision import PrecisionRecipe

HF_DIR = "hf"
LAYER_PREFIX = "decoder.layers."
VOCAB_CHUNK_BYTES = 64 * 2**20
"""Row-block size of the embedding / output layer when streamed (a decoder layer's order)."""
WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Dtypes a model tensor may have in either checkpoint; the conversion keeps each tensor's dtype."""
DCP_METADATA = ".metadata"
"""torch.distributed.checkpoint's index of a checkpoint: every key's shape, dtype and byte range."""
DAMAGED = "the checkpoint is damaged or incomplete: save it again, or convert another step's checkpoint"
MCORE_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                  "common_backend": "torch", "common_backend_version": 1}
_LINEAR_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
_QK_NORM_MODULES = ("self_attention.q_layernorm", "self_attention.k_layernorm")


def checkpoint_key(spec: TensorSpec) -> str:
    """``decoder.layers.3.mlp.linear_fc2.weight`` -> ``decoder.layers.mlp.linear_fc2.weight``."""
    if spec.layer is None:
        return spec.megatron
    return LAYER_PREFIX + spec.megatron[len(f"{LAYER_PREFIX}{spec.layer}.") :]


def sharded_tensor(spec: TensorSpec, local: torch.Tensor, num_layers: int, tp_rank: int = 0, tp_size: int = 1):
    """The ShardedTensor (or SwiGLU factory) megatron-core builds for ``spec`` on one TP rank."""
    key = checkpoint_key(spec)
    if spec.layer is None:
        if spec.tp_dim is None:
            return ShardedTensor.from_rank_offsets(key, local, replica_id=(0, tp_rank, 0))
        return ShardedTensor.from_rank_offsets(
            key, local, (spec.tp_dim, tp_rank, tp_size), replica_id=(0, 0, 0), allow_shape_mismatch=True
        )
    layer_axis = (0, spec.layer, num_layers)
    if spec.tp_dim is None:
        return ShardedTensor.from_rank_offsets(key, local, layer_axis, replica_id=(0, tp_rank, 0), prepend_axis_num=1)
    sh = ShardedTensor.from_rank_offsets(
        key, local, layer_axis, (spec.tp_dim + 1, tp_rank, tp_size), replica_id=(0, 0, 0), prepend_axis_num=1
    )
    return apply_swiglu_sharded_factory(sh, (layer_axis,)) if spec.fuse == "fc1" else sh


def _extra_state_keys(bridge: ModelBridge) -> list[str]:
    """Storage keys of the (empty) ``_extra_state`` objects GPTModel requests with either layer spec:
    megatron-core stores a ShardedObject under ``<key>/shard_<offset>_<global shape>``."""
    n = bridge.dims.num_layers
    modules = _LINEAR_MODULES + (_QK_NORM_MODULES if bridge.dims.qk_norm else ())
    keys = [f"{LAYER_PREFIX}{m}._extra_state/shard_{i}_{n}" for i in range(n) for m in modules]
    return keys + ["decoder.final_layernorm._extra_state/shard_0_1"]


class _Chunk:
    """One stored chunk of a checkpoint key, produced on demand."""

    def __init__(self, key: str, global_shape: tuple[int, ...], offset: tuple[int, ...], shape: tuple[int, ...],
                 dtype: torch.dtype, produce: Callable[[], torch.Tensor]):
        self.key, self.global_shape, self.offset, self.shape = key, global_shape, offset, shape
        self.dtype, self.produce = dtype, produce


class _StreamingPlanner(DefaultSavePlanner):
    """Plans the write from chunk descriptions and converts each chunk only in ``resolve_data``,
    when DCP writes it, so memory holds about one chunk per key rather than the model."""

    def __init__(self, chunks: list[_Chunk], objects: list[str], on_chunk: Callable[[], None]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks = {(c.key, c.offset): c for c in chunks}
        self.objects = objects
        self.on_chunk = on_chunk

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in self.objects]
        for c in self.chunks.values():
            items.append(WriteItem(
                index=MetadataIndex(c.key, torch.Size(c.offset)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(c.offset), sizes=torch.Size(c.shape)),
                    properties=TensorProperties(dtype=c.dtype),
                    size=torch.Size(c.global_shape),
                ),
            ))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save([None], buf)  # megatron-core stores a list of the objects' data
            return buf
        chunk = self.chunks[(write_item.index.fqn, tuple(write_item.index.offset))]
        data = chunk.produce()
        if tuple(data.shape) != chunk.shape or data.dtype != chunk.dtype:
            raise MegatronCheckpointError(f"{chunk.key}: produced {tuple(data.shape)} {data.dtype}, planned "
                                  f"{chunk.shape} {chunk.dtype}")
        self.on_chunk()
        return data


def _chunks(bridge: ModelBridge, hf: HFCheckpoint) -> list[_Chunk]:
    n = bridge.dims.num_layers
    chunks = []
    for spec in bridge.tensor_map():
        dtype = hf.dtype(spec.hf[0])
        key = checkpoint_key(spec)
        if spec.layer is not None:
            chunks.append(_Chunk(key, (n, *spec.shape), (spec.layer,) + (0,) * len(spec.shape), (1, *spec.shape),
                                 dtype, lambda s=spec: bridge.to_megatron(s, hf.get).unsqueeze(0).contiguous()))
        elif spec.fuse == "vocab":
            rows, width = spec.shape
            step = max(1, VOCAB_CHUNK_BYTES // (width * dtype.itemsize))
            for r0 in range(0, rows, step):
                r1 = min(rows, r0 + step)
                chunks.append(_Chunk(key, spec.shape, (r0, 0), (r1 - r0, width), dtype,
                                     lambda s=spec, a=r0, b=r1: _vocab_rows(bridge, hf, s, a, b)))
        else:
            chunks.append(_Chunk(key, spec.shape, (0,) * len(spec.shape), spec.shape, dtype,
                                 lambda s=spec: bridge.to_megatron(s, hf.get).contiguous()))
    return chunks


def _vocab_rows(bridge: ModelBridge, hf: HFCheckpoint, spec: TensorSpec, r0: int, r1: int) -> torch.Tensor:
    """Rows [r0, r1) of the padded embedding / output layer, reading only those rows."""
    name, vocab = spec.hf[0], bridge.dims.vocab_size
    real = hf.get(name, rows=(r0, min(r1, vocab))) if r0 < vocab else None
    pad = r1 - max(r0, vocab)
    if pad <= 0:
        return real
    zeros = torch.zeros(pad, spec.shape[1], dtype=hf.dtype(name))
    return zeros if real is None else torch.cat([real, zeros])


def check_hf_sources(bridge: ModelBridge, hf: HFCheckpoint) -> None:
    """Every HF tensor the bridge reads exists, has its shape and a ``WEIGHT_DTYPES`` dtype shared by
    the tensors fused with it; from the safetensors headers, before any data is read. FP8 sources
    are refused: their codes would be copied as if they were weights, without their scales."""
    for spec in bridge.tensor_map():
        for name in spec.hf:
            if name not in hf:
                raise HfCheckpointError(f"HF checkpoint {hf.path} has no tensor {name!r} (needed for {spec.megatron})")
        bridge.check_sources(spec, hf.shape)
        dtypes = {name: hf.dtype(name) for name in spec.hf}
        for name, dtype in dtypes.items():
            if dtype.is_floating_point and dtype.itemsize == 1:
                scale = name + SCALE_SUFFIX
                found = (f": {hf.path} is an FP8 checkpoint (with block scales {scale}). FP8 sources are" if scale in hf
                         else f" and its {scale} is missing: {hf.path} is an FP8 checkpoint without its scales "
                         "(an incomplete copy?). FP8 sources, with or without scales, are")
                raise HfCheckpointError(
                    f"HF tensor {name} is {_dtype_name(dtype)}{found} not supported (their weights are already "
                    "quantized): convert from the BF16 checkpoint the FP8 one was made from")
            if dtype not in WEIGHT_DTYPES:
                raise HfCheckpointError(
                    f"HF tensor {name} in {hf.path / hf.weight_map[name]} is {_dtype_name(dtype)}; "
                    f"{bridge.architecture} needs a floating-point tensor there ({_weight_dtype_names()}): the file is "
                    "corrupt or not this model's weights; convert from the original BF16 checkpoint")
        if len(set(dtypes.values())) > 1:
            found = ", ".join(f"{name} {_dtype_name(d)}" for name, d in dtypes.items())
            raise HfCheckpointError(f"HF tensors fused into {spec.megatron} differ in dtype ({found}); save the "
                                  "checkpoint in one dtype (e.g. bfloat16) and convert that")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _weight_dtype_names() -> str:
    """``WEIGHT_DTYPES`` for a message: "bfloat16, float16 or float32"."""
    *head, last = map(_dtype_name, WEIGHT_DTYPES)
    return f"{', '.join(head)} or {last}"


def _dcp(operation: Callable[[], None]) -> None:
    """Run a torch.distributed.checkpoint save or load and raise what failed in it, not the
    ``CheckpointException`` DCP wraps it in (whose message is a traceback per rank): with
    ``no_dist`` there is one rank, so one failure, whose ``__context__`` (e.g. a full disk behind a
    torch.save error) stays as it was."""
    try:
        operation()
        return
    except CheckpointException as e:
        failures = list(e.failures.values())
        if len(failures) != 1:
            raise
        failure = failures[0][0]
    raise failure


def save_hf_as_megatron(bridge: ModelBridge, hf: HFCheckpoint, out: Path, *, progress: bool = False) -> None:
    """Write ``hf``'s weights as a megatron-core checkpoint into the (empty) directory ``out``,
    converting one chunk at a time (see the module docstring); sources are checked first
    (``check_hf_sources``)."""
    check_hf_sources(bridge, hf)
    chunks = _chunks(bridge, hf)
    bar, task = _progress(progress, len(chunks), f"converting {bridge.architecture}")
    with bar:
        planner = _StreamingPlanner(chunks, _extra_state_keys(bridge), on_chunk=lambda: bar.advance(task))
        writer = dcp.FileSystemWriter(str(out), single_file_per_rank=True, thread_count=1)
        _dcp(lambda: dcp.save({}, storage_writer=writer, planner=planner, no_dist=True))
    torch.save({}, out / "common.pt")
    (out / "metadata.json").write_text(json.dumps(MCORE_METADATA))
    (out / HF_DIR).mkdir()
    (out / HF_DIR / "config.json").write_text(json.dumps(hf.config, indent=2) + "\n")
    hf.copy_side_files(out / HF_DIR)


def _progress(enabled: bool, total: int, description: str):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        disable=not enabled)
    return progress, progress.add_task(description, total=total)


class _SliceLoadPlanner(DefaultLoadPlanner):
    """Reads a rectangular slice of each requested checkpoint key into a given buffer."""

    def __init__(self, requests: dict[str, tuple[tuple[int, ...], torch.Tensor]]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.requests = requests

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, (offset, dest) in self.requests.items():
            chunk = ChunkStorageMetadata(offsets=torch.Size(offset), sizes=dest.size())
            items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [chunk])
        return LoadPlan(items)

    def resolve_tensor(self, read_item):
        view = self.requests[read_item.dest_index.fqn][1]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, read_item, tensor) -> None:
        dest = self.resolve_tensor(read_item)
        if tensor.data_ptr() != dest.data_ptr():
            dest.copy_(tensor)


def check_checkpoint_shapes(ckpt: Path, bridge: ModelBridge, meta) -> None:
    """Every key the bridge needs is stored with the model's shape (the vocab may be padded more)."""
    for spec in bridge.tensor_map():
        key = checkpoint_key(spec)
        md = meta.state_dict_metadata.get(key)
        if md is None or not hasattr(md, "size"):
            raise MegatronCheckpointError(f"checkpoint {ckpt} has no tensor {key!r} (needed for {spec.megatron})")
        stored = tuple(md.size)
        want = (bridge.dims.num_layers, *spec.shape) if spec.layer is not None else spec.shape
        vocab_ok = spec.fuse == "vocab" and stored[1:] == want[1:] and stored[0] >= want[0]
        if stored != want and not vocab_ok:
            raise MegatronCheckpointError(f"checkpoint {ckpt} tensor {key!r} has shape {stored}; "
                                  f"{bridge.architecture} with its config.json needs {want}")


def check_checkpoint_metadata(ckpt: Path, bridge: ModelBridge) -> None:
    """``check_checkpoint_shapes`` from ``ckpt``'s metadata (``_read_metadata``: its data files
    present and long enough; no tensor is read); a ``MegatronCheckpointError`` otherwise."""
    check_checkpoint_shapes(ckpt, bridge, _read_metadata(ckpt))


def _read_metadata(ckpt: Path) -> Metadata:
    """``ckpt``'s DCP metadata, with every data file it points into present and long enough; a
    missing or damaged file is a ``CheckpointError`` naming it, before anything is converted."""
    path = ckpt / DCP_METADATA
    if not path.is_file():
        raise MegatronCheckpointError(f"{path} is missing: {DAMAGED}")
    try:
        meta = dcp.FileSystemReader(str(ckpt)).read_metadata()
    except Exception as e:  # an unpickler's failures have any type
        raise MegatronCheckpointError(f"{path} cannot be read ({_one_line(e)}): {DAMAGED}") from None
    if not isinstance(meta, Metadata):
        raise MegatronCheckpointError(f"{path} holds a {type(meta).__name__}, not checkpoint metadata: {DAMAGED}")
    needed: dict[str, int] = {}
    for info in meta.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(needed.items()):
        data = ckpt / name
        if not data.is_file():
            raise MegatronCheckpointError(f"{data} is missing (listed in {path}): {DAMAGED}")
        size = data.stat().st_size
        if size < end:
            raise MegatronCheckpointError(f"{data} is truncated ({size} bytes; {path} needs {end}): {DAMAGED}")
    return meta


def _one_line(error: Exception) -> str:
    """``error`` for a one-line message: its type and the first line of its text."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def _read_slices(ckpt: Path, specs: list[TensorSpec], meta) -> dict[str, torch.Tensor]:
    """Full (TP=1) tensors of ``specs`` (one layer's, or the non-layer ones), reading only their
    slice of each checkpoint key (checked by ``check_checkpoint_shapes``)."""
    requests, out = {}, {}
    for spec in specs:
        key = checkpoint_key(spec)
        md = meta.state_dict_metadata[key]
        if spec.layer is None:
            out[spec.megatron] = torch.empty(spec.shape, dtype=md.properties.dtype)
            requests[key] = ((0,) * len(spec.shape), out[spec.megatron])
        else:
            buf = torch.empty((1, *spec.shape), dtype=md.properties.dtype)
            requests[key] = ((spec.layer,) + (0,) * len(spec.shape), buf)
            out[spec.megatron] = buf[0]
    try:
        _dcp(lambda: dcp.load({}, storage_reader=dcp.FileSystemReader(str(ckpt)),
                              planner=_SliceLoadPlanner(requests), no_dist=True))
    except Exception as e:  # torch.load of damaged bytes fails with any type
        files = sorted({str(ckpt / info.relative_path) for index, info in meta.storage_data.items()
                        if index.fqn in requests})
        raise MegatronCheckpointError(f"reading {', '.join(files)} failed ({_one_line(e)}): {DAMAGED}") from None
    return out


def read_megatron_as_hf(
    ckpt_dir: str | os.PathLike,
    out: Path,
    *,
    fp8_recipe: PrecisionRecipe | None = None,
    max_shard_bytes: int = 5 * 2**30,
    progress: bool = False,
) -> None:
    """Write the checkpoint at ``ckpt_dir`` as an HF checkpoint into ``out``, one layer in memory at a
    time; with ``fp8_recipe``, linear weights are exported as block FP8."""
    ckpt = Path(ckpt_dir)
    config_path = ckpt / HF_DIR / "config.json"
    if not config_path.is_file():
        raise MegatronCheckpointError(f"{ckpt} has no {HF_DIR}/config.json; was it written by convert_hf_to_megatron?")
    hf_config = read_json(config_path)
    bridge = bridge_for(hf_config)
    if fp8_recipe is not None:
        first, last, n = fp8_recipe.fp8.bf16_first_layers, fp8_recipe.fp8.bf16_last_layers, bridge.dims.num_layers
        if first + last > n:
            raise ValueError(f"--bf16-first-layers {first} plus --bf16-last-layers {last} exceed the checkpoint's "
                             f"{n} layers: keep at most {n} layers in BF16")
        check_fp8_exportable(bridge, fp8_recipe)
    groups: dict[int | None, list[TensorSpec]] = {}
    for spec in bridge.tensor_map():
        groups.setdefault(spec.layer, []).append(spec)
    meta = _read_metadata(ckpt)
    check_checkpoint_shapes(ckpt, bridge, meta)
    for spec in bridge.tensor_map():
        dtype = meta.state_dict_metadata[checkpoint_key(spec)].properties.dtype
        if dtype not in WEIGHT_DTYPES:
            raise MegatronCheckpointError(
                f"checkpoint {ckpt} stores {checkpoint_key(spec)!r} as {_dtype_name(dtype)}; model weights are "
                f"{_weight_dtype_names()}: convert it again from the BF16 HF checkpoint")
    plan = [(name, meta.state_dict_metadata[checkpoint_key(spec)].properties.dtype, shape)
            for specs in groups.values() for spec in specs
            for name, shape in zip(spec.hf, bridge.hf_shapes(spec), strict=True)]
    if fp8_recipe is not None:
        plan = list(fp8_plan(bridge, fp8_recipe, plan))
    bar, task = _progress(progress, len(groups), f"exporting {bridge.architecture}")
    with bar, StreamingSafetensorsWriter(out, plan, max_shard_bytes) as writer:
        for specs in groups.values():
            full = _read_slices(ckpt, specs, meta)
            tensors = (item for spec in specs for item in bridge.to_hf(spec, full.pop(spec.megatron)).items())
            if fp8_recipe is not None:
                tensors = to_fp8_block(bridge, fp8_recipe, tensors)
            for name, t in tensors:
                writer.add(name, t)
            bar.advance(task)
        writer.finish()
    config = fp8_hf_config(bridge, fp8_recipe, hf_config) if fp8_recipe is not None else hf_config
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (ckpt / HF_DIR / name).is_file():
            (out / name).write_bytes((ckpt / HF_DIR / name).read_bytes())
