"""The exact forward's pieces that run without a GPU (``precision.exact``; ops/exact.py,
actor/exact.py, the job rules): the ops defined once are megatron's arithmetic bit for bit, the
custom ops vLLM runs are those functions under torch.compile, the trainer's paged view of its
K/V holds each sequence where vLLM's cache would, exact logprobs take their values from the given
logprob kernel and their gradient from the compiled path, and every layout that cannot be
exact is refused at config time naming the key. (The equality with vLLM itself is a GPU test:
tests/gpu/test_exact.py.)"""

import contextlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")

from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb  # noqa: E402

from megatron_jetrl.actor.exact import (ExactRMSNorm, _compiled_cache_values, _ExactAttentionFn,  # noqa: E402
                                        cache_values_and_range, exact_rope, fp8_cache_values, recompute_backward)
from megatron_jetrl.actor.layers import EXACT_ATTR, apply_rotary_pos_emb_packed, packed_positions  # noqa: E402
from megatron_jetrl.actor.logprobs import vocab_parallel_logprobs  # noqa: E402
from megatron_jetrl.algo import mismatch_metrics  # noqa: E402
from megatron_jetrl.config import ConfigError  # noqa: E402
from megatron_jetrl.job import load_job  # noqa: E402
from megatron_jetrl.job.config import check_exact_model, resolve  # noqa: E402
from megatron_jetrl.models import bridge_for  # noqa: E402
from megatron_jetrl.ops.exact import (VllmKernels, custom_ops, kv_pages, paged_kv, rope,  # noqa: E402
                                      rope_inv_freq, rope_reference, silu_mul, static_fp8_quant)
from megatron_jetrl.ops.extension import load_extension  # noqa: E402
from megatron_jetrl.ops.rms_norm import rms_norm_reference  # noqa: E402
from megatron_jetrl.precision import PrecisionMode, PrecisionRecipe  # noqa: E402

CONFIG = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False,
                         mrope_section=None)
ONE_RANK = SimpleNamespace(size=lambda: 1, rank=lambda: 0)


def _have_extension() -> bool:
    try:
        load_extension()
        return True
    except Exception:
        return False


needs_extension = pytest.mark.skipif(not _have_extension(), reason="megatron_jetrl._C is not built here")


# ------------------------------------------------------------------ ops defined once


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_is_megatrons_formula_and_frequencies(dtype):
    """``ops.exact.rope`` (what vLLM runs) = megatron's thd RoPE with its RotaryEmbedding angles."""
    g = torch.Generator().manual_seed(0)
    lengths, heads, dim, base = [7, 1, 130, 33], 4, 128, 1000000.0
    tokens = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    t = (torch.randn(tokens, heads, dim, generator=g) * 3).to(dtype)
    angles = torch.outer(torch.arange(max(lengths), dtype=torch.float32), rope_inv_freq(dim, base, t.device))
    freqs = torch.cat([angles, angles], dim=-1)[:, None, None, :]
    want = apply_rotary_pos_emb(t, freqs, CONFIG, cu_seqlens=cu, cp_group=ONE_RANK)
    got = rope_reference(t, packed_positions(cu, tokens), rope_inv_freq(dim, base, t.device))
    assert torch.equal(got, want)
    assert torch.equal(rope(t, packed_positions(cu, tokens), rope_inv_freq(dim, base, t.device)), want)  # CPU
    # and megatron's attention reaches it in an exact-mode model
    exact_config = SimpleNamespace(**vars(CONFIG), **{EXACT_ATTR: base})
    assert torch.equal(apply_rotary_pos_emb_packed(t, freqs, exact_config, cu_seqlens=cu, cp_group=ONE_RANK), want)


def test_rope_inv_freq_is_megatrons():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rotary = RotaryEmbedding(kv_channels=128, rotary_percent=1.0, rotary_base=1000000, use_cpu_initialization=True)
    assert torch.equal(rope_inv_freq(128, 1000000.0, torch.device("cpu")), rotary.inv_freq)


def test_silu_mul_is_megatrons_swiglu():
    """megatron's MLP: ``activation_func(x_glu) * (x_linear + glu_linear_offset)``, offset 0."""
    x = (torch.randn(64, 2 * 384) * 4).to(torch.bfloat16)
    gate, up = torch.chunk(x, 2, dim=-1)
    assert torch.equal(silu_mul(x), F.silu(gate) * (up + 0.0))


@needs_extension
def test_custom_ops_are_the_functions_and_trace_as_one_call():
    ops = custom_ops()
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(6, 256, generator=g) * 2).to(torch.bfloat16)
    r = (torch.randn(6, 256, generator=g)).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(256, generator=g)).to(torch.bfloat16)
    assert torch.equal(ops.rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))
    normed, total = ops.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(total, x + r) and torch.equal(normed, rms_norm_reference(x + r, w, 1e-6))
    gu = torch.randn(6, 512, generator=g).to(torch.bfloat16)
    assert torch.equal(ops.silu_mul(gu), silu_mul(gu))
    pos = torch.tensor([0, 1, 2, 0, 5, 9])
    q = torch.randn(6, 2 * 128, generator=g).to(torch.bfloat16)
    k = torch.randn(6, 128, generator=g).to(torch.bfloat16)
    inv = rope_inv_freq(128, 10000.0, q.device)
    qkv = torch.cat([q, k, k], dim=1)  # vLLM passes q and k as column slices of one qkv tensor
    rq, rk = ops.rope(pos, qkv[:, :256], qkv[:, 256:384], inv)
    assert torch.equal(rq, rope_reference(q.view(6, 2, 128), pos, inv).view(6, 256))
    assert torch.equal(rk, rope_reference(k.view(6, 1, 128), pos, inv).view(6, 128))

    def layer(x, r, w, gu, pos, q, k):
        n, t = ops.add_rms_norm(x, r, w, 1e-6)
        return n, t, ops.silu_mul(gu), *ops.rope(pos, q, k, inv)

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")(x, r, w, gu, pos, q, k)
    for got, want in zip(compiled, layer(x, r, w, gu, pos, q, k), strict=True):
        assert torch.equal(got, want)
    for op, args in ((torch.ops.jetrl.rms_norm, (x, w, 1e-6)), (torch.ops.jetrl.add_rms_norm, (x, r, w, 1e-6)),
                     (torch.ops.jetrl.silu_mul, (gu,)), (torch.ops.jetrl.rope, (pos, q, k, inv))):
        torch.library.opcheck(op, args)


