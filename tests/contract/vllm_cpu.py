"""vLLM's real model classes on the CPU, with the engine's own configuration.

The minimum real setup: ``vllm.EngineArgs(**llm_kwargs(...)).create_engine_config()`` (the exact
arguments ``VllmEngine`` passes to ``vllm.LLM``; only sleep mode is off, which the CPU platform
lacks), vLLM's distributed state on gloo, then the steps of ``BaseModelLoader.load_model`` for
``load_format="dummy"`` without its CUDA cache calls. Two choices are stubbed:

- the block-FP8 GEMM kernel (vLLM has no CPU kernel to choose). It returns
  ``CutlassFp8BlockScaledMMKernel``, the kernel vLLM picks on Hopper when DeepGEMM and FlashInfer
  are absent; its weight processing is the shared
  ``Fp8BlockScaledMMLinearKernel.process_weights_after_loading``, which the DeepGEMM kernel also
  runs first (its fp32 128x128 scale transform is an identity on SM90).
- the host-CPU check for vLLM's AMX GEMM (``no_sgl_kernel``), so that the tests take the same path
  on every CI machine. It is set when this module is imported, and so also in spawned workers.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import torch
import transformers
import vllm
import vllm.model_executor.kernels.linear as vllm_linear_kernels
import vllm.model_executor.kernels.linear.scaled_mm.cpu as vllm_scaled_mm_cpu
import vllm.model_executor.layers.utils as vllm_layer_utils
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.kernels.linear.scaled_mm.cutlass import CutlassFp8BlockScaledMMKernel
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.model_loader import get_model_loader
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.utils.torch_utils import set_default_torch_dtype

from megatron_jetrl.precision import PrecisionRecipe
from megatron_jetrl.rollout.vllm_engine import VllmOptions, llm_kwargs
from tests.model_fixtures import tiny_hf_model

ARCHS = ["Qwen3ForCausalLM", "LlamaForCausalLM"]


def tiny_model(arch: str, seed: int = 0) -> transformers.PreTrainedModel:
    """A tiny random HF model with head_dim 128 (q/k/v and gate/up boundaries on 128 rows, so the
    sync re-slices the trainer's 128x128 blocks exactly at any rollout TP up to 4)."""
    if arch != "LlamaForCausalLM":
        return tiny_hf_model(arch, seed=seed)
    config = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=128, vocab_size=1000, max_position_embeddings=16384, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192})
    config.architectures = [arch]
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    return model.eval()


def write_config(model: transformers.PreTrainedModel, directory: Path) -> Path:
    """The checkpoint directory the engine is pointed at: a plain BF16 config.json (the FP8 config
    comes from the recipe, not from the checkpoint)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model.config.to_dict()))
    return directory


def engine_config(kwargs: dict) -> VllmConfig:
    """vLLM's config from ``vllm.LLM`` keyword arguments, as the engine core builds it."""
    return vllm.EngineArgs(**{**kwargs, "enable_sleep_mode": False}).create_engine_config()


def cpu_vllm_config(model_dir: Path, recipe: PrecisionRecipe, options: VllmOptions | None = None) -> VllmConfig:
    hf_config = json.loads((model_dir / "config.json").read_text())
    return engine_config(llm_kwargs(model_dir, hf_config, recipe, options or VllmOptions()))


def init_vllm_distributed(init_file: Path, *, world_size: int = 1, rank: int = 0, tp: int = 1) -> None:
    """vLLM's world and TP groups on gloo (once per process)."""
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=world_size, rank=rank, local_rank=rank,
                                     distributed_init_method=f"file://{init_file}", backend="gloo")
        initialize_model_parallel(tp)


@contextlib.contextmanager
def block_fp8_kernel_on_cpu() -> Iterator[None]:
    """The first stub: vLLM's block-FP8 kernel choice answers with its Hopper CUTLASS kernel."""
    real = vllm_linear_kernels.choose_scaled_mm_linear_kernel

    def choose(config, possible_kernels, compute_capability=None, force_kernel=None, *, quantization):
        if quantization != "fp8_block_w8a8":
            return real(config, possible_kernels, compute_capability, force_kernel, quantization=quantization)
        return CutlassFp8BlockScaledMMKernel

    vllm_linear_kernels.choose_scaled_mm_linear_kernel = choose
    try:
        yield
    finally:
        vllm_linear_kernels.choose_scaled_mm_linear_kernel = real


SGL_CHECK_READERS = (vllm_layer_utils, vllm_scaled_mm_cpu)
"""The modules whose ``check_cpu_sgl_kernel`` vLLM 0.32 calls: the unquantized CPU GEMM dispatch
(``dispatch_cpu_unquantized_gemm``) and the CPU int8 scaled-mm kernel (which imports it by name)."""
VLLM_SGL_CHECK = vllm_layer_utils.check_cpu_sgl_kernel
"""vLLM's own check, kept for the test that shows what it does on an AMX host."""


