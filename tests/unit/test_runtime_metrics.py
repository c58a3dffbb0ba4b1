"""Metric sinks: metrics.jsonl (strict JSON, truncation on resume), TensorBoard, W&B, settings."""

import json
import sys
import types

import numpy as np
import pytest
import torch

from megatron_jetrl.config import ConfigError
from megatron_jetrl.runtime import LogSettings, MetricsLogger, WandbSettings


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_jsonl_rows_are_strict_json_with_nonfinite_named(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        log.log(1, {"reward": 0.5, "len": torch.tensor(17.0), "kl": np.float32(0.25)})
        log.log(2, {"loss": float("nan"), "grad_norm": float("inf"), "x": -float("inf"), "ok": 1})
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    strict = dict(parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))
    rows = [json.loads(line, **strict) for line in text.splitlines()]
    assert rows[0]["step"] == 1 and rows[0]["reward"] == 0.5 and rows[0]["len"] == 17.0 and rows[0]["kl"] == 0.25
    assert isinstance(rows[0]["time"], float) and "nonfinite" not in rows[0]
    assert rows[1]["loss"] is None and rows[1]["grad_norm"] is None and rows[1]["ok"] == 1.0
    assert rows[1]["nonfinite"] == {"loss": "nan", "grad_norm": "inf", "x": "-inf"}


def test_log_rejects_reserved_names_and_non_numbers(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        with pytest.raises(ValueError, match="reserved"):
            log.log(1, {"step": 3.0})
        with pytest.raises(TypeError, match="'name'"):
            log.log(1, {"name": "abc"})


def test_truncate_after_drops_later_steps_and_torn_lines(tmp_path):
    log = MetricsLogger(tmp_path, tensorboard=False)
    for step in range(1, 6):
        log.log(step, {"v": float(step)})
    log.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "v": 6.0')  # killed mid-line
    log = MetricsLogger(tmp_path, tensorboard=False)  # start_step=0: a fresh start drops everything
    assert _rows(tmp_path) == []
    for step in range(1, 6):
        log.log(step, {"v": float(step)})
    log.truncate_after(3)
    log.log(4, {"v": 40.0})
    log.close()
    assert [(r["step"], r["v"]) for r in _rows(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


def test_resume_start_step_truncates(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        for step in range(1, 6):
            log.log(step, {"v": float(step)})
    with MetricsLogger(tmp_path, tensorboard=False, start_step=2) as log:
        log.log(3, {"v": 30.0})
    assert [(r["step"], r["v"]) for r in _rows(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_disabled_logger_touches_nothing(tmp_path):
    run_dir = tmp_path / "run"
    log = MetricsLogger(run_dir, tensorboard=True, wandb=WandbSettings(project="p"), enabled=False)
    log.log(1, {"a": 1.0})
    log.truncate_after(0)
    log.close()
    assert not run_dir.exists()


def _scalars(tb_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return [(e.step, round(e.value, 6)) for e in acc.Scalars(tag)]


def test_tensorboard_scalars_are_readable_and_purged_on_resume(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard not installed")
    with MetricsLogger(tmp_path) as log:
        for step in range(1, 5):
            log.log(step, {"rollout/reward": step / 10})
    assert _scalars(tmp_path / "tensorboard", "rollout/reward") == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]
    with MetricsLogger(tmp_path, start_step=2) as log:
        log.log(3, {"rollout/reward": 3.0})
    assert _scalars(tmp_path / "tensorboard", "rollout/reward") == [(1, 0.1), (2, 0.2), (3, 3.0)]


def test_missing_tensorboard_names_the_key(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match=r"log\.tensorboard.*pip install tensorboard"):
        MetricsLogger(tmp_path, tensorboard=True)


def test_missing_wandb_names_the_key(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match=r"log\.wandb\.project.*pip install wandb"):
        MetricsLogger(tmp_path, tensorboard=False, wandb=WandbSettings(project="jetrl"))
    MetricsLogger(tmp_path, tensorboard=False, wandb=WandbSettings()).close()  # no project: wandb not asked for
    MetricsLogger(tmp_path, tensorboard=False, wandb=WandbSettings(project="p", mode="disabled")).close()


class _FakeRun:
    def __init__(self, kwargs):
        self.kwargs, self.logged, self.finished = kwargs, [], False

    def log(self, values, step):
        self.logged.append((step, values))

    def finish(self):
        self.finished = True


def test_wandb_run_id_persists_across_resume(tmp_path, monkeypatch):
    runs = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: runs.append(_FakeRun(kwargs)) or runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    settings = WandbSettings(project="jetrl", entity="team", name="tiny", mode="offline")
    with MetricsLogger(tmp_path, tensorboard=False, wandb=settings, config={"seed": 1}) as log:
        log.log(1, {"loss": float("nan")})
    with MetricsLogger(tmp_path, tensorboard=False, wandb=settings, start_step=1) as log:
        log.log(2, {"loss": 0.5})
    first, second = runs
    assert first.kwargs == dict(project="jetrl", entity="team", name="tiny", mode="offline", dir=str(tmp_path),
                                config={"seed": 1}, resume="allow", id=first.kwargs["id"])
    assert second.kwargs["id"] == first.kwargs["id"] == (tmp_path / "wandb_id").read_text().strip()
    assert first.finished and second.finished
    assert np.isnan(first.logged[0][1]["loss"]) and second.logged == [(2, {"loss": 0.5})]


def test_settings_defaults_and_validation():
    s = LogSettings()
    assert s.console and s.tensorboard and s.every == 1 and s.wandb == WandbSettings() and not s.wandb.active
    assert WandbSettings(project="p").active
    for kwargs, key in [
        (dict(every=0), "log.every"), (dict(every=True), "log.every"), (dict(console="yes"), "log.console"),
        (dict(tensorboard=1), "log.tensorboard"), (dict(wandb={"project": "p"}), "log.wandb"),
    ]:
        with pytest.raises(ConfigError) as e:
            LogSettings(**kwargs)
        assert e.value.key == key
    for kwargs, key in [(dict(mode="cloud"), "log.wandb.mode"), (dict(project=""), "log.wandb.project"),
                        (dict(entity=3), "log.wandb.entity")]:
        with pytest.raises(ConfigError) as e:
            WandbSettings(**kwargs)
        assert e.value.key == key


def test_settings_field_types_are_plain_for_the_yaml_loader():
    import typing

    hints = typing.get_type_hints(LogSettings)
    assert hints == {"console": bool, "tensorboard": bool, "wandb": WandbSettings, "every": int}
    assert typing.get_type_hints(WandbSettings)["project"] == typing.Optional[str]
