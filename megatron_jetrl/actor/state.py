"""The actor's state: model + optimizer + scheduler as one megatron-core distributed checkpoint
(inside a run checkpoint, ``runtime/run_checkpoints.py``; weight conversion is ``hf_conversion.py``).

- The model part is GPTModel's own ``sharded_state_dict()``, the same keys the conversion tools
  write and read, so ``tools/convert_megatron_to_hf.py`` exports an actor checkpoint directly.
- The optimizer part uses the DistributedOptimizer's ``fully_reshardable`` format (one state
  tensor per parameter, in model space), so a checkpoint loads at any TP / PP / DP.
- Scheduler state, step count and the caller's ``extra`` dict are common (non-sharded) state.
- ``hf/`` (config.json) is written next to it, as the converter does, so the tools recognise it.

Saving is atomic: everything goes to ``<dir>.tmp-<step>`` and is renamed to ``<dir>`` after every
rank finished; an existing ``<dir>`` is replaced only then.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing

from megatron_jetrl.actor.hf_conversion import HF_DIR, check_checkpoint_shapes
from megatron_jetrl.actor.build import use_fused_torch_adam
from megatron_jetrl.config import MegatronCheckpointError

if TYPE_CHECKING:
    from megatron_jetrl.models import ModelBridge


class CheckpointedActor(Protocol):
    """What a checkpoint reads and restores of an actor (``actor.Actor`` is one); a protocol, so
    this module does not import the actor that imports it."""

    bridge: "ModelBridge"
    gpt: torch.nn.Module
    optimizer: Any
    scheduler: Any
    steps: int

    def optimizers(self) -> list: ...

OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}
STATE_FILE = "jetrl_state.json"
"""Marks a full actor checkpoint (model + optimizer); a converted HF checkpoint has none."""


def _sharded_state(actor: CheckpointedActor, *, is_loading: bool, model_only: bool,
                   extra: Optional[dict] = None) -> dict:
    model_sd = actor.gpt.sharded_state_dict()
    state = {"model": model_sd}
    if not model_only:
        state["optimizer"] = actor.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                                metadata=OPTIMIZER_FORMAT)
        state["scheduler"] = actor.scheduler.state_dict()
        state["steps"] = actor.steps
        state["extra"] = extra or {}
    return state


def save_actor(actor: CheckpointedActor, directory: Path, *, extra: dict) -> None:
    rank = dist.get_rank()
    tmp = directory.with_name(f"{directory.name}.tmp-{actor.steps}")
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)  # empty: megatron warns of an "incomplete checkpoint" otherwise
    dist.barrier()
    state = _sharded_state(actor, is_loading=False, model_only=False, extra=extra)
    dist_checkpointing.save(state, str(tmp), validate_access_integrity=True)
    dist.barrier()
    if rank == 0:
        (tmp / HF_DIR).mkdir()
        (tmp / HF_DIR / "config.json").write_text(json.dumps(actor.bridge.hf_config, indent=2) + "\n")
        (tmp / STATE_FILE).write_text(json.dumps({"steps": actor.steps, "format": 1}) + "\n")
        old = directory.with_name(f"{directory.name}.old")
        if directory.exists():
            directory.rename(old)
        tmp.rename(directory)
        if old.exists():
            shutil.rmtree(old)
    dist.barrier()


def load_actor(actor: CheckpointedActor, directory: Path, *, model_only: Optional[bool]) -> dict:
    if not directory.is_dir():
        raise MegatronCheckpointError(f"no checkpoint directory at {directory}")
    has_state = (directory / STATE_FILE).is_file()
    if model_only is None:
        model_only = not has_state
    elif not model_only and not has_state:
        raise MegatronCheckpointError(f"{directory} holds model weights only (no {STATE_FILE}); load it with "
                                      "model_only=True")
    check_checkpoint_shapes(directory, actor.bridge, dcp.FileSystemReader(str(directory)).read_metadata())
    if not model_only:
        _init_empty_adam_state(actor)
    state = _sharded_state(actor, is_loading=True, model_only=model_only)
    loaded = dist_checkpointing.load(state, str(directory))
    actor.gpt.load_state_dict(loaded["model"], strict=True)
    if model_only:
        # The optimizer's fp32 master weights must follow the new parameters.
        actor.optimizer.reload_model_params()
        return {}
    with _torch_adam_step_fix(actor):
        actor.optimizer.load_state_dict(loaded["optimizer"])
    actor.scheduler.load_state_dict(loaded["scheduler"])
    actor.steps = int(loaded["steps"])
    return dict(loaded.get("extra") or {})


@contextlib.contextmanager
def _torch_adam_step_fix(actor: CheckpointedActor):
    """Work around megatron-core 0.16.1 loading a DistributedOptimizer checkpoint with torch's Adam
    (its fallback when neither apex nor TE is installed): ``load_state_dict`` first puts Adam's
    shared ``step`` into every parameter's state, then copies the checkpoint's per-parameter
    tensors into *each* state key, and the checkpoint has no per-parameter ``step``
    (``KeyError: 'step'``). Here the missing ``step`` is supplied as the value already restored
    from the param groups, so that copy is a no-op; everything else runs as megatron wrote it.
    Afterwards each parameter gets its own copy of the step (see below)."""
    patched = []
    for opt in actor.optimizers():
        if not isinstance(opt.optimizer, torch.optim.Adam) or not hasattr(opt, "model_param_group_index_map"):
            continue
        original = opt._set_main_param_and_optimizer_states

        def set_states(model_param, tensors, opt=opt, original=original):
            group_index, group_order = opt.model_param_group_index_map[model_param]
            state = opt.optimizer.state[opt.optimizer.param_groups[group_index]["params"][group_order]]
            if "step" in state and "step" not in tensors:
                tensors = {**tensors, "step": state["step"]}
            return original(model_param, tensors)

        opt._set_main_param_and_optimizer_states = set_states
        patched.append(opt)
    try:
        yield
    finally:
        use_fused_torch_adam(actor.optimizer)
        for opt in patched:
            del opt._set_main_param_and_optimizer_states
            # megatron hands every parameter the *same* step tensor; Adam increments each
            # parameter's step in place, so a shared one would advance once per parameter.
            # The fused Adam (see build.py) keeps it on the parameter's device.
            for group in opt.optimizer.param_groups:
                on_device = group.get("fused") or group.get("capturable")
                for p in group["params"]:
                    state = opt.optimizer.state.get(p, {})
                    if torch.is_tensor(state.get("step")):
                        state["step"] = state["step"].detach().to(
                            dtype=torch.float32, device=p.device if on_device else "cpu", copy=True)


def _init_empty_adam_state(actor: CheckpointedActor) -> None:
    """Give a fresh optimizer the state entries a loaded one has, so the checkpoint can be read
    into them. megatron's DistributedOptimizer reads each param's ``step`` when building its
    state dict; torch's Adam (used when neither apex nor TE is installed) creates state lazily at
    its first step, and megatron's own initialiser omits ``step``. Values are overwritten by the load."""
    for opt in actor.optimizers():
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if isinstance(inner, torch.optim.Adam) and "step" not in state:
                    on_device = group.get("fused") or group.get("capturable")
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")


__all__ = ["load_actor", "save_actor"]
