"""Compiled kernels. The only package that imports ``megatron_jetrl._C``; each op sits beside
the pure-torch reference it must equal bit for bit (``megatron_jetrl.precision``)."""

from megatron_jetrl.ops.copy import SEGMENT_COLUMNS, copy_segments, copy_segments_reference
from megatron_jetrl.ops.extension import ExtensionUnavailable, cuda_kernels_available, load_extension
from megatron_jetrl.ops.quantize import NativeQuantizer, quantize_1x128, quantize_128x128

__all__ = [
    "SEGMENT_COLUMNS",
    "ExtensionUnavailable",
    "NativeQuantizer",
    "copy_segments",
    "copy_segments_reference",
    "cuda_kernels_available",
    "load_extension",
    "quantize_1x128",
    "quantize_128x128",
]
