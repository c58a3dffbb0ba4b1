"""The exact rollout's vLLM side against the installed vLLM (0.32), on the CPU: with the replacements
installed, vLLM's real Qwen3 builds every norm, activation and rotary module as the exact op, each
computing what ``ops/exact.py`` computes, as one opaque call under torch.compile; the engine's
arguments ask for FlashAttention with the trainer's page size; without the replacements, the
engine's check names every module left on vLLM's own kernel. (That vLLM's logprobs then equal
the trainer's is a GPU test: tests/gpu/test_exact.py.)"""

import pytest

vllm = pytest.importorskip("vllm", reason="vllm not installed; runs in the vLLM venv of .ci/run")

import torch  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402

from megatron_jetrl.ops.exact import rope_inv_freq, rope_reference, silu_mul  # noqa: E402
from megatron_jetrl.precision.exact import KV_PAGE  # noqa: E402
from megatron_jetrl.ops.rms_norm import rms_norm_reference  # noqa: E402
from megatron_jetrl.precision import PrecisionMode, PrecisionRecipe  # noqa: E402
from megatron_jetrl.rollout import vllm_exact  # noqa: E402
from tests.contract.vllm_cpu import build_vllm_model, cpu_vllm_config, tiny_model, write_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("vllm_world")


@pytest.fixture
def exact_model(tmp_path):
    """vLLM's Qwen3 built with the replacements installed (removed again after the test)."""
    model_dir = write_config(tiny_model("Qwen3ForCausalLM"), tmp_path / "ckpt")
    config = cpu_vllm_config(model_dir, PrecisionRecipe(mode=PrecisionMode.BF16, exact=True))
    vllm_exact.install()
    try:
        yield config, build_vllm_model(config)
    finally:
        vllm_exact.uninstall()


def test_engine_arguments_ask_for_flash_attention_and_the_trainers_pages(exact_model):
    config, _ = exact_model
    assert config.cache_config.block_size == KV_PAGE
    assert config.attention_config.backend.name == "FLASH_ATTN"


def test_every_norm_activation_and_rotary_is_the_exact_op(exact_model):
    config, model = exact_model
    counts, wrong = vllm_exact.replaced_modules(model)
    assert not wrong, wrong
    assert counts["norms"] == 2 * 4 + 1 and counts["activations"] == 2 and counts["rotary"] >= 1, counts
    assert counts["attention"] == 2
    layer = model.model.layers[1]
    g = torch.Generator().manual_seed(0)
    h = layer.input_layernorm.weight.shape[0]
    x = torch.randn(5, h, generator=g).to(torch.bfloat16)
    r = torch.randn(5, h, generator=g).to(torch.bfloat16)
    w, eps = layer.input_layernorm.weight.detach(), layer.input_layernorm.variance_epsilon
    with set_current_vllm_config(config), torch.no_grad():
        normed, total = layer.input_layernorm(x, r)
        assert torch.equal(total, x + r) and torch.equal(normed, rms_norm_reference(x + r, w, eps))
        assert torch.equal(layer.input_layernorm(x), rms_norm_reference(x, w, eps))
        gu = torch.randn(5, 1024, generator=g).to(torch.bfloat16)
        assert torch.equal(layer.mlp.act_fn(gu), silu_mul(gu))
        attn = layer.self_attn
        pos = torch.tensor([0, 3, 1, 7, 2])
        q = torch.randn(5, attn.q_size, generator=g).to(torch.bfloat16)
        k = torch.randn(5, attn.kv_size, generator=g).to(torch.bfloat16)
        rq, rk = attn.rotary_emb(pos, q, k)
        d, inv = attn.head_dim, rope_inv_freq(attn.head_dim, float(attn.rotary_emb.base), q.device)
        assert torch.equal(attn.rotary_emb.jetrl_inv_freq, inv)  # the trainer's frequencies, kept as a buffer
        # a buffer of the model: vLLM saves and restores those around a level-2 sleep
        assert any(name.endswith("rotary_emb.jetrl_inv_freq") for name, _ in model.named_buffers())
        assert torch.equal(rq, rope_reference(q.view(5, -1, d), pos, inv).view(5, -1))
        assert torch.equal(rk, rope_reference(k.view(5, -1, d), pos, inv).view(5, -1))
        # vLLM compiles the model in one graph: each op stays one opaque call with the same values
        compiled = torch.compile(lambda a, b: layer.input_layernorm(a, b), fullgraph=True, backend="aot_eager")
        c_normed, c_total = compiled(x, r)
        assert torch.equal(c_normed, normed) and torch.equal(c_total, total)


