"""The job config: YAML + overrides -> typed sections, errors that name the key, the resolved
layout ``jetrl check`` prints, and the example configs."""

from __future__ import annotations

from pathlib import Path

import os
import re
import pytest
import yaml

from megatron_jetrl.cli import main as cli_main
from megatron_jetrl.config import ConfigError, apply_overrides, build, load_yaml, parse_override
from megatron_jetrl.job import load_job, resolve
from megatron_jetrl.precision import PrecisionMode

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "configs" / "tiny_countdown.yaml"


def tiny(*overrides: str):
    return load_job(TINY, overrides)


def test_example_loads_with_the_documented_values():
    job = tiny()
    assert job.precision.mode is PrecisionMode.FP8 and job.actor.precision is job.precision
    assert job.algo.group_size == 8 and job.rollout.sampling.max_new_tokens == 24
    assert job.actor.optimizer.lr == pytest.approx(3e-4)
    assert job.data.train.synthetic.task == "countdown"


def test_overrides_parse_yaml_values_and_apply():
    assert parse_override("a.b=3") == ("a.b", 3)
    assert parse_override("a=true") == ("a", True)
    assert parse_override("a=[1, 2]") == ("a", [1, 2])
    assert parse_override("a=null") == ("a", None)
    assert parse_override("a=fp8") == ("a", "fp8")
    raw = apply_overrides({"x": {"y": 1}}, ["x.y=2", "x.z.w=3"])
    assert raw == {"x": {"y": 2, "z": {"w": 3}}}
    job = tiny("precision.mode=bf16", "actor.optimizer.lr=1e-5", "run.steps=3")
    assert job.precision.mode is PrecisionMode.BF16 and job.run.steps == 3
    assert job.actor.optimizer.lr == pytest.approx(1e-5)  # YAML reads 1e-5 as a string; float fields take it


def test_an_override_given_twice_is_refused_naming_both():
    with pytest.raises(ConfigError) as e:
        tiny("run.steps=3", "precision.mode=bf16", "run.steps=5")
    assert e.value.key == "run.steps"
    assert "given twice" in str(e.value) and "run.steps=3" in str(e.value) and "run.steps=5" in str(e.value)


@pytest.mark.parametrize("override, key", [
    ("actor.optimizer.lrr=1", "actor.optimizer.lrr"),
    ("bogus.x=1", "bogus"),
    ("precision.mode=fp7", "precision.mode"),
    ("run.steps=0", "run.steps"),
    ("run.steps=1.5", "run.steps"),
    ("algo.group_size=-1", "algo.group_size"),
    ("rollout.sampling.n=4", "rollout.sampling.n"),
    ("rollout.sampling.seed=4", "rollout.sampling.seed"),
    ("actor.precision.mode=bf16", "actor.precision"),
    ("rollout.engine=sglang", "rollout.engine"),
    ("rollout.sampling.temperature=hot", "rollout.sampling.temperature"),
    ("rollout.sampling.ignore_eos=maybe", "rollout.sampling.ignore_eos"),
    ("log.tensorboard=maybe", "log.tensorboard"),
    ("run=3", "run"),
])
def test_bad_values_name_their_key(override, key):
    with pytest.raises(ConfigError) as e:
        tiny(override)
    assert e.value.key == key or e.value.key.startswith(key), (e.value.key, str(e.value))


def test_missing_sections_and_required_keys():
    raw = load_yaml(TINY)
    for section in ("run", "model", "data"):
        broken = {k: v for k, v in raw.items() if k != section}
        with pytest.raises(ConfigError) as e:
            load_job(None, raw=broken)
        assert e.value.key == section
    broken = {**raw, "run": {"dir": "x"}}
    with pytest.raises(ConfigError) as e:
        load_job(None, raw=broken)
    assert e.value.key == "run.steps" and "required" in str(e.value)


