"""Shared test helpers: byte comparison and hand-made adversarial inputs."""

from __future__ import annotations

import torch

from megatron_jetrl.ops import quantize_1x128, quantize_128x128
from megatron_jetrl.precision import quantize_fp8_blockwise


def assert_same_bytes(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Codes equal byte for byte; fp32 scales equal bit for bit, NaN where the other has NaN
    (NaN payloads carry no meaning and are not compared)."""
    shapes = tuple(actual.shape), tuple(expected.shape)
    assert shapes[0] == shapes[1], f"{what}: shape {shapes[0]} != {shapes[1]}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a, e = actual.detach().cpu().contiguous(), expected.detach().cpu().contiguous()
    if a.dtype == torch.float8_e4m3fn:
        diff = (a.view(torch.uint8) != e.view(torch.uint8)).nonzero()
        assert diff.numel() == 0, f"{what}: {diff.shape[0]} codes differ, first at {diff[0].tolist()}"
        return
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    assert torch.equal(nan_a, nan_e), f"{what}: NaN positions differ"
    bits_a = a.masked_fill(nan_a, 0).view(torch.int32)
    bits_e = e.masked_fill(nan_e, 0).view(torch.int32)
    diff = (bits_a != bits_e).nonzero()
    assert diff.numel() == 0, (
        f"{what}: {diff.shape[0]} values differ, first at {diff[0].tolist()}: "
        f"{a[tuple(diff[0])].item()!r} vs {e[tuple(diff[0])].item()!r}"
    )


E4M3_BOUNDARY_VALUES = [
    448.0, -448.0, 416.0, 432.0, 440.0,  # the largest codes and the 416|448 midpoint 432
    1.0, 1.0625, 1.125, 1.1875,  # 1.0625 is the 1.0/1.125 midpoint: ties to even (1.0)
    2.0 ** -6, 2.0 ** -7, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -11,  # e4m3 subnormal range
    0.0, -0.0,
]


def adversarial_matrix(dtype: torch.dtype) -> torch.Tensor:
    """A [259, 389] matrix (partial tail blocks on both dims) holding the cases the quantizer must
    get exactly right: an all-zero 128x128 block, the dtype's largest finite value, a block whose
    amax is so small that 448/amax overflows fp32 (or nearly), subnormals next to normals, exact
    e4m3 grid values and ties with amax exactly 448, and NaN, +Inf, -Inf in different blocks."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(259, 389, generator=g, dtype=torch.float32)
    info = torch.finfo(dtype)
    x[0:128, 0:128] = 0.0
    x[0:64:2, 0:128] = -0.0
    x[130, 5] = info.max
    x[131, 0:128] = info.max / 3
    tiny = info.smallest_normal * info.eps  # the smallest subnormal of dtype
    x[128:256, 128:256] = tiny * torch.randint(-3, 4, (128, 128), generator=g, dtype=torch.float32)
    x[3, 128:256] = tiny * torch.arange(128, dtype=torch.float32)
    x[3, 200] = 1.0
    row = torch.tensor(E4M3_BOUNDARY_VALUES, dtype=torch.float32)
    x[4, 256 : 256 + row.numel()] = row
    x[4, 256 + row.numel() : 384] = 0.5
    x[5, 130] = float("nan")
    x[200, 300] = float("inf")
    x[258, 388] = float("-inf")
    x[0:128, 384:389] = 0.0
    return x.to(dtype)


def assert_kernels_match_reference(x: torch.Tensor, pow2: bool, eps: float, references=None) -> None:
    """Every output of both kernels, in every mode, equals ``quantize_fp8_blockwise`` of each
    tensor in ``references`` (default: x itself; the GPU tests add x.cpu())."""
    kw = {"pow2_scales": pow2, "eps": eps}
    row, col = quantize_1x128(x, rowwise=True, columnwise=True, **kw)
    only_row, none_col = quantize_1x128(x, rowwise=True, columnwise=False, **kw)
    none_row, only_col = quantize_1x128(x, rowwise=False, columnwise=True, **kw)
    assert none_col is None and none_row is None
    assert row.block_shape == col.block_shape == (1, 128)
    blocks, transposed = quantize_128x128(x, with_transpose=True, **kw)
    only_blocks, none_t = quantize_128x128(x, with_transpose=False, **kw)
    assert none_t is None
    for ref in references if references is not None else (x,):
        data, scale = quantize_fp8_blockwise(ref, (1, 128), **kw)
        data_t, scale_t = quantize_fp8_blockwise(ref.t(), (1, 128), **kw)
        for got, what in ((row, "rowwise"), (only_row, "rowwise-only")):
            assert_same_bytes(got.data, data, f"{what} codes")
            assert_same_bytes(got.scale_inv, scale, f"{what} scale_inv")
        for got, what in ((col, "columnwise"), (only_col, "columnwise-only")):
            assert_same_bytes(got.data, data_t, f"{what} codes")
            assert_same_bytes(got.scale_inv, scale_t, f"{what} scale_inv")
        data, scale = quantize_fp8_blockwise(ref, (128, 128), **kw)
        data_t, scale_t = quantize_fp8_blockwise(ref.t(), (128, 128), **kw)
        for got, what in ((blocks, "block"), (only_blocks, "block without transpose")):
            assert_same_bytes(got.data, data, f"{what} codes")
            assert_same_bytes(got.scale_inv, scale, f"{what} scale_inv")
        assert_same_bytes(transposed.data, data_t, "transposed block codes")
        assert_same_bytes(transposed.scale_inv, scale_t, "transposed block scale_inv")


WORDS = ["<unk>", "<eos>", "<|user|>", "<|system|>", "<|assistant|>", "what", "is", "2+2", "3+3", "?",
         "be", "brief", "a", "very", "long", "question"]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
ID = {w: i for i, w in enumerate(WORDS)}


def tiny_hf_tokenizer(directory, chat_template=TEMPLATE) -> str:
    """A word-level HF tokenizer saved to ``directory``, built offline with ``tokenizers``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(ID, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    kwargs = {"chat_template": chat_template} if chat_template else {}
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", unk_token="<unk>", **kwargs).save_pretrained(
        directory)
    return str(directory)


def run_ranks(target, world: int, *args, timeout: float = 240.0) -> list[tuple]:
    """Run ``target(rank, *args, results)`` in ``world`` spawned processes (a gloo or NCCL job of
    tests/dist and tests/gpu); each worker puts one tuple whose first item is its rank on
    ``results``. Returns those tuples in rank order; workers still running after a timeout are
    terminated."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(rank, *args, results)) for rank in range(world)]
    for p in procs:
        p.start()
    try:
        return sorted((results.get(timeout=timeout) for _ in procs), key=lambda o: o[0])
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
