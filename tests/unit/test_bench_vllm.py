"""The vLLM benchmark's plumbing (benchmarks/bench_vllm.py, headline.py) on CPU: the headline file
is written by the script, atomically, one object per key; the table computes its ratios from the
children's JSON; the RL-step runs it starts are valid jobs. The numbers here are made up for the
arithmetic; the real ones come from the GPU host (docs/benchmarks.md)."""

import json
import os
import statistics
from pathlib import Path

import pytest

from benchmarks import bench_vllm
from benchmarks.headline import BEGIN, END, KEYS, Figure, command_line, merge, update, with_table
from benchmarks.headline import table as headline_table

ROOT = Path(__file__).resolve().parents[2]


def test_headline_update_keeps_other_keys_and_refuses_non_numbers(tmp_path):
    path = tmp_path / "results" / "headline.json"
    update(path, {"linear_fp8_over_bf16": Figure.of([1.23456, 1.2, 1.3])}, device="GPU X", command="cmd a")
    data = update(path, {"vllm_sync_8b_s": Figure.of([2])}, device="GPU Y", command="cmd b")
    a, b = data["linear_fp8_over_bf16"], data["vllm_sync_8b_s"]
    assert a["value"] == 1.2346 and a["device"] == "GPU X" and b["command"] == "cmd b"
    assert a["repeats"] == 3 and a["spread"] == [1.2, 1.3] and b["repeats"] == 1 and b["spread"] == [2, 2]
    assert set(a) == {"value", "repeats", "runs", "spread", "baseline", "device", "command", "date"}
    assert a["runs"] == 1 and a["baseline"] == ""
    assert json.loads(path.read_text()) == data
    with pytest.raises(ValueError, match="vllm_k3_fp8_8b6"):
        update(path, {"vllm_k3_fp8_8b6": Figure.of([float("nan")])}, device="GPU", command="x")
    with pytest.raises(ValueError, match="not a Figure"):  # a bare number has no repeats
        update(path, {"vllm_k3_fp8_8b6": 0.1}, device="GPU", command="x")
    assert "vllm_k3_fp8_8b6" not in json.loads(path.read_text())
    with pytest.raises(ValueError, match="KEYS"):  # a key nobody described cannot be written
        update(path, {"made_up": Figure.of([1.0])}, device="GPU", command="x")
    assert sorted(p.name for p in path.parent.iterdir()) == ["headline.json"]  # no temporary left
    k3 = update(path, {"vllm_k3_fp8_8b6": Figure.of([2.345678e-7])}, device="GPU", command="x")["vllm_k3_fp8_8b6"]
    assert k3["value"] == 2.3457e-7  # not 0.0
    retired = {**json.loads(path.read_text()), "vllm_decode_fp8_over_bf16": a}  # a key KEYS no longer lists
    path.write_text(json.dumps(retired))
    update(path, {"vllm_sync_8b_s": Figure.of([1.0])}, device="GPU", command="x")
    assert set(json.loads(path.read_text())) == {"linear_fp8_over_bf16", "vllm_sync_8b_s", "vllm_k3_fp8_8b6"}


def test_merge_copies_a_runs_entries_and_refuses_hand_made_ones(tmp_path):
    main, run = tmp_path / "headline.json", tmp_path / "run.json"
    update(main, {"vllm_sync_8b_s": Figure.of([0.4])}, device="GPU X", command="a")
    written = update(run, {"rl_step_8b_full_fp8_over_bf16": Figure.of([1.2, 1.1, 1.3])}, device="4 × GPU Y",
                     command="TP=4 bash x.sh")
    assert merge(main, [run]) == ["rl_step_8b_full_fp8_over_bf16"]
    data = json.loads(main.read_text())
    assert data["rl_step_8b_full_fp8_over_bf16"] == written["rl_step_8b_full_fp8_over_bf16"]
    assert data["vllm_sync_8b_s"]["command"] == "a"
    before = main.read_text()
    hand = tmp_path / "hand.json"
    hand.write_text(json.dumps({"vllm_sync_8b_s": {"value": 0.1, "device": "GPU"}}))
    with pytest.raises(ValueError, match="lacks repeats, spread, command, date"):
        merge(main, [run, hand])
    hand.write_text(json.dumps({"made_up": written["rl_step_8b_full_fp8_over_bf16"]}))
    with pytest.raises(ValueError, match="made_up is not in"):
        merge(main, [hand])
    assert main.read_text() == before  # nothing written when any source is refused


def test_scale_headline_figures_need_the_same_work():
    from benchmarks.scale_summary import headline_figures

    def run(name, step_s, tok_s, tokens):
        return {"run": name, "seconds_per_step": {"step": step_s}, "tokens_per_s_per_gpu_per_step": tok_s,
                "tokens_per_timed_step": tokens}

    fp8 = run("fp8", [10.0, 11.0, 9.0], [3000.0, 2800.0, 3100.0], [70000] * 3)
    bf16 = run("bf16", [13.0, 13.2, 12.6], [2300.0, 2250.0, 2400.0], [70000] * 3)
    figs = headline_figures({"fp8": fp8, "bf16": bf16}, "rl_step_8b_full")
    want = Figure.ratio([13.0, 13.2, 12.6], [10.0, 11.0, 9.0])
    got = figs["rl_step_8b_full_fp8_over_bf16"]
    assert (got.value, got.repeats, got.spread) == (want.value, want.repeats, want.spread)
    assert got.runs == 2 and got.baseline.startswith("the BF16 run of the same round and layout (1 round")
    tok = figs["rl_step_8b_full_tokens_per_s_per_gpu"]
    assert (tok.value, tok.repeats, tok.spread, tok.runs) == (3000.0, 3, (2800.0, 3100.0), 1)
    assert set(figs) <= set(KEYS)
    with pytest.raises(ValueError, match="same tokens"):
        headline_figures({"fp8": fp8, "bf16": {**bf16, "tokens_per_timed_step": [69000] * 3}}, "rl_step_8b_full")
    with pytest.raises(ValueError, match="fp8 and bf16"):
        headline_figures({"fp8": fp8}, "rl_step_8b_full")


def test_scale_headline_figures_pool_rounds_and_pair_steps_within_each():
    from benchmarks.scale_summary import headline_figures, rounds

    def run(step_s, tokens=70000):
        return {"seconds_per_step": {"step": step_s}, "tokens_per_s_per_gpu_per_step": [tokens / s for s in step_s],
                "tokens_per_timed_step": [tokens] * len(step_s)}

    runs = {"fp8": run([10.0, 11.0]), "bf16": run([13.0, 13.2]), "bf16.r2": run([13.4, 12.8]),
            "fp8.r2": run([13.0, 12.0]), "preempt": run([9.0])}
    assert rounds(runs) == ["", ".r2"] and rounds({**runs, "fp8.r10": {}, "fp8.old": {}}) == ["", ".r2", ".r10"]
    figs = headline_figures(runs, "rl_step_8b_full")
    # median over median of both rounds; the spread pairs fp8 with bf16 of the same round and step,
    # so the slow second FP8 run pulls the low end below 1
    fig = figs["rl_step_8b_full_fp8_over_bf16"]
    assert (fig.value, fig.repeats, fig.spread) == (
        statistics.median([13.0, 13.2, 13.4, 12.8]) / statistics.median([10.0, 11.0, 13.0, 12.0]), 4,
        (13.4 / 13.0, 13.0 / 10.0))
    assert fig.runs == 4 and "2 rounds" in fig.baseline  # two runs a round: run-to-run variation is in the spread
    tok = figs["rl_step_8b_full_tokens_per_s_per_gpu"]
    assert tok.repeats == 4 and tok.runs == 2
    with pytest.raises(ValueError, match="round r2 has fp8.r2 alone"):
        headline_figures({k: v for k, v in runs.items() if k != "bf16.r2"}, "rl_step_8b_full")
    with pytest.raises(ValueError, match="fp8.r2 and bf16.r2 did not process the same tokens"):
        headline_figures({**runs, "bf16.r2": run([13.4, 12.8], tokens=69000)}, "rl_step_8b_full")


def test_figures_are_medians_with_their_spread():
    assert Figure.of([3.0, 1.0, 2.0]) == Figure(2.0, 3, (1.0, 3.0))
    paired = Figure.ratio([10.0, 12.0, 11.0], [5.0, 4.0, 5.5])  # the same work, repeat by repeat
    assert paired.value == 11.0 / 5.0 and paired.repeats == 3 and paired.spread == (2.0, 3.0)
    unpaired = Figure.ratio([10.0, 12.0], [5.0, 4.0, 6.0])
    assert unpaired.repeats == 2 and unpaired.spread == (10.0 / 6.0, 12.0 / 4.0)
    with pytest.raises(ValueError):
        Figure.of([])
    want = "python -m benchmarks.x step --step-args '--a 1'"
    assert command_line("benchmarks.x", ["step", "--step-args", "--a 1"], environ={}) == want
    under_torchrun = {"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2", "NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"}
    assert command_line("benchmarks.x", ["--modes", "fp8-te"], environ=under_torchrun) == (
        "NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 torchrun --nproc-per-node 2 -m benchmarks.x --modes fp8-te")


