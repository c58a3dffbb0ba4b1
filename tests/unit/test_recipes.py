"""The 8B and 32B recipes pass `jetrl check` at their node counts and fit an H100 by the memory
plan, in FP8 and in the one-key BF16/FP16 variants; a layout that does not fit is warned about
with what to change. Only the paths are overridden: a model directory holding the shipped
config.json (examples/configs/models/) and a stand-in tokenizer, and DAPO-schema JSONL data."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_jetrl.cli import backend_env, check_memory, machine_problems, main
from megatron_jetrl.config import ConfigError
from megatron_jetrl.job.estimate import GPU_MEMORY_GIB, GiB, gpu_capacity
from megatron_jetrl.job import load_job, resolve
from tests.helpers import tiny_hf_tokenizer

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"
RECIPES = {"8b": ("qwen3_8b_dapo_fp8.yaml", 1), "32b": ("qwen3_32b_dapo_fp8.yaml", 4)}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipes")
    out = {}
    for size in RECIPES:
        model = root / f"Qwen3-{size}"
        tiny_hf_tokenizer(model)  # a stand-in tokenizer; the model's shapes come from the real config.json
        shutil.copy(CONFIGS / "models" / f"qwen3-{size}.json", model / "config.json")
        out[size] = model
    record = {"prompt": [{"role": "user", "content": "what is 2+2 ?"}], "reward_model": {"ground_truth": "4"}}
    (root / "dapo.jsonl").write_text("\n".join(json.dumps(record) for _ in range(8)) + "\n")
    out["data"] = root / "dapo.jsonl"
    return out


def overrides(paths, size):
    return [f"model.hf_config={paths[size]}", f"data.train.path={paths['data']}", f"data.eval.path={paths['data']}",
            "model.checkpoint=null"]


@pytest.mark.parametrize("mode", ["fp8", "bf16", "fp16", "bf16-train+fp8-rollout"])
@pytest.mark.parametrize("size", sorted(RECIPES))
def test_recipe_checks_and_fits_an_h100(paths, capsys, size, mode):
    name, nodes = RECIPES[size]
    code = main(["check", str(CONFIGS / name), "--nodes", str(nodes), *overrides(paths, size),
                 f"precision.mode={mode}"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "config OK" in out.out and "does not fit" not in out.out
    # the only warnings allowed: what this machine lacks (a supported vLLM, math_verify), and only
    # where it lacks them
    warnings = [line for line in out.out.splitlines() if line.startswith("WARNING")]
    job = load_job(CONFIGS / name, [*overrides(paths, size), f"precision.mode={mode}"])
    assert warnings == [f"WARNING: {e} (jetrl train needs it on the GPU hosts)" for e in machine_problems(job)]
    assert f"world        {8 * nodes} processes" in out.out
    job = load_job(CONFIGS / name, [*overrides(paths, size), f"precision.mode={mode}"])
    plan = resolve(job, 8 * nodes).memory
    assert plan.fits(GPU_MEMORY_GIB["H100"] * GiB)
    assert plan.peak(GPU_MEMORY_GIB["H100"] * GiB) > 40 * GiB  # the recipes use the GPU, not a corner of it


def test_recipe_parameter_counts(paths):
    counts = {size: resolve(load_job(CONFIGS / name, overrides(paths, size)), 8 * nodes).memory.total_params
              for size, (name, nodes) in RECIPES.items()}
    assert 8.1e9 < counts["8b"] < 8.3e9 and 32.7e9 < counts["32b"] < 32.9e9


def test_32b_on_one_node_does_not_fit_and_says_what_to_change(paths, capsys):
    name, _ = RECIPES["32b"]
    code = main(["check", str(CONFIGS / name), "--nodes", "1", *overrides(paths, "32b")])
    out, err = capsys.readouterr()
    assert code == 2
    assert err.startswith("config error: memory plan: ") and "does not fit in memory (79.1 GiB per GPU" in err
    assert len(err.strip().splitlines()) == 1 and "config OK" not in out
    assert "WARNING: the estimated peak per GPU is" in out and "more GPUs" in out


def test_activation_warning_names_recompute(paths, capsys):
    name, nodes = RECIPES["8b"]
    code = main(["check", str(CONFIGS / name), "--nodes", str(nodes), *overrides(paths, "8b"), "actor.recompute=none",
                 "actor.parallel.sequence_parallel=false"])
    out, err = capsys.readouterr()
    assert code == 2 and "does not fit" in err and "actor.recompute=full" in out


def test_memory_terms_by_hand(paths):
    """The 8B recipe's plan, term by term, from the Qwen3-8B shapes (TP=2 +SP, DP=4, 18432 tokens)."""
    job = load_job(CONFIGS / RECIPES["8b"][0], overrides(paths, "8b"))
    m = resolve(job, 8).memory
    h, ffn, layers, vocab, heads, groups, hd = 4096, 12288, 36, 151936, 32, 8, 128
    layer = h * (heads + 2 * groups) * hd + heads * hd * h + 3 * h * ffn  # qkv, proj, fc1 (gate, up), fc2
    norms = 2 * h + 2 * hd  # input/post-attention norms, q/k norms
    local = (layers * (layer + norms) + 2 * vocab * h) / 2
    assert m.trainer_weights == pytest.approx(local * 2 + h * 2 / 2, rel=1e-6)  # + the final norm
    assert m.trainer_grads == pytest.approx(2 * m.trainer_weights)
    assert m.optimizer == pytest.approx(6 * m.trainer_weights / 4)
    assert m.fp8_copies == pytest.approx(layers * layer / 2 * 2)
    tokens, padded = 18432, 152064  # the vocab padded to a multiple of 128 x TP
    assert m.activations == pytest.approx(layers * tokens * h * 2 / 2 + tokens * h * 34 / 2 + tokens * padded / 2 * 8)
    assert m.rollout_total(80 * GiB) == pytest.approx(0.7 * 80 * GiB)
    assert m.host_offload == pytest.approx(m.trainer_weights + m.optimizer)


