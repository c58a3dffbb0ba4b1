"""bench_sampler's table and argument checks (its timings need a GPU and vLLM: hosts/offline/vllm.sh --sampler)."""

import pytest

from benchmarks import bench_sampler as bench


def test_the_table_gives_host_and_wall_time_against_the_batched_noise():
    def row(variant, host, wall):
        return {"batch": 128, "variant": variant, "host_ms": host, "host_spread": [host - 0.01, host + 0.02],
                "wall_ms": wall, "wall_spread": [wall - 0.01, wall + 0.03], "input_copy_ms": 0.05, "calls": 50,
                "repeats": 5}

    lines = bench.table([row("vllm", 1.2, 1.25), row("batched", 0.1, 0.25)], "GPU X").splitlines()
    assert "GPU X" in lines[0] and "wall / batched" in lines[2]
    vllm, batched = lines[3:]
    assert "1.200" in vllm and "1.250" in vllm and "5.00x" in vllm and "1.240-1.280" in vllm
    assert "0.100" in batched and "1.00x" in batched


@pytest.mark.parametrize("argv, message", [(["--batches", "128,x"], "expected integers"),
                                           (["--batches", "0"], "must be >= 1"),
                                           (["--repeats", "2"], "--repeats >= 3")])
def test_bad_arguments_are_named_before_any_gpu_work(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_without_a_gpu_it_says_so(capsys, monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    assert bench.main(["--batches", "128"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
