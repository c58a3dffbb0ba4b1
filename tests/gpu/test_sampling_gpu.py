"""The seeded exponential noise kernel equals its pure-torch reference (ops/sampling.py) on CUDA bit for
bit: Qwen's vocabulary, widths that are not a multiple of 4, a row stride wider than the row, seeds
and offsets over all 64 bits, sparse rows. And vLLM's sampler with the replacement
(rollout/vllm_sampling.py) draws ``argmax(probs / q)`` with that noise on real CUDA generators: a
request's token does not depend on the batch around it, and each draw advances its generator by
the step vLLM rewinds."""

import pytest
import torch

from megatron_jetrl.ops.sampling import OFFSET_STEP, exponential_noise_, exponential_noise_reference
from tests.gpu.conftest import requires_vllm

pytestmark = pytest.mark.gpu

QWEN_VOCAB = 151936


def _table(rows, seed0=0):
    g = torch.Generator().manual_seed(seed0)
    seeds = torch.randint(-(2**63), 2**63 - 1, (len(rows),), generator=g, dtype=torch.int64)
    offsets = torch.randint(0, 2**40, (len(rows),), generator=g, dtype=torch.int64) * OFFSET_STEP
    return torch.stack([torch.tensor(rows, dtype=torch.int64), seeds, offsets], dim=-1)


def _same_bits(actual, expected, what):
    diff = (actual.view(torch.int32) != expected.view(torch.int32)).nonzero()
    assert diff.numel() == 0, f"{what}: {diff.shape[0]} values differ, first at {diff[0].tolist()}"


@pytest.mark.parametrize("rows,vocab,stride", [(128, QWEN_VOCAB, QWEN_VOCAB), (7, 1001, 1001), (5, 258, 263),
                                                (3, 3, 3), (256, 4096, 4100)])
def test_the_kernel_equals_the_reference(rows, vocab, stride):
    filled = list(range(0, rows, 2)) if rows > 3 else list(range(rows))  # sparse rows: the others stay
    table = _table(filled, seed0=rows + vocab).cuda()
    base = torch.full((rows, stride), -1.0, device="cuda")
    q, expected = base[:, :vocab], base.clone()[:, :vocab]
    exponential_noise_(q, table)
    exponential_noise_reference(expected, table)
    _same_bits(q, expected, f"{rows}x{vocab} (row stride {stride})")
    assert bool((base[:, vocab:] == -1).all()), "the kernel wrote past a row's end"


def test_a_rows_noise_from_the_kernel_does_not_depend_on_the_batch():
    table = _table(list(range(64)), seed0=3).cuda()
    q = torch.empty(64, QWEN_VOCAB, device="cuda")
    exponential_noise_(q, table)
    alone = torch.empty(1, QWEN_VOCAB, device="cuda")
    exponential_noise_(alone, torch.cat([torch.zeros_like(table[17:18, :1]), table[17:18, 1:]], dim=-1))
    _same_bits(alone[0], q[17], "row 17 alone vs in 64")


@requires_vllm
def test_vllms_sampler_draws_with_the_batched_noise():
    from megatron_jetrl.rollout import vllm_sampling

    vllm_sampling.install()
    try:
        module = vllm_sampling.sampler_module()
        g = torch.Generator(device="cuda").manual_seed(0)
        probs = torch.softmax(torch.randn(6, QWEN_VOCAB, device="cuda", generator=g) * 3, dim=-1)

        def generators(seeds):
            return {i: torch.Generator(device="cuda").manual_seed(s) for i, s in seeds.items()}

        seeded = {0: 11, 2: 12, 3: 13, 5: 14}
        gens = generators(seeded)
        offsets = {i: gen.get_offset() for i, gen in gens.items()}
        tokens = module.random_sample(probs.clone(), gens)
        for i, s in seeded.items():
            q = torch.empty(1, QWEN_VOCAB, device="cuda")
            exponential_noise_reference(q, torch.tensor([[0, s, offsets[i]]]))
            assert tokens[i].item() == (probs[i] / q[0]).argmax().item(), f"row {i}"
            assert gens[i].get_offset() == offsets[i] + OFFSET_STEP
        alone = module.random_sample(probs[3:4].clone(), generators({0: 13}))  # request 3 in a batch of one
        assert alone[0].item() == tokens[3].item()
    finally:
        vllm_sampling.uninstall()
