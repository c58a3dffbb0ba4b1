"""The vllm rollout engine against the installed vLLM (0.32): vLLM's real Qwen3 and Llama classes,
built on the CPU from the engine's own ``vllm.LLM`` arguments, load what the weight sync ships
through vLLM's own loaders, and hold exactly those bytes afterwards, at the first load and at every
weight update after (the checkpoint-format reload), at rollout TP 1 and TP 2 (pre-sharded).

The two stubs (the block-FP8 kernel choice, and vLLM's CPU-feature check that would pick a kernel the
CPU wheel lacks on AMX hosts) and why ``vllm.LLM`` itself is stood in for are explained in
``tests/contract/vllm_cpu.py``.
"""

import json

import pytest

vllm = pytest.importorskip("vllm", reason="vllm not installed; runs in the vLLM venv of .ci/run")

import torch
import torch.multiprocessing as mp
from vllm.logprobs import FlatLogprobs, Logprob, create_sample_logprobs
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod
from vllm.config import set_current_vllm_config
from vllm.outputs import CompletionOutput, RequestOutput

from megatron_jetrl.config import ConfigError
from megatron_jetrl.models import bridge_for
from megatron_jetrl.models.fp8_export import to_fp8_block
from megatron_jetrl.precision import Fp8Options, PrecisionMode, PrecisionRecipe, quantize_fp8_blockwise
from megatron_jetrl.rollout.base import SamplingParams, TensorMeta, WeightMismatch
from megatron_jetrl.rollout.vllm_engine import VllmEngine, VllmOptions, engine_env, samples_from_outputs
from megatron_jetrl.rollout.vllm_model import DirectTargets, LayerwiseUpdate, fp8_kv_attention, model_weight_specs
from megatron_jetrl.sync import engine_tensors_from_full
from tests.contract.vllm_cpu import (
    ARCHS,
    InProcessLLM,
    assert_params_equal,
    build_vllm_model,
    cpu_vllm_config,
    engine_config,
    expected_params,
    init_vllm_distributed,
    tiny_model,
    write_config,
)

RECIPES = {
    "fp8": PrecisionRecipe(),
    "fp8-bf16-first-layer": PrecisionRecipe(fp8=Fp8Options(bf16_first_layers=1)),
}
E8M0_OFF = ("VLLM_USE_DEEP_GEMM_E8M0", "0")
KV_ATTRS = ("_q_scale", "_k_scale", "_v_scale", "_q_scale_float", "_k_scale_float", "_v_scale_float", "_k_scale_cpu",
            "_v_scale_cpu")
"""What an attention layer's FP8 KV cache reads: device scales, their floats and host copies."""


def rollout_tensors(hf_model, recipe, rollout_tp=1, rollout_rank=0) -> list[tuple[str, torch.Tensor]]:
    """What the weight sync ships to rollout rank ``rollout_rank`` for this model's weights."""
    bridge = bridge_for(hf_model.config.to_dict())
    hf = hf_model.state_dict()
    megatron = {s.megatron: bridge.to_megatron(s, hf.__getitem__) for s in bridge.tensor_map()}
    return list(engine_tensors_from_full(bridge, recipe, megatron, rollout_tp=rollout_tp, rollout_rank=rollout_rank))


def buckets(tensors, size=5):
    """Sync buckets that cut through layers, so a layer's tensors span several loads."""
    return [tensors[i : i + size] for i in range(0, len(tensors), size)]


def metas(tensors):
    return {n: TensorMeta(tuple(t.shape), t.dtype) for n, t in tensors}


@pytest.fixture(scope="module", autouse=True)
def _world(vllm_world):
    """vLLM's world and TP groups (conftest: once per process)."""


