"""Run checkpoints: atomic publication, pruning, crash recovery, and exact RNG resume (one process;
tests/dist/test_run_checkpoints_dist.py runs the protocol with a real barrier)."""

import errno
import json
import os
import random

import numpy as np
import pytest
import torch

from megatron_jetrl.config import ConfigError
from megatron_jetrl.job import load_job
from megatron_jetrl.runtime import (
    COMPLETE, LATEST, RunCheckpoints, RunSaveError, load_rng, rng_fingerprint, rng_path, save_json_atomic, save_rng,
    write_atomic,
)
from megatron_jetrl.runtime import run_checkpoints as checkpoints_module


def _ckpts(tmp_path, keep_last=3):
    return RunCheckpoints(tmp_path, keep_last=keep_last, rank=0, world_size=1, barrier=lambda: None)


def _save(ck, step, payload="x"):
    return ck.save(step, lambda staging: (staging / "trainer_state.json").write_text(
        json.dumps({"step": step, "payload": payload})), any_rank=bool)


class Killed(BaseException):
    """The process dies here: not an error ``save`` handles (it cleans up nothing), as a kill."""


def _killed(*_args, **_kwargs):
    raise Killed


def _state(path):
    return json.loads((path / "trainer_state.json").read_text())


def test_save_publishes_atomically_and_updates_latest(tmp_path):
    ck = _ckpts(tmp_path)
    assert ck.latest() is None
    seen = []

    def write(staging):
        seen.append((staging, staging.is_dir(), list(staging.iterdir())))
        (staging / "trainer_state.json").write_text("{}")
        seen.append(ck.latest())  # staging is never a checkpoint

    final = ck.save(10, write, any_rank=bool)
    staging = tmp_path / "checkpoints" / "step_00000010.tmp"
    assert seen == [(staging, True, []), None]
    assert final == tmp_path / "checkpoints" / "step_00000010"
    assert not staging.exists()
    assert json.loads((final / COMPLETE).read_text())["step"] == 10
    assert (tmp_path / "checkpoints" / LATEST).read_text().strip() == "step_00000010"
    assert ck.latest() == final and ck.step_of(final) == 10


def test_keep_last_prunes_oldest(tmp_path):
    ck = _ckpts(tmp_path, keep_last=2)
    for step in (1, 2, 3, 4):
        _save(ck, step)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == [LATEST, "step_00000003", "step_00000004"]
    assert ck.latest().name == "step_00000004"


def test_save_replaces_a_stale_staging_dir(tmp_path):
    ck = _ckpts(tmp_path)
    stale = tmp_path / "checkpoints" / "step_00000005.tmp"
    stale.mkdir(parents=True)
    (stale / "half_written").write_text("junk")
    seen = []
    ck.save(5, lambda staging: seen.append(list(staging.iterdir())), any_rank=bool)
    assert seen == [[]]


def test_a_kill_while_writing_resumes_from_last_complete(tmp_path):
    ck = _ckpts(tmp_path)
    _save(ck, 1, "good")
    staging = tmp_path / "checkpoints" / "step_00000002.tmp"

    def write(directory):
        (directory / "trainer_state.json").write_text("{half")
        raise Killed  # the process dies here; a new one starts

    with pytest.raises(Killed):
        ck.save(2, write, any_rank=bool)
    ck2 = _ckpts(tmp_path)
    assert ck2.latest().name == "step_00000001"
    assert _state(ck2.latest())["payload"] == "good"
    removed = ck2.clean_stale()
    assert [p.name for p in removed] == ["step_00000002.tmp"]
    assert not staging.exists()
    assert _save(ck2, 2, "again").name == "step_00000002"
    assert _state(ck2.latest())["payload"] == "again"


def test_a_kill_while_publishing_before_the_rename(tmp_path, monkeypatch):
    ck = _ckpts(tmp_path)
    _save(ck, 1)
    monkeypatch.setattr(checkpoints_module.os, "rename", _killed)
    with pytest.raises(Killed):
        _save(ck, 2)
    monkeypatch.undo()
    assert (tmp_path / "checkpoints" / "step_00000002.tmp" / COMPLETE).is_file()  # marker written, not published
    assert ck.latest().name == "step_00000001"
    ck.clean_stale()
    assert ck.latest().name == "step_00000001"


def test_a_kill_after_the_rename_before_the_pointer_then_saved_again(tmp_path, monkeypatch):
    ck = _ckpts(tmp_path)
    _save(ck, 1, "one")
    monkeypatch.setattr(checkpoints_module, "write_atomic", _killed)
    with pytest.raises(Killed):
        _save(ck, 2)
    monkeypatch.undo()
    # step 2 is complete but unannounced: the pointer (valid) still leads to step 1
    assert (tmp_path / "checkpoints" / "step_00000002" / COMPLETE).is_file()
    assert ck.latest().name == "step_00000001"
    # resuming from step 1 and saving step 2 again replaces the unannounced one
    final = _save(ck, 2, "two")
    assert _state(final)["payload"] == "two" and ck.latest() == final
    assert not any(p.name.endswith(".tmp") for p in (tmp_path / "checkpoints").iterdir())


