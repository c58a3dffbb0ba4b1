"""A converted checkpoint loads at TP=2 x PP=2: four gloo processes request their shards the way
GPTModel does (per-rank TP shards, the stage's layers, vocab padded for TP=2) and get exactly the
bridge's TP shards of the HF weights."""

import os

import pytest
import torch

from tests.model_fixtures import load_tool, save_tiny_hf
from megatron_jetrl.launch import free_port
from tests.helpers import run_ranks

TP, PP = 2, 2


def _worker(rank, port, ckpt, hf_dir, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=TP * PP)
    try:
        from megatron.core import dist_checkpointing

        from megatron_jetrl.actor.hf_conversion import sharded_tensor
        from megatron_jetrl.models import bridge_for
        from megatron_jetrl.models.hf_checkpoint import HFCheckpoint
        from megatron_jetrl.models.layout import pp_layer_range

        hf = HFCheckpoint(hf_dir)
        bridge = bridge_for(hf.config)
        n = bridge.dims.num_layers
        tp_rank, pp_rank = rank % TP, rank // TP
        layers = pp_layer_range(n, PP, pp_rank)
        wanted = [
            s for s in bridge.tensor_map()
            if (s.layer in layers)
            or (s.megatron.startswith("embedding") and pp_rank == 0)
            or (s.layer is None and not s.megatron.startswith("embedding") and pp_rank == PP - 1)
        ]
        request, expected = {}, {}
        for spec in wanted:
            want = bridge.tp_shard(spec, bridge.to_megatron(spec, hf.get), tp_rank, TP)
            expected[spec.megatron] = want
            request[spec.megatron] = sharded_tensor(spec, torch.full_like(want, float("nan")), n, tp_rank, TP)
        loaded = dist_checkpointing.load(request, ckpt)
        bad = [k for k, t in loaded.items() if not torch.equal(t, expected[k])]
        results.put((rank, len(loaded), bad))
    except Exception as e:  # reported to the test
        results.put((rank, 0, [repr(e)]))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_checkpoint_loads_at_tp2_pp2(arch, tmp_path):
    save_tiny_hf(arch, tmp_path / "hf")
    convert = load_tool("convert_hf_to_megatron")
    assert convert(["--hf-dir", str(tmp_path / "hf"), "--out-dir", str(tmp_path / "mg")]) == 0

    port = free_port()
    outcomes = run_ranks(_worker, TP * PP, port, str(tmp_path / "mg"), str(tmp_path / "hf"))
    for rank, count, bad in outcomes:
        assert count > 0 and not bad, f"rank {rank}: {bad}"
