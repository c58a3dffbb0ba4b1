"""hosts/offline/jit_cache.sh: DeepGEMM's JIT kernels packed on one GPU machine and unpacked on the next,
only where the same software compiled them (GPU, driver, torch, vLLM, nvcc), only when every part is
intact; run here with stand-ins for nvidia-smi and nvcc."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "hosts" / "offline" / "jit_cache.sh"


def _machine(tmp_path: Path, gpu: str = "NVIDIA H200, 580.159.04") -> dict:
    """An environment whose HOME, nvidia-smi and nvcc are the test's."""
    bin_dir = tmp_path / f"bin-{abs(hash(gpu))}"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\necho '{gpu}'\n")
    (bin_dir / "nvcc").write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("DG_JIT_CACHE_DIR", "VLLM_CACHE_ROOT")}
    return {**env, "HOME": str(home), "PATH": f"{bin_dir}:{env['PATH']}"}


def _sh(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=120)


def _cache(env: dict) -> Path:
    cache = Path(env["HOME"]) / ".cache" / "vllm" / "deep_gemm"
    for i in range(3):
        (cache / f"kernel.{i}").mkdir(parents=True)
        (cache / f"kernel.{i}" / "kernel.cubin").write_bytes(os.urandom(4096) + bytes([i]))
    return cache


def test_kernels_packed_on_one_machine_are_unpacked_on_the_next(tmp_path):
    env = _machine(tmp_path)
    cache = _cache(env)
    want = {p.relative_to(cache): p.read_bytes() for p in cache.rglob("*") if p.is_file()}
    out, carried = tmp_path / "out", tmp_path / "carried"
    packed = _sh(env, "pack", str(out))
    assert packed.returncode == 0 and "3 files" in packed.stdout, packed.stdout + packed.stderr
    assert sorted(p.name for p in out.iterdir()) == ["dg_jit.manifest", "dg_jit.tar.xz.00"]
    assert "NVIDIA H200, 580.159.04" in (out / "dg_jit.manifest").read_text()

    subprocess.run(["rm", "-rf", str(cache)], check=True)  # the next machine: no cache
    subprocess.run(["cp", "-r", str(out), str(carried)], check=True)
    unpacked = _sh(env, "unpack", str(carried))
    assert unpacked.returncode == 0 and "unpacked into" in unpacked.stdout, unpacked.stdout + unpacked.stderr
    assert {p.relative_to(cache): p.read_bytes() for p in cache.rglob("*") if p.is_file()} == want
    again = _sh(env, "unpack", str(carried))  # once per machine
    assert again.returncode == 0 and "already unpacked" in again.stdout


def test_kernels_of_other_software_are_left_unused(tmp_path):
    env = _machine(tmp_path)
    cache = _cache(env)
    assert _sh(env, "pack", str(tmp_path / "out")).returncode == 0
    subprocess.run(["rm", "-rf", str(cache)], check=True)
    other = _machine(tmp_path, gpu="NVIDIA H100 80GB HBM3, 570.86.15")
    done = _sh(other, "unpack", str(tmp_path / "out"))
    assert done.returncode == 0 and "compiled with other software, left unused" in done.stdout, done.stdout
    assert "H100" in done.stdout and not cache.exists() and not (tmp_path / "out" / ".unpacked").exists()


def test_a_damaged_part_unpacks_nothing(tmp_path):
    env = _machine(tmp_path)
    cache = _cache(env)
    out = tmp_path / "out"
    assert _sh(env, "pack", str(out)).returncode == 0
    subprocess.run(["rm", "-rf", str(cache)], check=True)
    part = out / "dg_jit.tar.xz.00"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 1
    part.write_bytes(bytes(data))
    done = _sh(env, "unpack", str(out))
    assert done.returncode == 1 and "does not match its checksum" in done.stdout
    assert not cache.exists()


@pytest.mark.parametrize("verb", ["pack", "unpack"])
def test_nothing_to_pack_or_unpack_is_one_line_and_no_files(tmp_path, verb):
    env = _machine(tmp_path)
    done = _sh(env, verb, str(tmp_path / "out"))
    assert done.returncode == 0 and done.stdout.startswith("jit_cache: no ") and len(done.stdout.splitlines()) == 1
    assert not (tmp_path / "out").exists()
