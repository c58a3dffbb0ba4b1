"""Decoding for the ``hf`` rollout engine: batched generation from its transformers model.

Decoding runs the transformers model one token at a time over a KV cache of its own
(``SlotKvCache``). Prompts are left-padded, so slot ``s`` of every row holds column ``s`` of the
padded batch and one write position serves the whole batch: no per-row indexing, no per-step
allocation, and (on CUDA) a decode step that is captured once per batch as a CUDA graph and
replayed. Stops are checked on the device; the host looks every ``STOP_CHECK_EVERY`` steps, and
then also drops finished rows from the batch once they are half of it.

``generate_samples`` cuts the rows (prompt x sample) into batches within ``HfOptions``' budgets,
longest prompt first; one prefill serves all samples of a prompt. The model must be built with
attention implementation ``ATTENTION`` (``slot_attention``, registered with transformers'
``AttentionInterface``); this module needs nothing else of it but its transformers forward.

Shape legend: B rows of a batch (prompt x sample), U distinct prompts of a batch, L padded prompt
length, S cache slots (L + max_new_tokens - 1), V vocab, H KV heads, G query heads per KV head,
D head dim, T max_new_tokens.
"""

from __future__ import annotations

from typing import Iterator

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from megatron_jetrl.models import ModelDims
from megatron_jetrl.rollout.base import Sample, SamplingParams
from megatron_jetrl.rollout.settings import HfOptions

ATTENTION = "jetrl_slot_attention"
"""Name under which ``slot_attention`` is registered with transformers' ``AttentionInterface``."""

STOP_CHECK_EVERY = 16
"""Decode steps between the host's looks at the device-side finished mask (one sync each)."""


