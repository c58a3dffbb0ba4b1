"""Where the engine-vs-trainer logprob gap comes from, measured: vLLM 0.26 and the trainer fed the same
tokens, compared op by op, and the exact rollout (``precision.exact``) taken apart one op at a time.

    python -m benchmarks.exact_ablation all [--models tiny,8b6] [--runs exact:fp8,...] [--work DIR]
                                            [--headline docs/results/headline.json]
    python -m benchmarks.exact_ablation table [--work DIR]

One process per (model, engine setting, precision mode) (vLLM's state lives for a process):

- engine settings: ``default`` (vLLM as it runs without the exact mode), ``batch_invariant``
  (``VLLM_BATCH_INVARIANT=1`` alone: vLLM's own batch-invariant kernels, the trainer unchanged) and
  ``exact`` (``precision.exact``: both sides on the same kernels);
- models: ``tiny`` (examples/configs/tiny_countdown.yaml's model: 4 layers, hidden 256) and ``8b6``
  (6 layers at Qwen3-8B widths, vocabulary 151,936); random weights from megatron's initialisation
  after three supervised steps (not vLLM's dummy weights, whose logits are uniform).

Each run: the trainer's weights synced into vLLM (eager: module hooks need it), vLLM samples at
temperature 1, the trainer recomputes every sampled token's logprob: k3 KL, max |Δlogp|, the
share of tokens whose fp32 logprob differs, token_mult_prob_error. Then one sequence is prefilled
by vLLM and run through the trainer with hooks on both models: every op's output of every layer
compared (max |Δ|, share of unequal elements) and the first op whose outputs differ named.
With the exact engine, the trainer swaps one op at a time back to its default kernel (the rest
stays exact) and the sampled tokens are scored again: how much each op alone contributes.

Each run samples the same prompts with ``--seeds`` seeds (default 3): the repeats of its mismatch
figures (the ablation and the per-op comparison use seed 1's samples).

Headline keys (written by ``all --headline``): ``vllm_k3_{fp8,mixed,bf16}_8b6`` (default engine),
``vllm_exact_max_abs_dlogp`` (the largest |Δlogp| over the exact runs and seeds; goal 0); the k3
keys are medians over the seeds, each key with its range.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.headline import command_line

ROOT = Path(__file__).resolve().parents[1]

MODELS = {"tiny": {"prompts": 64, "n": 4, "new_tokens": 95, "prompt_len": 32, "memory": 0.2, "lr": 1e-3},
          "8b6": {"prompts": 16, "n": 8, "new_tokens": 512, "prompt_len": 64, "memory": 0.25, "lr": 1e-4}}
"""Per model: sampled prompts x samples x new tokens (8b6: the shape of the step benchmark's
mismatch figures), prompt length, vLLM's share of the GPU, warm-up learning rate."""

RUNS = [("default", "bf16"), ("default", "fp8"), ("default", "bf16-train+fp8-rollout"),
        ("batch_invariant", "bf16"), ("batch_invariant", "fp8"), ("exact", "bf16"), ("exact", "fp8")]

ABLATIONS = ("rms_norm", "rope", "attention", "fp8_gemm", "bf16_gemm", "lm_head", "token_logprob")
"""Ops the exact trainer can swap back to its default kernel one at a time."""


def hf_config(model: str) -> dict:
    if model == "8b6":
        from benchmarks.model_shapes import qwen3_8b_shaped

        return qwen3_8b_shaped(6)
    from megatron_jetrl.job import load_job

    return load_job(ROOT / "examples/configs/tiny_countdown.yaml").model.hf_config_dict()


# ------------------------------------------------------------------------------------ one process


def warm_up_batch(vocab: int, seed: int, longest: int):
    import torch

    from megatron_jetrl.actor import PackedBatch

    g = torch.Generator().manual_seed(seed)
    lens = [min(n, longest) for n in (37, 128, 5, 300, 64, 91, 200, 17)]
    seqs = [torch.randint(0, vocab, (n,), generator=g) for n in lens]
    return PackedBatch.from_sequences(seqs, loss_mask=[torch.ones(n) for n in lens])


