"""Faults a newcomer hits with the conversion tools: a full disk, a source of the wrong dtype (FP8,
integers), a conversion killed under --force. Each ends in one line naming the thing and the fix,
exit status 2, and nothing half-written or hidden left next to the output."""

import errno
import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import megatron_jetrl.actor.hf_conversion as checkpoint
from megatron_jetrl.models.hf_checkpoint import StreamingSafetensorsWriter
from megatron_jetrl.precision import quantize_fp8_blockwise
from tests.model_fixtures import load_tool, save_tiny_hf

to_megatron, to_hf = load_tool("convert_hf_to_megatron"), load_tool("convert_megatron_to_hf")
ARCH = "Qwen3ForCausalLM"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny HF model and its megatron conversion."""
    root = tmp_path_factory.mktemp("faults")
    save_tiny_hf(ARCH, root / "hf")
    assert to_megatron(["--hf-dir", str(root / "hf"), "--out-dir", str(root / "mg")]) == 0
    return root


def _error_line(capsys) -> str:
    """The tool's last stderr line, checked to be its only error line and no traceback."""
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert lines and lines[-1].startswith("convert_") and ": error: " in lines[-1], err
    assert sum(": error: " in line for line in lines) == 1, err
    return lines[-1]


def _nothing_hidden(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.glob(f".{out.name}.*"))


