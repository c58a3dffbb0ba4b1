"""bench_exact_kernels' table and argument checks (its timings need a GPU: hosts/offline/vllm.sh --kernels)."""

import pytest

from benchmarks import bench_exact_kernels as bench


def test_the_table_gives_each_variant_against_the_exact_kernel_and_its_bandwidth():
    def row(variant, us):
        return {"op": "add+rmsnorm+quant", "rows": 128, "variant": variant, "us": us, "spread": [us - 0.1, us + 0.2],
                "repeats": 5, "bytes": 4_000_000}

    text = bench.table([row("exact", 10.0), row("vllm_fused", 4.0), row("floor (copy)", 2.0)], "GPU X")
    lines = text.splitlines()
    assert "GPU X" in lines[0] and "x exact" in lines[1]
    exact, fused, floor = lines[2:]
    assert "10.00" in exact and "1.00x" in exact and " 400 " in exact  # 4 MB in 10 us: 400 GB/s
    assert "4.00" in fused and "0.40x" in fused and "3.90-4.20" in fused
    assert "0.20x" in floor


@pytest.mark.parametrize("argv, message", [(["--rows", "128,x"], "expected integers"),
                                           (["--rows", "0"], "must be >= 1"),
                                           (["--repeats", "2"], "--repeats >= 3")])
def test_bad_arguments_are_named_before_any_gpu_work(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_without_a_gpu_it_says_so(capsys, monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    assert bench.main(["--rows", "128"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
