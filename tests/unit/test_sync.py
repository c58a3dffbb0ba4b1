"""Weight sync on CPU: the plan for many layouts, the segment copy kernel against its reference,
and the engine tensors of every train/rollout layout against the FP8 checkpoint export of the
same model (the bytes a rollout engine must hold)."""

from __future__ import annotations

import logging

import pytest
import torch

from megatron_jetrl.config import ConfigError
from megatron_jetrl.models import ParallelLayout, bridge_for
from megatron_jetrl.models.fp8_export import to_fp8_block
from megatron_jetrl.ops import copy_segments, copy_segments_reference
from megatron_jetrl.precision import Fp8Options, PrecisionRecipe
from megatron_jetrl.precision.kv_cache import kv_scale_names
from megatron_jetrl.rollout.base import TensorMeta, WeightMismatch
from megatron_jetrl.sync import SyncPlan, WeightSync, engine_tensors_from_full, shard_state, simulate
from tests.helpers import assert_same_bytes
from tests.model_fixtures import FAMILIES, tiny_hf_model

QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False}

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1)]


def _model(arch: str):
    m = tiny_hf_model(arch)
    bridge = bridge_for(m.config.to_dict())
    sd = m.state_dict()
    full = {s.megatron: bridge.to_megatron(s, lambda n: sd[n]) for s in bridge.tensor_map()}
    hf = {h: sd[h] for s in bridge.tensor_map() for h in s.hf}
    return bridge, full, hf


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return _model(request.param)


def _expected(bridge, recipe, hf, rollout_tp, r):
    """Rollout rank r's shard of every HF tensor (vLLM's split), as the FP8 export quantizes it.
    For 128-aligned shards that equals cutting the full export (what the trainer's bytes give)."""
    shard_dim = {h: s.tp_dim for s in bridge.tensor_map() if s.tp_dim is not None and s.fuse != "vocab" for h in s.hf}
    sliced = {name: (t.chunk(rollout_tp, dim=shard_dim[name])[r].contiguous() if name in shard_dim else t)
              for name, t in hf.items()}
    return dict(to_fp8_block(bridge, recipe, sliced.items()))


# ------------------------------------------------------------------------------------- plan

@pytest.mark.parametrize("tp,pp,rollout_tp,world", [(1, 1, 1, 1), (2, 1, 1, 2), (2, 2, 2, 8), (4, 1, 2, 8),
                                                    (1, 4, 4, 8), (8, 1, 1, 8), (2, 2, 8, 8), (1, 1, 8, 8)])
