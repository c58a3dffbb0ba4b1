"""The exact rollout inside real vLLM (``precision.exact``; scenarios in tests/gpu/exact_worker.py,
one torchrun launch per engine): the logprob vLLM reports for every sampled token equals the
trainer's, bit for bit (``torch.equal``, max |Δlogp| = 0, k3 = 0), in BF16 and unified FP8, for one
prompt alone and 256 sequences at once, with torch.compile and CUDA graphs as a job runs the
engine, after a sync and after optimizer steps; the update's own forward gives the same values;
at the tiny model's widths and at Qwen3-8B's (6 layers), at TP 1 and at equal TP 2 and 4 (with a
negative control), with a BF16 and an FP8 KV cache; and neither side starts with a module left on a
non-exact kernel.

Skipped (with the reason) where vLLM is not installed; with ``JETRL_REQUIRE_VLLM=1`` (set by
hosts/offline/vllm.sh) a missing vLLM fails instead.
"""

import json
import os
from pathlib import Path

import pytest
import torch

from megatron_jetrl.precision import PrecisionRecipe
from megatron_jetrl.rollout.vllm_engine import VllmOptions, engine_env
from tests.gpu.conftest import requires_vllm
from tests.gpu.test_actor import _launch, _ok

WORKER = Path(__file__).with_name("exact_worker.py")
pytestmark = [pytest.mark.gpu, requires_vllm]


def _run(tmp_path_factory, scenario: str, nproc: int = 1) -> dict:
    return _run_in(tmp_path_factory.mktemp(scenario), scenario, nproc)


def _run_in(root: Path, scenario: str, nproc: int = 1) -> dict:
    """The scenario's results, run by the worker in ``root`` (which keeps what it writes there)."""
    env = engine_env(PrecisionRecipe(exact=True), VllmOptions())  # the launcher's part: vLLM reads these at import
    saved = {var: os.environ.get(var) for var in env}
    os.environ.update(env)
    try:  # for the worker only: later engine tests of this process run without the exact mode's settings
        data = _launch(root, nproc, scenario, worker=WORKER)
    finally:
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
    _ok(data, scenario)
    return data["results"][scenario]


def _exact(r: dict) -> None:
    print(json.dumps(r, indent=1))
    assert all(r["exact_modules"][k] > 0 for k in ("norms", "activations", "rotary", "attention")), r
    # vLLM's batch-invariant mode pinned NCCL for the process at start; the engine gave the job's values back
    assert r["nccl_pins_undone"] and r["nccl_env_kept"], (r["nccl_pins_undone"], r["nccl_env_kept"])
    for case in ("batch1", "batch256", "after_steps"):
        for side in ("recompute", "update_forward"):
            got = r[case][side]
            assert got["tokens"] > 0 and got["equal"], (case, side, got)
            assert got["unequal"] == 0 and got["max_abs_dlogp"] == 0.0 and got["k3"] == 0.0, (case, side, got)
    assert r["batch1"]["sequences"] == 1 and r["batch256"]["sequences"] == 256
    assert r["steps"] == 3 + 3 + 1  # warm-up, one per round, one in between: the weights moved


@pytest.mark.parametrize("mode", ["fp8", "bf16"])
def test_rollout_logprobs_equal_the_trainers_bit_for_bit(tmp_path_factory, mode):
    _exact(_run(tmp_path_factory, f"exact_{mode}"))


@pytest.mark.parametrize("mode", ["fp8", "bf16"])
def test_exact_at_qwen3_8b_widths(tmp_path_factory, mode):
    _exact(_run(tmp_path_factory, f"exact_{mode}_8b6"))


@pytest.mark.parametrize("scenario", ["exact_fp8_kv", "exact_fp8_kv_8b6"])
def test_exact_with_an_fp8_kv_cache(tmp_path_factory, scenario):
    """q, k, v through the FP8 KV cache's quantization with the scales the engine holds, both sides."""
    r = _run(tmp_path_factory, scenario)
    _exact(r)
    assert r["exact_modules"]["fp8_kv_attention"] == r["exact_modules"]["attention"] > 0, r
    used = [r[case]["kv_scales_used"] for case in ("batch1", "batch256", "after_steps")]
    assert all(0 < v < 1e4 for scales in used for v in scales) and used[0] != used[1], used  # measured, then moved


def test_without_segments_an_fp8_kv_cache_prefill_is_not_exact(tmp_path_factory):
    """The negative control of ``exact_fp8_kv_8b6``: vLLM's prefills of up to 400 tokens in one
    FlashAttention call (its metadata unsegmented) run the FP8 kernel's other tile shape, and tokens differ."""
    r = _run(tmp_path_factory, "unsegmented_fp8_kv_8b6")
    print(json.dumps(r, indent=1))
    unequal = sum(r[case][side]["unequal"] for case in ("batch256", "after_steps")
                  for side in ("recompute", "update_forward"))
    assert unequal > 0, r


