"""The seeded exponential noise of the rollout sampler (ops/sampling.py), on the CPU: Philox4x32-10
gives the published answers, a row's noise depends on its own seed, offset and column only, the
noise is Exp(1) and drawing with it samples the given distribution, and a draw advances each
request's generator by the step vLLM rewinds. (The kernel against this reference: tests/gpu/test_sampling_gpu.py.)"""

import math

import pytest
import torch

from megatron_jetrl.ops.sampling import (OFFSET_STEP, exponential_noise_, exponential_noise_reference,
                                         philox4x32_reference, seeded_exponential_)

# Random123's known-answer vectors for Philox4x32-10 (kat_vectors: counter, key -> output)
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


class FakeGenerator:
    """A CUDA generator's seed and offset, on the CPU (CPU generators keep no offset)."""

    def __init__(self, seed: int, offset: int = 0):
        self.seed, self.offset = seed, offset

    def initial_seed(self) -> int:
        return self.seed

    def get_offset(self) -> int:
        return self.offset

    def set_offset(self, offset: int) -> None:
        self.offset = offset


@pytest.mark.parametrize("counter,key,expected", PHILOX_KAT)
def test_philox_gives_the_published_answers(counter, key, expected):
    out = philox4x32_reference(torch.tensor(counter), torch.tensor(key))
    assert tuple(out.tolist()) == expected


def noise(table, vocab=37, rows=None):
    q = torch.full((rows or 1 + max(r for r, _, _ in table), vocab), -1.0)
    exponential_noise_reference(q, torch.tensor(table, dtype=torch.int64))
    return q


def test_a_rows_noise_depends_on_its_seed_offset_and_column_only():
    alone = noise([(0, 11, 8)])[0]
    among = noise([(3, 11, 8), (0, 12, 8), (1, 11, 12), (2, 11 + (1 << 32), 8)])
    assert torch.equal(among[3], alone)  # same seed and offset elsewhere in another batch
    for other in among[:3]:  # another seed, another offset, another high word of the seed
        assert not torch.equal(other, alone)
    assert torch.equal(noise([(0, 11, 8)], vocab=40)[0, :37], alone)  # the columns do not depend on the width


def test_rows_not_in_the_table_are_left_alone():
    q = noise([(1, 5, 0)], rows=3)
    assert torch.equal(q[0], torch.full((37,), -1.0)) and torch.equal(q[2], torch.full((37,), -1.0))
    assert bool((q[1] > 0).all())


def test_seeds_and_offsets_use_all_64_bits():
    top = noise([(0, -1, 0), (1, (1 << 63) - 1, 0), (2, 5, 1 << 40), (3, 5, (1 << 40) + 4)])
    assert len({tuple(r.tolist()) for r in top}) == 4


def test_the_noise_is_positive_finite_and_exponential():
    q = noise([(r, 1000 + r, 4 * r) for r in range(64)], vocab=4096)
    assert bool(torch.isfinite(q).all()) and bool((q > 0).all())
    n = q.numel()
    assert abs(q.mean().item() - 1.0) < 5 / math.sqrt(n)  # Exp(1): mean 1, variance 1
    for t in (0.1, 1.0, 3.0):  # P(q > t) = exp(-t)
        p = math.exp(-t)
        assert abs((q > t).double().mean().item() - p) < 5 * math.sqrt(p * (1 - p) / n)


def test_drawing_with_the_noise_samples_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0])
    draws = 20000
    q = noise([(r, 7, OFFSET_STEP * r) for r in range(draws)], vocab=len(probs))  # one request's draws in turn
    tokens = (probs / q).argmax(dim=-1)
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    assert counts[-1] == 0  # a token of probability 0 is never drawn
    expected = probs.double() * draws
    seen = expected > 0
    chi2 = (((counts - expected)[seen]) ** 2 / expected[seen]).sum().item()
    assert chi2 < 20.5, counts.tolist()  # 4 degrees of freedom: p < 0.0004


def test_a_draw_fills_the_seeded_rows_and_advances_their_generators():
    gens = {0: FakeGenerator(21, 8), 2: FakeGenerator((1 << 64) - 3, 0)}
    q = torch.full((3, 19), -1.0)
    seeded_exponential_(q, gens)
    expected = torch.full((3, 19), -1.0)
    exponential_noise_reference(expected, torch.tensor([[0, 21, 8], [2, -3, 0]]))
    assert torch.equal(q, expected)
    assert gens[0].offset == 8 + OFFSET_STEP and gens[2].offset == OFFSET_STEP
    seeded_exponential_(q, gens)  # the next draw is another
    assert not torch.equal(q[0], expected[0])
    gens[0].set_offset(gens[0].offset - 2 * OFFSET_STEP)  # rewound (vLLM, for a discarded token): the same draw
    seeded_exponential_(q, gens)
    assert torch.equal(q[0], expected[0])


def test_no_generators_draws_nothing_and_the_dispatch_takes_the_reference_off_cuda():
    q = torch.full((2, 5), -1.0)
    seeded_exponential_(q, {})
    assert torch.equal(q, torch.full((2, 5), -1.0))
    table = torch.tensor([[1, 3, 4]])
    exponential_noise_(q, table)
    expected = torch.full((2, 5), -1.0)
    exponential_noise_reference(expected, table)
    assert torch.equal(q, expected)


def test_the_kernel_refuses_what_it_cannot_fill():
    from megatron_jetrl.ops import load_extension

    ext = load_extension()
    with pytest.raises(RuntimeError, match="q must be float32"):
        ext.exponential_noise_(torch.zeros(2, 4, dtype=torch.float64), torch.zeros(1, 3, dtype=torch.int64))
    with pytest.raises(RuntimeError, match=r"table must be \[B, 3\]"):
        ext.exponential_noise_(torch.zeros(2, 4), torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="runs on CUDA"):
        ext.exponential_noise_(torch.zeros(2, 4), torch.zeros(1, 3, dtype=torch.int64))