def test_every_headline_key_is_described_and_the_table_renders():
    data = json.loads((ROOT / "docs" / "results" / "headline.json").read_text())
    assert set(data) <= set(KEYS), sorted(set(data) - set(KEYS))
    text = headline_table(data)
    assert all(f"`{k}`" in text for k in data) and "(not described" not in text
    doc = f"intro\n{BEGIN}\nstale\n{END}\noutro\n"
    assert with_table(doc, data) == f"intro\n{BEGIN}\n{text}\n{END}\noutro\n"
    with pytest.raises(ValueError, match="markers"):
        with_table("no markers", data)


def _decode(mode, tok_s):
    cases = {c: {"batch": int(c.split("x")[0]), "tokens": int(c.split("x")[1]), "wall_s": 1.0, "tok_s": v}
             for c, v in tok_s.items()}
    return {"mode": mode, "fp8_gemm": "cutlass", "engine_start_s": 90.0, "kv_cache_tokens": 1000, "used_gib": 60.0,
            "cases": cases, "device": "GPU X"}


def test_table_ratios_and_headline(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "decode_bf16.json").write_text(json.dumps(_decode("bf16", {"256x512": 1000.0, "256x4096": 500.0})))
    (work / "decode_fp8.json").write_text(json.dumps(_decode("fp8", {"256x512": 1100.0, "256x4096": 600.0})))
    (work / "decode_fp8kv.json").write_text(json.dumps(_decode("fp8kv", {"256x512": 1200.0, "256x4096": 800.0})))
    (work / "decode_fp8-deep_gemm.json").write_text(  # its own column and headline key
        json.dumps(_decode("fp8", {"256x512": 1150.0, "256x4096": 700.0})))
    (work / "sync_in_place.json").write_text(json.dumps(
        {"path": "in_place", "total_s": 0.2, "engine_gb": 10.0, "floor_s": 0.1, "in_place_tensors": 5,
         "tensors": 6, "device": "GPU X"}))
    (work / "sync_reload.json").write_text(json.dumps(
        {"path": "reload", "total_s": 0.8, "engine_gb": 10.0, "floor_s": 0.1, "in_place_tensors": 0,
         "tensors": 6, "device": "GPU X"}))
    (work / f"sync_{bench_vllm.sync_name('in_place', 2, 2)}.json").write_text(json.dumps(  # not the headline's
        {"path": "in_place", "train_tp": 2, "rollout_tp": 2, "total_s": 0.05, "engine_gb": 5.0, "floor_s": 0.05,
         "in_place_tensors": 5, "tensors": 6, "device": "GPU X"}))
    phases = {"generate": 2.0, "logprobs": 1.0, "update": 1.0, "sync": 0.1, "step": 4.0}
    profile = {"step": 5, "device": "GPU X", "phases": {"generate": {
        "wall_s": 2.5, "kernel_ms": 900.0, "classes_ms": {"gemm": 500.0, "attention": 400.0}, "top_kernels_ms": {},
        "host": {"sampled_s": 2.4, "gc_s": 0.25, "gc_collections": 7, "inclusive_s": {},
                 "self_s": {"engine/output_processor.py:process_outputs": 0.5, "gpu/model_runner.py:execute": 0.4}}},
        "update": {"wall_s": 1.2, "kernel_ms": 1000.0, "classes_ms": {"gemm": 700.0, "elementwise": 300.0},
                   "top_kernels_ms": {}, "top_ops_ms": {"aten::mm": 700.0, "aten::add_": 250.4}}}}

    def run(step_s: list[float], **more):
        per_step = {p: [v] * len(step_s) for p, v in phases.items()}
        return {"seconds": phases, "seconds_per_step": {**per_step, "step": step_s}, "tokens_per_s_per_gpu": 100.0,
                "tokens_per_timed_step": [4096.0, 4100.0, 4090.0], "device": "GPU X",
                "command": "python -m benchmarks.bench_vllm step", **more}

    (work / "step.json").write_text(json.dumps({
        "fp8": run([3.2, 3.0, 3.3], profile=profile, alloc_retries_per_step={"update": [0.0, 4.0, 2.0]}),
        "bf16": run([4.0, 4.0, 4.2], alloc_retries_per_step={"update": [0.0, 0.0, 0.0]},
                    update_split_per_step={"update_time_s": [1.0, 2.1, 1.0], "forward_backward_s": [0.9, 2.0, 0.9],
                                           "microbatch_gpu_ms_median": [40.0, 41.0, 40.0],
                                           "microbatch_gpu_ms_max": [45.0, 1100.0, 44.0]}),
        "fp8kv": run([2.5, 2.4, 2.6])}))
    headline = tmp_path / "headline.json"
    text = _table(work, headline)
    assert "fp8 allocation retries a timed step: update 0/4/2" in text and "bf16 allocation retries" not in text
    assert ("bf16 update a timed step: 1.00 s (0.90 forward+backward; micro-batch GPU ms median 40, max 45), "
            "2.10 s (2.00 forward+backward; micro-batch GPU ms median 41, max 1100)") in text
    assert "fp8 update a timed step" not in text
    assert "1.20x" in text and "1.60x" in text  # 256x4096: fp8 600/500, fp8kv 800/500
    assert "fp8-deep_gemm/bf16" in text and "1.40x" in text  # DeepGEMM 700/500
    data = json.loads(headline.read_text())
    got = {k: v["value"] for k, v in data.items()}
    assert got == {"vllm_decode_fp8_deep_gemm_over_bf16": 1.4, "vllm_sync_8b_s": 0.2,
                   "rl_step_vllm_fp8_over_bf16": 1.25, "rl_step_vllm_fp8kv_over_bf16": 1.6,
                   "rl_generate_fp8_over_bf16": 1.0}
    assert data["rl_step_vllm_fp8_over_bf16"]["spread"] == [1.25, 1.3333]  # paired step by step: 4/3.2 .. 4/3
    assert data["rl_step_vllm_fp8_over_bf16"]["repeats"] == 3
    assert data["rl_step_vllm_fp8_over_bf16"]["command"] == "python -m benchmarks.bench_vllm step"
    assert data["vllm_sync_8b_s"]["device"] == "GPU X"
    assert "cut off" not in text
    assert "in_place   2->2    0.0500" in text and "in_place   1->1    0.2000" in text
    assert "bf16/fp8kv" in text and "1.60x" in text.split("bf16/fp8kv")[1].splitlines()[0]
    assert "kernel time of step 5 (fp8, profiled)" in text and "kernels    900.0 ms: gemm 500, attention 400" in text
    assert "warm start s" not in text  # no result has one: no row
    assert ("host s by function (own time): engine/output_processor.py:process_outputs 0.50, "
            "gpu/model_runner.py:execute 0.40; GC 0.25 s in 7 collections") in text
    assert "kernel ms by torch operator (own kernels): aten::mm 700, aten::add_ 250" in text


def test_a_warm_start_is_a_row_and_the_headline_engine_start(tmp_path):
    """decode --warm-start: the table shows each mode's warm start beside its first one (— where a
    result has none), and vllm_engine_start_s is the FP8 mode's warm start, not its cold one."""
    (tmp_path / "decode_bf16.json").write_text(json.dumps(_decode("bf16", {"256x4096": 500.0})))
    (tmp_path / "decode_fp8.json").write_text(json.dumps(
        {**_decode("fp8", {"256x4096": 600.0}), "engine_start_warm_s": 41.0,
         "command": "python -m benchmarks.bench_vllm decode --modes bf16,fp8 --warm-start"}))
    headline = tmp_path / "headline.json"
    text = _table(tmp_path, headline)
    rows = {line[:12].strip(): line[12:].split() for line in text.splitlines() if "start s" in line}
    assert rows == {"start s": ["90", "90"], "warm start s": ["—", "41", "(1)"]}  # median (starts)
    start = json.loads(headline.read_text())["vllm_engine_start_s"]
    assert start["value"] == 41.0 and start["command"].endswith("--warm-start")



def test_a_first_start_from_carried_kernels_is_not_called_cold(tmp_path):
    """A decode result whose machine had DeepGEMM's kernels carried in (hosts/offline/jit_cache.sh,
    dg_jit_seeded) has its first start marked in the table as not cold; a result without the mark has
    no such line."""
    (tmp_path / "decode_bf16.json").write_text(json.dumps(_decode("bf16", {"256x4096": 500.0})))
    (tmp_path / "decode_fp8.json").write_text(json.dumps({**_decode("fp8", {"256x4096": 600.0}),
                                                          "dg_jit_seeded": True}))
    text = _table(tmp_path, tmp_path / "headline.json")
    assert "(start s of fp8: DeepGEMM's kernels carried from an earlier machine" in text and "bf16:" not in text
    (tmp_path / "decode_fp8.json").write_text(json.dumps(_decode("fp8", {"256x4096": 600.0})))
    assert "carried from an earlier machine" not in _table(tmp_path, tmp_path / "headline.json")

