"""The exact engine's fusion pass: a norm or SiLU·mul and the 1x128 quantization after it become one
kernel (``precision.exact``).

Why: in the exact mode vLLM's own fusions are off (they quantize vLLM's way, ``vllm_quant.py``), so
before each FP8 linear the engine ran two kernels, the exact norm (or SiLU·mul) and the trainer's
quantization, where the default engine runs one. The fused ops (``ops.exact.rms_norm_quant``,
``silu_mul_quant``) give the same bytes as the two kernels in turn (GPU-tested bit for bit), so the
rollout stays exact and the trainer, which keeps the two, needs nothing.

How: an Inductor post-grad pass, handed to vLLM as ``post_grad_custom_post_pass`` (vLLM's pass
manager runs it after its own passes, on every compiled piece of the model). It finds, in the FX
graph of a piece,

    jetrl::rms_norm(x, w, eps)                    -> [same-shape views] -> jetrl::quantize_1x128_rows
    jetrl::add_rms_norm(x, r, w, eps)[0]          -> [same-shape views] -> jetrl::quantize_1x128_rows
    jetrl::silu_mul(x)                            -> [same-shape views] -> jetrl::quantize_1x128_rows

where the norm's (or activation's) value has no other use, and calls the fused op instead; the
residual sum of ``add_rms_norm`` comes from the fused op too. Anything else is left as it is (still
exact, one kernel more). The pass is a plain graph rewrite, testable without vLLM
(``fuse_quantizations``); its ``uuid`` is this file's digest, so vLLM's and Inductor's compile
caches recompile when it changes.
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
    (``vllm_quant.quantize_rows_op``). Returns how many of each fusion it made."""
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


@functools.cache
def _digest() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


@functools.cache
def _pass_class() -> type:
    from vllm.compilation.passes.inductor_pass import InductorPass

    from megatron_jetrl.ops.exact import custom_ops
    from megatron_jetrl.rollout.vllm_quant import quantize_rows_op

    class ExactQuantFusion(InductorPass):
        """``fuse_quantizations`` as a vLLM Inductor pass (``post_grad_custom_post_pass``)."""

        def __call__(self, graph: fx.Graph) -> None:
            counts = fuse_quantizations(graph, custom_ops(), quantize_rows_op())
            if any(counts.values()):
                logger.info("precision.exact: fused the quantization into %s", counts)

        def uuid(self) -> str:
            return _digest()

        def __reduce__(self):  # pickled by name (vLLM may copy its compilation config)
            return fusion_pass, ()

    return ExactQuantFusion


def fusion_pass() -> Any:
    """The pass for ``vllm.LLM(compilation_config={"inductor_compile_config":
    {"post_grad_custom_post_pass": fusion_pass()}})`` (``vllm_exact.llm_kwargs``)."""
    return _pass_class()()