def no_sgl_kernel(n: int, k: int, dtype: torch.dtype) -> bool:
    """The second stub, in place of vLLM's ``check_cpu_sgl_kernel`` whatever the host CPU.

    On a CPU with AMX (``torch.cpu._is_amx_tile_supported()``: Sapphire Rapids and newer) vLLM's
    check is true for every small bf16 weight (at most 1 MiB, N % 16 == 0, K % 32 == 0): all the
    linears of the tests' tiny models. vLLM then packs them with ``torch.ops._C.convert_weight_packed``,
    an op of vLLM's CPU build that the PyPI wheel lacks, and drops their ``weight``. vLLM 0.32 has no
    setting for this. With the stub, vLLM takes the path it takes on a CPU without AMX
    (``torch.nn.functional.linear``, the weight kept), which is also what a GPU worker holds."""
    return False


for _module in SGL_CHECK_READERS:
    # on import, so that it holds in the pytest process and in every spawned worker (which imports
    # this module to unpickle its target): the tests take the same path on every host
    _module.check_cpu_sgl_kernel = no_sgl_kernel


def build_vllm_model(vllm_config: VllmConfig) -> torch.nn.Module:
    """The model a vLLM worker holds after ``load_model`` with ``load_format="dummy"``."""
    model_config, device = vllm_config.model_config, torch.device("cpu")
    loader = get_model_loader(vllm_config.load_config)
    with block_fp8_kernel_on_cpu(), set_current_vllm_config(vllm_config):
        with set_default_torch_dtype(model_config.dtype), device:
            model = loader.create_model(vllm_config=vllm_config, model_config=model_config)
        loader.load_weights(model, model_config)
        process_weights_after_loading(model, model_config, device)
    return model.eval()


def expected_params(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What each vLLM parameter must hold after loading ``tensors`` (HF names, this rank's shards):
    the projections of a fused linear concatenated in packed-modules order; for a vocab-parallel
    embedding, this rank's rows of the full tensor (vLLM pads the vocab; the padding is not
    compared)."""
    packed = model.packed_modules_mapping
    out = {}
    for name, _ in model.named_parameters():
        module_name, _, attr = name.rpartition(".")
        prefix, _, leaf = module_name.rpartition(".")
        module = model.get_submodule(module_name)
        if leaf in packed:
            out[name] = torch.cat([tensors[f"{prefix}.{p}.{attr}"] for p in packed[leaf]])
        elif isinstance(module, VocabParallelEmbedding):
            rows = module.shard_indices
            out[name] = tensors[name][rows.org_vocab_start_index : rows.org_vocab_end_index]
        else:
            out[name] = tensors[name]
    return out


def assert_params_equal(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    """Byte equality (FP8 codes as bytes), shape and dtype of every parameter; an embedding's
    padding rows are not compared (``expected`` may hold them or not)."""
    params = dict(model.named_parameters())
    assert set(params) == set(expected), sorted(set(params) ^ set(expected))
    for name, param in params.items():
        want, got = expected[name], param.detach()
        module = model.get_submodule(name.rpartition(".")[0])
        if isinstance(module, VocabParallelEmbedding):  # this rank's vocabulary rows, not the padding
            rows = module.shard_indices.org_vocab_end_index - module.shard_indices.org_vocab_start_index
            got, want = got[:rows], want[:rows]
        assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, want.dtype, got.shape, want.shape)
        assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), name


class InProcessLLM:
    """Stands in for ``vllm.LLM``, which cannot start on this CPU machine (the PyPI vLLM wheel is a
    CUDA build: its CPU platform needs the ``vllm._C`` CPU kernels, e.g. ``init_cpu_memory_env``).
    It builds the real vLLM config and model from the engine's arguments and runs
    ``collective_rpc`` on them the way vLLM's in-process executor does (``fn(worker)``); sleep,
    wake and the prefix cache are only recorded."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.vllm_config = engine_config(kwargs)
        self.model = build_vllm_model(self.vllm_config)
        self.worker = SimpleNamespace(get_model=lambda: self.model, vllm_config=self.vllm_config)
        self.calls: list[tuple] = []
        shutdown = SimpleNamespace(shutdown=lambda: self.calls.append(("shutdown",)))
        self.llm_engine = SimpleNamespace(engine_core=shutdown)

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("collective_rpc",))
        return [method(self.worker, *args, **(kwargs or {}))]

    def sleep(self, level: int = 1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))
        return True

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.calls.append(("reset_prefix_cache",))
        return True

    def generate(self, *args, **kwargs):
        raise NotImplementedError("no vLLM CPU kernels in this wheel: generation runs on the GPU host")