def test_warm_start_runs_a_start_only_child_after_each_mode(tmp_path, monkeypatch):
    """decode --warm-start: after a mode's measured child, --warm-start-repeats more children of that
    mode with --start-only; their starts go into the mode's result (engine_start_warm_s_all, their
    median as engine_start_warm_s; engine_start_s kept) and their own JSON is removed. A mode whose
    measured child wrote nothing gets no warm start; the headline figure has the repeats."""
    calls = []
    warm = iter([31.0, 29.0, 30.5])

    def fake_run_child(kind, args, extra, *, name=None, gpus=1, env_extra=None):
        calls.append((name, extra))
        if name == "bf16":
            return None
        start = next(warm) if "--start-only" in extra else 90.0
        result = {"mode": extra[0], "engine_start_s": start}
        (Path(args.work) / f"{kind}_{name}.json").write_text(json.dumps(result))
        return result

    monkeypatch.setattr(bench_vllm, "run_child", fake_run_child)
    bench_vllm.main(["decode", "--modes", "bf16,fp8", "--fp8-gemm", "deep_gemm", "--warm-start",
                     "--work", str(tmp_path)])
    assert [(n, e[:2]) for n, e in calls] == [("bf16", ["bf16", "--cases"]), ("fp8-deep_gemm", ["fp8", "--cases"]),
                                              *[("fp8-deep_gemm-start", ["fp8", "--start-only"])] * 3]
    result = json.loads((tmp_path / "decode_fp8-deep_gemm.json").read_text())
    assert result == {"mode": "fp8", "engine_start_s": 90.0, "engine_start_warm_s": 30.5,
                      "engine_start_warm_s_all": [31.0, 29.0, 30.5]}
    assert sorted(f.name for f in tmp_path.glob("*.json")) == ["decode_fp8-deep_gemm.json"]
    start, _ = bench_vllm.decode_headline({"fp8-deep_gemm": result}, "256x4096")["vllm_engine_start_s"]
    assert (start.value, start.repeats, start.spread) == (30.5, 3, (29.0, 31.0))


def test_cold_starts_run_with_empty_caches_and_are_the_cold_headline(tmp_path, monkeypatch):
    """decode --cold-start: --cold-start-repeats start-only children, each with vLLM's, DeepGEMM's,
    Inductor's and Triton's caches in a fresh directory of its own (removed after); their seconds are
    the mode's engine_start_cold_s_all and vllm_engine_start_cold_s their median; without them there is no
    cold figure (a run's first start may find caches an earlier run filled)."""
    seen, cold = [], iter([300.0, 280.0, 310.0])

    def fake_run_child(kind, args, extra, *, name=None, gpus=1, env_extra=None):
        if "--start-only" in extra:
            assert set(env_extra) == set(bench_vllm.COLD_CACHES)
            roots = {Path(v).parent for v in env_extra.values()}
            assert len(roots) == 1 and roots.pop().is_dir()
            seen.append(env_extra["VLLM_CACHE_ROOT"])
        result = {"mode": extra[0], "engine_start_s": next(cold) if "--start-only" in extra else 90.0}
        (Path(args.work) / f"{kind}_{name}.json").write_text(json.dumps(result))
        return result

    monkeypatch.setattr(bench_vllm, "run_child", fake_run_child)
    bench_vllm.main(["decode", "--modes", "fp8", "--fp8-gemm", "deep_gemm", "--cold-start", "--work", str(tmp_path)])
    assert len(set(seen)) == 3 and not any(Path(v).parent.exists() for v in seen)  # each fresh, all removed
    result = json.loads((tmp_path / "decode_fp8-deep_gemm.json").read_text())
    assert result["engine_start_cold_s_all"] == [300.0, 280.0, 310.0] and result["engine_start_s"] == 90.0
    start, _ = bench_vllm.decode_headline({"fp8-deep_gemm": result}, "256x4096")["vllm_engine_start_cold_s"]
    assert (start.value, start.repeats, start.spread) == (300.0, 3, (280.0, 310.0))
    (tmp_path / "decode_fp8-deep_gemm.json").write_text(json.dumps({**result, **_decode("fp8", {"8x64": 900.0})}))
    rows = {line[:12].strip(): line[12:].split() for line in _table(tmp_path, tmp_path / "h.json").splitlines()
            if "start s" in line}
    assert rows == {"start s": ["90"], "cold start s": ["300", "(3)"]}  # the table shows them too
    assert "vllm_engine_start_cold_s" not in bench_vllm.decode_headline(
        {"fp8-deep_gemm": {**result, "engine_start_cold_s_all": None}}, "256x4096")



@pytest.mark.parametrize("kind", ["warm", "cold"])
def test_starts_cut_off_keep_those_that_finished(tmp_path, monkeypatch, kind):
    """A run cut off during its third extra start (the machine taken back: the process dies) keeps
    the two starts that finished in the mode's result, and the headline figure counts two runs."""
    starts = iter([41.0, 39.0])

    def fake_run_child(kind_, args, extra, *, name=None, gpus=1, env_extra=None):
        if "--start-only" in extra:
            value = next(starts, None)
            if value is None:
                raise KeyboardInterrupt  # the lane killed mid-start
            result = {"mode": extra[0], "engine_start_s": value}
        else:
            result = {"mode": extra[0], "engine_start_s": 90.0}
        (Path(args.work) / f"{kind_}_{name}.json").write_text(json.dumps(result))
        return result

    monkeypatch.setattr(bench_vllm, "run_child", fake_run_child)
    with pytest.raises(KeyboardInterrupt):
        bench_vllm.main(["decode", "--modes", "fp8-exact", "--fp8-gemm", "deep_gemm", f"--{kind}-start",
                         "--work", str(tmp_path)])
    result = json.loads((tmp_path / "decode_fp8-exact-deep_gemm.json").read_text())
    assert result[f"engine_start_{kind}_s_all"] == [41.0, 39.0] and result["engine_start_s"] == 90.0
    assert not list(tmp_path.glob("cold-start-*"))  # a cold start's caches removed, cut off or not
    suffix = "_s" if kind == "warm" else "_cold_s"
    start, _ = bench_vllm.decode_headline({"fp8-exact-deep_gemm": result}, "256x4096")[
        "vllm_exact_engine_start" + suffix]
    assert (start.value, start.runs) == (40.0, 2)


def test_the_exact_engines_starts_are_headline_figures_of_their_own(tmp_path):
    """The exact engine (the rollout's default) has start keys of its own beside the default FP8
    engine's: warm and cold medians of its start-only children, each start a run (process) of its own;
    a mode without extra starts gives none, and the default's keys stay the default's."""
    exact = {"mode": "fp8-exact", "engine_start_s": 70.0, "engine_start_warm_s_all": [40.0, 38.0, 39.0],
             "engine_start_cold_s_all": [65.0, 61.0, 63.0]}
    figures = bench_vllm.decode_headline({"fp8-exact-deep_gemm": exact,
                                          "fp8-deep_gemm": {"mode": "fp8", "engine_start_s": 300.0}}, "256x4096")
    assert set(figures) == {"vllm_exact_engine_start_s", "vllm_exact_engine_start_cold_s"}
    warm, source = figures["vllm_exact_engine_start_s"]
    cold, _ = figures["vllm_exact_engine_start_cold_s"]
    assert source is exact
    assert (warm.value, warm.repeats, warm.runs, warm.spread) == (39.0, 3, 3, (38.0, 40.0))
    assert (cold.value, cold.repeats, cold.runs, cold.spread) == (63.0, 3, 3, (61.0, 65.0))

def test_step_ratios_are_no_headline_unless_every_mode_did_the_same_work(tmp_path):
    phases = {"generate": 2.0, "logprobs": 1.0, "update": 1.0, "sync": 0.1, "step": 4.0}
    runs = {mode: {"seconds": phases, "tokens_per_s_per_gpu": 1.0, "tokens_per_timed_step": tokens}
            for mode, tokens in (("fp8", [4096.0, 4000.0]), ("bf16", [4096.0, 4096.0]))}
    (tmp_path / "step.json").write_text(json.dumps(runs))
    headline = tmp_path / "headline.json"
    text = _table(tmp_path, headline)
    assert "did not generate the same tokens" in text and not headline.exists()


