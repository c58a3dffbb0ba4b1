"""Where this process sits in the job, read from the launcher's environment, and the variables the
backends need set before they are imported.

One process per GPU, started by one of:

    torchrun      RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT
    srun          SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID, SLURM_STEP_NODELIST,
                  SLURM_STEP_TASKS_PER_NODE (one task per GPU: ``--ntasks-per-node`` = GPUs per
                  node); the rendezvous address is the step's first node, the port
                  ``MASTER_PORT`` or one derived from the job id, so every task computes the same
    nothing       a world of one on this host

``torchrun`` inside an ``srun`` (one torchrun per node) is read as torchrun: its variables win.
Started inside an ``sbatch`` script but outside ``srun`` with more than one task allocated is an
error, because the other ranks would never arrive.

Everything here is pure (an environment mapping in, a ``Placement`` or an error out) so that it is
tested without a cluster; ``cli.py`` applies the results to ``os.environ`` before torch.distributed,
Transformer Engine or vLLM read them. The package itself never reads these variables.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from typing import Mapping, MutableMapping, Optional

from megatron_jetrl.config import ConfigError
from megatron_jetrl.models import ParallelLayout

LAUNCHERS = ("torchrun", "srun", "single")
PORT_BASE, PORT_SPAN = 20000, 20000
"""srun's rendezvous port without MASTER_PORT: PORT_BASE + job id mod PORT_SPAN (below the
ephemeral range, different for consecutive jobs sharing a node)."""


class LaunchError(ConfigError):
    """The launcher's environment is missing a variable, or holds one that cannot be used."""

    def __init__(self, variable: str, got: object, allowed: str):
        super().__init__(f"environment:{variable}", got, allowed)


