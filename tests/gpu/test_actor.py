"""The Megatron actor on GPUs: HF parity for every family, FP8 / FP16 against BF16, optimizer
steps, offload, checkpoints, and TP / SP / PP layouts against TP=1.

The scenarios run in tests/gpu/actor_worker.py under torchrun (one launch per GPU count); the
tests here assert on the numbers it records. Tolerances are BF16-sized: a wrong layout or a
mis-sliced weight gives errors orders of magnitude larger.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
WORKER = Path(__file__).with_name("actor_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def _launch(tmp: Path, nproc: int, scenarios: str, worker: Path = WORKER) -> dict:
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(worker), "--root", str(tmp), "--scenarios", scenarios]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    results = tmp / "results.json"
    assert results.is_file(), (f"worker wrote no results (rc={proc.returncode}):\n"
                               f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    data = json.loads(results.read_text())
    print(json.dumps(data["results"], indent=1))
    return data


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("actor1"), 1,
                   "hf_parity,precision_modes,memory_and_checkpoint,bad_input,recompute")


@pytest.fixture(scope="module")
def two_gpus(tmp_path_factory):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"TP=2 / PP=2 need 2 GPUs; this host has {torch.cuda.device_count()}")
    return _launch(tmp_path_factory.mktemp("actor2"), 2, "parallel_layouts")


def _ok(data, scenario):
    assert scenario not in data["errors"], data["errors"][scenario]


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_actor_logprobs_equal_hf(one_gpu, arch):
    _ok(one_gpu, "hf_parity")
    r = one_gpu["results"][f"hf_parity/{arch}"]
    # megatron in BF16 is as far from the fp32 HF model as HF's own BF16 run is
    assert r["actor_vs_fp32"] < max(2.0 * r["hf_bf16_vs_fp32"], 2e-2), r
    assert r["entropy_finite"] and r["first_tokens_zero"]


def test_fp8_logprobs_close_to_bf16_and_weights_are_the_reference_bytes(one_gpu):
    _ok(one_gpu, "precision_modes")
    r = one_gpu["results"]["precision/fp8"]
    assert r["fp8_linears"] == 4 * 4
    assert r["fp8_weights_match_reference"] and r["fp8_weights_match_after_step"]
    assert 0 < r["mean_abs_dlogp_vs_bf16"] < 0.05, r


@pytest.mark.parametrize("mode", ["bf16", "fp8", "fp16"])
def test_optimizer_steps_lower_the_loss(one_gpu, mode):
    _ok(one_gpu, "precision_modes")
    r = one_gpu["results"][f"precision/{mode}"]
    losses = r["losses"]
    assert losses[-1] < losses[0] - 0.05, losses
    assert all(abs(a - b) < 1e-2 * abs(b) + 1e-3 for a, b in zip(r["reported_loss"], losses[:-1], strict=True)), r
    t = r["timeline"]  # where the update's time went: the forward and backward within it, per micro-batch GPU ms
    assert 0 < t["forward_backward_s"] <= t["update_time_s"], t
    if t["micro_batches"] >= 2:
        assert 0 < t["microbatch_gpu_ms_median"] <= t["microbatch_gpu_ms_max"] < 1e3 * t["forward_backward_s"], t


def test_fp16_runs_with_dynamic_loss_scaling(one_gpu):
    r = one_gpu["results"]["precision/fp16"]
    assert r["loss_scale"][0] == 2.0**12 and min(r["loss_scale"]) >= 1.0
    assert r["mean_abs_dlogp_vs_bf16"] < 0.05, r
    assert sum(r["skipped"]) < len(r["skipped"])


def test_offload_frees_memory_and_restores_exactly(one_gpu):
    _ok(one_gpu, "memory_and_checkpoint")
    r = one_gpu["results"]["offload"]
    assert r["params_bytes"] > 0 and r["optimizer_bytes"] > r["params_bytes"] and r["grads_bytes"] > 0
    assert r["freed_bytes"] >= 0.9 * (r["params_bytes"] + r["grads_bytes"] + r["optimizer_bytes"]), r
    assert r["logprobs_identical"] and r["fp8_identical"]
    assert "offloaded" in r["offloaded_call_error"]


def test_offload_with_a_need_restores_exactly(one_gpu):
    """Colocated, the actor frees only what the engine's wake needs (which storages, at sizes where
    device memory frees as they go: tests/gpu/test_offload_gpu.py); what a partial offload moved comes
    back exactly, and a need the GPU already has moves nothing."""
    _ok(one_gpu, "memory_and_checkpoint")
    r = one_gpu["results"]["offload_partial"]
    assert r["covered"] and 0 < r["moved"] <= r["moved_all"], r
    assert r["logprobs_identical"] and r["nothing_needed"], r


def test_close_frees_the_actors_memory_even_with_references_left(one_gpu):
    """A colocated engine wakes its whole share right after the trainer closes its actor (at the end
    of a job): the actor's parameters, gradients and optimizer state must be freed then, even where
    something still refers to them. Bytes are counted above what the worker held before it built
    that actor (its own tensors, the earlier actors' leftovers it keeps on purpose)."""
    r = one_gpu["results"]["close"]
    assert r["lingering_bytes"] == 0, r
    assert r["allocated_closed"] <= 0.05 * r["allocated_open"], r


def test_checkpoint_roundtrip_same_layout_is_exact(one_gpu):
    r = one_gpu["results"]["checkpoint_same_layout"]
    assert r["extra"] == {"note": "same-layout"}
    assert r["logprobs_identical"] and r["next_step_identical"], r
    assert r["grad_norms"][0] == r["grad_norms"][1]


def test_bad_input_is_named(one_gpu):
    _ok(one_gpu, "bad_input")
    e = one_gpu["results"]["bad_input"]
    assert "token ids must be in [0, 1000)" in e["token_out_of_range"]
    assert "limit is 16384" in e["too_long"]
    assert "selects no token" in e["empty_mask"]
    assert "parallel.tp" in e["tp3"]


@pytest.mark.parametrize("mode", ["bf16", "fp8"])
def test_full_recompute_gives_the_same_step(one_gpu, mode):
    _ok(one_gpu, "recompute")
    r = one_gpu["results"][f"recompute/{mode}"]
    assert r["loss_rel_diff"] < 1e-6, r
    assert r["grad_norm_rel_diff"] < 1e-3, r
    assert r["max_abs_dlogp_after_step"] < 1e-2, r


def test_parallel_layouts_match_tp1(two_gpus):
    _ok(two_gpus, "parallel_layouts")
    r = two_gpus["results"]["parallel"]
    for layout in ("tp2", "tp2_sp", "pp2"):
        for mode in ("bf16", "fp8"):
            entry = r[f"{layout}/{mode}"]
            assert entry["mean_abs_dlogp_vs_tp1"] < 2e-2, (layout, mode, entry)
            assert entry["mean_abs_dlogp_after_step_vs_tp1"] < 3e-2, (layout, mode, entry)
            # KV-cache scales: one per layer for q, k, v; TP / SP / PP only reorder BF16 sums
            assert entry["kv_scales_shape"] == [4, 3] and entry["kv_scales_min"] > 0, (layout, mode, entry)
            assert entry["kv_scales_max_rel_diff_vs_tp1"] < 0.02, (layout, mode, entry)
    assert r["tp2_to_tp1_load"]["mean_abs_dlogp_vs_tp2"] < 2e-2
    assert r["tp2_to_tp1_load"]["steps"] == 2  # one step saved at TP=2, one more at TP=1
    assert r["exports_have_same_layout"]


@pytest.fixture(scope="module")
def host_syncs(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("syncs"), 1, "host_syncs")


def test_micro_batches_do_not_make_the_host_wait(host_syncs):
    """Under torch's sync debug mode: the logprob pass's micro-batches never wait for the GPU; an
    update's forward + backward waits at most once per micro-batch, inside megatron's backward
    call (the embedding's backward counts its index segments on the host above 3,072 tokens)."""
    _ok(host_syncs, "host_syncs")
    results = host_syncs["results"]
    assert set(results) == {f"host_syncs/{m}/{i}" for m in ("bf16", "fp8") for i in ("eager", "compiled")}
    for key, seen in results.items():
        fwd, fb = seen["forward"], seen["forward_backward"]
        assert fwd["micro_batches"] >= 2 and fwd["syncs"] == [], (key, fwd)
        assert len(fb["syncs"]) <= fb["micro_batches"], (key, fb)
        assert all(s.startswith("schedules.py:") for s in fb["syncs"]), (key, fb)
