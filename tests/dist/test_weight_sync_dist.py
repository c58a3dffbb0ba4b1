"""The weight sync across processes (gloo): each rank holds only its own train shards, the rounds
exchange pieces with batch_isend_irecv, and every rank's engine tensors equal the in-process
simulation of the same plan (which tests/unit/test_sync.py checks against the FP8 export)."""

import os

import pytest
import torch
from megatron_jetrl.launch import free_port
from tests.helpers import run_ranks


def _worker(rank, world, port, tp, pp, rollout_tp, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from megatron_jetrl.models import ParallelLayout
        from megatron_jetrl.precision import PrecisionRecipe
        from megatron_jetrl.sync import SyncPlan, WeightSync, shard_state, simulate
        from tests.unit.test_sync import _model

        bridge, full, _ = _model("Qwen3ForCausalLM")
        recipe = PrecisionRecipe()
        train = ParallelLayout(tp, pp)
        plan = SyncPlan(bridge, recipe, train, rollout_tp, world)
        all_shards = shard_state(bridge, recipe, full, train, dp_size=world // (tp * pp))
        mine = all_shards[rank]
        sync = WeightSync(plan, rank, bucket_mb=0.25)
        sync.check(mine)

        class Engine:
            def __init__(self):
                self.got = {}

            def weight_specs(self):
                return sync.engine_specs()

            def update_weights(self, tensors):
                self.got.update((n, t.clone()) for n, t in tensors)

            def weight_buffers(self):  # handed-over tensors only
                return {}

        engine = Engine()
        report = sync.sync(mine, engine)
        expected = dict(simulate(plan, all_shards, rank))
        bad = [n for n in expected if not torch.equal(engine.got[n].view(torch.uint8), expected[n].view(torch.uint8))]
        results.put((rank, sorted(engine.got) == sorted(expected), bad, report.rounds, report.sent_bytes, None))
    except Exception:  # reported to the test
        import traceback

        results.put((rank, False, [], 0, 0, traceback.format_exc()))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("tp,pp,rollout_tp,world", [(2, 1, 1, 2), (1, 2, 2, 2), (2, 2, 1, 4), (2, 1, 4, 4)])
def test_sync_across_processes_equals_simulation(tp, pp, rollout_tp, world):
    port = free_port()
    out = run_ranks(_worker, world, world, port, tp, pp, rollout_tp)
    for rank, names_ok, bad, rounds, _sent, error in out:
        assert error is None, f"rank {rank}: {error}"
        assert names_ok and bad == [], f"rank {rank}: differing tensors {bad[:5]}"
        assert rounds > 1
    assert sum(o[4] for o in out) > 0  # pieces really crossed processes
