"""The ``vllm`` rollout engine: vLLM in-process on every rank, colocated with the trainer.

Each rank builds one ``vllm.LLM`` with ``distributed_executor_backend="external_launcher"``: no
worker processes, no Ray; the ranks of a rollout TP group (consecutive global ranks) form vLLM's
TP group on the job's own ``torch.distributed`` world, and every other group of ``rollout TP``
ranks is an independent replica. All ranks of one TP group must make the same calls with the same
prompts and sampling (vLLM schedules deterministically per replica).

Precision comes from the recipe only: the model is built with the recipe's block-FP8
``quantization_config`` (``hf_overrides``), ``load_format="dummy"`` (the first weights come from
the weight sync, nothing is read from disk) and ``logprobs_mode="raw_logprobs"`` (logprobs of the
model's own distribution, comparable with the trainer's). vLLM on Hopper keeps a block-FP8 weight
as loaded: ``weight`` e4m3 [N, K] and ``weight_scale_inv`` fp32 [N/128, K/128] are neither
transposed nor re-laid-out (DeepGEMM's fp32 128x128 weight scales need no transform on SM90), so
the bytes the sync ships are the bytes the GEMMs read, provided DeepGEMM's UE8M0 re-quantization
is off. That switch is an environment variable read by vLLM; the launcher sets it
(``recipe.vllm_settings(...).env``) and this engine only checks it.

Weight updates use vLLM's checkpoint-format reload (``model_executor.model_loader.reload``):
``initialize_layerwise_reload`` puts every layer back in checkpoint layout (on the meta device,
keeping the live kernel tensors aside), ``model.load_weights`` runs vLLM's own loaders (q/k/v
into ``qkv_proj``, gate/up into ``gate_up_proj``, scales alongside), each layer is processed as
soon as all its tensors arrived and copied into the live tensors (CUDA graphs stay valid), and
``finalize_layerwise_reload`` closes the update. A plain second ``load_weights`` fails: the FP8
method replaced the parameters by plain ``torch.nn.Parameter``s, whose kept loaders need vLLM's
parameter classes.

A weight update may span several ``update_weights`` calls (one per sync bucket); it is closed by
the next ``generate``, ``sleep`` or ``wake``. Tensors of a layer that is still incomplete at the
end of a call are held by reference until the layer completes: do not overwrite them in place.

Sleep level 2 (the default) discards the weights instead of copying them to host memory: every RL
step replaces all of them anyway, so level 1 would only spend host RAM and PCIe time on bytes
that are about to be overwritten. The price is that after a level-2 sleep (and after start-up,
when the weights are dummy) the next update must deliver every tensor of ``weight_specs()``
before ``generate``; the engine checks that and names what is missing. Level 1 allows partial
updates.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

import torch

from megatron_jetrl.config import ConfigError, check_integer
from megatron_jetrl.models import ModelBridge, bridge_for
from megatron_jetrl.precision import PrecisionRecipe
from megatron_jetrl.rollout.base import Sample, SamplingParams, TensorMeta, WeightMismatch, check_against_specs

if TYPE_CHECKING:
    import vllm

KV_CACHE_DTYPES = ("auto", "fp8")
KV_SCALES = ("q_scale", "k_scale", "v_scale")
"""Per-layer FP8 KV-cache scales, loadable as ``<layer>.self_attn.attn.<name>`` (fp32 scalars)."""

FINISH_REASONS = {"stop": "stop", "length": "length"}
"""vLLM ``CompletionOutput.finish_reason`` -> ``Sample.finish_reason``; anything else is an error."""


@dataclass(frozen=True)
class VllmOptions:
    """The ``rollout.vllm`` section: how the engine runs (precision is the recipe's, not here)."""

    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    """Share of GPU memory for weights + KV cache while awake; the trainer gets it back in sleep."""
    max_model_len: int = 8192
    max_num_seqs: int = 256
    kv_cache_dtype: str = "auto"
    """``fp8`` stores the KV cache in E4M3 with per-layer scales (``self_attn.attn.{q,k,v}_scale``)."""
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    seed: int = 0
    sleep_level: int = 2

    def __post_init__(self) -> None:
        k = "rollout.vllm"
        for name in ("tensor_parallel_size", "max_model_len", "max_num_seqs"):
            v = getattr(self, name)
            check_integer(f"{k}.{name}", v, minimum=1)
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u < 1:
            raise ConfigError(f"{k}.gpu_memory_utilization", u, "must be a fraction in (0, 1)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"{k}.kv_cache_dtype", self.kv_cache_dtype, f"must be one of {list(KV_CACHE_DTYPES)}")
        for name in ("enforce_eager", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{k}.{name}", getattr(self, name), "must be true or false")
        check_integer(f"{k}.seed", self.seed)
        if self.sleep_level not in (1, 2):
            raise ConfigError(f"{k}.sleep_level", self.sleep_level,
                              "must be 1 (weights kept in host memory) or 2 (weights discarded; every update "
                              "must then send all weights)")


def require_vllm() -> ModuleType:
    """The ``vllm`` module, or an error saying how to get it."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(
            "the vllm rollout engine needs vLLM (>= 0.32), which is not installed here: "
            "pip install 'megatron-jetrl[vllm]' (or use rollout.engine=hf)"
        ) from e
    return vllm


def check_environment(env: Mapping[str, str], environ: Mapping[str, str] = os.environ) -> None:
    """Raise naming the first variable of ``env`` that the process environment does not set to its
    value. vLLM reads these itself (at import or first use), so the launcher must set them before
    the process starts; the package never sets environment variables."""
    for var, value in env.items():
        if environ.get(var) != value:
            raise ConfigError(
                f"environment:{var}", environ.get(var),
                f"the precision recipe needs {var}={value} for vLLM (set by the launcher, before vLLM is "
                f"imported: export {var}={value})",
            )


def llm_kwargs(model_path: str | Path, bridge: ModelBridge, recipe: PrecisionRecipe,
               options: VllmOptions) -> dict[str, Any]:
    """The ``vllm.LLM`` keyword arguments of this engine (``vllm.EngineArgs`` fields)."""
    settings = recipe.vllm_settings(bridge.dims.num_layers)
    quant = settings.quantization_config
    return dict(
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
        max_model_len=options.max_model_len,
        max_num_seqs=options.max_num_seqs,
        enforce_eager=options.enforce_eager,
        enable_prefix_caching=options.enable_prefix_caching,
    )


# ---------------------------------------------------------------------------------------------------
# Worker side: functions of a vLLM model, run on the engine's worker through ``collective_rpc`` (and
# directly on a bare model by the contract test).


def model_weight_specs(model: torch.nn.Module) -> dict[str, TensorMeta]:
    """Every checkpoint tensor this rank's vLLM ``model`` loads, by HF name, with the shape and dtype
    it must have: fused linears split back into their projections with the packed-modules mapping
    and the layer's partition sizes (this rank's shard under TP), ``weight_scale_inv`` for FP8
    linears, full embeddings / LM head (vLLM shards those itself), norms as held, and the FP8
    KV-cache scales of each attention layer when the KV cache is FP8.

    Raises ``RuntimeError`` when a parameter is held in a layout the checkpoint format does not
    describe (a kernel that transposes, pads or repacks: then the shipped bytes would not be the
    bytes computed with)."""
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    specs: dict[str, TensorMeta] = {}
    for name, param in model.named_parameters():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        if isinstance(module, LinearBase):
            specs.update(_linear_specs(module_name, module, attr, param, packed))
        elif isinstance(module, VocabParallelEmbedding):
            specs[name] = TensorMeta((module.org_vocab_size, module.embedding_dim), param.dtype)
        else:
            specs[name] = TensorMeta(tuple(param.shape), param.dtype)
    for module_name, module in model.named_modules():
        if isinstance(module, Attention) and str(module.kv_cache_dtype).startswith("fp8"):
            specs.update({f"{module_name}.{s}": TensorMeta((), torch.float32) for s in KV_SCALES})
    return specs


def _linear_specs(module_name: str, layer: torch.nn.Module, attr: str, param: torch.Tensor,
                  packed: Mapping[str, Sequence[str]]) -> dict[str, TensorMeta]:
    prefix, _, leaf = module_name.rpartition(".")
    parts = list(packed.get(leaf, [leaf]))
    sizes = list(layer.output_partition_sizes)
    if len(parts) != len(sizes):
        raise RuntimeError(f"vLLM layer {module_name}: packed modules {parts} but {len(sizes)} output partitions")
    names = [f"{prefix}.{p}" if prefix else p for p in parts]
    k = getattr(layer, "input_size_per_partition", None) or layer.input_size
    block = getattr(layer, "weight_block_size", None)
    if attr == "weight":
        expected = [(n, k) for n in sizes]
        if param.dtype not in (torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.float32):
            raise RuntimeError(f"vLLM holds {module_name}.weight as {param.dtype}; the checkpoint format is "
                               "float8_e4m3fn or the model dtype (an FNUZ platform?)")
    elif attr == "weight_scale_inv" and block:
        expected = [(math.ceil(n / block[0]), math.ceil(k / block[1])) for n in sizes]
    elif attr == "bias":
        expected = [(n,) for n in sizes]
    else:
        raise RuntimeError(f"vLLM layer {module_name} has parameter {attr!r}, which this engine cannot update")
    held = (sum(s[0] for s in expected), *expected[0][1:])
    if tuple(param.shape) != held:
        raise RuntimeError(f"vLLM holds {module_name}.{attr} as {list(param.shape)}; the checkpoint layout of "
                           f"{names} gives {list(held)} (a kernel re-laid it out; its bytes would not be the "
                           "trainer's)")
    return {f"{n}.{attr}": TensorMeta(shape, param.dtype) for n, shape in zip(names, expected, strict=True)}


class LayerwiseUpdate:
    """One checkpoint-format weight update of a live vLLM model (vLLM's layerwise reload; see the
    module docstring): ``load`` any number of times, then ``finish`` once.

    ``presharded``: the tensors of TP-split linears are this rank's shards (shapes of
    ``model_weight_specs``), not full tensors. vLLM's linear loaders always cut a full tensor at
    ``tp_rank * shard``; for the duration of the update each split linear parameter's ``tp_rank``
    is set to 0 (``is_sharded_weight`` for loaders that read that), so a shard is copied whole (vLLM
    loads its replicated MLA latents the same way). Embeddings and the LM head still take full
    tensors."""

    def __init__(self, model: torch.nn.Module, vllm_config: Any, *, presharded: bool):
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.model, self.vllm_config = model, vllm_config
        with set_current_vllm_config(vllm_config):
            initialize_layerwise_reload(model)
        self._undo = _take_shards_whole(model) if presharded else []

    def load(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            self.model.load_weights(tensors)

    def finish(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        try:
            with set_current_vllm_config(self.vllm_config), torch.no_grad():
                finalize_layerwise_reload(self.model, self.vllm_config.model_config)
        finally:
            for obj, attr, value in reversed(self._undo):
                setattr(obj, attr, value)


def _take_shards_whole(model: torch.nn.Module) -> list[tuple[torch.Tensor, str, Any]]:
    """Make the loaders of every TP-split linear copy a given shard whole; returns what to undo."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.parameter import BasevLLMParameter

    undo: list[tuple[torch.Tensor, str, Any]] = []
    for module in model.modules():
        if not isinstance(module, LinearBase) or getattr(module, "tp_size", 1) == 1:
            continue
        for param in module._parameters.values():
            if param is None:
                continue
            if isinstance(param, BasevLLMParameter):
                undo.append((param, "tp_rank", param.tp_rank))
                param.tp_rank = 0
            else:
                undo.append((param, "is_sharded_weight", getattr(param, "is_sharded_weight", False)))
                param.is_sharded_weight = True
    return undo


# ---------------------------------------------------------------------------------------------------
# Driver side.


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
            logprobs = [float(c.logprobs[t][tok].logprob) for t, tok in enumerate(tokens)]
            samples.append(Sample(prompt_index=i, tokens=tokens, logprobs=logprobs, finish_reason=reason))
    return samples


class VllmEngine:
    """``RolloutEngine`` on an in-process vLLM (see the module docstring).

    Args:
        model_path: the policy's HF checkpoint directory; only its ``config.json`` is read (the
            weights come from ``update_weights``; prompts are token ids, so no tokenizer).
        recipe: precision recipe: rollout dtype, FP8 block config, layers kept in BF16.
        options: the ``rollout.vllm`` section.

    Every rank of the job builds one; the process must have been launched by torchrun or srun
    (``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` set) with the recipe's vLLM
    environment (``recipe.vllm_settings(num_layers).env``).
    """

    def __init__(self, model_path: str | Path, recipe: PrecisionRecipe, options: VllmOptions = VllmOptions()):
        if not isinstance(recipe, PrecisionRecipe):
            raise TypeError(f"recipe must be a PrecisionRecipe; got {type(recipe).__name__}")
        if not isinstance(options, VllmOptions):
            raise TypeError(f"options must be a VllmOptions; got {type(options).__name__}")
        config_path = Path(model_path) / "config.json"
        if not config_path.is_file():
            raise ConfigError("rollout.model_path", str(model_path), "must be an HF checkpoint directory with a "
                              "config.json")
        self.bridge = bridge_for(json.loads(config_path.read_text()))
        self.recipe, self.options = recipe, options
        check_environment(recipe.vllm_settings(self.bridge.dims.num_layers).env)
        vllm = require_vllm()
        from vllm.distributed import get_tensor_model_parallel_rank

        self._vllm = vllm
        self._llm = vllm.LLM(**llm_kwargs(model_path, self.bridge, recipe, options))
        self.tp_size = options.tensor_parallel_size
        self.tp_rank = get_tensor_model_parallel_rank()
        """This rank's place in its rollout TP group: the ``rollout_rank`` whose shards it loads."""
        self._specs = self._on_worker(lambda worker: model_weight_specs(worker.get_model()))
        self._needed = self._required_names()
        """Tensors that must arrive before the next generate: all of them while the weights are dummy
        or discarded (level-2 sleep), else none."""
        self._update: LayerwiseUpdate | None = None
        self._awake = {"weights": True, "kv_cache": True}

    # -- RolloutEngine ---------------------------------------------------------------------------
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Sample]:
        self._finish_update()
        if not all(self._awake.values()):
            raise RuntimeError("vllm engine: generate needs an awake engine; call wake() first")
        if self._needed:
            raise RuntimeError(f"vllm engine: {len(self._needed)} weight tensors were never loaded since the weights "
                               f"were last dummy or discarded (e.g. {sorted(self._needed)[:3]}); update_weights "
                               "with all of weight_specs() first")
        prompts = [{"prompt_token_ids": [int(t) for t in p]} for p in prompt_token_ids]
        params = [self._vllm_sampling(sampling, i) for i in range(len(prompts))]
        outputs = self._llm.generate(prompts, params, use_tqdm=False)
        return samples_from_outputs(outputs, sampling.n)

    def weight_specs(self) -> dict[str, TensorMeta]:
        return dict(self._specs)

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
        if not self._awake["weights"]:
            self._llm.wake_up(tags=["weights"])
            self._awake["weights"] = True
        if self._update is None:
            presharded = self.tp_size > 1
            self._update = self._on_worker(
                lambda worker: LayerwiseUpdate(worker.get_model(), worker.vllm_config, presharded=presharded))
        update = self._update
        self._on_worker(lambda worker: update.load(items))
        self._needed.difference_update(n for n, _ in items)

    def sleep(self) -> None:
        self._finish_update()
        if not any(self._awake.values()):
            return
        self._llm.sleep(level=self.options.sleep_level)
        self._awake = {"weights": False, "kv_cache": False}
        if self.options.sleep_level == 2:
            self._needed = self._required_names()

    def wake(self) -> None:
        self._finish_update()
        tags = [tag for tag, awake in self._awake.items() if not awake]
        if tags:
            self._llm.wake_up(tags=tags)
            self._awake = {"weights": True, "kv_cache": True}

    def close(self) -> None:
        if self._llm is not None:
            self._llm.llm_engine.engine_core.shutdown()
            self._llm = None

    # -- internals -------------------------------------------------------------------------------
    def _on_worker(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(worker)`` on this rank's one in-process vLLM worker."""
        (result,) = self._llm.collective_rpc(fn)
        return result

    def _finish_update(self) -> None:
        if self._update is None:
            return
        update, self._update = self._update, None
        self._on_worker(lambda worker: update.finish())
        if self._awake["kv_cache"]:
            self._llm.reset_prefix_cache()

    def _required_names(self) -> set[str]:
        """What a full update must contain: everything but the KV-cache scales, which vLLM keeps as
        buffers across sleep (they default to 1.0 when never sent)."""
        return {n for n in self._specs if n.rpartition(".")[2] not in KV_SCALES}

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
            detokenize=False,
            skip_special_tokens=False,
        )
