"""An actor checkpoint is saved into an empty directory: megatron-core warns "Overwriting old
incomplete / corrupted checkpoint..." whenever it saves into one that holds anything. Its save
needs CUDA (it stages tensors on the device), so here it is replaced by one that records what the
directory held when megatron was called and writes a file as it would."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing import ShardedTensor

from megatron_jetrl.actor import state


class _Part:
    def __init__(self, tensors=None):
        self.tensors = tensors or {}

    def sharded_state_dict(self, *args, **kwargs):
        return {k: ShardedTensor.from_rank_offsets(k, t) for k, t in self.tensors.items()}

    def state_dict(self):
        return {"lr": 1.0}


@pytest.fixture
def process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_saving_twice_never_warns_of_an_incomplete_checkpoint(tmp_path, process_group, monkeypatch):
    held = []

    def megatron_save(sharded, directory, **kwargs):
        held.append(sorted(p.name for p in Path(directory).iterdir()))
        assert set(sharded) == {"model", "optimizer", "scheduler", "steps", "extra"}
        (Path(directory) / "metadata.json").write_text("{}")

    monkeypatch.setattr(state.dist_checkpointing, "save", megatron_save)
    actor = SimpleNamespace(bridge=SimpleNamespace(hf_config={"model_type": "qwen3"}),
                            gpt=_Part({"w": torch.arange(8, dtype=torch.float32)}),
                            optimizer=_Part(), scheduler=_Part(), steps=1)
    out = tmp_path / "actor"
    state.save_actor(actor, out, extra={"a": 1})
    actor.steps = 2
    state.save_actor(actor, out, extra={"a": 2})
    assert held == [[], []]
    assert (out / "metadata.json").is_file()
    assert json.loads((out / state.STATE_FILE).read_text())["steps"] == 2
    assert json.loads((out / state.HF_DIR / "config.json").read_text()) == {"model_type": "qwen3"}
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("actor")) == ["actor"]