# -- what the engine asks of vLLM ---------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_llm_arguments_build_a_block_fp8_model_config(arch, tmp_path):
    model_dir = write_config(tiny_model(arch), tmp_path / "ckpt")
    cfg = cpu_vllm_config(model_dir, PrecisionRecipe(), VllmOptions(tensor_parallel_size=1, kv_cache_dtype="fp8"))
    assert isinstance(cfg.quant_config, Fp8Config)
    assert cfg.quant_config.weight_block_size == [128, 128]
    assert cfg.quant_config.activation_scheme == "dynamic" and cfg.quant_config.is_checkpoint_fp8_serialized
    names = bridge_for(tiny_model(arch).config.to_dict()).linear_names
    want = PrecisionRecipe().quantization_config(2, linear_names=names)
    assert cfg.model_config.hf_config.quantization_config == want
    assert cfg.model_config.logprobs_mode == "raw_logprobs"
    assert cfg.model_config.dtype == torch.bfloat16
    assert cfg.load_config.load_format == "dummy"
    assert cfg.parallel_config.distributed_executor_backend == "external_launcher"
    assert cfg.cache_config.cache_dtype == "fp8"

    fp16 = cpu_vllm_config(model_dir, PrecisionRecipe(mode=PrecisionMode.FP16))
    assert fp16.model_config.dtype == torch.float16

    # The recipe decides, whatever the checkpoint's config.json says (here: an FP8 export's).
    exported = write_config(tiny_model(arch), tmp_path / "fp8-export")
    config = json.loads((exported / "config.json").read_text())
    config["quantization_config"] = PrecisionRecipe().quantization_config(2, linear_names=names)
    (exported / "config.json").write_text(json.dumps(config))
    bf16 = cpu_vllm_config(exported, PrecisionRecipe(mode=PrecisionMode.BF16))
    assert bf16.quant_config is None and bf16.model_config.quantization is None
    keep_first = PrecisionRecipe(fp8=Fp8Options(bf16_first_layers=1))
    assert cpu_vllm_config(exported, keep_first).quant_config.ignored_layers == keep_first.quantization_config(
        2, linear_names=names)["ignored_layers"]


def test_sampling_maps_to_valid_vllm_params():
    engine = object.__new__(VllmEngine)
    engine._vllm = vllm
    s = SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=-1, max_new_tokens=12, stop_token_ids=(7, 9), seed=5)
    p = engine._vllm_sampling(s, prompt=2)
    assert isinstance(p, vllm.SamplingParams)
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens) == (3, 0.7, 0.9, 0, 12)
    assert p.stop_token_ids == [7, 9] and p.ignore_eos and p.logprobs == 0 and not p.detokenize
    assert p.flat_logprobs  # vLLM keeps the logprobs in flat lists (few objects for the GC)
    assert p.seed == 5 + 2 * 3
    top4 = engine._vllm_sampling(SamplingParams(top_k=4), prompt=0)
    assert top4.top_k == 4 and top4.seed is None
    assert engine._vllm_sampling(SamplingParams(temperature=0.0), prompt=0).temperature == 0.0


def test_samples_from_vllm_outputs():
    def completion(index, tokens, logprobs, reason):
        return CompletionOutput(index=index, text="", token_ids=tokens, cumulative_logprob=sum(logprobs),
                                logprobs=[{t: Logprob(lp, rank=1), t + 1: Logprob(-9.0, rank=2)}
                                          for t, lp in zip(tokens, logprobs, strict=True)],
                                finish_reason=reason, stop_reason=tokens[-1] if reason == "stop" else None)

    outputs = [
        RequestOutput("0", None, [1, 2], None, [completion(1, [5, 6], [-0.5, -0.25], "length"),
                                                completion(0, [4, 9], [-1.0, -2.0], "stop")], True),
        RequestOutput("1", None, [3], None, [completion(0, [8], [-0.125], "length"),
                                             completion(1, [9], [-3.0], "stop")], True),
    ]
    samples = samples_from_outputs(outputs, n=2)
    assert [(s.prompt_index, s.tokens, s.logprobs, s.finish_reason) for s in samples] == [
        (0, [4, 9], [-1.0, -2.0], "stop"),
        (0, [5, 6], [-0.5, -0.25], "length"),
        (1, [8], [-0.125], "length"),
        (1, [9], [-3.0], "stop"),
    ]
    outputs[1].outputs[0].finish_reason = "abort"
    with pytest.raises(RuntimeError, match="'abort'"):
        samples_from_outputs(outputs, n=2)