def score(actor, prompts, samples) -> tuple[dict, object]:
    """The trainer's logprobs of the samples against the engine's (mismatch metrics + exactness)."""
    import torch

    from megatron_jetrl.actor import PackedBatch
    from megatron_jetrl.algo import mismatch_metrics

    seqs = [torch.tensor(prompts[s.prompt_index] + s.tokens) for s in samples]
    masks = [torch.tensor([0.0] * len(prompts[s.prompt_index]) + [1.0] * len(s.tokens)) for s in samples]
    rollout = torch.cat([torch.tensor([0.0] * len(prompts[s.prompt_index]) + list(s.logprobs)) for s in samples])
    batch = PackedBatch.from_sequences(seqs, loss_mask=masks)
    lp = actor.compute_logprobs(batch).logprobs
    mask = batch.fields["loss_mask"]
    m = mismatch_metrics(lp, rollout, mask)
    keep = mask > 0
    m["unequal_share"] = m["rollout_corr/unequal_tokens"] / float(keep.sum())
    m["tokens"] = int(keep.sum())
    return m, batch


@contextlib.contextmanager
def trainer_default(actor, op: str):
    """Inside: the exact trainer computes ``op`` with its default (non-exact) kernel."""
    import torch.nn.functional as F

    from megatron_jetrl.actor.exact import ExactRMSNorm
    from megatron_jetrl.actor.layers import EXACT_ATTR, PackedCoreAttention, _Fp8LinearMixin
    from megatron_jetrl.actor.logprobs import vocab_parallel_logprobs

    undo = []
    gpt = actor.gpt
    if op == "rms_norm":
        for m in gpt.modules():
            if isinstance(m, ExactRMSNorm):
                m.forward = lambda x, m=m: F.rms_norm(x, (x.shape[-1],), m.weight, m.eps)
                undo.append(lambda m=m: vars(m).pop("forward"))
    elif op == "rope":
        base = getattr(actor.config, EXACT_ATTR)
        setattr(actor.config, EXACT_ATTR, None)
        undo.append(lambda: setattr(actor.config, EXACT_ATTR, base))
    elif op in ("attention", "fp8_gemm", "bf16_gemm"):
        for m in gpt.modules():
            pick = (isinstance(m, PackedCoreAttention) if op == "attention" else
                    isinstance(m, _Fp8LinearMixin) and m.fp8_enabled == (op == "fp8_gemm"))
            if pick:
                kernels, m.exact_kernels = m.exact_kernels, None
                undo.append(lambda m=m, k=kernels: setattr(m, "exact_kernels", k))
    elif op == "lm_head":
        bound = vars(gpt.output_layer).pop("_forward_impl")
        undo.append(lambda: setattr(gpt.output_layer, "_forward_impl", bound))
    elif op == "token_logprob":
        kernels = actor._exact

        def compiled(logits, ids):
            lp, _ = vocab_parallel_logprobs(logits, ids[:, 0], vocab_start=0, vocab_size=logits.shape[1],
                                            impl="compiled")
            return lp[:, None]

        actor._exact = dataclasses.replace(kernels, token_logprobs=compiled)
        undo.append(lambda: setattr(actor, "_exact", kernels))
    else:
        raise ValueError(f"unknown op {op!r}")
    try:
        yield bool(undo)
    finally:
        for f in undo:
            f()


