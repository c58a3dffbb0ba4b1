"""megatron-core distributed checkpoints of a bridged model, written and read without GPTModel.

The checkpoint holds exactly the ShardedTensors GPTModel's ``sharded_state_dict()`` produces, so a
model built at any TP/PP (local or Transformer Engine layer spec) loads it:

- decoder tensors share one key per kind, ``decoder.layers.<name>``, with the layer index as a
  prepended axis of size num_layers (a pipeline stage reads its own layers' slices);
- ``linear_fc1`` goes through megatron's own SwiGLU factory, which stores gate and up so that each
  TP size gets its [gate_r; up_r];
- embedding and output layer allow a shape mismatch, so the vocab padding (128 here, 128 x TP in
  the model) is reconciled on load;
- the modules' ``_extra_state`` entries GPTModel requests are stored empty.

Reading back goes one checkpoint key (all layers of it) at a time; writing is one save of the
whole model (megatron-core's writer takes the full state dict).

Next to the tensors, ``hf/`` keeps the source config.json and tokenizer files.
"""

from __future__ import annotations

import json
import os
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

from megatron_jetrl.models import ModelBridge, TensorSpec, bridge_for
from megatron_jetrl.models.fp8_export import check_fp8_exportable, fp8_hf_config, to_fp8_block
from megatron_jetrl.models.hf_checkpoint import (
    CheckpointError,
    HFCheckpoint,
    ShardedSafetensorsWriter,
    TOKENIZER_FILES,
)
from megatron_jetrl.precision import PrecisionRecipe

HF_DIR = "hf"
LAYER_PREFIX = "decoder.layers."
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


def extra_state_objects(bridge: ModelBridge) -> dict[str, ShardedObject]:
    """The (empty) ``_extra_state`` entries GPTModel requests with either layer spec."""
    n = bridge.dims.num_layers
    modules = _LINEAR_MODULES + (_QK_NORM_MODULES if bridge.dims.qk_norm else ())
    objs = {
        f"{LAYER_PREFIX}{i}.{m}._extra_state": ShardedObject(f"{LAYER_PREFIX}{m}._extra_state", None, (n,), (i,),
                                                            replica_id=(0, 0, 0))
        for i in range(n)
        for m in modules
    }
    key = "decoder.final_layernorm._extra_state"
    objs[key] = ShardedObject(key, None, (1,), (0,), replica_id=(0, 0, 0))
    return objs


@contextmanager
def single_process_group() -> Iterator[None]:
    """dist_checkpointing needs torch.distributed: a one-process gloo group unless one exists."""
    created = not torch.distributed.is_initialized()
    if created:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    _cpu_only_torch_workarounds()
    try:
        yield
    finally:
        if created:
            torch.distributed.destroy_process_group()


def _cpu_only_torch_workarounds() -> None:
    """megatron-core 0.16's torch_dist writer assumes CUDA: it synchronizes the device after staging
    tensors and broadcasts its failure flag from a CUDA tensor. On a CPU-only torch (a login node,
    CI) both raise, so the converter replaces exactly those two steps with CPU equivalents."""
    if torch.cuda.is_available():
        return
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from torch.distributed.checkpoint import CheckpointException
    from torch.distributed.checkpoint.utils import _get_failure_dict

    preload = FileSystemWriterAsync.preload_tensors
    if getattr(preload, "_jetrl_cpu", False):
        return

    def preload_tensors(write_buckets, non_blocking=True):
        return preload(write_buckets, non_blocking=False)

    preload_tensors._jetrl_cpu = True
    FileSystemWriterAsync.preload_tensors = staticmethod(preload_tensors)

    def save_state_dict_async_finalize(storage_writer, global_metadata, dist_wrapper):
        results = dist_wrapper.gather_object(storage_writer.retrieve_write_results())
        failures = {}
        if dist_wrapper.is_coordinator:
            failures = _get_failure_dict(results)
            if not failures:
                storage_writer.finish(global_metadata, results)
        flag = torch.tensor([int(bool(failures))], dtype=torch.int)
        torch.distributed.broadcast(flag, src=dist_wrapper.coordinator_rank, group=dist_wrapper.group)
        if flag.item():
            raise CheckpointException("write", failures)

    mcore_torch.save_state_dict_async_finalize = save_state_dict_async_finalize


