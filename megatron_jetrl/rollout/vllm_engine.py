"""The ``vllm`` rollout engine: vLLM in-process on every rank, colocated with the trainer.

Each rank builds one ``vllm.LLM`` with ``distributed_executor_backend="external_launcher"``: no
worker processes, no Ray, the engine core in this process (vLLM turns its multiprocessing off for
that backend); the ranks of a rollout TP group (consecutive global ranks) form vLLM's TP group on
the job's own ``torch.distributed`` world, and every other group of ``rollout TP`` ranks is an
independent replica. All ranks of one TP group must make the same calls with the same prompts and
sampling (vLLM schedules deterministically per replica).

Precision comes from the recipe only: the model is built from the policy's HF config with the
recipe's block-FP8 ``quantization_config`` (``hf_overrides``), ``load_format="dummy"`` (the first
weights come from the weight sync, nothing is read from disk), no tokenizer (token ids in, token
ids out) and ``logprobs_mode="raw_logprobs"`` (logprobs of the model's own distribution,
comparable with the trainer's). vLLM on Hopper keeps a block-FP8 weight as loaded: ``weight`` e4m3
[N, K] and ``weight_scale_inv`` fp32 [N/128, K/128], so the bytes the sync ships are the bytes the
GEMMs read, provided DeepGEMM's UE8M0 re-quantization is off. That switch is an environment
variable read by vLLM; the launcher sets it (``engine_env``) and this engine checks it, and checks
after start-up that vLLM holds every FP8 weight in the checkpoint layout.

Two ways to update weights (``rollout.vllm.weight_update``):

- ``in_place`` (default): every checkpoint tensor is a view of a live vLLM parameter
  (``vllm_model.DirectTargets``). ``weight_buffers()`` hands those views to the weight sync, whose
  copy kernels write the trainer's bytes straight into vLLM's storage; ``update_weights`` copies
  whatever else arrives (the vocabulary rows of this rank at rollout TP > 1, FP8 KV-cache scales).
- ``reload``: vLLM's own loaders through its layerwise reload (``vllm_model.LayerwiseUpdate``): an
  update may span several ``update_weights`` calls (one per sync bucket) and is closed by the next
  ``generate``, ``sleep`` or ``wake``. Slower (vLLM materialises each layer in checkpoint layout,
  loads, processes and copies back), for layouts the in-place path refuses.

Sleep level 2 (the default) discards the weights instead of copying them to host memory: every RL
step replaces all of them anyway, so level 1 would only spend host RAM and PCIe time on bytes that
are about to be overwritten. The price is that after a level-2 sleep (and after start-up, when the
weights are dummy) the next update must deliver every tensor of ``weight_specs()`` before
``generate``; the engine checks that and names what is missing. Level 1 allows partial updates.

Supported vLLM versions and the differences between them live in ``VLLM_VERSIONS`` below.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import importlib
import importlib.metadata
import json
import math
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional, Sequence

import torch

from megatron_jetrl.config import ConfigError
from megatron_jetrl.models import bridge_for
from megatron_jetrl.precision import PrecisionRecipe
from megatron_jetrl.rollout import vllm_activation_quant, vllm_exact
from megatron_jetrl.rollout.settings import VllmOptions
from megatron_jetrl.rollout.base import (MissingWeights, Sample, SamplingParams, TensorMeta, WeightMismatch,
                                         check_against_specs)
from megatron_jetrl.rollout.vllm_model import KV_SCALES, DirectTargets, LayerwiseUpdate, model_weight_specs

if TYPE_CHECKING:
    import vllm


FINISH_REASONS = {"stop": "stop", "length": "length"}
"""vLLM ``CompletionOutput.finish_reason`` -> ``Sample.finish_reason``; anything else is an error."""

VLLM_VERSIONS = {
    "0.26": "the GPU host's vLLM (the newest built for torch 2.11 / CUDA 13); GPU-tested",
    "0.32": "current vLLM (torch 2.13); contract-tested on CPU in CI",
}
"""The vLLM minor versions this engine is tested with. Versions between them are accepted (the
APIs the engine uses are the same in both; the contract tests read them from each version's
source). Everything the engine uses from vLLM — ``LLM(...)`` arguments, ``generate`` with token-id
prompts, ``collective_rpc`` with a callable, ``sleep(level)`` / ``wake_up(tags)``,
``reset_prefix_cache``, ``model_loader.reload`` and the layer classes read by ``vllm_model`` — has
one form in both, so no code here branches on the version."""


def _first_rank() -> bool:
    """Whether this process is rank 0 of the job (or the only process): the one that prints."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def parse_version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor.split("rc")[0].split("+")[0])