@needs_extension
def test_exact_rms_norm_module_forward_is_the_kernel_and_backward_is_rms_norms():
    config = SimpleNamespace(use_cpu_initialization=True, params_dtype=torch.float32, sequence_parallel=False)
    norm = ExactRMSNorm(config, 256, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
    x = torch.randn(5, 3, 256, requires_grad=True)
    y = norm(x)
    assert torch.equal(y, rms_norm_reference(x.detach(), norm.weight.detach(), 1e-6))
    dy = torch.randn_like(y)
    y.backward(dy)
    xr, wr = x.detach().clone().requires_grad_(), norm.weight.detach().clone().requires_grad_()
    F.rms_norm(xr, (256,), wr, 1e-6).backward(dy)
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(norm.weight.grad, wr.grad)


# ------------------------------------------------------------------ the trainer's paged K/V


def test_paged_kv_puts_each_sequence_on_its_own_pages():
    lengths, page = [5, 16, 1, 40, 17], 16
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    tokens = sum(lengths)
    k = torch.randn(tokens, 2, 8)
    v = torch.randn(tokens, 2, 8)
    k_pages, v_pages, table, used = paged_kv(k, v, kv_pages(cu, packed_positions(cu, tokens), max(lengths), page))
    assert used.tolist() == lengths and table.dtype == torch.int32 and used.dtype == torch.int32
    assert table.shape == (len(lengths), -(-max(lengths) // page))
    for i, n in enumerate(lengths):
        rows_k = k_pages[table[i].long()].reshape(-1, 2, 8)
        rows_v = v_pages[table[i].long()].reshape(-1, 2, 8)
        assert torch.equal(rows_k[:n], k[cu[i]:cu[i + 1]]) and torch.equal(rows_v[:n], v[cu[i]:cu[i + 1]])
        pages = -(-n // page)
        assert not rows_k[n:pages * page].any()  # the rest of its last page is zero
        assert len(set(table[i, :pages].tolist())) == pages  # pages of its own
    used_pages = [p for i, n in enumerate(lengths) for p in table[i, :-(-n // page)].tolist()]
    assert len(used_pages) == len(set(used_pages))


def _segments_by_loop(cu, seq_lens, chunk):
    """(first token, keys seen, sequence) of every segment, by a plain loop."""
    want = []
    for i in range(len(cu) - 1):
        n = int(cu[i + 1]) - int(cu[i])
        context = int(seq_lens[i]) - n
        for a in range(0, n, chunk):
            want.append((int(cu[i]) + a, context + min(a + chunk, n), i))
    return want


def _check_segments(cu, seq_lens, table_in, chunk):
    from megatron_jetrl.ops.exact import query_segments

    tokens = int(cu[-1])
    cu_q, used, table = query_segments(cu, seq_lens, table_in, tokens, chunk)
    want = _segments_by_loop(cu, seq_lens, chunk)
    segments = tokens // chunk + len(cu) - 1
    assert cu_q.dtype == used.dtype == torch.int32 and cu_q.numel() == segments + 1
    assert [(int(cu_q[j]), int(used[j])) for j in range(len(want))] == [(f, u) for f, u, _ in want]
    for j, (_, _, i) in enumerate(want):
        assert torch.equal(table[j], table_in[i])
        assert int(cu_q[j + 1]) - int(cu_q[j]) <= chunk
    assert (cu_q[len(want):] == tokens).all() and (used[len(want):] == 0).all()  # empty segments after


def test_fp8_queries_are_cut_into_decode_sized_segments_on_both_sides():
    """With an FP8 KV cache both sides attend in segments of at most ``chunk`` queries of one
    sequence, each over its sequence's keys up to its last token: the trainer's packed sequences
    (no context), and vLLM's step, where a request's queries follow its cached tokens (a prefill
    after a prefix-cache hit, a chunked prefill's later part, a decode) and padded requests have
    none; unused segments are empty."""
    from megatron_jetrl.ops.exact import kv_pages
    from megatron_jetrl.precision.exact import ExactUnavailable, fp8_kv_query_chunk

    assert fp8_kv_query_chunk(32, 8) == 16 and fp8_kv_query_chunk(8, 4) == 32 and fp8_kv_query_chunk(4, 4) == 64
    with pytest.raises(ExactUnavailable):
        fp8_kv_query_chunk(128, 1)
    lengths, chunk = [5, 16, 1, 40, 17], 16
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    pages = kv_pages(cu, packed_positions(cu, sum(lengths)), max(lengths))
    _check_segments(cu, pages.seqused_k, pages.block_table, chunk)  # the trainer's
    # vLLM's: queries of 1 (decode), 300 (prefill after 32 cached tokens), 17, 0 (a padded request)
    queries, cached = [1, 300, 17, 0], [700, 32, 0, 0]
    cu = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([q + c for q, c in zip(queries, cached, strict=True)], dtype=torch.int32)
    table = torch.arange(4 * 50, dtype=torch.int32).view(4, 50)
    _check_segments(cu, seq_lens, table, chunk)


# ------------------------------------------------------------------ exact logprobs


def test_exact_logprobs_take_the_kernels_values_and_compileds_gradient():
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(9, 256, generator=g) * 3).to(torch.bfloat16)
    labels = torch.randint(0, 200, (9,), generator=g)
    calls = []

    def kernel(x, ids):  # a stand-in for vLLM's logprob kernel: [M, V] logits (any row stride), ids [M, k]
        calls.append((tuple(x.shape), x.stride(0), tuple(ids.shape)))
        return torch.log_softmax(x.float(), dim=-1).gather(1, ids) - 1.0  # not the compiled path's values

    a = logits.clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs(a, labels, vocab_start=0, vocab_size=200, with_entropy=True, impl="exact",
                                      token_logprobs=kernel)
    want = (torch.log_softmax(logits[:, :200].float(), -1) - 1.0).gather(1, labels[:, None]).squeeze(1)
    assert torch.equal(lp, want) and calls == [((9, 200), 256, (9, 1))]  # the logits as they are, no copy
    b = logits.clone().requires_grad_()
    lp_c, ent_c = vocab_parallel_logprobs(b, labels, vocab_start=0, vocab_size=200, with_entropy=True,
                                          impl="compiled")
    assert torch.equal(ent, ent_c)
    (lp.sum() + ent.sum()).backward()
    (lp_c.sum() + ent_c.sum()).backward()
    assert torch.equal(a.grad, b.grad)
    with pytest.raises(ValueError, match="token_logprobs kernel"):
        vocab_parallel_logprobs(logits, labels, vocab_start=0, vocab_size=200, impl="exact")


def test_mismatch_metrics_count_unequal_tokens():
    lp = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    m = mismatch_metrics(lp, lp.clone(), torch.ones(4))
    assert m["rollout_corr/unequal_tokens"] == 0 and m["rollout_corr/max_abs_dlogp"] == 0
    other = lp.clone()
    other[1] = torch.nextafter(other[1], torch.tensor(0.0))  # one ulp
    m = mismatch_metrics(other, lp, torch.tensor([1.0, 1.0, 0.0, 1.0]))
    assert m["rollout_corr/unequal_tokens"] == 1 and m["rollout_corr/max_abs_dlogp"] > 0
    assert m["rollout_corr/k3_kl"] >= 0


# ------------------------------------------------------------------ config


def test_recipe_exact_modes_and_environment():
    assert PrecisionRecipe(exact=True).vllm_env["VLLM_BATCH_INVARIANT"] == "1"
    assert PrecisionRecipe(mode=PrecisionMode.BF16, exact=True).vllm_env == {"VLLM_BATCH_INVARIANT": "1",
                                                                            "VLLM_USE_V2_MODEL_RUNNER": "1"}
    assert "VLLM_BATCH_INVARIANT" not in PrecisionRecipe().vllm_env
    for mode in (PrecisionMode.FP16, PrecisionMode.BF16_TRAIN_FP8_ROLLOUT):
        with pytest.raises(ConfigError, match="precision.exact"):
            PrecisionRecipe(mode=mode, exact=True)
    with pytest.raises(ConfigError, match="precision.exact"):
        PrecisionRecipe(exact="yes")
    assert PrecisionRecipe(exact=True).to_dict()["exact"] is True


EXACT = ["precision.exact=true", "rollout.engine=vllm"]


def test_an_exact_job_loads_and_round_trips():
    job = load_job("examples/configs/tiny_countdown.yaml", EXACT)
    assert job.precision.exact and job.actor.precision.exact
    assert load_job(None, raw=job.to_dict()) == job


@pytest.mark.parametrize("override, key", [
    ("rollout.engine=hf", "rollout.engine"),
    ("actor.fp8_backend=te", "actor.fp8_backend"),
    ("actor.fp8_backend=te precision.mode=bf16", "actor.fp8_backend"),  # TE's layers in BF16 too
    ("actor.attention_impl=te", "actor.attention_impl"),
    ("actor.parallel.tp=16 rollout.vllm.tensor_parallel_size=16", "actor.parallel.tp"),
    ("actor.parallel.tp=2", "rollout.vllm.tensor_parallel_size"),
    ("rollout.vllm.tensor_parallel_size=2", "rollout.vllm.tensor_parallel_size"),
    ("actor.parallel.pp=4", "actor.parallel.pp"),
    ("rollout.vllm.activation_quant=vllm", "rollout.vllm.activation_quant"),
    ("rollout.vllm.attention_backend=triton_attn", "rollout.vllm.attention_backend"),
    ("algo.correction.mode=token_tis", "algo.correction.mode"),
])
def test_layouts_that_cannot_be_exact_are_refused_naming_the_key(override, key):
    given = override.split()
    keys = {o.partition("=")[0] for o in given}
    base = [o for o in EXACT if o.partition("=")[0] not in keys]
    with pytest.raises(ConfigError) as e:
        load_job("examples/configs/tiny_countdown.yaml", [*base, *given])
    assert e.value.key == key and "precision.exact" in str(e.value)


@pytest.mark.parametrize("gemm", ["auto", "deep_gemm", "cutlass"])
def test_every_block_fp8_gemm_is_an_exact_layout(gemm):
    """The trainer's exact FProp calls whichever GEMM vLLM runs for each linear (``VllmKernels.fp8_gemm``),
    so every ``rollout.vllm.fp8_gemm`` is exact; ``auto`` is DeepGEMM, as in the default rollout."""
    job = load_job("examples/configs/tiny_countdown.yaml", [*EXACT, f"rollout.vllm.fp8_gemm={gemm}"])
    assert job.rollout.vllm.fp8_gemm_kernel == ("cutlass" if gemm == "cutlass" else "deep_gemm")


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_equal_tp_up_to_8_and_an_fp8_kv_cache_are_exact_layouts(tp):
    job = load_job("examples/configs/tiny_countdown.yaml",
                   [*EXACT, f"actor.parallel.tp={tp}", f"rollout.vllm.tensor_parallel_size={tp}"])
    assert job.actor.parallel.tp == job.rollout.vllm.tensor_parallel_size == tp
    fp8_kv = load_job("examples/configs/tiny_countdown.yaml", [*EXACT, "rollout.vllm.kv_cache_dtype=fp8"])
    assert fp8_kv.rollout.fp8_kv_cache


def test_the_exact_query_quantization_divides_clamps_and_rounds_to_nearest_even():
    """``static_fp8_quant``: x / scale in fp32 (an IEEE division), clamped to ±448, then E4M3's
    round-to-nearest-even: ties between two codes go to the even one."""
    scale = torch.tensor([0.5])
    # 1.0625 lies halfway between the E4M3 codes 1.0 and 1.125: to 1.0 (even); 1.1875 -> 1.25 (even)
    x = torch.tensor([0.53125, 0.59375, -0.53125, 1000.0, -1000.0, 0.0, 3e-3], dtype=torch.bfloat16)
    got = static_fp8_quant(x, scale).float()
    assert got.tolist()[:6] == [1.0, 1.25, -1.0, 448.0, -448.0, 0.0]
    g = torch.Generator().manual_seed(1)
    y = (torch.randn(64, 256, generator=g) * 50).to(torch.bfloat16)
    s = torch.tensor([0.173])
    want = torch.clamp(y.float() / s, -448.0, 448.0).to(torch.float8_e4m3fn)
    assert torch.equal(static_fp8_quant(y, s).view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(custom_ops().static_fp8_quant(y, s).view(torch.uint8), want.view(torch.uint8))


def test_the_plan_says_how_an_exact_fp8_kv_engine_attends():
    """``jetrl check``'s precision line: an exact rollout, and with an FP8 KV cache the query segments
    both sides attend in (64 / (query heads per KV head); the tiny model has 2 / 1)."""
    plain = load_job("examples/configs/tiny_countdown.yaml", EXACT)
    kv = load_job("examples/configs/tiny_countdown.yaml", [*EXACT, "rollout.vllm.kv_cache_dtype=fp8"])
    line = next(x for x in resolve(kv, 1).describe(kv) if x.startswith("precision"))
    assert "exact rollout with an FP8 KV cache (attention in segments of 32 queries; vLLM " in line, line
    plain_line = next(x for x in resolve(plain, 1).describe(plain) if x.startswith("precision"))
    assert ", exact rollout (vLLM " in plain_line, plain_line


def test_check_says_whether_the_engines_exactness_was_verified_on_a_gpu(monkeypatch):
    """The exact rollout was verified on a GPU with vLLM 0.26; another version may run it, and the
    start-up self-check of every exact job decides: ``jetrl check``'s precision line says which."""
    import importlib.metadata

    from megatron_jetrl.rollout.engines import ENGINES

    vllm = ENGINES["vllm"]
    for version, want in (("0.26.0", "vLLM 0.26.0: exactness GPU-verified"),
                          ("0.32.0", "vLLM 0.32.0: exactness not GPU-verified on this version, the start-up "
                                     "self-check decides")):
        monkeypatch.setattr(importlib.metadata, "version", lambda package, v=version: v)
        assert vllm.exact_status() == want and vllm.describe() == f"vllm engine, vLLM {version}"

    def missing(package):
        raise importlib.metadata.PackageNotFoundError(package)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert vllm.exact_status() == "vLLM not installed here"


def test_models_the_exact_forward_cannot_compute_are_refused():
    base = load_job("examples/configs/tiny_countdown.yaml", EXACT).model.hf_config_dict()
    check_exact_model(bridge_for(base))
    llama = {**base, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
             "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    with pytest.raises(ConfigError, match="scales its rotary embedding"):
        check_exact_model(bridge_for(llama))
    job = load_job("examples/configs/tiny_countdown.yaml", EXACT)
    with pytest.raises(ConfigError, match="multiple of 128"):
        resolve(job, 1, hf_config={**base, "hidden_size": 320, "intermediate_size": 640})


def test_an_exact_model_with_a_module_left_behind_is_refused():
    from megatron_jetrl.actor.build import check_exact

    config = SimpleNamespace(use_cpu_initialization=True, params_dtype=torch.float32, sequence_parallel=False)
    model = torch.nn.Module()
    model.norm = ExactRMSNorm(config, 128)
    check_exact(model)
    model.q_layernorm = torch.nn.RMSNorm(128)
    with pytest.raises(RuntimeError, match=r"q_layernorm \(RMSNorm\)"):
        check_exact(model)


def _trainer_double(exact: bool, update_logprobs: torch.Tensor, overrides=(), recompute_allowed=False):
    from megatron_jetrl.trainer import Trainer

    class Actor:
        calls: list = []
        measured = torch.full((2, 3), 0.25)

        stepped = 0

        def update(self, batch, loss_fn, *, with_logprobs=False, before_step=None):
            self.calls.append(("update", with_logprobs))
            if before_step is None or before_step(update_logprobs.clone()):
                self.stepped += 1
            if not with_logprobs:
                return {"loss": 0.5, "old_logprobs_seen": batch.fields["old_logprobs"].clone()}
            return {"loss": 0.5}, update_logprobs.clone()

        def compute_logprobs(self, batch, **kw):
            self.calls.append(("compute_logprobs",))
            if not recompute_allowed:
                raise AssertionError("the exact trainer skips the recompute pass")
            return SimpleNamespace(logprobs=update_logprobs.clone(), kv_scales=None)

        @contextlib.contextmanager
        def kv_scale_meter(self):
            self.calls.append(("meter",))
            meter = SimpleNamespace(scales=None)
            yield meter
            meter.scales = self.measured

        def use_rollout_kv_scales(self, scales):
            self.calls.append(("use_rollout_kv_scales", scales.tolist()))

        def weight_shards(self):
            return []

    job = load_job("examples/configs/tiny_countdown.yaml", [*(EXACT if exact else []), *overrides])
    synced = []
    logged: list[str] = []
    double = SimpleNamespace(job=job, actor=Actor(), loss_fn=None, kv_scales=torch.ones(2, 3), engine=None,
                             sync=SimpleNamespace(sync=lambda shards, engine, kv_scales: synced.append(kv_scales)),
                             colocation=SimpleNamespace(synced=lambda: None), synced=synced, step=7,
                             engine_description="vllm engine, vLLM 0.32.0", _any_rank=lambda flag: flag,
                             console=SimpleNamespace(log=logged.append, warn=lambda m: logged.append(f"WARNING: {m}")),
                             logged=logged)
    double._exact_mismatch_line = lambda mismatch: Trainer._exact_mismatch_line(double, mismatch)
    double.prepare_update = lambda batch, **kw: Trainer.prepare_update(double, batch, **kw)
    return double


def _two_sequences(rollout):
    from megatron_jetrl.actor import PackedBatch

    return PackedBatch.from_sequences([torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])],
                                      loss_mask=[torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0.0, 1.0, 1.0])],
                                      rollout_logprobs=[rollout[:3], rollout[3:]])


def test_the_exact_trainer_skips_the_recompute_and_measures_the_update_forward():
    from megatron_jetrl.trainer import Trainer

    rollout = torch.tensor([0.0, -1.0, -2.0, 0.0, -0.25, -3.0])
    batch = _two_sequences(rollout)
    trainer = _trainer_double(True, rollout)
    prepared, metrics, kv = Trainer.prepare_update(trainer, batch)
    assert torch.equal(prepared.fields["old_logprobs"], prepared.fields["rollout_logprobs"]) and kv is None
    assert metrics == {} and trainer.actor.calls == []
    m, measured = Trainer.update(trainer, prepared)
    assert trainer.actor.calls == [("update", True)] and m["actor/loss"] == 0.5 and measured is None
    assert m["rollout_corr/k3_kl"] == 0 and m["rollout_corr/unequal_tokens"] == 0
    assert trainer.actor.stepped == 1 and m["exact/corrected_step"] == 0


def _one_ulp_off(rollout: torch.Tensor) -> torch.Tensor:
    off = rollout.clone()
    off[4] = torch.nextafter(off[4], torch.tensor(0.0))
    return off


def test_a_step_whose_rollout_was_not_exact_stops_the_job_before_its_optimizer_step():
    """precision.exact_mismatch=stop (the default): one token one ulp off in the update's forward, and
    the job stops with one line (the step, the tokens, max |Δlogp|, the engine's version, what to do);
    the optimizer step on the rollout's logprobs is not taken. The negative control: exact logprobs step."""
    from megatron_jetrl.trainer import ExactMismatch, Trainer

    rollout = torch.tensor([0.0, -1.0, -2.0, 0.0, -0.25, -3.0])
    trainer = _trainer_double(True, _one_ulp_off(rollout))
    prepared, _, _ = Trainer.prepare_update(trainer, _two_sequences(rollout))
    with pytest.raises(ExactMismatch) as e:
        Trainer.update(trainer, prepared)
    line = str(e.value)
    assert "\n" not in line and "step 7" in line and "gave 1 response tokens" in line and "vLLM 0.32.0" in line
    assert "precision.exact_mismatch=correct" in line and "not applied" in line
    assert trainer.actor.stepped == 0 and trainer.actor.calls == [("update", True)]
    exact = _trainer_double(True, rollout)
    Trainer.update(exact, prepared)
    assert exact.actor.stepped == 1


def test_with_exact_mismatch_correct_such_a_step_recomputes_and_corrects_loudly():
    """precision.exact_mismatch=correct: the step's optimizer step on the rollout's logprobs is not
    taken; the old logprobs are recomputed, algo.correction applied (its weights in the batch), and the
    update runs on those; the console says so, the metrics mark the step."""
    from megatron_jetrl.trainer import Trainer

    rollout = torch.tensor([0.0, -1.0, -2.0, 0.0, -0.25, -3.0])
    off = _one_ulp_off(rollout)
    trainer = _trainer_double(True, off, ["precision.exact_mismatch=correct", "algo.correction.mode=token_tis"],
                              recompute_allowed=True)
    prepared, _, _ = Trainer.prepare_update(trainer, _two_sequences(rollout))
    m, _ = Trainer.update(trainer, prepared)
    assert trainer.actor.calls == [("update", True), ("compute_logprobs",), ("update", False)]
    assert trainer.actor.stepped == 1  # the corrected update only
    assert torch.equal(m["actor/old_logprobs_seen"], off)  # the recomputed old logprobs
    assert m["exact/corrected_step"] == 1 and m["exact/unequal_tokens"] == 1 and m["rollout_corr/unequal_tokens"] == 1
    assert "rollout_corr/is_weight_mean" in m  # the configured correction ran
    assert len(trainer.logged) == 1 and trainer.logged[0].startswith("WARNING: precision.exact: at step 7")


def test_exact_mismatch_settings_are_checked_with_the_job():
    with pytest.raises(ConfigError) as e:
        load_job("examples/configs/tiny_countdown.yaml", ["precision.exact_mismatch=correct"])
    assert e.value.key == "precision.exact_mismatch" and "precision.exact=true" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_job("examples/configs/tiny_countdown.yaml", [*EXACT, "precision.exact_mismatch=fix"])
    assert e.value.key == "precision.exact_mismatch"
    with pytest.raises(ConfigError) as e:  # a correction with nothing to correct
        load_job("examples/configs/tiny_countdown.yaml", [*EXACT, "algo.correction.mode=token_tis"])
    assert e.value.key == "algo.correction.mode" and "exact_mismatch=correct" in str(e.value)
    job = load_job("examples/configs/tiny_countdown.yaml",
                   [*EXACT, "precision.exact_mismatch=correct", "algo.correction.mode=token_tis"])
    assert job.precision.exact_mismatch == "correct" and load_job(None, raw=job.to_dict()) == job


def test_with_an_fp8_kv_cache_the_exact_update_measures_the_scales_both_sides_then_use():
    """No recompute pass measures the KV-cache scales in the exact mode: the update's forward does
    (it runs with the scales the rollout used), the sync ships them, and the actor's exact attention
    takes them for the next step. At start both sides get ``trainer.kv_scales`` (ones, or the
    checkpoint's), never vLLM's own defaults."""
    from megatron_jetrl.trainer import Trainer

    rollout = torch.tensor([0.0, -1.0, -2.0, 0.0, -0.25, -3.0])
    trainer = _trainer_double(True, rollout, ["rollout.vllm.kv_cache_dtype=fp8"])
    Trainer.sync_weights(trainer)  # the first sync
    assert [s.tolist() for s in trainer.synced] == [[[1.0] * 3] * 2]
    assert trainer.actor.calls == [("use_rollout_kv_scales", [[1.0] * 3] * 2)]
    trainer.actor.calls.clear()
    m, measured = Trainer.update(trainer, _two_sequences(rollout))
    assert trainer.actor.calls == [("meter",), ("update", True)] and measured is trainer.actor.measured
    Trainer.sync_weights(trainer, measured)
    assert trainer.synced[-1] is measured and trainer.kv_scales is measured
    assert trainer.actor.calls[-1] == ("use_rollout_kv_scales", [[0.25] * 3] * 2)
    # without an FP8 KV cache nothing is measured, shipped or handed to the actor
    plain = _trainer_double(True, rollout)
    assert Trainer.update(plain, _two_sequences(rollout))[1] is None
    Trainer.sync_weights(plain)
    assert plain.synced == [None] and plain.actor.calls == [("update", True)]


def test_trainer_rope_gradient_is_the_references():
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(9, 2, 64, generator=g) * 2).to(torch.bfloat16).requires_grad_()
    positions = torch.tensor([0, 1, 2, 3, 0, 1, 40000, 7, 8])
    inv = rope_inv_freq(64, 10000.0, x.device)
    y = exact_rope(x, positions, 10000.0)
    assert torch.equal(y, rope_reference(x.detach(), positions, inv))
    dy = torch.randn(y.shape, generator=g).to(y.dtype)
    (dx,) = torch.autograd.grad(y, x, dy)
    xr = x.detach().clone().requires_grad_()
    (want,) = torch.autograd.grad(rope_reference(xr, positions, inv), xr, dy)
    assert torch.equal(dx, want)


@needs_extension
def test_rope_kernel_names_what_is_wrong():
    ext = load_extension()
    x, pos, inv = torch.zeros(4, 2, 64), torch.arange(4), torch.ones(32)
    with pytest.raises(RuntimeError, match="runs on CUDA"):
        ext.rope(x, pos, inv)
    with pytest.raises(RuntimeError, match=r"3-D \[T, H, D\]"):
        ext.rope(x.view(4, 128), pos, inv)
    with pytest.raises(RuntimeError, match="must be even"):
        ext.rope(torch.zeros(4, 2, 63), pos, inv)


@needs_extension
def test_ordered_sum_off_cuda_is_its_reference_and_the_kernel_names_what_is_wrong():
    from megatron_jetrl.ops.exact import ordered_sum, ordered_sum_reference

    parts = (torch.randn(4, 3, 5) * torch.tensor([1.0, 300.0, 0.01, 37.0]).view(4, 1, 1)).bfloat16()
    want = ((parts[0].float() + parts[1].float() + parts[2].float()) + parts[3].float()).bfloat16()
    assert torch.equal(ordered_sum(parts), want) and torch.equal(ordered_sum_reference(parts), want)
    with pytest.raises(RuntimeError, match="runs on CUDA"):
        load_extension().ordered_sum(parts)


def test_the_fp8_kv_attention_backward_is_taken_at_the_values_the_cache_holds():
    """With an FP8 KV cache the forward attends over q, k, v rounded to the cache's E4M3 codes (and
    clamped by its scales): the backward differentiates the trainer's attention at those values,
    straight through the rounding, and passes no gradient where the clamp cut an element."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, h, 128, generator=g).bfloat16() for h in (2, 1, 1))
    scales = torch.tensor([1.5 / 448, 1.0, 2.5 / 448])  # q and v clip where |x| > 1.5 / 2.5; k never
    seen = {}

    def attention(qg, kg, vg, cu_seqlens, max_seqlen, scale):
        seen["at"] = (qg.detach().clone(), kg.detach().clone(), vg.detach().clone())
        return qg * (kg.float().sum() + vg.float().square().sum()).to(qg.dtype)

    out, lse = torch.zeros(6, 2, 128).bfloat16(), torch.zeros(2, 6)  # the forward's: recompute_backward ignores them
    ctx = SimpleNamespace(saved_tensors=(q, k, v, torch.tensor([0, 6], dtype=torch.int32), scales, out, lse),
                          args=(6, 0.1, recompute_backward(attention)))
    dout = torch.randn(6, 2, 128, generator=g).bfloat16()
    dq, dk, dv, *rest = _ExactAttentionFn.backward(ctx, dout)
    assert all(r is None for r in rest)
    at = [(static_fp8_quant(t, scales[i:i + 1]).float() * scales[i]).bfloat16() for i, t in enumerate((q, k, v))]
    for got, want in zip(seen["at"], at, strict=True):
        assert torch.equal(got, want)
    assert not torch.equal(seen["at"][0], q)  # the cache's values, not the BF16 inputs
    with torch.enable_grad():
        qg, kg, vg = (t.clone().requires_grad_() for t in at)
        want = torch.autograd.grad(attention(qg, kg, vg, None, 6, 0.1), (qg, kg, vg), dout)
    clipped_q, clipped_v = q.float().abs() > 1.5, v.float().abs() > 2.5
    assert clipped_q.any() and clipped_v.any() and (~clipped_q).any()
    assert torch.equal(dq, torch.where(clipped_q, torch.zeros((), dtype=dq.dtype), want[0]))
    assert torch.equal(dk, want[1])
    assert torch.equal(dv, torch.where(clipped_v, torch.zeros((), dtype=dv.dtype), want[2]))
    values, inside = fp8_cache_values(q, scales[0:1])
    assert torch.equal(values, at[0]) and torch.equal(inside, ~clipped_q)
    # over a BF16 cache: the gradient of the trainer's attention at the inputs themselves
    ctx.saved_tensors = (q, k, v, ctx.saved_tensors[3], None, out, lse)
    plain = _ExactAttentionFn.backward(ctx, dout)
    assert len(rest) == len(plain) - 3 == 7 and all(r is None for r in plain[3:])
    assert all(torch.equal(a, b) for a, b in zip(seen["at"], (q, k, v), strict=True))
    with torch.enable_grad():
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        want = torch.autograd.grad(attention(qg, kg, vg, None, 6, 0.1), (qg, kg, vg), dout)
    assert all(torch.equal(a, b) for a, b in zip(plain[:3], want, strict=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_compiled_cache_values_are_the_eager_ones_bit_for_bit(dtype):
    """The one kernel the FP8 KV backward runs on CUDA (torch.compile of ``cache_values_and_range``) gives
    the eager ops' values and range mask, here compiled for the CPU: at token counts that change (one
    compilation), on values inside, at and past the clamp, subnormal codes, signed zeros, inf and NaN."""
    from megatron_jetrl.ops.exact import static_fp8_quant

    compiled = _compiled_cache_values()
    scale = torch.tensor([2.0 / 448])
    g = torch.Generator().manual_seed(0)
    for tokens in (5, 37):
        t = (torch.randn(tokens, 3, 128, generator=g) * 1.5).to(dtype)
        flat = t.view(-1)
        flat[:8] = torch.tensor([2.0, -2.0, 2.0001, 0.0, -0.0, float("inf"), float("nan"), 1e-4]).to(dtype)
        codes = static_fp8_quant(t, scale)
        want, got = cache_values_and_range(t, codes, scale), compiled(t, codes, scale)
        assert got[0].dtype == dtype and got[1].dtype == torch.bool
        nan = want[0].isnan()  # a NaN's payload bits are the compiler's: only where NaN is must agree
        assert torch.equal(got[0].isnan(), nan) and nan.any()
        assert torch.equal(got[0][~nan].view(torch.int16), want[0][~nan].view(torch.int16))  # -0 and inf included
        assert torch.equal(got[1], want[1])
        assert want[1].logical_not().any() and want[1].any()


def _kernels(deep_gemm, calls: list) -> VllmKernels:
    """``VllmKernels`` whose two block-FP8 GEMMs record their arguments (CPU stand-ins: the real
    ones are CUDA kernels, tests/gpu/test_exact_kernels.py)."""
    def cutlass(a, b_t, *, scale_a, scale_b, out_dtype):
        calls.append(("cutlass", a, b_t, scale_a, scale_b))
        return torch.zeros(a.shape[0], b_t.shape[1], dtype=out_dtype)

    def dg(a_pair, b_pair, out, *, is_deep_gemm_e8m0_used):
        calls.append(("deep_gemm", *a_pair, *b_pair, is_deep_gemm_e8m0_used))
        out.fill_(1.0)

    return VllmKernels(bf16_gemm=None, cutlass_scaled_mm=cutlass, deep_gemm=dg if deep_gemm else None,
                       deep_gemm_takes=lambda dtype, shape: dtype == torch.bfloat16 and shape[0] % 64 == 0,
                       flash_attn_varlen_func=None, fa_version=3, descale_query=True, token_logprobs=None,
                       reshape_and_cache_flash=None)


def test_the_exact_fprop_calls_the_gemm_vllm_runs_for_each_linear():
    """DeepGEMM where vLLM runs it (and its rule takes the shape), with the activation's 1x128 scales
    column-major and fp32 weight scales (no power-of-two cast); CUTLASS otherwise, as vLLM falls back."""
    from megatron_jetrl.precision import Fp8Tensor

    a = Fp8Tensor(torch.zeros(3, 256, dtype=torch.float8_e4m3fn), torch.ones(2, 3).t(), (1, 128))  # strides (1, 3)
    w = Fp8Tensor(torch.zeros(128, 256, dtype=torch.float8_e4m3fn), torch.ones(1, 2), (128, 128))
    odd = Fp8Tensor(torch.zeros(96, 256, dtype=torch.float8_e4m3fn), torch.ones(1, 2), (128, 128))
    calls: list = []
    kernels = _kernels(True, calls)
    assert kernels.fp8_kernel(torch.bfloat16, 128, 256) == "deep_gemm"
    out = kernels.fp8_gemm(a, w, torch.bfloat16)
    assert out.shape == (3, 128) and out.dtype == torch.bfloat16 and bool((out == 1).all())
    kind, q, sa, wq, ws, e8m0 = calls[-1]
    assert kind == "deep_gemm" and q is a.data and wq is w.data and ws is w.scale_inv and e8m0 is False
    assert sa.stride() == (1, 3) and torch.equal(sa, a.scale_inv)
    assert kernels.fp8_kernel(torch.bfloat16, 96, 256) == "cutlass"  # vLLM's rule: N a multiple of 64
    kernels.fp8_gemm(a, odd, torch.bfloat16)
    assert calls[-1][0] == "cutlass" and calls[-1][2].shape == (256, 96)
    off: list = []
    assert _kernels(False, off).fp8_kernel(torch.bfloat16, 128, 256) == "cutlass"  # VLLM_USE_DEEP_GEMM=0
    _kernels(False, off).fp8_gemm(a, w, torch.bfloat16)
    assert off[-1][0] == "cutlass"


@pytest.mark.parametrize("pow2, m_align", [(False, 4), (True, 1)])
def test_the_fused_quantizing_ops_are_the_two_ops_in_turn(pow2, m_align):
    """``rms_norm_quant`` / ``silu_mul_quant`` (off CUDA: the two kernels in turn) equal their eager torch
    references: codes, scales and the scales' layout (the GPU kernels against both: tests/gpu/test_exact_kernels.py)."""
    from megatron_jetrl.ops.exact import (rms_norm_quant, rms_norm_quant_reference, silu_mul_quant,
                                          silu_mul_quant_reference)

    g = torch.Generator().manual_seed(7)
    x, r = ((torch.randn(9, 384, generator=g) * 5).to(torch.bfloat16) for _ in range(2))
    w = (torch.rand(384, generator=g) + 0.5).to(torch.bfloat16)
    options = dict(pow2_scales=pow2, quant_eps=0.0, m_align=m_align)
    for residual in (None, r):
        got, want = rms_norm_quant(x, w, 1e-6, residual, **options), rms_norm_quant_reference(x, w, 1e-6, residual,
                                                                                              **options)
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
        assert torch.equal(got[1], want[1]) and got[1].stride() == want[1].stride() == (1, -(-9 // m_align) * m_align)
        assert (got[2] is None and want[2] is None) if residual is None else torch.equal(got[2], want[2])
    gu = (torch.randn(9, 2 * 256, generator=g) * 4).to(torch.bfloat16)
    got, want = silu_mul_quant(gu, **options), silu_mul_quant_reference(gu, **options)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])


def test_the_exact_swiglu_is_megatrons_eager_forward_with_its_compiled_gradient():
    """``ExactSwiGLU`` (the exact layer spec's MLP activation): forward the bits of megatron's eager
    ``silu(gate) * up`` (what vLLM's exact SiLU·mul computes), gradient megatron's ``swiglu_back`` (the
    default mode's); a model whose MLP keeps another activation is refused."""
    from megatron.core.fusions.fused_bias_swiglu import swiglu_back
    from megatron.core.transformer.mlp import MLP

    from megatron_jetrl.actor.exact import ExactSwiGLU
    from megatron_jetrl.actor.build import check_exact

    config = SimpleNamespace(gated_linear_unit=True, activation_func=F.silu)
    act = ExactSwiGLU(config)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 2 * 256, generator=g) * 3).to(torch.bfloat16).requires_grad_()
    y = act(x)
    gate, up = x.detach().chunk(2, dim=-1)
    assert torch.equal(y, F.silu(gate) * up)
    dy = torch.randn(y.shape, generator=g).to(y.dtype)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert torch.equal(dx, swiglu_back(dy, x.detach()))
    with pytest.raises(Exception, match="SwiGLU"):
        ExactSwiGLU(SimpleNamespace(gated_linear_unit=False, activation_func=F.gelu))
    model = torch.nn.Module()
    model.mlp = MLP.__new__(MLP)  # only its activation is read
    torch.nn.Module.__init__(model.mlp)
    model.mlp.activation_func = act
    check_exact(model)
    del model.mlp.activation_func  # megatron's MLP keeps a plain function there without the exact spec
    model.mlp.activation_func = F.silu
    with pytest.raises(RuntimeError, match=r"mlp.activation_func \(silu\)"):
        check_exact(model)


