"""The exact engine's fusion pass (``rollout/vllm_fusion.py``) on graphs traced here, on the CPU: a
norm or SiLU·mul whose only use is the 1x128 quantization becomes the fused op, with every output
(codes, scales, the residual sum) wired to where the two ops' outputs went, and the rewritten graph
computes the same bytes; a value used elsewhere too is left alone. That the fused kernels equal the
two kernels on a GPU is tests/gpu/test_exact_kernels.py; that vLLM runs the pass, tests/gpu/test_exact.py."""

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from megatron_jetrl.ops.exact import custom_ops
from megatron_jetrl.ops.extension import load_extension
from megatron_jetrl.rollout.vllm_fusion import fuse_quantizations
from megatron_jetrl.rollout.vllm_activation_quant import quantize_rows_op

load_extension()  # the ops' CPU paths run the extension's CPU kernels (built by the install, as in CI)

OPS = custom_ops()
QUANT = quantize_rows_op()
H, I = 256, 384
EPS = 1e-6


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(6, H, generator=g) * 3).to(torch.bfloat16)
    r = torch.randn(6, H, generator=g).to(torch.bfloat16)
    w = (torch.rand(H, generator=g) + 0.5).to(torch.bfloat16)
    gu = (torch.randn(6, 2 * I, generator=g) * 2).to(torch.bfloat16)
    return x, r, w, gu


def decoder_piece(x, r, w, gu):
    """What an exact engine's compiled piece holds: the first layer's norm, a residual norm, SiLU·mul,
    each followed by the quantization of a block-FP8 linear (through a same-shape view, as vLLM's
    linear reshapes its input)."""
    q0, s0 = QUANT(OPS.rms_norm(x, w, EPS).view(-1, H), False, 0.0, 4)
    normed, total = OPS.add_rms_norm(x, r, w, EPS)
    q1, s1 = QUANT(normed.view(-1, H), False, 0.0, 4)
    q2, s2 = QUANT(OPS.silu_mul(gu), False, 0.0, 1)
    return q0, s0, q1, s1, total, q2, s2


def _targets(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def _same(a, b) -> bool:
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b) and a.stride() == b.stride()


def test_each_norm_and_activation_before_a_quantization_becomes_one_fused_op():
    inputs = _inputs()
    gm = make_fx(decoder_piece)(*inputs)
    want = gm(*inputs)
    counts = fuse_quantizations(gm.graph, OPS, QUANT)
    gm.graph.lint()
    gm.recompile()
    assert counts == {"rms_norm": 1, "add_rms_norm": 1, "silu_mul": 1}
    targets = _targets(gm)
    assert not any(t.startswith(("jetrl.quantize_1x128_rows", "jetrl.rms_norm.", "jetrl.add_rms_norm.",
                                 "jetrl.silu_mul.")) for t in targets), targets
    assert {"jetrl.rms_norm_quant.default", "jetrl.add_rms_norm_quant.default",
            "jetrl.silu_mul_quant.default"} <= set(targets)
    got = gm(*inputs)
    assert all(_same(a, b) for a, b in zip(got, want, strict=True))  # codes, scales (and their layout), the sum


def test_a_value_used_elsewhere_too_is_not_fused():
    """The norm's BF16 output also leaves the piece (as the final norm feeds the LM head): fusing would
    drop it, so the graph keeps both kernels; the SiLU·mul beside it is still fused."""
    def piece(x, r, w, gu):
        normed, total = OPS.add_rms_norm(x, r, w, EPS)
        q, s = QUANT(normed, False, 0.0, 4)
        q2, s2 = QUANT(OPS.silu_mul(gu), False, 0.0, 1)
        return q, s, normed, total, q2, s2

    inputs = _inputs()
    gm = make_fx(piece)(*inputs)
    want = gm(*inputs)
    counts = fuse_quantizations(gm.graph, OPS, QUANT)
    gm.recompile()
    assert counts == {"rms_norm": 0, "add_rms_norm": 0, "silu_mul": 1}
    assert "jetrl.add_rms_norm.default" in _targets(gm) and "jetrl.quantize_1x128_rows.default" in _targets(gm)
    assert all(_same(a, b) for a, b in zip(gm(*inputs), want, strict=True))