def test_yaml_errors_say_where(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run:\n  dir: x\n   steps: 3\n")
    with pytest.raises(ConfigError, match="line"):
        load_yaml(bad)
    with pytest.raises(ConfigError, match="no such file"):
        load_yaml(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_yaml(tmp_path / "list.yaml")


def test_resolved_config_round_trips():
    job = tiny("precision.mode=fp16", "algo.loss.type=gspo")
    again = load_job(None, raw=yaml.safe_load(yaml.safe_dump(job.to_dict())))
    assert again == job


def test_build_reports_types_of_nested_fields():
    from megatron_jetrl.models import ParallelLayout

    assert build(ParallelLayout, {"tp": 2}, "actor.parallel").tp == 2
    with pytest.raises(ConfigError, match="actor.parallel.tp"):
        build(ParallelLayout, {"tp": "two"}, "actor.parallel")
    with pytest.raises(ConfigError, match="actor.parallel.sequence_parallel"):
        build(ParallelLayout, {"sequence_parallel": 1}, "actor.parallel")


def test_resolve_layout_and_its_errors():
    r = resolve(tiny("actor.parallel.tp=2", "model.config.num_key_value_heads=2"), 4)
    assert (r.dp, r.rollout_tp, r.rollout_replicas) == (2, 1, 4)
    assert r.memory.peak() > 0 and r.memory.total_params > 1e6
    text = "\n".join(r.describe(tiny("actor.parallel.tp=2", "model.config.num_key_value_heads=2")))
    assert "TP=2 PP=1 DP=2" in text and "memory/GPU" in text
    with pytest.raises(ConfigError, match="must divide the world size"):
        resolve(tiny("actor.parallel.tp=2", "model.config.num_key_value_heads=2"), 3)
    with pytest.raises(ConfigError) as e:
        resolve(tiny("rollout.sampling.max_new_tokens=200"), 1)
    assert e.value.key == "rollout.sampling.max_new_tokens" and "128" in str(e.value)
    with pytest.raises(ConfigError) as e:
        resolve(tiny("actor.parallel.tp=3"), 3)
    assert "tp" in e.value.key


@pytest.mark.parametrize("override", ["num_hidden_layers=0", "num_hidden_layers=-1", "hidden_size=0",
                                      "num_attention_heads=-2", "intermediate_size=-5", "head_dim=0", "vocab_size=0",
                                      "max_position_embeddings=0"])
def test_model_dimensions_of_an_inline_config_must_be_positive(override, capsys):
    """A size of 0 or less in model.config is named when the job resolves (jetrl check and jetrl
    train both resolve it before any GPU work), not a traceback or a "config OK"."""
    key, value = override.split("=")
    with pytest.raises(ConfigError) as e:
        resolve(tiny(f"model.config.{override}"), 1)
    assert str(e.value) == f"config.json:{key}: got {value}; must be a positive integer"
    assert cli_main(["check", str(TINY), f"model.config.{override}"]) == 2
    out = capsys.readouterr()
    assert f"model.config.{key}: got {value}; must be a positive integer" in out.err and "config OK" not in out.out


def test_fp8_kv_cache_needs_vllm_and_fp8_rollout():
    with pytest.raises(ConfigError, match="rollout.engine=vllm"):
        tiny("rollout.vllm.kv_cache_dtype=fp8")
    with pytest.raises(ConfigError, match="precision.mode"):
        tiny("rollout.engine=vllm", "rollout.vllm.kv_cache_dtype=fp8", "precision.mode=bf16")


def test_the_trainer_line_names_te_layers_and_the_deep_gemm_wgrad():
    def trainer(*overrides):
        return next(x for x in resolve(tiny(*overrides), 1).describe(tiny(*overrides)) if x.startswith("trainer"))

    assert "Transformer Engine" not in trainer() and "DeepGEMM" not in trainer()
    assert trainer("actor.fp8_backend=te").endswith(", Transformer Engine's layers")
    assert trainer("actor.fp8_wgrad=deep_gemm").endswith(", FP8 WGrad by DeepGEMM into the main grads")


def test_the_rollout_line_names_vllms_fp8_gemm():
    def rollout(*overrides):
        return next(x for x in resolve(tiny(*overrides), 1).describe(tiny(*overrides)) if x.startswith("rollout"))

    assert rollout("rollout.engine=vllm").endswith(", block-FP8 GEMM DeepGEMM")
    assert rollout("rollout.engine=vllm", "rollout.vllm.fp8_gemm=cutlass").endswith(", block-FP8 GEMM CUTLASS")
    assert "GEMM" not in rollout("rollout.engine=vllm", "precision.mode=bf16")
    assert "GEMM" not in rollout()  # the hf engine computes with the trainer's own GEMM


def test_fp8_kv_cache_scales_need_the_native_layers_in_every_mode():
    """The per-step q/k/v scales come from the native attention; the te backend builds Transformer
    Engine's layers in every precision mode, so BF16 training with FP8 rollout is refused too."""
    for mode in ("fp8", "bf16-train+fp8-rollout"):
        with pytest.raises(ConfigError, match="cannot calibrate an FP8 KV cache") as e:
            tiny("rollout.engine=vllm", "rollout.vllm.kv_cache_dtype=fp8", f"precision.mode={mode}",
                 "actor.fp8_backend=te")
        assert e.value.key == "actor.fp8_backend"


def test_vllm_engine_takes_an_inline_config_and_sizes_its_sequences():
    job = tiny("rollout.engine=vllm")  # the inline model.config is enough: vLLM gets it written out
    assert job.model.hf_config is None
    assert job.longest_sequence == job.data.train.max_prompt_tokens + job.rollout.sampling.max_new_tokens
    tiny("rollout.engine=vllm", f"rollout.vllm.max_model_len={job.longest_sequence}")
    # Checked with the config, before any model or warm-up is built.
    with pytest.raises(ConfigError, match="longest prompt") as e:
        tiny("rollout.engine=vllm", f"rollout.vllm.max_model_len={job.longest_sequence - 1}")
    assert e.value.key == "rollout.vllm.max_model_len"


def test_the_soft_overlong_buffer_must_fit_the_response_length():
    """Checked when the job loads (``jetrl check`` / before ``jetrl train`` builds anything), not at
    the first step's scoring; the buffer is unused by the other modes."""
    job = tiny()
    max_new = job.rollout.sampling.max_new_tokens
    tiny("data.overlong.mode=soft", f"data.overlong.buffer_tokens={max_new}")
    with pytest.raises(ConfigError, match=rf"must not exceed rollout.sampling.max_new_tokens \({max_new}\)") as e:
        tiny("data.overlong.mode=soft", f"data.overlong.buffer_tokens={max_new + 1}")
    assert e.value.key == "data.overlong.buffer_tokens"
    tiny("data.overlong.mode=filter", f"data.overlong.buffer_tokens={max_new + 1}")


def test_eval_prompts_size_the_rollout_not_the_training_activations():
    """Longer eval prompts raise the engine's context (longest_sequence) but not the activation
    estimate: a training micro-batch holds training sequences only."""
    job = tiny("actor.max_tokens_per_microbatch=64")
    longer = tiny("actor.max_tokens_per_microbatch=64", "data.eval.max_prompt_tokens=100")
    assert longer.longest_sequence == 100 + job.rollout.sampling.max_new_tokens > job.longest_sequence
    assert longer.longest_training_sequence == job.longest_training_sequence
    assert resolve(longer, 1).memory == resolve(job, 1).memory


def test_bad_smoke_flag_is_refused_before_the_data_loads(capsys, monkeypatch):
    import megatron_jetrl.cli as cli

    monkeypatch.setattr(cli, "load_data", lambda *a: pytest.fail("data loaded before the flag was checked"))
    assert cli_main(["train", str(TINY), "--smoke", "--smoke-step-seconds", "-1"]) == 2
    assert "--smoke-step-seconds" in capsys.readouterr().err


def test_check_command_prints_the_layout(capsys):
    assert cli_main(["check", str(TINY), "--world-size", "2", "run.steps=5"]) == 0
    out = capsys.readouterr().out
    assert "TP=1 PP=1 DP=2" in out and "config OK" in out and "peak" in out


def test_check_command_reports_config_errors(capsys):
    assert cli_main(["check", str(TINY), "actor.optimizer.lr=-1"]) == 2
    err = capsys.readouterr().err
    assert "actor.optimizer.lr" in err


def test_train_refuses_bad_config_before_any_gpu_work(capsys):
    assert cli_main(["train", str(TINY), "data.prompts_per_step=0"]) == 2
    assert "data.prompts_per_step" in capsys.readouterr().err


def test_choice_fields_are_checked_by_their_annotation_in_code_and_in_the_loader():
    """One type check for a section built by the loader or in code (config.check_fields): a
    Literal field refuses a value outside it, naming the key, either way; the Literal lists the
    same choices as the constants other code reads."""
    import typing

    from megatron_jetrl.actor import ActorSettings
    from megatron_jetrl.config import build
    from megatron_jetrl.precision import GEMM_BACKENDS
    from megatron_jetrl.rollout import ENGINES, HfOptions, RolloutSettings
    from megatron_jetrl.rollout.vllm_engine import VllmOptions

    for make, key in ((lambda: VllmOptions(kv_cache_dtype="fp4"), "rollout.vllm.kv_cache_dtype"),
                      (lambda: VllmOptions(sleep_level=3), "rollout.vllm.sleep_level"),
                      (lambda: HfOptions(cuda_graphs="yes"), "rollout.hf.cuda_graphs"),
                      (lambda: RolloutSettings(engine="sglang"), "rollout.engine"),
                      (lambda: ActorSettings(recompute="selective"), "actor.recompute"),
                      (lambda: build(RolloutSettings, {"vllm": {"weight_update": "nccl"}}, "rollout"),
                       "rollout.vllm.weight_update")):
        with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: got .*must be"):
            make()
    assert typing.get_args(typing.get_type_hints(RolloutSettings)["engine"]) == tuple(ENGINES)
    hints = typing.get_type_hints(RolloutSettings)
    for name, kind in ENGINES.items():  # each engine's options section is the rollout field of its name
        assert kind.name == name and hints[name] is kind.options
        assert isinstance(RolloutSettings(engine=name).options, kind.options)
    assert typing.get_args(typing.get_type_hints(HfOptions)["gemm"]) == GEMM_BACKENDS
    assert typing.get_args(typing.get_type_hints(ActorSettings)["fp8_gemm"]) == GEMM_BACKENDS
    from megatron_jetrl.algo.settings import CorrectionSettings
    from megatron_jetrl.data.settings import CHAT_TEMPLATE_MODES, DatasetSettings, OverlongSettings

    assert typing.get_args(typing.get_type_hints(DatasetSettings)["chat_template"]) == CHAT_TEMPLATE_MODES
    for make, key in ((lambda: CorrectionSettings(mode="tis"), "algo.correction.mode"),
                      (lambda: OverlongSettings(mode="hard"), "data.overlong.mode")):
        with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: got .*must be"):
            make()


def test_profile_steps_must_be_steps_of_the_run():
    from megatron_jetrl.job.config import RunSettings

    assert RunSettings(dir="r", steps=5, profile_steps=(2, 5)).profile_steps == (2, 5)
    with pytest.raises(ConfigError, match=r"run\.profile_steps\[1\].*after the last step \(run\.steps=5\)"):
        RunSettings(dir="r", steps=5, profile_steps=(2, 6))
    with pytest.raises(ConfigError, match=r"run\.profile_steps\[0\]"):
        RunSettings(dir="r", steps=5, profile_steps=(0,))


def test_settings_that_would_fail_or_do_nothing_later_are_refused_when_the_job_loads():
    """Each of these passed ``jetrl check`` and failed (or silently did nothing) only once the job ran."""
    cases = [
        (("reward.type=arithmetic",), "reward.type", "does not score data.train.synthetic.task 'countdown'"),
        (("data.eval=null",), "run.eval_every", "evaluates data.eval, which is not set"),
        (("rollout.hf.max_batch_tokens=10",), "rollout.hf.max_batch_tokens", "must hold one prompt + response"),
    ]
    for overrides, key, reason in cases:
        with pytest.raises(ConfigError, match=re.escape(reason)) as e:
            tiny(*overrides)
        assert e.value.key == key, overrides
    tiny("data.eval=null", "run.eval_every=0")
    job = tiny()
    tiny(f"rollout.hf.max_batch_tokens={job.longest_sequence - 1}")


def test_a_model_config_file_that_is_not_a_json_object_names_the_key(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    for text, reason in (("[1, 2]", "must hold a JSON object"), (b"\xff\xfe", "is not valid JSON")):
        (model / "config.json").write_bytes(text.encode() if isinstance(text, str) else text)
        with pytest.raises(ConfigError, match=re.escape(reason)) as e:
            tiny("model.hf_config=" + str(model)).model.hf_config_dict()
        assert e.value.key == "model.hf_config"


def test_a_checkpoint_path_that_is_not_a_checkpoint_is_refused_by_check(tmp_path, capsys):
    """There but not a megatron checkpoint: an error in ``jetrl check`` too (nothing is still to come),
    naming the run checkpoint's actor directory when that is what was given."""
    empty = tmp_path / "empty"
    empty.mkdir()
    step = tmp_path / "step_00000004"
    (step / "actor").mkdir(parents=True)
    (step / "actor" / ".metadata").write_bytes(b"")
    for path, fix in ((empty, "name the directory tools/convert_hf_to_megatron.py wrote"),
                      (step, f"name {step / 'actor'} (a run's checkpoint keeps the weights there)")):
        assert cli_main(["check", str(TINY), f"run.dir={tmp_path / 'run'}", f"model.checkpoint={path}"]) == 2
        err = capsys.readouterr().err
        assert f"model.checkpoint: got '{path}'; is not a megatron checkpoint directory (no .metadata in it): {fix}" \
            in err


def test_a_fresh_start_in_a_run_dir_with_checkpoints_is_refused_before_anything_is_written(tmp_path):
    from megatron_jetrl.runtime.run_checkpoints import LATEST

    run = tmp_path / "run"
    step = run / "checkpoints" / "step_00000003"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("")
    (run / "checkpoints" / LATEST).write_text("step_00000003")
    before = _tree(run)
    tiny(f"run.dir={run}").run.check_dir()  # resume (the default): fine
    with pytest.raises(ConfigError, match=r"has checkpoints \(step_00000003\); use a new run\.dir, or "
                                          r"run\.resume=true") as e:
        tiny(f"run.dir={run}", "run.resume=false").run.check_dir()
    assert e.value.key == "run.resume" and _tree(run) == before


def _tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_run_dir_that_is_a_file_is_refused_by_check_and_train(tmp_path, capsys, monkeypatch):
    import megatron_jetrl.cli as cli

    (tmp_path / "f").write_text("x")
    for run_dir, wrong in ((tmp_path / "f", "is a file, not a directory"),
                           (tmp_path / "f" / "run", f"cannot be created: {tmp_path / 'f'} is a file")):
        with pytest.raises(ConfigError, match=rf"^run\.dir: got '{re.escape(str(run_dir))}'; {re.escape(wrong)}; "
                                              r"set run\.dir to"):
            tiny(f"run.dir={run_dir}").run.check_dir()
        assert cli_main(["check", str(TINY), f"run.dir={run_dir}"]) == 2
        out = capsys.readouterr()
        assert f"run.dir: got '{run_dir}'; {wrong}" in out.err and "config OK" not in out.out
        monkeypatch.setattr(cli, "load_data", lambda *a: pytest.fail("data loaded before run.dir was checked"))
        assert cli_main(["train", str(TINY), f"run.dir={run_dir}"]) == 2
        assert f"run.dir: got '{run_dir}'; {wrong}" in capsys.readouterr().err
    assert _tree(tmp_path) == ["f"]


def test_run_dir_that_does_not_exist_yet_is_not_created(tmp_path):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "keep").write_text("x")
    for run_dir in (tmp_path / "new", tmp_path / "a" / "b" / "c", tmp_path / "old"):
        tiny(f"run.dir={run_dir}").run.check_dir()
    assert _tree(tmp_path) == ["old", "old/keep"]


@pytest.mark.parametrize("exists", [True, False])
def test_read_only_run_dir_is_refused_and_nothing_is_left(tmp_path, monkeypatch, exists):
    """chmod 0o500 is what a user sees; root writes there anyway, so as root the permission
    check is shown os.access's answer for a user, and the write probe (which catches what
    permissions miss: read-only mounts, ACLs, root squash) is made to fail as such a mount does."""
    import errno
    import tempfile

    from megatron_jetrl.job import config as job_config

    ro = tmp_path / "ro"
    ro.mkdir()
    run_dir = ro if exists else ro / "run"
    wrong = "is not writable" if exists else f"does not exist and cannot be created: {ro} is not writable"
    ro.chmod(0o500)
    try:
        if os.geteuid() == 0:  # chmod does not restrict root
            real_access = os.access
            monkeypatch.setattr(job_config.os, "access", lambda p, mode: Path(p) != ro and real_access(p, mode))
        with pytest.raises(ConfigError, match=rf"^run\.dir: got '{re.escape(str(run_dir))}'; {re.escape(wrong)} by "
                                              r"this user; .*or set run\.dir (to|under) a writable directory$"):
            tiny(f"run.dir={run_dir}").run.check_dir()
        monkeypatch.undo()
        ro.chmod(0o700)

        def read_only_mount(*args, **kwargs):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))

        monkeypatch.setattr(tempfile, "mkstemp", read_only_mount)
        with pytest.raises(ConfigError, match=rf"^run\.dir: got '{re.escape(str(run_dir))}'; {re.escape(wrong)} "
                                              r"\(Read-only file system\); "):
            tiny(f"run.dir={run_dir}").run.check_dir()
    finally:
        ro.chmod(0o700)
    assert _tree(tmp_path) == ["ro"]


