"""The exact engine's fusion pass: kernels that the default engine gets from vLLM's own fusions, made
of the exact ops (``precision.exact``).

Why: in the exact mode vLLM's fusions are off (they quantize vLLM's way, ``vllm_activation_quant.py``) and its
norms and rotary embedding are the exact ops, each one kernel. Before each FP8 linear the engine ran
two kernels, the exact norm (or SiLU·mul) and the trainer's quantization, where the default engine
runs one; and for attention's q/k norms and rotary embedding four (two norms, which also copied their
strided input, and two rotations) where the default engine's compiled graph runs about one. The fused
ops (``ops.exact.rms_norm_quant``, ``silu_mul_quant``, ``qk_norm_rope``) give the same bytes as the
kernels they replace, in turn (GPU-tested bit for bit), so the rollout stays exact and the trainer,
which keeps the separate ops, needs nothing.

How: an Inductor post-grad pass, handed to vLLM as ``post_grad_custom_post_pass`` (vLLM's pass
manager runs it after its own passes, on every compiled piece of the model). It finds, in the FX
graph of a piece,

    jetrl::rms_norm(x, w, eps)                    -> [same-shape views] -> jetrl::quantize_1x128_rows
    jetrl::add_rms_norm(x, r, w, eps)[0]          -> [same-shape views] -> jetrl::quantize_1x128_rows
    jetrl::silu_mul(x)                            -> [same-shape views] -> jetrl::quantize_1x128_rows
    jetrl::rope(pos, view(jetrl::rms_norm(view(q), wq)), view(jetrl::rms_norm(view(k), wk)), inv_freq)

where the intermediate values have no other use, and calls the fused op instead; the residual sum of
``add_rms_norm`` comes from the fused op too. Anything else is left as it is (still exact, a kernel
more). The pass is a plain graph rewrite, testable without vLLM (``fuse_quantizations``,
``fuse_qk_norm_rope``); its ``uuid`` is this file's digest, so vLLM's and Inductor's compile caches
recompile when it changes.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import operator
from pathlib import Path
from typing import Any

import torch
from torch import fx

logger = logging.getLogger(__name__)

_VIEWS = ("view", "reshape", "_unsafe_view")
"""aten ops that may stand between a norm and the quantization without changing its 2-D shape."""


def _is(node: Any, op: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target == op


def _is_view(node: Any) -> bool:
    return (isinstance(node, fx.Node) and node.op == "call_function"
            and any(node.target == getattr(torch.ops.aten, v).default for v in _VIEWS))


def _shape(node: fx.Node):
    value = node.meta.get("val")
    return None if value is None else tuple(value.shape)


def _same_shape(a: fx.Node, b: fx.Node) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    sa, sb = _shape(a), _shape(b)
    return (sa is not None and sb is not None and len(sa) == len(sb) == 2
            and all(statically_known_true(x == y) for x, y in zip(sa, sb, strict=True)))


def _producer(node: fx.Node) -> fx.Node:
    """The node whose value ``node`` is, looking through views that keep its 2-D shape and have no other use."""
    while _is_view(node) and len(node.users) == 1 and _same_shape(node, node.args[0]):
        node = node.args[0]
    return node


def _sole_getitem(node: fx.Node, index: int) -> fx.Node | None:
    """The one ``operator.getitem(node, index)`` of a multi-output node, or None."""
    found = [u for u in node.users if _is(u, operator.getitem) and u.args[1] == index]
    return found[0] if len(found) == 1 else None


def _arguments(node: fx.Node) -> list:
    """A custom op node's arguments in its schema's order (a graph may pass some by keyword)."""
    names = [a.name for a in node.target._schema.arguments]
    return [*node.args, *(node.kwargs[n] for n in names[len(node.args):])]


def _chain(source: fx.Node, quant: fx.Node) -> list[fx.Node]:
    """The nodes from ``source`` (exclusive) to ``quant`` (exclusive): the views in between."""
    nodes, node = [], _arguments(quant)[0]
    while node is not source:
        nodes.append(node)
        node = node.args[0]
    return nodes


def fuse_quantizations(graph: fx.Graph, ops: Any, quantize: Any) -> dict[str, int]:
    """Rewrite ``graph`` in place (see the module docstring): ``ops`` is ``torch.ops.jetrl`` with the
    exact ops registered (``ops.exact.custom_ops``), ``quantize`` the quantization op
    (``vllm_activation_quant.quantize_rows_op``). Returns how many of each fusion it made."""
    quant_op = getattr(quantize, "_opoverload", quantize)
    norm, add_norm, silu = ops.rms_norm.default, ops.add_rms_norm.default, ops.silu_mul.default
    counts = {"rms_norm": 0, "add_rms_norm": 0, "silu_mul": 0}
    for q_node in list(graph.nodes):
        if not _is(q_node, quant_op):
            continue
        x, pow2, eps, align = _arguments(q_node)
        value = _producer(x)
        if value is not x and len(x.users) != 1:
            continue
        users = [_sole_getitem(q_node, i) for i in (0, 1)]
        if any(u is None for u in users) or len(q_node.users) != 2:
            continue
        if _is(value, norm) and len(value.users) == 1:
            kind, source, total, fused_op = "rms_norm", value, None, ops.rms_norm_quant.default
        elif _is(value, silu) and len(value.users) == 1:
            kind, source, total, fused_op = "silu_mul", value, None, ops.silu_mul_quant.default
        elif (_is(value, operator.getitem) and value.args[1] == 0 and _is(value.args[0], add_norm)
              and len(value.users) == 1):
            kind, source, fused_op = "add_rms_norm", value.args[0], ops.add_rms_norm_quant.default
            total = _sole_getitem(source, 1)  # the residual sum: the fused op's third output
            if len(source.users) != (1 if total is None else 2):
                continue
        else:
            continue
        outputs, values = list(users), list(q_node.meta.get("val") or (None, None))
        if kind == "add_rms_norm":
            outputs.append(total)
            values.append((source.meta.get("val") or (None, None))[1])
        _replace(graph, source, fused_op, (*_arguments(source), pow2, eps, align), outputs, values)
        dead = [*users, q_node, *_chain(value, q_node)] + ([value, total] if kind == "add_rms_norm" else [])
        for node in (*dead, source):
            if node is not None:
                graph.erase_node(node)
        counts[kind] += 1
    return counts


def _replace(graph: fx.Graph, source: fx.Node, fused_op: Any, args: tuple, outputs: list, values: list) -> None:
    """Insert ``fused_op(*args)`` before ``source`` and make its output i stand for the getitem node
    ``outputs[i]`` everywhere (None: unused). ``values``: the outputs' fake values, for Inductor."""
    with graph.inserting_before(source):
        fused = graph.call_function(fused_op, args)
        if all(v is not None for v in values):
            fused.meta["val"] = tuple(values)
        for index, old in enumerate(outputs):
            if old is None:
                continue
            new = graph.call_function(operator.getitem, (fused, index))
            if values[index] is not None:
                new.meta["val"] = values[index]
            old.replace_all_uses_with(new)


