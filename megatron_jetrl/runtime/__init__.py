"""What a long run needs around the RL step: checkpoints that resume exactly and are published
atomically, preemption signals agreed across ranks, metric sinks, the console view, phase timing.

Imports the standard library, torch, numpy, rich and ``megatron_jetrl.config`` only (TensorBoard
and W&B when a sink asks for them), so it loads and tests on a CPU machine.
"""

from megatron_jetrl.runtime.atomic import fsync_dir, save_json_atomic, write_atomic
from megatron_jetrl.runtime.run_checkpoints import COMPLETE, LATEST, RunCheckpoints, RunSaveError
from megatron_jetrl.runtime.console import ConsoleView, PhaseHandle, format_step_line
from megatron_jetrl.runtime.metric_sinks import LogSettings, MetricsLogger, WandbSettings
from megatron_jetrl.runtime.rng import load_rng, rng_fingerprint, rng_path, save_rng
from megatron_jetrl.runtime.signals import EXIT_PREEMPTED, PreemptionSignal, any_rank
from megatron_jetrl.runtime.timing import PhaseTimer

__all__ = [
    "COMPLETE", "EXIT_PREEMPTED", "LATEST", "ConsoleView", "LogSettings", "MetricsLogger", "PhaseHandle", "PhaseTimer",
    "PreemptionSignal", "RunCheckpoints", "RunSaveError", "WandbSettings", "any_rank", "format_step_line", "fsync_dir",
    "load_rng", "rng_fingerprint", "rng_path", "save_json_atomic", "save_rng", "write_atomic",
]
