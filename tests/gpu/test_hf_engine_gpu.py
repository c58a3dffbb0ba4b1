"""The hf rollout engine on Hopper: its FP8 linear is the trainer's FProp (native quantizer,
blockwise scaled_mm) bit for bit; a tiny FP8 engine's rollout logprobs are close to the BF16
model's; CUDA-graph decoding equals eager decoding; sleep gives the weights' memory back."""

import math

import pytest
import torch

from megatron_jetrl.models import bridge_for
from megatron_jetrl.models.fp8_export import to_fp8_block
from megatron_jetrl.ops import NativeQuantizer
from megatron_jetrl.precision import PrecisionRecipe, fp8_block_linear
from megatron_jetrl.rollout import HfEngine, HfOptions, SamplingParams
from megatron_jetrl.rollout.hf_model import Fp8InferenceLinear
from tests.helpers import assert_same_bytes
from tests.model_fixtures import FAMILIES
from tests.unit.test_hf_engine import reference_model

pytestmark = pytest.mark.gpu
FP8, BF16 = PrecisionRecipe(mode="fp8"), PrecisionRecipe(mode="bf16")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens, n, k", [(1, 6144, 4096), (16, 4096, 4096), (64, 24576, 4096), (7, 4096, 12288),
                                          (100, 256, 1024), (3, 130, 200)])
def test_engine_linear_is_the_trainer_fprop_bit_for_bit(hopper, tokens, n, k, bias):
    g = torch.Generator(device="cuda").manual_seed(tokens + n)
    x = torch.randn(2, tokens, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k**-0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g) if bias else None
    quantizer = NativeQuantizer()
    linear = Fp8InferenceLinear(k, n, bias=bias, dtype=torch.bfloat16, quantizer=quantizer, gemm="scaled_mm",
                                device="cuda")
    fprop = quantizer.quantize_weight(w).fprop
    linear.weight.copy_(fprop.data)
    linear.weight_scale_inv.copy_(fprop.scale_inv)
    if bias:
        linear.bias.copy_(b)
    with torch.inference_mode():
        y = linear(x)
    trainer = fp8_block_linear(x, w, b, quantizer=quantizer, gemm="scaled_mm")
    assert y.shape == trainer.shape == (2, tokens, n)
    assert_same_bytes(y, trainer.detach(), f"{tokens}x{k} -> {n}")


def _reference(arch):
    return reference_model(arch).cuda()


def _engine(model, recipe, quantizer=None, **options):
    engine = HfEngine(model.config.to_dict(), recipe, HfOptions(**options), device="cuda", quantizer=quantizer)
    _load(engine, model, recipe)
    return engine


def _load(engine, model, recipe):
    specs = engine.weight_specs()
    tensors = [(n, t) for n, t in model.state_dict().items() if n in specs]
    if recipe.rollout_fp8:
        tensors = list(to_fp8_block(bridge_for(model.config.to_dict()), recipe, tensors))
    engine.update_weights(tensors)


def _scored(model, prompt, tokens):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens], device="cuda")).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens, device="cuda")[:, None]).squeeze(1).cpu()


@pytest.mark.parametrize("arch", FAMILIES)
def test_fp8_engine_logprobs_close_to_the_bf16_model(hopper, arch):
    model = _reference(arch)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (5, 17, 40, 9)]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=48, seed=0)
    bf16, fp8 = _engine(model, BF16), _engine(model, FP8)
    for s in bf16.generate(prompts, params):
        ref = _scored(model, prompts[s.prompt_index], s.tokens)
        torch.testing.assert_close(torch.tensor(s.logprobs), ref, rtol=0, atol=2e-2)
    diffs = []
    for s in fp8.generate(prompts, params):
        diffs.append(torch.tensor(s.logprobs) - _scored(model, prompts[s.prompt_index], s.tokens))
    diff = torch.cat(diffs).abs()
    assert diff.mean() < 0.02 and diff.max() < 0.2, f"FP8 - BF16 logprobs: mean {diff.mean():.3g}, max {diff.max():.3g}"


@pytest.mark.parametrize("recipe", [BF16, FP8], ids=["bf16", "fp8"])
def test_cuda_graph_decoding_equals_eager(hopper, recipe):
    model = _reference("Qwen3ForCausalLM")
    graphs, eager = _engine(model, recipe), _engine(model, recipe, cuda_graphs=False)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (5, 17, 40, 9, 33)]
    greedy = eager.generate(prompts, SamplingParams(temperature=0, max_new_tokens=64))
    stops = tuple({s.tokens[k] for s in greedy[:3] for k in (10, 30)})
    for params in (SamplingParams(n=3, max_new_tokens=64, seed=2),
                   SamplingParams(n=3, max_new_tokens=64, seed=2, top_p=0.9, top_k=50, stop_token_ids=stops)):
        assert graphs.generate(prompts, params) == eager.generate(prompts, params)


@pytest.mark.parametrize("keep", [True, False], ids=["keeps-weights", "drops-weights"])
def test_sleep_releases_weight_memory_and_wake_restores_outputs(hopper, keep):
    """Both sleeps free the weight memory; a dropping sleep (the default) needs the weights again
    (here: the reference model's, as a sync would write them) before the same outputs come back."""
    model = _reference("Qwen3ForCausalLM")
    engine = _engine(model, FP8, sleep_keeps_weights=keep)
    prompts = [[1, 2, 3, 4], [5, 6]]
    params = SamplingParams(n=2, max_new_tokens=16, seed=0)
    before = engine.generate(prompts, params)
    weight_bytes = sum(math.prod(m.shape) * m.dtype.itemsize for m in engine.weight_specs().values())
    torch.cuda.synchronize()
    awake = torch.cuda.memory_allocated()
    engine.sleep()
    assert awake - torch.cuda.memory_allocated() >= weight_bytes
    engine.wake()
    if not keep:
        assert engine.weights_discarded
        _load(engine, model, FP8)
    assert engine.generate(prompts, params) == before