def _through_views(node: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """The node whose value ``node`` views (through views of any shape, each with no other use), and
    the views passed, nearest first."""
    chain = []
    while _is_view(node) and len(node.users) == 1:
        chain.append(node)
        node = node.args[0]
    return node, chain


def fuse_qk_norm_rope(graph: fx.Graph, ops: Any) -> int:
    """Rewrite ``graph`` in place: where the rotary embedding's q and k are each the exact norm of a
    tensor's heads (``jetrl::rms_norm`` of a view of q [T, Hq * D], viewed back), and the norms have no
    other use, call ``jetrl::qk_norm_rope`` on the two tensors instead (one kernel for two norms, their
    input copies and the rotation). Returns how many it fused."""
    rope, norm = ops.rope.default, ops.rms_norm.default
    count = 0
    for r_node in list(graph.nodes):
        if not _is(r_node, rope):
            continue
        positions, q_in, k_in, inv_freq = _arguments(r_node)
        users = [_sole_getitem(r_node, i) for i in (0, 1)]
        if any(u is None for u in users) or len(r_node.users) != 2:
            continue
        found = []
        for x in (q_in, k_in):
            n_node, out_views = _through_views(x)
            if not (_is(n_node, norm) and len(n_node.users) == 1):
                break
            nx, weight, eps = _arguments(n_node)
            source, in_views = _through_views(nx)
            sx, ss = _shape(x), _shape(source)
            if sx is None or ss is None or len(sx) != 2 or len(ss) != 2 or not _same_shape(x, source):
                break
            found.append((source, weight, eps, [*out_views, n_node, *in_views]))
        if len(found) != 2:
            continue
        (q_src, wq, eps_q, q_dead), (k_src, wk, eps_k, k_dead) = found
        values = list(r_node.meta.get("val") or (None, None))
        _replace(graph, r_node, ops.qk_norm_rope.default, (positions, q_src, k_src, wq, wk, eps_q, eps_k, inv_freq),
                 users, values)
        for node in (*users, r_node, *q_dead, *k_dead):
            graph.erase_node(node)
        count += 1
    return count


@functools.cache
def _digest() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


@functools.cache
def _pass_class() -> type:
    from vllm.compilation.passes.inductor_pass import InductorPass

    from megatron_jetrl.ops.exact import custom_ops
    from megatron_jetrl.rollout.vllm_activation_quant import quantize_rows_op

    class ExactQuantFusion(InductorPass):
        """``fuse_quantizations`` as a vLLM Inductor pass (``post_grad_custom_post_pass``)."""

        def __call__(self, graph: fx.Graph) -> None:
            counts = {**fuse_quantizations(graph, custom_ops(), quantize_rows_op()),
                      "qk_norm_rope": fuse_qk_norm_rope(graph, custom_ops())}
            if any(counts.values()):
                logger.info("precision.exact: fused kernels in a compiled piece: %s", counts)

        def uuid(self) -> str:
            return _digest()

        def __reduce__(self):  # pickled by name (vLLM may copy its compilation config)
            return fusion_pass, ()

    return ExactQuantFusion


def fusion_pass() -> Any:
    """The pass for ``vllm.LLM(compilation_config={"inductor_compile_config":
    {"post_grad_custom_post_pass": fusion_pass()}})`` (``vllm_exact.llm_kwargs``)."""
    return _pass_class()()