def test_without_the_replacements_the_check_names_the_modules(tmp_path):
    model_dir = write_config(tiny_model("Qwen3ForCausalLM"), tmp_path / "ckpt")
    model = build_vllm_model(cpu_vllm_config(model_dir, PrecisionRecipe(mode=PrecisionMode.BF16, exact=True)))
    counts, wrong = vllm_exact.replaced_modules(model)
    assert counts["norms"] == 9 and len(wrong) == 9 + 2 + counts["rotary"], wrong
    assert any("input_layernorm: RMSNorm" in w for w in wrong) and any("SiluAndMul" in w for w in wrong)


def test_install_is_idempotent_and_uninstall_restores_vllms_classes():
    from vllm.model_executor.custom_op import op_registry_oot

    vllm_exact.install()
    vllm_exact.install()
    assert all(getattr(op_registry_oot[n], "jetrl_exact", False) for n in ("RMSNorm", "SiluAndMul", "RotaryEmbedding"))
    builder = vllm_exact._metadata_builder()
    assert builder.build.jetrl_exact and builder.build.jetrl_original.__qualname__.endswith("Builder.build")
    vllm_exact.uninstall()
    assert not any(n in op_registry_oot for n in ("RMSNorm", "SiluAndMul", "RotaryEmbedding"))
    assert not getattr(builder.build, "jetrl_exact", False)


