"""The conversion tools on tiny random models of each family: HF -> Megatron -> HF is bit-exact, the FP8
export holds the quantizer's bytes, and bad input fails clearly without leaving output behind."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_jetrl.models import bridge_for
from megatron_jetrl.precision import quantize_fp8_blockwise
from tests.helpers import assert_same_bytes
from tests.model_fixtures import FAMILIES, load_tool, save_tiny_hf

to_megatron, to_hf = load_tool("convert_hf_to_megatron"), load_tool("convert_megatron_to_hf")


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        out.update(load_file(directory / shard))
    assert set(out) == set(index["weight_map"])
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def converted(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    save_tiny_hf(request.param, root / "hf")
    (root / "hf" / "tokenizer_config.json").write_text('{"model_max_length": 128}\n')
    assert to_megatron(["--hf-dir", str(root / "hf"), "--out-dir", str(root / "mg")]) == 0
    return request.param, root


def test_hf_to_megatron_to_hf_is_bit_exact(converted):
    arch, root = converted
    assert to_hf(["--ckpt-dir", str(root / "mg"), "--out-dir", str(root / "back"), "--max-shard-gb", "0.0005"]) == 0
    source, back = _weights(root / "hf"), _weights(root / "back")
    assert set(back) == set(source)
    for name, t in source.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    assert len(set(json.loads((root / "back" / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    config = json.loads((root / "back" / "config.json").read_text())
    assert config == json.loads((root / "hf" / "config.json").read_text())
    assert (root / "back" / "tokenizer_config.json").read_text() == '{"model_max_length": 128}\n'
    assert (root / "mg" / "hf" / "tokenizer_config.json").is_file()


def test_fp8_export_holds_the_quantizers_bytes(converted):
    arch, root = converted
    assert to_hf(["--ckpt-dir", str(root / "mg"), "--out-dir", str(root / "fp8"), "--fp8-block"]) == 0
    source, fp8 = _weights(root / "hf"), _weights(root / "fp8")
    config = json.loads((root / "fp8" / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    linear = [n for n in source if n.endswith("_proj.weight")]
    assert len(linear) == 7 * bridge_for(config).dims.num_layers
    for name, t in source.items():
        if name in linear:
            data, scale_inv = quantize_fp8_blockwise(t, (128, 128))
            assert_same_bytes(fp8[name], data, name)
            assert_same_bytes(fp8[name + "_scale_inv"], scale_inv, name + "_scale_inv")
            assert scale_inv.shape == (-(-t.shape[0] // 128), -(-t.shape[1] // 128))
        else:
            assert fp8[name].dtype == torch.bfloat16 and torch.equal(fp8[name], t), name
    assert set(fp8) == set(source) | {n + "_scale_inv" for n in linear}


def test_fp8_export_keeps_first_and_last_layers_bf16(converted):
    arch, root = converted
    out = root / "fp8-edges"
    args = ["--ckpt-dir", str(root / "mg"), "--out-dir", str(out), "--fp8-block", "--bf16-first-layers", "1"]
    assert to_hf(args) == 0
    weights = _weights(out)
    assert weights["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16
    assert weights["model.layers.1.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.mlp.down_proj" in config["ignored_layers"] == config["modules_to_not_convert"]


def test_existing_output_needs_force(converted, capsys):
    arch, root = converted
    marker = root / "mg" / "hf" / "config.json"
    before = marker.read_text()
    assert to_megatron(["--hf-dir", str(root / "hf"), "--out-dir", str(root / "mg")]) == 2
    assert "--force" in capsys.readouterr().err
    assert marker.read_text() == before


def _broken_copy(root: Path, tmp: Path, edit) -> Path:
    import shutil

    hf = tmp / "broken-hf"
    shutil.copytree(root / "hf", hf)
    edit(hf)
    return hf


def _assert_fails_cleanly(args, out: Path, capsys, message: str):
    assert to_megatron(args) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.tmp-*"))


def test_unknown_architecture(converted, tmp_path, capsys):
    arch, root = converted

    def edit(hf):
        config = json.loads((hf / "config.json").read_text())
        config["architectures"] = ["GPT2LMHeadModel"]
        (hf / "config.json").write_text(json.dumps(config))

    hf = _broken_copy(root, tmp_path, edit)
    _assert_fails_cleanly(["--hf-dir", str(hf), "--out-dir", str(tmp_path / "out")], tmp_path / "out", capsys,
                          "supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM")


def test_missing_tensor_is_named(converted, tmp_path, capsys):
    arch, root = converted
    missing = "model.layers.1.mlp.up_proj.weight"

    def edit(hf):
        index = json.loads((hf / "model.safetensors.index.json").read_text())
        del index["weight_map"][missing]
        (hf / "model.safetensors.index.json").write_text(json.dumps(index))

    hf = _broken_copy(root, tmp_path, edit)
    _assert_fails_cleanly(["--hf-dir", str(hf), "--out-dir", str(tmp_path / "out")], tmp_path / "out", capsys,
                          missing)


def test_misshaped_tensor_is_named(converted, tmp_path, capsys):
    arch, root = converted

    def edit(hf):
        config = json.loads((hf / "config.json").read_text())
        config["intermediate_size"] = 384
        (hf / "config.json").write_text(json.dumps(config))

    hf = _broken_copy(root, tmp_path, edit)
    _assert_fails_cleanly(["--hf-dir", str(hf), "--out-dir", str(tmp_path / "out")], tmp_path / "out", capsys,
                          "model.layers.0.mlp.gate_proj.weight has shape (512, 256)")


def test_fp8_export_of_unaligned_projections_says_which(tmp_path, capsys):
    hf = tmp_path / "hf"
    model = save_tiny_hf("Qwen2ForCausalLM", hf)
    config = json.loads((hf / "config.json").read_text())
    assert config["intermediate_size"] == model.config.intermediate_size
    config["intermediate_size"] = 320
    (hf / "config.json").write_text(json.dumps(config))
    weights = _weights(hf)
    for i in range(2):
        for p in ("gate", "up"):
            weights[f"model.layers.{i}.mlp.{p}_proj.weight"] = weights[f"model.layers.{i}.mlp.{p}_proj.weight"][:320]
        weights[f"model.layers.{i}.mlp.down_proj.weight"] = weights[f"model.layers.{i}.mlp.down_proj.weight"][:, :320]
    from safetensors.torch import save_file

    for f in hf.glob("model*.safetensors*"):
        f.unlink()
    save_file({k: v.contiguous() for k, v in weights.items()}, str(hf / "model.safetensors"))
    assert to_megatron(["--hf-dir", str(hf), "--out-dir", str(tmp_path / "mg")]) == 0
    assert to_hf(["--ckpt-dir", str(tmp_path / "mg"), "--out-dir", str(tmp_path / "fp8"), "--fp8-block"]) == 2
    err = capsys.readouterr().err
    assert "multiples of 128" in err and "mlp.gate_proj.weight [320, 256]" in err and "without --fp8-block" in err
    assert not (tmp_path / "fp8").exists()


def test_checkpoint_not_matching_its_config_fails_before_writing(converted, tmp_path, capsys):
    import shutil

    arch, root = converted
    ckpt = tmp_path / "mg"
    shutil.copytree(root / "mg", ckpt)
    config = json.loads((ckpt / "hf" / "config.json").read_text())
    config["intermediate_size"] = 384
    (ckpt / "hf" / "config.json").write_text(json.dumps(config))
    assert to_hf(["--ckpt-dir", str(ckpt), "--out-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "decoder.layers.mlp.linear_fc1.weight" in err and "has shape" in err, err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


# ---- bad files: one line naming the file and the problem, nothing written


def _first_shard(hf: Path) -> Path:
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    return hf / sorted(set(index["weight_map"].values()))[0]


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("fault", ["absurd header size", "header not json", "truncated shard", "broken config",
                                   "broken index"])
def test_a_broken_file_is_named_in_one_line(converted, tmp_path, capsys, fault):
    arch, root = converted

    def edit(hf):
        shard = _first_shard(hf)
        data = shard.read_bytes()
        if fault == "absurd header size":
            shard.write_bytes((2**63).to_bytes(8, "little") + data[8:])
        elif fault == "header not json":
            n = int.from_bytes(data[:8], "little")
            shard.write_bytes(data[:8] + b"\xff" * n + data[8 + n:])
        elif fault == "truncated shard":
            shard.write_bytes(data[: len(data) - 100])
        elif fault == "broken config":
            (hf / "config.json").write_text('{"architectures": [')
        else:
            (hf / "model.safetensors.index.json").write_text("[]")

    hf = _broken_copy(root, tmp_path, edit)
    out = tmp_path / "out"
    assert to_megatron(["--hf-dir", str(hf), "--out-dir", str(out)]) == 2
    err = _one_line(capsys)
    named = {"broken config": "config.json", "broken index": "model.safetensors.index.json"}.get(fault)
    assert str(hf / named) in err if named else _first_shard(hf).name in err, err
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


def test_a_killed_conversions_partial_output_is_removed_by_the_next_run(converted, tmp_path, capsys):
    import subprocess
    import sys

    arch, root = converted
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".out.tmp-{dead.pid}"  # what SIGKILL leaves: no cleanup ran
    stale.mkdir()
    (stale / "part.safetensors").write_bytes(b"x" * 1000)
    assert to_megatron(["--hf-dir", str(root / "hf"), "--out-dir", str(tmp_path / "out")]) == 0
    assert not stale.exists() and (tmp_path / "out").is_dir()
    assert "partial output of a conversion that was killed" in capsys.readouterr().err
    assert not list(tmp_path.glob(".out.*"))


@pytest.mark.parametrize("where", ["input", "parent of input", "working directory"])
def test_an_output_that_would_replace_the_input_is_refused(converted, tmp_path, capsys, monkeypatch, where):
    arch, root = converted
    hf = _broken_copy(root, tmp_path, lambda hf: None)
    before = sorted(p.name for p in hf.iterdir())
    out = {"input": hf, "parent of input": tmp_path, "working directory": Path(".")}[where]
    monkeypatch.chdir(tmp_path)
    assert to_megatron(["--hf-dir", str(hf), "--out-dir", str(out), "--force"]) == 2
    assert "--out-dir" in _one_line(capsys)
    assert sorted(p.name for p in hf.iterdir()) == before
    assert to_hf(["--ckpt-dir", str(root / "mg"), "--out-dir", str(root / "mg"), "--force"]) == 2
    assert "--out-dir" in _one_line(capsys) and (root / "mg" / "hf" / "config.json").is_file()


def test_export_arguments_are_checked_before_any_work(converted, tmp_path, capsys):
    arch, root = converted
    assert to_hf(["--ckpt-dir", str(tmp_path / "missing"), "--out-dir", str(tmp_path / "o")]) == 2
    assert "does not exist" in _one_line(capsys)
    for flag in (["--pow2-scales"], ["--bf16-first-layers", "1"], ["--bf16-last-layers", "2"]):
        assert to_hf(["--ckpt-dir", str(root / "mg"), "--out-dir", str(tmp_path / "o"), *flag]) == 2
        assert "--fp8-block" in _one_line(capsys)
    assert not (tmp_path / "o").exists()


def test_help_answers_without_importing_the_backends():
    import subprocess
    import sys

    for tool in ("convert_hf_to_megatron", "convert_megatron_to_hf"):
        code = ("import runpy, sys; sys.argv = ['x', '--help']\n"
                f"try:\n    runpy.run_path('tools/{tool}.py', run_name='__main__')\n"
                "except SystemExit:\n    pass\n"
                "assert not any(m.startswith(('megatron', 'torch')) for m in sys.modules), 'imported a backend'")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[2])
        assert proc.returncode == 0 and "usage" in proc.stdout and proc.stderr == "", proc.stderr