def _tree(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ---- 1. disk full


def _disk_fills_after(n: int, code: int, real, hidden: bool):
    """``real`` (a writer), failing from its ``n``-th call on as a full disk does: an OSError with
    ``code``, or (``hidden``) torch.save's RuntimeError raised while handling it (what torch.save
    really raises when the file it streams to hits ENOSPC: a zip-position mismatch)."""
    calls = []

    def write(*args, **kwargs):
        calls.append(1)
        if len(calls) < n:
            return real(*args, **kwargs)
        if not hidden:
            raise OSError(code, "No space left on device")
        try:
            raise OSError(code, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None

    return write


@pytest.mark.parametrize("code, hidden", [(errno.ENOSPC, True), (errno.ENOSPC, False), (errno.EDQUOT, False)],
                         ids=["ENOSPC-in-torch.save", "ENOSPC", "EDQUOT"])
def test_disk_full_while_writing_megatron(source, tmp_path, capsys, monkeypatch, code, hidden):
    monkeypatch.setattr(torch, "save", _disk_fills_after(4, code, torch.save, hidden))
    out = tmp_path / "mg"
    assert to_megatron(["--hf-dir", str(source / "hf"), "--out-dir", str(out)]) == 2
    line = _error_line(capsys)
    what = "no space left on device" if code == errno.ENOSPC else "disk quota exceeded"
    assert f"convert_hf_to_megatron: error: {what} while writing {out} (" in line, line
    assert f"free at {tmp_path})" in line and line.endswith("or choose another --out-dir"), line
    assert not out.exists() and _nothing_hidden(out) == []


def test_disk_full_while_writing_hf_keeps_the_old_output(source, tmp_path, capsys, monkeypatch):
    out = tmp_path / "back"
    assert to_hf(["--ckpt-dir", str(source / "mg"), "--out-dir", str(out)]) == 0
    before = _tree(out)
    capsys.readouterr()
    monkeypatch.setattr(StreamingSafetensorsWriter, "add",
                        _disk_fills_after(5, errno.ENOSPC, StreamingSafetensorsWriter.add, hidden=False))
    open_when_measured, disk_usage = [], shutil.disk_usage

    def measure(path):  # a removed shard still open would keep the space it reports
        open_when_measured.extend(_open_files_under(tmp_path))
        return disk_usage(path)

    monkeypatch.setattr(shutil, "disk_usage", measure)
    args = ["--ckpt-dir", str(source / "mg"), "--out-dir", str(out), "--force", "--max-shard-gb", "0.0005"]
    assert to_hf(args) == 2
    line = _error_line(capsys)
    assert f"convert_megatron_to_hf: error: no space left on device while writing {out} (" in line, line
    assert "MiB written, now removed" in line and "free space or choose another --out-dir" in line, line
    assert _tree(out) == before and _nothing_hidden(out) == [] and open_when_measured == []


def _open_files_under(directory: Path) -> list[str]:
    fds = Path("/proc/self/fd")
    if not fds.is_dir():
        pytest.skip("needs /proc/self/fd")
    targets = []
    for fd in fds.iterdir():
        try:
            targets.append(str(fd.readlink()))
        except OSError:
            pass
    return [t for t in targets if t.startswith(str(directory))]


# ---- 2. source dtypes


def _rewritten_copy(source: Path, tmp_path: Path, edit) -> Path:
    """A copy of the tiny HF model as one model.safetensors, its tensors passed through ``edit``."""
    hf = tmp_path / "hf"
    shutil.copytree(source / "hf", hf)
    weights = {}
    for f in sorted(hf.glob("model*.safetensors")):
        weights.update(load_file(f))
    for f in hf.glob("model*.safetensors*"):
        f.unlink()
    edit(weights)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(hf / "model.safetensors"))
    return hf


def _to_int32(name):
    def edit(weights):
        weights[name] = (weights[name].float() * 1000).to(torch.int32)
    return edit


def _to_fp8(keep_scales: bool):
    def edit(weights):
        for name in [n for n in weights if n.endswith("_proj.weight")]:
            weights[name], scale_inv = quantize_fp8_blockwise(weights[name], (128, 128))
            if keep_scales:
                weights[name + "_scale_inv"] = scale_inv
    return edit


def _k_proj_fp32(weights):
    weights["model.layers.1.self_attn.k_proj.weight"] = weights["model.layers.1.self_attn.k_proj.weight"].float()


@pytest.mark.parametrize("fault, edit, expected", [
    # fused, second source: was converted silently (torch.cat promoted the integers to bf16)
    ("int32 up_proj", _to_int32("model.layers.1.mlp.up_proj.weight"),
     ["HF tensor model.layers.1.mlp.up_proj.weight in ", "model.safetensors is int32",
      "needs a floating-point tensor there (bfloat16, float16 or float32)", "convert from the original BF16"]),
    # fused, first source: was a traceback (the planned chunk dtype int32, the produced one bf16)
    ("int32 gate_proj", _to_int32("model.layers.0.mlp.gate_proj.weight"),
     ["HF tensor model.layers.0.mlp.gate_proj.weight in ", "is int32"]),
    # copied as is: was written into the megatron checkpoint as int32
    ("int32 norm", _to_int32("model.norm.weight"), ["HF tensor model.norm.weight in ", "is int32"]),
    ("fp8 without scales", _to_fp8(keep_scales=False),
     ["HF tensor model.layers.0.self_attn.q_proj.weight is float8_e4m3fn and its "
      "model.layers.0.self_attn.q_proj.weight_scale_inv is missing", "is an FP8 checkpoint without its scales",
      "not supported", "convert from the BF16 checkpoint"]),
    ("fp8 with scales", _to_fp8(keep_scales=True),
     ["HF tensor model.layers.0.self_attn.q_proj.weight is float8_e4m3fn", "is an FP8 checkpoint (with block scales "
      "model.layers.0.self_attn.q_proj.weight_scale_inv)", "not supported", "convert from the BF16 checkpoint"]),
    ("mixed dtypes", _k_proj_fp32,
     ["fused into decoder.layers.1.self_attention.linear_qkv.weight differ in dtype",
      "model.layers.1.self_attn.k_proj.weight float32", "model.layers.1.self_attn.q_proj.weight bfloat16"]),
])
def test_a_source_of_the_wrong_dtype_is_named(source, tmp_path, capsys, fault, edit, expected):
    hf = _rewritten_copy(source, tmp_path, edit)
    out = tmp_path / "mg"
    assert to_megatron(["--hf-dir", str(hf), "--out-dir", str(out)]) == 2
    line = _error_line(capsys)
    for part in expected:
        assert part in line, line
    assert not out.exists() and _nothing_hidden(out) == []


def test_a_megatron_checkpoint_of_the_wrong_dtype_is_named(source, tmp_path, capsys, monkeypatch):
    hf = _rewritten_copy(source, tmp_path, _to_int32("model.norm.weight"))
    with monkeypatch.context() as m:  # what an older converter wrote from such a source
        m.setattr(checkpoint, "check_hf_sources", lambda bridge, hf: None)
        assert to_megatron(["--hf-dir", str(hf), "--out-dir", str(tmp_path / "mg")]) == 0
    capsys.readouterr()
    out = tmp_path / "back"
    assert to_hf(["--ckpt-dir", str(tmp_path / "mg"), "--out-dir", str(out)]) == 2
    line = _error_line(capsys)
    assert "stores 'decoder.final_layernorm.weight' as int32" in line and "bfloat16, float16 or float32" in line
    assert not out.exists() and _nothing_hidden(out) == []


# ---- 3. a conversion killed under --force, then run again


def _owned(directory: Path, pid: int, host: str | None = None, files: dict[str, bytes] | None = None) -> Path:
    directory.mkdir()
    (directory / ".owner").write_text(f"{host or socket.gethostname()} {pid}\n")
    for name, data in (files or {"part.distcp": b"x" * 1000}).items():
        (directory / name).write_bytes(data)
    return directory


@pytest.fixture
def existing(source, tmp_path):
    """A complete output, as a first conversion left it."""
    out = tmp_path / "mg"
    shutil.copytree(source / "mg", out)
    return out


def test_killed_while_writing_then_run_without_force(source, existing, capsys):
    """Killed while writing the new output: the old one is complete, the partial one is removed
    (it was left behind silently by the refusal) and the refusal is right."""
    before, pid = _tree(existing), _dead_pid()
    stale = _owned(existing.parent / f".mg.tmp-{pid}", pid)
    assert to_megatron(["--hf-dir", str(source / "hf"), "--out-dir", str(existing)]) == 2
    err = capsys.readouterr().err
    assert f"removed {stale}, the partial output of a conversion that was killed (pid {pid})" in err, err
    assert err.strip().splitlines()[-1] == (f"convert_hf_to_megatron: error: output {existing} already exists; "
                                            "pass --force to replace it")
    assert _tree(existing) == before and _nothing_hidden(existing) == []


@pytest.mark.parametrize("new_output", ["complete", "partial"])
def test_killed_between_the_two_renames_restores_the_previous_output(source, existing, capsys, new_output):
    """Killed mid-swap: ``out`` was moved to ``.mg.old-PID`` and the new output not yet moved in.
    The previous output is put back (the killed run never took effect), then refused as existing."""
    before, pid = _tree(existing), _dead_pid()
    old = existing.parent / f".mg.old-{pid}"
    existing.rename(old)
    tmp = existing.parent / f".mg.tmp-{pid}"
    if new_output == "complete":  # its owner file goes just before the swap
        tmp.mkdir()
        (tmp / "common.pt").write_bytes(b"new")
    else:
        _owned(tmp, pid)
    assert to_megatron(["--hf-dir", str(source / "hf"), "--out-dir", str(existing)]) == 2
    err = capsys.readouterr().err
    assert f"restored {existing} from {old}: a conversion replacing it (pid {pid}) was killed" in err, err
    assert err.strip().splitlines()[-1].endswith("already exists; pass --force to replace it"), err
    assert _tree(existing) == before and _nothing_hidden(existing) == []


def test_killed_while_deleting_the_replaced_output(source, existing, capsys):
    """Killed after the swap: the new output stands; the previous one, half deleted, is removed."""
    pid = _dead_pid()
    (existing.parent / f".mg.tmp-{pid}").mkdir()  # the replaced output, renamed so before deletion
    assert to_megatron(["--hf-dir", str(source / "hf"), "--out-dir", str(existing), "--force"]) == 0
    assert "partial output of a conversion that was killed" in capsys.readouterr().err
    assert _nothing_hidden(existing) == [] and (existing / "hf" / "config.json").is_file()


def test_an_old_directory_beside_a_complete_output_is_removed(source, existing, capsys):
    pid = _dead_pid()
    old = existing.parent / f".mg.old-{pid}"
    shutil.copytree(existing, old)
    before = _tree(existing)
    assert to_megatron(["--hf-dir", str(source / "hf"), "--out-dir", str(existing)]) == 2
    err = capsys.readouterr().err
    assert f"removed {old}, the previous output" in err and "pass --force" in err, err
    assert _tree(existing) == before and _nothing_hidden(existing) == []


def test_another_hosts_directory_is_named_with_the_command_to_remove_it(source, existing, capsys):
    stale = _owned(existing.parent / ".mg.tmp-4242", 4242, host="some-other-host")
    assert to_megatron(["--hf-dir", str(source / "hf"), "--out-dir", str(existing)]) == 2
    err = capsys.readouterr().err
    assert f"note: left {stale} alone: it was written by process 4242 on host some-other-host" in err, err
    assert f"rm -rf {stale}" in err and err.strip().splitlines()[-1].endswith("pass --force to replace it"), err
    assert stale.is_dir()


def test_force_replaces_only_once_the_new_output_is_complete(source, existing, monkeypatch):
    """What a kill at any point of a --force run leaves: an ``.old-`` directory only while it holds
    the complete previous output, and only ``.tmp-`` directories (always disposable) otherwise."""
    import os

    before, seen = _tree(existing), []
    real_replace = os.replace

    def replace(src, dst):
        seen.append((Path(src).name, Path(dst).name))
        if Path(dst).name.startswith(".mg.old-"):
            assert _tree(Path(src)) == before
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    assert to_megatron(["--hf-dir", str(source / "hf"), "--out-dir", str(existing), "--force"]) == 0
    pid = os.getpid()
    assert seen == [("mg", f".mg.old-{pid}"), (f".mg.tmp-{pid}", "mg"), (f".mg.old-{pid}", f".mg.tmp-{pid}")]
    assert _nothing_hidden(existing) == [] and json.loads((existing / "metadata.json").read_text())


def test_an_output_that_appears_while_converting_is_not_replaced_without_force(source, tmp_path, capsys,
                                                                               monkeypatch):
    out = tmp_path / "mg"

    def another_conversion_finishes_first(bridge, hf, tmp, progress=False):
        (tmp / "common.pt").write_bytes(b"ours")
        out.mkdir()
        (out / "common.pt").write_bytes(b"theirs")

    monkeypatch.setattr(checkpoint, "save_hf_as_megatron", another_conversion_finishes_first)
    assert to_megatron(["--hf-dir", str(source / "hf"), "--out-dir", str(out)]) == 2
    line = _error_line(capsys)
    assert "appeared while converting" in line and line.endswith("pass --force to replace it"), line
    assert _tree(out) == {"common.pt": b"theirs"} and _nothing_hidden(out) == []