def test_the_exact_query_quantization_of_an_fp8_kv_cache_is_the_trainers_op(tmp_path):
    """With an FP8 KV cache vLLM quantizes the query by its per-layer scale (a static per-tensor
    ``QuantFP8``); in the exact mode that is ``jetrl::static_fp8_quant``, one opaque call under
    torch.compile, the op the trainer's exact attention calls; also with the per-head groups vLLM
    asks for where the model has one KV head (one scale). Several per-head scales have no exact op."""
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    from megatron_jetrl.ops.exact import static_fp8_quant
    from megatron_jetrl.rollout import vllm_activation_quant

    config = cpu_vllm_config(write_config(tiny_model("Qwen3ForCausalLM"), tmp_path / "ckpt"),
                             PrecisionRecipe(exact=True))
    vllm_activation_quant.install(False, 0.0, exact=True)
    try:
        with set_current_vllm_config(config):
            quant = QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR)
            per_head = QuantFP8(static=True, group_shape=GroupShape(-1, 256))  # what one KV head gets
        assert type(quant).__name__ == "TrainerQuantFP8" and quant.jetrl_exact_static and per_head.jetrl_exact_static
        g = torch.Generator().manual_seed(0)
        x = (torch.randn(7, 512, generator=g) * 300).to(torch.bfloat16)  # some beyond ±448 after scaling
        scale = torch.tensor([0.37])
        want = static_fp8_quant(x, scale)
        assert want.dtype == torch.float8_e4m3fn and float(want.float().abs().max()) == 448.0
        for forward in (quant.forward_native, quant.forward_cuda):
            q, s = forward(x, scale)
            assert torch.equal(q.view(torch.uint8), want.view(torch.uint8)) and s is scale
        compiled = torch.compile(lambda a, b: quant.forward_native(a, b)[0], fullgraph=True, backend="aot_eager")
        assert torch.equal(compiled(x, scale).view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(per_head.forward_native(x, scale)[0].view(torch.uint8), want.view(torch.uint8))
        with pytest.raises(RuntimeError, match="no exact kernel"):  # per-head scales of several KV heads
            per_head.forward_native(x, torch.tensor([0.37, 0.5]))
    finally:
        vllm_activation_quant.uninstall()


def _flash_metadata(**given):
    """vLLM's FlashAttention metadata of one step: ``given`` fields, the other required ones None."""
    import dataclasses

    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadata

    required = {f.name: None for f in dataclasses.fields(FlashAttentionMetadata)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    return FlashAttentionMetadata(**{**required, **given})


def test_with_an_fp8_kv_cache_a_prefill_attends_in_the_trainers_query_segments(tmp_path):
    """An exact engine with an FP8 KV cache schedules whole prefills (no cap on a request's new tokens
    a step); its FlashAttention metadata builder cuts a step's queries into the segments of at most
    ``fp8_kv_query_chunk`` tokens the trainer attends in (``ops.exact.query_segments``), so every call
    runs the kernel a decode step runs. A step of decode-sized queries, and a BF16 cache, stay as vLLM
    built them."""
    from types import SimpleNamespace

    from megatron_jetrl.ops.exact import query_segments
    from megatron_jetrl.precision.exact import fp8_kv_query_chunk
    from megatron_jetrl.rollout.vllm_engine import VllmOptions

    model = tiny_model("Qwen3ForCausalLM")
    hf, model_dir = model.config, write_config(model, tmp_path / "ckpt")
    fp8 = cpu_vllm_config(model_dir, PrecisionRecipe(exact=True), VllmOptions(kv_cache_dtype="fp8"))
    assert not fp8.scheduler_config.long_prefill_token_threshold
    kwargs = vllm_exact.llm_kwargs({"kv_cache_dtype": "fp8"})
    assert kwargs["compilation_config"]["cudagraph_mode"] == "FULL_AND_PIECEWISE"  # segmented steps: no full graph
    chunk = fp8_kv_query_chunk(hf.num_attention_heads, hf.num_key_value_heads)
    builder = SimpleNamespace(cache_config=SimpleNamespace(cache_dtype="fp8"), num_heads_q=hf.num_attention_heads,
                              num_heads_kv=hf.num_key_value_heads)
    queries, cached = [1, 3 * chunk + 5, 2], [40, 16, 0]  # a decode, a prefill after a prefix-cache hit, a prefill
    cu = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([q + c for q, c in zip(queries, cached, strict=True)], dtype=torch.int32)
    table = torch.arange(3 * 8, dtype=torch.int32).view(3, 8)
    step = _flash_metadata(num_actual_tokens=int(cu[-1]), max_query_len=max(queries), query_start_loc=cu,
                           max_seq_len=int(seq_lens.max()), seq_lens=seq_lens, block_table=table,
                           slot_mapping=torch.arange(int(cu[-1])))
    segmented = vllm_exact.fp8_kv_segmented(builder, step)
    want = query_segments(cu, seq_lens, table, int(cu[-1]), chunk)
    assert segmented.max_query_len == chunk and segmented.num_actual_tokens == step.num_actual_tokens
    for got, expected in zip((segmented.query_start_loc, segmented.seq_lens, segmented.block_table), want,
                             strict=True):
        assert torch.equal(got, expected)
    assert segmented.slot_mapping is step.slot_mapping and segmented.max_seq_len == step.max_seq_len
    decode = _flash_metadata(**{**{f: getattr(step, f) for f in ("num_actual_tokens", "query_start_loc",
                                                                  "max_seq_len", "seq_lens", "block_table",
                                                                  "slot_mapping")}, "max_query_len": chunk})
    assert vllm_exact.fp8_kv_segmented(builder, decode) is decode
    bf16 = SimpleNamespace(**{**vars(builder), "cache_config": SimpleNamespace(cache_dtype="auto")})
    assert vllm_exact.fp8_kv_segmented(bf16, step) is step


def test_an_exact_fp8_engine_compiles_with_the_fusion_pass(tmp_path):
    """vLLM takes the pass as its ``post_grad_custom_post_pass`` (an ``InductorPass``), and its compile
    cache key stays the same from one engine start to the next (the pass's uuid, not its address)."""
    from vllm.compilation.passes.inductor_pass import InductorPass

    model_dir = write_config(tiny_model("Qwen3ForCausalLM"), tmp_path / "ckpt")
    configs = [cpu_vllm_config(model_dir, PrecisionRecipe(exact=True)) for _ in range(2)]
    fusion = [c.compilation_config.inductor_compile_config.get("post_grad_custom_post_pass") for c in configs]
    assert all(isinstance(f, InductorPass) for f in fusion) and fusion[0] is not fusion[1]
    assert fusion[0].uuid() == fusion[1].uuid()
    assert configs[0].compilation_config.compute_hash() == configs[1].compilation_config.compute_hash()
    bf16 = cpu_vllm_config(model_dir, PrecisionRecipe(mode=PrecisionMode.BF16, exact=True))
    assert "post_grad_custom_post_pass" not in bf16.compilation_config.inductor_compile_config  # no quantization


# -- above TP 2: vLLM's TP all-reduce in the exact order -----------------------------------------------

TP4 = 4


def _tp4_partials() -> torch.Tensor:
    """[4, 6, 256] BF16 partial results of very different magnitudes (as in tests/dist/test_ordered_tp_reduce.py)."""
    g = torch.Generator().manual_seed(5)
    return (torch.randn(TP4, 6, 256, generator=g) * torch.tensor([1.0, 300.0, 0.01, 37.0]).view(TP4, 1, 1)).to(
        torch.bfloat16)


def _tp4_worker(rank, tmp, results):
    try:
        from vllm.distributed.parallel_state import get_tp_group

        from tests.contract.vllm_cpu import init_vllm_distributed

        init_vllm_distributed(tmp / "tp4-store", world_size=TP4, rank=rank, tp=TP4)
        group, parts = get_tp_group(), _tp4_partials()
        before = group.all_reduce(parts[rank].clone())  # vLLM's own all-reduce
        vllm_exact.install()
        try:
            assert group.unique_name.startswith("tp:") and type(group)._all_reduce_out_place.jetrl_exact
            exact = group.all_reduce(parts[rank].clone())
        finally:
            vllm_exact.uninstall()
        after = group.all_reduce(parts[rank].clone())
        results.put((rank, [t.view(torch.int16).tolist() for t in (before, exact, after)], None))
    except BaseException as e:  # reported to the test
        import traceback

        results.put((rank, None, f"{e!r}\n{traceback.format_exc()}"))


def test_above_tp_2_the_exact_all_reduce_sums_the_ranks_in_order(tmp_path):
    """At TP 4 with the replacements installed, vLLM's TP all-reduce (what its row-parallel linears and
    embedding call) gives every rank the ordered fp32 sum of the partial results (``ops.exact.ordered_sum``,
    the trainer's ``ordered_tp_reduce``); uninstalled, vLLM's own all-reduce is back. Negative controls:
    vLLM's own all-reduce, and a BF16 sum rounded at every step, give other bits for these partials."""
    import torch.multiprocessing as mp

    from megatron_jetrl.ops.exact import ordered_sum

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_tp4_worker, args=(r, tmp_path, results)) for r in range(TP4)]
    for p in procs:
        p.start()
    got = dict((rank, (out, err)) for rank, out, err in (results.get(timeout=600) for _ in procs))
    for p in procs:
        p.join(timeout=60)
    assert all(err is None for _, err in got.values()), "\n".join(err for _, err in got.values() if err)
    parts = _tp4_partials()
    want = ordered_sum(parts)
    stepwise = parts[0]
    for part in parts[1:]:
        stepwise = stepwise + part
    assert not torch.equal(want, stepwise)
    for rank, (out, _) in got.items():
        before, exact, after = (torch.tensor(t, dtype=torch.int16).view(torch.bfloat16) for t in out)
        assert torch.equal(exact, want), f"rank {rank}: the exact all-reduce is not the rank-order fp32 sum"
        assert torch.equal(before, after), f"rank {rank}: uninstall did not bring vLLM's all-reduce back"
        assert not torch.equal(before, want), f"rank {rank}: vLLM's own all-reduce (gloo's here) gave the ordered " \
                                              "sum's bits: the negative control sees no difference"


