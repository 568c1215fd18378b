"""Annotate: what each node of a captured graph costs, from the shapes torch.export recorded.

Terms:
- *FLOPs* are floating-point operations of the forward pass at the traced shapes; a multiply-add
  counts as two. Backward costs about twice the forward (one matmul for the input gradient, one for
  the weight gradient), so a training step costs about three times the forward: ``training_flops``.
- *activation bytes* are the bytes of a node's output tensor(s) (a view counts its full size: the
  number says how big the value is, not how much new memory it takes). A ``get_attr`` node has none:
  the tensor it reads is a parameter, counted in *parameter bytes* instead.
- *parameter bytes* are the bytes of the parameter a ``get_attr`` node reads; 0 for every other node.
  A tied weight is read by one ``get_attr`` node (capture canonicalises names), so it counts once.

FLOP rules come with each op's record (``passes.rules.op(..., flops=)``, into ``FLOPS``); the rest are tables keyed by
the op's name (``aten.linear.default`` -> ``linear``):

=======================================  ====================================================
matmuls (linear, mm, bmm, matmul, einsum, ...)   ``2 * numel(out) * K`` (K the contracted size), plus
                                         ``numel(out)`` for an added bias
scaled_dot_product_attention             ``4 * B * H * Tq * Tk * D`` (QK^T and PV), halved for
                                         ``is_causal``; the softmax is not counted
convolution, conv1d/2d/3d                ``2 * numel(out) * Cin/groups * prod(kernel)``, plus bias
embedding, views, copies, creations      0 (data movement, no arithmetic)
reductions (sum, mean, amax, ...)        ``numel(input)``
norms, softmax                           ``5 * numel(out)``
losses (cross_entropy_loss, ...)         a few per element of the logits (``5`` for cross entropy)
everything else (element-wise, unknown)  ``numel(out)``
=======================================  ====================================================

``symbolic_flops`` gives the same total as a sympy expression in the batch size ``b`` and sequence
length ``s`` for the planner's formulas (see its docstring for the heuristic and its limits).

Written on ``node.meta``: ``COST`` (a ``NodeCost``), by ``annotate``; read by the planner.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import sympy
import torch
from torch import fx
from torch.utils._sympy.numbers import int_oo

from autoshard import meta

COST = meta.COST

# A training step runs the forward once and the backward (about two forwards) once.
BACKWARD_FACTOR = 2
# FLOP-equivalents per parameter byte in ``stage_cost``. An fp32 parameter costs about 12 FLOPs per step
# outside the forward: zeroing and accumulating its gradient and an Adam update of about 10 FLOPs. That is
# 3 per byte. Small next to the matmuls of a layer, but it keeps an embedding table (0 FLOPs: a lookup)
# from looking free, and it spreads parameter memory across stages when FLOPs tie.
PARAM_BYTE_COST = 3.0

BATCH_SYMBOL = sympy.Symbol("b", positive=True, integer=True)
SEQ_SYMBOL = sympy.Symbol("s", positive=True, integer=True)

Dim = int | sympy.Expr  # a size: an int at the traced shapes, or a formula in b and s
ShapeMap = Callable[[tuple[int, ...]], tuple[Dim, ...]]  # a traced shape -> the sizes to count with


@dataclass(frozen=True)
class NodeCost:
    """The cost of one node at the traced shapes."""

    flops: int
    activation_bytes: int
    param_bytes: int


# --------------------------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------------------------


def annotate(gm: fx.GraphModule) -> dict[fx.Node, NodeCost]:
    """Cost every node of ``gm``; the result is also stored on each ``node.meta[COST]``."""
    costs = {}
    for node in gm.graph.nodes:
        cost = NodeCost(
            flops=int(node_flops(node)),
            activation_bytes=activation_bytes(node),
            param_bytes=_param_bytes(gm, node),
        )
        node.meta[COST] = costs[node] = cost
    return costs


def node_flops(node: fx.Node, shape_map: ShapeMap = tuple) -> Dim:
    """Forward FLOPs of ``node``; ``shape_map`` maps each traced shape to the sizes to count with."""
    if node.op != "call_function":
        return 0
    rule = FLOPS.get(getattr(node.target, "overloadpacket", node.target))
    if rule is not None:
        return rule(node, shape_map)
    name = op_name(node.target)
    if name in _FREE:
        return 0
    if name in _PER_INPUT_ELEMENT:
        return _PER_INPUT_ELEMENT[name] * _numel(_shape(node.args[0], shape_map))
    return _PER_OUTPUT_ELEMENT.get(name, 1) * _output_numel(node, shape_map)


def training_flops(cost: NodeCost | int) -> int:
    """FLOPs of a forward and a backward: about three forwards."""
    flops = cost.flops if isinstance(cost, NodeCost) else cost
    return (1 + BACKWARD_FACTOR) * flops


def total_flops(costs: dict[fx.Node, NodeCost]) -> int:
    """Forward FLOPs of the whole graph."""
    return sum(c.flops for c in costs.values())


def total_param_bytes(costs: dict[fx.Node, NodeCost]) -> int:
    """Bytes of all parameters the graph reads (a tied weight once)."""
    return sum(c.param_bytes for c in costs.values())


def stage_cost(
    nodes: Iterable[fx.Node], costs: dict[fx.Node, NodeCost], *, param_weight: float = PARAM_BYTE_COST
) -> float:
    """The scalar a pipeline partitioner balances: training FLOPs plus ``param_weight`` per parameter byte.

    Additive over nodes, so the cost of a stage is the sum of the costs of its nodes. The parameter
    term is why a stage holding only the token embedding is not free (see ``PARAM_BYTE_COST``).
    """
    return float(sum(training_flops(costs[n]) + param_weight * costs[n].param_bytes for n in nodes))


def symbolic_flops(gm: fx.GraphModule, batch_dim_size: int, seq_dim_size: int) -> sympy.Expr:
    """Total forward FLOPs of ``gm`` as a polynomial in ``BATCH_SYMBOL`` (b) and ``SEQ_SYMBOL`` (s).

    A heuristic for the planner's formulas, never used for correctness. In every shape, a size equal
    to the traced batch size becomes ``b``, one equal to the traced sequence length becomes ``s``, and
    a leading size equal to their product becomes ``b*s`` when no other size did (tokens flattened to
    ``(b*s, hidden)`` before a matmul or the loss); then the FLOP rules run on those sizes. Evaluated
    at the traced sizes it gives the numeric total exactly. It is wrong where another dim happens to
    have one of these sizes (a head dim of 128 at sequence 128 reads as ``s``), and size 1 is never
    replaced, so a capture at batch 1 gives a formula constant in ``b``. Capture at pairwise distinct
    sizes for a useful formula.
    """
    if batch_dim_size == seq_dim_size and batch_dim_size != 1:
        raise ValueError(
            f"batch and sequence sizes are both {batch_dim_size}: the formula cannot tell them apart; "
            "capture at distinct sizes"
        )
    named = {n: sym for n, sym in ((batch_dim_size, BATCH_SYMBOL), (seq_dim_size, SEQ_SYMBOL)) if n != 1}

    def shape_map(shape: tuple[int, ...]) -> tuple[Dim, ...]:
        sizes = tuple(named.get(n, n) for n in shape)
        if named and sizes == shape and shape and shape[0] == batch_dim_size * seq_dim_size:
            sizes = (BATCH_SYMBOL * SEQ_SYMBOL, *sizes[1:])
        return sizes

    return sympy.expand(sympy.Add(*(node_flops(n, shape_map) for n in gm.graph.nodes)))


def summary(gm: fx.GraphModule, *, top: int = 5) -> str:
    """Total parameters, forward and training FLOPs, and the ``top`` largest activations of ``gm``."""
    costs = {n: n.meta[COST] for n in gm.graph.nodes} if _annotated(gm) else annotate(gm)
    params = sum(p.numel() for p in gm.parameters())
    flops = total_flops(costs)
    lines = [
        f"parameters: {_count(params)} ({format_bytes(total_param_bytes(costs))})",
        f"forward: {_count(flops)}FLOP at the traced shapes; training step ~{_count(training_flops(flops))}FLOP",
        "largest activations (views left out):",
    ]
    fresh = [n for n in costs if not (n.op == "call_function" and op_name(n.target) in _VIEWS)]
    for node in sorted(fresh, key=lambda n: costs[n].activation_bytes, reverse=True)[:top]:
        where = meta.module_path(node) or "(top level)"
        shapes = ", ".join("x".join(map(str, t.shape)) or "scalar" for t in _tensors(meta.val(node)))
        lines.append(f"  {node.name:<28} {shapes:<16} {format_bytes(costs[node].activation_bytes):>10}  {where}")
    return "\n".join(lines)


def op_name(target: object) -> str:
    """The op's name without namespace and overload: ``aten.linear.default`` -> ``linear``."""
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    return getattr(target, "__name__", str(target))