def _self_check_double(trainer_logprobs):
    """A trainer whose engine samples two responses (the rollout's logprobs fixed) and whose actor
    scores them with ``trainer_logprobs`` (per packed token); it records the colocation's moves."""
    from megatron_jetrl.data.datasets import Prompt
    from megatron_jetrl.experience import Group, Response
    from megatron_jetrl.rollout import SamplingParams
    from megatron_jetrl.trainer import Trainer

    moves, logged = [], []
    prompts = [Prompt(i, (1, 2), None, "p") for i in range(20)]
    responses = {0: Response([3, 4], [-0.5, -1.0], True, 0.0, 0.0), 1: Response([5, 6], [-0.25, -2.0], True, 0.0, 0.0)}

    def generate(ps, sampling, *, seed):
        moves.append(("generate", len(ps), sampling.n, sampling.max_new_tokens, sampling.temperature))
        return list(range(len(ps))), None

    def score(ps, mine, samples, sampling):
        return [Group(i, (1, 2), [responses[i % 2]]) for i in range(len(ps))], 0, 0

    double = SimpleNamespace(
        train_set=prompts, sampling=SamplingParams(n=8, temperature=0.7, max_new_tokens=512, stop_token_ids=(9,)),
        colocation=SimpleNamespace(rollout_mode=lambda: moves.append("rollout"),
                                   train_mode=lambda: moves.append("train")),
        generate=generate, score=score, _seed=lambda r: 5, _any_rank=lambda flag: flag,
        console=SimpleNamespace(log=logged.append), engine_description="vllm engine, vLLM 0.32.0",
        actor=SimpleNamespace(compute_logprobs=lambda batch: SimpleNamespace(logprobs=trainer_logprobs(batch))),
        moves=moves, logged=logged, SELF_CHECK_PROMPTS=Trainer.SELF_CHECK_PROMPTS,
        SELF_CHECK_TOKENS=Trainer.SELF_CHECK_TOKENS)
    return double