def test_samples_from_flat_vllm_logprobs():
    """``flat_logprobs=True`` (what the engine asks for) returns ``FlatLogprobs``: one entry a position
    with ``logprobs=0``, read as the flat list it is."""
    def completion(index, tokens, logprobs):
        flat = create_sample_logprobs(flat_logprobs=True)
        for t, lp in zip(tokens, logprobs, strict=True):
            flat.append({t: Logprob(lp, rank=3)})
        return CompletionOutput(index=index, text="", token_ids=tokens, cumulative_logprob=sum(logprobs),
                                logprobs=flat, finish_reason="length")

    outputs = [RequestOutput("0", None, [1], None, [completion(0, [5, 6, 5], [-0.5, -0.25, -4.0])], True)]
    flat = outputs[0].outputs[0].logprobs
    assert isinstance(flat, FlatLogprobs) and len(flat) == 3
    (sample,) = samples_from_outputs(outputs, n=1)
    assert sample.tokens == [5, 6, 5] and sample.logprobs == [-0.5, -0.25, -4.0]


# -- vLLM's model classes and loaders ----------------------------------------------------------------


def test_sync_ships_the_fp8_export_bytes_at_tp1():
    """The bytes checked below are the FP8 checkpoint layout (``to_fp8_block``): the sync must ship
    exactly those at rollout TP 1."""
    hf_model = tiny_model("Qwen3ForCausalLM")
    recipe = PrecisionRecipe()
    exported = dict(to_fp8_block(bridge_for(hf_model.config.to_dict()), recipe, hf_model.state_dict().items()))
    shipped = dict(rollout_tensors(hf_model, recipe))
    assert sorted(shipped) == sorted(exported)
    for name, t in exported.items():
        assert torch.equal(shipped[name].view(torch.uint8), t.view(torch.uint8)) if t.dtype == torch.float8_e4m3fn \
            else torch.equal(shipped[name], t), name


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("arch", ARCHS)
def test_vllm_loads_and_reloads_the_sync_bytes(arch, recipe_name, tmp_path):
    recipe = RECIPES[recipe_name]
    first, second = tiny_model(arch, seed=0), tiny_model(arch, seed=1)
    cfg = cpu_vllm_config(write_config(first, tmp_path / "ckpt"), recipe)
    model = build_vllm_model(cfg)

    quant = {n: type(m.quant_method) for n, m in model.named_modules() if n.endswith(("qkv_proj", "down_proj"))}
    fp8_layers = range(recipe.fp8.bf16_first_layers, 2)
    for n, method in quant.items():
        layer = int(n.split(".")[2])
        assert method is (Fp8LinearMethod if layer in fp8_layers else UnquantizedLinearMethod), n

    for hf_model in (first, second):
        tensors = rollout_tensors(hf_model, recipe)
        assert model_weight_specs(model) == metas(tensors)
        update = LayerwiseUpdate(model, cfg, presharded=False)
        for bucket in buckets(tensors):
            update.load(bucket)
        update.finish()
        assert_params_equal(model, expected_params(model, dict(tensors)))


def test_a_plain_second_load_fails_after_fp8_processing(tmp_path):
    """Why updates go through the checkpoint-format reload: after ``process_weights_after_loading``
    an FP8 weight is a plain ``Parameter`` (still carrying the v2 loader, which needs vLLM's
    parameter class), so ``load_weights`` alone cannot load a second time."""
    hf_model = tiny_model("Qwen3ForCausalLM")
    model = build_vllm_model(cpu_vllm_config(write_config(hf_model, tmp_path / "ckpt"), PrecisionRecipe()))
    weight = model.model.layers[0].self_attn.qkv_proj.weight
    assert type(weight) is torch.nn.Parameter and weight.dtype == torch.float8_e4m3fn
    with pytest.raises(AttributeError, match="load_qkv_weight"):
        model.load_weights(rollout_tensors(hf_model, PrecisionRecipe()))