def test_the_generate_ratio_notes_its_own_phases_variance_and_only_that(tmp_path):
    """rl_generate_fp8_over_bf16 moves with the generate phase's step-to-step variance as much as the
    step ratio does: its entry names that phase (and no other) when it varied over the timed steps."""
    def run(generate, update):
        phases = {"generate": generate, "logprobs": [1.0] * 3, "update": update, "sync": [0.1] * 3,
                  "step": [g + 1.1 + u for g, u in zip(generate, update, strict=True)]}
        return {"seconds_per_step": phases, "tokens_per_timed_step": [4096.0] * 3,
                "config": {"layers": 16, "response_len": 2048}}

    runs = {"bf16": run([12.3, 12.8, 14.0], [10.9, 10.9, 13.9]), "fp8": run([19.3, 14.0, 23.3], [9.4] * 3)}
    (tmp_path / "step.json").write_text(json.dumps(runs))
    headline = tmp_path / "headline.json"
    _table(tmp_path, headline)
    entries = json.loads(headline.read_text())
    generate = entries["rl_generate_fp8_over_bf16"]["note"]
    assert generate.startswith("within the run, fp8 generate 14.00-23.30 s over the timed steps")
    assert "update" not in generate and "bf16 generate" not in generate  # bf16's generate varied 1.14x only
    assert "bf16 update 10.90-13.90 s" in entries["rl_step_vllm_fp8_over_bf16"]["note"]
    runs = {"bf16": run([12.3, 12.8, 12.6], [10.9] * 3), "fp8": run([11.0, 11.2, 11.1], [9.4] * 3)}
    (tmp_path / "step.json").write_text(json.dumps(runs))
    headline.unlink()
    _table(tmp_path, headline)
    assert "note" not in json.loads(headline.read_text())["rl_generate_fp8_over_bf16"]  # steady: no note


def test_step_modes_with_te_attention_are_compared_with_bf16_with_te_attention(tmp_path):
    """The -ta step modes (the trainer attending with TE's cuDNN kernels) get their ratio against
    bf16-ta where it ran, so both sides attend alike; bf16-ta itself against bf16. Table only: the
    headline keys stay fp8's and fp8kv's against bf16."""
    def run(step_s):
        phases = {"generate": [2.0] * 3, "logprobs": [1.0] * 3, "update": [1.0] * 3, "sync": [0.1] * 3,
                  "step": [step_s] * 3}
        return {"seconds_per_step": phases, "tokens_per_timed_step": [4096.0] * 3}

    assert bench_vllm.step_baseline("fp8-ta", {"bf16", "bf16-ta"}) == "bf16-ta"
    assert bench_vllm.step_baseline("fp8-ta", {"bf16"}) == "bf16"
    assert bench_vllm.step_baseline("bf16-ta", {"bf16", "bf16-ta"}) == "bf16"
    runs = {"bf16": run(4.0), "fp8": run(3.5), "bf16-ta": run(3.8), "fp8-ta": run(3.2)}
    (tmp_path / "step.json").write_text(json.dumps(runs))
    headline = tmp_path / "headline.json"
    text = _table(tmp_path, headline)
    rows = {w[0]: w for w in (line.split() for line in text.splitlines()) if w and "/" in w[0]}
    assert rows["bf16/fp8"][5] == "1.14x" and rows["bf16-ta/fp8-ta"][5] == "1.19x"
    assert rows["bf16/bf16-ta"][5] == "1.05x" and "bf16/fp8-ta" not in rows
    entries = json.loads(headline.read_text())
    assert set(entries) == {"rl_step_vllm_fp8_over_bf16", "rl_generate_fp8_over_bf16"}
    # these runs are of 6 layers (no config recorded: the old default), the targets of 16: each entry says so
    assert {e["note"] for e in entries.values()} == {"measured at 6 decoder layers; the target is stated for 16"}
    assert bench_vllm.step_layers_note(16) == ""


def test_a_note_is_kept_by_merge_and_printed_after_what_the_key_measures(tmp_path):
    from benchmarks.headline import Figure, merge, update

    run = tmp_path / "run.json"
    update(run, {"linear_fp8_over_bf16": Figure.of([1.2, 1.3, 1.25]).noted("on CUTLASS | not the default")},
           device="GPU X", command="python -m benchmarks.bench_fp8_linear")
    update(run, {"vllm_sync_8b_s": Figure.of([0.3])}, device="GPU X", command="python -m benchmarks.bench_vllm sync")
    merged = tmp_path / "headline.json"
    merge(merged, [run])
    data = json.loads(merged.read_text())
    assert data["linear_fp8_over_bf16"]["note"] == "on CUTLASS | not the default"
    assert "note" not in data["vllm_sync_8b_s"]
    row = next(line for line in headline_table(data).splitlines() if "`linear_fp8_over_bf16`" in line)
    assert "Qwen3-8B shapes — **note:** on CUTLASS \\| not the default |" in row



def test_a_ratio_without_a_recorded_baseline_says_so_in_the_table():
    """A ratio entry written before baselines were recorded shows that it has none; a ratio with one shows
    it; a value (seconds, a KL) has no baseline to show."""
    entry = {"value": 1.2, "repeats": 3, "spread": [1.1, 1.3], "device": "GPU X", "date": "2026-11-26"}
    data = {"linear_fp8_over_bf16": entry, "vllm_sync_8b_s": entry,
            "actor_step_fp8_over_bf16": {**entry, "baseline": "the bf16 mode's step"}}
    rows = {line.split("`")[1]: line for line in headline_table(data).splitlines() if line.startswith("| `")}
    assert "| not recorded (an entry older than the field) |" in rows["linear_fp8_over_bf16"]
    assert "| the bf16 mode's step |" in rows["actor_step_fp8_over_bf16"]
    assert "| — |" in rows["vllm_sync_8b_s"] and "not recorded (an" not in rows["vllm_sync_8b_s"]

def test_table_marks_a_mode_cut_off_before_its_cases_finished(tmp_path):
    (tmp_path / "decode_bf16.json").write_text(json.dumps(_decode("bf16", {"256x512": 1000.0, "256x4096": 500.0})))
    (tmp_path / "decode_fp8.json").write_text(json.dumps({**_decode("fp8", {"256x512": 1100.0}), "complete": False}))
    headline = tmp_path / "headline.json"
    text = _table(tmp_path, headline)
    assert "cut off before all cases finished: fp8" in text and "1.10x" in text
    # the headline case (256x4096) has no FP8 number: no ratio written (and no cold start was measured)
    assert not headline.exists() or json.loads(headline.read_text()) == {}


def _table(work: Path, headline: Path) -> str:
    import argparse

    args = argparse.Namespace(work=str(work), layers=36, prompt_len=256, headline_case="256x4096", headline=headline)
    return bench_vllm.table(args)


def test_decode_at_another_depth_gives_no_headline_figure(tmp_path):
    """The decode keys are Qwen3-8B's 36 layers: results of another depth (recorded with each result;
    older ones: the table's --layers) print their table and write no headline figure."""
    work = tmp_path / "work"
    work.mkdir()
    for mode, name, tok_s in (("bf16", "bf16", 500.0), ("fp8kv", "fp8kv-deep_gemm", 700.0),
                              ("fp8kv-tri", "fp8kv-tri-deep_gemm", 450.0)):
        (work / f"decode_{name}.json").write_text(json.dumps({**_decode(mode, {"256x4096": tok_s}), "layers": 16}))
    headline = tmp_path / "headline.json"
    text = _table(work, headline)
    assert "fp8kv-tri-deep_gemm/bf16" in text and "0.90x" in text and "1.40x" in text
    assert "decode at 16 layers: no headline figure" in text and not headline.exists()
    assert text.startswith("== vLLM decode, Qwen3-8B shapes (16 layers)")  # the results' depth, not --layers
    for name in ("bf16", "fp8kv-deep_gemm", "fp8kv-tri-deep_gemm"):  # the same results at 36 layers do count
        path = work / f"decode_{name}.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "layers": 36}))
    _table(work, headline)
    assert json.loads(headline.read_text())["vllm_decode_fp8kv_deep_gemm_over_bf16"]["value"] == 1.4


def test_the_step_runs_are_valid_jobs():
    """The overrides bench_vllm's step command passes to ``jetrl train`` load and resolve."""
    from megatron_jetrl.job import load_job, resolve

    for mode in ("fp8", "bf16"):
        job = load_job(ROOT / "benchmarks/configs/qwen3_8b_dims.yaml",
                       [f"precision.mode={mode}", "rollout.engine=vllm", "rollout.vllm.gpu_memory_utilization=0.2",
                        "rollout.vllm.fp8_gemm=cutlass", "run.steps=4", "log.console=false"])
        resolve(job, 1)
        assert job.rollout.engine == "vllm" and job.rollout.vllm.max_model_len is None
    # --step-layers / --step-response-len / --step-offload: a deeper model with longer responses
    deep = load_job(ROOT / "benchmarks/configs/qwen3_8b_dims.yaml",
                    [*bench_vllm.STEP_MODES["fp8kv"], "rollout.engine=vllm", "model.config.num_hidden_layers=16",
                     "rollout.sampling.max_new_tokens=2048", "rollout.offload_actor=true",
                     "actor.max_tokens_per_microbatch=16384"])  # --step-mb-tokens
    resolve(deep, 1)
    assert deep.rollout.offload_actor and deep.rollout.fp8_kv_cache and deep.longest_sequence > 2048
    assert deep.actor.max_tokens_per_microbatch == 16384


