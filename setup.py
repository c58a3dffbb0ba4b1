"""Builds megatron_jetrl and its extension megatron_jetrl._C from csrc/.

CUDA kernels are compiled when torch is a CUDA build and a CUDA toolkit (nvcc) is found; otherwise
a CPU-only extension is built (C++ kernels; the package also works with no extension at all, on
the pure-torch references). Install with ``pip install --no-build-isolation -e .`` so the build
uses the torch already installed (a CPU wheel in CI) instead of downloading one.

Target GPUs: TORCH_CUDA_ARCH_LIST as usual for torch extensions; when unset, Hopper (9.0).
"""

import glob
import os

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError as e:  # pragma: no cover - exercised only by a broken install
    raise SystemExit(
        "megatron-jetrl builds a torch extension and needs torch installed first:\n"
        "  pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu   # CPU machine\n"
        "  (a GPU machine: the CUDA build, e.g. --index-url https://download.pytorch.org/whl/cu130)\n"
        "  pip install setuptools wheel ninja\n"
        "  pip install --no-build-isolation -e \".[test]\"\n"
        f"({e})"
    ) from e


def extension():
    cpp = ["csrc/bindings.cpp", "csrc/copy_segments.cpp", "csrc/quantize.cpp", "csrc/quantize_cpu.cpp",
           "csrc/rms_norm.cpp", "csrc/rope.cpp", "csrc/elementwise.cpp"]
    cxx = ["-O3", "-std=c++17"]
    if torch.version.cuda is not None and CUDA_HOME is not None:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
        return CUDAExtension(
            name="megatron_jetrl._C",
            sources=cpp + sorted(glob.glob("csrc/*.cu")),
            define_macros=[("JETRL_WITH_CUDA", None)],
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "-std=c++17", "--expt-relaxed-constexpr"]},
        )
    return CppExtension(name="megatron_jetrl._C", sources=cpp, extra_compile_args=cxx)


setup(
    name="megatron-jetrl",
    version="0.1.0",
    description="RL post-training on megatron-core with one unified FP8 precision flow for training and rollout",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_jetrl", "megatron_jetrl.*"]),
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    install_requires=[
        "torch>=2.10",
        "megatron-core>=0.16",
        "numpy",
        "safetensors",
        "transformers>=5.17,<6",  # tested: 5.17 (GPU host), 5.19 (vLLM 0.32 venv), 5.24 (CI)
        "pyyaml",
        "rich",
        "tensorboard",
        "pyarrow",  # Parquet, the recipes' data format
    ],
    extras_require={
        "te": ["transformer-engine[pytorch]>=2.9"],
        "vllm": ["vllm>=0.26,<0.33"],  # rollout/vllm_engine.py VLLM_VERSIONS: 0.26 (GPU host) to 0.32 (CI)
        "math": ["math-verify"],  # reward.math_checker=math_verify (the recipes' choice)
        "test": ["pytest>=8", "ruff", "matplotlib"],  # matplotlib: the study plots (benchmarks/mismatch_plots.py)
        "study": ["matplotlib"],
    },
    entry_points={"console_scripts": ["jetrl = megatron_jetrl.cli:main"]},
    zip_safe=False,
)
