"""The headline figures in docs/results/headline.json: one object per key with the value, the device
it was measured on, the command that measured it and the date. Benchmarks write them; nobody types
them. Values keep five significant digits (a KL of 2.3e-7 stays 2.3e-7).

    update(path, {"vllm_sync_8b_s": 0.021}, device="NVIDIA H100 80GB HBM3", command="...")

The file is read, updated and written back atomically (other keys are kept).
"""

from __future__ import annotations

import datetime
import json
import math
import os
from pathlib import Path
from typing import Mapping


def update(path: str | Path, values: Mapping[str, float], *, device: str, command: str) -> dict:
    """Set ``values`` (finite numbers) in the headline file at ``path``; returns the whole file."""
    path = Path(path)
    data = json.loads(path.read_text()) if path.is_file() else {}
    date = datetime.date.today().isoformat()
    for key, value in values.items():
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"headline {key}: {value!r} is not a finite number")
        data[key] = {"value": float(f"{float(value):.5g}"), "device": device, "command": command, "date": date}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(dict(sorted(data.items())), indent=1) + "\n")
    os.replace(tmp, path)
    return data
