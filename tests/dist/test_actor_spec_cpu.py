"""The actor's layer spec builds a megatron-core GPTModel on CPU (one gloo process): the checkpoint
keys are the bridge's, the recipe's BF16 first/last layers keep BF16 linears, and a packed forward
in FP8 (emulated GEMMs) stays close to BF16. megatron-core's RoPE asks for a CUDA device at
construction; the test points that one call at the CPU."""


import pytest
import torch
from megatron_jetrl.launch import free_port

pytest.importorskip("megatron.core")


@pytest.fixture
def megatron_cpu(monkeypatch):
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def _model(bridge, mode, elementwise_impl="compiled", attention_impl="torch", **fp8):
    from megatron.core.models.gpt import GPTModel

    from megatron_jetrl.actor import ActorSettings
    from megatron_jetrl.actor.build import configure_fp8_linears, layer_spec, transformer_config
    from megatron_jetrl.config import build
    from megatron_jetrl.precision import PrecisionRecipe

    recipe = build(PrecisionRecipe, {"mode": mode, "fp8": fp8}, "precision")
    settings = ActorSettings(precision=recipe, fp8_gemm="emulate", elementwise_impl=elementwise_impl,
                             attention_impl=attention_impl)
    config = transformer_config(bridge, settings)
    config.use_cpu_initialization = True
    torch.manual_seed(0)
    model = GPTModel(config=config, transformer_layer_spec=layer_spec(bridge, settings, config),
                     **bridge.gpt_model_kwargs(settings.parallel))
    n_fp8 = configure_fp8_linears(model, settings, bridge.dims.num_layers, torch.device("cpu")) if mode == "fp8" else 0
    return model, n_fp8


