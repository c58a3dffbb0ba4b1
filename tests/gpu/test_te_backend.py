"""The te backend on the GPU host: Transformer Engine's layer spec with Float8BlockScaling
and fp32 scales. Its FP8 weights are the reference 128x128 quantization byte for byte and the bytes
TE cached for its own FProp; its logprobs sit as close to BF16 as the native backend's; steps lower
the loss; the hf engine and real vLLM hold TE's bytes after a sync, before and after a step. And the
native layers' ``actor.attention_impl=te``: TE's fused (cuDNN) attention over packed sequences.

Skipped where Transformer Engine is not installed, unless ``JETRL_REQUIRE_TE=1`` (set on the GPU
host once hosts/offline/te_install.sh installed it) makes a missing TE fail."""

import importlib.util
import os
from pathlib import Path

import pytest

from tests.gpu.conftest import requires_vllm
from tests.gpu.test_actor import _launch, _ok
from tests.gpu.test_vllm_engine import _run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        importlib.util.find_spec("transformer_engine") is None and os.environ.get("JETRL_REQUIRE_TE") != "1",
        reason="Transformer Engine is not installed here: pip install 'megatron-jetrl[te]' (the offline host: "
               "hosts/offline/te_install.sh)"),
]


@pytest.fixture(scope="module")
def te(tmp_path_factory, monkeypatch_module):
    # TE reads its block-scaling scale format when it is imported: the worker's environment
    monkeypatch_module.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1")
    actor = _launch(tmp_path_factory.mktemp("te_actor"), 1, "te_backend")
    sync = _launch(tmp_path_factory.mktemp("te_sync"), 1, "byte_identity_te",
                   worker=Path(__file__).with_name("sync_worker.py"))
    return actor, sync


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_te_weights_are_the_reference_bytes_and_tes_own_cache(te):
    data, _ = te
    _ok(data, "te_backend")
    r = data["results"]["te/backend"]
    for when in ("first", "after_steps"):
        b = r[when]
        assert b["fp8_tensors"] > 0, b
        assert b["codes_equal"] == b["fp8_tensors"] and b["scales_equal"] == b["fp8_tensors"], b
        assert b["cache_seen"] == b["fp8_tensors"] and b["cache_equal"] == b["cache_seen"], b
    assert r["losses"][-1] < r["losses"][0], r["losses"]


def test_te_logprobs_are_as_close_to_bf16_as_the_native_backend(te):
    data, _ = te
    r = data["results"]["te/logprobs"]
    assert r["te_vs_bf16_mean"] < 2 * r["native_vs_bf16_mean"] + 1e-4, r
    assert r["te_vs_native_mean"] < r["native_vs_bf16_mean"], r


def test_hf_engine_holds_tes_bytes(te):
    _, sync = te
    _ok(sync, "byte_identity_te")
    r = sync["results"]["identity/te_tp1_rollout1"]
    assert r["all_ranks_identical"], r
    assert r["fp8_tensors"] > 0 and r["changed_after_step"] > 0, r


@requires_vllm
def test_vllm_holds_tes_bytes(tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1")
    r = _run(tmp_path_factory, "engine_fp8_te")["engine_fp8_te"]
    for key in ("identity_first", "identity_after_step"):
        ident = r[key]
        assert ident["equal"], ident["first_diff"]
        assert ident["live_equals_shipped"], ident["first_shipped_diff"]
        assert ident["fp8_tensors"] > 0
    assert r["identity_first"]["in_place"] == r["identity_first"]["tensors"]
    assert r["changed_after_step"] > 0
    assert r["mismatch"]["k3_kl"] < 1e-3, r["mismatch"]


def test_te_backend_builds_tes_layers_in_bf16_too(te):
    """The te backend is Transformer Engine's layers in every mode, so that its FP8 step is measured
    against its own BF16 step (the same attention and norms): in BF16 no native attention module is
    built, and the logprobs sit far closer to the native BF16 ones than FP8's do."""
    data, _ = te
    r = data["results"]["te/logprobs"]
    assert r["te_layers"] == {"fp8": True, "bf16": True}, r
    assert r["te_bf16_vs_bf16_mean"] < 0.5 * r["native_vs_bf16_mean"], r


def test_te_packed_attention_runs_cudnn_and_matches_torchs_flash_attention():
    """``actor.attention_impl=te`` at Qwen3-8B's heads (32 query, 8 KV, head dim 128) over three packed
    sequences of unequal length: TE picks its fused (cuDNN) backend, and output and gradients agree with
    torch's FlashAttention-2 varlen (the default) to BF16 rounding; two kernels, so not bit for bit."""
    import math
    from types import SimpleNamespace

    import torch
    from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as dpa

    from megatron_jetrl.actor.layers import packed_causal_attention, te_packed_causal_attention

    config = SimpleNamespace(tensor_model_parallel_size=1, num_attention_heads=32, num_query_groups=8, kv_channels=128)
    lengths = [700, 1300, 2048]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    T, scale = sum(lengths), 1 / math.sqrt(128)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(T, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(T, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    grad = torch.randn(T, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    attend = te_packed_causal_attention(config, 1, scale)
    results = {}
    for name, fn in (("te", attend), ("torch", lambda *a: packed_causal_attention(*a, scale))):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*inputs, cu, max(lengths))
        out.backward(grad)
        results[name] = [out.detach().float(), *(t.grad.float() for t in inputs)]
    assert dpa._attention_backends["use_fused_attention"], dpa._attention_backends
    for what, got, want in zip(("out", "dq", "dk", "dv"), results["te"], results["torch"], strict=True):
        assert got.shape == want.shape, what
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < 1e-2, (what, rel)