def test_the_residual_sum_may_be_unused():
    def piece(x, r, w, gu):
        normed, _ = OPS.add_rms_norm(x, r, w, EPS)
        return QUANT(normed, True, 1e-12, 1)

    inputs = _inputs()
    gm = make_fx(piece)(*inputs)
    want = gm(*inputs)
    assert fuse_quantizations(gm.graph, OPS, QUANT)["add_rms_norm"] == 1
    gm.recompile()
    assert all(_same(a, b) for a, b in zip(gm(*inputs), want, strict=True))  # pow2 scales and eps passed on


def attention_piece(qkv, positions, wq, wk, inv_freq):
    """vLLM's Qwen3 attention up to the attention op, as its exact engine compiles it: q, k, v split from
    qkv (strided column slices), each head of q and k normed by the exact norm (on a [T, H, D] view, viewed
    back) and both rotated by the exact rope."""
    q, k, v = qkv.split([4 * 128, 2 * 128, 2 * 128], dim=-1)
    qn = OPS.rms_norm(q.view(q.shape[0], 4, 128), wq, EPS).view(q.shape)
    kn = OPS.rms_norm(k.view(k.shape[0], 2, 128), wk, EPS).view(k.shape)
    qr, kr = OPS.rope(positions, qn, kn, inv_freq)
    return qr, kr, v


def test_q_and_k_norms_and_their_rotation_become_one_fused_op():
    from megatron_jetrl.ops.exact import rope_inv_freq
    from megatron_jetrl.rollout.vllm_fusion import fuse_qk_norm_rope

    g = torch.Generator().manual_seed(1)
    qkv = (torch.randn(7, 8 * 128, generator=g) * 2).to(torch.bfloat16)
    positions = torch.tensor([0, 1, 2, 50, 51, 900, 4095])
    wq, wk = ((torch.rand(128, generator=g) + 0.5).to(torch.bfloat16) for _ in range(2))
    inv_freq = rope_inv_freq(128, 1e6, torch.device("cpu"))
    inputs = (qkv, positions, wq, wk, inv_freq)
    gm = make_fx(attention_piece)(*inputs)
    want = gm(*inputs)
    assert fuse_qk_norm_rope(gm.graph, OPS) == 1
    gm.graph.lint()
    gm.recompile()
    targets = _targets(gm)
    assert "jetrl.qk_norm_rope.default" in targets
    assert not any(t.startswith(("jetrl.rms_norm.", "jetrl.rope.")) for t in targets), targets
    got = gm(*inputs)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_norm_used_elsewhere_keeps_the_q_k_path_as_it_is():
    from megatron_jetrl.ops.exact import rope_inv_freq
    from megatron_jetrl.rollout.vllm_fusion import fuse_qk_norm_rope

    def piece(qkv, positions, wq, wk, inv_freq):
        q, k, _ = qkv.split([4 * 128, 2 * 128, 2 * 128], dim=-1)
        qn = OPS.rms_norm(q.view(q.shape[0], 4, 128), wq, EPS)
        kn = OPS.rms_norm(k.view(k.shape[0], 2, 128), wk, EPS).view(k.shape)
        qr, kr = OPS.rope(positions, qn.view(q.shape), kn, inv_freq)
        return qr, kr, qn  # the normed q also leaves the piece

    g = torch.Generator().manual_seed(2)
    inputs = ((torch.randn(3, 8 * 128, generator=g)).to(torch.bfloat16), torch.tensor([4, 5, 6]),
              torch.ones(128, dtype=torch.bfloat16), torch.ones(128, dtype=torch.bfloat16),
              rope_inv_freq(128, 1e4, torch.device("cpu")))
    gm = make_fx(piece)(*inputs)
    assert fuse_qk_norm_rope(gm.graph, OPS) == 0
