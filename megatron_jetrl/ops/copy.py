"""Batched 2-D byte copies (csrc/copy_segments*): the weight sync's reshard and bucket packing.

A segment table is int64 [S, 8] on the CPU, one row per copy, in bytes (``SEGMENT_COLUMNS``):
``rows`` rows of ``row_bytes`` bytes, read from ``srcs[src]`` at ``src_offset`` + r·``src_stride``
and written to ``dsts[dst]`` at ``dst_offset`` + r·``dst_stride``. Tensors must be contiguous and on
one device; offsets address their bytes whatever their dtype. One launch copies every segment, so
de-interleaving a QKV shard into q/k/v, splitting [gate; up], joining row-parallel column shards
and packing a bucket cost one kernel instead of one copy per piece.
"""

from __future__ import annotations

from typing import Sequence

import torch

from megatron_jetrl.ops.extension import load_extension

SEGMENT_COLUMNS = ("src", "src_offset", "src_stride", "dst", "dst_offset", "dst_stride", "row_bytes", "rows")


def copy_segments(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], table: torch.Tensor) -> None:
    """Run every copy of ``table`` (the kernel; bounds and devices are checked before launching)."""
    load_extension().copy_segments(list(srcs), list(dsts), table)


def copy_segments_reference(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], table: torch.Tensor) -> None:
    """The same copies in pure torch, one strided copy per segment (no bounds checks beyond torch's)."""
    src_bytes = [_bytes(t) for t in srcs]
    dst_bytes = [_bytes(t) for t in dsts]
    for src, s_off, s_stride, dst, d_off, d_stride, row_bytes, rows in table.tolist():
        if rows == 0 or row_bytes == 0:
            continue
        s_base, d_base = src_bytes[src], dst_bytes[dst]
        # as_strided's offset counts from the storage's start, not the view's
        s = s_base.as_strided((rows, row_bytes), (s_stride, 1), s_base.storage_offset() + s_off)
        d_base.as_strided((rows, row_bytes), (d_stride, 1), d_base.storage_offset() + d_off).copy_(s)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as flat uint8 (a view: writes land in ``t``)."""
    if not t.is_contiguous():
        raise ValueError(f"copy_segments needs contiguous tensors; got strides {t.stride()} for shape {tuple(t.shape)}")
    return t.reshape(-1).view(torch.uint8)
