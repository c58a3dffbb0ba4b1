"""Megatron's fused tensor layouts and tensor-parallel splits, as pure tensor functions.

    linear_qkv (rows)   for each query group g (= KV head g), in order:
                          [ q rows of the group's heads | k rows of head g | v rows of head g ]
                        each head is head_dim rows; TP splits whole groups, so a TP shard is a
                        contiguous row range.
    linear_fc1 (rows)   [gate; up] on every TP rank: rank r holds [gate_r; up_r], so the full
                        (TP=1) tensor is [gate; up] and a TP shard is not a contiguous slice of it.

Legend: H query heads, G query groups (KV heads), d head_dim, P = H // G heads per group.
"""

from __future__ import annotations

import torch


def interleave_qkv(q_HdK: torch.Tensor, k_GdK: torch.Tensor, v_GdK: torch.Tensor, num_groups: int) -> torch.Tensor:
    """HF q/k/v projections (weights [rows, K] or biases [rows]) -> megatron linear_qkv rows."""
    d = k_GdK.shape[0] // num_groups
    q = q_HdK.reshape(num_groups, -1, *q_HdK.shape[1:])
    k = k_GdK.reshape(num_groups, d, *k_GdK.shape[1:])
    v = v_GdK.reshape(num_groups, d, *v_GdK.shape[1:])
    return torch.cat([q, k, v], dim=1).reshape(-1, *q_HdK.shape[1:])


def split_qkv(
    qkv: torch.Tensor, num_heads: int, num_groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``interleave_qkv`` (for any number of whole groups, e.g. one TP shard)."""
    groups = qkv.shape[0] // ((num_heads // num_groups + 2) * head_dim)
    per_group = qkv.reshape(groups, -1, head_dim, *qkv.shape[1:])
    p = num_heads // num_groups
    q = per_group[:, :p].reshape(-1, *qkv.shape[1:])
    k = per_group[:, p].reshape(-1, *qkv.shape[1:])
    v = per_group[:, p + 1].reshape(-1, *qkv.shape[1:])
    return q.contiguous(), k.contiguous(), v.contiguous()


def tp_chunk(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous 1/size of ``t`` along ``dim``."""
    if t.shape[dim] % size:
        raise ValueError(f"dimension {dim} of size {t.shape[dim]} is not divisible by TP={size}")
    return t.chunk(size, dim=dim)[rank]


def fc1_shard(gate: torch.Tensor, up: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """linear_fc1 of TP rank ``rank``: [gate_r; up_r]."""
    return torch.cat([tp_chunk(gate, 0, rank, size), tp_chunk(up, 0, rank, size)])


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero rows appended up to ``rows`` (vocab padding of embedding and output layer)."""
    if t.shape[0] > rows:
        raise ValueError(f"cannot pad {t.shape[0]} rows down to {rows}")
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def pp_layer_range(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """Decoder layers held by pipeline stage ``pp_rank`` (even split, megatron's default)."""
    if num_layers % pp_size:
        raise ValueError(f"num_layers {num_layers} is not divisible by PP={pp_size}")
    per = num_layers // pp_size
    return range(pp_rank * per, (pp_rank + 1) * per)
