"""Faults a newcomer hits with the conversion tools: a full disk, a source of the wrong dtype (FP8,
integers), a conversion killed under --force, an --out-dir that cannot be written, a damaged megatron
checkpoint, export numbers out of range. Each ends in one line naming the thing and the fix, exit
status 2, and nothing half-written, hidden or newly created left next to the output."""

import errno
import json
import os
import re
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
    assert re.search(r"\d+(\.\d)? [KMG]iB written, now removed", line), line
    assert "free space or choose another --out-dir" in line, line
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


# ---- 4. an --out-dir that cannot be written


@pytest.mark.parametrize("kind", ["file", "symlink"])
def test_an_out_dir_that_is_a_file_or_a_symlink_is_refused_even_with_force(source, tmp_path, capsys, kind):
    """Was swapped in, then its deletion failed (rmtree of a file or a symlink), leaving ``.f.tmp-PID``."""
    out, target = tmp_path / "f", tmp_path / "target"
    target.mkdir()
    if kind == "file":
        out.write_text("x\n")
    else:
        out.symlink_to(target)
    assert to_megatron(["--hf-dir", str(source / "hf"), "--out-dir", str(out), "--force"]) == 2
    line = _error_line(capsys)
    assert f"--out-dir {out} " in line and ("not a directory" if kind == "file" else "symbolic link") in line, line
    assert out.is_symlink() if kind == "symlink" else out.read_text() == "x\n"
    assert _nothing_hidden(out) == [] and list(target.iterdir()) == []


@pytest.mark.parametrize("below", ["f/x", "f/a/b/x"])
def test_an_out_dir_below_a_file_is_named(source, tmp_path, capsys, below):
    """Were "[Errno 17] File exists: 'f'" and a NotADirectoryError traceback."""
    (tmp_path / "f").write_text("x\n")
    out = tmp_path / below
    assert to_megatron(["--hf-dir", str(source / "hf"), "--out-dir", str(out)]) == 2
    line = _error_line(capsys)
    assert f"--out-dir {out}: {tmp_path / 'f'} is a file, not a directory" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_an_unwritable_out_dir_is_refused_before_any_work(source, tmp_path, capsys, monkeypatch):
    """As a read-only mount answers (tests run as root, whom permissions do not stop)."""
    ro, access = tmp_path / "ro", os.access
    ro.mkdir()
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != ro and access(path, mode, **kw))
    monkeypatch.setattr(checkpoint, "save_hf_as_megatron", lambda *a, **kw: pytest.fail("converted anyway"))
    out = ro / "a" / "out"
    assert to_megatron(["--hf-dir", str(source / "hf"), "--out-dir", str(out)]) == 2
    line = _error_line(capsys)
    assert f"--out-dir {out}: {ro} is not writable" in line and "name a directory you can write to" in line, line
    assert list(ro.iterdir()) == []