LAYER_POINTS = (  # op: (vLLM module, what), (megatron module, what) inside layer i
    ("residual_in", ("input_layernorm", "out1"), ("", "in0")),
    ("input_norm", ("input_layernorm", "out0"), ("input_layernorm", "out")),
    ("q", ("self_attn.q_norm", "in0"), ("self_attention.q_layernorm", "in0")),
    ("k", ("self_attn.k_norm", "in0"), ("self_attention.k_layernorm", "in0")),
    ("q_norm", ("self_attn.q_norm", "out"), ("self_attention.q_layernorm", "out")),
    ("k_norm", ("self_attn.k_norm", "out"), ("self_attention.k_layernorm", "out")),
    ("q_rope", ("self_attn.attn", "in0"), ("self_attention.core_attention", "in0")),
    ("k_rope", ("self_attn.attn", "in1"), ("self_attention.core_attention", "in1")),
    ("v", ("self_attn.attn", "in2"), ("self_attention.core_attention", "in2")),
    ("attention", ("self_attn.attn", "out"), ("self_attention.core_attention", "out")),
    ("o_proj", ("self_attn.o_proj", "out0"), ("self_attention.linear_proj", "out0")),
    ("residual_mid", ("post_attention_layernorm", "out1"), ("pre_mlp_layernorm", "in0")),
    ("post_attn_norm", ("post_attention_layernorm", "out0"), ("pre_mlp_layernorm", "out")),
    ("gate_up", ("mlp.gate_up_proj", "out0"), ("mlp.linear_fc1", "out0")),
    ("silu_mul", ("mlp.act_fn", "out"), ("mlp.linear_fc2", "in0")),
    ("down", ("mlp.down_proj", "out0"), ("mlp.linear_fc2", "out0")),
)
"""Where each op's tensor is read on both sides (``captured``'s ``what``). vLLM's first input norm
takes no residual: there the residual is its input and its output is a tensor, not a pair."""


def _points(layers: int, side: int) -> list[tuple[str, str, str]]:
    """(op, module, what) on side 0 (vLLM's Qwen3) or 1 (megatron's GPTModel)."""
    prefix, first, last = (("model.layers", ("embedding", "model.embed_tokens", "out"), ("model.norm", "out0"))
                           if side == 0 else
                           ("decoder.layers", ("embedding", "embedding", "out"), ("decoder.final_layernorm", "out")))
    pts = [first]
    for i in range(layers):
        for op, *where in LAYER_POINTS:
            module, what = where[side]
            if side == 0 and i == 0 and op in ("residual_in", "input_norm"):
                what = {"out1": "in0", "out0": "out"}[what]
            pts.append((f"L{i}.{op}", f"{prefix}.{i}" + (f".{module}" if module else ""), what))
    return pts + [("final_norm", *last)]


@contextlib.contextmanager
def captured(model, points, tokens: int):
    """Record each point's tensor on the first call of its module inside the block: ``out`` (the
    output), ``outN`` (item N of a tuple output), ``inN`` (positional input N, or the
    ``hidden_states`` keyword); as [tokens, -1] fp32 on the CPU (the trainer's padding rows cut)."""
    import torch

    got: dict[str, torch.Tensor] = {}
    by_module: dict[str, list[tuple[str, str]]] = {}
    for op, module, what in points:
        by_module.setdefault(module, []).append((op, what))

    def pick(what, args, kwargs, out):
        if what == "out":
            return out[0] if isinstance(out, (tuple, list)) else out
        if what.startswith("out"):
            return out[int(what[3:])]
        i = int(what[2:])
        return args[i] if i < len(args) else kwargs["hidden_states"]

    handles = []
    for module, wants in by_module.items():
        def hook(_m, args, kwargs, out, wants=wants):
            for op, what in wants:
                if op not in got:
                    t = pick(what, args, kwargs, out).detach()
                    got[op] = t.reshape(t.shape[0], -1)[:tokens].float().cpu()
        handles.append(model.get_submodule(module).register_forward_hook(hook, with_kwargs=True))
    try:
        yield got
    finally:
        for h in handles:
            h.remove()


def op_diffs(theirs: dict, ours: dict, order: list[str]) -> dict:
    """Per op: max |Δ|, the share of unequal elements and the trainer's largest magnitude."""
    out = {}
    for op in order:
        a, b = theirs.get(op), ours.get(op)
        if a is None or b is None or a.shape != b.shape:
            out[op] = {"missing": True, "vllm": None if a is None else list(a.shape),
                       "trainer": None if b is None else list(b.shape)}
            continue
        out[op] = {"max_abs": float((a - b).abs().max()), "unequal_share": float((a != b).float().mean()),
                   "scale": float(b.abs().max())}
    return out