def test_the_step_table_names_what_the_run_resolved(tmp_path):
    """step_config reads the run's own config.yaml (as ``jetrl train`` writes it), defaults included."""
    from megatron_jetrl.cli import _write_config
    from megatron_jetrl.job import load_job

    job = load_job(ROOT / "benchmarks/configs/qwen3_8b_dims.yaml",
                   ["model.config.num_hidden_layers=16", "rollout.sampling.max_new_tokens=2048",
                    "rollout.offload_actor=true"])  # micro-batch tokens: the YAML's own
    _write_config(tmp_path, job)
    assert bench_vllm.step_config(tmp_path) == {"layers": 16, "response_len": 2048, "offload_actor": True,
                                                "mb_tokens": job.actor.max_tokens_per_microbatch, "fp8_gemm": "auto"}


def test_model_shapes_and_the_lm_head_share():
    """The step benchmark's models build and the LM head's FLOP share is what the shapes give:
    per layer 4096 x (4096 + 2 x 1024) + 4096 x 4096 + 3 x 12288 x 4096 MACs for Qwen3-8B."""
    from benchmarks.model_shapes import lm_head_flop_share, qwen3_shaped
    from megatron_jetrl.models import bridge_for

    eight, four = qwen3_shaped("qwen3-8b"), qwen3_shaped("qwen3-4b")
    assert bridge_for(eight).dims.num_layers == bridge_for(four).dims.num_layers == 36
    assert bridge_for(four).dims.tied_embeddings and bridge_for(four).dims.hidden_size == 2560
    layer = 4096 * 6144 + 4096 * 4096 + 3 * 12288 * 4096
    assert lm_head_flop_share(eight) == pytest.approx(151936 * 4096 / (36 * layer + 151936 * 4096))
    assert 0.08 < lm_head_flop_share(eight) < 0.10  # a real 8B: under a tenth
    assert lm_head_flop_share(qwen3_shaped("qwen3-8b", 6)) > 0.33  # 6 layers: over a third
    with pytest.raises(ValueError, match="qwen3-4b"):
        qwen3_shaped("qwen3-32b")


def test_actor_step_speedups_are_written_only_for_modes_that_ran(tmp_path):
    """bench_actor_step's headline ratios: median baseline time / median measured time (> 1: the
    measured mode is faster), spread over the steps paired one by one; a key only where both of its
    modes ran. TE's FP8 is compared with TE's BF16 (the same attention) and with native FP8 apart
    from the native-BF16 comparison."""
    from benchmarks.bench_actor_step import MODES, RATIOS, speedups

    assert set(RATIOS) <= set(KEYS)
    assert {m for base, measured, _ in RATIOS.values() for m in (base, measured)} <= set(MODES)
    assert MODES["bf16-te"][:2] == ("bf16", "te") and MODES["fp8-te"][:2] == ("fp8", "te")
    assert MODES["fp8-dgw"] == ("fp8", "native", "deep_gemm", "torch")
    assert MODES["bf16-ta"] == ("bf16", "native", "gemm", "te") and MODES["fp8-ta"] == ("fp8", "native", "gemm", "te")

    def row(step_s, logprob_s):
        return {"step_s_all": step_s, "logprob_s_all": logprob_s}

    rows = {"bf16": row([2.0, 2.2, 2.1], [1.0] * 3), "fp8": row([1.6, 2.0, 1.4], [0.8] * 3),
            "fp8-te": row([1.5, 1.6, 1.4], [0.7] * 3), "bf16-te": row([1.8, 1.8, 1.8], [0.9] * 3),
            "fp8-dgw": row([1.5, 1.8, 1.3], [0.8] * 3), "bf16-ta": row([1.9, 2.0, 1.9], [0.95] * 3),
            "fp8-ta": row([1.55, 1.6, 1.5], [0.75] * 3), "fp8-exact": row([1.7, 2.1, 1.5], [0.9] * 3),
            "bf16-exact": row([2.2, 2.3, 2.2], [1.1] * 3)}
    figs = speedups(rows)
    assert set(figs) == set(RATIOS)
    assert figs["actor_step_fp8_over_bf16_te_attention"].value == pytest.approx(1.9 / 1.55)
    assert figs["actor_step_te_fp8_over_fp8_te_attention"].value == pytest.approx(1.55 / 1.5)
    assert figs["actor_step_fp8_deep_gemm_wgrad_over_bf16"].value == pytest.approx(2.1 / 1.5)
    assert figs["actor_step_exact_fp8_over_fp8"].value == pytest.approx(1.6 / 1.7)  # < 1: the exact step is slower
    assert MODES["fp8-exact"] == MODES["fp8"] and MODES["bf16-exact"] == MODES["bf16"]
    te_over_fp8 = figs["actor_step_te_fp8_over_fp8"]  # native FP8 time / TE FP8 time
    assert te_over_fp8.value == pytest.approx(1.6 / 1.5) and te_over_fp8.repeats == 3
    assert te_over_fp8.spread == pytest.approx((1.4 / 1.4, 2.0 / 1.6))
    assert figs["actor_step_te_fp8_over_te_bf16"].value == pytest.approx(1.8 / 1.5)
    assert figs["actor_step_te_fp8_over_bf16"].value == pytest.approx(2.1 / 1.5)
    assert figs["actor_step_fp8_over_bf16"].value == pytest.approx(2.1 / 1.6)
    assert figs["logprob_fp8_over_bf16"].value == pytest.approx(1.0 / 0.8)

    without_te_bf16 = speedups({m: rows[m] for m in ("bf16", "fp8", "fp8-te")})
    assert set(without_te_bf16) == {"actor_step_fp8_over_bf16", "logprob_fp8_over_bf16",
                                    "actor_step_te_fp8_over_bf16", "actor_step_te_fp8_over_fp8"}
    assert set(speedups({m: rows[m] for m in ("bf16-te", "fp8-te")})) == {"actor_step_te_fp8_over_te_bf16"}
    assert speedups({"fp8-te": rows["fp8-te"], "bf16": rows["bf16"]}).keys() == {"actor_step_te_fp8_over_bf16"}
    assert speedups({"fp8-te": rows["fp8-te"]}) == {}

    path = tmp_path / "headline.json"
    update(path, figs, device="GPU X", command="torchrun ... -m benchmarks.bench_actor_step --modes bf16,fp8,fp8-te")
    data = json.loads(path.read_text())
    assert data["actor_step_te_fp8_over_fp8"]["value"] == 1.0667
    assert data["actor_step_te_fp8_over_te_bf16"]["spread"] == [1.125, 1.2857]  # 1.8 / 1.6, 1.8 / 1.4


def test_kernel_time_by_class():
    """The benchmarks' kernel-time split: graph launches and copies left out, names classified by
    the first pattern they match (FA3's CUTLASS kernels as attention, not GEMM)."""
    from types import SimpleNamespace

    from benchmarks.bench_vllm import KERNEL_CLASSES
    from megatron_jetrl.runtime.profiling import by_class, kernel_launches, kernel_ms

    events = [SimpleNamespace(key=k, device_time_total=us, count=n) for k, us, n in (
        ("void cutlass::device_kernel<flash::FlashAttnFwdSm90<...>>", 2000.0, 36),
        ("nvjet_sm90_tst_192x128", 5000.0, 72), ("cudaGraphLaunch", 9000.0, 1),
        ("Memcpy HtoD (Pinned -> Device)", 700.0, 3), ("triton_poi_fused_silu", 300.0, 36), ("some_kernel", 100.0, 2),
        ("matmul_kernel_persistent", 400.0, 1))]  # vLLM's batch-invariant matmul: the exact engine's LM head
    kernels = kernel_ms(SimpleNamespace(key_averages=lambda: events))
    assert kernel_launches(SimpleNamespace(key_averages=lambda: events)) == 36 + 72 + 36 + 2 + 1
    assert kernels == {"void cutlass::device_kernel<flash::FlashAttnFwdSm90<...>>": 2.0, "nvjet_sm90_tst_192x128": 5.0,
                       "triton_poi_fused_silu": 0.3, "some_kernel": 0.1, "matmul_kernel_persistent": 0.4}
    assert by_class(kernels, KERNEL_CLASSES) == {"attention": 2.0, "gemm": 5.4, "norm / rope / act": 0.3,
                                                 "other": 0.1}