def test_fp8_kv_cache_scales_load_and_update(tmp_path):
    hf_model = tiny_model("Qwen3ForCausalLM")
    recipe = PrecisionRecipe()
    cfg = cpu_vllm_config(write_config(hf_model, tmp_path / "ckpt"), recipe, VllmOptions(kv_cache_dtype="fp8"))
    model = build_vllm_model(cfg)
    tensors = rollout_tensors(hf_model, recipe)
    specs = model_weight_specs(model)
    scale_names = sorted(set(specs) - {n for n, _ in tensors})
    assert scale_names == sorted(f"model.layers.{i}.self_attn.attn.{s}_scale" for i in range(2) for s in "qkv")
    assert all(specs[n] == TensorMeta((), torch.float32) for n in scale_names)

    for step in (1, 2):
        scales = {n: torch.tensor(0.01 * step + 0.001 * i, dtype=torch.float32) for i, n in enumerate(scale_names)}
        update = LayerwiseUpdate(model, cfg, presharded=False)
        update.load(tensors + list(scales.items()))
        update.finish()
        for name, value in scales.items():
            attn, kind = model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
            assert torch.equal(getattr(attn, f"_{kind}"), value), name
        assert_params_equal(model, expected_params(model, dict(tensors)))


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("arch", ARCHS)
def test_direct_writes_equal_vllms_own_loaders(arch, recipe_name, tmp_path):
    """The in-place path (``DirectTargets``) puts every byte where vLLM's own loaders put it, FP8
    KV-cache scales included; an independent check of its name -> row-range map."""
    recipe = RECIPES[recipe_name]
    hf_model = tiny_model(arch, seed=3)
    model_dir = write_config(hf_model, tmp_path / "ckpt")
    options = VllmOptions(kv_cache_dtype="fp8")
    by_vllm, direct = (build_vllm_model(cpu_vllm_config(model_dir, recipe, options)) for _ in range(2))
    attention = sorted(fp8_kv_attention(by_vllm))
    scales = [(f"{a}.{s}", torch.tensor(0.02 + 0.003 * i + 0.001 * j)) for i, a in enumerate(attention)
              for j, s in enumerate(("q_scale", "k_scale", "v_scale"))]
    tensors = rollout_tensors(hf_model, recipe) + scales

    update = LayerwiseUpdate(by_vllm, cpu_vllm_config(model_dir, recipe, options), presharded=False)
    update.load(tensors)
    update.finish()
    targets = DirectTargets(direct)
    for bucket in buckets(tensors):
        targets.write(bucket)

    assert_params_equal(direct, dict(by_vllm.named_parameters()))
    assert_params_equal(direct, expected_params(direct, dict(tensors[: -len(scales)])))
    for name in attention:
        a, b = by_vllm.get_submodule(name), direct.get_submodule(name)
        for attr in KV_ATTRS:
            want, got = getattr(a, attr), getattr(b, attr)
            assert (torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want), (name, attr)
    with pytest.raises(WeightMismatch, match=r"k_scale is -1\.0"):
        targets.write([(scales[1][0], torch.tensor(-1.0))])


# -- the engine --------------------------------------------------------------------------------------


def set_engine_env(monkeypatch):
    for var, value in engine_env(PrecisionRecipe(), VllmOptions()).items():
        monkeypatch.setenv(var, value)


@pytest.fixture(params=["in_place", "reload"])
def engine_on_cpu(request, tmp_path, monkeypatch):
    """A VllmEngine whose ``vllm.LLM`` is ``InProcessLLM`` (a real vLLM model from the engine's
    arguments), with each way of updating weights."""
    set_engine_env(monkeypatch)
    monkeypatch.setattr(vllm, "LLM", InProcessLLM)
    hf_model = tiny_model("Qwen3ForCausalLM")
    engine = VllmEngine(hf_model.config.to_dict(), PrecisionRecipe(), VllmOptions(weight_update=request.param))
    yield engine, hf_model
    engine.close()