def test_an_exact_job_starts_only_after_its_self_check_finds_the_engines_logprobs():
    """Before step 1: a few of the first prompts sampled by the engine (one response each, temperature
    1, no stops) and scored by the trainer; equal bits: the start goes on, saying so. One token one ulp
    off: the start ends with one line naming the engine's version and the fix (the negative control)."""
    from megatron_jetrl.trainer import ExactMismatch, Trainer

    same = _self_check_double(lambda batch: batch.fields["rollout_logprobs"].clone())
    metrics = Trainer.exact_self_check(same)
    assert metrics["rollout_corr/unequal_tokens"] == 0 and metrics["rollout_corr/k3_kl"] == 0
    assert same.moves == ["rollout", ("generate", 8, 1, 32, 1.0), "train"]
    assert len(same.logged) == 1 and "16 sampled tokens have the trainer's logprobs bit for bit" in same.logged[0]

    def one_off(batch):
        lp = batch.fields["rollout_logprobs"].clone()
        lp[3] = torch.nextafter(lp[3], torch.tensor(0.0))
        return lp

    with pytest.raises(ExactMismatch) as e:
        Trainer.exact_self_check(_self_check_double(one_off))
    line = str(e.value)
    assert "found 1 of 16 sampled tokens" in line and "vLLM 0.32.0" in line and "precision.exact=false" in line