@pytest.mark.parametrize("pointer", [None, "garbage\n", "step_00000009\n", "../../etc\n", "step_00000003\n"])
def test_latest_falls_back_to_scan_when_pointer_is_broken(tmp_path, pointer):
    ck = _ckpts(tmp_path)
    _save(ck, 1)
    _save(ck, 2)
    (tmp_path / "checkpoints" / "step_00000003").mkdir()  # incomplete: no COMPLETE marker
    (tmp_path / "checkpoints" / "step_00000004.tmp").mkdir()
    (tmp_path / "checkpoints" / "step_00000004.tmp" / COMPLETE).write_text("{}")
    latest = tmp_path / "checkpoints" / LATEST
    if pointer is None:
        latest.unlink()
    else:
        latest.write_text(pointer)
    assert ck.latest().name == "step_00000002"


@pytest.mark.parametrize("pointer, problem", [
    (b"\xff\xfestep_00000002\n", "cannot be read ('utf-8' codec can't decode byte 0xff"),
    (b"garbage\n", "names 'garbage', not a complete step directory"),
])
def test_unusable_pointer_is_named_in_one_warning_and_the_newest_complete_one_used(tmp_path, caplog, pointer,
                                                                                    problem):
    ck = _ckpts(tmp_path)
    _save(ck, 1)
    _save(ck, 2)
    latest = tmp_path / "checkpoints" / LATEST
    latest.write_bytes(pointer)
    with caplog.at_level("WARNING", logger="megatron_jetrl.runtime.run_checkpoints"):
        assert ck.latest().name == "step_00000002"
        assert [p.name for p in ck.candidates()] == ["step_00000002", "step_00000001"]
    assert len(caplog.records) == 1  # once, though a resume asks twice
    assert caplog.records[0].getMessage().startswith(f"{latest} {problem}")
    assert caplog.records[0].getMessage().endswith("falling back to the newest complete checkpoint: step_00000002")
    for step in (1, 2):
        (ck.step_dir(step) / COMPLETE).unlink()
    caplog.clear()
    with caplog.at_level("WARNING", logger="megatron_jetrl.runtime.run_checkpoints"):
        assert ck.latest() is None and ck.candidates() == []
    assert caplog.records[0].getMessage().endswith("falling back to the newest complete checkpoint: there is none")
    caplog.clear()
    other_rank = RunCheckpoints(tmp_path, keep_last=3, rank=1, world_size=2, barrier=lambda: None)
    with caplog.at_level("WARNING", logger="megatron_jetrl.runtime.run_checkpoints"):
        assert other_rank.latest() is None
    assert not caplog.records  # rank 0 says it for all


def test_pointer_rolled_back_by_hand_is_followed_and_the_abandoned_future_pruned(tmp_path):
    ck = _ckpts(tmp_path, keep_last=5)
    for step in (1, 2, 3):
        _save(ck, step)
    (tmp_path / "checkpoints" / LATEST).write_text("step_00000001\n")
    assert ck.latest().name == "step_00000001"
    _save(ck, 2, "new timeline")
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == [LATEST, "step_00000001", "step_00000002"]
    assert _state(ck.latest())["payload"] == "new timeline"


def test_constructor_validates(tmp_path):
    with pytest.raises(ValueError, match="keep_last"):
        RunCheckpoints(tmp_path, keep_last=0, rank=0, world_size=1, barrier=lambda: None)
    with pytest.raises(ValueError, match="rank"):
        RunCheckpoints(tmp_path, keep_last=1, rank=2, world_size=2, barrier=lambda: None)
    with pytest.raises(ValueError, match="step"):
        _ckpts(tmp_path).save(-1, lambda staging: None, any_rank=bool)


def test_non_zero_rank_only_writes_waits_and_reads(tmp_path):
    calls, agreed = [], []
    ck = RunCheckpoints(tmp_path, keep_last=1, rank=1, world_size=2, barrier=lambda: calls.append(1))
    seen = []
    final = ck.save(1, lambda staging: seen.append(staging.exists()),
                    any_rank=lambda flag: agreed.append(flag) or flag)
    assert seen == [False] and agreed == [False, False, False]  # rank 0 makes and publishes it
    assert final == ck.step_dir(1) and not (tmp_path / "checkpoints").exists()
    assert ck.clean_stale() == [] and calls == [1]


def test_save_json_atomic_and_write_atomic(tmp_path):
    path = tmp_path / "state.json"
    save_json_atomic(path, {"b": 1, "a": [1.5, float("nan")]})
    back = json.loads(path.read_text())
    assert back["b"] == 1 and back["a"][0] == 1.5 and back["a"][1] != back["a"][1]
    write_atomic(path, b"raw")
    assert path.read_bytes() == b"raw"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # no temp file left behind


def _draw():
    return (
        [random.random() for _ in range(3)], random.gauss(0, 1),
        np.random.rand(3).tolist(), float(np.random.randn()),
        torch.rand(4).tolist(), torch.randint(0, 1000, (3,)).tolist(), torch.randn(2).tolist(),
    )


