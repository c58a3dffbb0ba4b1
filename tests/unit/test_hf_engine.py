"""The hf rollout engine on CPU, against the tiny HF models of every family.

BF16: greedy decoding equals transformers' own ``generate`` and the rollout logprobs equal a full
(uncached) forward's. FP8: every engine linear is bit for bit the trainer's FProp
(``fp8_block_linear``, reference quantizer, emulated GEMM) on the bytes the sync ships, and the engine
stores exactly those bytes. Then sampling, weight updates, sleep/wake and input checks.

bf16 logits of a tiny random model have near-ties (top two within one bf16 ulp), where two correct
implementations may pick different tokens; greedy comparisons accept a divergence only there.
"""

import json

import pytest
import torch
from safetensors.torch import save_file

from megatron_jetrl.models import BRIDGES, bridge_for
from megatron_jetrl.models.fp8_export import fp8_hf_config, to_fp8_block
from megatron_jetrl.precision import Fp8Options, PrecisionRecipe, ReferenceQuantizer, fp8_block_linear
from megatron_jetrl.rollout import HfEngine, HfOptions, SamplingParams, WeightMismatch
from megatron_jetrl.rollout.hf_model import Fp8InferenceLinear, FusedProjection, hf_classes
from tests.helpers import assert_same_bytes
from tests.model_fixtures import FAMILIES, save_tiny_hf, tiny_hf_model

BF16 = PrecisionRecipe(mode="bf16")
FP8 = PrecisionRecipe(mode="fp8")
GREEDY = SamplingParams(temperature=0, max_new_tokens=10)
VOCAB = 1000
NEAR_TIE = 2 * 2.0**-8
"""Two bf16 ulps of a logit's magnitude (relative): below this, the greedy choice is a coin flip."""


def reference_model(arch: str, seed: int = 0):
    """The tiny HF model computing as the engine (and the trainer) does: RoPE frequencies in fp32
    (the fixture's ``.to(bfloat16)`` rounded them) and torch's RMSNorm in the model dtype."""
    model = tiny_hf_model(arch, seed=seed)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)
    norm_cls = hf_classes(BRIDGES[arch]).norm
    for name, norm in list(model.named_modules()):
        if isinstance(norm, norm_cls):
            parent, child = name.rsplit(".", 1)
            torch_norm = torch.nn.RMSNorm(tuple(norm.weight.shape), eps=norm.variance_epsilon, dtype=norm.weight.dtype)
            with torch.no_grad():
                torch_norm.weight.copy_(norm.weight)
            setattr(model.get_submodule(parent), child, torch_norm)
    return model