# --------------------------------------------------------------------------------------------------------------------
# FLOP rules
# --------------------------------------------------------------------------------------------------------------------


def linear_flops(node: fx.Node, shape_map: ShapeMap) -> Dim:
    out = _output_numel(node, shape_map)
    k = _shape(node.args[0], shape_map)[-1]
    has_bias = _arg(node, 2, "bias") is not None
    return 2 * out * k + (out if has_bias else 0)


def _matmul_rule(left: int, adds: bool) -> Callable[[fx.Node, ShapeMap], Dim]:
    """``2 * numel(out) * K`` with K the last size of operand ``left``; plus ``numel(out)`` if it ``adds``."""

    def rule(node: fx.Node, shape_map: ShapeMap) -> Dim:
        out = _output_numel(node, shape_map)
        k = _shape(node.args[left], shape_map)[-1]
        return 2 * out * k + (out if adds else 0)

    return rule


def attention_flops(node: fx.Node, shape_map: ShapeMap) -> Dim:
    q, k, v = (_shape(a, shape_map) for a in node.args[:3])  # (B, H, Tq, D), (B, Hkv, Tk, D), (B, Hkv, Tk, Dv)
    causal = bool(_arg(node, 5, "is_causal", False))
    rows = _numel(q[:-1])  # B * H * Tq
    # 2 * rows * Tk * D for QK^T and 2 * rows * Tk * Dv for PV; a causal mask skips about half.
    return (1 if causal else 2) * rows * k[-2] * (q[-1] + v[-1])


