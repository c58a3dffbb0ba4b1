"""The weight-sync contract on GPUs (scenarios in tests/gpu/sync_worker.py, run under torchrun):
the engine's FP8 bytes and scales are the trainer's FProp weights of the same step, at TP=1 and
TP=2 -> rollout TP 1 and 2; and the engine's rollout logprobs agree with the trainer's far better
under unified FP8 than under BF16-train + FP8-rollout."""

import pytest
import torch

from tests.gpu.test_actor import _launch, _ok

pytestmark = pytest.mark.gpu


def _worker(tmp, nproc, scenarios):
    from pathlib import Path

    return _launch(tmp, nproc, scenarios, worker=Path(__file__).with_name("sync_worker.py"))


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory):
    return _worker(tmp_path_factory.mktemp("sync1"), 1, "byte_identity,mismatch")


@pytest.fixture(scope="module")
def two_gpus(tmp_path_factory):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"train TP=2 needs 2 GPUs; this host has {torch.cuda.device_count()}")
    return _worker(tmp_path_factory.mktemp("sync2"), 2, "byte_identity")


def _identity(data, key):
    _ok(data, "byte_identity")
    r = data["results"][key]
    assert r["all_ranks_identical"], r
    assert r["fp8_tensors"] > 0 and r["changed_after_step"] > 0, r


def test_engine_fp8_bytes_are_the_trainers_tp1(one_gpu):
    _identity(one_gpu, "identity/tp1_rollout1")


@pytest.mark.parametrize("rollout_tp", [1, 2])
def test_engine_fp8_bytes_are_the_trainers_tp2(two_gpus, rollout_tp):
    _identity(two_gpus, f"identity/tp2_rollout{rollout_tp}")


def test_unified_fp8_mismatch_is_far_below_bf16_train_fp8_rollout(one_gpu):
    _ok(one_gpu, "mismatch")
    m = {k.split("/", 1)[1]: v for k, v in one_gpu["results"].items() if k.startswith("mismatch/")}
    assert set(m) == {"bf16", "fp8", "bf16-train+fp8-rollout", "fp16"}
    for mode, r in m.items():
        assert r["tokens"] > 500 and r["k3_kl"] >= 0, (mode, r)
    # same kernels on both sides: only attention / cache numerics differ
    assert m["fp8"]["mean_abs_dlogp"] < 0.5 * m["bf16-train+fp8-rollout"]["mean_abs_dlogp"], m
    assert m["fp8"]["k3_kl"] < 0.25 * m["bf16-train+fp8-rollout"]["k3_kl"], m
    assert m["fp16"]["mean_abs_dlogp"] <= 2 * m["bf16"]["mean_abs_dlogp"] + 1e-4, m