def test_an_exact_engine_above_tp_2_turns_off_the_passes_that_rewrite_the_all_reduce():
    four = vllm_exact.llm_kwargs({"tensor_parallel_size": 4})
    passes = four["compilation_config"]["pass_config"]
    assert passes and all(passes[name] is False for name in passes), passes
    assert set(passes) <= set(vllm_exact.REWRITING_PASSES) and "fuse_allreduce_rms" in passes
    two = vllm_exact.llm_kwargs({"tensor_parallel_size": 2})
    assert "pass_config" not in two.get("compilation_config", {})


def test_vllms_batch_invariant_nccl_settings_do_not_outlive_the_engine_start(monkeypatch):
    """vLLM's own override (what its worker runs in batch-invariant mode) inside the exact engine's
    guard: every NCCL variable it sets is one of ``VLLM_NCCL_PINS`` (a pin added by a later vLLM fails
    here), and afterwards each has the job's value again."""
    import os

    from vllm.model_executor.determinism import batch_invariant
    from vllm.utils import nccl as nccl_utils

    saved = dict(os.environ)
    monkeypatch.setattr(nccl_utils, "_unpinned_env", None)  # vLLM's record of the values before its pins
    try:
        os.environ["NCCL_PROTO"] = "LL128"  # a job's own setting
        os.environ.pop("NCCL_MAX_NCHANNELS", None)
        job = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
        with vllm_exact.job_nccl_environment() as undone:
            batch_invariant.override_envs_for_invariance()
            pinned = {k for k in set(os.environ) | set(job)
                      if k.startswith("NCCL_") and os.environ.get(k) != job.get(k)}
        assert pinned and pinned <= set(vllm_exact.VLLM_NCCL_PINS), pinned - set(vllm_exact.VLLM_NCCL_PINS)
        assert {k: v for k, v in os.environ.items() if k.startswith("NCCL_")} == job
        assert undone["NCCL_MAX_NCHANNELS"] == "1" and undone["NCCL_PROTO"] == "Simple", undone
    finally:
        os.environ.clear()
        os.environ.update(saved)