def test_gpu_capacity_and_recompute_setting():
    assert gpu_capacity("h200") == GPU_MEMORY_GIB["H200"] * GiB and gpu_capacity("40") == 40 * GiB
    for bad in ("A100", "-1", "0", "inf", "nan"):
        with pytest.raises(ValueError, match="--gpu-memory"):
            gpu_capacity(bad)
    with pytest.raises(ConfigError, match="actor.recompute"):
        load_job(CONFIGS / "tiny_countdown.yaml", ["actor.recompute=selective"])


def test_check_flag_errors(capsys):
    cfg = str(CONFIGS / "tiny_countdown.yaml")
    assert main(["check", cfg, "--gpu-memory", "A100"]) == 2
    assert "--gpu-memory" in capsys.readouterr().err
    assert main(["check", cfg, "--world-size", "6", "--gpus-per-node", "4"]) == 2
    assert "multiple of --gpus-per-node" in capsys.readouterr().err
    assert main(["check", cfg, "--world-size", "4", "--nodes", "2"]) == 2
    assert "contradicts --nodes 2 x --gpus-per-node 8 = 16" in capsys.readouterr().err
    assert main(["check", cfg, "--nodes", "2", "--gpus-per-node", "3", "actor.parallel.tp=2",
                 "model.config.num_key_value_heads=2"]) == 2
    assert "no TP group spans nodes" in capsys.readouterr().err


def test_train_refuses_a_plan_over_the_gpu(paths):
    """What jetrl train does with the GPU's size before building anything: the 32B recipe on one
    node is refused with the plan's reasons; --skip-memory-check lets it start with warnings."""
    job = load_job(CONFIGS / RECIPES["32b"][0], overrides(paths, "32b"))
    resolved = resolve(job, 8)
    h100 = GPU_MEMORY_GIB["H100"] * GiB
    with pytest.raises(ConfigError, match="memory plan.*GiB per GPU.*more GPUs.*--skip-memory-check"):
        check_memory(resolved, h100, skip=False)
    assert check_memory(resolved, h100, skip=True)
    assert check_memory(resolve(job, 32), h100, skip=False) == []


