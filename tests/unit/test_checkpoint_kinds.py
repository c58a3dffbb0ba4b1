"""The three checkpoints have an error type each, and ``jetrl`` names the kind in its one line."""

import pytest

from megatron_jetrl.config import CheckpointError, HfCheckpointError, MegatronCheckpointError, RunCheckpointError
from megatron_jetrl.models.hf_checkpoint import HFCheckpoint
from megatron_jetrl.runtime import RunCheckpoints


def test_each_checkpoint_raises_its_own_kind(tmp_path):
    (tmp_path / "hf").mkdir()
    with pytest.raises(HfCheckpointError):
        HFCheckpoint(tmp_path / "hf")  # no config.json, no safetensors

    from megatron_jetrl.actor.hf_conversion import check_checkpoint_metadata
    from megatron_jetrl.models import bridge_for
    from tests.model_fixtures import tiny_hf_model

    (tmp_path / "mg").mkdir()
    (tmp_path / "mg" / ".metadata").write_bytes(b"not a pickle")
    bridge = bridge_for(tiny_hf_model("Qwen3ForCausalLM", 2).config.to_dict())
    with pytest.raises(MegatronCheckpointError, match="cannot be read"):
        check_checkpoint_metadata(tmp_path / "mg", bridge)

    ckpts = RunCheckpoints(tmp_path / "run", 2, 0, 1, lambda: None)
    ckpts.save(1, lambda staging: None, any_rank=bool)
    with pytest.raises(RunCheckpointError, match="no checkpoint in"):
        ckpts.restore_newest(lambda c: (_ for _ in ()).throw(ValueError("broken")), any_rank=bool,
                             warn=lambda c, p: None)


def test_each_error_names_its_kind():
    assert [e("x").kind for e in (RunCheckpointError, MegatronCheckpointError, HfCheckpointError,
                                  CheckpointError)] == [
        "run checkpoint", "megatron checkpoint", "HF checkpoint", "checkpoint"]