def test_plan_covers_every_tensor_once_from_own_replica(tp, pp, rollout_tp, world):
    bridge = bridge_for(QWEN3_8B)
    train = ParallelLayout(tp, pp)
    plan = SyncPlan(bridge, PrecisionRecipe(), train, rollout_tp, world)
    dp_size = world // (tp * pp)
    assert plan.requantized == ()  # head_dim 128: every trainer byte is reused
    for rank in range(world):
        dp = (rank // tp) % dp_size
        replica = {t + tp * (dp + dp_size * p) for t in range(tp) for p in range(pp)}
        tensors = plan.tensors(rank)
        assert [t.name for t in tensors] == plan.names
        for t in tensors:
            covered = 0
            for p in t.pieces:
                assert p.dst_start == covered, (t.name, p)
                covered += p.length
                assert p.src_rank in replica
            assert covered == t.shape[t.dim], t.name


def test_plan_fp8_shapes_and_qkv_runs():
    bridge = bridge_for(QWEN3_8B)
    plan = SyncPlan(bridge, PrecisionRecipe(), ParallelLayout(2, 1), 2, 2)
    t = {x.name: x for x in plan.tensors(1)}
    q = t["model.layers.0.self_attn.q_proj.weight"]
    assert q.fp8 and not q.requantize and q.shape == (2048, 4096) and q.scale_shape == (16, 32)
    # 4 query groups per train rank, 4 heads of 128 rows each: one run per group
    assert [(p.src_rank, p.src_start, p.length) for p in q.pieces] == [(1, i * 768, 512) for i in range(4)]
    o = t["model.layers.0.self_attn.o_proj.weight"]
    assert o.dim == 1 and o.shape == (4096, 2048) and [(p.src_rank, p.src_start) for p in o.pieces] == [(1, 0)]
    emb = t["model.embed_tokens.weight"]
    assert not emb.fp8 and emb.shape == (151936, 4096) and len(emb.pieces) == 2


def test_plan_rounds_respect_the_bucket():
    bridge = bridge_for(QWEN3_8B)
    plan = SyncPlan(bridge, PrecisionRecipe(), ParallelLayout(1, 1), 1, 1)
    rounds = plan.rounds(256 * 2**20)
    assert [i for r in rounds for i in r] == list(range(len(plan.names)))
    sizes = [sum(plan.tensors(0)[i].wire_bytes() for i in r) for r in rounds]
    assert all(s <= 256 * 2**20 or len(r) == 1 for s, r in zip(sizes, rounds, strict=True))
    with pytest.raises(ConfigError, match="sync.bucket_mb"):
        plan.rounds(0)


def test_plan_rejects_bad_layouts():
    bridge = bridge_for(QWEN3_8B)
    with pytest.raises(ConfigError, match="rollout.tp.*num_key_value_heads"):
        SyncPlan(bridge, PrecisionRecipe(), ParallelLayout(1, 1), 16, 16)
    with pytest.raises(ConfigError, match="rollout.tp.*world size"):
        SyncPlan(bridge, PrecisionRecipe(), ParallelLayout(1, 1), 4, 2)
    with pytest.raises(ConfigError, match="world size"):
        SyncPlan(bridge, PrecisionRecipe(), ParallelLayout(2, 2), 1, 6)


def test_plan_logs_requantized_projections(caplog):
    bridge, _, _ = _model("LlamaForCausalLM")  # head_dim 64: k and v rows straddle 128-row blocks
    with caplog.at_level(logging.WARNING, logger="megatron_jetrl.sync.plan"):
        plan = SyncPlan(bridge, PrecisionRecipe(), ParallelLayout(1, 1), 1, 1)
    assert "model.layers.0.self_attn.k_proj.weight" in plan.requantized
    assert "model.layers.0.self_attn.q_proj.weight" not in plan.requantized
    assert "re-quantized per projection" in caplog.text


# ---------------------------------------------------------------------------- engine tensors

@pytest.mark.parametrize("tp,pp", LAYOUTS)
@pytest.mark.parametrize("rollout_tp", [1, 2])
def test_engine_tensors_equal_the_fp8_export(model, tp, pp, rollout_tp):
    """Every layout delivers the bytes of the FP8 export (TP=1 quantization): for head_dim 128 the
    trainer's per-shard FP8 bytes re-slice exactly; other projections are re-quantized whole."""
    bridge, full, hf = model
    recipe = PrecisionRecipe()
    for r in range(rollout_tp):
        got = dict(engine_tensors_from_full(bridge, recipe, full, rollout_tp, r, train=ParallelLayout(tp, pp)))
        expected = _expected(bridge, recipe, hf, rollout_tp, r)
        assert sorted(got) == sorted(expected)
        for name, t in expected.items():
            assert_same_bytes(got[name], t, f"{name} (train tp={tp} pp={pp}, rollout tp={rollout_tp} rank {r})")


@pytest.mark.parametrize("mode", ["bf16", "fp16", "bf16-train+fp8-rollout"])
def test_engine_tensors_other_modes(mode):
    bridge, full, hf = _model("Qwen3ForCausalLM")
    recipe = PrecisionRecipe(mode=mode)
    dtype = torch.float16 if mode == "fp16" else torch.bfloat16
    full = {k: v.to(dtype) for k, v in full.items()}
    hf = {k: v.to(dtype) for k, v in hf.items()}
    plan = SyncPlan(bridge, recipe, ParallelLayout(2, 1), 1, 2)
    assert all(t.requantize == t.fp8 for t in plan.tensors(0))
    got = dict(engine_tensors_from_full(bridge, recipe, full, train=ParallelLayout(2, 1)))
    expected = dict(to_fp8_block(bridge, recipe, hf.items())) if recipe.rollout_fp8 else hf
    assert sorted(got) == sorted(expected)
    for name, t in expected.items():
        assert_same_bytes(got[name], t, name)


def test_bf16_first_last_layers_stay_bf16():
    bridge, full, hf = _model("Qwen3ForCausalLM")
    recipe = PrecisionRecipe(fp8=Fp8Options(bf16_first_layers=1))
    got = dict(engine_tensors_from_full(bridge, recipe, full))
    assert got["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16
    assert "model.layers.0.mlp.down_proj.weight_scale_inv" not in got
    assert got["model.layers.1.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn


def test_kernel_and_reference_sync_agree():
    """The compiled copy (C++ on CPU) and the pure-torch reference produce the same engine tensors."""
    bridge, full, _ = _model("Qwen2ForCausalLM")
    recipe = PrecisionRecipe()
    train = ParallelLayout(2, 2)
    plan = SyncPlan(bridge, recipe, train, 2, 4)
    shards = shard_state(bridge, recipe, full, train)
    a = dict(simulate(plan, shards, 3, copy=copy_segments))
    b = dict(simulate(plan, shards, 3, copy=copy_segments_reference, bucket_mb=0.01))
    assert sorted(a) == sorted(b)
    for name in a:
        assert_same_bytes(a[name], b[name], name)


# ------------------------------------------------------------------------------ bad input

class _RecordingEngine:
    def __init__(self, specs):
        self.specs, self.loaded = specs, []

    def weight_specs(self):
        return self.specs

    def update_weights(self, tensors):
        self.loaded += [name for name, _ in tensors]

    def weight_buffers(self):  # handed-over tensors only
        return {}


def _qwen3_tp1_sync():
    """A Qwen3 model's sync at TP 1 -> rollout TP 1 (reference copies) and its one rank's shards."""
    bridge, full, _ = _model("Qwen3ForCausalLM")
    recipe = PrecisionRecipe()
    plan = SyncPlan(bridge, recipe, ParallelLayout(1, 1), 1, 1)
    return bridge, plan, WeightSync(plan, 0, copy=copy_segments_reference), \
        shard_state(bridge, recipe, full, ParallelLayout(1, 1))[0]


def test_engine_mismatch_is_named_before_anything_is_written():
    bridge, plan, sync, shards = _qwen3_tp1_sync()
    specs = sync.engine_specs()
    name = "model.layers.1.mlp.up_proj.weight"
    wrong = dict(specs)
    wrong[name] = TensorMeta((512, 128), torch.float8_e4m3fn)
    engine = _RecordingEngine(wrong)
    with pytest.raises(ValueError, match=rf"{name} is \[512, 256\].*holds \[512, 128\]"):
        sync.check(shards, engine)
    missing = {k: v for k, v in specs.items() if k != name}
    with pytest.raises(ValueError, match=rf"{name} .* is not in the engine"):
        sync.check(shards, _RecordingEngine(missing))
    assert engine.loaded == []
    ok = _RecordingEngine(specs)
    sync.check(shards, ok)
    report = sync.sync(shards, ok)
    assert sorted(ok.loaded) == sorted(specs) and report.tensors == len(plan.names)


def test_kv_cache_scales_go_with_the_weights_under_vllms_names():
    bridge, plan, sync, shards = _qwen3_tp1_sync()
    layers = bridge.dims.num_layers
    names = kv_scale_names(layers)
    got = {}

    class Engine(_RecordingEngine):
        def update_weights(self, tensors):
            super().update_weights(tensors)
            got.update({n: float(t) for n, t in tensors if n in names})

    engine = Engine({**sync.engine_specs(), **{n: TensorMeta((), torch.float32) for n in names}})
    scales = torch.arange(1, 3 * layers + 1, dtype=torch.float32).reshape(layers, 3) / 1000
    sync.sync(shards, engine, kv_scales=scales)
    assert engine.loaded[-len(names):] == names  # after every weight
    assert got == {n: float(v) for n, v in zip(names, scales.flatten(), strict=True)}
    assert got["model.layers.1.self_attn.attn.k_scale"] == float(scales[1, 1])
    with pytest.raises(WeightMismatch, match="kv_scales has shape"):
        sync.sync(shards, engine, kv_scales=scales[:1])


def test_source_mismatch_is_named():
    _, _, sync, shards = _qwen3_tp1_sync()
    shards = dict(shards)
    name = "decoder.layers.0.mlp.linear_fc2.weight"
    shards[name] = shards[name]._replace(fp8=None)
    with pytest.raises(ValueError, match=f"{name} has no FP8 weight"):
        sync.check(shards)
    shards[name] = shards[name]._replace(dense=torch.zeros(3, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=rf"{name} is \[3, 3\]; the plan expects \[256, 512\]"):
        sync.check(shards)
    del shards[name]
    with pytest.raises(ValueError, match=f"no tensor {name}"):
        sync.check(shards)
    with pytest.raises(WeightMismatch):
        from megatron_jetrl.rollout.base import check_against_specs
        check_against_specs({}, {"x": TensorMeta((1,), torch.float32)}, what="t")


# ------------------------------------------------------------------------------ copy kernel

def _random_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    srcs = [torch.randint(0, 255, (int(n),), generator=g, dtype=torch.uint8) for n in (4096, 777, 12288)]
    srcs.append(torch.randn(64, 48, generator=g).to(torch.bfloat16))
    dsts = [torch.zeros(8192, dtype=torch.uint8), torch.zeros(3000, dtype=torch.uint8)]
    rows = []
    cursor = [0, 0]
    for _ in range(40):
        s = int(torch.randint(0, len(srcs), (1,), generator=g))
        size = srcs[s].numel() * srcs[s].element_size()
        row_bytes = int(torch.randint(1, 48, (1,), generator=g)) * (16 if seed % 2 else 1)
        n_rows = int(torch.randint(1, 5, (1,), generator=g))
        s_stride = row_bytes + int(torch.randint(0, 3, (1,), generator=g)) * 16
        if (n_rows - 1) * s_stride + row_bytes > size:
            continue
        s_off = int(torch.randint(0, size - (n_rows - 1) * s_stride - row_bytes + 1, (1,), generator=g))
        d = s % 2
        if cursor[d] + n_rows * row_bytes > dsts[d].numel():
            continue
        rows.append([s, s_off, s_stride, d, cursor[d], row_bytes, row_bytes, n_rows])
        cursor[d] += n_rows * row_bytes
    return srcs, dsts, torch.tensor(rows, dtype=torch.long)


@pytest.mark.parametrize("seed", range(4))
def test_copy_segments_kernel_equals_reference(seed):
    srcs, dsts, table = _random_case(seed)
    expected = [d.clone() for d in dsts]
    copy_segments_reference(srcs, expected, table)
    copy_segments(srcs, dsts, table)
    for a, e in zip(dsts, expected, strict=True):
        assert torch.equal(a, e)
    assert any(int(d.sum()) for d in dsts)


def test_copy_segments_reference_respects_view_offsets():
    base = torch.arange(32, dtype=torch.uint8)
    src, dst = base[8:16], torch.zeros(16, dtype=torch.uint8)
    table = torch.tensor([[0, 2, 4, 0, 1, 4, 2, 2]])
    copy_segments_reference([src], [dst], table)
    ref = torch.zeros(16, dtype=torch.uint8)
    copy_segments([src], [ref], table)
    assert dst.tolist() == ref.tolist() == [0, 10, 11, 0, 0, 14, 15] + [0] * 9


def test_copy_segments_validates_before_copying():
    src, dst = torch.zeros(64, dtype=torch.uint8), torch.zeros(32, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="segment 0 writes up to byte 40 of a destination of 32 bytes"):
        copy_segments([src], [dst], torch.tensor([[0, 0, 8, 0, 0, 8, 8, 5]]))
    with pytest.raises(RuntimeError, match="segment 1 reads up to byte 72"):
        copy_segments([src], [dst], torch.tensor([[0, 0, 8, 0, 0, 8, 8, 1], [0, 64, 8, 0, 8, 8, 8, 1]]))
    with pytest.raises(RuntimeError, match="src id 3 out of range"):
        copy_segments([src], [dst], torch.tensor([[3, 0, 8, 0, 0, 8, 8, 1]]))
    with pytest.raises(RuntimeError, match="must be contiguous"):
        copy_segments([torch.zeros(8, 8, dtype=torch.uint8).t()], [dst], torch.tensor([[0, 0, 8, 0, 0, 8, 8, 1]]))
    with pytest.raises(RuntimeError, match="CPU int64 tensor"):
        copy_segments([src], [dst], torch.zeros(1, 7, dtype=torch.long))
    assert int(dst.sum()) == 0


class _BufferEngine(_RecordingEngine):
    """An in-process engine offering its own tensors for in-place writes (all but one)."""

    def __init__(self, specs, skip):
        super().__init__(specs)
        self.buffers = {n: torch.zeros(m.shape, dtype=m.dtype) for n, m in specs.items() if n != skip}

    def weight_buffers(self):
        return self.buffers


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "LlamaForCausalLM"])
def test_in_place_sync_writes_the_engine_buffers(arch):
    """With weight_buffers() the kernels write straight into the engine, re-quantized tensors
    (Llama's k/v) are copied in after quantization, and only a tensor the engine does not offer
    goes through update_weights."""
    bridge, full, hf = _model(arch)
    recipe = PrecisionRecipe()
    plan = SyncPlan(bridge, recipe, ParallelLayout(1, 1), 1, 1)
    sync = WeightSync(plan, 0, copy=copy_segments_reference, bucket_mb=0.05)
    skip = "model.layers.0.mlp.up_proj.weight_scale_inv"
    engine = _BufferEngine(sync.engine_specs(), skip)
    report = sync.sync(shard_state(bridge, recipe, full, ParallelLayout(1, 1))[0], engine)
    assert report.in_place == len(sync.engine_specs()) - 1
    expected = _expected(bridge, recipe, hf, 1, 0)
    assert engine.loaded == [skip]
    assert (arch == "LlamaForCausalLM") == bool(plan.requantized)
    for name, t in expected.items():
        if name != skip:
            assert_same_bytes(engine.buffers[name], t, name)