def _hf_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """The model's checkpoint tensors, as ``save_pretrained`` writes them (a tied head omitted)."""
    tied = model.config.tie_word_embeddings
    return [(n, t) for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")]


def _engine(model, recipe=BF16, **options) -> HfEngine:
    options.setdefault("gemm", "emulate")
    engine = HfEngine(model.config.to_dict(), recipe, HfOptions(**options), device="cpu",
                      quantizer=ReferenceQuantizer() if recipe.rollout_fp8 else None)
    tensors = _hf_tensors(model)
    if recipe.rollout_fp8:
        tensors = list(to_fp8_block(bridge_for(model.config.to_dict()), recipe, tensors))
    engine.update_weights(tensors)
    return engine


def _prompts(lengths=(5, 9, 3), seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _full_logits(model, prompt, response) -> torch.Tensor:
    """fp32 logits predicting each response token, from one uncached forward of prompt+response."""
    with torch.no_grad():
        logits = model(torch.tensor(prompt + response)[None]).logits[0].float()
    return logits[len(prompt) - 1 : -1]


def _assert_greedy_equal(model, prompt, tokens, expected, what):
    """Equal, or equal up to a position where the reference's two candidates are a near-tie."""
    if tokens == expected:
        return
    k = next(i for i, (a, b) in enumerate(zip(tokens, expected, strict=False)) if a != b)
    logits = _full_logits(model, prompt, expected[: k + 1])[k]
    gap = (logits[expected[k]] - logits[tokens[k]]).abs().item()
    assert gap <= NEAR_TIE * logits.abs().max().item(), (
        f"{what}: greedy tokens differ at {k} ({tokens[k]} vs {expected[k]}) with a logit gap {gap:.3g}"
    )


def _hf_greedy(model, prompts, max_new_tokens) -> list[list[int]]:
    """transformers' ``generate`` on the left-padded batch."""
    L = max(map(len, prompts))
    ids = torch.zeros(len(prompts), L, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, L - len(p) :], mask[i, L - len(p) :] = torch.tensor(p), 1
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=0)
    return [row[L:].tolist() for row in out]


@pytest.mark.parametrize("arch", FAMILIES)
def test_bf16_greedy_equals_transformers_generate_and_logprobs_equal_a_full_forward(arch):
    model = reference_model(arch)
    engine = _engine(model)
    prompts = _prompts()
    samples = engine.generate(prompts, GREEDY)
    expected = _hf_greedy(model, prompts, GREEDY.max_new_tokens)
    assert [s.prompt_index for s in samples] == [0, 1, 2]
    for i, (s, p) in enumerate(zip(samples, prompts, strict=True)):
        assert s.finish_reason == "length" and len(s.tokens) == len(s.logprobs) == GREEDY.max_new_tokens
        _assert_greedy_equal(model, p, s.tokens, expected[i], f"{arch} prompt {i}")
        logprobs = _full_logits(model, p, s.tokens).log_softmax(-1)
        expected_lp = logprobs.gather(-1, torch.tensor(s.tokens)[:, None]).squeeze(1)
        # bf16 logits: cached and uncached forwards may round a logit one ulp apart (2^-9 here).
        torch.testing.assert_close(torch.tensor(s.logprobs), expected_lp, rtol=0, atol=3e-3)


@pytest.mark.parametrize("arch", FAMILIES)
def test_fp8_linears_are_the_trainer_fprop_on_the_shipped_bytes(arch):
    model = reference_model(arch)
    bridge = bridge_for(model.config.to_dict())
    shipped = dict(to_fp8_block(bridge, FP8, _hf_tensors(model)))
    engine = _engine(model, FP8)
    held = engine.named_weights()
    assert {n for n, m in engine.weight_specs().items() if m.dtype == torch.float8_e4m3fn} == {
        n for n in shipped if shipped[n].dtype == torch.float8_e4m3fn}
    for name, t in shipped.items():
        assert_same_bytes(held[name], t, name)
    fp8 = {n: m for n, m in engine.model.named_modules() if isinstance(m, Fp8InferenceLinear)}
    assert len(fp8) == 4 * bridge.dims.num_layers  # q/k/v and gate/up fused
    captured = {}

    def keep_first_call(name):
        def hook(module, args, out):
            captured.setdefault(name, (args[0], out))
        return hook

    hooks = [m.register_forward_hook(keep_first_call(n)) for n, m in fp8.items()]
    samples = engine.generate(_prompts((4, 6)), SamplingParams(temperature=0, max_new_tokens=3))
    for h in hooks:
        h.remove()
    assert len(captured) == len(fp8) and all(len(s.tokens) == 3 for s in samples)
    master = dict(model.named_parameters())
    fused = {"self_attn.qkv_proj.linear": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj.linear": ("gate_proj",
                                                                                                 "up_proj")}
    for name, (x, y) in captured.items():
        layer, local = name.split(".", 3)[:3], name.split(".", 3)[3]
        block = local.split(".")[0]
        parts = [f"{'.'.join(layer)}.{block}.{p}" for p in fused[local]] if local in fused else [name]
        w = torch.cat([master[f"{p}.weight"] for p in parts])
        b = torch.cat([master[f"{p}.bias"] for p in parts]) if f"{parts[0]}.bias" in master else None
        trainer = fp8_block_linear(x, w, b, quantizer=ReferenceQuantizer(), gemm="emulate")
        assert_same_bytes(y, trainer, f"{name} output")


