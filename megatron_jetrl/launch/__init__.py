"""Launching a job: where this process sits (``placement``: torchrun / srun / single, SLURM node
lists, the layout-per-node check, backend variables) and the launch path without the model
(``smoke``: ``jetrl train --smoke``, imported where used: it needs torch.distributed)."""

from megatron_jetrl.launch.placement import (
    BACKEND_DEFAULTS,
    LAUNCHERS,
    PORT_BASE,
    PORT_SPAN,
    LaunchError,
    Placement,
    apply_env,
    check_parallel_layout,
    detect,
    expand_nodelist,
    expand_tasks_per_node,
    free_port,
)

__all__ = ["BACKEND_DEFAULTS", "LAUNCHERS", "PORT_BASE", "PORT_SPAN", "LaunchError", "Placement", "apply_env",
           "check_parallel_layout", "detect", "expand_nodelist", "expand_tasks_per_node", "free_port"]