def test_spec_keys_bf16_layers_and_fp8_forward(megatron_cpu):
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_jetrl.actor.hf_conversion import checkpoint_key
    from megatron_jetrl.actor.layers import PackedCoreAttention, _Fp8LinearMixin
    from megatron_jetrl.precision.kv_cache import KvAmaxObserver
    from megatron_jetrl.actor.build import named_shards
    from megatron_jetrl.precision import quantize_fp8_blockwise
    from megatron_jetrl.models import bridge_for
    from tests.model_fixtures import tiny_hf_model

    bridge = bridge_for(tiny_hf_model("Qwen3ForCausalLM", num_layers=4).config.to_dict())
    bf16, _ = _model(bridge, "bf16")
    fp8, n_fp8 = _model(bridge, "fp8", bf16_first_layers=1, bf16_last_layers=1)

    keys = {getattr(v, "key", None) for v in fp8.sharded_state_dict().values()}
    assert {checkpoint_key(s) for s in bridge.tensor_map()} <= keys
    enabled = {layer.layer_number: [m.fp8_enabled for m in layer.modules() if isinstance(m, _Fp8LinearMixin)]
               for layer in fp8.decoder.layers}
    assert enabled == {1: [False] * 4, 2: [True] * 4, 3: [True] * 4, 4: [False] * 4}
    assert n_fp8 == 8

    # the weight sync's view: every bridge tensor under its global name, FP8 weights where enabled
    shards = named_shards(fp8)
    assert sorted(shards) == sorted(s.megatron for s in bridge.tensor_map())
    for spec in bridge.tensor_map():
        param, fp8_weight = shards[spec.megatron]
        assert tuple(param.shape) == spec.shape, spec.megatron
        assert (fp8_weight is not None) == (spec.linear and spec.layer in (1, 2)), spec.megatron
    qkv = shards["decoder.layers.2.self_attention.linear_qkv.weight"]
    assert qkv[0].data_ptr() == fp8.decoder.layers[2].self_attention.linear_qkv.weight.data_ptr()
    assert torch.equal(qkv[1].data.view(torch.uint8),
                       quantize_fp8_blockwise(qkv[0])[0].view(torch.uint8))

    # KV-cache calibration: the observer sees q, k, v as core attention gets them (after qk-norm, RoPE)
    observer = KvAmaxObserver(bridge.dims.num_layers, "cpu")
    seen = {}
    attn = [m for m in bf16.modules() if isinstance(m, PackedCoreAttention)]

    def capture(mod, args):
        seen[mod.layer_number - 1] = args[:3]  # returning None keeps the arguments

    hooks = [m.register_forward_pre_hook(capture) for m in attn]
    for m in attn:
        m.kv_observer = observer
    cu0 = torch.tensor([0, 30, 64], dtype=torch.int32)
    with torch.no_grad():
        bf16(torch.randint(0, 1000, (1, 64)), None, None, packed_seq_params=PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu0, cu_seqlens_kv=cu0, max_seqlen_q=34, max_seqlen_kv=34))
    for h in hooks:
        h.remove()
    for m in attn:
        m.kv_observer = None
    assert sorted(seen) == [0, 1, 2, 3]
    for layer, qkv in seen.items():
        want = [x.abs().reshape(x.shape[0], -1).amax(1).float().sort().values[63].item() for x in qkv]
        assert observer.amax[layer].tolist() == pytest.approx(want, rel=0, abs=0), layer

    fp8.load_state_dict(bf16.state_dict())
    cu = torch.tensor([0, 40, 100], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=60, max_seqlen_kv=60)
    tokens = torch.randint(0, 1000, (1, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = bf16(tokens, None, None, packed_seq_params=packed).float()
        got = fp8(tokens, None, None, packed_seq_params=packed).float()
        # the packed forward equals each sequence run on its own
        first = bf16(tokens[:, :40], None, None, packed_seq_params=PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu[:2], cu_seqlens_kv=cu[:2], max_seqlen_q=40, max_seqlen_kv=40)).float()
    assert torch.equal(first, ref[:, :40])
    # two FP8 layers of a random-init model: a few percent; a wrong GEMM or layout gives ~100 %
    rel = ((got - ref).norm() / ref.norm()).item()
    assert 0 < rel < 0.1, rel


def test_compiled_elementwise_is_the_eager_layer_to_rounding(megatron_cpu):
    """actor.elementwise_impl=compiled: megatron's fused SwiGLU (its torch.compile'd forward and
    backward, rounded once where eager rounds silu first) and the compiled RoPE (megatron's bits,
    tests/unit/test_packed_rope.py) give the eager layers' logits and gradients to bf16 rounding.
    The exact mode keeps eager SwiGLU and its own RoPE."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_jetrl.actor import ActorSettings
    from megatron_jetrl.actor.layers import COMPILED_ROPE_ATTR
    from megatron_jetrl.actor.build import transformer_config
    from megatron_jetrl.models import bridge_for
    from megatron_jetrl.precision import PrecisionRecipe
    from tests.model_fixtures import tiny_hf_model

    bridge = bridge_for(tiny_hf_model("Qwen3ForCausalLM", num_layers=2).config.to_dict())
    eager, _ = _model(bridge, "bf16", elementwise_impl="eager")
    fused, _ = _model(bridge, "bf16")
    assert (eager.config.bias_activation_fusion, getattr(eager.config, COMPILED_ROPE_ATTR)) == (False, False)
    assert (fused.config.bias_activation_fusion, getattr(fused.config, COMPILED_ROPE_ATTR)) == (True, True)
    exact = transformer_config(bridge, ActorSettings(precision=PrecisionRecipe(mode="fp8", exact=True)))
    assert (exact.bias_activation_fusion, getattr(exact, COMPILED_ROPE_ATTR)) == (False, False)

    fused.load_state_dict(eager.state_dict())
    cu = torch.tensor([0, 40, 100], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=60, max_seqlen_kv=60)
    tokens = torch.randint(0, 1000, (1, 100), generator=torch.Generator().manual_seed(0))
    out = {}
    for name, model in (("eager", eager), ("fused", fused)):
        logits = model(tokens, None, None, packed_seq_params=packed).float()
        logits.square().mean().backward()
        out[name] = logits.detach(), {n: p.grad.float() for n, p in model.named_parameters()}
    (ref, ref_grads), (got, got_grads) = out["eager"], out["fused"]
    assert not torch.equal(got, ref)  # the SwiGLU's single rounding shows
    assert ((got - ref).norm() / ref.norm()).item() < 1e-2
    for name, g in ref_grads.items():
        assert ((got_grads[name] - g).norm() / g.norm()).item() < 3e-2, name


def test_te_attention_gets_the_packed_layout_and_stays_out_of_the_checkpoint(megatron_cpu, monkeypatch):
    """actor.attention_impl=te: each layer's PackedCoreAttention calls Transformer Engine's
    DotProductAttention (here a stand-in computing the reference attention, TE being a GPU package)
    with this rank's heads and query groups, the thd layout, causal-within-sequence masking, int32
    cu_seqlens and the micro-batch's max_seqlen; its output [T, H*D] is the torch path's, and the
    model's parameters and checkpoint keys are the native layers' (no TE module in the tree)."""
    import importlib.machinery
    import sys
    import types

    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_jetrl.actor.layers import reference_packed_causal_attention
    from megatron_jetrl.models import bridge_for
    from tests.model_fixtures import tiny_hf_model

    built, calls = [], []

    class StandIn:
        def __init__(self, heads, kv_channels, **kwargs):
            built.append((heads, kv_channels, kwargs))
            self.scale = kwargs["softmax_scale"]

        def __call__(self, q, k, v, **kwargs):
            calls.append(kwargs)
            out = reference_packed_causal_attention(q, k, v, kwargs["cu_seqlens_q"], self.scale)
            return out.reshape(out.shape[0], -1)

    te = types.ModuleType("transformer_engine")
    te.__spec__ = importlib.machinery.ModuleSpec("transformer_engine", None)
    te_pytorch = types.ModuleType("transformer_engine.pytorch")
    te_pytorch.DotProductAttention = StandIn
    te.pytorch = te_pytorch
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te_pytorch)

    hf = tiny_hf_model("Qwen3ForCausalLM", num_layers=2).config
    bridge = bridge_for(hf.to_dict())
    native, _ = _model(bridge, "bf16")
    with_te, _ = _model(bridge, "bf16", attention_impl="te")
    assert sorted(with_te.state_dict()) == sorted(native.state_dict())
    assert [n for n, _ in with_te.named_modules()] == [n for n, _ in native.named_modules()]
    heads, groups, head_dim = hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim
    assert [(b[0], b[1]) for b in built] == [(heads, head_dim)] * 2
    assert {(b[2]["num_gqa_groups"], b[2]["qkv_format"], b[2]["attn_mask_type"]) for b in built} == {
        (groups, "thd", "padding_causal")}

    with_te.load_state_dict(native.state_dict())
    cu = torch.tensor([0, 40, 100])  # int64 here: the attention gets int32
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=60, max_seqlen_kv=60)
    tokens = torch.randint(0, 1000, (1, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = native(tokens, None, None, packed_seq_params=packed)
        got = with_te(tokens, None, None, packed_seq_params=packed)
    assert torch.equal(got, ref)
    assert len(calls) == 2
    for kw in calls:
        assert (kw["qkv_format"], kw["attn_mask_type"], kw["max_seqlen_q"], kw["max_seqlen_kv"]) == (
            "thd", "padding_causal", 60, 60)
        assert kw["cu_seqlens_q"].dtype == kw["cu_seqlens_kv"].dtype == torch.int32
        assert kw["cu_seqlens_q"].tolist() == [0, 40, 100]


def test_the_exact_spec_mlp_runs_its_swiglu_module(megatron_cpu):
    """The exact layer spec gives megatron's MLP the ExactSwiGLU module, which megatron calls on fc1's
    whole [gate | up] output (use_te_activation_func): the MLP's output is the eager SwiGLU MLP's bit for
    bit (the same linears, silu(gate) * up with its two roundings), and its gradients are the eager
    MLP's to bf16 rounding (megatron's fused SwiGLU gradient)."""
    import torch.nn.functional as F

    from megatron_jetrl.actor import ActorSettings
    from megatron_jetrl.actor.exact import ExactSwiGLU
    from megatron_jetrl.actor.layers import _Fp8LinearMixin
    from megatron_jetrl.actor.build import layer_spec, transformer_config
    from megatron_jetrl.models import bridge_for
    from megatron_jetrl.precision import PrecisionRecipe
    from tests.model_fixtures import tiny_hf_model
    from megatron.core.models.gpt import GPTModel

    bridge = bridge_for(tiny_hf_model("Qwen3ForCausalLM", num_layers=1).config.to_dict())
    settings = ActorSettings(precision=PrecisionRecipe(mode="bf16", exact=True))
    config = transformer_config(bridge, settings)
    config.use_cpu_initialization = True
    torch.manual_seed(0)
    model = GPTModel(config=config, transformer_layer_spec=layer_spec(bridge, settings, config),
                     **bridge.gpt_model_kwargs(settings.parallel))
    mlp = model.decoder.layers[0].mlp
    assert isinstance(mlp.activation_func, ExactSwiGLU)
    for m in mlp.modules():
        if isinstance(m, _Fp8LinearMixin):
            m.fp8_enabled = False  # megatron's BF16 GEMM (the exact kernels are vLLM's, a GPU's)
    x = torch.randn(9, 1, bridge.dims.hidden_size, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    x.requires_grad_()
    out, _ = mlp(x)
    w1, w2 = mlp.linear_fc1.weight, mlp.linear_fc2.weight
    xr = x.detach().clone().requires_grad_()
    gate, up = F.linear(xr, w1).chunk(2, dim=-1)
    want = F.linear(F.silu(gate) * up, w2)
    assert torch.equal(out, want)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.dtype)
    (dx,) = torch.autograd.grad(out, x, dy)
    (dxr,) = torch.autograd.grad(want, xr, dy)
    assert ((dx.float() - dxr.float()).norm() / dxr.float().norm()).item() < 2e-2


def test_an_exact_model_has_the_default_models_checkpoint_keys(megatron_cpu):
    """The exact layer spec's modules take part in megatron's sharded checkpoint like the default
    spec's (the MLP asks its activation module for its state: ExactSwiGLU has none), with the same
    keys and shapes, so an exact job loads and saves the default mode's checkpoints."""
    from megatron_jetrl.actor import ActorSettings
    from megatron_jetrl.actor.build import layer_spec, transformer_config
    from megatron_jetrl.models import bridge_for
    from megatron_jetrl.precision import PrecisionRecipe
    from tests.model_fixtures import tiny_hf_model
    from megatron.core.models.gpt import GPTModel

    bridge = bridge_for(tiny_hf_model("Qwen3ForCausalLM", num_layers=2).config.to_dict())
    shapes = []
    for exact in (False, True):
        settings = ActorSettings(precision=PrecisionRecipe(mode="fp8", exact=exact))
        config = transformer_config(bridge, settings)
        config.use_cpu_initialization = True
        model = GPTModel(config=config, transformer_layer_spec=layer_spec(bridge, settings, config),
                         **bridge.gpt_model_kwargs(settings.parallel))
        state = model.sharded_state_dict()
        shapes.append({k: tuple(v.global_shape) for k, v in state.items() if hasattr(v, "global_shape")})
    assert shapes[0] and shapes[1] == shapes[0]