def test_fp8_recipe_keeps_its_bf16_layers_and_generates_close_to_bf16():
    model = reference_model("Qwen3ForCausalLM")
    recipe = PrecisionRecipe(mode="fp8", fp8=Fp8Options(bf16_first_layers=1))
    engine = _engine(model, recipe)
    specs = engine.weight_specs()
    assert specs["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16
    assert "model.layers.0.mlp.up_proj.weight_scale_inv" not in specs
    assert specs["model.layers.1.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert specs["lm_head.weight"].dtype == specs["model.embed_tokens.weight"].dtype == torch.bfloat16
    prompt = _prompts((6,))
    s = engine.generate(prompt, GREEDY)[0]
    reference = _full_logits(model, prompt[0], s.tokens).log_softmax(-1)
    diff = torch.tensor(s.logprobs) - reference.gather(-1, torch.tensor(s.tokens)[:, None]).squeeze(1)
    assert diff.abs().max() < 0.05, f"FP8 rollout logprobs differ from the BF16 model's by {diff.abs().max():.3g}"


def test_weight_specs_use_checkpoint_names_and_a_tied_head_once():
    tied = _engine(reference_model("Qwen2ForCausalLM"))
    specs = tied.weight_specs()
    assert "lm_head.weight" not in specs and "model.embed_tokens.weight" in specs
    assert specs["model.layers.1.self_attn.q_proj.bias"].shape == (256,)
    untied = HfEngine(reference_model("LlamaForCausalLM").config.to_dict(), BF16, device="cpu").weight_specs()
    assert untied["lm_head.weight"].shape == (VOCAB, 256)
    assert not any("rotary" in n for n in untied)


def test_tied_head_follows_the_embedding():
    model = reference_model("Qwen2ForCausalLM")
    engine = _engine(model)
    new = torch.randn(VOCAB, 256, dtype=torch.bfloat16)
    engine.update_weights([("model.embed_tokens.weight", new)])
    assert torch.equal(engine.model.lm_head.weight, new)


def test_sampling_seeds_order_and_filters():
    engine = _engine(reference_model("Qwen3ForCausalLM"))
    prompts = _prompts()
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=5)
    first = engine.generate(prompts, params)
    assert [s.prompt_index for s in first] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [s.tokens for s in engine.generate(prompts, params)] == [s.tokens for s in first]
    other = engine.generate(prompts, SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=6))
    assert [s.tokens for s in other] != [s.tokens for s in first]
    assert len({tuple(s.tokens) for s in first}) > 3, "samples of one prompt should differ at temperature 1"
    greedy = [s.tokens for s in engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=8))]
    for filters in (dict(top_k=1), dict(top_p=1e-6), dict(top_k=50, top_p=1e-6)):
        got = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=8, seed=1, **filters))
        assert [s.tokens for s in got] == [g for g in greedy for _ in range(2)], filters


def test_logprobs_are_of_the_raw_distribution_whatever_the_temperature():
    engine = _engine(reference_model("Qwen3ForCausalLM"))
    prompt = _prompts((7,))
    greedy = engine.generate(prompt, GREEDY)[0]
    hot = engine.generate(prompt, SamplingParams(temperature=5.0, top_k=1, max_new_tokens=10, seed=0))[0]
    assert hot.tokens == greedy.tokens
    assert hot.logprobs == greedy.logprobs


def test_stop_tokens_end_samples_and_length_otherwise():
    engine = _engine(reference_model("LlamaForCausalLM"))
    prompts = _prompts()
    greedy = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=40))
    stop = greedy[0].tokens[3]
    stopped = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=40, stop_token_ids=(stop,)))
    for g, s in zip(greedy, stopped, strict=True):
        if stop in g.tokens:
            end = g.tokens.index(stop) + 1
            assert (s.tokens, s.finish_reason) == (g.tokens[:end], "stop")
            assert s.logprobs == g.logprobs[:end]
        else:
            assert (s.tokens, s.finish_reason) == (g.tokens, "length")
    assert stopped[0].tokens[-1] == stop and len(stopped[0].tokens) <= 4
    last = greedy[1].tokens[-1]
    if last not in greedy[1].tokens[:-1]:
        at_end = engine.generate(prompts[1:2], SamplingParams(temperature=0, max_new_tokens=40,
                                                               stop_token_ids=(last,)))[0]
        assert (len(at_end.tokens), at_end.finish_reason) == (40, "stop")