def convolution_flops(node: fx.Node, shape_map: ShapeMap) -> Dim:
    transposed = node.target is torch.ops.aten.convolution.default and bool(_arg(node, 6, "transposed", False))
    weight = _shape(node.args[1], shape_map)  # (Cout, Cin/groups, *kernel); transposed: (Cin, Cout/groups, *kernel)
    # Every output element (every input element when transposed) is a dot product of length prod(weight[1:]).
    positions = _numel(_shape(node.args[0], shape_map)) if transposed else _output_numel(node, shape_map)
    has_bias = _arg(node, 2, "bias") is not None
    return 2 * positions * _numel(weight[1:]) + (_output_numel(node, shape_map) if has_bias else 0)


def einsum_flops(node: fx.Node, shape_map: ShapeMap) -> Dim:
    """``2 * `` the product of every index's size (each output element is a dot product over the contracted
    indices), per contraction of one more operand; an ellipsis counts as one index of its dims' product."""
    equation, operands = node.args[0], node.args[1]
    sizes: dict[str, Dim] = {}
    for spec, operand in zip(equation.replace(" ", "").partition("->")[0].split(","), operands, strict=False):
        shape = list(_shape(operand, shape_map))
        letters = spec.replace("...", ".")
        if "." in letters:  # the ellipsis: what the named indices leave of the shape, as one index
            cut = letters.index(".")
            after = len(letters) - cut - 1
            covered = shape[cut:len(shape) - after]
            shape = [*shape[:cut], _numel(covered), *shape[len(shape) - after:]]
        for letter, size in zip(letters, shape, strict=False):
            sizes[letter] = size
    return 2 * _numel(sizes.values()) * max(1, len(operands) - 1)


FlopRule = Callable[[fx.Node, ShapeMap], Dim]
MATMUL, ATTENTION = "matmul", "attention"  # how the planner times an op whose FLOPs a rule counts: as a matmul of them,
# or by attention's own rate

# What autoshard knows of an op's arithmetic, by op (an overload's packet: every overload of it): its FLOP rule and
# how it is timed. Written by ``passes.rules.op(..., flops=, timing=)`` alone (``record``), with the op's other
# records: linear and the matmuls, einsum, the convolutions and attention (``passes.rules_nn``).
FLOPS: dict[object, FlopRule] = {}
TIMING: dict[object, str] = {}


def record(target: object, flops: FlopRule, timing: str) -> None:
    """Record ``target``'s FLOP rule and timing; a second, different record for the same op is refused."""
    packet = getattr(target, "overloadpacket", target)
    if FLOPS.get(packet, flops) is not flops or TIMING.get(packet, timing) != timing:
        raise AssertionError(f"{packet} has a FLOP rule already ({FLOPS[packet].__qualname__}, timed as "
                             f"{TIMING[packet]}): one record per op")
    FLOPS[packet], TIMING[packet] = flops, timing