def test_an_out_dir_that_cannot_be_created_is_named_and_its_new_parents_removed(source, tmp_path, capsys,
                                                                               monkeypatch):
    """As /sys answers root (EPERM where os.access says yes): was a PermissionError traceback."""
    mkdir = Path.mkdir

    def refuse_below_a(path, *args, **kwargs):
        if path.parent.name == "a":
            raise PermissionError(errno.EPERM, "Operation not permitted", str(path))
        mkdir(path, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", refuse_below_a)
    out = tmp_path / "deep" / "a" / "b" / "out"
    assert to_megatron(["--hf-dir", str(source / "hf"), "--out-dir", str(out)]) == 2
    line = _error_line(capsys)
    assert f"--out-dir {out}: cannot create {out.parent} (Operation not permitted)" in line, line
    assert list(tmp_path.iterdir()) == []


def test_a_failed_conversion_removes_only_the_parents_it_created(source, tmp_path, capsys):
    """Were left behind: deep/a/b/c after a failure writing deep/a/b/c/out."""
    hf = _rewritten_copy(source, tmp_path, _to_int32("model.norm.weight"))
    deep = tmp_path / "deep"
    deep.mkdir()
    (deep / "keep").write_text("mine\n")
    out = deep / "a" / "b" / "c" / "out"
    assert to_megatron(["--hf-dir", str(hf), "--out-dir", str(out)]) == 2
    assert "is int32" in _error_line(capsys)
    assert sorted(p.name for p in deep.iterdir()) == ["keep"]


# ---- 5. a damaged megatron checkpoint


def _zero_first_tensor_bytes(mg: Path) -> None:
    """Overwrite the start of one stored tensor (its torch.save zip header) with zeros."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(mg)).read_metadata()
    info = next(info for index, info in meta.storage_data.items() if index.fqn == "decoder.final_layernorm.weight")
    with open(mg / info.relative_path, "r+b") as f:
        f.seek(info.offset)
        f.write(bytes(64))


@pytest.mark.parametrize("fault, damage, named, expected", [
    ("no .metadata", lambda mg: (mg / ".metadata").unlink(), ".metadata", "is missing"),
    ("truncated .metadata", lambda mg: _truncate(mg / ".metadata", 100), ".metadata", "cannot be read"),
    ("no data file", lambda mg: (mg / "__0_0.distcp").unlink(), "__0_0.distcp", "is missing (listed in"),
    ("empty data file", lambda mg: _truncate(mg / "__0_0.distcp", 0), "__0_0.distcp", "is truncated (0 bytes"),
    ("truncated data file", lambda mg: _truncate(mg / "__0_0.distcp", 5000), "__0_0.distcp", "is truncated"),
    ("damaged tensor", _zero_first_tensor_bytes, "__0_0.distcp", "reading "),
    ("config.json a list", lambda mg: (mg / "hf" / "config.json").write_text("[1]"), "hf/config.json",
     "expected a JSON object, found list"),
    ("config.json not JSON", lambda mg: (mg / "hf" / "config.json").write_text('{"architectures": ['),
     "hf/config.json", "not valid JSON"),
])
def test_a_damaged_megatron_checkpoint_is_named_in_one_line(source, tmp_path, capsys, fault, damage, named,
                                                           expected):
    """Were tracebacks (FileNotFoundError, UnpicklingError, EOFError, AttributeError) or, for invalid
    JSON, a message without the file."""
    mg = tmp_path / "mg"
    shutil.copytree(source / "mg", mg)
    damage(mg)
    out = tmp_path / "back"
    assert to_hf(["--ckpt-dir", str(mg), "--out-dir", str(out)]) == 2
    line = _error_line(capsys)
    assert str(mg / named) in line and expected in line, line
    if not named.startswith("hf/"):
        assert line.endswith("damaged or incomplete: save it again, or convert another step's checkpoint"), line
    assert not out.exists() and _nothing_hidden(out) == []


def _truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


# ---- 6. export numbers out of range


@pytest.mark.parametrize("args, flag", [
    (["--max-shard-gb", "inf"], "--max-shard-gb"),  # was an OverflowError traceback
    (["--max-shard-gb", "nan"], "--max-shard-gb"),  # was "cannot convert float NaN to integer"
    (["--max-shard-gb", "0"], "--max-shard-gb"),
    (["--max-shard-gb", "1e-12"], "--max-shard-gb"),  # under one byte
    (["--fp8-block", "--bf16-first-layers", "-1"], "--bf16-first-layers -1"),  # was precision.fp8.bf16_first_layers
    (["--fp8-block", "--bf16-last-layers", "-1"], "--bf16-last-layers -1"),
    (["--fp8-block", "--bf16-first-layers", "2", "--bf16-last-layers", "1"], "--bf16-last-layers 1"),  # 2 layers
])
def test_export_numbers_out_of_range_name_the_flag(source, tmp_path, capsys, args, flag):
    out = tmp_path / "back"
    assert to_hf(["--ckpt-dir", str(source / "mg"), "--out-dir", str(out), *args]) == 2
    line = _error_line(capsys)
    assert flag in line and "precision." not in line, line
    assert not out.exists() and _nothing_hidden(out) == []