def test_batches_are_cut_by_max_num_seqs_and_max_batch_tokens():
    model = reference_model("Qwen3ForCausalLM")
    prompts = _prompts((5, 9, 3, 12))
    params = SamplingParams(n=2, temperature=0, max_new_tokens=6)
    whole = [s.tokens for s in _engine(model).generate(prompts, params)]
    for kwargs in (dict(max_num_seqs=3), dict(max_batch_tokens=20), dict(max_prefill_tokens=10)):
        got = _engine(model, **kwargs).generate(prompts, params)
        assert [s.prompt_index for s in got] == [0, 0, 1, 1, 2, 2, 3, 3]
        for i, (s, w) in enumerate(zip(got, whole, strict=True)):
            _assert_greedy_equal(model, prompts[i // 2], s.tokens, w, f"{kwargs} sample {i}")


def test_update_weights_checks_everything_before_writing():
    engine = _engine(reference_model("Qwen3ForCausalLM"))
    before = {n: t.clone() for n, t in engine.named_weights().items()}
    good = ("model.norm.weight", torch.zeros(256, dtype=torch.bfloat16))
    with pytest.raises(WeightMismatch, match=r"model\.layers\.0\.mlp\.gate_prj\.weight .*not in the engine"):
        engine.update_weights([good, ("model.layers.0.mlp.gate_prj.weight", torch.zeros(512, 256))])
    bad_shape = ("model.layers.1.self_attn.o_proj.weight", torch.zeros(256, 512, dtype=torch.bfloat16))
    with pytest.raises(WeightMismatch, match=r"o_proj\.weight is \[256, 512\].*holds \[256, 1024\]"):
        engine.update_weights(iter([good, bad_shape]))
    bad_dtype = ("model.layers.1.mlp.down_proj.weight", torch.zeros(256, 512))
    with pytest.raises(WeightMismatch, match=r"down_proj\.weight is \[256, 512\] torch\.float32"):
        engine.update_weights([good, bad_dtype])
    with pytest.raises(WeightMismatch, match="given twice"):
        engine.update_weights([good, good])
    for name, t in engine.named_weights().items():
        assert torch.equal(t, before[name]), f"{name} was written by a rejected update"


def test_fp8_update_rejects_bf16_for_an_fp8_weight():
    engine = _engine(reference_model("Qwen3ForCausalLM"), FP8)
    with pytest.raises(WeightMismatch, match=r"q_proj\.weight is \[1024, 256\] torch\.bfloat16.*float8_e4m3fn"):
        engine.update_weights([("model.layers.0.self_attn.q_proj.weight",
                                torch.zeros(1024, 256, dtype=torch.bfloat16))])


def test_sleep_wake_and_a_second_update():
    model = reference_model("Qwen2ForCausalLM")
    engine = _engine(model, FP8, sleep_keeps_weights=True)
    prompts = _prompts()
    params = SamplingParams(n=2, max_new_tokens=6, seed=3)
    before = engine.generate(prompts, params)
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(prompts, params)
    engine.wake()
    assert engine.generate(prompts, params) == before
    other = reference_model("Qwen2ForCausalLM", seed=1)
    engine.sleep()
    engine.update_weights(to_fp8_block(bridge_for(other.config.to_dict()), FP8, _hf_tensors(other)))
    engine.wake()
    after = engine.generate(prompts, params)
    assert [s.tokens for s in after] != [s.tokens for s in before]
    engine.update_weights(to_fp8_block(bridge_for(model.config.to_dict()), FP8, _hf_tensors(model)))
    assert engine.generate(prompts, params) == before
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate(prompts, params)


def test_sleep_drops_the_weights_until_every_tensor_arrives_again():
    """The default sleep keeps nothing (the next sync writes every tensor): a generate before that
    is refused, naming what is missing; a partial update is not enough; a full one, or the sync's
    in-place buffers, restore the outputs."""
    model = reference_model("Qwen3ForCausalLM")
    engine = _engine(model, FP8)
    prompts, params = _prompts(), SamplingParams(n=2, max_new_tokens=6, seed=3)
    before = engine.generate(prompts, params)
    assert not engine.weights_discarded
    engine.sleep()
    assert engine.weights_discarded and not engine._host  # nothing copied to the host
    engine.wake()
    with pytest.raises(RuntimeError, match="never loaded since the weights were created or dropped"):
        engine.generate(prompts, params)
    tensors = list(to_fp8_block(bridge_for(model.config.to_dict()), FP8, _hf_tensors(model)))
    engine.update_weights(tensors[:3])
    assert engine.weights_discarded
    with pytest.raises(RuntimeError, match="never loaded"):
        engine.generate(prompts, params)
    engine.update_weights(tensors[3:])
    assert not engine.weights_discarded and engine.generate(prompts, params) == before
    engine.sleep()
    buffers = engine.weight_buffers()  # what an in-place sync writes: all of them
    for name, t in tensors:
        buffers[name].copy_(t)
    engine.wake()
    assert engine.generate(prompts, params) == before
    fresh = HfEngine(model.config.to_dict(), FP8, HfOptions(gemm="emulate"), device="cpu",
                     quantizer=ReferenceQuantizer())
    with pytest.raises(RuntimeError, match="never loaded"):  # created: no weights yet
        fresh.generate(prompts, params)


def test_bad_prompts_are_named():
    engine = _engine(reference_model("LlamaForCausalLM"))
    cases = [
        ([[1, 2], []], r"prompt 1 is empty"),
        ([[1, 2], [3, VOCAB]], rf"prompt 1 has token id {VOCAB} outside the vocab \[0, {VOCAB}\)"),
        ([[-1]], r"prompt 0 has token id -1"),
        ([[1], [0.5, 2]], r"prompt 1 holds torch.float"),
        ([[1], [2] * 16380], r"prompt 1: 16380 tokens \+ max_new_tokens 10 exceed max_position_embeddings 16384"),
        ([], r"no prompts"),
    ]
    for prompts, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.generate(prompts, GREEDY)
    with pytest.raises(ValueError, match=r"stop_token_ids \[1000\] are outside the vocab"):
        engine.generate([[1]], SamplingParams(stop_token_ids=(VOCAB,)))
    with pytest.raises(ValueError, match="more KV-cache slots than max_batch_tokens"):
        HfEngine(engine.bridge.hf_config, BF16, HfOptions(max_batch_tokens=8), device="cpu").generate([[1] * 5], GREEDY)


def test_from_checkpoint_bf16_and_fp8_export(tmp_path):
    model = save_tiny_hf("LlamaForCausalLM", tmp_path / "bf16")
    bridge = bridge_for(model.config.to_dict())
    shipped = dict(to_fp8_block(bridge, FP8, _hf_tensors(model)))
    fp8_dir = tmp_path / "fp8"
    fp8_dir.mkdir()
    save_file({n: t.contiguous() for n, t in shipped.items()}, fp8_dir / "model.safetensors")
    (fp8_dir / "config.json").write_text(json.dumps(fp8_hf_config(bridge, FP8, model.config.to_dict())))
    kw = dict(device="cpu", quantizer=ReferenceQuantizer())
    quantized_on_load = HfEngine.from_checkpoint(tmp_path / "bf16", FP8, HfOptions(gemm="emulate"), **kw)
    from_export = HfEngine.from_checkpoint(fp8_dir, FP8, HfOptions(gemm="emulate"), **kw)
    for engine in (quantized_on_load, from_export):
        state = engine.named_weights()
        for name, t in shipped.items():
            assert_same_bytes(state[name], t, name)
    bf16_from_export = HfEngine.from_checkpoint(fp8_dir, BF16, device="cpu")
    w = bf16_from_export.named_weights()["model.layers.0.mlp.down_proj.weight"]
    torch.testing.assert_close(w, model.model.layers[0].mlp.down_proj.weight, rtol=0.07, atol=1e-3)
    prompts = _prompts()
    assert quantized_on_load.generate(prompts, GREEDY) == from_export.generate(prompts, GREEDY)


def test_fused_projection_serves_each_part_from_one_gemm():
    calls = []
    linear = torch.nn.Linear(4, 6, bias=False)
    linear.register_forward_hook(lambda *_: calls.append(1))
    fused = FusedProjection(linear, (3, 2, 1))
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    full = linear(x).detach()
    calls.clear()
    with torch.no_grad():
        parts = [fused.part(i, x) for i in (1, 0, 2)]
        assert len(calls) == 1
        torch.testing.assert_close(torch.cat([parts[1], parts[0], parts[2]], -1), full, rtol=0, atol=0)
        fused.part(0, x)  # a part asked again belongs to a new call
        fused.part(0, y)  # a new input recomputes
        assert len(calls) == 3