def timing(target: object) -> str | None:
    """How the planner times ``target``: ``MATMUL``, ``ATTENTION``, or None (by the bytes it moves)."""
    return TIMING.get(getattr(target, "overloadpacket", target))


mm_flops = _matmul_rule(0, adds=False)
addmm_flops = _matmul_rule(1, adds=True)


# Views of their input: no arithmetic and no new memory.
_VIEWS = frozenset({
    "view", "_unsafe_view", "reshape", "transpose", "t", "permute", "unsqueeze", "squeeze", "expand", "expand_as",
    "flatten", "unflatten", "split", "split_with_sizes", "chunk", "unbind", "getitem", "alias", "slice", "select",
    "narrow", "detach",
})
# Copies, lookups, tensor creation and checks: data movement only.
_FREE = _VIEWS | {
    "contiguous", "clone", "cat", "stack", "repeat", "repeat_interleave", "to", "_to_copy", "type_as",
    "lift_fresh_copy", "broadcast_tensors", "embedding", "index", "index_select", "gather", "arange", "zeros",
    "ones", "full", "empty", "zeros_like", "ones_like", "full_like", "empty_like", "new_zeros", "new_ones",
    "new_full", "new_empty", "scalar_tensor", "_assert_tensor_metadata", "_assert_scalar", "sym_size", "sym_numel",
}

_PER_INPUT_ELEMENT = {
    **dict.fromkeys([
        "sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "var", "std", "var_mean", "norm",
        "linalg_vector_norm", "prod", "logsumexp", "all", "any", "cumsum", "cumprod", "nll_loss",
    ], 1),
    "cross_entropy_loss": 5,  # log-softmax (max, subtract, exp, sum, log) and the pick of the target
    "mse_loss": 3,  # subtract, square, sum
}

_PER_OUTPUT_ELEMENT = dict.fromkeys([
    "layer_norm", "native_layer_norm", "rms_norm", "group_norm", "batch_norm", "softmax", "_softmax",
    "log_softmax", "_log_softmax",
], 5)


# --------------------------------------------------------------------------------------------------------------------
# Shapes and bytes
# --------------------------------------------------------------------------------------------------------------------


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _shape(arg: object, shape_map: ShapeMap) -> tuple[Dim, ...]:
    """The shape of a node's tensor value, mapped by ``shape_map``; () for anything else."""
    value = meta.val(arg) if isinstance(arg, fx.Node) else None
    return shape_map(_ints(value.shape)) if isinstance(value, torch.Tensor) else ()


def _ints(shape: torch.Size) -> tuple[int, ...]:
    return tuple(dim_size(d) for d in shape)


def dim_size(dim: int | torch.SymInt) -> int:
    """A dim's size; one that depends on the data (the tokens routed to an expert) counts at its upper bound.

    Costs only balance stages, so an estimate is safe; without a finite bound such a dim counts as 1.
    """
    if not isinstance(dim, torch.SymInt):
        return int(dim)
    if dim.node.hint is not None:
        return int(dim.node.hint)
    upper = dim.node.shape_env.bound_sympy(dim.node.expr).upper
    return int(upper) if upper.is_integer and upper not in (int_oo, sympy.oo) else 1


def _numel(shape: Iterable[Dim]) -> Dim:
    return functools.reduce(operator.mul, shape, 1)


def _output_numel(node: fx.Node, shape_map: ShapeMap) -> Dim:
    return sum((_numel(shape_map(_ints(t.shape))) for t in _tensors(meta.val(node))), 0)


def _arg(node: fx.Node, index: int, name: str, default: object = None) -> object:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def activation_bytes(node: fx.Node) -> int:
    """The bytes of the tensors ``node`` outputs, as this graph holds them."""
    if node.op in ("get_attr", "output"):
        return 0
    return sum(t.numel() * t.dtype.itemsize for t in _tensors(meta.val(node)))


def _param_bytes(gm: fx.GraphModule, node: fx.Node) -> int:
    if node.op != "get_attr":
        return 0
    try:
        p = gm.get_parameter(node.target)
    except AttributeError:  # a buffer or a constant, not a parameter
        return 0
    return p.numel() * p.dtype.itemsize


def _annotated(gm: fx.GraphModule) -> bool:
    return all(COST in n.meta for n in gm.graph.nodes)


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} "


def format_bytes(n: float) -> str:
    """``193.8 KiB``: binary units, one decimal."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"