def test_backend_env_follows_the_recipe(paths):
    job = load_job(CONFIGS / RECIPES["8b"][0], overrides(paths, "8b"))
    exact = {"VLLM_BATCH_INVARIANT": "1", "VLLM_USE_V2_MODEL_RUNNER": "1"}  # the recipe's rollout is exact (auto)
    assert job.precision.exact and job.precision.exact_auto == ""
    assert backend_env(job, resolve(job, 8)) == {"VLLM_USE_DEEP_GEMM_E8M0": "0", "VLLM_USE_DEEP_GEMM": "1", **exact}
    cut = load_job(CONFIGS / RECIPES["8b"][0], [*overrides(paths, "8b"), "rollout.vllm.fp8_gemm=cutlass"])
    assert backend_env(cut, resolve(cut, 8)) == {"VLLM_USE_DEEP_GEMM_E8M0": "0", "VLLM_USE_DEEP_GEMM": "0", **exact}
    default = load_job(CONFIGS / RECIPES["8b"][0], [*overrides(paths, "8b"), "precision.exact=false"])
    assert backend_env(default, resolve(default, 8)) == {"VLLM_USE_DEEP_GEMM_E8M0": "0", "VLLM_USE_DEEP_GEMM": "1"}
    hf = load_job(CONFIGS / RECIPES["8b"][0], [*overrides(paths, "8b"), "precision.fp8.pow2_scales=true",
                                               "rollout.engine=hf"])
    assert backend_env(hf, resolve(hf, 8)) == {}  # native backend, hf engine: nothing to set
    te = load_job(CONFIGS / RECIPES["8b"][0], [*overrides(paths, "8b"), "precision.fp8.pow2_scales=true",
                                               "rollout.engine=hf", "actor.fp8_backend=te"])
    assert backend_env(te, resolve(te, 8)) == {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "0"}
    te_vllm = load_job(CONFIGS / RECIPES["8b"][0], [*overrides(paths, "8b"), "actor.fp8_backend=te"])
    assert backend_env(te_vllm, resolve(te_vllm, 8)) == {
        "NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1", "VLLM_USE_DEEP_GEMM_E8M0": "0", "VLLM_USE_DEEP_GEMM": "1"}
    # what te cannot do yet is refused when the config loads: the FP8 KV cache's per-step scales
    with pytest.raises(ConfigError, match="actor.fp8_backend.*kv_cache_dtype=auto"):
        load_job(CONFIGS / RECIPES["8b"][0], [*overrides(paths, "8b"), "actor.fp8_backend=te",
                                               "rollout.vllm.kv_cache_dtype=fp8"])
    load_job(CONFIGS / RECIPES["8b"][0], [*overrides(paths, "8b"), "rollout.vllm.kv_cache_dtype=fp8"])