def child(args) -> dict:
    import torch
    import torch.distributed as dist

    from megatron_jetrl.actor import Actor, ActorSettings, OptimizerSettings, PackedBatch
    from megatron_jetrl.algo import cross_entropy_loss
    from megatron_jetrl.models import bridge_for
    from megatron_jetrl.precision import PrecisionRecipe
    from megatron_jetrl.rollout import SamplingParams
    from megatron_jetrl.rollout.vllm_engine import VllmEngine, VllmOptions
    from megatron_jetrl.sync import SyncPlan, WeightSync

    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    shape = MODELS[args.model]
    config = hf_config(args.model)
    exact = args.engine == "exact"
    recipe = PrecisionRecipe(mode=args.mode, exact=exact)
    settings = ActorSettings(precision=recipe, max_tokens_per_microbatch=8192,
                             optimizer=OptimizerSettings(lr=shape["lr"], weight_decay=0.0, clip_grad=1.0))
    actor = Actor(bridge_for(config), settings)
    vocab = actor.bridge.dims.vocab_size
    for step in range(3):
        actor.update(warm_up_batch(vocab, 100 + step, actor.bridge.dims.max_position_embeddings), cross_entropy_loss)
    max_len = shape["prompt_len"] + shape["new_tokens"] + 1  # + 1: a sample prefilled whole for the op hooks
    t0 = time.perf_counter()
    engine = VllmEngine(config, recipe, VllmOptions(gpu_memory_utilization=shape["memory"], max_model_len=max_len,
                                                    max_num_seqs=256, enforce_eager=True,
                                                    enable_prefix_caching=False))
    out = {"model": args.model, "engine": args.engine, "mode": args.mode, "device": torch.cuda.get_device_name(),
           "engine_start_s": time.perf_counter() - t0, "eager": True}
    plan = SyncPlan(actor.bridge, recipe, actor.settings.parallel, 1, 1)
    sync = WeightSync(plan, 0, device=actor.device)
    sync.sync(actor.weight_shards(), engine)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (shape["prompt_len"],), generator=g).tolist() for _ in range(shape["prompts"])]
    repeats = []
    for seed in range(1, args.seeds + 1):  # the same prompts sampled again with another seed: a repeat
        if seed > 1:
            sync.sync(actor.weight_shards(), engine)  # the sleep after the last sampling dropped the weights
        engine.wake()
        drawn = engine.generate(prompts, SamplingParams(n=shape["n"], temperature=1.0,
                                                        max_new_tokens=shape["new_tokens"], seed=seed))
        engine.sleep()
        repeats.append(score(actor, prompts, drawn)[0])
        if seed == 1:
            samples = drawn
    out["mismatch"], out["repeats"] = repeats[0], repeats
    if exact:
        out["ablation"] = {}
        for op in ABLATIONS:
            with trainer_default(actor, op) as swapped:
                if swapped:
                    out["ablation"][op], _ = score(actor, prompts, samples)
    # one sequence through both models, hooks on every op
    seq = prompts[samples[0].prompt_index] + samples[0].tokens
    layers = actor.bridge.dims.num_layers
    vllm_model = engine._on_worker(lambda worker: worker.get_model())
    sync.sync(actor.weight_shards(), engine)  # the sleep after sampling dropped the weights
    engine.wake()
    with captured(vllm_model, _points(layers, 0), len(seq)) as theirs:
        engine.generate([seq], SamplingParams(n=1, temperature=0.0, max_new_tokens=1))
    engine.sleep()
    with captured(actor.gpt, _points(layers, 1), len(seq)) as ours:
        actor.compute_logprobs(PackedBatch.from_sequences([torch.tensor(seq)]))
    order = [op for op, _, _ in _points(layers, 0)]
    diffs = op_diffs(theirs, ours, order)
    out["ops"] = diffs
    out["first_differing_op"] = next((op for op in order if not diffs[op].get("missing")
                                      and diffs[op]["unequal_share"] > 0), None)
    engine.close()
    actor.close()
    dist.destroy_process_group()
    return out