@pytest.mark.parametrize("scenario", ["exact_fp8_tp2", "exact_bf16_tp2", "exact_fp8_8b6_tp2"])
def test_exact_at_equal_tp_2(tmp_path_factory, scenario):
    """Trainer TP 2 (sequence parallel) = rollout TP 2 on two GPUs: the same equalities on every rank."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"equal TP 2 needs 2 GPUs; this host has {torch.cuda.device_count()}")
    r = _run(tmp_path_factory, scenario, nproc=2)
    _exact(r)
    assert r["tp"] == 2 and r["ranks_alike"], r


@pytest.mark.parametrize("scenario", ["exact_fp8_tp4", "exact_bf16_tp4", "exact_fp8_8b6_tp4", "exact_bf16_8b6_tp4"])
def test_exact_at_equal_tp_4(tmp_path_factory, scenario):
    """Trainer TP 4 (sequence parallel) = rollout TP 4 on four GPUs: both sides reduce the row-parallel
    outputs in the contract's order (``ops.exact.ordered_sum``); the same equalities on every rank."""
    if torch.cuda.device_count() < 4:
        pytest.skip(f"equal TP 4 needs 4 GPUs; this host has {torch.cuda.device_count()}")
    r = _run(tmp_path_factory, scenario, nproc=4)
    _exact(r)
    assert r["tp"] == 4 and r["ranks_alike"], r


def test_at_tp_4_each_sides_own_reduction_is_not_exact(tmp_path_factory):
    """The negative control of ``test_exact_at_equal_tp_4``: with the ordered reduction off on both
    sides (NCCL's reduce-scatter in the trainer, vLLM's all-reduce in the engine) tokens differ."""
    if torch.cuda.device_count() < 4:
        pytest.skip(f"TP 4 needs 4 GPUs; this host has {torch.cuda.device_count()}")
    r = _run(tmp_path_factory, "unordered_fp8_8b6_tp4", nproc=4)
    print(json.dumps(r, indent=1))
    unequal = sum(r[case][side]["unequal"] for case in ("batch256", "after_steps")
                  for side in ("recompute", "update_forward"))
    assert unequal > 0, r


def test_no_side_starts_with_a_non_exact_kernel(tmp_path_factory):
    r = _run(tmp_path_factory, "exact_fallback")
    assert r["engine_refused"], r
    assert r["actor_refused"], r


@pytest.mark.parametrize("mode, cosine", [("fp8", 0.99), ("bf16", 0.9999)])
def test_the_exact_update_computes_the_default_modes_gradient(tmp_path_factory, mode, cosine):
    """The exact mode changes the forward's kernels and the backward's implementation, not the gradient:
    the same initial weights and batch in two processes (the default actor, and the exact one in vLLM's
    batch-invariant mode) give gradients at cosine >= 0.99 over all parameters (FP8: its quantization
    differs where the forwards' bits do) or >= 0.9999 (BF16), and grad norms within 0.1 %."""
    results = {}
    for kind in ("default", "exact"):
        name = f"grad_{mode}_{kind}"
        root = tmp_path_factory.mktemp(name)
        results[kind] = (_run_in(root, name), torch.load(root / f"{name}.pt"))
    (d_info, d), (e_info, e) = results["default"], results["exact"]
    assert d_info["skipped"] == e_info["skipped"] == 1.0 and d_info["steps"] == e_info["steps"] == 0
    assert set(d) == set(e) and len(d) == d_info["params"] > 0
    flat_d, flat_e = (torch.cat([g[n].flatten().double() for n in sorted(d)]) for g in (d, e))
    overall = float(torch.nn.functional.cosine_similarity(flat_d, flat_e, dim=0))
    worst = min((float(torch.nn.functional.cosine_similarity(d[n].flatten().double(), e[n].flatten().double(),
                                                             dim=0)), n) for n in d if d[n].abs().sum() > 0)
    print(f"{mode}: gradient cosine {overall:.6f} over all parameters, lowest of one parameter {worst[0]:.6f} "
          f"({worst[1]}); grad norms {d_info['grad_norm']:.6g} (default) vs {e_info['grad_norm']:.6g} (exact)")
    assert overall >= cosine, (overall, worst)
    assert abs(e_info["grad_norm"] / d_info["grad_norm"] - 1) < 1e-3, (d_info, e_info)