def test_step_modes_are_valid_jobs_and_unknown_ones_refused(capsys):
    from megatron_jetrl.job import load_job, resolve

    for mode, overrides in bench_vllm.STEP_MODES.items():
        job = load_job(ROOT / "benchmarks/configs/qwen3_8b_dims.yaml",
                       [*overrides, "rollout.engine=vllm", "run.steps=5", "run.profile_steps=[5]"])
        resolve(job, 1)
        assert job.run.profile_steps == (5,), mode
    with pytest.raises(SystemExit):
        bench_vllm.main(["step", "--step-modes", "fp8,fp9"])
    assert "--step-modes: unknown fp9" in capsys.readouterr().err


def test_the_docs_table_is_the_headline_file():
    """docs/benchmarks.md's table is generated from headline.json (python -m benchmarks.headline table --write)."""
    data = json.loads((ROOT / "docs" / "results" / "headline.json").read_text())
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    assert with_table(doc, data) == doc, "run: python -m benchmarks.headline table --write docs/benchmarks.md"


def test_scale_summary_plans_vllms_share_of_the_gpu_it_is_given(tmp_path):
    """The memory plan beside a scale run counts vLLM's share of the GPU's memory (as ``jetrl check``
    does for that GPU), not nothing; a profiled step is not a timed one, nor, with the actor offloaded,
    step 2 (its offload pins the optimizer state's host buffers, once)."""
    import yaml

    from benchmarks.scale_summary import summarise
    from megatron_jetrl.job import load_job

    job = load_job("benchmarks/configs/qwen3_8b_dims.yaml", ["rollout.engine=vllm", "rollout.offload_actor=true",
                                                             "rollout.vllm.gpu_memory_utilization=0.7",
                                                             "run.steps=5", "run.profile_steps=[5]"])
    run = tmp_path / "fp8"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(job.to_dict(), sort_keys=False))
    rows = [{"step": s, "timing/step_s": 10.0 + s, "perf/tokens_per_step": 1000.0, "perf/tokens_per_s_per_gpu": 50.0,
             "memory/device_used_gib": 60.0} for s in (1, 2, 3, 4, 5)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = summarise(run, 1, 79.1 * 2**30)
    assert r["plan_gib"]["rollout"] == pytest.approx(0.7 * 79.1)
    assert r["plan_gib"]["peak"] >= r["plan_gib"]["rollout"] and r["measured_gib"]["device_used"] == 60.0
    assert r["seconds_per_step"]["step"] == [13.0, 14.0]  # steps 3..: not the offload's warm-up, not the profiled
    assert r["profile"] is None  # the profiled step wrote no profile here
    profile = {"step": 5, "phases": {"generate": {"wall_s": 3.0, "kernel_ms": 900.0,
                                                  "classes_ms": {"attention": 500.0, "gemm": 400.0}}}}
    (run / "profiles").mkdir()
    (run / "profiles" / "step_5.json").write_text(json.dumps(profile))
    assert summarise(run, 1, 79.1 * 2**30)["profile"] == profile
    from benchmarks.rl_summary import profile_lines
    assert profile_lines("fp8", profile) == [
        "-- kernel time of step 5 (fp8, profiled), ms by phase and class:",
        "   generate    wall   3.000 s, kernels    900.0 ms: attention 500, gemm 400"]


def test_the_offline_host_script_measures_the_engines_default_fp8_gemm():
    """vllm.sh passes --fp8-gemm to every bench_vllm call: its default must be the engine's own
    (a run that meant the default once measured CUTLASS because the script said so)."""
    import re

    from megatron_jetrl.rollout.vllm_engine import VllmOptions

    script = (ROOT / "hosts" / "offline" / "vllm.sh").read_text()
    assert re.search(r"\bgemm=(\w+)", script).group(1) == VllmOptions().fp8_gemm
    assert bench_vllm.build_parser().get_default("fp8_gemm") == VllmOptions().fp8_gemm


def test_the_actor_benchmark_refuses_a_depth_over_the_gpu_and_names_one_that_fits():
    """The memory plan, before anything is built: 12 layers of Qwen3-8B widths ran out of an H100
    (79 GiB) in BF16; 16 fit an H200."""
    import argparse

    from benchmarks.bench_actor_step import check_memory

    args = argparse.Namespace(model="qwen3-8b", layers=12, modes="bf16,fp8", tp=1, mb_tokens=8192, seq_len=4096,
                              logprob_impl="compiled", elementwise_impl="compiled")
    with pytest.raises(SystemExit, match=r"^bench_actor_step: --layers 12: the trainer needs ~\d+ GiB .* "
                                         r"this GPU has 79 GiB: use --layers 9 \(or --skip-memory-check\)$"):
        check_memory(args, 79.2)
    check_memory(argparse.Namespace(**{**vars(args), "layers": 16}), 139.8)  # fits: returns


def test_the_actor_benchmarks_json_holds_the_finished_modes_and_says_whether_all_ran(tmp_path):
    """main writes --json after every mode: a run cut off mid-way keeps the modes it finished,
    marked incomplete; the last write is marked complete."""
    import argparse

    from benchmarks.bench_actor_step import write_json

    path = tmp_path / "actor.json"
    args = argparse.Namespace(modes="bf16,fp8", json=path, layers=36)
    write_json(args, "GPU X", [{"mode": "bf16", "step_s": 1.5}], complete=False)
    first = json.loads(path.read_text())
    assert first == {"args": {"modes": "bf16,fp8", "json": str(path), "layers": 36}, "device": "GPU X",
                     "complete": False, "rows": [{"mode": "bf16", "step_s": 1.5}]}
    write_json(args, "GPU X", [{"mode": "bf16", "step_s": 1.5}, {"mode": "fp8", "step_s": 1.3}], complete=True)
    last = json.loads(path.read_text())
    assert last["complete"] is True and [r["mode"] for r in last["rows"]] == ["bf16", "fp8"]


def test_an_offloaded_step_run_warms_up_two_steps(tmp_path, monkeypatch):
    """With --step-offload, step 2's offload is the first with the optimizer's state (it pins host
    memory for it, once): steps 1 and 2 warm up, the timed ones follow, the profiled one is last."""
    import subprocess

    import yaml

    from megatron_jetrl.job import load_job

    seen = {}

    def fake_run(cmd, env, stdout, stderr, timeout):
        over = dict(a.split("=", 1) for a in cmd if "=" in a and not a.startswith("-"))
        seen["cmd"], seen["env"] = cmd, env
        run_dir = Path(over["run.dir"])
        run_dir.mkdir(parents=True)
        job = load_job(ROOT / "benchmarks/configs/qwen3_8b_dims.yaml", ["rollout.offload_actor=true"])
        (run_dir / "config.yaml").write_text(yaml.safe_dump(job.to_dict(), sort_keys=False))
        rows = [{"step": s, "timing/step_s": 10.0 * s, "timing/colocate_s": 40.0 if s == 2 else 2.0,
                 "perf/tokens_per_step": 100.0} for s in range(1, int(over["run.steps"]) + 1)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(bench_vllm.subprocess, "run", fake_run)
    monkeypatch.setattr(bench_vllm, "_gpu_name", lambda: "GPU X")
    args = bench_vllm.build_parser().parse_args(["step", "--step-modes", "fp8", "--step-offload", "--profile",
                                                 "--work", str(tmp_path), "--step-env", "A_B=x:y", "--step-env", "C="])
    result = bench_vllm.step_runs(args)["fp8"]
    assert "run.steps=6" in seen["cmd"] and "run.profile_steps=[6]" in seen["cmd"]
    assert seen["env"]["A_B"] == "x:y" and seen["env"]["C"] == ""
    assert result["seconds_per_step"]["step"] == [30.0, 40.0, 50.0]  # steps 3, 4, 5
    assert result["seconds_per_step"]["colocate"] == [2.0, 2.0, 2.0]
    from benchmarks.rl_summary import warm_up_steps

    assert warm_up_steps(False) == ()  # without offload only step 1 warms up


def test_step_env_must_be_name_equals_value(capsys):
    with pytest.raises(SystemExit) as e:
        bench_vllm.build_parser().parse_args(["step", "--step-env", "expandable_segments"])
    assert e.value.code == 2 and "expected NAME=VALUE" in capsys.readouterr().err


def test_step_json_holds_the_modes_that_finished_and_nothing_older(tmp_path, monkeypatch):
    """step.json is rewritten after every mode (a lane cut off keeps what finished), and a run whose
    modes all fail leaves an empty one, not an earlier run's results."""
    import subprocess

    (tmp_path / "step.json").write_text(json.dumps({"fp8": {"seconds": {"step": 1.0}}}))  # an earlier run's
    monkeypatch.setattr(bench_vllm.subprocess, "run", lambda cmd, **_: subprocess.CompletedProcess(cmd, 1))
    args = bench_vllm.build_parser().parse_args(["step", "--step-modes", "fp8,bf16", "--work", str(tmp_path)])
    assert bench_vllm.step_runs(args) == {}
    assert json.loads((tmp_path / "step.json").read_text()) == {}


def test_exact_ablation_headline_is_the_median_over_sampling_seeds(tmp_path):
    """exact_ablation's headline figures: the default engine's k3 KL at 8b6 per mode (median and range
    over the seeds), and the largest |Δlogp| over the exact runs and seeds (with the per-seed range).
    An older result without repeats counts as one measurement; --seeds below 1 is refused."""
    from benchmarks.exact_ablation import default_command, headline_figures, table
    from benchmarks.exact_ablation import main as exact_ablation_main

    def run(model, engine, mode, k3s, dlogps):
        reps = [{"rollout_corr/k3_kl": k, "rollout_corr/max_abs_dlogp": d, "unequal_share": 0.0,
                 "token_mult_prob_error": 1.0} for k, d in zip(k3s, dlogps, strict=True)]
        return {"model": model, "engine": engine, "mode": mode, "device": "GPU X", "mismatch": reps[0],
                "repeats": reps, "ops": {}}

    runs = {"8b6_default_fp8": run("8b6", "default", "fp8", [0.02, 0.01, 0.03], [1.0, 2.0, 3.0]),
            "8b6_default_bf16": run("8b6", "default", "bf16", [4e-4], [0.5]),
            "8b6_exact_fp8": run("8b6", "exact", "fp8", [0.0] * 3, [0.0, 0.0, 0.0]),
            "tiny_exact_bf16": run("tiny", "exact", "bf16", [0.0] * 3, [0.0, 0.25, 0.0])}
    figs = headline_figures(runs)
    assert set(figs) == {"vllm_k3_fp8_8b6", "vllm_k3_bf16_8b6", "vllm_exact_max_abs_dlogp"}
    k3 = figs["vllm_k3_fp8_8b6"]
    assert (k3.value, k3.repeats, k3.spread) == (0.02, 3, (0.01, 0.03))
    assert figs["vllm_k3_bf16_8b6"].repeats == 1
    exact = figs["vllm_exact_max_abs_dlogp"]  # per seed: max(0, 0), max(0, 0.25), max(0, 0): one seed is off
    assert (exact.value, exact.repeats, exact.spread) == (0.25, 3, (0.0, 0.25))
    for name, r in runs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(r))
    text = table(tmp_path, str(tmp_path / "headline.json"), command="python -m benchmarks.exact_ablation all")
    assert "| 8b6 | default | fp8 | 0.02 (0.01-0.03, 3 seeds) |" in text
    data = json.loads((tmp_path / "headline.json").read_text())
    assert data["vllm_k3_fp8_8b6"]["repeats"] == 3 and data["vllm_k3_fp8_8b6"]["spread"] == [0.01, 0.03]
    with pytest.raises(SystemExit):
        exact_ablation_main(["table", "--seeds", "0"])
    assert default_command(runs) == ("python -m benchmarks.exact_ablation all --models 8b6,tiny --runs "
                                     "default:bf16,default:fp8,exact:bf16,exact:fp8 --seeds 1 (rebuilt from the "
                                     "results; then table --headline)")


@pytest.mark.parametrize("script, env_key, missing", [("rl_8b_full.sh", "JETRL_8B_OUT", "main.log"),
                                                      ("lanes.sh", "JETRL_LANES", "plan.sh")])
def test_waiting_on_a_machine_that_never_started_the_run_stops_at_once(tmp_path, script, env_key, missing):
    """The GPU host goes back 30 s after a call ends; a later call gets a fresh machine. ``wait``
    there has nothing to wait for: it says so in one line and fails, instead of sleeping out its
    seconds of device time."""
    import subprocess
    import time

    env = {**os.environ, env_key: str(tmp_path / "nothing"), "OUT": ""}
    start = time.monotonic()
    done = subprocess.run(["bash", str(ROOT / "hosts" / "offline" / script), "wait", "30"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=25)
    assert time.monotonic() - start < 10
    assert done.returncode == 1
    assert done.stdout.startswith("no ") and f"{missing} is missing" in done.stdout and "start again" in done.stdout


@pytest.mark.parametrize("rounds", ["0", "two", "-1"])
def test_the_full_8b_script_refuses_bad_rounds_before_it_starts(tmp_path, rounds):
    """ROUNDS is checked before anything is started or installed, and ``start`` says so in the
    foreground instead of in the background run's log."""
    import subprocess

    env = {**os.environ, "JETRL_8B_OUT": str(tmp_path / "out"), "ROUNDS": rounds, "OUT": ""}
    done = subprocess.run(["bash", str(ROOT / "hosts" / "offline" / "rl_8b_full.sh"), "start"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=25)
    assert done.returncode == 1
    assert done.stdout.startswith(f"ROUNDS={rounds}: give a whole number >= 1")
    assert not (tmp_path / "out").exists()


def test_exact_decode_is_paired_with_the_default_engine_of_the_same_run():
    """vllm_exact_decode_over_default (and _256x4096, and the FP8-KV pair): exact over default, both on
    DeepGEMM (the engine's default GEMM) and from one invocation of the benchmark; a default result of
    another run, or a CUTLASS one, gives no figure."""
    def result(mode, tok_s, invocation):
        return {**_decode(mode, tok_s), "fp8_gemm": "deep_gemm", "invocation": invocation}

    cases = {"128x2048": 1000.0, "256x4096": 800.0}
    decode = {"fp8-deep_gemm": result("fp8", cases, "run a"),
              "fp8-exact-deep_gemm": result("fp8-exact", {"128x2048": 950.0, "256x4096": 780.0}, "run a"),
              "fp8kv-deep_gemm": result("fp8kv", cases, "run b"),
              "fp8kv-exact-deep_gemm": result("fp8kv-exact", cases, "run c"),  # another run: not paired
              "fp8-exact": {**_decode("fp8-exact", {"128x2048": 10.0}), "invocation": "run a"}}  # CUTLASS: not paired
    out = bench_vllm.decode_headline(decode, "256x4096")
    assert out["vllm_exact_decode_over_default"][0].value == pytest.approx(0.95)
    assert out["vllm_exact_decode_over_default_256x4096"][0].value == pytest.approx(780.0 / 800.0)
    assert not any(k.startswith("vllm_exact_fp8kv") for k in out)
    decode["fp8kv-exact-deep_gemm"]["invocation"] = "run b"
    assert bench_vllm.decode_headline(decode, "256x4096")["vllm_exact_fp8kv_decode_over_default"][0].value == 1.0
    assert all(k in KEYS for k in bench_vllm.decode_headline(decode, "256x4096"))


def test_the_exact_steps_over_bf16_are_headline_figures(tmp_path):
    def run(step_s):
        phases = {"generate": [2.0] * 3, "logprobs": [1.0] * 3, "update": [1.0] * 3, "sync": [0.1] * 3,
                  "step": [step_s] * 3}
        return {"seconds_per_step": phases, "tokens_per_timed_step": [4096.0] * 3}

    runs = {"bf16": run(6.0), "fp8": run(5.0), "fp8-exact": run(4.0), "fp8kv-exact": run(3.75)}
    (tmp_path / "step.json").write_text(json.dumps(runs))
    headline = tmp_path / "headline.json"
    _table(tmp_path, headline)
    data = json.loads(headline.read_text())
    assert data["rl_step_exact_fp8_over_bf16"]["value"] == 1.5 and data["rl_step_exact_fp8kv_over_bf16"]["value"] == 1.6
    assert data["rl_step_exact_over_default"]["value"] == 1.25 and data["rl_step_vllm_fp8_over_bf16"]["value"] == 1.2


def replay(command: str):
    """A recorded command's benchmark arguments, parsed by that benchmark's own parser: the variables
    set before it and the launcher (``python`` / ``torchrun --nproc-per-node N``) taken off first."""
    import importlib
    import shlex

    words = shlex.split(command)
    env = {}
    while words and "=" in words[0] and not words[0].startswith("-"):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    launcher = words[:words.index("-m")]
    assert launcher in (["python"], ["torchrun", "--nproc-per-node", launcher[-1]]), launcher
    module = words[words.index("-m") + 1]
    return env, launcher, importlib.import_module(module).build_parser().parse_args(words[words.index("-m") + 2:])


@pytest.mark.parametrize("module, argv, environ", [
    ("benchmarks.bench_vllm", ["--fp8-gemm", "auto", "decode", "--modes", "fp8,fp8-exact", "--cases", "128x2048",
                               "--repeats", "3"], {}),
    ("benchmarks.bench_actor_step", ["--layers", "16", "--modes", "bf16,fp8,bf16-te,fp8-te"],
     {"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "1", "NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"}),
    ("benchmarks.exact_ablation", ["all", "--models", "tiny,8b6", "--seeds", "3", "--work", "/tmp/a b",
                                   "--headline=/tmp/vllm_gpu_out/h.json"], {}),
])
def test_a_recorded_command_runs_as_written(module, argv, environ):
    """What a headline entry records is the command that ran: its environment variables that change the
    measurement, its launcher and its arguments, which the benchmark's own parser reads back as they were
    (quoted where a value needs it), except where it wrote: a placeholder, not the host's path."""
    import importlib

    from benchmarks.headline import portable_argv

    command = command_line(module, argv, environ)
    env, launcher, args = replay(command)
    assert env == {k: v for k, v in environ.items() if k == "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"}
    assert launcher[0] == ("torchrun" if "TORCHELASTIC_RUN_ID" in environ else "python")
    assert vars(args) == vars(importlib.import_module(module).build_parser().parse_args(portable_argv(argv)))
    assert "/tmp" not in command


def test_output_locations_are_placeholders():
    from benchmarks.headline import portable_argv

    assert portable_argv(["decode", "--work", "/tmp/x", "--json=/tmp/r.json", "--repeats", "3", "--headline",
                          "h.json", "--out", "o"]) == [
        "decode", "--work", "WORK", "--json=JSON", "--repeats", "3", "--headline", "HEADLINE", "--out", "OUT"]


def test_an_older_entrys_host_paths_become_placeholders_when_the_file_is_written(tmp_path):
    """Entries recorded before commands were portable name a GPU host's paths: any write of the file
    (a benchmark's update, a merge) records them with the placeholders a new entry gets."""
    from benchmarks.headline import merge, portable_command

    old = ("NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 python -m benchmarks.bench_actor_step --layers 16 --headline "
           "/tmp/bench_vllm/headline_actor.json --json /tmp/vllm_gpu_out/gpu1/actor_0.json")
    expected = ("NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 python -m benchmarks.bench_actor_step --layers 16 --headline "
                "HEADLINE --json JSON")
    assert portable_command(old) == expected
    entry = {"value": 1.1, "repeats": 5, "spread": [1.0, 1.2], "device": "GPU X", "command": old, "date": "2026-11-27"}
    source, headline = tmp_path / "run.json", tmp_path / "headline.json"
    source.write_text(json.dumps({"actor_step_fp8_over_bf16": entry}))
    merge(headline, [source])
    assert json.loads(headline.read_text())["actor_step_fp8_over_bf16"]["command"] == expected


def test_an_older_entrys_moved_script_is_recorded_where_it_is_now(tmp_path):
    """A command recorded before its script moved (``MOVED_SCRIPTS``) is written with the script's
    current path, its variables and arguments as they were."""
    from benchmarks.headline import merge, portable_command

    old = "TP=4 RTP=2 STEPS=6 ARGS='run.profile_steps=[6]' bash benchmarks/gpu_host/rl_8b_full.sh"
    expected = "TP=4 RTP=2 STEPS=6 'ARGS=run.profile_steps=[6]' bash hosts/offline/rl_8b_full.sh"
    assert portable_command(old) == expected and (ROOT / "hosts/offline/rl_8b_full.sh").is_file()
    entry = {"value": 1.2, "repeats": 3, "spread": [1.1, 1.3], "device": "GPU X", "command": old, "date": "2026-11-27"}
    source, headline = tmp_path / "run.json", tmp_path / "headline.json"
    source.write_text(json.dumps({"rl_step_8b_full_fp8_over_bf16": entry}))
    merge(headline, [source])
    assert json.loads(headline.read_text())["rl_step_8b_full_fp8_over_bf16"]["command"] == expected


def test_every_recorded_command_names_a_script_or_module_of_this_tree():
    """Each headline entry's command runs something the tree has: its ``-m`` module, or the script
    it gives to bash (a script moved since would fail here until ``MOVED_SCRIPTS`` knows it)."""
    import importlib.util
    import shlex

    data = json.loads((ROOT / "docs/results/headline.json").read_text())
    for key, entry in data.items():
        words = shlex.split(entry["command"].split(" (")[0])  # an older entry's trailing remark left off
        if "-m" in words:
            module = words[words.index("-m") + 1]
            assert importlib.util.find_spec(module) is not None, f"{key}: no module {module}"
        else:
            script = words[words.index("bash") + 1]
            assert (ROOT / script).is_file(), f"{key}: no script {script}"


def test_a_step_ratio_notes_a_large_phase_that_varied_over_the_timed_steps():
    from benchmarks.bench_vllm import step_spread_note

    steady = {"generate": [5.0, 5.1, 5.2], "logprobs": [1.8, 1.9, 1.8], "score": [0.05, 0.1, 0.14],
              "step": [12.0, 12.2, 12.3]}
    assert step_spread_note({"bf16": steady, "fp8-exact": steady}) == ""  # score varied, but is 1 % of the step
    varied = {**steady, "generate": [5.85, 6.57, 8.52], "step": [13.4, 14.3, 16.3]}
    note = step_spread_note({"bf16": varied, "fp8-exact": steady})
    assert note.startswith("within the run, bf16 generate 5.85-8.52 s over the timed steps")
    assert "fp8-exact" not in note and "score" not in note


def test_the_step_table_gives_each_phases_cpu_seconds_of_this_process_and_of_the_others(tmp_path):
    import json

    from benchmarks.bench_vllm import cpu_lines
    from benchmarks.rl_summary import summarise

    rows = [{"step": s, "timing/step_s": 10.0, "timing/generate_s": 5.0 + s, "cpu/generate_process_s": 4.0 + s,
             "cpu/generate_machine_s": 6.0 + s, "cpu/update_process_s": 2.0} for s in (1, 2, 3)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cpu = summarise(path)["cpu_per_step"]
    assert cpu == {"generate": {"process": [6.0, 7.0], "machine": [8.0, 9.0]}, "update": {"process": [2.0, 2.0]}}
    lines = cpu_lines("fp8-exact", {"generate": [7.0, 8.0], "update": [3.0, 3.0]}, cpu)
    assert lines[0].endswith("generate CPU s a timed step: wall 7.00 / this process 6.00 / others 2.00, "
                             "wall 8.00 / this process 7.00 / others 2.00")
    assert lines[1].endswith("update CPU s a timed step: wall 3.00 / this process 2.00, wall 3.00 / this process 2.00")


def test_the_host_profile_gives_ms_a_decode_step_by_function(monkeypatch):
    import torch

    from benchmarks.bench_vllm import host_profile

    def spin(n):
        total = 0
        for i in range(n):  # pure Python: all of it the function's own time
            total += i
        return total

    class Engine:
        def generate(self, prompts, params):
            assert len(prompts) == 4 and params.max_new_tokens == 10
            for _ in range(params.max_new_tokens):
                spin(20_000)  # the host work of one decode step

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    hp = host_profile(Engine(), vocab=100, prompt_len=8, batch=4, steps=10, top=5)
    assert hp["batch"] == 4 and hp["steps"] == 10 and hp["wall_ms_per_step"] > 0
    top = hp["functions"][0]
    assert top["function"].endswith(":spin") and top["calls_per_step"] == 1.0
    assert 0 < top["self_ms"] <= top["total_ms"] and len(hp["functions"]) <= 5


def test_the_table_shows_a_decode_host_profile(tmp_path):
    """decode --host-profile: the table gives each mode's wall time a step and its functions by their
    own time, in the recorded order, a built-in's address left out; a mode without one shows none."""
    functions = [{"function": "scheduler.py:425:schedule", "calls_per_step": 1.0, "self_ms": 0.7, "total_ms": 4.2},
                 {"function": "~:0:<function Event.synchronize at 0x7f248a130540>", "calls_per_step": 1.0,
                  "self_ms": 0.5, "total_ms": 0.5}]
    (tmp_path / "decode_fp8.json").write_text(json.dumps(
        {**_decode("fp8", {"128x1024": 900.0}), "layers": 16,
         "host_profile": {"batch": 128, "steps": 256, "wall_ms_per_step": 4.81, "functions": functions}}))
    (tmp_path / "decode_fp8-exact.json").write_text(json.dumps({**_decode("fp8-exact", {"128x1024": 900.0}),
                                                                "layers": 16}))
    lines = _table(tmp_path, tmp_path / "h.json").splitlines()
    at = lines.index("-- host time, fp8, 256 decode steps at batch 128: 4.81 ms wall a step (unprofiled); "
                     "by function, ms a step under cProfile:")
    assert [line.split() for line in lines[at + 2:at + 4]] == [
        ["0.700", "4.200", "1.0", "scheduler.py:425:schedule"],
        ["0.500", "0.500", "1.0", "~:0:<function", "Event.synchronize>"]]
    assert sum("-- host time" in line for line in lines) == 1
