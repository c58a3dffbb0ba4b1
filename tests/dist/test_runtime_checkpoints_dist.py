"""The checkpoint protocol and the preemption agreement across 2 processes (gloo): every rank writes
into the staging dir rank 0 made, rank 0 publishes after all ranks finished, every rank then sees
the same latest(); a signal on one rank stops all ranks at the same step."""

import os
import signal

import torch
from megatron_jetrl.launch import free_port
from tests.helpers import run_ranks


def _worker(rank, world, port, run_dir, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import torch.distributed as dist

        from megatron_jetrl.runtime import (
            PreemptionSignal, RunCheckpoints, any_rank, load_rng, rng_fingerprint, save_rng,
        )

        out = {"any": [any_rank(rank == 1), any_rank(False), any_rank(True)]}
        ck = RunCheckpoints(run_dir, keep_last=2, rank=rank, world_size=world, barrier=dist.barrier)
        ck.clean_stale()
        torch.manual_seed(100 + rank)
        fingerprints = {}
        with PreemptionSignal() as pre:
            stopped_at = None
            for step in range(1, 10):
                torch.rand(3)

                def write(staging, step=step):
                    assert staging.is_dir(), f"rank {rank}: no staging directory when writing"
                    (staging / f"shard_{rank}").write_text(str(step))
                    save_rng(staging, rank)

                ck.save(step, write, any_rank=any_rank)
                fingerprints[step] = rng_fingerprint()
                final = ck.step_dir(step)
                files = sorted(p.name for p in final.iterdir())
                assert files == ["COMPLETE", "rng", "shard_0", "shard_1"], f"rank {rank}: {files}"
                if rank == 0 and step == 3:
                    os.kill(os.getpid(), signal.SIGUSR1)
                if pre.agreed(any_rank):
                    stopped_at = step
                    break
        out["stopped_at"] = stopped_at
        out["latest"] = ck.latest().name
        out["steps"] = sorted(p.name for p in ck.root.iterdir())
        torch.rand(5)
        load_rng(ck.latest(), rank)
        out["rng_restored"] = rng_fingerprint() == fingerprints[stopped_at]
        dist.barrier()
        results.put((rank, out, None))
    except Exception:  # reported to the test
        import traceback

        results.put((rank, None, traceback.format_exc()))
    finally:
        torch.distributed.destroy_process_group()


def test_checkpoint_protocol_and_preemption_across_processes(tmp_path):
    world = 2
    port = free_port()
    stale = tmp_path / "checkpoints" / "step_00000007.tmp"
    stale.mkdir(parents=True)
    out = run_ranks(_worker, world, world, port, tmp_path)
    for rank, got, error in out:
        assert error is None, f"rank {rank}: {error}"
        assert got["any"] == [True, False, True]
        assert got["stopped_at"] == 3  # rank 0 was signalled; rank 1 stopped at the same step
        assert got["latest"] == "step_00000003"
        assert got["steps"] == ["latest", "step_00000002", "step_00000003"]  # keep_last=2, stale .tmp gone
        assert got["rng_restored"]