def check_vllm_version(version: str) -> None:
    """Raise naming the supported range when ``version`` is outside it."""
    tested = sorted(parse_version(v) for v in VLLM_VERSIONS)
    try:
        v = parse_version(version)
    except ValueError:
        v = None
    if v is None or not tested[0] <= v <= tested[-1]:
        lo, hi = (".".join(map(str, t)) for t in (tested[0], tested[-1]))
        raise ConfigError("rollout.engine", "vllm",
                          f"needs vLLM {lo}.x to {hi}.x; this environment has vLLM {version} (pip install "
                          f"vllm=={hi}.0, or rollout.engine=hf)")


def installed_vllm_version() -> Optional[str]:
    """vLLM's version from its package metadata (without importing it), or None."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def require_vllm_version() -> str:
    """The installed vLLM's version, or an error saying how to get a supported one (without
    importing vLLM: ``jetrl train`` asks before any expensive work)."""
    version = installed_vllm_version()
    if version is None:
        raise ConfigError("rollout.engine", "vllm", "vLLM is not installed here: pip install 'megatron-jetrl[vllm]' "
                          "(or use rollout.engine=hf)")
    check_vllm_version(version)
    return version


def require_vllm() -> ModuleType:
    """The ``vllm`` module, or an error saying how to get it."""
    require_vllm_version()
    import vllm

    return vllm


def engine_env(recipe: PrecisionRecipe, options: VllmOptions) -> dict[str, str]:
    """Environment variables vLLM must see (it reads them at import or first use, so the launcher
    sets them before the process imports vLLM): the recipe's scale format for DeepGEMM and the
    FP8 GEMM choice."""
    env = dict(recipe.vllm_env)
    if recipe.rollout_fp8:
        env["VLLM_USE_DEEP_GEMM"] = "1" if options.fp8_gemm_kernel == "deep_gemm" else "0"
    return env


def check_environment(env: Mapping[str, str], environ: Mapping[str, str] = os.environ) -> None:
    """Raise naming the first variable of ``env`` that the process environment does not set to its
    value. The package never sets environment variables itself."""
    for var, value in env.items():
        if environ.get(var) != value:
            raise ConfigError(
                f"environment:{var}", environ.get(var),
                f"the vllm engine needs {var}={value} (jetrl train sets it; a script that builds the engine "
                f"itself must export {var}={value} before vLLM is imported)",
            )


def llm_kwargs(model_path: str | Path, hf_config: Mapping[str, Any], recipe: PrecisionRecipe,
               options: VllmOptions) -> dict[str, Any]:
    """The ``vllm.LLM`` keyword arguments of this engine (``vllm.EngineArgs`` fields)."""
    bridge = bridge_for(dict(hf_config))
    settings = recipe.vllm_settings(bridge.dims.num_layers, linear_names=bridge.linear_names)
    quant = settings.quantization_config
    kwargs = dict(
        model=str(model_path),
        skip_tokenizer_init=True,
        generation_config="vllm",
        tensor_parallel_size=options.tensor_parallel_size,
        distributed_executor_backend="external_launcher",
        dtype=settings.dtype,
        quantization="fp8" if quant else None,
        hf_overrides={"quantization_config": quant},
        load_format="dummy",
        enable_sleep_mode=True,
        logprobs_mode="raw_logprobs",
        kv_cache_dtype=options.kv_cache_dtype,
        seed=options.seed,
        gpu_memory_utilization=options.gpu_memory_utilization,
        max_model_len=options.max_model_len or bridge.dims.max_position_embeddings,
        max_num_seqs=options.max_num_seqs,
        enforce_eager=options.enforce_eager,
        enable_prefix_caching=options.enable_prefix_caching,
    )
    if options.attention_config is not None:
        kwargs["attention_config"] = options.attention_config
    compilation: dict[str, Any] = {}
    if options.cuda_graph_max_batch is not None and not options.enforce_eager:
        top = min(options.cuda_graph_max_batch, options.max_num_seqs)
        compilation["cudagraph_capture_sizes"] = sorted({*(s for s in (1, 2, 4) if s <= top),
                                                         *range(8, top + 1, 8), top})
    if quant and options.activation_quant == "trainer":  # the fused kernels would quantize vLLM's way
        compilation["pass_config"] = {"fuse_norm_quant": False, "fuse_act_quant": False}
    if compilation:
        kwargs["compilation_config"] = compilation
    return vllm_exact.llm_kwargs(kwargs) if recipe.exact else kwargs


def model_dir(hf_config: Mapping[str, Any], cache_root: Path) -> Path:
    """The directory vLLM reads the architecture from: the config alone, in
    ``<cache_root>/jetrl-models/<digest of the config>``. vLLM keys its compile cache by the model's
    path, among the rest, so the same architecture finds its compiled graphs at the next engine start
    (a new directory each start recompiled every time: ~30 s at 8B). Written atomically; processes
    of one node that write the same config write the same bytes."""
    text = json.dumps(dict(hf_config), sort_keys=True)
    path = cache_root / "jetrl-models" / hashlib.sha256(text.encode()).hexdigest()[:16]
    config = path / "config.json"
    if not config.is_file() or config.read_text() != text:
        path.mkdir(parents=True, exist_ok=True)
        tmp = path / f".config.json.{os.getpid()}"
        tmp.write_text(text)
        os.replace(tmp, config)
    return path


def samples_from_outputs(outputs: Sequence[Any], n: int) -> list[Sample]:
    """vLLM ``RequestOutput``s (one per prompt, in prompt order) -> prompt-major ``Sample``s."""
    samples = []
    for i, out in enumerate(outputs):
        completions = sorted(out.outputs, key=lambda c: c.index)
        if len(completions) != n:
            raise RuntimeError(f"vLLM returned {len(completions)} samples for prompt {i}; asked for {n}")
        for c in completions:
            reason = FINISH_REASONS.get(c.finish_reason)
            if reason is None:
                raise RuntimeError(f"vLLM sample {c.index} of prompt {i} ended with {c.finish_reason!r} "
                                   f"(stop reason {c.stop_reason!r}); expected 'stop' or 'length'")
            tokens = list(c.token_ids)
            if c.logprobs is None or len(c.logprobs) != len(tokens):
                raise RuntimeError(f"vLLM returned no logprob for some tokens of sample {c.index} of prompt {i}")
            logprobs = _sampled_logprobs(c.logprobs, tokens)
            samples.append(Sample(prompt_index=i, tokens=tokens, logprobs=logprobs, finish_reason=reason))
    return samples


def _sampled_logprobs(logprobs: Any, tokens: list[int]) -> list[float]:
    """The sampled tokens' logprobs from a completion's ``logprobs``: vLLM's ``FlatLogprobs`` (flat
    lists, one entry a position when only the sampled token's is asked for: read as they are) or a
    list of ``{token: Logprob}`` per position."""
    flat_tokens = getattr(logprobs, "token_ids", None)
    if flat_tokens is not None and list(flat_tokens) == tokens:
        return [float(lp) for lp in logprobs.logprobs]
    return [float(logprobs[t][tok].logprob) for t, tok in enumerate(tokens)]


def _check_no_requantization(vllm_module: ModuleType) -> None:
    """vLLM's own answer to "will DeepGEMM re-quantize block scales to powers of two" must be no
    (the environment check above makes it so; this catches a vLLM that decides otherwise)."""
    try:
        from vllm.utils.deep_gemm import is_deep_gemm_e8m0_used
    except ImportError:  # no DeepGEMM integration in this build: nothing can re-quantize
        return
    if is_deep_gemm_e8m0_used():
        raise ConfigError("environment:VLLM_USE_DEEP_GEMM_E8M0", os.environ.get("VLLM_USE_DEEP_GEMM_E8M0"),
                          f"vLLM {vllm_module.__version__} would re-quantize the trainer's FP8 weights to "
                          "power-of-two scales; export VLLM_USE_DEEP_GEMM_E8M0=0 (or precision.fp8.pow2_scales=true)")


def _release_cumem_pools() -> None:
    """Free the memory pools of vLLM's sleep-mode allocator now (vLLM would at exit), while
    their memory is mapped; nothing to do where vLLM never loaded it (no sleep mode, no CUDA)."""
    cumem = sys.modules.get("vllm.device_allocator.cumem")
    allocator = getattr(getattr(cumem, "CuMemAllocator", None), "instance", None)
    if allocator is not None:
        allocator.release_pools()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class VllmEngine:
    """``RolloutEngine`` on an in-process vLLM (see the module docstring).

    Args:
        hf_config: the policy's HF config as a dict (the job reads it once, ``job.model``): the
            architecture and its sizes. No weights and no tokenizer are read (weights come from
            the sync; prompts are token ids).
        recipe: precision recipe: rollout dtype, FP8 block config, layers kept in BF16.
        options: the ``rollout.vllm`` section.

    Every rank of the job builds one; the process must have been launched by torchrun or srun
    (``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` set) with ``engine_env(...)`` in its
    environment. Building checks, before any weight is written: vLLM's version, the environment,
    and that vLLM holds every weight in the checkpoint layout.
    """

    def __init__(self, hf_config: Mapping[str, Any], recipe: PrecisionRecipe, options: VllmOptions = VllmOptions()):
        if not isinstance(hf_config, Mapping):
            raise TypeError(f"hf_config must be the HF config as a dict; got {type(hf_config).__name__}")
        if not isinstance(recipe, PrecisionRecipe):
            raise TypeError(f"recipe must be a PrecisionRecipe; got {type(recipe).__name__}")
        if not isinstance(options, VllmOptions):
            raise TypeError(f"options must be a VllmOptions; got {type(options).__name__}")
        config = dict(hf_config)
        self.bridge = bridge_for(config)
        self.recipe, self.options = recipe, options
        check_environment(engine_env(recipe, options))
        vllm = require_vllm()
        self._vllm = vllm
        self._llm = None
        self._awake = {"weights": True, "kv_cache": True}
        self._open = True
        """Until ``close``: the engine (or what of it was built) and the hooks it installed into vLLM."""
        try:
            path = model_dir(config, Path(importlib.import_module("vllm.envs").VLLM_CACHE_ROOT))
            if (recipe.rollout_fp8 and options.activation_quant == "trainer") or recipe.exact:
                vllm_activation_quant.install(recipe.fp8.pow2_scales, recipe.fp8.amax_epsilon, exact=recipe.exact)
            if recipe.exact:
                vllm_exact.install()
                vllm_exact.initialize_nccl()
            with vllm_exact.job_nccl_environment() as undone:
                self._llm = vllm.LLM(**llm_kwargs(path, config, recipe, options))
            self.nccl_pins_undone = undone
            """The NCCL variables vLLM's batch-invariant mode had set for the process, given back their
            job values (``vllm_exact.job_nccl_environment``; empty where that mode is off)."""
            if undone and _first_rank():
                print("vllm engine: vLLM's batch-invariant mode had set "
                      + ", ".join(f"{k}={'(unset)' if v is None else v}" for k, v in undone.items())
                      + " for the whole process; the job's values are back, so the trainer's collectives keep "
                      "them (precision.exact's reductions do not depend on NCCL's)", flush=True)
            if recipe.rollout_fp8:
                _check_no_requantization(vllm)
            self.exact_modules = self._on_worker(vllm_exact.check_engine) if recipe.exact else None
            """How many norm, activation, rotary and attention modules run the exact kernels (exact mode)."""
            from vllm.distributed import get_tensor_model_parallel_rank

            self.tp_size = options.tensor_parallel_size
            self.tp_rank = get_tensor_model_parallel_rank()
            """This rank's place in its rollout TP group: the ``rollout_rank`` whose shards it loads."""
            self._specs = self._on_worker(lambda worker: model_weight_specs(worker.get_model()))
            self._weight_bytes = sum(math.prod(m.shape) * m.dtype.itemsize for m in self._specs.values())
            self._direct: Optional[DirectTargets] = None
            if options.weight_update == "in_place":
                self._direct = self._on_worker(lambda worker: DirectTargets(worker.get_model()))
        except BaseException:
            self.close()
            raise
        self._needed = MissingWeights("vllm", (n for n in self._specs if n.rpartition(".")[2] not in KV_SCALES))
        """Tensors that must arrive before the next generate: all of them while the weights are dummy
        or discarded (level-2 sleep), else none. The KV-cache scales are not among them: vLLM keeps
        them as buffers across a sleep (1.0 when never sent)."""
        self._update: Optional[LayerwiseUpdate] = None
        self._awake = {"weights": True, "kv_cache": True}
        self._weights_changed = False

    # -- RolloutEngine ---------------------------------------------------------------------------
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Sample]:
        self._finish_update()
        if not all(self._awake.values()):
            raise RuntimeError("vllm engine: generate needs an awake engine; call wake() first")
        self._needed.check()
        if self._weights_changed and self.options.enable_prefix_caching:
            self._llm.reset_prefix_cache()  # cached KV was computed with the old weights
        self._weights_changed = False
        prompts = [{"prompt_token_ids": [int(t) for t in p]} for p in prompt_token_ids]
        if sampling.temperature == 0 and sampling.n > 1:  # vLLM takes n=1 only for greedy: one request each
            n = sampling.n
            greedy = dataclasses.replace(sampling, n=1)
            outputs = self._llm.generate([p for p in prompts for _ in range(n)],
                                         [self._vllm_sampling(greedy, 0)] * (len(prompts) * n), use_tqdm=False)
            return [dataclasses.replace(s, prompt_index=s.prompt_index // n) for s in samples_from_outputs(outputs, 1)]
        params = [self._vllm_sampling(sampling, i) for i in range(len(prompts))]
        outputs = self._llm.generate(prompts, params, use_tqdm=False)
        return samples_from_outputs(outputs, sampling.n)

    def weight_specs(self) -> dict[str, TensorMeta]:
        return dict(self._specs)

    def weight_buffers(self) -> dict[str, torch.Tensor]:
        """The live vLLM parameters (views) a weight sync writes in place, with ``update_weights``
        for the rest; empty with ``weight_update=reload``. Retakes the weight memory when asleep.
        The caller must write every returned tensor before the next ``generate``."""
        if self._direct is None:
            return {}
        self._wake_weights()
        buffers = self._direct.buffers()
        self._needed.arrived(buffers)
        self._weights_changed = True
        return buffers

    def update_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        items = list(tensors)
        if not items:
            return
        given: dict[str, TensorMeta] = {}
        for name, t in items:
            if name in given:
                raise WeightMismatch(f"vllm engine update: tensor {name} given more than once in one call")
            given[name] = TensorMeta(tuple(t.shape), t.dtype)
        check_against_specs(self._specs, given, what="vllm engine update")
        self._wake_weights()
        if self._direct is not None:
            direct = self._direct
            self._on_worker(lambda worker: direct.write(items))
        else:
            if self._update is None:
                presharded = self.tp_size > 1
                self._update = self._on_worker(
                    lambda worker: LayerwiseUpdate(worker.get_model(), worker.vllm_config, presharded=presharded))
            update = self._update
            self._on_worker(lambda worker: update.load(items))
        self._needed.arrived(given)
        self._weights_changed = True

    def sleep(self) -> None:
        self._finish_update()
        if not any(self._awake.values()):
            return
        self._llm.sleep(level=self.options.sleep_level)
        self._awake = {"weights": False, "kv_cache": False}
        if self.options.sleep_level == 2:
            self._needed.dropped()

    def wake(self) -> None:
        self._finish_update()
        tags = [tag for tag, awake in self._awake.items() if not awake]
        if tags:
            self._llm.wake_up(tags=tags)
            self._awake = {"weights": True, "kv_cache": True}

    def wake_bytes(self) -> int:
        """The engine's share of the GPU (``gpu_memory_utilization`` of its memory: weights, KV
        cache, activations and CUDA graphs, as vLLM sized them at start) less the weights already
        awake (a sync wakes them first); 0 when awake."""
        if all(self._awake.values()):
            return 0
        share = int(self.options.gpu_memory_utilization * torch.cuda.mem_get_info()[1])
        return max(0, share - (self._weight_bytes if self._awake["weights"] else 0))

    def close(self) -> None:
        """Release the engine's GPU memory. vLLM's own shutdown is not called: in-process under the
        external launcher it tears down torch.distributed's default process group, which belongs to
        the job (the launcher destroys it at exit).

        Memory that a sleep unmapped is mapped back first (its contents are not needed): vLLM's
        allocator unmaps every allocation it frees, and freeing one that is already unmapped fails
        on CUDA ("invalid argument" from cumem_allocator.cpp, at exit). Then the engine is dropped
        and the allocator's pools released while everything in them is still mapped. Close the
        trainer's model first: waking takes back the engine's whole share of the GPU for a moment
        (where it cannot, ``_map_back`` says so and the close goes on without it)."""
        if self._llm is not None:
            asleep = [tag for tag, awake in self._awake.items() if not awake]
            mapped = self._map_back(asleep) if asleep else True
            self._llm = None
            gc.unfreeze()  # vLLM froze the objects of the process at start-up, as its shutdown would undo
            gc.collect()
            if mapped:
                _release_cumem_pools()
        if self._open:  # the model directory stays: the next start's compile cache names it
            self._open = False
            vllm_activation_quant.uninstall()  # a later engine of this process chooses again
            vllm_exact.uninstall()

    def _map_back(self, asleep: list[str]) -> bool:
        """Wake ``asleep`` for ``close``; False, saying so in one line, when the GPU has no room for
        them (something outside the engine still holds memory): the engine is then dropped without
        releasing its allocator's pools, and vLLM may report a cumem error at exit, nothing worse."""
        gc.collect()
        torch.cuda.empty_cache()  # what the trainer let go of goes back to the device first
        try:
            self._llm.wake_up(tags=asleep)
        except RuntimeError as e:  # vLLM's allocator: "CUDA Error: out of memory at cumem_allocator.cpp"
            if "out of memory" not in str(e):
                raise
            free, _ = torch.cuda.mem_get_info()
            print(f"vllm engine: closing without mapping its slept {' and '.join(asleep)} back: out of GPU memory "
                  f"({free / 2**30:.1f} GiB free; PyTorch holds {torch.cuda.memory_allocated() / 2**30:.1f} GiB "
                  "outside the engine's pools); vLLM may report a cumem error at exit", file=sys.stderr)
            return False
        self._awake = dict.fromkeys(self._awake, True)
        return True

    @property
    def weights_discarded(self) -> bool:
        """True while some weight tensor has not arrived since the weights were last dummy or
        discarded by a level-2 sleep (``generate`` refuses until it has)."""
        return bool(self._needed)

    @property
    def kv_cache_tokens(self) -> Optional[int]:
        """Tokens the KV cache holds on this rank (its size vLLM chose from the free memory)."""
        cache = self._llm.llm_engine.vllm_config.cache_config
        blocks = getattr(cache, "num_gpu_blocks", None)
        return None if blocks is None else blocks * cache.block_size

    # -- internals -------------------------------------------------------------------------------
    def _on_worker(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(worker)`` on this rank's one in-process vLLM worker."""
        (result,) = self._llm.collective_rpc(fn)
        return result

    def _wake_weights(self) -> None:
        """Retake the weight memory only (the KV cache stays released while the trainer runs)."""
        if not self._awake["weights"]:
            self._llm.wake_up(tags=["weights"])
            self._awake["weights"] = True

    def _finish_update(self) -> None:
        if self._update is None:
            return
        update, self._update = self._update, None
        self._on_worker(lambda worker: update.finish())

    def _vllm_sampling(self, s: SamplingParams, prompt: int) -> "vllm.SamplingParams":
        """One prompt's vLLM sampling: only ``stop_token_ids`` stop (not the model's EOS), the sampled
        token's raw logprob, no detokenization; a seeded call gives prompt ``i`` the seeds
        ``seed + i*n + j`` (vLLM adds the sample index ``j``)."""
        return self._vllm.SamplingParams(
            n=s.n,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else 0,
            max_tokens=s.max_new_tokens,
            stop_token_ids=list(s.stop_token_ids),
            ignore_eos=True,
            seed=None if s.seed is None else s.seed + prompt * s.n,
            logprobs=0,
            flat_logprobs=True,  # a few lists a sample, not a dict and a Logprob a token: less host time and GC
            detokenize=False,
            skip_special_tokens=False,
        )