def test_the_exact_spec_builds_every_linear_and_attention_with_vllms_kernels(megatron_cpu):
    """The exact layer spec hands vLLM's kernels to megatron's constructors (ModuleSpec params): every
    parallel linear and core attention holds them from construction, with nothing set afterwards; with
    the LM head's exact GEMM bound (build_gpt does it) the model passes check_exact, without the
    kernels it is refused."""
    from megatron_jetrl.actor import ActorSettings
    from megatron_jetrl.actor.build import check_exact, layer_spec, transformer_config
    from megatron_jetrl.actor.exact import bind_exact_forward
    from megatron_jetrl.actor.layers import PackedCoreAttention, _Fp8LinearMixin
    from megatron_jetrl.models import bridge_for
    from megatron_jetrl.precision import PrecisionRecipe
    from tests.model_fixtures import tiny_hf_model
    from megatron.core.models.gpt import GPTModel

    bridge = bridge_for(tiny_hf_model("Qwen3ForCausalLM", num_layers=2).config.to_dict())
    settings = ActorSettings(precision=PrecisionRecipe(mode="fp8", exact=True))
    kernels = object()  # vLLM's kernels stand-in: only who holds it is checked here
    models = []
    for given in (kernels, None):
        config = transformer_config(bridge, settings)
        config.use_cpu_initialization = True
        models.append(GPTModel(config=config, transformer_layer_spec=layer_spec(bridge, settings, config, given),
                               **bridge.gpt_model_kwargs(settings.parallel)))
    model, without = models
    held = [m.exact_kernels for m in model.modules() if isinstance(m, (_Fp8LinearMixin, PackedCoreAttention))]
    assert len(held) == 2 * (4 + 1) and all(k is kernels for k in held)
    bind_exact_forward(model.output_layer, kernels)
    check_exact(model)
    bind_exact_forward(without.output_layer, kernels)
    with pytest.raises(RuntimeError, match="without the exact kernels"):
        check_exact(without)
