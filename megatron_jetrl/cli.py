"""``jetrl``: the command line.

    jetrl train CONFIG [key=value ...]     run (or continue) the RL job in run.dir
    jetrl check CONFIG [key=value ...]     validate the job, print its layout and memory plan (no GPU)

``train`` runs one process per GPU: under ``torchrun`` or ``srun`` (one task per GPU) every
process runs this command; started plainly it is a single-GPU job (``launch.py`` reads where each
process sits). Everything about the job is validated before the first GPU is touched: the config,
the launcher's environment, the layout against the world and the nodes, the data, and the memory
plan against the GPU. Any of those failing exits with status 2 and names what to change.
``train --smoke`` runs the launch path without the model, on CPUs (``smoke.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from dataclasses import dataclass
from typing import Optional, Sequence

import yaml

from megatron_jetrl import launch
from megatron_jetrl.config import CheckpointError, ConfigError
from megatron_jetrl.job.estimate import gpu_capacity
from megatron_jetrl.rollout.engines import engine_kind
from megatron_jetrl.job import JobConfig, JobData, Resolved, load_data, load_job, missing_inputs, resolve
from megatron_jetrl.runtime.run_checkpoints import RunSaveError
from megatron_jetrl.runtime.signals import PreemptionSignal

EXIT_CONFIG = 2
EXIT_EXACT_MISMATCH = 3
"""An exact rollout that did not hold (``precision.exact_mismatch: stop``): not a preemption, so SLURM
does not requeue it."""
EXIT_SAVE_FAILED = 4
"""A run checkpoint could not be written (a full disk, a quota): not requeued either."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jetrl", description="RL post-training with unified FP8 (megatron-jetrl)")
    sub = parser.add_subparsers(dest="command", required=True)
    train_p = sub.add_parser("train", help="run or continue an RL job")
    check_p = sub.add_parser("check", help="validate a job and print its layout and memory plan")
    for p in (train_p, check_p):
        p.add_argument("config", help="YAML job config (examples/configs/)")
        p.add_argument("overrides", nargs="*", metavar="key=value", help="override config keys, e.g. run.steps=10")
    train_p.add_argument("--smoke", action="store_true",
                         help="CPU smoke test of the launch: rendezvous (gloo), rank layout, config check, "
                              "preemption -> checkpoint -> resume; no model")
    train_p.add_argument("--smoke-step-seconds", type=float, default=1.0, help="length of a smoke step (default 1)")
    train_p.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                         help="start N processes on this machine, one per GPU, forwarding stop signals and "
                              "waiting for their checkpoint (instead of torchrun); srun starts them on a cluster")
    train_p.add_argument("--skip-memory-check", action="store_true",
                         help="start even when the memory plan says the job does not fit the GPU")
    check_p.add_argument("--world-size", type=int, default=None,
                         help="processes the job will run on (default: nodes x gpus-per-node, else WORLD_SIZE, "
                              "SLURM_NTASKS or 1)")
    check_p.add_argument("--nodes", type=int, default=None, help="nodes the job will run on")
    check_p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs (processes) per node (default 8)")
    check_p.add_argument("--gpu-memory", default="H100", help="H100, H200 or GiB per GPU (default H100)")
    args, extra = parser.parse_known_args(argv)  # overrides may follow options, too
    unknown = [a for a in extra if "=" not in a or a.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = [*args.overrides, *extra]
    try:
        job = load_job(args.config, args.overrides)
        if args.command == "check":
            return check(job, args)
        if args.nproc_per_node is not None:
            return launch_local(list(sys.argv[1:] if argv is None else argv), args.nproc_per_node)
        return train(job, args)
    except ConfigError as e:
        # every rank of a launch reads the same config: one message, from rank 0 (an error in a
        # rank's own environment is printed by that rank)
        if _rank() == "0" or e.key.startswith("environment:"):
            print(f"config error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except CheckpointError as e:  # every rank agreed on it (RunCheckpoints.restore_newest): one line, from rank 0
        if _rank() == "0":
            print(f"{e.kind} error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except RunSaveError as e:  # every rank raises it; the one that hit the cause names it
        if _rank() == "0" or e.local:
            print(f"checkpoint save error: {e}", file=sys.stderr)
        return EXIT_SAVE_FAILED


def launch_local(argv: list[str], nproc: int) -> int:
    """``jetrl train --nproc-per-node N``: the same command as N workers on this machine
    (``launch/local.py``), refused inside another launcher's process."""
    from megatron_jetrl.launch.local import run_local, worker_command

    if nproc < 1:
        raise ConfigError("--nproc-per-node", nproc, "must be >= 1 (one process per GPU)")
    try:
        outer = launch.detect(os.environ).launcher
    except launch.LaunchError:  # the batch script of a several-task allocation: this launcher starts them
        outer = "single"
    if outer != "single":
        raise ConfigError("--nproc-per-node", nproc, f"this process is already one of a launch (started by {outer}): "
                          "let that launcher start the processes (srun --ntasks-per-node, torchrun --nproc-per-node) "
                          "and drop --nproc-per-node")
    rest, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc-per-node":
            skip = True
        elif not arg.startswith("--nproc-per-node="):
            rest.append(arg)
    return run_local(worker_command(rest), nproc)


def _rank() -> str:
    """This process's rank in its launch (the launcher's variable; 0 when started plainly)."""
    return os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "0"


@dataclass
class Preflight:
    """What ``preflight`` found: the resolved job, its data (None where the files are not there
    yet, ``check`` only) and, for ``check``, what ``train`` would refuse as warnings."""

    resolved: Resolved
    data: Optional[JobData]
    warnings: list[str]
    missing: int = 0
    plan_config: Optional[str] = None


def preflight(job: JobConfig, *, nodes: int, per_node: int, planning: bool, machine: bool = True) -> Preflight:
    """Every check that needs no GPU, in one order for ``jetrl check`` and ``jetrl train``: the run
    directory, the inputs on disk, the layout for ``nodes`` x ``per_node`` processes, the data, and
    what this machine lacks (``machine``: not for the CPU smoke run). ``planning`` (``check``): a
    user plans before downloading and possibly on another machine, so missing inputs and machine
    problems are warnings and the plan may use ``model.plan_config``; otherwise the first of them is
    the error."""
    world = nodes * per_node
    job.run.check_dir()  # a run dir that cannot be written would fail at the first save
    job.check_resume()  # continuing a run with another precision, lr, group size... is refused
    missing = missing_inputs(job)
    warnings = [f"{key} {path} does not exist yet: {fix} (jetrl train needs it)" for key, path, fix in missing]
    if missing and not planning:
        raise ConfigError(missing[0][0], missing[0][1], "does not exist: " + "; ".join(
            f"{fix}" if i == 0 else f"also {key} {path}: {fix}" for i, (key, path, fix) in enumerate(missing)))
    plan_config = None
    if any(key == "model.hf_config" for key, _, _ in missing):
        if job.model.plan_config is None:
            raise ConfigError("model.hf_config", job.model.hf_config,
                              "no config.json there yet: download the model, or set model.plan_config to a config.json "
                              "of the same model to plan with (the recipes point at examples/configs/models/)")
        plan_config = job.model.plan_config
    try:
        resolved = resolve(job, world, hf_config=None if plan_config is None else job.model.plan_config_dict())
    except ConfigError as e:
        raise _named_by_source(e, job, plan_config) from None
    launch.check_parallel_layout(nodes, per_node, job.actor.parallel, resolved.rollout_tp)
    if job.model.checkpoint is not None and not any(key == "model.checkpoint" for key, _, _ in missing):
        check_initial_checkpoint(job, resolved)
    if machine:  # before the data, the model and the warm-up
        problems = machine_problems(job)
        if problems and not planning:
            raise problems[0]
        warnings += [f"{p} (jetrl train needs it on the GPU hosts)" for p in problems]
    # what the data check reads: the tokenizer and the data files (config.json too when the tokenizer
    # is the model's directory); with the plan's config it runs before the weights are downloaded
    unchecked = [key for key, _, _ in missing
                 if key != "model.checkpoint" and not (key == "model.hf_config" and job.model.tokenizer is not None)]
    data = None if unchecked else load_data(job, resolved)
    if unchecked:
        warnings.append("tokenizer and data not checked (they need the files above)")
    return Preflight(resolved, data, warnings, len(missing), plan_config)


def check_initial_checkpoint(job: JobConfig, resolved: Resolved) -> None:
    """``model.checkpoint`` holds the model ``model.hf_config`` (or ``model.config``) describes:
    every tensor the model needs, with its shape (read from the checkpoint's metadata only). A
    ConfigError naming the key, the first tensor that differs and the fix otherwise."""
    from megatron_jetrl.actor.hf_conversion import check_checkpoint_metadata

    try:
        check_checkpoint_metadata(Path(job.model.checkpoint), resolved.bridge)
    except CheckpointError as e:
        raise ConfigError("model.checkpoint", job.model.checkpoint,
                          f"does not hold this job's model ({e}): name the checkpoint tools/convert_hf_to_megatron.py "
                          "wrote from model.hf_config's model, or the model.hf_config it was converted from") from None


def _named_by_source(e: ConfigError, job: JobConfig, plan_config: Optional[str]) -> ConfigError:
    """``e`` with an HF config entry's key (``config.json:KEY``, as the model bridges name it)
    naming where the entry came from: ``model.config.KEY`` when it is set inline, else the file's
    path (``model.plan_config``'s when planning with it). Other errors as they are."""
    prefix = "config.json:"
    if not e.key.startswith(prefix):
        return e
    entry = e.key[len(prefix):]
    if entry.split(".")[0] in job.model.config or (plan_config is None and job.model.hf_config is None):
        return ConfigError(f"model.config.{entry}", e.got, e.allowed)
    return ConfigError(f"{plan_config or job.model.config_path()}:{entry}", e.got, e.allowed)


def _world_from_env(name: str) -> int:
    """The world size in the launcher's variable ``name``, an integer >= 1 (else a LaunchError naming it)."""
    value = os.environ[name]
    try:
        world = int(value)
    except ValueError:
        world = 0
    if world < 1:
        raise launch.LaunchError(name, value, "must be an integer >= 1 (the processes jetrl check plans for); "
                                 "fix or unset it, or pass --world-size N")
    return world


def check(job: JobConfig, args: argparse.Namespace) -> int:
    capacity = gpu_capacity(args.gpu_memory)
    for flag, value in (("--world-size", args.world_size), ("--nodes", args.nodes),
                        ("--gpus-per-node", args.gpus_per_node)):
        if value is not None and value < 1:
            raise ConfigError(flag, value, "must be >= 1")
    if args.world_size is not None and args.nodes is not None and args.world_size != args.nodes * args.gpus_per_node:
        raise ConfigError("--world-size", args.world_size,
                          f"contradicts --nodes {args.nodes} x --gpus-per-node {args.gpus_per_node} = "
                          f"{args.nodes * args.gpus_per_node}; give one of them")
    world_from = "--world-size"
    if args.world_size is not None:
        world = args.world_size
    elif args.nodes is not None:
        world, world_from = args.nodes * args.gpus_per_node, "--nodes"
    else:
        env = next((name for name in ("WORLD_SIZE", "SLURM_NTASKS") if os.environ.get(name)), None)
        world, world_from = (_world_from_env(env), env) if env else (1, None)
    per_node = min(args.gpus_per_node, world)
    if world % per_node:
        raise ConfigError("--world-size", world, f"must be a multiple of --gpus-per-node ({per_node})")
    try:
        found = preflight(job, nodes=world // per_node, per_node=per_node, planning=True)
    except ConfigError as e:
        if world_from is None and "world size" in e.allowed:  # planned for 1 process: say how to plan for more
            raise ConfigError(e.key, e.got, f"{e.allowed}; jetrl check planned for 1 process: pass --nodes N "
                              f"(x --gpus-per-node, default 8) or --world-size N") from None
        raise
    print("\n".join(found.resolved.describe(job, capacity)))
    print(f"run dir      {job.run.dir}")
    if found.plan_config is not None:
        print(f"planned with model.plan_config {found.plan_config}")
    problems = found.resolved.memory.problems(capacity)
    for line in [*found.warnings, *problems]:
        print(f"WARNING: {line}")
    if problems:  # what jetrl train would refuse: an error here too (its exit status says so to scripts)
        peak, gpu = found.resolved.memory.peak(capacity) / 2**30, capacity / 2**30
        print(f"config error: memory plan: {peak:.1f} GiB per GPU does not fit in memory ({gpu:.1f} GiB per GPU, "
              "--gpu-memory): change what the WARNING names; jetrl train refuses it "
              "(--skip-memory-check starts anyway)", file=sys.stderr)
        return EXIT_CONFIG
    print("config OK" + (f"; {found.missing} input(s) still to fetch (see WARNING)" if found.missing else ""))
    return 0


def train(job: JobConfig, args: argparse.Namespace) -> int:
    # stop signals are recorded from here on: one that arrives while the model is being built is
    # honoured (checkpoint, exit 75) after the first step instead of killing the process unsaved
    with PreemptionSignal() as preemption:
        return _train(job, args, preemption)


def _train(job: JobConfig, args: argparse.Namespace, preemption: PreemptionSignal) -> int:
    if args.smoke and not args.smoke_step_seconds >= 0:  # a bad flag before the data is loaded
        raise ConfigError("--smoke-step-seconds", args.smoke_step_seconds, "must be >= 0")
    placement = launch.detect(os.environ)
    found = preflight(job, nodes=placement.num_nodes, per_node=placement.local_world_size, planning=False,
                      machine=not args.smoke)
    resolved, data = found.resolved, found.data
    os.environ.update(placement.torch_env())
    launch.apply_env(os.environ, backend_env(job, resolved), launch.BACKEND_DEFAULTS)
    if args.smoke:
        return _smoke(job, resolved, placement, preemption, args.smoke_step_seconds)

    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        # every rank finds the same: one line, from rank 0 (main prints a ConfigError so)
        raise ConfigError("jetrl train", "no CUDA GPU visible",
                          "it needs one GPU per process (jetrl check validates a job without one; "
                          "jetrl train --smoke tests the launch on CPUs)")
    if placement.local_rank >= torch.cuda.device_count():
        raise ConfigError("environment:LOCAL_RANK", placement.local_rank,
                          f"only {torch.cuda.device_count()} GPUs are visible on this node: run one process per GPU "
                          "(srun --ntasks-per-node / torchrun --nproc-per-node = GPUs per node)")
    torch.cuda.set_device(placement.local_rank)
    capacity = torch.cuda.mem_get_info()[1]
    problems = check_memory(resolved, capacity, skip=args.skip_memory_check)
    # No device_id: NCCL communicators are then made on each group's first collective. With
    # device_id every one of megatron's process groups gets one at once: 6.5 GiB per GPU for a
    # world of 1 on an H100 (benchmarks.md, "NCCL communicators"), most of them never used.
    dist.init_process_group("nccl")
    from megatron_jetrl.trainer import ExactMismatch, Trainer

    run_dir = Path(job.run.dir)
    if dist.get_rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_config(run_dir, job)
        print(placement.describe())
        print("\n".join(resolved.describe(job, capacity)), flush=True)
        for line in problems:
            print(f"WARNING: {line}", flush=True)
    dist.barrier(device_ids=[placement.local_rank])
    trainer = Trainer(job, resolved, data, run_dir=run_dir)
    try:
        return trainer.run(preemption)
    except ExactMismatch as e:  # every rank found it (the check is all-reduced): one line, from rank 0
        if dist.get_rank() == 0:
            print(f"exact rollout error: {e}", file=sys.stderr, flush=True)
        return EXIT_EXACT_MISMATCH
    finally:
        trainer.close()
        dist.destroy_process_group()


def machine_problems(job: JobConfig) -> list[ConfigError]:
    """What this machine lacks for the job (the math checker, what its engine's ``requirements``
    name, e.g. a supported vLLM): warnings for
    ``jetrl check``, which may run elsewhere; errors for ``jetrl train``."""
    from megatron_jetrl.data.rewards import require_math_checker

    problems = []
    checks = [lambda: require_math_checker(job.reward), *engine_kind(job.rollout).requirements(job.rollout.options)]
    for check_one in checks:
        try:
            check_one()
        except ConfigError as e:
            problems.append(e)
    return problems


def check_memory(resolved: Resolved, capacity: float, *, skip: bool) -> list[str]:
    """Refuse a job whose memory plan exceeds a GPU of ``capacity`` bytes (unless ``skip``);
    returns the plan's problems (printed as warnings when skipped)."""
    problems = resolved.memory.problems(capacity)
    if problems and not skip:
        raise ConfigError("memory plan", f"{resolved.memory.peak(capacity) / 2**30:.1f} GiB per GPU",
                          "; ".join(problems) + " (jetrl check CONFIG prints the plan; --skip-memory-check "
                          "starts anyway)")
    return problems


def backend_env(job: JobConfig, resolved: Resolved) -> dict[str, str]:
    """Variables the job's backends read when they are imported, from its precision recipe:
    Transformer Engine's scale format (te backend) and the engine's ``environment`` (vLLM's DeepGEMM
    scale switch, its batch-invariant mode for an exact rollout)."""
    layers = resolved.bridge.dims.num_layers
    env: dict[str, str] = {}
    if job.precision.train_fp8 and job.actor.fp8_backend == "te":
        env.update(job.precision.te_settings(layers).env)
    env.update(engine_kind(job.rollout).environment(job.precision, job.rollout.options))
    return env


def _smoke(job: JobConfig, resolved: Resolved, placement: launch.Placement, preemption: PreemptionSignal,
           step_seconds: float) -> int:
    import torch.distributed as dist

    from megatron_jetrl.launch.smoke import run_smoke

    dist.init_process_group("gloo")
    try:
        if dist.get_rank() == 0:
            print("\n".join(resolved.describe(job)), flush=True)
        return run_smoke(placement, Path(job.run.dir), preemption, steps=job.run.steps, save_every=job.run.save_every,
                         keep_last=job.run.keep_last, parallel=job.actor.parallel, dp_size=resolved.dp,
                         rollout_tp=resolved.rollout_tp, step_seconds=step_seconds, resume=job.run.resume)
    finally:
        dist.destroy_process_group()


def _write_config(run_dir: Path, job: JobConfig) -> None:
    """The resolved config as run_dir/config.yaml; an earlier one that differs is kept beside it."""
    from megatron_jetrl.runtime.atomic import write_atomic

    text = yaml.safe_dump(job.to_dict(), sort_keys=False)
    path = run_dir / "config.yaml"
    if path.is_file() and path.read_text() != text:
        previous = sorted(run_dir.glob("config.previous.*.yaml"))
        write_atomic(run_dir / f"config.previous.{len(previous) + 1}.yaml", path.read_text())
    write_atomic(path, text)


if __name__ == "__main__":
    sys.exit(main())
