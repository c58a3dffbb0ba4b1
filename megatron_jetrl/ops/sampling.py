"""Seeded exponential noise for the rollout engine's sampler (csrc/sampling*), every seeded row in
one launch.

vLLM draws a token as ``argmax(probs / q)`` with ``q ~ Exp(1)`` per vocabulary entry. A request with
its own seed has its own ``torch.Generator``, and vLLM fills that request's row of ``q`` with one
``exponential_`` call per request, every decode step: a Python loop of one launch per request. The
trainer seeds every request (``run.seed``, step, round: reproducible rollouts and exact resume), so
at 128 requests the loop costs about 1.1 ms of host time per decode step on an H200 while the GPU
waits (``docs/rollout.md``). ``seeded_exponential_`` fills all the seeded rows in one kernel.

The noise: row ``row`` of ``q`` gets, at column ``j``, ``-log(u)`` with ``u = (2·(x >> 9) + 1)·2⁻²⁴``
(in (0, 1): never 0 or 1, so ``q`` is finite and positive) and ``x`` word ``j % 4`` of Philox4x32-10
with key ``(seed low, seed high)`` and counter ``(j // 4, 0, offset low, offset high)``. A row's noise
depends on its seed, its offset and the column only, never on the other rows of the batch. The
offset is the generator's (``torch.Generator.get_offset``): a draw advances it by ``OFFSET_STEP``, the
step vLLM rewinds when it discards a partial prefill's token, so a request's draws follow each
other as with vLLM's own loop (other numbers: the stream is Philox's, not torch's ``exponential_``).
"""

from __future__ import annotations

from typing import Mapping, Protocol

import torch

from megatron_jetrl.ops.extension import load_extension

OFFSET_STEP = 4
"""How far one draw advances a request's generator offset (vLLM rewinds a discarded token by 4)."""

PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)
PHILOX_ROUNDS = 10
_M32 = 0xFFFFFFFF


class SeededGenerator(Protocol):
    """What ``seeded_exponential_`` reads of a request's generator (a CUDA ``torch.Generator``)."""

    def initial_seed(self) -> int: ...

    def get_offset(self) -> int: ...

    def set_offset(self, offset: int) -> object: ...


def _signed64(v: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits."""
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


def _mulhilo(m: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``m · x`` (``m`` and ``x`` below 2³², ``x`` int64): in 16-bit
    halves, so no int64 product overflows."""
    m_hi, m_lo = m >> 16, m & 0xFFFF
    x_hi, x_lo = x >> 16, x & 0xFFFF
    mid = m_lo * x_hi + m_hi * x_lo
    low = m_lo * x_lo + ((mid & 0xFFFF) << 16)
    return m_hi * x_hi + (mid >> 16) + (low >> 32), low & _M32


def philox4x32_reference(counter: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Philox4x32-10 in pure torch: ``counter`` int64 [..., 4] and ``key`` int64 [..., 2] (each word
    below 2³², broadcastable) -> int64 [..., 4], the four 32-bit output words."""
    c0, c1, c2, c3 = counter.unbind(-1)
    k0, k1 = key.unbind(-1)
    for r in range(PHILOX_ROUNDS):
        if r:
            k0, k1 = (k0 + PHILOX_W[0]) & _M32, (k1 + PHILOX_W[1]) & _M32
        hi0, lo0 = _mulhilo(PHILOX_M[0], c0)
        hi1, lo1 = _mulhilo(PHILOX_M[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return torch.stack(torch.broadcast_tensors(c0, c1, c2, c3), dim=-1)


def exponential_noise_reference(q: torch.Tensor, table: torch.Tensor) -> None:
    """Fill ``q[row]`` (float32 [R, V]) for every ``(row, seed, offset)`` of ``table`` (int64 [B, 3]) in
    pure torch, on ``q``'s device: what the kernel computes, bit for bit."""
    if table.numel() == 0:
        return
    table = table.to(q.device)
    row, seed, offset = table.unbind(-1)
    V = q.shape[1]
    groups = torch.arange((V + 3) // 4, dtype=torch.int64, device=q.device)
    lanes = [groups.expand(len(row), -1), torch.zeros_like(groups).expand(len(row), -1)]
    lanes += [(w & _M32)[:, None].expand(-1, len(groups)) for w in (offset, offset >> 32)]
    key = torch.stack([seed & _M32, (seed >> 32) & _M32], dim=-1)[:, None, :]
    words = philox4x32_reference(torch.stack(lanes, dim=-1), key).reshape(len(row), -1)[:, :V]
    u = ((words >> 9) * 2 + 1).to(torch.float32) * 2.0**-24
    q[row] = -torch.log(u)


def exponential_noise_(q: torch.Tensor, table: torch.Tensor) -> None:
    """``exponential_noise_reference``'s values, in one kernel on CUDA (the reference elsewhere)."""
    if q.is_cuda:
        load_extension().exponential_noise_(q, table)
    else:
        exponential_noise_reference(q, table)


def seeded_exponential_(q: torch.Tensor, generators: Mapping[int, SeededGenerator]) -> None:
    """Fill row ``i`` of ``q`` (float32 [R, V]) for each ``i -> generator`` of ``generators`` with that
    request's next draw, and advance each generator's offset by ``OFFSET_STEP``. Host work: three
    calls per request and one copy of the table; no host sync (the table goes through pinned memory)."""
    if not generators:
        return
    rows = []
    for i, g in generators.items():
        offset = g.get_offset()
        rows.append((i, _signed64(g.initial_seed()), _signed64(offset)))
        g.set_offset(offset + OFFSET_STEP)
    table = torch.tensor(rows, dtype=torch.int64, pin_memory=q.is_cuda)
    exponential_noise_(q, table.to(q.device, non_blocking=True))