def test_engine_updates_sleeps_and_wakes(engine_on_cpu):
    engine, first = engine_on_cpu
    llm, recipe = engine._llm, PrecisionRecipe()
    assert engine.tp_rank == 0 and engine.tp_size == 1
    tensors = rollout_tensors(first, recipe)
    assert engine.weight_specs() == metas(tensors)
    with pytest.raises(RuntimeError, match="never loaded"):
        engine.generate([[1, 2, 3]], SamplingParams())

    for bucket in buckets(tensors):
        engine.update_weights(bucket)
    engine.wake()  # closes the update
    assert_params_equal(llm.model, expected_params(llm.model, dict(tensors)))
    assert not any(c[0] in ("wake_up", "sleep") for c in llm.calls)

    engine.sleep()
    assert llm.calls[-1] == ("sleep", 2)
    second = rollout_tensors(tiny_model("Qwen3ForCausalLM", seed=1), recipe)
    engine.update_weights(second[:4])
    assert ("wake_up", ["weights"]) in llm.calls[-3:]  # weights only: the KV cache stays released
    engine.wake()
    assert llm.calls[-1] == ("wake_up", ["kv_cache"])
    with pytest.raises(RuntimeError, match="never loaded"):
        engine.generate([[1, 2, 3]], SamplingParams())  # level 2 discarded the rest

    for bucket in buckets(second):
        engine.update_weights(bucket)
    engine.wake()
    assert_params_equal(llm.model, expected_params(llm.model, dict(second)))
    with pytest.raises(NotImplementedError, match="no vLLM CPU kernels"):
        engine.generate([[1, 2, 3]], SamplingParams())  # every check passed; only the kernels are missing
    assert llm.calls[-1] == ("reset_prefix_cache",)  # cached KV of the old weights is dropped first


def test_engine_close_maps_slept_memory_back_before_letting_go(engine_on_cpu):
    """Freeing memory that a sleep unmapped makes vLLM's allocator unmap it a second time (a CUDA
    "invalid argument" at exit): close wakes what sleeps, never sleeps, then drops the engine."""
    engine, _ = engine_on_cpu
    llm = engine._llm
    engine.sleep()
    assert llm.calls[-1] == ("sleep", 2)
    engine.close()
    assert llm.calls[-1] == ("wake_up", ["weights", "kv_cache"])
    assert engine._llm is None
    engine.close()  # twice is fine
    assert llm.calls[-1] == ("wake_up", ["weights", "kv_cache"])


def test_engine_close_without_room_to_map_back_says_so_and_still_lets_go(engine_on_cpu, monkeypatch, capsys):
    """Where the GPU has no room to map the slept memory back (the trainer still holds some), close
    says so in one line and drops the engine without releasing the allocator's pools, instead of
    failing a finished job at its very end."""
    import megatron_jetrl.rollout.vllm_engine as vllm_engine

    engine, _ = engine_on_cpu
    llm = engine._llm
    engine.sleep()

    def out_of_memory(tags):
        raise RuntimeError("CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:163")

    released = []
    monkeypatch.setattr(llm, "wake_up", out_of_memory)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (2 * 2**30, 80 * 2**30))
    monkeypatch.setattr(vllm_engine, "_release_cumem_pools", lambda: released.append(True))
    engine.close()
    assert engine._llm is None and released == []
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "out of GPU memory (2.0 GiB free" in err[0] and "weights and kv_cache" in err[0]


def test_engine_weight_buffers_are_the_live_parameters(engine_on_cpu):
    """What the weight sync does with an in-place engine: raw bytes into ``weight_buffers()``, the
    rest through ``update_weights``; a reload engine offers no buffers."""
    engine, first = engine_on_cpu
    llm = engine._llm
    tensors = dict(rollout_tensors(first, PrecisionRecipe()))
    engine.sleep()
    buffers = engine.weight_buffers()
    if engine.options.weight_update == "reload":
        assert buffers == {}
        return
    assert llm.calls[-1] == ("wake_up", ["weights"])
    assert set(buffers) == set(tensors)  # rollout TP 1: every tensor, embeddings included
    for name, buf in buffers.items():
        assert buf.is_contiguous() and engine.weight_specs()[name] == TensorMeta(tuple(buf.shape), buf.dtype)
        buf.view(torch.uint8).copy_(tensors[name].contiguous().view(torch.uint8))  # raw bytes, as the sync
    engine.wake()
    assert_params_equal(llm.model, expected_params(llm.model, tensors))
    with pytest.raises(NotImplementedError, match="no vLLM CPU kernels"):
        engine.generate([[1, 2, 3]], SamplingParams())  # nothing missing: the buffers counted as written


