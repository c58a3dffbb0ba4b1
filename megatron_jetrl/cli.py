"""``jetrl``: the command line.

    jetrl train CONFIG [key=value ...]     run (or continue) the RL job in run.dir
    jetrl check CONFIG [key=value ...]     validate the job and print its resolved layout (no GPU)

``train`` runs one process per GPU: under ``torchrun`` (or ``srun``, one task per GPU) every
process runs this command; started plainly it is a single-GPU job. Everything about the job is
validated before the first GPU is touched, and a config error exits with status 2, naming the key.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path
from typing import Sequence

import yaml

from megatron_jetrl.config import ConfigError
from megatron_jetrl.job import JobConfig, load_data, load_job, resolve

EXIT_CONFIG = 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jetrl", description="RL post-training with unified FP8 (megatron-jetrl)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("train", "run or continue an RL job"), ("check", "validate a job and print its layout")):
        p = sub.add_parser(name, help=text)
        p.add_argument("config", help="YAML job config (examples/configs/)")
        p.add_argument("overrides", nargs="*", metavar="key=value", help="override config keys, e.g. run.steps=10")
        if name == "check":
            p.add_argument("--world-size", type=int, default=None,
                           help="processes the job will run on (default: WORLD_SIZE, SLURM_NTASKS, or 1)")
    args, extra = parser.parse_known_args(argv)  # overrides may follow options, too
    unknown = [a for a in extra if "=" not in a or a.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = [*args.overrides, *extra]
    try:
        job = load_job(args.config, args.overrides)
        if args.command == "check":
            return check(job, args.world_size)
        return train(job)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return EXIT_CONFIG


def check(job: JobConfig, world_size: int | None) -> int:
    world = world_size or int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or 1)
    resolved = resolve(job, world)
    load_data(job, resolved)
    print("\n".join(resolved.describe(job)))
    print(f"run dir      {job.run.dir}")
    print("config OK")
    return 0


def train(job: JobConfig) -> int:
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    resolved = resolve(job, world)  # layout and data errors before any GPU work
    data = load_data(job, resolved)
    if not torch.cuda.is_available():
        raise SystemExit("jetrl train needs CUDA GPUs (jetrl check validates a job without one)")
    _init_distributed()
    from megatron_jetrl.trainer import Trainer

    run_dir = Path(job.run.dir)
    if dist.get_rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_config(run_dir, job)
        print("\n".join(resolved.describe(job)), flush=True)
    dist.barrier()
    trainer = Trainer(job, resolved, data, run_dir=run_dir)
    try:
        return trainer.run()
    finally:
        trainer.close()
        dist.destroy_process_group()


def _init_distributed() -> None:
    """One process per GPU: torchrun/srun set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT; a
    plain start is a world of one on this host."""
    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_rank >= torch.cuda.device_count():
        raise SystemExit(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs are visible")
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))


def _write_config(run_dir: Path, job: JobConfig) -> None:
    """The resolved config as run_dir/config.yaml; an earlier one that differs is kept beside it."""
    from megatron_jetrl.runtime.atomic import write_atomic

    text = yaml.safe_dump(job.to_dict(), sort_keys=False)
    path = run_dir / "config.yaml"
    if path.is_file() and path.read_text() != text:
        previous = sorted(run_dir.glob("config.previous.*.yaml"))
        write_atomic(run_dir / f"config.previous.{len(previous) + 1}.yaml", path.read_text())
    write_atomic(path, text)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
