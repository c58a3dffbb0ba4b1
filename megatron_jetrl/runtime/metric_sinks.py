"""Where per-step metrics go: ``metrics.jsonl`` always, TensorBoard and Weights & Biases on request.

Only rank 0 writes: other ranks build ``MetricsLogger(..., enabled=False)``, which does nothing.

``metrics.jsonl`` holds one strict-JSON object per logged step, ``{"step", "time", **metrics}``.
JSON has no NaN or infinity, so a non-finite value is written as ``null`` and named in a
``"nonfinite"`` object, e.g. ``{"loss": null, "nonfinite": {"loss": "nan"}}`` (``"inf"``/``"-inf"``
likewise); TensorBoard and W&B receive the float as it is.

Resuming: pass ``start_step`` (the step of the checkpoint resumed from, 0 for a fresh start in an
existing run directory). Lines with a later step are dropped from ``metrics.jsonl``, TensorBoard is
told to purge its events from ``start_step + 1`` on, and W&B continues the run whose id is kept in
``run_dir/wandb_id`` (W&B ignores steps it already has, with a warning).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from megatron_jetrl.config import ConfigError, check_integer
from megatron_jetrl.runtime.atomic import write_atomic

WANDB_MODES = ("online", "offline", "disabled")
_RESERVED = ("step", "time", "nonfinite")


def _optional_name(key: str, value) -> None:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ConfigError(key, value, "must be a non-empty string or null")


@dataclass(frozen=True)
class WandbSettings:
    """Weights & Biases: used when ``project`` is set and ``mode`` is not ``disabled``.
    ``offline`` writes the run under ``run_dir/wandb`` for a later ``wandb sync``."""

    project: Optional[str] = None
    entity: Optional[str] = None
    name: Optional[str] = None
    mode: str = "online"

    def __post_init__(self) -> None:
        for key in ("project", "entity", "name"):
            _optional_name(f"log.wandb.{key}", getattr(self, key))
        if self.mode not in WANDB_MODES:
            raise ConfigError("log.wandb.mode", self.mode, f"must be one of {WANDB_MODES}")

    @property
    def active(self) -> bool:
        return self.project is not None and self.mode != "disabled"


@dataclass(frozen=True)
class LogSettings:
    """The ``log`` section: console view on/off, TensorBoard on/off, W&B, and ``every``: the
    trainer logs a step (console line, metrics.jsonl, TensorBoard, W&B) every ``every`` steps, and
    always the last step, a step with an evaluation and the step a stop signal ends the run with."""

    console: bool = True
    tensorboard: bool = True
    wandb: WandbSettings = field(default_factory=WandbSettings)
    every: int = 1

    def __post_init__(self) -> None:
        for key in ("console", "tensorboard"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"log.{key}", getattr(self, key), "must be true or false")
        if not isinstance(self.wandb, WandbSettings):
            raise ConfigError("log.wandb", self.wandb, "must be a WandbSettings")
        check_integer("log.every", self.every, minimum=1)


def _finite_or_null(metrics: Mapping[str, float]) -> dict[str, Any]:
    row: dict[str, Any] = {}
    nonfinite: dict[str, str] = {}
    for key, value in metrics.items():
        if math.isfinite(value):
            row[key] = value
        else:
            row[key] = None
            nonfinite[key] = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if nonfinite:
        row["nonfinite"] = nonfinite
    return row


class MetricsLogger:
    """Per-step metrics to ``run_dir/metrics.jsonl``, ``run_dir/tensorboard/`` and W&B.

    ``config`` is the resolved job config (a plain dict) recorded with the W&B run. A requested
    sink whose package is missing fails here, naming the key that asked for it.
    """

    def __init__(self, run_dir: Path, *, tensorboard: bool = True, wandb: Optional[WandbSettings] = None,
                 enabled: bool = True, start_step: int = 0, config: Optional[Mapping[str, Any]] = None):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        self._wandb_run = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.truncate_after(start_step)
        if tensorboard:
            self._tb = self._open_tensorboard(start_step)
        if wandb is not None and wandb.active:
            self._wandb_run = self._open_wandb(wandb, config)

    def _open_tensorboard(self, start_step: int):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ConfigError("log.tensorboard", True, "needs the tensorboard package: pip install tensorboard "
                              "(or set log.tensorboard=false)") from e
        tb_dir = self.run_dir / "tensorboard"
        resumed = tb_dir.is_dir() and any(tb_dir.iterdir())
        return SummaryWriter(str(tb_dir), purge_step=start_step + 1 if resumed else None)

    def _open_wandb(self, settings: WandbSettings, config: Optional[Mapping[str, Any]]):
        try:
            import wandb
        except ImportError as e:
            raise ConfigError("log.wandb.project", settings.project, "needs the wandb package: pip install wandb "
                              "(or unset log.wandb.project, or set log.wandb.mode=disabled)") from e
        id_file = self.run_dir / "wandb_id"
        if id_file.is_file():
            run_id = id_file.read_text(encoding="utf-8").strip()
        else:
            run_id = uuid.uuid4().hex[:16]
            write_atomic(id_file, run_id + "\n")
        return wandb.init(project=settings.project, entity=settings.entity, name=settings.name,
                          mode=settings.mode, dir=str(self.run_dir), config=dict(config or {}),
                          resume="allow", id=run_id)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record ``metrics`` at ``step``. Values must convert with ``float()`` (Python numbers,
        0-d tensors, numpy scalars); ``step``/``time``/``nonfinite`` are reserved names."""
        if not self.enabled:
            return
        values: dict[str, float] = {}
        for key, value in metrics.items():
            if key in _RESERVED:
                raise ValueError(f"metric name {key!r} is reserved in metrics.jsonl ({_RESERVED})")
            try:
                values[key] = float(value)
            except (TypeError, ValueError) as e:
                raise TypeError(f"metric {key!r}: {value!r} is not a number") from e
        row = {"step": int(step), "time": time.time(), **_finite_or_null(values)}
        self._jsonl.write(json.dumps(row, allow_nan=False) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(values, step=int(step))

    def truncate_after(self, step: int) -> None:
        """Atomically drop the ``metrics.jsonl`` lines whose step is greater than ``step``, and any
        line a crash left unparseable (a torn last line)."""
        if not self.enabled:
            return
        if self._jsonl is not None:
            self._jsonl.close()
        if self.path.is_file():
            kept = []
            with open(self.path, encoding="utf-8") as f:
                for line in f:
                    try:
                        if json.loads(line)["step"] <= step:
                            kept.append(line if line.endswith("\n") else line + "\n")
                    except (ValueError, KeyError, TypeError):
                        continue
            write_atomic(self.path, "".join(kept))
        self._jsonl = open(self.path, "a", encoding="utf-8")

    def close(self) -> None:
        """Flush and close every sink (finishes the W&B run)."""
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
