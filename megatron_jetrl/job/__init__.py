"""The job: its config (``config``: every section, loaded and checked once, and ``resolve``: the
model, the layout and the memory plan for a world size) and the memory plan itself
(``estimate``)."""

from megatron_jetrl.job.config import (
    JobConfig,
    JobData,
    ModelSettings,
    Resolved,
    RunSettings,
    SftSettings,
    load_data,
    load_job,
    missing_inputs,
    resolve,
)

__all__ = ["JobConfig", "JobData", "ModelSettings", "Resolved", "RunSettings", "SftSettings", "load_data",
           "load_job", "missing_inputs", "resolve"]