def _progress(enabled: bool, total: int, description: str):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        disable=not enabled)
    return progress, progress.add_task(description, total=total)


def save_hf_as_megatron(bridge: ModelBridge, hf: HFCheckpoint, out: Path, *, progress: bool = False) -> None:
    """Write ``hf``'s weights as a megatron-core checkpoint into the (empty) directory ``out``."""
    specs = bridge.tensor_map()
    for spec in specs:
        for name in spec.hf:
            if name not in hf:
                raise CheckpointError(f"HF checkpoint {hf.path} has no tensor {name!r} (needed for {spec.megatron})")
    n = bridge.dims.num_layers
    state = dict(extra_state_objects(bridge))
    bar, task = _progress(progress, len(specs), f"converting {bridge.architecture}")
    with bar:
        for spec in specs:
            state[spec.megatron] = sharded_tensor(spec, bridge.to_megatron(spec, hf.get).contiguous(), n)
            bar.advance(task)
    with single_process_group():
        dist_checkpointing.save(state, str(out))
    (out / HF_DIR).mkdir()
    (out / HF_DIR / "config.json").write_text(json.dumps(hf.config, indent=2) + "\n")
    hf.copy_side_files(out / HF_DIR)


def _load_full(ckpt: Path, bridge: ModelBridge, specs: list[TensorSpec], meta: dict) -> dict[str, torch.Tensor]:
    """Full (TP=1) tensors of ``specs``, which must cover whole checkpoint keys (every layer of a
    key: megatron-core derives a key's shard layout from all its layers, so a single process can
    only read a key whole)."""
    request = {}
    for spec in specs:
        key = checkpoint_key(spec)
        if key not in meta:
            raise CheckpointError(f"checkpoint {ckpt} has no tensor {key!r} (needed for {spec.megatron})")
        want = (bridge.dims.num_layers, *spec.shape) if spec.layer is not None else spec.shape
        if tuple(meta[key].global_shape) != want and not (spec.fuse == "vocab" and spec.layer is None):
            raise CheckpointError(f"checkpoint {ckpt} tensor {key!r} has shape {tuple(meta[key].global_shape)}; "
                                  f"{bridge.architecture} with its config.json needs {want}")
        request[spec.megatron] = sharded_tensor(spec, torch.empty(spec.shape, dtype=meta[key].dtype),
                                                bridge.dims.num_layers)
    return dist_checkpointing.load(request, str(ckpt))


def read_megatron_as_hf(
    ckpt_dir: str | os.PathLike,
    out: Path,
    *,
    fp8_recipe: PrecisionRecipe | None = None,
    max_shard_bytes: int = 5 * 2**30,
    progress: bool = False,
) -> None:
    """Write the checkpoint at ``ckpt_dir`` as an HF checkpoint into ``out``, one checkpoint key (all
    its layers) in memory at a time; with ``fp8_recipe``, linear weights are exported as block FP8."""
    ckpt = Path(ckpt_dir)
    config_path = ckpt / HF_DIR / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{ckpt} has no {HF_DIR}/config.json; was it written by convert_hf_to_megatron?")
    hf_config = json.loads(config_path.read_text())
    bridge = bridge_for(hf_config)
    if fp8_recipe is not None:
        check_fp8_exportable(bridge, fp8_recipe)
    by_key: dict[str, list[TensorSpec]] = {}
    for spec in bridge.tensor_map():
        by_key.setdefault(checkpoint_key(spec), []).append(spec)
    with single_process_group():
        meta = dist_checkpointing.load_tensors_metadata(str(ckpt))
        writer = ShardedSafetensorsWriter(out, max_shard_bytes)
        bar, task = _progress(progress, len(by_key), f"exporting {bridge.architecture}")
        with bar:
            for specs in by_key.values():
                full = _load_full(ckpt, bridge, specs, meta)
                tensors = (item for spec in specs for item in bridge.to_hf(spec, full.pop(spec.megatron)).items())
                if fp8_recipe is not None:
                    tensors = to_fp8_block(bridge, fp8_recipe, tensors)
                for name, t in tensors:
                    writer.add(name, t)
                del full
                bar.advance(task)
        writer.finish()
    config = fp8_hf_config(bridge, fp8_recipe, hf_config) if fp8_recipe is not None else hf_config
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (ckpt / HF_DIR / name).is_file():
            (out / name).write_bytes((ckpt / HF_DIR / name).read_bytes())
