"""benchmarks/bench_rl_full.py without a GPU: the runs it would make (ABBA rounds, each mode's
overrides, the shared layout), and the bad arguments it refuses before anything starts."""

import shlex

import pytest

from benchmarks import bench_rl_full


def test_the_runs_alternate_over_the_rounds_with_each_modes_precision(capsys):
    assert bench_rl_full.main(["--dry-run", "--nproc", "4", "--rounds", "3", "--work", "/nowhere"]) == 0
    commands = [shlex.split(line) for line in capsys.readouterr().out.splitlines()]
    names = [next(a for a in c if a.startswith("run.dir=")).rsplit("/", 1)[1] for c in commands]
    assert names == ["fp8", "bf16", "bf16.r2", "fp8.r2", "fp8.r3", "bf16.r3"]
    for name, c in zip(names, commands, strict=True):
        assert c[:3] == ["torchrun", "--standalone", "--nproc-per-node=4"]
        assert "actor.parallel.tp=4" in c and "rollout.vllm.tensor_parallel_size=4" in c  # exact: equal TPs
        assert ("precision.exact=false" in c) == name.startswith("bf16")  # BF16 keeps its recompute
        assert "run.steps=5" in c and "rollout.sampling.ignore_eos=true" in c


@pytest.mark.parametrize("argv, message", [
    (["--nproc", "4", "--tp", "3"], "--tp 3 must divide --nproc 4"),
    (["--nproc", "4", "--rollout-tp", "8"], "--rollout-tp 8 must divide --nproc 4"),
    (["--nproc", "4", "--steps", "2"], "--steps 2: give a whole number >= 3"),
    (["--nproc", "4", "--rounds", "0"], "--rounds 0: give a whole number >= 1"),
])
def test_bad_arguments_are_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench_rl_full.main([*argv, "--dry-run"])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_work_directory_with_runs_in_it_is_refused(tmp_path, capsys):
    (tmp_path / "old").write_text("")
    with pytest.raises(SystemExit):
        bench_rl_full.main(["--nproc", "4", "--work", str(tmp_path)])
    assert "is not empty" in capsys.readouterr().err