@dataclass(frozen=True)
class Placement:
    """This process's place: global rank in ``world_size``, ``local_rank`` among the
    ``local_world_size`` processes of its node (= the GPU it drives), node ``node_rank`` of
    ``num_nodes``, and the rendezvous every process of the job agrees on."""

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    job_id: Optional[str] = None
    restart_count: int = 0

    def __post_init__(self) -> None:
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"launcher must be one of {LAUNCHERS}, got {self.launcher!r}")
        if not 0 <= self.rank < self.world_size:
            raise LaunchError("RANK", self.rank, f"must be in [0, {self.world_size}) (WORLD_SIZE {self.world_size})")
        if not 0 <= self.local_rank < self.local_world_size:
            raise LaunchError("LOCAL_RANK", self.local_rank,
                              f"must be in [0, {self.local_world_size}) (processes on this node)")
        if not 0 <= self.node_rank < self.num_nodes:
            raise LaunchError("SLURM_NODEID or GROUP_RANK", self.node_rank,
                              f"must be in [0, {self.num_nodes}) (nodes in the job)")
        if self.local_world_size * self.num_nodes != self.world_size:
            raise LaunchError(
                "WORLD_SIZE", self.world_size,
                f"must equal nodes x processes per node ({self.num_nodes} x {self.local_world_size}): "
                "run the same number of processes (one per GPU) on every node")
        if not 0 < self.master_port < 65536:
            raise LaunchError("MASTER_PORT", self.master_port, "must be a TCP port in 1..65535")

    def torch_env(self) -> dict[str, str]:
        """The variables ``torch.distributed``'s ``env://`` rendezvous reads."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(self.local_world_size), "GROUP_RANK": str(self.node_rank),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}

    def describe(self) -> str:
        job = f", job {self.job_id}" + (f" (restart {self.restart_count})" if self.restart_count else "") \
            if self.job_id else ""
        return (f"{self.launcher}: {self.world_size} processes on {self.num_nodes} node(s) x {self.local_world_size}, "
                f"rendezvous {self.master_addr}:{self.master_port}{job}")


def detect(environ: Mapping[str, str]) -> Placement:
    """The placement of this process from its environment (see the module docstring)."""
    if "RANK" in environ or "WORLD_SIZE" in environ:
        return _from_torchrun(environ)
    if "SLURM_STEP_ID" in environ and _get(environ, "SLURM_STEP_ID") != "batch" and "SLURM_PROCID" in environ:
        return _from_srun(environ)
    if "SLURM_JOB_ID" in environ:
        tasks = _int(environ, "SLURM_NTASKS", default=1)
        if tasks > 1:
            raise LaunchError(
                "SLURM_STEP_ID", environ.get("SLURM_STEP_ID"),
                f"this process runs in the batch script of job {environ['SLURM_JOB_ID']} ({tasks} tasks) but not "
                "under srun: start it as `srun jetrl train ...` (one task per GPU) so every rank starts")
    return Placement("single", 0, 1, 0, 1, 0, 1, "127.0.0.1", free_port(),
                     job_id=environ.get("SLURM_JOB_ID"), restart_count=_int(environ, "SLURM_RESTART_COUNT", default=0))


def _from_torchrun(environ: Mapping[str, str]) -> Placement:
    world = _int(environ, "WORLD_SIZE", minimum=1)
    local_world = _int(environ, "LOCAL_WORLD_SIZE", default=world, minimum=1)
    if world % local_world:
        raise LaunchError("LOCAL_WORLD_SIZE", local_world, f"must divide WORLD_SIZE ({world})")
    return Placement(
        "torchrun", rank=_int(environ, "RANK"), world_size=world, local_rank=_int(environ, "LOCAL_RANK"),
        local_world_size=local_world, node_rank=_int(environ, "GROUP_RANK", default=0),
        num_nodes=world // local_world, master_addr=_get(environ, "MASTER_ADDR"),
        master_port=_int(environ, "MASTER_PORT"), job_id=environ.get("SLURM_JOB_ID"),
        restart_count=_int(environ, "SLURM_RESTART_COUNT", default=0))


def _from_srun(environ: Mapping[str, str]) -> Placement:
    world = (_int(environ, "SLURM_STEP_NUM_TASKS", default=None, minimum=1)
             or _int(environ, "SLURM_NTASKS", minimum=1))
    nodelist_var = "SLURM_STEP_NODELIST" if "SLURM_STEP_NODELIST" in environ else "SLURM_JOB_NODELIST"
    nodes = expand_nodelist(_get(environ, nodelist_var), nodelist_var)
    per_node_var = "SLURM_STEP_TASKS_PER_NODE" if "SLURM_STEP_TASKS_PER_NODE" in environ else "SLURM_TASKS_PER_NODE"
    per_node = expand_tasks_per_node(_get(environ, per_node_var), per_node_var)
    if len(per_node) != len(nodes):
        raise LaunchError(per_node_var, environ[per_node_var],
                          f"lists {len(per_node)} nodes but {nodelist_var} has {len(nodes)}")
    if len(set(per_node)) != 1:
        raise LaunchError(per_node_var, environ[per_node_var],
                          "every node must run the same number of tasks (one per GPU): "
                          "use --ntasks-per-node equal to the GPUs per node")
    if "MASTER_ADDR" in environ:
        master = _get(environ, "MASTER_ADDR")
    else:
        master = nodes[0]
    job_id = _get(environ, "SLURM_JOB_ID")
    if "MASTER_PORT" in environ:
        port = _int(environ, "MASTER_PORT")
    elif job_id.isdigit():
        port = PORT_BASE + int(job_id) % PORT_SPAN
    else:
        raise LaunchError("SLURM_JOB_ID", job_id, "is not numeric; set MASTER_PORT to pick the rendezvous port")
    return Placement(
        "srun", rank=_int(environ, "SLURM_PROCID"), world_size=world, local_rank=_int(environ, "SLURM_LOCALID"),
        local_world_size=per_node[0], node_rank=_int(environ, "SLURM_NODEID"), num_nodes=len(nodes),
        master_addr=master, master_port=port, job_id=job_id,
        restart_count=_int(environ, "SLURM_RESTART_COUNT", default=0))


def check_parallel_layout(num_nodes: int, per_node: int, parallel: ParallelLayout, rollout_tp: int) -> None:
    """Tensor-parallel groups stay inside a node (of ``per_node`` processes): their all-reduces
    run every layer and would crawl over the inter-node network. (TP x PP x DP = world is
    ``job.resolve``'s check.)"""
    if num_nodes == 1:
        return
    if per_node % parallel.tp:
        raise ConfigError("actor.parallel.tp", parallel.tp,
                          f"must divide the processes per node ({per_node}) so that no TP group spans nodes")
    if per_node % rollout_tp:
        raise ConfigError("rollout.vllm.tensor_parallel_size", rollout_tp,
                          f"must divide the processes per node ({per_node}) so that no engine spans nodes")


def apply_env(environ: MutableMapping[str, str], required: Mapping[str, str],
              defaults: Mapping[str, str] = {}) -> list[str]:
    """Set ``required`` variables (a different value already set is an error: the recipe and the
    environment would disagree) and ``defaults`` that are not set. Returns what was set."""
    changed = []
    for name, value in required.items():
        if name in environ and environ[name] != value:
            raise LaunchError(name, environ[name], f"the job needs {name}={value} (its precision recipe); "
                              "unset it or change the recipe")
        if name not in environ:
            changed.append(name)
        environ[name] = value
    for name, value in defaults.items():
        if name not in environ:
            environ[name] = value
            changed.append(name)
    return changed


BACKEND_DEFAULTS = {
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    # megatron's TP and sequence-parallel communication must be queued in issue order
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    # a failed collective tears the process down instead of hanging the job until the wall time
    "TOKENIZERS_PARALLELISM": "false",
    # the reward workers fork after the tokenizer was used
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    # the actor and a colocated engine take turns at the whole GPU: segments that grow and shrink in
    # place instead of fixed blocks the update cannot reuse (at the GPU's limit torch's allocator
    # then frees its cache, synchronizes and retries; vLLM's sleep-mode pool turns them off for itself)
}


# -- SLURM's compressed lists ------------------------------------------------------------------

_BRACKET = re.compile(r"\[([^\[\]]*)\]")


def expand_nodelist(text: str, variable: str = "SLURM_JOB_NODELIST") -> list[str]:
    """SLURM's hostlist syntax: ``gpu[001-003,007],login1`` -> gpu001 gpu002 gpu003 gpu007 login1
    (zero padding kept; several bracket groups in one name multiply out)."""
    names: list[str] = []
    for item in _split_top_level(text, variable):
        names.extend(_expand_host(item, text, variable))
    if not names:
        raise LaunchError(variable, text, "is empty; expected a SLURM node list such as gpu[01-04]")
    return names


def _split_top_level(text: str, variable: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if depth not in (0, 1):
            raise LaunchError(variable, text, "has unbalanced brackets; expected a list such as gpu[01-04,07]")
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise LaunchError(variable, text, "has unbalanced brackets; expected a list such as gpu[01-04,07]")
    items.append(text[start:])
    return [s.strip() for s in items if s.strip()]


def _expand_host(item: str, text: str, variable: str) -> list[str]:
    m = _BRACKET.search(item)
    if m is None:
        if "[" in item or "]" in item or not re.fullmatch(r"[A-Za-z0-9._-]+", item):
            raise LaunchError(variable, text, f"cannot parse {item!r} as a host name")
        return [item]
    head, tail = item[:m.start()], item[m.end():]
    out = []
    for part in m.group(1).split(","):
        part = part.strip()
        bounds = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if bounds is None:
            raise LaunchError(variable, text, f"cannot parse range {part!r} in {item!r}; expected e.g. [01-04,07]")
        lo, hi = bounds.group(1), bounds.group(2) or bounds.group(1)
        if int(hi) < int(lo):
            raise LaunchError(variable, text, f"range {part!r} runs backwards")
        width = len(lo) if lo.startswith("0") else 0
        for n in range(int(lo), int(hi) + 1):
            out.extend(_expand_host(f"{head}{n:0{width}d}{tail}", text, variable))
    return out


def expand_tasks_per_node(text: str, variable: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """``8(x4),4`` -> [8, 8, 8, 8, 4]."""
    out: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise LaunchError(variable, text, "cannot parse; expected counts such as 8(x4) or 8,8,4")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


# -- small helpers ---------------------------------------------------------------------------------

def _get(environ: Mapping[str, str], name: str) -> str:
    value = environ.get(name)
    if value is None or value == "":
        raise LaunchError(name, value, "is not set; the launcher (torchrun or srun) sets it for every process")
    return value


def _int(environ: Mapping[str, str], name: str, *, default: Optional[int] = ...,
         minimum: Optional[int] = None) -> Optional[int]:
    """Variable ``name`` as an integer (``>= minimum`` when given); ``default`` when it is not set
    (no default: required)."""
    if name not in environ and default is not ...:
        return default
    value = _get(environ, name)
    allowed = "must be an integer" + ("" if minimum is None else f" >= {minimum}")
    try:
        number = int(value)
    except ValueError:
        raise LaunchError(name, value, allowed) from None
    if minimum is not None and number < minimum:
        raise LaunchError(name, value, allowed)
    return number


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