# ------------------------------------------------------------------------------------ driver


def run_all(args) -> None:
    from megatron_jetrl.launch import free_port
    from megatron_jetrl.precision import PrecisionRecipe
    from megatron_jetrl.rollout.vllm_engine import VllmOptions, engine_env

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    runs = RUNS if args.runs is None else [tuple(r.split(":")) for r in args.runs.split(",")]
    unknown = [r for r in runs if r not in RUNS]
    if unknown:
        raise SystemExit(f"--runs: unknown {unknown}; of {', '.join(e + ':' + m for e, m in RUNS)}")
    for model in args.models.split(","):
        for engine, mode in runs:
            name = f"{model}_{engine}_{mode}"
            result = work / f"{name}.json"
            if result.is_file() and not args.again:
                continue
            recipe = PrecisionRecipe(mode=mode, exact=engine == "exact")
            env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONUNBUFFERED": "1",
                   **engine_env(recipe, VllmOptions())}
            if engine == "batch_invariant":
                env["VLLM_BATCH_INVARIANT"] = "1"
            cmd = [sys.executable, "-m", "benchmarks.exact_ablation", "_child", "--model", model, "--engine", engine,
                   "--mode", mode, "--result", str(result), "--seeds", str(args.seeds)]
            t0 = time.perf_counter()
            with open(work / f"{name}.log", "w") as log:
                rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout,
                                    cwd=ROOT).returncode
            print(f"{name}: rc={rc} in {time.perf_counter() - t0:.0f} s", flush=True)
            if rc != 0:
                print("\n".join((work / f"{name}.log").read_text(errors="replace").splitlines()[-25:]), flush=True)
    command = command_line("benchmarks.exact_ablation")
    for result in work.glob("*.json"):  # the command that made them travels with the results (table --headline)
        data = json.loads(result.read_text())
        result.write_text(json.dumps({**data, "command": data.get("command", command)}, indent=1))
    print(table(work, args.headline, command))


def table(work: Path, headline: str | None = None, command: str = "") -> str:
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(Path(work).glob("*.json"))}
    if not runs:
        return f"no results in {work}"
    lines = ["| model | engine | mode | k3 KL | max abs dlogp (seed 1) | unequal tokens (seed 1) | "
             "token_mult_prob_error (seed 1) | first op that differs |", "|---|---|---|---:|---:|---:|---:|---|"]
    for r in runs.values():
        m = r["mismatch"]
        k3 = [x["rollout_corr/k3_kl"] for x in repeats_of(r)]
        k3_cell = f"{m['rollout_corr/k3_kl']:.3g}" if len(k3) == 1 else (
            f"{statistics.median(k3):.3g} ({min(k3):.3g}-{max(k3):.3g}, {len(k3)} seeds)")
        lines.append(f"| {r['model']} | {r['engine']} | {r['mode']} | {k3_cell} | "
                     f"{m['rollout_corr/max_abs_dlogp']:.3g} | {m['unequal_share']:.2%} | "
                     f"{m['token_mult_prob_error']:.4f} | {r.get('first_differing_op') or 'none'} |")
    ablations = [r for r in runs.values() if r.get("ablation")]
    if ablations:
        lines += ["", "Exact engine, one trainer op back on its default kernel (the rest exact):", "",
                  "| model | mode | op | k3 KL | max abs dlogp | unequal tokens |", "|---|---|---|---:|---:|---:|"]
        for r in ablations:
            for op, m in r["ablation"].items():
                lines.append(f"| {r['model']} | {r['mode']} | {op} | {m['rollout_corr/k3_kl']:.3g} | "
                             f"{m['rollout_corr/max_abs_dlogp']:.3g} | {m['unequal_share']:.2%} |")
    lines += ["", "Per op, layer 0 and the last layer (max |Δ| / share of unequal elements), one sequence:", ""]
    for r in runs.values():
        ops = r.get("ops", {})
        layers = sorted({int(k[1:].split(".")[0]) for k in ops if k.startswith("L")})
        keep = [k for k in ops if not k.startswith("L") or k.startswith(f"L{layers[0]}.")
                or k.startswith(f"L{layers[-1]}.")] if layers else list(ops)
        cells = ", ".join(f"{k} {ops[k]['max_abs']:.2g}/{ops[k]['unequal_share']:.0%}" for k in keep
                          if not ops[k].get("missing"))
        lines.append(f"- {r['model']} {r['engine']} {r['mode']}: {cells}")
    text = "\n".join(lines)
    if headline:
        from benchmarks.headline import update

        first = next(iter(runs.values()))
        update(headline, headline_figures(runs), device=first["device"],
               command=command or first.get("command") or default_command(runs))
    return text