def test_check_loads_the_data_and_refuses_an_empty_prompt(tmp_path, capsys):
    """jetrl check loads the data whenever the tokenizer and the data files are there (also while
    the model is still to download, planning with model.plan_config), so an empty prompt is named
    there instead of stopping the run at its batch."""
    import json

    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "3 5>8=", "answer": 8}) + "\n" + json.dumps({"prompt": "", "answer": 1})
                    + "\n")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(load_yaml(TINY)["model"]["config"]))
    args = ["data.train.synthetic=null", f"data.train.path={data}", f"run.dir={tmp_path / 'run'}"]
    later = [f"model.hf_config={tmp_path / 'not-downloaded'}", f"model.plan_config={plan}"]
    for extra in ([], later):
        assert cli_main(["check", str(TINY), *args, *extra]) == 2
        out = capsys.readouterr()
        assert f"data.train.prompt_key: got 'prompt'; record 2 of {data} (line 2): the prompt is empty" in out.err
        assert "config OK" not in out.out
    assert _tree(tmp_path) == ["plan.json", "train.jsonl"]


# -- bad input: one line naming the key, the file or the variable, never a traceback ---------------------------


@pytest.mark.parametrize("content, reason", [
    (b"\xff\xfe", "is not UTF-8 text (byte 0); save it as UTF-8"),
    (b"run:\n  steps: 1\nmodel:\n  tokenizer: x\nrun:\n  steps: 2\n",
     "is not valid YAML at line 5, column 1: the key 'run' is given twice (first at line 1); keep one"),
    (b"run: {steps: 1, steps: 2}\n", "is not valid YAML at line 1, column 17: the key 'steps' is given twice"),
])
def test_a_config_file_that_cannot_be_read_is_named(tmp_path, capsys, content, reason):
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    assert cli_main(["check", str(path)]) == 2
    assert capsys.readouterr().err.startswith(f"config error: config: got '{path}'; {reason}")
    assert cli_main(["check", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"config error: config: got '{tmp_path}'; is a directory; pass the path of " \
                                      "a YAML job config file\n"


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("base: &b {steps: 1, seed: 2}\nrun:\n  <<: *b\n  steps: 3\n")
    assert load_yaml(path)["run"] == {"steps": 3, "seed": 2}


@pytest.mark.parametrize("override, line", [
    ("model.config.rope_theta=abc", "model.config.rope_theta: got 'abc'; must be a finite number > 0"),
    ("model.config.rms_norm_eps=abc", "model.config.rms_norm_eps: got 'abc'; must be a finite number > 0"),
    ("model.config.rms_norm_eps=0", "model.config.rms_norm_eps: got 0; must be a finite number > 0"),
    ("model.config.rope_theta=.inf", "model.config.rope_theta: got inf; must be a finite number > 0"),
    ("model.config.tie_word_embeddings=maybe", "model.config.tie_word_embeddings: got 'maybe'; must be true or false"),
    ("actor.parallel.tp=0", "actor.parallel.tp: got 0; must be an integer >= 1"),
    ("actor.parallel.tp=3", "actor.parallel.tp: got 3; must divide num_attention_heads (2)"),
    ("data.eval.synthetic.options.bogus=1", "data.eval.synthetic.options: got ['bogus']; task 'countdown' takes"),
    ("data.eval.synthetic.options.num_numbers=99", "data.eval.synthetic.options.num_numbers: got 99; must be an "
                                                   "integer in [2, 6]"),
])
def test_check_names_the_key_of_a_bad_model_layout_or_data_value(override, line, capsys):
    assert cli_main(["check", str(TINY), override]) == 2
    out = capsys.readouterr()
    assert out.err.startswith(f"config error: {line}") and out.err.count("\n") == 1 and "config OK" not in out.out


def test_model_config_file_errors_name_the_file(tmp_path, capsys):
    """An entry read from a file is named by the file's path; one set inline by model.config.KEY."""
    import json

    config = dict(load_yaml(TINY)["model"]["config"], rope_theta="abc")
    (tmp_path / "model").mkdir()
    for path in (tmp_path / "plan.json", tmp_path / "model" / "config.json"):
        path.write_text(json.dumps(config))
    args = ["check", str(TINY), "model.config={}", f"run.dir={tmp_path / 'run'}"]
    assert cli_main([*args, f"model.hf_config={tmp_path / 'model'}"]) == 2
    assert capsys.readouterr().err.startswith(f"config error: {tmp_path / 'model' / 'config.json'}:rope_theta: got "
                                              "'abc'; must be a finite number > 0")
    planned = [f"model.hf_config={tmp_path / 'later'}", f"model.plan_config={tmp_path / 'plan.json'}"]
    assert cli_main([*args, *planned]) == 2
    assert capsys.readouterr().err.startswith(f"config error: {tmp_path / 'plan.json'}:rope_theta: got 'abc'")
    assert cli_main([*args, *planned, "model.config.rope_theta=-1"]) == 2
    assert capsys.readouterr().err.startswith("config error: model.config.rope_theta: got -1;")


@pytest.mark.parametrize("name, value", [("WORLD_SIZE", "abc"), ("WORLD_SIZE", "0"), ("SLURM_NTASKS", "-3")])
def test_check_names_a_bad_world_size_variable(name, value, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    monkeypatch.setenv(name, value)
    assert cli_main(["check", str(TINY)]) == 2
    err = capsys.readouterr().err
    assert err == (f"config error: environment:{name}: got '{value}'; must be an integer >= 1 (the processes jetrl "
                   "check plans for); fix or unset it, or pass --world-size N\n")


def _checkpointed_run(run_dir: Path, *overrides: str) -> None:
    """A run dir whose newest checkpoint was made by the tiny job with ``overrides``."""
    from megatron_jetrl.runtime import RunCheckpoints, save_json_atomic

    job = tiny(f"run.dir={run_dir}", *overrides)
    ckpts = RunCheckpoints(run_dir, 2, 0, 1, lambda: None)
    ckpts.save(20, lambda staging: save_json_atomic(staging / "trainer_state.json", {"step": 20,
                                                                                     "config": job.to_dict()}),
               any_rank=bool)


def test_resuming_with_what_the_run_learns_with_changed_is_refused_naming_each_key(tmp_path, capsys):
    run_dir = tmp_path / "run"
    _checkpointed_run(run_dir)
    code = cli_main(["check", str(TINY), f"run.dir={run_dir}", "precision.mode=bf16", "actor.optimizer.lr=1e-4",
                     "algo.group_size=4"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"config error: actor.optimizer.lr: got 0.0001; differs from the checkpoint this run resumes "
                          f"({run_dir / 'checkpoints' / 'step_00000020'}: 0.0003); also algo.group_size (8 -> 4), "
                          "precision.mode ('fp8' -> 'bf16'): set it back, use a new run.dir, or run.allow_changes="
                          "[actor.optimizer.lr, algo.group_size, precision.mode] to change it on purpose"), err


def test_resuming_with_operational_or_allowed_changes_goes_ahead(tmp_path, capsys):
    run_dir = tmp_path / "run"
    _checkpointed_run(run_dir)
    # more steps, another micro-batch size, the exact kernels, data moved: what it learns with is the same
    assert cli_main(["check", str(TINY), f"run.dir={run_dir}", "run.steps=200", "actor.max_tokens_per_microbatch=4096",
                     "precision.exact=true", "rollout.engine=vllm", "log.every=5"]) == 0
    assert "differs from the checkpoint" not in capsys.readouterr().err
    assert cli_main(["check", str(TINY), f"run.dir={run_dir}", "actor.optimizer.lr=1e-4",
                     "run.allow_changes=[actor.optimizer]"]) == 0, capsys.readouterr().err
    assert cli_main(["check", str(TINY), f"run.dir={run_dir}", "actor.optimizer.lr=1e-4", "run.resume=false"]) == 2
    assert "run.resume: got False" in capsys.readouterr().err  # a fresh start there is refused on its own terms


def test_a_checkpoint_from_a_release_with_other_keys_resumes(tmp_path):
    from megatron_jetrl.job.config import resume_changes

    job = tiny()
    saved = job.to_dict()
    saved["algo"]["loss"]["a_key_of_another_release"] = 1
    del saved["algo"]["loss"]["kl_type"]
    assert resume_changes(job, saved) == []
    saved["algo"]["loss"]["kl_coef"] = 0.5
    assert resume_changes(job, saved) == [("algo.loss.kl_coef", 0.5, 0.0)]


@pytest.fixture(scope="module")
def converted_qwen3(tmp_path_factory):
    """A tiny random Qwen3 in HF form and converted to megatron (2 layers, hidden 256, vocab 1000)."""
    from tests.model_fixtures import load_tool, save_tiny_hf

    root = tmp_path_factory.mktemp("qwen3")
    save_tiny_hf("Qwen3ForCausalLM", root / "hf")
    assert load_tool("convert_hf_to_megatron")(["--hf-dir", str(root / "hf"), "--out-dir", str(root / "mg")]) == 0
    return root


def test_an_initial_checkpoint_of_another_model_is_refused_by_check(tmp_path, capsys, converted_qwen3):
    hf, mg = converted_qwen3 / "hf", converted_qwen3 / "mg"
    run = f"run.dir={tmp_path / 'run'}"
    assert cli_main(["check", str(TINY), run, f"model.hf_config={hf}", "model.config={}",
                     f"model.checkpoint={mg}"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    # the tiny example's own model (4 layers, vocab 64) from the same checkpoint
    assert cli_main(["check", str(TINY), run, f"model.checkpoint={mg}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"config error: model.checkpoint: got '{mg}'; does not hold this job's model (checkpoint "
                          f"{mg} tensor "), err
    assert err.endswith("name the checkpoint tools/convert_hf_to_megatron.py wrote from model.hf_config's model, or "
                        "the model.hf_config it was converted from"), err


def test_the_plan_says_what_the_colocated_actor_moves_a_step():
    """Colocated with an engine that claims a share of the GPU, the actor moves to host memory only
    what that share and its own state leave short (gradients dropped first, no copy): nothing on a
    GPU with room for both, its weights and optimizer state at most."""
    from megatron_jetrl.job.estimate import RUNTIME_RESERVE_GIB, GiB, MemoryEstimate

    def plan(share):
        return MemoryEstimate(total_params=1, trainer_weights=8 * GiB, trainer_grads=16 * GiB, optimizer=12 * GiB,
                              fp8_copies=6 * GiB, activations=14 * GiB, rollout_weights=0, rollout_kv_cache=0,
                              engine_share=share, share_key="rollout.vllm.gpu_memory_utilization", offload_actor=True,
                              host_offload=20 * GiB)

    gpu = 100 * GiB
    assert plan(0.3).moved_to_host(gpu) == 0.0  # 36 + 30 + reserve fit in 100
    short = 36 * GiB + 60 * GiB + RUNTIME_RESERVE_GIB * GiB - gpu  # 4 GiB short: the gradients cover it
    assert short < 16 * GiB and plan(0.6).moved_to_host(gpu) == 0.0
    assert plan(0.8).moved_to_host(gpu) == 36 * GiB + 80 * GiB + RUNTIME_RESERVE_GIB * GiB - gpu - 16 * GiB
    assert plan(0.99).moved_to_host(gpu) == 20 * GiB  # weights and optimizer state, all of them
    rows = dict(plan(0.8).rows(gpu))
    assert rows["moved a step (each way)"] == pytest.approx(8.0)
    assert plan(None).moved_to_host(gpu) is None and "moved a step (each way)" not in dict(plan(None).rows(gpu))