class SlotKvCache:
    """The KV cache of one left-padded batch, duck-typing the part of transformers' ``Cache`` the
    Llama / Qwen2 / Qwen3 attention calls (``update``).

    ``k[layer]``, ``v[layer]``: [B, H, S, D] in the model dtype, allocated once. During a prefill
    (``prefill_rows``) the attention sees the prefill batch's own keys and values, and each batch row
    gets its prompt's (one prefill serves all samples of a prompt). During decoding, every row writes
    slot ``write_pos`` (a device tensor, so a captured step replays at later slots) and attends over
    all S slots; the attention mask hides padding and slots not yet written.
    """

    def __init__(self, num_layers: int, rows: int, heads: int, slots: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (rows, heads, slots, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.write_pos = torch.zeros(1, dtype=torch.long, device=device)
        self._prefill: tuple[torch.Tensor, torch.Tensor] | None = None

    def prefill_rows(self, rows: torch.Tensor | None, src: torch.Tensor | None) -> None:
        """Next forwards are a prefill whose row ``src[i]`` fills batch row ``rows[i]``; None ends it."""
        self._prefill = None if rows is None else (rows, src)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self._prefill is not None:
            rows, src = self._prefill
            length = key_states.shape[2]
            self.k[layer_idx][:, :, :length].index_copy_(0, rows, key_states.index_select(0, src))
            self.v[layer_idx][:, :, :length].index_copy_(0, rows, value_states.index_select(0, src))
            return key_states, value_states
        self.k[layer_idx].index_copy_(2, self.write_pos, key_states)
        self.v[layer_idx].index_copy_(2, self.write_pos, value_states)
        return self.k[layer_idx], self.v[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise RuntimeError("SlotKvCache needs explicit position_ids")

    def keep_rows(self, keep: torch.Tensor) -> None:
        self.k = [t.index_select(0, keep) for t in self.k]
        self.v = [t.index_select(0, keep) for t in self.v]


def slot_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention for the engine's model: transformers' SDPA for a prefill; for a decode step (one
    query per row) the G query heads of each KV head are laid out as G queries, so SDPA reads the
    cache once instead of through transformers' per-step ``repeat_kv`` copy of it (G times the
    cache's bytes, more than the weights at long context)."""
    if query.shape[2] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    B, Hq, _, D = query.shape
    H = key.shape[1]
    q = query.reshape(B, H, Hq // H, D)
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(B, Hq, 1, D).transpose(1, 2).contiguous(), None


def generate_samples(model, prompts: list[torch.Tensor], sampling: SamplingParams, *, dims: ModelDims,
                     options: HfOptions, dtype: torch.dtype, device: torch.device) -> list[Sample]:
    """``sampling.n`` samples of every prompt (checked CPU LongTensors) from ``model`` (in ``dtype``
    on ``device``), decoded in batches within ``options``' budgets; one ``Sample`` per row, rows in
    prompt order."""
    n, T = sampling.n, sampling.max_new_tokens
    rows = [i for i in range(len(prompts)) for _ in range(n)]
    order = sorted(range(len(rows)), key=lambda r: -len(prompts[rows[r]]))
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator(device=device).manual_seed(sampling.seed)
    out: list[Sample | None] = [None] * len(rows)
    with torch.inference_mode():
        for chunk in _chunks(order, [len(prompts[rows[r]]) for r in range(len(rows))], T, options):
            tokens, logprobs, lengths = _generate_batch(model, [prompts[rows[r]] for r in chunk], sampling,
                                                        generator, dims=dims, options=options, dtype=dtype,
                                                        device=device)
            for k, r in enumerate(chunk):
                m = lengths[k]
                stopped = m < T or tokens[k][m - 1] in sampling.stop_token_ids
                out[r] = Sample(prompt_index=rows[r], tokens=tokens[k][:m], logprobs=logprobs[k][:m],
                                finish_reason="stop" if stopped else "length")
    return out


def _chunks(order: list[int], lengths: list[int], T: int, options: HfOptions) -> Iterator[list[int]]:
    """Rows in ``order`` (longest prompt first) cut into batches within the row and slot budgets."""
    chunk: list[int] = []
    for r in order:
        slots = (lengths[chunk[0]] if chunk else lengths[r]) + T - 1
        if chunk and (len(chunk) == options.max_num_seqs or (len(chunk) + 1) * slots > options.max_batch_tokens):
            yield chunk
            chunk = []
        chunk.append(r)
    if chunk:
        yield chunk


def _generate_batch(model, prompts: list[torch.Tensor], sampling: SamplingParams, generator, *, dims: ModelDims,
                    options: HfOptions, dtype: torch.dtype, device: torch.device):
    """Decode one batch (rows of equal prompts adjacent); returns host lists of tokens,
    logprobs and lengths per row."""
    T = sampling.max_new_tokens
    B = len(prompts)
    lens = torch.tensor([p.numel() for p in prompts], device=device)
    L = max(p.numel() for p in prompts)
    S = L + T - 1
    cache = SlotKvCache(dims.num_layers, B, dims.num_groups, S, dims.head_dim, dtype, device)
    key_valid = torch.zeros(B, S, dtype=torch.bool, device=device)
    key_valid[:, :L] = torch.arange(L, device=device) >= (L - lens)[:, None]
    logits = _prefill(model, cache, prompts, L, vocab_size=dims.vocab_size,
                      max_prefill_tokens=options.max_prefill_tokens, device=device)

    tokens = torch.zeros(B, T, dtype=torch.long, device=device)
    logprobs = torch.zeros(B, T, dtype=torch.float32, device=device)
    lengths = torch.full((B,), T, dtype=torch.long, device=device)
    stops = torch.tensor(sampling.stop_token_ids, dtype=torch.long, device=device)
    active = torch.arange(B, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    step = _DecodeStep(model, cache, key_valid, use_graph=options.cuda_graphs and device.type == "cuda")
    for t in range(T):
        if t > 0:
            logits = step.run()
        tok, lp = sample_tokens(logits, sampling, generator)
        tokens[:, t].index_copy_(0, active, tok)
        logprobs[:, t].index_copy_(0, active, lp)
        if stops.numel():
            hit = torch.isin(tok, stops) & ~done
            lengths.index_copy_(0, active, torch.where(hit, t + 1, lengths.index_select(0, active)))
            done |= hit
        if t == T - 1:
            break
        step.feed(tok, lens if t == 0 else None, slot=L + t)
        if stops.numel() and (t + 1) % STOP_CHECK_EVERY == 0:
            left = int((~done).sum())
            if left == 0:
                break
            if left <= done.numel() // 2:
                keep = (~done).nonzero().squeeze(1)
                active, done, lens = active[keep], done[keep], lens[keep]
                step.keep_rows(keep)
    return tokens.tolist(), logprobs.tolist(), lengths.tolist()


def _prefill(model, cache: SlotKvCache, prompts: list[torch.Tensor], L: int, *, vocab_size: int,
             max_prefill_tokens: int, device: torch.device) -> torch.Tensor:
    """Run each distinct prompt once (left-padded to L, in forwards of at most
    ``max_prefill_tokens`` padded tokens); fill every row's cache; last-token logits [B, V] fp32."""
    distinct: list[torch.Tensor] = []
    src = []  # row -> its prompt's index in ``distinct`` (equal prompts are adjacent rows)
    for r, p in enumerate(prompts):
        if not (r > 0 and (prompts[r - 1] is p or torch.equal(prompts[r - 1], p))):
            distinct.append(p)
        src.append(len(distinct) - 1)
    src_B = torch.tensor(src, device=device)
    logits_BV = torch.empty(len(prompts), vocab_size, dtype=torch.float32, device=device)
    group = max(1, max_prefill_tokens // L)
    causal = torch.ones(L, L, dtype=torch.bool, device=device).tril_()
    diag = torch.eye(L, dtype=torch.bool, device=device)
    for g0 in range(0, len(distinct), group):
        batch = distinct[g0 : g0 + group]
        ids = torch.zeros(len(batch), L, dtype=torch.long)
        for u, p in enumerate(batch):
            ids[u, L - p.numel() :] = p
        lens = torch.tensor([p.numel() for p in batch], device=device)
        valid = torch.arange(L, device=device) >= (L - lens)[:, None]
        positions = (valid.cumsum(-1) - 1).clamp_min_(0)
        # Pad queries attend to themselves only: a fully masked row would make NaNs.
        mask = causal & (valid[:, None, :] | diag)
        rows = ((src_B >= g0) & (src_B < g0 + len(batch))).nonzero().squeeze(1)
        rows_src = src_B[rows] - g0
        cache.prefill_rows(rows, rows_src)
        out = model(input_ids=ids.to(device), attention_mask=mask[:, None], position_ids=positions,
                    past_key_values=cache, use_cache=True, logits_to_keep=1)
        logits_BV.index_copy_(0, rows, out.logits[:, -1].float().index_select(0, rows_src))
    cache.prefill_rows(None, None)
    return logits_BV


class _DecodeStep:
    """One decode forward over fixed input buffers: ``feed`` sets them, ``run`` returns the logits
    [B, V] fp32. On CUDA the forward is captured once as a graph (again after ``keep_rows``)."""

    def __init__(self, model, cache: SlotKvCache, key_valid_BS: torch.Tensor, *, use_graph: bool):
        self.model, self.cache, self.key_valid = model, cache, key_valid_BS
        B, dev = key_valid_BS.shape[0], key_valid_BS.device
        self.input_ids = torch.zeros(B, 1, dtype=torch.long, device=dev)
        self.positions = torch.zeros(B, 1, dtype=torch.long, device=dev)
        self.use_graph = use_graph
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def feed(self, tokens_B: torch.Tensor, positions_B: torch.Tensor | None, *, slot: int) -> None:
        """The sampled tokens as the next input, at ``positions_B`` (None: one past the last)."""
        self.input_ids.copy_(tokens_B[:, None])
        if positions_B is None:
            self.positions.add_(1)
        else:
            self.positions.copy_(positions_B[:, None])
        self.cache.write_pos.fill_(slot)
        self.key_valid[:, slot] = True

    def keep_rows(self, keep: torch.Tensor) -> None:
        self.cache.keep_rows(keep)
        self.key_valid = self.key_valid.index_select(0, keep)
        self.input_ids = self.input_ids.index_select(0, keep)
        self.positions = self.positions.index_select(0, keep)
        self.graph = self.logits = None

    def _forward(self) -> torch.Tensor:
        out = self.model(input_ids=self.input_ids, attention_mask=self.key_valid[:, None, None, :],
                         position_ids=self.positions, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float()

    def run(self) -> torch.Tensor:
        if not self.use_graph:
            return self._forward()
        if self.graph is None:
            # Warm-up forwards on a side stream (allocator, cuBLAS workspaces) before the capture; a
            # forward only rewrites the slot it reads, so repeating one is harmless.
            side = torch.cuda.Stream(self.input_ids.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self._forward()
        self.graph.replay()
        return self.logits


def sample_tokens(logits_BV: torch.Tensor, sampling: SamplingParams,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from fp32 logits, and its logprob under the raw logits (before
    temperature, top-k and top-p). Sampling draws ``argmax(p / E)``, E ~ Exp(1) per entry, which
    picks index i with probability p_i and needs no host sync. Temperature 0 and top_k 1 are greedy
    (the first of tied maxima); top-k keeps ties with the k-th logit; top-p keeps the fewest most
    likely tokens whose mass reaches top_p (ties in index order)."""
    raw_logprobs = torch.log_softmax(logits_BV, dim=-1)
    if sampling.temperature == 0 or sampling.top_k == 1:
        tok = logits_BV.argmax(dim=-1)
    else:
        x = logits_BV / sampling.temperature
        V = x.shape[-1]
        if 0 < sampling.top_k < V:
            kth = torch.topk(x, sampling.top_k, dim=-1).values[:, -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if sampling.top_p < 1:
            sorted_x, idx = torch.sort(x, dim=-1, descending=True, stable=True)
            probs = torch.softmax(sorted_x, dim=-1)
            drop = (probs.cumsum(dim=-1) - probs) > sampling.top_p
            x = x.scatter(-1, idx, sorted_x.masked_fill(drop, float("-inf")))
        probs = torch.softmax(x, dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(torch.finfo(torch.float32).tiny)
        tok = (probs / noise).argmax(dim=-1)
    return tok, raw_logprobs.gather(-1, tok[:, None]).squeeze(1)


__all__ = ["ATTENTION", "STOP_CHECK_EVERY", "SlotKvCache", "generate_samples", "sample_tokens", "slot_attention"]
