"""Packed variable-length batches: sequences back to back in one row, so no compute is spent on
padding. Pure torch; the actor turns a micro-batch into megatron's ``thd`` PackedSeqParams.

Legend: T = tokens, B = sequences, ``cu_seqlens`` = [0, len_0, len_0 + len_1, ...] ([B + 1]).

Alignment: a per-token field of a batch is aligned with ``tokens``. A logprob at position t is
log p(tokens[t] | tokens of the same sequence before t); the first token of a sequence has none
and holds 0. The model's logits at position t predict token t + 1 (``next_token_labels``), and
``align_to_tokens`` moves the per-position results back onto the tokens they score.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch


@dataclass(frozen=True)
class PackedBatch:
    """Token ids [T] int64 and per-token fields ([T] each), with sequence boundaries [B + 1]."""

    tokens: torch.Tensor
    cu_seqlens: torch.Tensor
    fields: Mapping[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tokens.dim() != 1 or self.tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"tokens must be a 1-D integer tensor; got {self.tokens.dtype} {tuple(self.tokens.shape)}")
        cu = self.cu_seqlens
        if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != self.tokens.numel():
            raise ValueError(f"cu_seqlens must run from 0 to the token count {self.tokens.numel()}; got {cu.tolist()}")
        if bool((cu[1:] <= cu[:-1]).any()):
            raise ValueError("every sequence needs at least one token (cu_seqlens must increase strictly)")
        for name, t in self.fields.items():
            if tuple(t.shape) != tuple(self.tokens.shape):
                raise ValueError(f"field {name!r} has shape {tuple(t.shape)}; "
                                 f"it must match tokens {tuple(self.tokens.shape)}")

    @classmethod
    def from_sequences(
        cls, sequences: Sequence[Sequence[int] | torch.Tensor], **fields: Sequence[Sequence[float] | torch.Tensor]
    ) -> "PackedBatch":
        """Pack lists (or 1-D tensors) of token ids; each field gives one per-token list per sequence."""
        if not sequences:
            raise ValueError("a batch needs at least one sequence")
        seqs = [torch.as_tensor(s, dtype=torch.int64).reshape(-1) for s in sequences]
        lens = [len(s) for s in seqs]
        packed = {}
        for name, values in fields.items():
            if len(values) != len(seqs):
                raise ValueError(f"field {name!r} has {len(values)} sequences; tokens have {len(seqs)}")
            parts = [torch.as_tensor(v).reshape(-1) for v in values]
            for i, (p, n) in enumerate(zip(parts, lens, strict=True)):
                if p.numel() != n:
                    raise ValueError(f"field {name!r} of sequence {i} has {p.numel()} values for {n} tokens")
            packed[name] = torch.cat(parts)
        return cls(torch.cat(seqs), cu_seqlens_of(lens), packed)

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def seq_lens(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    def select(self, indices: Sequence[int]) -> "PackedBatch":
        """The sub-batch of sequences ``indices``, in that order."""
        cu = self.cu_seqlens.tolist()
        spans = [(cu[i], cu[i + 1]) for i in indices]
        index = torch.cat([torch.arange(a, b) for a, b in spans])
        lens = [b - a for a, b in spans]
        return PackedBatch(self.tokens[index], cu_seqlens_of(lens), {k: v[index] for k, v in self.fields.items()})

    def padded_to(self, multiple: int) -> "PackedBatch":
        """Append a padding sequence (token 0, fields 0) so T is a multiple of ``multiple`` (sequence
        parallelism splits T over TP ranks). The padding is the last sequence; drop it from results."""
        pad = -self.tokens.numel() % multiple
        if pad == 0:
            return self
        tokens = torch.cat([self.tokens, self.tokens.new_zeros(pad)])
        cu = torch.cat([self.cu_seqlens, self.cu_seqlens[-1:] + pad])
        fields = {k: torch.cat([v, v.new_zeros(pad)]) for k, v in self.fields.items()}
        return PackedBatch(tokens, cu, fields)


def cu_seqlens_of(lens: Sequence[int]) -> torch.Tensor:
    return torch.tensor([0, *lens], dtype=torch.int64).cumsum(0)


def next_token_labels(tokens: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """labels[t] = tokens[t + 1] inside a sequence; 0 at each sequence's last position (no target)."""
    labels = torch.roll(tokens, -1)
    # index_fill_ takes the 0 as a scalar argument; ``labels[idx] = 0`` would copy it to the device
    # from pageable host memory first, which makes the host wait for the GPU
    return labels.index_fill_(0, cu_seqlens[1:].to(tokens.device) - 1, 0)


def align_to_tokens(per_position: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Move values computed at position t (for token t + 1) onto token t + 1; 0 at sequence starts."""
    out = torch.roll(per_position, 1)
    return out.index_fill_(0, cu_seqlens[:-1].to(per_position.device), 0)  # no host copy of the 0


def partition_for_data_parallel(seq_lens: Sequence[int], dp_size: int) -> list[list[int]]:
    """Split sequence indices over ``dp_size`` ranks with balanced token counts (longest first, each
    to the rank with the fewest tokens; ties to the lowest rank). Deterministic, so every rank
    computes the same split. Each rank's indices are ascending."""
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1; got {dp_size}")
    if len(seq_lens) < dp_size:
        raise ValueError(
            f"the batch has {len(seq_lens)} sequences but data-parallel size is {dp_size}: every "
            "data-parallel rank needs at least one sequence; send a larger batch or use fewer DP ranks"
        )
    order = sorted(range(len(seq_lens)), key=lambda i: (-seq_lens[i], i))
    parts: list[list[int]] = [[] for _ in range(dp_size)]
    loads = [0] * dp_size
    for i in order:
        r = min(range(dp_size), key=lambda k: (loads[k], len(parts[k]), k))
        parts[r].append(i)
        loads[r] += seq_lens[i]
    return [sorted(p) for p in parts]


def plan_micro_batches(seq_lens: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group sequence indices into micro-batches of at most ``max_tokens`` tokens (first fit,
    longest first). A sequence longer than the budget gets a micro-batch of its own; the caller
    rejects sequences the model cannot take. Micro-batches are ordered by their first index."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1; got {max_tokens}")
    order = sorted(range(len(seq_lens)), key=lambda i: (-seq_lens[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        n = seq_lens[i]
        for b, load in enumerate(loads):
            if load + n <= max_tokens:
                bins[b].append(i)
                loads[b] += n
                break
        else:
            bins.append([i])
            loads.append(n)
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def plan_batch(seq_lens: Sequence[int], dp_size: int, max_tokens: int) -> list[list[list[int]]]:
    """For every data-parallel rank, its micro-batches as lists of global sequence indices:
    ``partition_for_data_parallel`` then ``plan_micro_batches`` within each rank's share. Every rank
    computes the whole plan, so each knows where every other rank's results belong."""
    plan = []
    for shard in partition_for_data_parallel(seq_lens, dp_size):
        groups = plan_micro_batches([seq_lens[i] for i in shard], max_tokens)
        plan.append([[shard[j] for j in group] for group in groups])
    return plan