# -- precision.exact: auto (a job's default) ------------------------------------------------------------

TINY = "examples/configs/tiny_countdown.yaml"


def test_auto_is_exact_wherever_the_job_allows_it():
    job = load_job(TINY, ["rollout.engine=vllm"])
    assert job.precision.exact and job.actor.precision.exact and job.precision.exact_auto == ""
    assert job.to_dict()["precision"]["exact"] == "auto" and load_job(None, raw=job.to_dict()) == job
    assert ", exact rollout (" in resolve(job, 1).describe(job)[1]


@pytest.mark.parametrize("override, key", [
    ("algo.correction.mode=token_tis", "algo.correction.mode=token_tis"),
    ("precision.mode=fp16", "mode 'fp16' has none"),
    ("model.config.head_dim=64", "head_dim is 64"),  # the model's shape, from its config read at load
])
def test_auto_runs_the_default_rollout_elsewhere_and_says_why(override, key):
    job = load_job(TINY, ["rollout.engine=vllm", override])  # also the hf engine: below
    assert not job.precision.exact and not job.actor.precision.exact
    assert key in job.precision.exact_auto, job.precision.exact_auto
    line = resolve(job, 1).describe(job)[1]
    assert "not exact (precision.exact=auto: " in line and key in line, line
    assert load_job(None, raw=job.to_dict()) == job
    hf = load_job(TINY)  # the tiny example's own engine
    assert not hf.precision.exact and "rollout.engine=hf" in hf.precision.exact_auto


def test_true_refuses_what_auto_passes_over_and_false_opts_out():
    with pytest.raises(ConfigError) as e:
        load_job(TINY, [*EXACT, "algo.correction.mode=token_tis"])
    assert e.value.key == "algo.correction.mode"
    off = load_job(TINY, ["rollout.engine=vllm", "precision.exact=false"])
    assert not off.precision.exact and off.precision.exact_auto is None
    assert off.to_dict()["precision"]["exact"] is False and "exact" not in resolve(off, 1).describe(off)[1]
    with pytest.raises(ConfigError, match=r"precision.exact: got 'sometimes'; must be true, false or auto"):
        load_job(TINY, ["precision.exact=sometimes"])