def test_check_plans_before_the_download_and_train_refuses(tmp_path, capsys, monkeypatch):
    """The README's first command, as a new user runs it: nothing downloaded yet. check plans from
    the shipped config.json (model.plan_config) and lists what is still to fetch; train refuses,
    naming it, before any work."""
    monkeypatch.chdir(ROOT)  # the recipes' paths are relative to the repository root
    name, nodes = RECIPES["32b"]
    assert not (ROOT / "checkpoints" / "Qwen3-32B").exists()
    assert main(["check", str(CONFIGS / name), "--nodes", str(nodes)]) == 0
    out = capsys.readouterr().out
    assert "planned with model.plan_config examples/configs/models/qwen3-32b.json" in out
    for key in ("model.hf_config checkpoints/Qwen3-32B", "model.checkpoint checkpoints/Qwen3-32B-megatron",
                "data.train.path data/dapo-math-17k.parquet", "data.eval.path data/aime-2024.parquet"):
        assert f"WARNING: {key} does not exist yet" in out, key
    assert "config OK; 4 input(s) still to fetch" in out and "does not fit" not in out
    assert "33B parameters" in out
    assert main(["train", str(CONFIGS / name)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.hf_config" in err and "also data.train.path" in err, err
    # without a plan_config the missing model is an error, saying what to do
    assert main(["check", str(CONFIGS / name), "--nodes", str(nodes), "model.plan_config=null"]) == 2
    assert "model.plan_config" in capsys.readouterr().err


def test_check_refuses_a_model_directory_without_tokenizer_files(paths, tmp_path, capsys):
    """A folder holding only config.json (transformers would build a 1-token tokenizer that encodes
    every prompt to []): check refuses it, naming the directory and what it holds."""
    bare = tmp_path / "Qwen3-8b"
    bare.mkdir()
    shutil.copy(CONFIGS / "models" / "qwen3-8b.json", bare / "config.json")
    name, nodes = RECIPES["8b"]
    args = [f"model.hf_config={bare}", f"data.train.path={paths['data']}", f"data.eval.path={paths['data']}",
            "model.checkpoint=null"]  # the initial weights are not what this test is about
    assert main(["check", str(CONFIGS / name), "--nodes", str(nodes), *args]) == 2
    err = capsys.readouterr().err
    assert "holds no tokenizer files" in err and str(bare) in err and "['config.json']" in err, err


@pytest.mark.parametrize("rank, printed", [("0", True), ("3", False)])
def test_a_config_error_is_printed_once_per_launch(capsys, monkeypatch, rank, printed):
    monkeypatch.setenv("RANK", rank)
    assert main(["check", str(CONFIGS / "tiny_countdown.yaml"), "run.steps=0"]) == 2
    assert ("config error: run.steps" in capsys.readouterr().err) is printed


def test_the_download_command_is_the_installed_hf_cli():
    """The recipes' first step downloads the model with ``hf download``: the CLI the installed
    huggingface_hub provides (it has no ``huggingface-cli`` any more). Each recipe's command runs
    ``hf download`` with options it knows, and no file of the docs still says ``huggingface-cli``."""
    stale = [str(path.relative_to(ROOT)) for path in [ROOT / "README.md", *ROOT.glob("examples/**/*"),
                                                      *ROOT.glob("docs/**/*")]
             if path.is_file() and b"huggingface-cli" in path.read_bytes()]
    assert not stale, f"say `hf download ...` instead of `huggingface-cli download ...` in {stale}"
    hf = Path(sys.executable).with_name("hf")
    assert hf.exists(), f"no `hf` next to {sys.executable}: huggingface_hub (a transformers dependency) provides it"
    usage = subprocess.run([str(hf), "download", "--help"], capture_output=True, text=True, check=True).stdout
    for name, _ in RECIPES.values():
        commands = [line.lstrip("# ").strip() for line in (CONFIGS / name).read_text().splitlines()
                    if re.match(r"#\s+hf download ", line)]
        assert len(commands) == 1, (name, commands)
        for option in re.findall(r"--[a-z-]+", commands[0]):
            assert option in usage, (name, option)


def test_check_without_nodes_says_how_to_plan_for_more_processes(paths, capsys, monkeypatch):
    """The 8B recipe's layout needs a node: planned for the default one process, the refusal says
    which flag gives the world size; with a world from the launcher's environment it does not."""
    for name in ("WORLD_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    name, nodes = RECIPES["8b"]
    assert main(["check", str(CONFIGS / name), *overrides(paths, "8b")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "world size (1 processes)" in err, err
    assert "pass --nodes N" in err and "--world-size N" in err, err
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["check", str(CONFIGS / name), *overrides(paths, "8b")]) == 2
    assert "pass --nodes" not in capsys.readouterr().err
    assert main(["check", str(CONFIGS / name), "--nodes", str(nodes), *overrides(paths, "8b")]) == 0


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this host has a CUDA GPU: train would start")
@pytest.mark.parametrize("rank, printed", [("0", True), ("1", False)])
def test_train_without_cuda_is_refused_once_per_launch(tmp_path, rank, printed):
    """Every rank of a launch on a machine without CUDA finds the same: one line from rank 0, exit 2,
    after the whole pre-flight and before anything is written to run.dir."""
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_NTASKS", "SLURM_PROCID", "LOCAL_RANK")}
    env.update(RANK=rank, WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", LOCAL_RANK=rank, MASTER_ADDR="127.0.0.1",
               MASTER_PORT="29999")
    run = subprocess.run([sys.executable, "-m", "megatron_jetrl.cli", "train", str(CONFIGS / "tiny_countdown.yaml"),
                          f"run.dir={tmp_path / 'run'}"], capture_output=True, text=True, cwd=ROOT, env=env)
    assert run.returncode == 2, run.stderr
    lines = [x for x in run.stderr.splitlines() if "config error" in x]
    assert lines == (["config error: jetrl train: got 'no CUDA GPU visible'; it needs one GPU per process "
                      "(jetrl check validates a job without one; jetrl train --smoke tests the launch on CPUs)"]
                     if printed else []), run.stderr
    assert not (tmp_path / "run").exists()