def default_command(runs: dict[str, dict]) -> str:
    """The ``all`` command that makes these results (their models, runs and seeds), then the table:
    for results written before the command travelled with them (it says it was rebuilt)."""
    models = ",".join(sorted({r["model"] for r in runs.values()}))
    pairs = ",".join(sorted({f"{r['engine']}:{r['mode']}" for r in runs.values()}))
    seeds = min(len(repeats_of(r)) for r in runs.values())
    return (f"python -m benchmarks.exact_ablation all --models {models} --runs {pairs} --seeds {seeds} "
            "(rebuilt from the results; then table --headline)")


def repeats_of(run: dict) -> list[dict]:
    """A run's mismatch metrics, one per sampling seed (older results: the one)."""
    return run.get("repeats") or [run["mismatch"]]


def headline_figures(runs: dict[str, dict]) -> dict:
    """``vllm_k3_{fp8,mixed,bf16}_8b6``: the default engine's k3 KL at 8b6, median and range over the
    sampling seeds; ``vllm_exact_max_abs_dlogp``: per seed, the largest |Δlogp| over the exact runs,
    and as the value the largest of those (one seed off exactness shows; the seeds every exact run
    has), with their range."""
    from benchmarks.headline import Figure

    figures = {}
    for mode, key in (("fp8", "fp8"), ("bf16-train+fp8-rollout", "mixed"), ("bf16", "bf16")):
        r = runs.get(f"8b6_default_{mode}")
        if r:
            figures[f"vllm_k3_{key}_8b6"] = Figure.of([m["rollout_corr/k3_kl"] for m in repeats_of(r)])
    exact = [repeats_of(r) for r in runs.values() if r["engine"] == "exact"]
    if exact:
        seeds = min(len(reps) for reps in exact)
        per_seed = [max(reps[i]["rollout_corr/max_abs_dlogp"] for reps in exact) for i in range(seeds)]
        figures["vllm_exact_max_abs_dlogp"] = Figure(max(per_seed), seeds, (min(per_seed), max(per_seed)))
    return figures


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["all", "table", "_child"])
    p.add_argument("--models", default="tiny,8b6")
    p.add_argument("--runs", default=None, help="engine:mode,... (default: all of RUNS)")
    p.add_argument("--work", default="/tmp/exact_ablation")
    p.add_argument("--headline", default=None)
    p.add_argument("--again", action="store_true", help="rerun runs whose results exist")
    p.add_argument("--timeout", type=int, default=1200)
    p.add_argument("--seeds", type=int, default=3,
                   help="sampling seeds per run (the repeats of the mismatch figures; the ablation uses seed 1's)")
    p.add_argument("--model", choices=sorted(MODELS))
    p.add_argument("--engine", choices=["default", "batch_invariant", "exact"])
    p.add_argument("--mode")
    p.add_argument("--result", type=Path)
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error(f"--seeds {args.seeds}: sample with at least one seed")
    if args.what == "_child":
        args.result.write_text(json.dumps(child(args), indent=1))
    elif args.what == "all":
        run_all(args)
    else:
        print(table(Path(args.work), args.headline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