SCALE = "model.layers.1.self_attn.k_proj.weight_scale_inv"  # fp32 [4, 2]: 4 KV heads x 128 rows, K = 256
WRONG = {
    "shape": ((SCALE, torch.ones(3, 2)), r"k_proj\.weight_scale_inv is \[3, 2\] .*holds \[4, 2\]"),
    "dtype": ((SCALE, torch.ones(4, 2, dtype=torch.bfloat16)),
              r"k_proj\.weight_scale_inv is \[4, 2\] torch\.bfloat16.*holds \[4, 2\] torch\.float32"),
    "name": (("model.layers.1.self_attn.kv_proj.weight", torch.zeros(256, 256, dtype=torch.float8_e4m3fn)),
             r"kv_proj\.weight \[256, 256\] is not in the engine"),
    "twice": ((SCALE, torch.ones(4, 2)), r"k_proj\.weight_scale_inv given more than once"),
}


@pytest.mark.parametrize("case", list(WRONG))
def test_engine_rejects_a_wrong_tensor_before_writing(engine_on_cpu, case):
    engine, hf_model = engine_on_cpu
    llm = engine._llm
    engine.update_weights(rollout_tensors(hf_model, PrecisionRecipe()))
    engine.wake()
    before = {n: p.detach().clone() for n, p in llm.model.named_parameters()}
    calls = len(llm.calls)

    bad, match = WRONG[case]
    new = rollout_tensors(tiny_model("Qwen3ForCausalLM", seed=1), PrecisionRecipe())
    if case in ("shape", "dtype"):
        new = [bad if n == bad[0] else (n, t) for n, t in new]
    else:
        new.insert(len(new) // 2, bad)
    with pytest.raises(WeightMismatch, match=match):
        engine.update_weights(new)
    assert len(llm.calls) == calls and engine._update is None
    for n, p in llm.model.named_parameters():
        assert torch.equal(p.detach().view(torch.uint8), before[n].view(torch.uint8)), n


def test_engine_checks_the_recipe_environment(tmp_path, monkeypatch):
    set_engine_env(monkeypatch)
    monkeypatch.delenv(E8M0_OFF[0], raising=False)
    monkeypatch.setattr(vllm, "LLM", InProcessLLM)
    config = tiny_model("Qwen3ForCausalLM").config.to_dict()
    with pytest.raises(ConfigError, match=r"VLLM_USE_DEEP_GEMM_E8M0=0"):
        VllmEngine(config, PrecisionRecipe())
    monkeypatch.setenv(E8M0_OFF[0], "1")
    with pytest.raises(ConfigError, match=r"environment:VLLM_USE_DEEP_GEMM_E8M0: got '1'"):
        VllmEngine(config, PrecisionRecipe())
    monkeypatch.setenv(*E8M0_OFF)
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM", "0")  # the kernel the config did not choose (auto: DeepGEMM)
    with pytest.raises(ConfigError, match=r"environment:VLLM_USE_DEEP_GEMM: got '0'.*VLLM_USE_DEEP_GEMM=1"):
        VllmEngine(config, PrecisionRecipe())


# -- rollout TP 2: each rank loads only its own shards --------------------------------------------------


def _tp2_worker(rank, arch, tmp, results):
    try:
        init_vllm_distributed(tmp / "tp2-store", world_size=2, rank=rank, tp=2)
        recipe = PrecisionRecipe()
        first, second = tiny_model(arch, seed=0), tiny_model(arch, seed=1)
        model_dir, options = write_config(first, tmp / f"ckpt{rank}"), VllmOptions(tensor_parallel_size=2)
        ref_cfg, cfg = (cpu_vllm_config(model_dir, recipe, options) for _ in range(2))  # one model per config
        by_vllm, presharded = build_vllm_model(ref_cfg), build_vllm_model(cfg)
        for hf_model in (first, second):
            full, shards = rollout_tensors(hf_model, recipe), rollout_tensors(hf_model, recipe, 2, rank)
            assert model_weight_specs(presharded) == metas(shards), "specs differ from the sync's TP=2 shards"
            reference = LayerwiseUpdate(by_vllm, ref_cfg, presharded=False)  # vLLM cuts the full tensors
            reference.load(full)
            reference.finish()
            update = LayerwiseUpdate(presharded, cfg, presharded=True)
            for bucket in buckets(shards):
                update.load(bucket)
            update.finish()
            assert_params_equal(presharded, dict(by_vllm.named_parameters()))
            assert_params_equal(presharded, expected_params(presharded, dict(shards)))
        update = LayerwiseUpdate(presharded, cfg, presharded=False)  # the loaders cut full tensors again
        update.load(full)
        update.finish()
        assert_params_equal(presharded, dict(by_vllm.named_parameters()))
        # in place: this rank's shards written whole, this rank's vocabulary rows cut from full tensors
        direct = build_vllm_model(cpu_vllm_config(model_dir, recipe, options))
        targets = DirectTargets(direct)
        assert not set(targets.buffers()) & {"model.embed_tokens.weight", "lm_head.weight"}  # vocab shards
        assert set(targets.buffers()) | {"model.embed_tokens.weight", "lm_head.weight"} == {n for n, _ in shards}
        for bucket in buckets(shards):
            targets.write(bucket)
        assert_params_equal(direct, dict(by_vllm.named_parameters()))
        results.put((rank, None))
    except BaseException as e:  # reported to the test
        import traceback

        results.put((rank, f"{e!r}\n{traceback.format_exc()}"))


@pytest.mark.parametrize("arch", ARCHS)
def test_presharded_updates_at_rollout_tp2(arch, tmp_path):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_tp2_worker, args=(r, arch, tmp_path, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert got == {0: None, 1: None}, "\n".join(str(v) for v in got.values() if v)


def test_greedy_with_several_samples_goes_as_one_request_each(engine_on_cpu):
    """vLLM refuses n > 1 at temperature 0; the engine sends n requests of one sample instead and
    returns them prompt-major like any other call."""
    engine, hf_model = engine_on_cpu
    engine.update_weights(rollout_tensors(hf_model, PrecisionRecipe()))
    sent = []

    def generate(prompts, params, use_tqdm=False):
        sent.append((prompts, params))
        return [RequestOutput(str(i), None, p["prompt_token_ids"], None,
                              [CompletionOutput(index=0, text="", token_ids=[i], cumulative_logprob=-1.0,
                                                logprobs=[{i: Logprob(-1.0, rank=1)}], finish_reason="length")],
                              True) for i, p in enumerate(prompts)]

    engine._llm.generate = generate
    samples = engine.generate([[1, 2], [3]], SamplingParams(n=3, temperature=0.0, max_new_tokens=1))
    (prompts, params), = sent
    assert [p["prompt_token_ids"] for p in prompts] == [[1, 2]] * 3 + [[3]] * 3
    assert all(p.n == 1 and p.temperature == 0.0 for p in params)
    assert [(s.prompt_index, s.tokens) for s in samples] == [(0, [0]), (0, [1]), (0, [2]), (1, [3]), (1, [4]),
                                                             (1, [5])]


# -- the trainer's activation quantization inside vLLM ---------------------------------------------


def mixed_activation(m: int = 192, k: int = 1024, seed: int = 0) -> torch.Tensor:
    """BF16 rows of mixed magnitudes (as a norm's output scaled by its weight)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 3).to(torch.bfloat16)


def test_trainer_activation_quant_replaces_vllms_in_every_fp8_linear(tmp_path, monkeypatch):
    """``activation_quant=trainer``: every block-FP8 linear of the engine's model quantizes its input
    with the trainer's kernel (the bytes of ``quantize_fp8_blockwise``, in the scale layout vLLM's
    GEMM asked for), vLLM's norm/activation+quant fusions are off, and vLLM's own rule, on the same
    input, gives other codes."""
    set_engine_env(monkeypatch)
    monkeypatch.setattr(vllm, "LLM", InProcessLLM)
    recipe = PrecisionRecipe()
    engine = VllmEngine(tiny_model("Qwen3ForCausalLM").config.to_dict(), recipe,
                        VllmOptions(activation_quant="trainer"))
    try:
        passes = engine._llm.vllm_config.compilation_config.pass_config
        assert passes.fuse_norm_quant is False and passes.fuse_act_quant is False
        ops = [m.quant_method.fp8_linear.quant_fp8 for m in engine._llm.model.modules()
               if isinstance(getattr(m, "quant_method", None), Fp8LinearMethod)]
        assert ops and all(type(op).__name__ == "TrainerQuantFP8" and op.trainer_groups for op in ops)
        x = mixed_activation()
        want_q, want_s = quantize_fp8_blockwise(x, (1, 128))
        q, s = ops[0].forward_native(x)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(s, want_s) and s.stride() == (1, x.shape[0])  # CUTLASS reads column-major scales
        # one opaque call under torch.compile (vLLM compiles the model in one graph)
        traced_q, traced_s = torch.compile(ops[0].forward_native, fullgraph=True, backend="aot_eager")(x)
        assert torch.equal(traced_q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(traced_s, want_s)
    finally:
        engine.close()
    # closed: vLLM's own QuantFP8 again, whose rule gives other codes on the same input
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    with set_current_vllm_config(engine_config({"model": str(write_config(tiny_model("Qwen3ForCausalLM"),
                                                                          tmp_path / "m")), "load_format": "dummy"})):
        theirs = QuantFP8(False, GroupShape(1, 128), column_major_scales=True)
    assert type(theirs) is QuantFP8
    their_q, _ = theirs.forward_native(x)
    assert (their_q.view(torch.uint8) != want_q.view(torch.uint8)).any()


def test_trainer_activation_quant_is_the_default_and_off_for_vllm_and_bf16(tmp_path):
    model_dir = write_config(tiny_model("Qwen3ForCausalLM"), tmp_path / "ckpt")
    default = cpu_vllm_config(model_dir, PrecisionRecipe())
    assert default.compilation_config.pass_config.fuse_norm_quant is False  # the trainer's quantization
    own = cpu_vllm_config(model_dir, PrecisionRecipe(), VllmOptions(activation_quant="vllm"))
    assert own.compilation_config.pass_config.fuse_norm_quant is not False  # vLLM decides
    bf16 = cpu_vllm_config(model_dir, PrecisionRecipe(mode=PrecisionMode.BF16), VllmOptions(activation_quant="trainer"))
    assert bf16.quant_config is None


def test_the_model_directory_is_named_by_the_config(tmp_path):
    """vLLM keys its compile cache by the model's path (the config hash below differs between two
    directories of one config): the same config gets the same directory, so the next engine start
    finds its compiled graphs; another config gets another one."""
    from megatron_jetrl.rollout.vllm_engine import model_dir

    config = tiny_model("Qwen3ForCausalLM").config.to_dict()
    first = model_dir(config, tmp_path / "cache")
    assert first == model_dir(dict(reversed(list(config.items()))), tmp_path / "cache")  # key order: no matter
    assert json.loads((first / "config.json").read_text()) == json.loads(json.dumps(config))
    assert first.parent == tmp_path / "cache" / "jetrl-models" and [p.name for p in first.iterdir()] == ["config.json"]
    deeper = model_dir({**config, "num_hidden_layers": config["num_hidden_layers"] + 1}, tmp_path / "cache")
    assert deeper != first and deeper.parent == first.parent

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text((first / "config.json").read_text())
    recipe = PrecisionRecipe(mode=PrecisionMode.BF16)
    hashes = [cpu_vllm_config(d, recipe).compute_hash() for d in (first, model_dir(config, tmp_path / "cache"),
                                                                  elsewhere)]
    assert hashes[0] == hashes[1] != hashes[2]


def test_the_attention_backend_option_reaches_vllms_attention_config(tmp_path):
    """``rollout.vllm.attention_backend`` names a backend of vLLM's ``AttentionBackendEnum``; auto leaves
    vLLM's own pick."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    model_dir = write_config(tiny_model("Qwen3ForCausalLM"), tmp_path / "ckpt")
    assert cpu_vllm_config(model_dir, PrecisionRecipe()).attention_config.backend is None
    for option in ("flash_attn", "triton_attn"):
        cfg = cpu_vllm_config(model_dir, PrecisionRecipe(), VllmOptions(kv_cache_dtype="fp8", attention_backend=option))
        assert cfg.attention_config.backend is AttentionBackendEnum[option.upper()]
