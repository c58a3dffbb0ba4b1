"""A whole RL job's configuration: YAML + ``key=value`` overrides -> ``JobConfig``, validated
before anything expensive starts, and the resolved layout ``jetrl check`` prints.

Sections and who reads them (each module receives only its own section):

    run        RunSettings         the run directory, steps, seed, checkpoints, evaluation
    model      ModelSettings       HF config (file or inline), initial weights, tokenizer
    precision  PrecisionRecipe     one recipe for trainer, rollout and sync
    actor      ActorSettings       trainer layout, micro-batching, optimizer (precision: above)
    rollout    RolloutSettings     engine and sampling (n = algo.group_size)
    algo       AlgoSettings        advantages, policy loss, rollout correction
    data       DataSettings        prompts, sampling order, dynamic sampling, overlong handling
    reward     RewardSettings      answer checking
    sft        SftSettings         optional supervised warm-up before RL (the tiny example's)
    log        LogSettings         console, TensorBoard, Weights & Biases

Only this module, ``trainer.py`` and ``cli.py`` see the whole ``JobConfig``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from megatron_jetrl.actor.settings import ActorSettings
from megatron_jetrl.algo.settings import AlgoSettings
from megatron_jetrl.config import ConfigError, apply_overrides, build, check_integer, load_yaml, to_plain
from megatron_jetrl.data.settings import DataSettings, RewardSettings
from megatron_jetrl.models import ModelBridge, bridge_for
from megatron_jetrl.precision import PrecisionRecipe
from megatron_jetrl.precision.exact import EXACT_MAX_PP, EXACT_MAX_TP, fp8_kv_query_chunk, model_problem
from megatron_jetrl.rollout.engines import ENGINES, engine_kind
from megatron_jetrl.rollout.settings import RolloutSettings
from megatron_jetrl.runtime.metric_sinks import LogSettings
from megatron_jetrl.runtime.run_checkpoints import RunCheckpoints, pointer_problem, resume_refused


@dataclass(frozen=True)
class RunSettings:
    """``dir`` holds everything a run writes (resolved config, checkpoints, metrics, TensorBoard).
    ``resume``: continue from the newest complete checkpoint in ``dir`` (false: refuse to start
    when ``dir`` already has checkpoints, so nothing is overwritten). ``save_every`` 0 saves only
    at the end and on preemption; ``save_at_end`` false skips the final checkpoint (benchmarks:
    a large model's checkpoint takes minutes and disk); ``eval_every`` 0 never evaluates.
    ``profile_steps``: steps whose phases run under the GPU profiler, each written to
    ``dir/profiles/step_<N>.json`` (kernel time per phase by class; ``runtime/profiling.py``).
    ``allow_changes``: keys (or sections) a resumed run may set differently from its checkpoint
    among what the run learns with (``RESUME_FIXED``), e.g. ``[actor.optimizer.lr]``."""

    dir: str
    steps: int
    seed: int = 1
    save_every: int = 50
    keep_last: int = 2
    eval_every: int = 0
    resume: bool = True
    save_at_end: bool = True
    profile_steps: tuple[int, ...] = ()
    allow_changes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for i, key in enumerate(self.allow_changes):
            if not isinstance(key, str) or not key.strip():
                raise ConfigError(f"run.allow_changes[{i}]", key, "must be a config key such as actor.optimizer.lr")
        if not isinstance(self.save_at_end, bool):
            raise ConfigError("run.save_at_end", self.save_at_end, "must be true or false")
        if not self.dir:
            raise ConfigError("run.dir", self.dir, "must be a directory path")
        check_integer("run.steps", self.steps, minimum=1)
        check_integer("run.save_every", self.save_every, minimum=0)
        check_integer("run.keep_last", self.keep_last, minimum=1)
        check_integer("run.eval_every", self.eval_every, minimum=0)
        for i, step in enumerate(self.profile_steps):
            check_integer(f"run.profile_steps[{i}]", step, minimum=1)
            if step > self.steps:
                raise ConfigError(f"run.profile_steps[{i}]", step, f"is after the last step (run.steps={self.steps})")

    def check_dir(self) -> None:
        """``dir`` is a directory this process can write, or can be created: its nearest existing
        ancestor is a writable directory. Otherwise a ConfigError on ``run.dir`` (``jetrl check`` and
        ``jetrl train`` call this before any GPU work: a run dir that cannot be written would fail
        at the first save). Leaves nothing behind: a missing ``dir`` is not created, and the probe
        file that tests writing (permissions alone miss read-only mounts, ACLs and root squash) is
        removed again. A ``checkpoints/latest`` the first save could not replace (a directory) is
        refused. With ``resume`` false, a ``dir`` that has checkpoints is refused too (on
        ``run.resume``), before ``jetrl train`` writes anything into it."""
        path = Path(self.dir).expanduser().absolute()
        existing = next(p for p in (path, *path.parents) if p.exists() or p.is_symlink())
        if existing == path and not path.is_dir():
            what = "a broken symbolic link" if not path.exists() else "a file, not a directory"
            raise ConfigError("run.dir", self.dir, f"is {what}; set run.dir to a directory (a new one is created)")
        if existing == path:
            wrong, fix = "is not writable", "make it writable, or set run.dir to a writable directory"
        elif not existing.is_dir():
            what = "a broken symbolic link" if not existing.exists() else "a file"
            raise ConfigError("run.dir", self.dir, f"cannot be created: {existing} is {what}; set run.dir to a path "
                              "under a directory")
        else:
            wrong = f"does not exist and cannot be created: {existing} is not writable"
            fix = f"create {path} (writable by this user), or set run.dir under a writable directory"
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError("run.dir", self.dir, f"{wrong} by this user; {fix}")
        try:
            fd, probe = tempfile.mkstemp(prefix=".jetrl-write-probe-", dir=existing)
        except OSError as e:
            raise ConfigError("run.dir", self.dir, f"{wrong} ({e.strerror}); {fix}") from None
        os.close(fd)
        os.unlink(probe)
        problem = pointer_problem(path / "checkpoints")
        if problem is not None:
            raise problem
        if not self.resume and path.is_dir():  # a fresh start must not overwrite a run's checkpoints
            latest = RunCheckpoints(path, self.keep_last, 0, 1, lambda: None).latest()
            if latest is not None:
                raise resume_refused(path, latest)


def _config_json(value: str) -> Path:
    """The config.json a ``model.*`` path names: the file itself, or ``config.json`` in the directory
    (also one not downloaded yet)."""
    path = Path(value)
    return path if path.is_file() or path.suffix == ".json" else path / "config.json"


def _read_config_json(key: str, value: str, missing: str) -> dict[str, Any]:
    path = _config_json(value)
    if not path.is_file():
        raise ConfigError(key, value, missing)
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(key, str(path), f"is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(key, str(path), f"must hold a JSON object (a model config), not a {type(data).__name__}")
    return data


@dataclass(frozen=True)
class ModelSettings:
    """The policy. ``hf_config``: an HF model directory (its ``config.json``) or a config file;
    ``config``: entries merged over it, or the whole HF config when ``hf_config`` is not set.
    ``checkpoint``: initial weights, a megatron checkpoint from ``tools/convert_hf_to_megatron.py``
    (or a run's checkpoint); unset means random initialisation (synthetic tasks). ``tokenizer``:
    ``synthetic:<task>`` or an HF tokenizer directory (default: the ``hf_config`` directory).
    ``plan_config``: a config.json of the same model that ``jetrl check`` plans with while
    ``hf_config`` is not downloaded yet (the recipes point at the shipped ones); ``jetrl train``
    never uses it."""

    hf_config: Optional[str] = None
    config: dict = field(default_factory=dict)
    checkpoint: Optional[str] = None
    tokenizer: Optional[str] = None
    plan_config: Optional[str] = None

    def __post_init__(self) -> None:
        if self.hf_config is None and not self.config:
            raise ConfigError("model.hf_config", None,
                              "set an HF model directory (or config.json), or model.config inline")
        if self.tokenizer is None and self.hf_config is None:
            raise ConfigError("model.tokenizer", None, "set synthetic:<task> or a tokenizer directory")

    def hf_config_dict(self) -> dict[str, Any]:
        """The HF config: the file's entries, then ``config``'s."""
        base = {} if self.hf_config is None else _read_config_json(
            "model.hf_config", self.hf_config, "no config.json there; pass an HF model directory")
        return {**base, **self.config}

    def config_path(self) -> Optional[Path]:
        """The config.json ``hf_config`` names (whether or not it exists); None when inline."""
        return None if self.hf_config is None else _config_json(self.hf_config)

    def plan_config_dict(self) -> dict[str, Any]:
        """``plan_config``'s entries, then ``config``'s (``jetrl check`` before the download)."""
        return {**_read_config_json("model.plan_config", self.plan_config, "no such file"), **self.config}

    @property
    def tokenizer_spec(self) -> str:
        if self.tokenizer is not None:
            return self.tokenizer
        path = Path(self.hf_config)
        return str(path if path.is_dir() else path.parent)


@dataclass(frozen=True)
class SftSettings:
    """Supervised warm-up before RL: ``steps`` optimizer steps of cross-entropy on the responses
    (field ``response_key`` of the train records; synthetic tasks call it ``solution``) at constant
    ``lr``, ``batch_size`` sequences per step. Runs once per run directory, before RL step 1."""

    steps: int = 0
    batch_size: int = 64
    lr: float = 1e-3
    response_key: str = "solution"

    def __post_init__(self) -> None:
        check_integer("sft.steps", self.steps, minimum=0)
        check_integer("sft.batch_size", self.batch_size, minimum=1)
        if not self.lr > 0:
            raise ConfigError("sft.lr", self.lr, "must be > 0")


@dataclass(frozen=True)
class JobConfig:
    run: RunSettings
    model: ModelSettings
    data: DataSettings
    precision: PrecisionRecipe = field(default_factory=PrecisionRecipe)
    actor: ActorSettings = field(default_factory=ActorSettings)
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    algo: AlgoSettings = field(default_factory=AlgoSettings)
    reward: RewardSettings = field(default_factory=RewardSettings)
    sft: SftSettings = field(default_factory=SftSettings)
    log: LogSettings = field(default_factory=LogSettings)

    @property
    def longest_sequence(self) -> int:
        """Tokens of the longest prompt + response a rollout may hold (train or eval prompts)."""
        prompts = [self.data.train.max_prompt_tokens]
        if self.data.eval is not None:
            prompts.append(self.data.eval.max_prompt_tokens)
        return max(prompts) + self.rollout.sampling.max_new_tokens

    @property
    def longest_training_sequence(self) -> int:
        """Tokens of the longest sequence a training micro-batch holds: train prompt + response (eval
        responses are generated, never trained on)."""
        return self.data.train.max_prompt_tokens + self.rollout.sampling.max_new_tokens

    def check_resume(self) -> None:
        """With ``run.resume``, a ``run.dir`` whose newest checkpoint was made with other values of
        what the run learns with (``resume_changes``) is refused on the first such key, naming the
        checkpoint, both values, any other changed keys and the fixes. A checkpoint whose state
        cannot be read is left to the resume (which names it and falls back)."""
        if not self.run.resume:
            return
        latest = RunCheckpoints(Path(self.run.dir), self.run.keep_last, 0, 1, lambda: None).latest()
        if latest is None:
            return
        try:
            saved = json.loads((latest / "trainer_state.json").read_text(encoding="utf-8"))["config"]
        except (OSError, ValueError, KeyError, TypeError):
            return
        changed = resume_changes(self, saved)
        if not changed:
            return
        key, before, now = changed[0]
        also = "; also " + ", ".join(f"{k} ({b!r} -> {n!r})" for k, b, n in changed[1:]) if changed[1:] else ""
        raise ConfigError(key, now, f"differs from the checkpoint this run resumes ({latest}: {before!r}){also}: set "
                          f"it back, use a new run.dir, or run.allow_changes=[{', '.join(k for k, _, _ in changed)}] "
                          "to change it on purpose")

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as plain data; ``load_job`` of it gives this config back."""
        out = to_plain(self)
        if self.precision.exact_auto is not None:
            out["precision"]["exact"] = EXACT_AUTO
        out["actor"].pop("precision")
        for name in _JOB_SET_SAMPLING:
            out["rollout"]["sampling"].pop(name)
        return out


RESUME_FIXED = ("run.seed", "model.config", "data", "precision", "actor.optimizer", "actor.seed", "rollout.sampling",
                "algo", "reward")
"""What a run learns with: a resumed run must set these as its checkpoint did (``check_resume``)."""

RESUME_FREE = ("data.train.path", "data.eval.path", "precision.exact", "precision.exact_mismatch",
               "reward.time_limit_s")
"""Exceptions inside ``RESUME_FIXED``: where the files are (moved data), how the rollout computes
(the exact kernels compute the default's numbers) and how long a reward may take."""


def _flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _under(key: str, prefixes: Sequence[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def resume_changes(job: "JobConfig", saved: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, checkpoint's value, this job's value) for every key of ``RESUME_FIXED`` (not
    ``RESUME_FREE``, not in ``run.allow_changes``) on which this job differs from ``saved`` (the
    checkpoint's config, ``JobConfig.to_dict`` form). Keys only one side has are not compared."""
    now, before = _flat(job.to_dict()), _flat(saved)
    changed = []
    for key in sorted(set(now) & set(before)):  # a key one side lacks: another release's config
        if not _under(key, RESUME_FIXED) or _under(key, RESUME_FREE) or _under(key, job.run.allow_changes):
            continue
        if now[key] != before[key]:
            changed.append((key, before[key], now[key]))
    return changed


_JOB_SET_SAMPLING = {"n": "algo.group_size", "seed": "run.seed (each step's seed derives from it)"}


def load_job(path: str | Path | None, overrides: Sequence[str] = (), *, raw: Mapping[str, Any] | None = None
             ) -> JobConfig:
    """The job from a YAML file (or an already-read mapping ``raw``) with ``key=value`` overrides.
    Raises ``ConfigError`` naming the key for anything unknown, missing or invalid."""
    data = load_yaml(path) if raw is None else dict(raw)
    data = apply_overrides(data, overrides)
    known = {f.name for f in dataclasses.fields(JobConfig)}
    for name in data:
        if name not in known:
            raise ConfigError(str(name), data[name], f"unknown section; a job has {sorted(known)}")
    actor_raw = _section(data, "actor")
    if "precision" in actor_raw:
        raise ConfigError("actor.precision", actor_raw["precision"],
                          "precision is a top-level section (it is shared by trainer, rollout and sync)")
    rollout_raw = _section(data, "rollout")
    sampling_raw = _section(rollout_raw, "sampling", "rollout")
    for name, owner in _JOB_SET_SAMPLING.items():
        if name in sampling_raw:
            raise ConfigError(f"rollout.sampling.{name}", sampling_raw[name], f"is set by the job from {owner}")
    precision_raw = _section(data, "precision")
    requested = precision_raw.get("exact", EXACT_AUTO)
    if requested not in (True, False, EXACT_AUTO):
        raise ConfigError("precision.exact", requested, f"must be true, false or {EXACT_AUTO}")
    if requested != EXACT_AUTO:
        return _built_job(data, actor_raw, rollout_raw, precision_raw)
    try:  # auto: exact wherever the job can be (every rule of precision.exact holds), else the default rollout
        job = _built_job(data, actor_raw, rollout_raw, {**precision_raw, "exact": True})
        _check_exact_model_if_known(job)
        why_not = ""
    except ConfigError as e:  # a problem of the exact rollout's: the same job without it is valid (else it raises)
        job = _built_job(data, actor_raw, rollout_raw, {**precision_raw, "exact": False})
        fix = e.allowed.removeprefix("precision.exact: ")
        why_not = fix if e.key == "precision.exact" else f"{e.key}={e.got}: {fix}"
    precision = job.precision.chosen_automatically(why_not)
    return dataclasses.replace(job, precision=precision, actor=dataclasses.replace(job.actor, precision=precision))


EXACT_AUTO = "auto"
"""``precision.exact``'s default in a job: the exact rollout wherever the job's engine and layout allow
it (``_check_exact``, the model's shape where its config can be read), else the default rollout, the
reason on the precision line of ``jetrl check`` and of the start."""


def _check_exact_model_if_known(job: "JobConfig") -> None:
    """The model side of an exact job where the model's config can be read now (not before a
    download: ``resolve`` checks it then)."""
    try:
        bridge = bridge_for(job.model.hf_config_dict())
    except (ConfigError, OSError):  # not downloaded yet, or a config resolve() will name when it plans
        return
    check_exact_model(bridge)


def _built_job(data: Mapping[str, Any], actor_raw: Mapping[str, Any], rollout_raw: Mapping[str, Any],
               precision_raw: Mapping[str, Any]) -> "JobConfig":
    precision = build(PrecisionRecipe, precision_raw, "precision")
    algo = build(AlgoSettings, data.get("algo"), "algo")
    job = JobConfig(
        run=build(RunSettings, data.get("run"), "run") if "run" in data else _missing("run"),
        model=build(ModelSettings, data.get("model"), "model") if "model" in data else _missing("model"),
        data=build(DataSettings, data.get("data"), "data") if "data" in data else _missing("data"),
        precision=precision,
        actor=build(ActorSettings, actor_raw, "actor", fixed={"precision": precision}),
        rollout=build(RolloutSettings, rollout_raw, "rollout"),
        algo=algo,
        reward=build(RewardSettings, data.get("reward"), "reward"),
        sft=build(SftSettings, data.get("sft"), "sft"),
        log=build(LogSettings, data.get("log"), "log"),
    )
    _check_together(job)
    return job


def _check_together(job: JobConfig) -> None:
    """Rules across sections (each section validated itself already)."""
    options = job.rollout.options
    if job.actor.fp8_backend == "te" and job.rollout.fp8_kv_cache:
        # the per-step q/k/v scales come from the local layer spec's attention (actor.py: _kv_observed)
        raise ConfigError("actor.fp8_backend", "te",
                          "cannot calibrate an FP8 KV cache (its per-step q/k/v scales come from the native "
                          "backend's attention; Transformer Engine's is not instrumented): use "
                          f"actor.fp8_backend=native, or {options.kv_cache_key}=auto")
    if job.rollout.fp8_kv_cache and not job.precision.rollout_fp8:
        raise ConfigError(options.kv_cache_key, "fp8",
                          f"an FP8 KV cache goes with FP8 rollout; precision.mode is {job.precision.mode.value!r}")
    if job.precision.exact:
        _check_exact(job)
    for key, data in (("data.train", job.data.train), ("data.eval", job.data.eval)):
        if data is not None and data.synthetic is not None and data.synthetic.task != job.reward.type:
            raise ConfigError("reward.type", job.reward.type,
                              f"does not score {key}.synthetic.task {data.synthetic.task!r} (every reward would be 0): "
                              f"set reward.type={data.synthetic.task}")
    if job.run.eval_every and job.data.eval is None:
        raise ConfigError("run.eval_every", job.run.eval_every,
                          "evaluates data.eval, which is not set: set data.eval, or run.eval_every=0")
    options.check_sequence(job.longest_sequence)
    overlong, max_new = job.data.overlong, job.rollout.sampling.max_new_tokens
    if overlong.mode == "soft" and overlong.buffer_tokens > max_new:
        raise ConfigError("data.overlong.buffer_tokens", overlong.buffer_tokens,
                          f"must not exceed rollout.sampling.max_new_tokens ({max_new}): the soft penalty ramps "
                          "over the last buffer_tokens of a response")


def _check_exact(job: JobConfig) -> None:
    """What an exact rollout (``precision.exact``) needs besides the precision mode: one layout both
    sides compute alike (``precision/exact.py``), an engine that supports it, and the engine's own
    rules for its options (``exact_rules`` of its options section)."""
    par, kind = job.actor.parallel, engine_kind(job.rollout)
    need = [
        ("rollout.engine", job.rollout.engine, kind.exact,
         "the exact forward is an engine's batch-invariant mode plus the trainer's kernels: set rollout.engine="
         + " or ".join(name for name, k in ENGINES.items() if k.exact)),
        ("actor.fp8_backend", job.actor.fp8_backend, job.actor.fp8_backend == "native",
         "Transformer Engine's layers compute with TE's kernels, not the engine's: set actor.fp8_backend=native"),
        ("actor.parallel.tp", par.tp, par.tp <= EXACT_MAX_TP,
         f"the exact rollout runs at TP up to {EXACT_MAX_TP} (both sides reduce in one order): set "
         f"actor.parallel.tp={EXACT_MAX_TP} or less"),
        ("actor.parallel.pp", par.pp, par.pp <= EXACT_MAX_PP,
         f"the exact rollout is verified at PP up to {EXACT_MAX_PP}: set actor.parallel.pp={EXACT_MAX_PP} or less"),
        *(job.rollout.options.exact_rules(par.tp) if kind.exact else []),
        ("algo.correction.mode", job.algo.correction.mode,
         job.algo.correction.mode == "none" or job.precision.exact_mismatch == "correct",
         "with an exact rollout the trainer's logprobs equal the rollout's: there is nothing to correct, set "
         "algo.correction.mode=none (or precision.exact_mismatch=correct: the correction for steps where "
         "exactness fails)"),
    ]
    for key, value, ok, fix in need:
        if not ok:
            raise ConfigError(key, value, f"precision.exact: {fix}")


def check_exact_model(bridge: ModelBridge) -> None:
    """The model side of ``precision.exact``: rotary embeddings the exact ``rope`` computes (plain,
    the whole head, no scaling) and hidden sizes the exact norm takes (multiples of 128)."""
    d = bridge.dims
    problem = model_problem(rope_scaling_factor=d.rope_scaling_factor, hidden_size=d.hidden_size, head_dim=d.head_dim)
    if problem is not None:
        raise ConfigError("precision.exact", True, problem)


def missing_inputs(job: JobConfig) -> list[tuple[str, str, str]]:
    """What the job reads from disk that is not there yet, as (key, path, what to do): the model's
    config.json, the initial checkpoint, the tokenizer directory, the data files. ``jetrl check``
    plans without them (warnings); ``jetrl train`` refuses to start without them. A checkpoint
    path that exists but holds no megatron checkpoint is a ConfigError at once."""
    from megatron_jetrl.data.tokenizer import SYNTHETIC_PREFIX

    missing = []
    config = job.model.config_path()
    if config is not None and not config.is_file():
        missing.append(("model.hf_config", job.model.hf_config,
                        "download the model (e.g. `hf download <repo> --local-dir <dir>`)"))
    if job.model.checkpoint is not None and not Path(job.model.checkpoint).exists():
        missing.append(("model.checkpoint", job.model.checkpoint,
                        "convert the model (tools/convert_hf_to_megatron.py, examples/slurm/convert.sbatch)"))
    elif job.model.checkpoint is not None and not (Path(job.model.checkpoint) / ".metadata").is_file():
        # there, but not a checkpoint: an error in check as well (nothing is still to come)
        actor = Path(job.model.checkpoint) / "actor"
        fix = (f"name {actor} (a run's checkpoint keeps the weights there)" if (actor / ".metadata").is_file() else
               "name the directory tools/convert_hf_to_megatron.py wrote, or a run's checkpoints/step_N/actor")
        raise ConfigError("model.checkpoint", job.model.checkpoint,
                          f"is not a megatron checkpoint directory (no .metadata in it): {fix}")
    tokenizer = job.model.tokenizer_spec
    if not tokenizer.startswith(SYNTHETIC_PREFIX) and not Path(tokenizer).expanduser().exists():
        if job.model.tokenizer is not None:  # else it is the model's directory, named above
            missing.append(("model.tokenizer", tokenizer, "download the model's tokenizer files"))
    for key, settings in (("data.train", job.data.train), ("data.eval", job.data.eval)):
        if settings is not None and settings.path is not None and not Path(settings.path).exists():
            missing.append((f"{key}.path", settings.path, "put the data file there"))
    return missing


def resolve(job: JobConfig, world_size: int, hf_config: Optional[dict[str, Any]] = None) -> "Resolved":
    """The model, layout and memory estimate for ``world_size`` processes, without a GPU.
    Raises ``ConfigError`` when the layout does not divide the world or the model. ``hf_config``:
    plan with this config instead of the job's (``jetrl check`` before the download)."""
    from megatron_jetrl.job.estimate import estimate_memory

    check_integer("world_size", world_size, minimum=1)
    hf_config = job.model.hf_config_dict() if hf_config is None else hf_config
    bridge = bridge_for(hf_config)
    bridge.check_layout(job.actor.parallel)
    job.precision.layer_in_fp8(0, bridge.dims.num_layers)
    if job.precision.exact:
        check_exact_model(bridge)
    dp = job.actor.data_parallel_size(world_size)
    rollout_tp = job.rollout.tp
    if world_size % rollout_tp:
        raise ConfigError(job.rollout.options.tp_key, rollout_tp,
                          f"must divide the world size ({world_size} processes)")
    longest = job.longest_sequence
    limit = job.actor.max_seq_len or bridge.dims.max_position_embeddings
    if longest > limit:
        raise ConfigError("rollout.sampling.max_new_tokens", job.rollout.sampling.max_new_tokens,
                          f"the longest prompt (data max_prompt_tokens) + max_new_tokens = {longest} exceeds the "
                          f"model's sequence limit ({limit}; actor.max_seq_len / max_position_embeddings)")
    if job.data.prompts_per_step * job.algo.group_size < dp:
        raise ConfigError("data.prompts_per_step", job.data.prompts_per_step,
                          f"prompts_per_step x algo.group_size must give every one of the {dp} data-parallel "
                          "ranks at least one response")
    memory = estimate_memory(bridge, job.actor, job.rollout, job.longest_training_sequence, world_size)
    return Resolved(bridge=bridge, hf_config=hf_config, world_size=world_size, dp=dp, rollout_tp=rollout_tp,
                    rollout_replicas=world_size // rollout_tp, memory=memory)


@dataclass(frozen=True)
class JobData:
    """The job's tokenizer and prompt datasets, loaded and checked once."""

    tokenizer: Any
    train: Any
    eval: Any


def load_data(job: JobConfig, resolved: "Resolved") -> JobData:
    """Tokenizer and datasets, checked against the model's vocabulary and the warm-up's response
    field (cheap next to a GPU job, so ``jetrl check`` runs it too)."""
    from megatron_jetrl.data.datasets import PromptDataset
    from megatron_jetrl.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(job.model.tokenizer_spec)
    vocab = resolved.bridge.dims.vocab_size
    if tokenizer.vocab_size > vocab:
        raise ConfigError("model.tokenizer", job.model.tokenizer_spec,
                          f"has {tokenizer.vocab_size} tokens; the model's vocab_size is {vocab}")
    train = PromptDataset.from_settings(job.data.train, tokenizer, "data.train")
    if len(train) == 0:
        raise ConfigError("data.train", job.data.train.path or "synthetic", "has no usable prompts")
    if job.sft.steps:
        train.records_field(job.sft.response_key, "sft.response_key")
    evaluation = (PromptDataset.from_settings(job.data.eval, tokenizer, "data.eval")
                  if job.data.eval is not None else None)
    return JobData(tokenizer, train, evaluation)


@dataclass(frozen=True)
class Resolved:
    bridge: ModelBridge
    hf_config: dict
    world_size: int
    dp: int
    rollout_tp: int
    rollout_replicas: int
    memory: Any

    def _exact_note(self, job: JobConfig) -> str:
        """The precision line's note on an exact rollout: with an FP8 KV cache, the query segments its
        attention runs in on both sides (``precision.exact.FP8_KV_QUERY_ROWS``)."""
        if not job.precision.exact:
            why_not = job.precision.exact_auto
            return f", not exact (precision.exact=auto: {why_not})" if why_not else ""
        status = engine_kind(job.rollout).exact_status()
        if not job.rollout.fp8_kv_cache:
            return f", exact rollout ({status})"
        d = self.bridge.dims
        return (f", exact rollout with an FP8 KV cache (attention in segments of "
                f"{fp8_kv_query_chunk(d.num_heads, d.num_groups)} queries; {status})")

    @staticmethod
    def _rollout_gemm_note(job: JobConfig) -> str:
        """vLLM's block-FP8 GEMM, ``auto`` resolved (DeepGEMM JIT-compiles at a cold start)."""
        label = job.rollout.options.fp8_gemm_label
        return f", block-FP8 GEMM {label}" if label is not None and job.precision.rollout_fp8 else ""

    def describe(self, job: JobConfig, gpu_bytes: float | None = None) -> list[str]:
        """The layout and the memory plan (against a GPU of ``gpu_bytes``, when given)."""
        d = self.bridge.dims
        par = job.actor.parallel
        params = self.memory.total_params
        lines = [
            f"model        {d.architecture}: {d.num_layers} layers, hidden {d.hidden_size}, ffn {d.ffn_hidden_size}, "
            f"heads {d.num_heads}/{d.num_groups} x {d.head_dim}, vocab {d.vocab_size} ({_count(params)} parameters)",
            f"precision    {job.precision.mode.value}"
            + (f" (bf16 first/last layers {job.precision.fp8.bf16_first_layers}/{job.precision.fp8.bf16_last_layers})"
               if job.precision.train_fp8 or job.precision.rollout_fp8 else "") + self._exact_note(job),
            f"world        {self.world_size} processes",
            f"trainer      TP={par.tp} PP={par.pp} DP={self.dp}" + (" +SP" if par.sequence_parallel else "")
            + f", {job.actor.max_tokens_per_microbatch} tokens/micro-batch, recompute {job.actor.recompute}"
            + (", Transformer Engine's layers" if job.actor.fp8_backend == "te" else "")
            + (", FP8 WGrad by DeepGEMM into the main grads" if job.actor.fp8_wgrad == "deep_gemm" else ""),
            f"rollout      engine {job.rollout.engine}, TP={self.rollout_tp}, {self.rollout_replicas} replicas, "
            + ("weights written in place" if job.rollout.options.in_place_weights else "weights through its loaders")
            + self._rollout_gemm_note(job),
            f"batch        {job.data.prompts_per_step} prompts x {job.algo.group_size} samples, "
            f"<= {job.data.train.max_prompt_tokens} + {job.rollout.sampling.max_new_tokens} tokens"
            + (f" (eval prompts <= {job.data.eval.max_prompt_tokens})" if job.data.eval is not None else ""),
            f"memory/GPU   (estimate, GiB{f'; GPU {gpu_bytes / 2**30:.1f} GiB' if gpu_bytes else ''})",
        ]
        lines += [f"  {name:<28} {gib:8.2f}" for name, gib in self.memory.rows(gpu_bytes)]
        return lines


def _section(data: dict, name: str, parent: str = "") -> dict:
    value = data.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        key = f"{parent}.{name}" if parent else name
        raise ConfigError(key, value, "must be a mapping")
    return value


def _missing(name: str):
    raise ConfigError(name, None, "the section is required")


def _count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.{1 if n < 10 * scale else 0}f}{unit}"
    return str(int(n))