def test_rng_round_trip_restores_the_same_next_numbers(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    _draw()  # leave the generators mid-stream, with cached Gaussians
    path = save_rng(tmp_path, rank=3)
    assert path == rng_path(tmp_path, 3) == tmp_path / "rng" / "rank_00003.pt"
    fingerprint = rng_fingerprint()
    expected = _draw()
    assert rng_fingerprint() != fingerprint
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    load_rng(tmp_path, rank=3)
    assert rng_fingerprint() == fingerprint
    assert _draw() == expected


def test_rng_file_loads_with_weights_only_and_missing_rank_is_named(tmp_path):
    save_rng(tmp_path, 0)
    state = torch.load(rng_path(tmp_path, 0), weights_only=True)
    assert set(state) >= {"python", "numpy", "torch"}
    with pytest.raises(FileNotFoundError, match="rank 1"):
        load_rng(tmp_path, 1)
    assert not any(p.name.endswith(".tmp") for p in (tmp_path / "rng").iterdir())
    assert os.listdir(tmp_path / "rng") == ["rank_00000.pt"]


# ------------------------------------------------------------------ save: failures agreed across ranks


def _no_space(staging):
    (staging / "actor").mkdir()
    (staging / "actor" / "part").write_bytes(b"x" * 4096)
    raise OSError(errno.ENOSPC, "No space left on device", str(staging / "actor" / "part"))


def _hidden_no_space(staging):
    """How torch.distributed.checkpoint reports it: each rank's error wrapped, not chained."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    try:
        _no_space(staging)
    except OSError as e:
        raise CheckpointException("save failed", {0: _wrap_exception(e)}) from None


@pytest.mark.parametrize("write", [_no_space, _hidden_no_space], ids=["ENOSPC", "in-CheckpointException"])
def test_a_full_disk_at_save_is_one_line_and_keeps_the_last_checkpoint(tmp_path, write):
    ck = _ckpts(tmp_path)
    _save(ck, 1, payload="kept")
    with pytest.raises(RunSaveError) as e:
        ck.save(2, write, any_rank=bool)
    message = str(e.value)
    assert "\n" not in message and e.value.local
    assert message.startswith(f"no space left on device while saving the checkpoint of step 2 in {tmp_path}")
    assert "4 KiB written, removed" in message and "continue from step_00000001" in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [LATEST, "step_00000001"]
    assert _state(ck.latest())["payload"] == "kept"


def test_an_unwritable_file_at_save_names_it(tmp_path):
    ck = _ckpts(tmp_path)

    def write(staging):
        raise PermissionError(errno.EACCES, "Permission denied", str(staging / "rng"))

    with pytest.raises(RunSaveError, match=r"cannot write .*step_00000004.tmp/rng \(Permission denied\); nothing "
                                           r"of it was kept: make run.dir writable, then run the same command to "
                                           r"start over"):
        ck.save(4, write, any_rank=bool)
    assert ck.latest() is None and not ck._staging(4).exists()


def test_a_failure_on_another_rank_stops_this_one_too(tmp_path):
    """This rank wrote its part; another did not (``any_rank`` says so): the staging directory is
    removed by rank 0 and this rank raises too, saying the other rank's log has the cause."""
    ck = _ckpts(tmp_path)
    _save(ck, 1)
    with pytest.raises(RunSaveError, match="failed on another rank .*continue from step_00000001") as e:
        ck.save(2, lambda staging: (staging / "part").write_text("x"), any_rank=lambda flag: True)
    assert not e.value.local and not ck._staging(2).exists() and ck.latest() == ck.step_dir(1)


def test_a_bug_in_the_writer_is_raised_as_it_is(tmp_path):
    ck = _ckpts(tmp_path)

    def write(staging):
        raise KeyError("sampler")

    with pytest.raises(KeyError, match="sampler"):
        ck.save(2, write, any_rank=bool)
    assert not ck._staging(2).exists()


def test_a_full_disk_while_publishing_leaves_no_staging_dir(tmp_path, monkeypatch):
    ck = _ckpts(tmp_path)
    _save(ck, 1)

    def full(path, obj):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoints_module, "save_json_atomic", full)  # COMPLETE cannot be written
    with pytest.raises(RunSaveError, match="no space left on device while saving the checkpoint of step 2"):
        ck.save(2, lambda staging: (staging / "part").write_text("x"), any_rank=bool)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [LATEST, "step_00000001"]


def test_a_latest_that_is_a_directory_is_refused_before_the_run_and_at_save(tmp_path):
    ck = _ckpts(tmp_path)
    (tmp_path / "checkpoints" / LATEST).mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"checkpoints/latest is a directory, where jetrl keeps the name of the "
                                          r"newest checkpoint: move it away"):
        ck.resume_point(True)
    with pytest.raises(ConfigError, match="is a directory"):
        ck.save(1, lambda staging: None, any_rank=bool)
    with pytest.raises(ConfigError, match="is a directory") as e:  # what jetrl check and train ask first
        load_job("examples/configs/tiny_countdown.yaml", [f"run.dir={tmp_path}"]).run.check_dir()
    assert e.value.key == "run.dir"
