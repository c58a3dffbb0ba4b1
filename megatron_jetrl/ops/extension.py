"""Loading the compiled extension, with an error that says how to build it when it is missing."""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

BUILD_HINT = "build it from the repository root with: pip install --no-build-isolation -e ."


class ExtensionUnavailable(RuntimeError):
    """The compiled extension (or its CUDA part) is not available."""


@functools.lru_cache(maxsize=None)
def load_extension() -> ModuleType:
    try:
        return importlib.import_module("megatron_jetrl._C")
    except ImportError as e:
        raise ExtensionUnavailable(f"megatron_jetrl._C is not built ({e}); {BUILD_HINT}") from e


def cuda_kernels_available() -> bool:
    """Whether the extension is built and includes the CUDA kernels."""
    try:
        return bool(load_extension().with_cuda())
    except ExtensionUnavailable:
        return False
