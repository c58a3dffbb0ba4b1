"""Batch-invariant RMSNorm (csrc/rms_norm*): one definition of the norm for vLLM and the trainer.

Why: a fused RMSNorm picks its reduction split by the number of rows in the call, so a token's
normalized activations (and from there its logprobs) change with the batch it happens to share,
and vLLM's rollout and the trainer's forward see different batches. Here a row's bits depend on
that row alone, through one fixed order of float operations, written below. vLLM (as a custom op)
and the trainer both call this kernel, so the two compute identical bits; ``rms_norm_reference``
follows the same order in plain torch, so the CPU tests and the GPU tests can compare bit for bit.

Inputs: x [R, H] (the op) or [..., H] (these functions), bfloat16, float16 or float32, the last
dim contiguous, any row stride; weight [H], x's dtype, contiguous; H a positive multiple of 128;
eps a float >= 0, used as float32. Output: a new contiguous tensor of x's shape and dtype.

The arithmetic, per row (every operation is IEEE fp32 with one round-to-nearest-even, products
and sums never fused into one FMA):

1. 128 lanes. Lane t (0..127) starts from acc = sq(x[t]) and then adds, in order,
   sq(x[t + 128]), sq(x[t + 256]), ..., where sq(v) = float(v) * float(v) rounded to fp32.
2. A halving tree over the lanes: for s = 64, 32, 16, 8, 4, 2, 1: acc[t] = acc[t] + acc[t + s]
   for t < s. sum = acc[0].
3. mean = sum / H; inv = 1 / sqrt(mean + float32(eps)) with a correctly rounded sqrt and
   division (not an approximate rsqrt).
4. y = dtype(float(dtype(float(x) * inv)) * float(weight)): the normalized value is rounded to
   x's dtype, then multiplied by the weight in fp32 and rounded again (no-ops for fp32). This is
   the rounding of the Hugging Face Llama/Qwen RMSNorm (``weight * hidden.to(input_dtype)``).

The CUDA kernel runs one block of 128 threads per row (lane = thread, the tree through shared
memory then warp shuffles); the C++ CPU kernel runs the same steps in loops.
"""

from __future__ import annotations

import torch

from megatron_jetrl.ops.extension import load_extension

LANES = 128
"""Partial sums per row; H must be a multiple of it."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The kernel on x [..., H] (leading dims flattened, copied only if they cannot be viewed as rows)."""
    H = _hidden_size(x)
    y_RH = load_extension().rms_norm(x.reshape(-1, H), weight, float(eps))
    return y_RH.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``, the sum a plain add of x's dtype (torch's, one
    rounding). On CUDA one launch (the kernel stores the sum, then norms it); elsewhere the add, then
    ``rms_norm``. x and residual of one shape [..., H] and dtype."""
    H = _hidden_size(x)
    if x.shape != residual.shape:
        raise ValueError(f"add_rms_norm: residual must have x's shape {tuple(x.shape)}; got {tuple(residual.shape)}")
    if not x.is_cuda:
        total = x + residual
        return rms_norm(total, weight, eps), total
    y_RH, total_RH = load_extension().add_rms_norm(x.reshape(-1, H), residual.reshape(-1, H), weight, float(eps))
    return y_RH.view(x.shape), total_RH.view(x.shape)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The documented arithmetic in eager torch, on any device: equal bit for bit to ``rms_norm``.

    Two torch shortcuts are avoided on purpose, each of which changes last bits:
    - CUDA torch turns a division by a Python scalar into a multiplication by its reciprocal, so
      every division here is tensor by tensor;
    - CPU torch's float32 sqrt (MKL's vector math) is not correctly rounded (about one result in
      six was off by an ulp on torch 2.13), so the sqrt runs in float64 and is rounded to float32,
      which gives the correctly rounded float32 sqrt (53 >= 2 * 24 + 2 bits: no double rounding).
    """
    H = _hidden_size(x)
    xf_RH = x.reshape(-1, H).float()
    sq_RJL = (xf_RH * xf_RH).view(-1, H // LANES, LANES)
    acc_RL = sq_RJL[:, 0]
    for j in range(1, H // LANES):
        acc_RL = acc_RL + sq_RJL[:, j]
    s = LANES // 2
    while s >= 1:
        acc_RL = acc_RL[:, :s] + acc_RL[:, s : 2 * s]
        s //= 2
    total_R = acc_RL[:, 0]
    mean_R = total_R / torch.full_like(total_R, H)
    root_R = torch.sqrt((mean_R + torch.full_like(mean_R, eps)).double()).float()
    inv_R = torch.ones_like(root_R) / root_R
    normed_RH = (xf_RH * inv_R[:, None]).to(x.dtype)
    return (normed_RH.float() * weight.float()).to(x.dtype).view(x.shape)


def _hidden_size(x: torch.Tensor) -> int:
    if x.dim() == 0:
        raise ValueError("rms_norm: x must have a last dim H; got a 0-d tensor")
    H = x.shape[-1]
    if H <= 0 or H % LANES:
        raise ValueError(f"rms_norm: H (x's last dim) must be a positive multiple of {LANES}; got H = {H}")
    return H


__all__ = ["LANES", "add_rms_norm", "rms_norm", "rms_norm_reference"]
