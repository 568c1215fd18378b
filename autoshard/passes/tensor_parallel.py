"""Tensor parallelism: find Megatron's patterns from graph structure, then shard the graph for one rank.

Planning (``plan_tensor_parallel``) never looks at names. A *region* is a set of column-parallel
linears whose sharded outputs flow, through ops that keep the shard (activations, views that split
heads, attention, RoPE arithmetic), into one row-parallel linear whose sum ends the region. For
every linear, the linears feeding its input (its *cone*, walking back through values that depend on
parameters) are tried as columns with it as the row; a candidate is kept when propagation shows no
all-gather of a sharded value. The same propagation discovers what the pattern needs:

- a fused projection (q, k, v in one linear) that the graph splits gets a blocked shard, so every
  rank holds whole heads of q, of k and of v;
- a column whose heads the degree does not divide (grouped-query k and v with fewer heads than
  ranks) is dropped from the region and stays replicated; each rank takes its share of the heads;
- a head count no column can be split over is an error naming the layer and the degrees that work.

Then the token embedding (fed by a graph input) is tried vocab-parallel, which also makes a tied LM
head column-parallel, and any remaining linear is tried alone as a column (an LM head whose logits
go to a vocab-parallel cross-entropy), then alone as a row (its replicated input sliced, its output
all-reduced: an MLM head's transform, a projection between embedding and layers). Tables no input
id indexes (positions, relative position buckets) are split by columns where their lookups feed
split heads, else by rows. Everything else stays replicated; so do the blocks whose heads the degree
does not divide, when the user asks for that rather than an error.

``tensor_parallel_pass`` applies a plan for one rank: it inserts the collectives the placements
need (Megatron's f before column regions, one per value; all-reduces closing row linears), rewrites
sizes to local ones, and replaces sharded parameters by this rank's shards.
"""

from __future__ import annotations

import itertools
import json
import operator
import re
import warnings

import torch
from torch import fx

from autoshard import meta
from autoshard.errors import AutoshardError
from autoshard.passes import localize
from autoshard.passes.axis import Axis
from autoshard.passes.axis_pass import AxisPass, PlanCodec, Sharding, splitting
from autoshard.passes.collectives import (
    CopyToParallel,
    ReadWhole,
    ReduceFromParallel,
    ScatterToParallel,
    local_part,
)
from autoshard.passes.placements import Placement, R, Shard
from autoshard.passes.propagate import Propagation, cost, propagate, requires_grad
from autoshard.passes.rules import arg, is_table_lookup, slice_bounds
from autoshard.passes.rules_conv import channel_dims, is_convolution, is_patch_conv
from autoshard.passes.rules_nn import einsum_letters, is_grouped_mm
from autoshard.passes.sharding import FALLBACKS, shard_axis  # noqa: F401 - FALLBACKS re-exported
from autoshard.plan import ParamPlan, TensorParallelPlan

aten = torch.ops.aten
_LINEARS = {aten.linear.default: (1, 2, 0), aten.addmm.default: (2, 0, 1)}  # op -> (weight arg, bias arg, out dim)
_CONE_LIMIT = 300
_IDS_PER_TOKEN = 4  # a table split by rows may look up this many ids per input id


def tensor_axis(size: int, *, mark_entries: bool = False) -> Axis:
    """The tp axis over ``size`` ranks. Every tp rank back-propagates the same loss, so a sum over a split dim (a
    norm over a split width) may stay pending; a fused projection (q, k, v in one linear) splits in blocks.
    ``mark_entries``: see ``tensor_parallel_pass``."""
    return Axis("tp", size, pending_sums=True, blocked_splits=True, copy_without_grad=mark_entries,
                localizers={aten.dropout.default: localize.dropout_of_part,
                            aten.scaled_dot_product_attention.default: localize.grouped_query_attention})


def _propagate(gm: fx.GraphModule, seeds: dict[str, Placement], size: int, *,
               base: Propagation | None = None) -> Propagation:
    return propagate(gm, seeds, tensor_axis(size), base=base)


class TensorParallelError(AutoshardError, ValueError):
    """A layer cannot be split over the requested degree; the message names it and the degrees that work.

    ``option`` is the option and value that would keep such layers replicated instead (a front end spells it
    its own way: a keyword argument, a command-line flag).
    """

    def __init__(self, reason: str, *, option: tuple[str, str] | None = None) -> None:
        self.reason, self.option = reason, option
        fix = f"; or pass {option[0]}={option[1]!r} to keep such layers replicated" if option else ""
        super().__init__(reason + fix)


# ------------------------------------------------------------------------------------------------ planning


def plan_tensor_parallel(gm: fx.GraphModule, size: int, *, indivisible: str = "error") -> TensorParallelPlan:
    """Decide the tp placement of every parameter of ``gm`` for ``size`` ranks."""
    params = {name for name, _ in gm.named_parameters()}
    plan = TensorParallelPlan(size=size)
    state = _propagate(gm, {}, size)
    if size == 1:
        return _finish(gm, plan, params)
    grad = requires_grad(gm)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    state = _plan_vocab(gm, plan, state, params)
    blockers: dict[str, str] = {}  # weight -> why the region it was tried in needed a gather
    for row in _linears(gm, params):
        if _weight(row) in plan.params:
            continue
        columns = sorted((c for c in _cone(_input(row), grad) if _is_free(c, plan, state)), key=order.__getitem__)
        if columns and _is_free(row, plan, None):
            columns, row = _enclosing(gm, plan, state, columns, row, grad, order) or (columns, row)
            state = _try_region(gm, plan, state, columns, row, indivisible, blockers)
    routers = [n for n in _linears(gm, params) if _is_free(n, plan, state) and _chooses(n)]
    for router in routers:
        for name in filter(None, (_weight(router), _bias(router))):
            plan.params[name] = ParamPlan(R, "replicated", "a router: its outputs choose (top-k), so every rank "
                                          "computes them whole and chooses as the model run whole does")
    for lone in _linears(gm, params):
        if _is_free(lone, plan, state):
            state = _try_region(gm, plan, state, [lone], None, "replicate")
    for lone in _linears(gm, params):
        if _is_free(lone, plan, state):
            state = _try_lone_row(plan, state, lone)
    state = _plan_tables(gm, plan, state, params)
    state = _plan_sliced(gm, plan, state, params)
    return _finish(gm, plan, params, blockers)


def _finish(gm: fx.GraphModule, plan: TensorParallelPlan, params: set[str],
            blockers: dict[str, str] | None = None) -> TensorParallelPlan:
    for name in sorted(params - set(plan.params), key=list(params).index):
        plan.params[name] = ParamPlan(R, "replicated", (blockers or {}).get(name, "no pattern shards it"))
    ordered = {n: plan.params[n] for n, _ in gm.named_parameters()}
    plan.params = ordered
    return plan


def _linears(gm: fx.GraphModule, params: set[str]) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if _is_linear(n) and _weight(n) in params]


_MATMULS = {aten.matmul.default, aten.mm.default}
_TRANSPOSES = {aten.t.default, aten.numpy_T.default}


def _is_linear(node: fx.Node) -> bool:
    """A linear (``linear``, ``addmm``, ``x @ W.T`` of a 2-D parameter) or a mixture of experts' matmul over a stack
    of expert matrices (a grouped matmul, or ``bmm`` of tokens gathered per expert, as Llama 4's experts)."""
    if node.target in _MATMULS:
        w, _ = _weight_node(node)
        return isinstance(w, fx.Node) and w.op == "get_attr" and len(meta.val(w).shape) == 2
    return (node.target in _LINEARS or _stacked(node) or _einsum_weight(node) is not None or is_patch_conv(node)
            or _is_dense_conv(node))


def _is_dense_conv(node: fx.Node) -> bool:
    """A convolution every output channel of which reads every input channel (no groups), over a batch: a linear
    over each window, split by output channels as a column, by input channels as a row. (A grouped or depthwise one
    keeps a channel split instead: see ``rules_conv``.)"""
    if not is_convolution(node) or arg(node, "groups") != 1:
        return False
    x, w = arg(node, "input"), _undetached(arg(node, "weight"))
    return isinstance(w, fx.Node) and w.op == "get_attr" and meta.val(x).dim() == meta.val(w).dim()


def _is_left(node: fx.Node) -> bool:
    """``W @ x`` of a 2-D parameter stored (out, in): Mamba's ``dt_proj.weight @ dt.transpose(1, 2)``."""
    w = node.args[0]
    return (node.target in _MATMULS and isinstance(w, fx.Node) and w.op == "get_attr"
            and len(meta.val(w).shape) == 2 and not (isinstance(node.args[1], fx.Node)
                                                       and node.args[1].op == "get_attr"))


def _stacked(node: fx.Node) -> bool:
    """A matmul over a stack of expert matrices (experts, in, out): every expert's tokens times its matrix."""
    if is_grouped_mm(node):
        return True
    if node.target is not aten.bmm.default:
        return False
    w, _ = _weight_node(node)
    return isinstance(w, fx.Node) and w.op == "get_attr" and (len(meta.val(w).shape) == 3
                                                              or _grouped_weight(node) is not None)


def _grouped_weight(node: fx.Node) -> fx.Node | None:
    """The 2-D parameter ``W`` (groups * out, in) of ``bmm(x, W.view(groups, out, in).transpose(1, 2))``: a grouped
    linear, each group of features of ``x`` times its own rows of ``W`` (DeepSeek V4's grouped output projection).
    A column splits ``W``'s rows, whole groups to a rank."""
    w = node.args[1]
    if node.target is not aten.bmm.default or not (isinstance(w, fx.Node) and w.target is aten.transpose.int
                                                   and sorted(d % 3 for d in w.args[1:3]) == [1, 2]):
        return None
    view = w.args[0]
    param = _undetached(view.args[0]) if isinstance(view, fx.Node) and view.target in _RESHAPES else None
    if not (isinstance(param, fx.Node) and param.op == "get_attr" and meta.val(param).dim() == 2):
        return None
    (rows, cols), shape = meta.val(param).shape, meta.val(view).shape
    return param if len(shape) == 3 and shape[0] * shape[1] == rows and shape[2] == cols else None


def _weight_node(node: fx.Node) -> tuple[fx.Node | None, int]:
    """The parameter node a linear multiplies by, and the dim of that parameter holding its output features."""
    w, dim = _weight_use(node)
    return _undetached(w), dim


def _undetached(value):
    """The parameter behind ``value.detach()`` (a weight read inside a ``torch.no_grad()`` region) or behind a cast
    (``fn.float()``: hyper-connections mixing their streams in fp32)."""
    while isinstance(value, fx.Node) and value.target in _READS:
        value = value.args[0]
    return value


_READS = {aten.detach.default, aten.to.dtype, aten.alias.default}  # a weight read as it is, or cast


def _cast_weight(node: fx.Node) -> bool:
    """Whether a linear reads its weight cast (``fn.float()``): a hyper-connection's mix, whose few outputs are read
    whole and never open a block as its column; such a linear is split alone, or not at all."""
    w = _weight_use(node)[0]
    while isinstance(w, fx.Node) and w.target is aten.detach.default:
        w = w.args[0]
    return isinstance(w, fx.Node) and w.target is aten.to.dtype


def _weight_use(node: fx.Node) -> tuple[fx.Node | None, int]:
    if (einsum := _einsum_weight(node)) is not None:
        return einsum[0], einsum[1]
    if is_patch_conv(node):  # (out channels, in channels, kernel rows, kernel columns)
        return arg(node, "weight"), 0
    if is_convolution(node):  # (out, in, ...), or a transposed one's (in, out, ...)
        return arg(node, "weight"), channel_dims(node)[0]
    if node.target in _LINEARS:
        w = arg(node, "weight" if node.target is aten.linear.default else "mat2")
        if (stack := _expert_of(w)) is not None:  # linear(x, W[i]): expert i of a stack (experts, out, in), as JetMoE's
            return stack, _LINEARS[node.target][2] + 1
        if node.target is aten.linear.default and (packed := _piece_of(w)) is not None:  # linear(x, W.split(s)[i])
            return packed, 0
        return w, _LINEARS[node.target][2]
    if _is_left(node):
        return node.args[0], 0
    if node.target in _MATMULS:  # x @ W.T (W stored (out, in), as nn.Linear) or x @ W (stored (in, out))
        w = node.args[1]
        if isinstance(w, fx.Node) and (w.target in _TRANSPOSES or (
                w.target is aten.transpose.int and sorted(d % 2 for d in w.args[1:3]) == [0, 1])):
            return w.args[0], 0
        return w, 1
    if (grouped := _grouped_weight(node)) is not None:
        return grouped, 0
    w = node.args[1]  # grouped: (experts, in, out), stored as it is or as its transpose (experts, out, in)
    if isinstance(w, fx.Node) and w.target is aten.transpose.int and sorted(d % 3 for d in w.args[1:3]) == [1, 2]:
        return w.args[0], 1
    return w, 2


def _einsum_weight(node: fx.Node) -> tuple[fx.Node, int, int, fx.Node] | None:
    """``einsum(equation, [x, W])`` of a parameter ``W`` (XLNet's ``ibh,hnd->ibnd``): ``W``, its first dim that the
    output keeps and ``x`` lacks (a column splits it: the heads), its first dim summed with ``x`` (a row splits it),
    and ``x``; None for any other einsum."""
    if node.target is not aten.einsum.default or len(node.args[1]) != 2:
        return None
    letters = einsum_letters(node.args[0], 2)
    operands = [_undetached(o) for o in node.args[1]]
    weights = [i for i, o in enumerate(operands) if isinstance(o, fx.Node) and o.op == "get_attr"]
    if letters is None or len(weights) != 1:
        return None
    (specs, out), (i,) = letters, weights
    spec, other = specs[i], specs[1 - i]
    kept = [d for d, c in enumerate(spec) if c in out and c not in other]
    summed = [d for d, c in enumerate(spec) if c not in out and c in other]
    if len(set(spec)) != len(spec) or not kept or not summed:
        return None
    return operands[i], kept[0], summed[0], node.args[1][1 - i]


def _expert_of(w) -> fx.Node | None:
    """The stack of expert matrices (experts, out, in) behind ``w = stack[i]``, or None."""
    if isinstance(w, fx.Node) and w.target is aten.select.int and w.args[1] in (0, -3):
        stack = _undetached(w.args[0])
        if isinstance(stack, fx.Node) and stack.op == "get_attr" and len(meta.val(stack).shape) == 3:
            return stack
    return None


_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}


def _piece_of(w, ndim: int = 2) -> fx.Node | None:
    """The parameter ``W`` of ``ndim`` dims behind ``w = W.split(sizes)[i]`` (cut along its first dim), or None:
    torch's MultiheadAttention cuts its packed in_proj weight and bias so when the query is not the key (a pooling
    head's probe query)."""
    split = w.args[0] if isinstance(w, fx.Node) and w.target is operator.getitem else None
    if not (isinstance(split, fx.Node) and split.target in _SPLITS and arg(split, "dim") in (0, -ndim)):
        return None
    param = _undetached(split.args[0])
    return param if isinstance(param, fx.Node) and param.op == "get_attr" and meta.val(param).dim() == ndim else None


def _packed_blocks(node: fx.Node) -> tuple[int, ...] | None:
    """The blocks of a packed weight's rows, for a linear of one of its pieces: every piece, cut further where its
    product is unflattened into (parts, width) (torch's ``kv.unflatten(-1, (2, E))``), so that each rank takes its
    heads of every part. None when the linear's weight is not a piece."""
    w = arg(node, "weight") if node.target is aten.linear.default else None
    if _piece_of(w) is None:
        return None
    split, blocks = w.args[0], []
    for i, piece in enumerate(meta.val(split)):
        size = int(piece.shape[0])
        parts = {_parts(linear, size) for getter in split.users if getter.args[1] == i
                 for linear in getter.users if linear.target is aten.linear.default and arg(linear, "weight") is getter}
        n = parts.pop() if len(parts) == 1 else 1
        blocks.extend([size // n] * n)
    return tuple(blocks) if len(blocks) > 1 else None


def _parts(linear: fx.Node, size: int) -> int:
    """How many parts a linear's ``size`` output features are unflattened into (k and v of one product), else 1."""
    last = len(meta.val(linear).shape) - 1
    for user in linear.users:
        if user.target is aten.unflatten.int and user.args[1] in (-1, last) and len(user.args[2]) == 2:
            n, width = user.args[2]
            if n * width == size and n > 1:
                return n
    return 1


def _weight(node: fx.Node) -> str | None:
    w, _ = _weight_node(node)
    return w.target if isinstance(w, fx.Node) and w.op == "get_attr" else None


def _out_dim(node: fx.Node) -> int:
    return _weight_node(node)[1]


def _in_dim(node: fx.Node) -> int:
    if (einsum := _einsum_weight(node)) is not None:
        return einsum[2]
    if is_patch_conv(node):  # the kernel's rows: each rank reads its rows of every patch
        return 2
    if is_convolution(node):
        return channel_dims(node)[1]
    out = _out_dim(node)
    stacked = len(meta.val(_weight_node(node)[0]).shape) == 3
    return 3 - out if stacked else 1 - out  # (out, in) / (in, out); experts (e, out, in) / (e, in, out)


def _bias(node: fx.Node) -> str | None:
    if _is_dense_conv(node) and not is_patch_conv(node):  # a patch embedding's bias is added after its sum, whole
        b = _undetached(arg(node, "bias"))
        return b.target if isinstance(b, fx.Node) and b.op == "get_attr" else None
    if node.target not in _LINEARS:
        return None
    b = _undetached(arg(node, "bias" if node.target is aten.linear.default else "self"))  # by position or keyword
    b = _piece_of(b, 1) or b  # a piece of a packed bias, cut as its weight
    return b.target if isinstance(b, fx.Node) and b.op == "get_attr" else None


def _enclosing(gm, plan, state, columns, row, grad, order):
    """A region that holds ``columns`` and ``row`` and ends at a later linear, with ``row`` inside it: a state-space
    mixer (in_proj -> x_proj -> dt_proj -> out_proj), where x_proj reads the channels in_proj splits and sums them
    back whole (a row inside), dt_proj splits them again (a column) and out_proj ends the block. Taken when it
    shards on a scratch plan, so that the nearer, smaller region (x_proj -> dt_proj alone) does not claim it."""
    for later in sorted(_forward_cone(row, grad), key=order.__getitem__):
        cone = sorted((c for c in _cone(_input(later), grad) if _is_free(c, plan, state)), key=order.__getitem__)
        if row not in cone or not set(columns) <= set(cone) or not _is_free(later, plan, None):
            continue
        scratch = TensorParallelPlan(size=plan.size, params=dict(plan.params))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _try_region(gm, scratch, state, cone, later, "replicate")
        if _weight(later) in scratch.params and all(_weight(c) in scratch.params for c in cone):
            return cone, later
    return None


_CHOICES = {aten.topk.default, aten.sort.default, aten.argsort.default, aten.argmax.default, aten.argmin.default}


def _chooses(linear: fx.Node, limit: int = 40) -> bool:
    """Whether a linear's own outputs are ranked by a top-k (or a sort, an argmax) within ``limit`` ops, through no
    other product: an MoE router, whose logits choose the experts. Split alone, its logits would be sums of
    per-rank parts, rounded otherwise than the whole product: a near tie could pick another expert than the model
    run whole picks. Routers stay replicated, as Megatron keeps them. (A sparse-attention indexer ranks keys by
    products of its outputs with others: not a router.)"""
    seen, todo = set(), [linear]
    while todo and len(seen) < limit:
        node = todo.pop(0)
        if node in seen:
            continue
        seen.add(node)
        if node.target in _CHOICES:
            return True
        if node is linear or node.target not in _PRODUCTS:
            todo.extend(node.users)
    return False


_PRODUCTS = {aten.linear.default, aten.addmm.default, aten.mm.default, aten.bmm.default, aten.matmul.default,
             aten.baddbmm.default, aten.einsum.default, aten.scaled_dot_product_attention.default}


def _forward_cone(x: fx.Node, grad: set[fx.Node]) -> list[fx.Node]:
    """The linears that read ``x`` through values that carry gradients: the first linear on every path."""
    return _walk(list(x.users), grad, lambda node: node.users)


def _is_free(node: fx.Node, plan: TensorParallelPlan, state: Propagation | None) -> bool:
    if _weight(node) in plan.params or (_bias(node) in plan.params):
        return False
    return state is None or state.of(_input(node)) == R


def _input(node: fx.Node) -> fx.Node:
    """The activation a linear multiplies: linear(x, w, b), addmm(b, x, w) and grouped(x, w, offsets)."""
    if (einsum := _einsum_weight(node)) is not None:
        return einsum[3]
    if node.target not in _LINEARS:
        return node.args[1] if _is_left(node) else node.args[0]
    return arg(node, "input" if node.target is aten.linear.default else "mat1")


def _cone(x: fx.Node, grad: set[fx.Node]) -> list[fx.Node]:
    """The linears that feed ``x`` through values that carry gradients (not masks, not positions)."""
    return _walk([x], grad, lambda node: node.all_input_nodes)  # a linear of a computed weight (a cast) is any op


def _walk(start: list[fx.Node], grad: set[fx.Node], step) -> list[fx.Node]:
    """The first linears met going from ``start`` by ``step`` (inputs or users) through values carrying gradients;
    none past ``_CONE_LIMIT`` nodes."""
    found, seen, todo = [], set(), list(start)
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if len(seen) > _CONE_LIMIT:
            return []
        if _is_linear(node) and _weight(node) is not None and not _cast_weight(node):
            found.append(node)
        elif node in grad and node.op == "call_function":
            todo.extend(step(node))
    return found


def _column_seeds(node: fx.Node, blocks, whole: tuple[int, ...] = ()) -> dict[str, Placement]:
    blocks = blocks or _packed_blocks(node)
    seeds = {_weight(node): Shard(_out_dim(node), blocks, whole)}
    if _bias(node):
        seeds[_bias(node)] = Shard(0, blocks, whole)
    return seeds


def _row_seeds(node: fx.Node) -> dict[str, Placement]:
    seeds = {_weight(node): Shard(_in_dim(node))}
    if _bias(node):
        seeds[_bias(node)] = R
    return seeds


def _try_region(gm, plan, state, columns, row, indivisible, blockers: dict | None = None) -> Propagation:
    """Try ``columns`` -> ``row``; keep the first variant that needs no all-gather. Returns the new state."""
    blocks: dict[fx.Node, tuple | None] = {c: None for c in columns}
    whole: dict[fx.Node, tuple[int, ...]] = {}  # blocks held whole (kv heads the degree does not divide)
    dropped: dict[fx.Node, str] = {}
    inner: set[fx.Node] = set()  # candidates fed by the region's split values: rows inside it
    found: set[fx.Node] = set()  # convolutions outside the candidates that turned out to be rows inside it
    hinted: set[fx.Node] = set()
    baseline: dict[fx.Node, str] = {}
    prop = None
    for _ in range(3 * len(columns) + 2):
        live = [c for c in columns if c not in dropped]
        if not live:
            break
        seeds = dict(state.seeds)
        for c in live:
            seeds.update(_row_seeds(c) if c in inner else _column_seeds(c, blocks[c], whole.get(c, ())))
        if row is not None:
            seeds.update(_row_seeds(row))
        problem = _width_problem(gm, [c for c in live if c not in inner], blocks, whole, plan.size,
                                 lone=row is None)
        prop = _propagate(gm, seeds, plan.size, base=state)
        gathers, fallbacks, conflicts = cost(prop, prop.changed)
        old = cost(state, prop.changed)
        if problem is None and gathers <= old[0] and fallbacks <= old[1] and not conflicts:
            if (found or any(is_convolution(c) for c in live)) and _splits_a_residual(prop):
                break  # the residual stream would stay split by channels: a block ends at its own row's sum
            _record(gm, plan, prop, live, row, blocks, dropped, inner, whole)
            return prop
        fed = [c for c in live if c not in inner and blocks[c] is None and _fed_split(prop, c)]
        if fed and row is not None:  # Mamba's x_proj reads the split channels: a row, its small output summed
            inner.update(fed)
            continue
        reached = _convs_fed_split(prop, plan, live, row)
        if reached and row is not None:  # a squeeze-and-excitation gate's conv, the block's own last conv
            columns = [*columns, *reached]
            inner.update(reached)
            found.update(reached)
            continue
        culprits = _conflicted(prop, live) if conflicts else ({problem[0]: problem[1]} if problem else {})
        hint = _hint(prop, live)
        layout = None if hint is None else hint[1] if blocks[hint[0]] is None else _refined(blocks[hint[0]], hint[1])
        if layout is not None and (hint[0] not in hinted or blocks[hint[0]] is not None):
            if not hinted:
                baseline = culprits  # the conflicts before any blocked layout: what to fall back on
            for c in columns:  # every expert of a stack read as W[i] is one weight: one layout
                if _weight(c) == _weight(hint[0]):
                    hinted.add(c)
                    blocks[c] = layout
            continue
        held = {c: _conflicted_blocks(prop, c, blocks[c]) for c in culprits if blocks[c] and c not in whole}
        if any(held.values()):  # a fused q, k, v whose kv heads do not divide: k and v held whole, as k_proj would be
            whole.update((c, found) for c, found in held.items() if found)
            continue
        if baseline:
            # the blocked layouts did not help (heads viewed as (heads, head dim), not a fused projection): back
            # to the conflicts they were tried for
            for column in hinted:
                blocks[column] = None
            culprits, baseline = baseline, {}
        if not culprits:
            break
        if len(culprits) == len(live) and row is not None:
            reason = max(culprits.values(), key=lambda text: int(text.split()[0]))
            if _shards_when_divisible(gm, plan, state, columns, row):
                _indivisible(gm, row, reason, plan.size, indivisible)
                for node in (*columns, row):  # kept whole as asked, not split alone later
                    for name in filter(None, (_weight(node), _bias(node))):
                        plan.params[name] = ParamPlan(R, "replicated", f"kept whole: {reason}")
            # else no degree would shard it (falcon's one fused q/k/v of 4 + 2 heads, sliced apart): replicated
            break
        dropped.update(culprits)
    if prop is not None:
        _note_refusals(plan, prop)
        if blockers is not None and row is not None:
            why = _blocker(prop, gm, row)
            for node in (*columns, row):
                for name in filter(None, (_weight(node), _bias(node))):
                    blockers.setdefault(name, why)
    return state


def _accepts(prop: Propagation, state: Propagation) -> bool:
    """Whether ``prop`` gathers no split value and falls back no more than ``state`` did, without conflicts, and
    every weight it splits divides over the ranks (a table of 2 heads' biases is not split 4 ways)."""
    gathers, fallbacks, conflicts = cost(prop, prop.changed)
    old = cost(state, prop.changed)
    return gathers <= old[0] and fallbacks <= old[1] and not conflicts and _seeds_divide(prop, state)


def _seeds_divide(prop: Propagation, state: Propagation) -> bool:
    """Whether every weight ``prop`` splits anew has, along the split dim, blocks the degree divides."""
    for node in prop.changed:
        placement = prop.seeds.get(node.target) if node.op == "get_attr" else None
        if not isinstance(placement, Shard) or state.seeds.get(node.target) == placement:
            continue
        try:
            size = node.graph.owning_module.get_parameter(node.target).shape[placement.dim]
        except AttributeError:  # not a parameter: nothing of it is stored split
            continue
        blocks = placement.blocks or (size,)
        if sum(blocks) != size or any(b % prop.size for i, b in enumerate(blocks) if i not in placement.whole):
            return False
    return True


def _try_lone_row(plan: TensorParallelPlan, state: Propagation, row: fx.Node) -> Propagation:
    """A linear no region took, split alone over its input features: each rank multiplies its slice of the
    (replicated) input and one all-reduce sums the products, so its weight is divided by the degree for the price
    of that all-reduce (and an all-gather of the input's gradient). Kept when nothing downstream gathers."""
    seeds = {**state.seeds, **_row_seeds(row)}
    if any(name in plan.params for name in seeds if name not in state.seeds):
        return state
    prop = _propagate(row.graph.owning_module, seeds, plan.size, base=state)
    if not _accepts(prop, state):
        return state
    for name, placement in _row_seeds(row).items():
        role = "row" if isinstance(placement, Shard) else "replicated"
        plan.params[name] = ParamPlan(placement, role, "row alone: its input sliced, its output all-reduced"
                                      if role == "row" else "bias added after the sum")
    return prop


def _plan_tables(gm, plan: TensorParallelPlan, state: Propagation, params: set[str]) -> Propagation:
    """Tables no input id indexes (positions, relative position buckets, token types), split by columns where
    their lookups flow into split values (a bias per head), else by rows as the token embedding is, where the
    lookup takes a few ids per input id at most (prompt tokens prepended; positions): the all-reduce of a lookup
    per pair of positions (a (T, T) bias) would cost more than the table saves."""
    tokens = max((meta.val(n).numel() for n in gm.graph.nodes if n.op == "placeholder" and
                  isinstance(meta.val(n), torch.Tensor) and not meta.val(n).is_floating_point()), default=0)
    for node in gm.graph.nodes:
        if (lookup := _lookup(node)) is None:
            continue
        w, ids = lookup
        if w.op != "get_attr" or w.target not in params or w.target in plan.params:
            continue
        columns = _propagate(gm, {**state.seeds, w.target: Shard(1)}, plan.size, base=state)
        if _accepts(columns, state):
            plan.params[w.target] = ParamPlan(Shard(1), "column", "table split by columns: each rank looks up "
                                              "the columns its split consumers take")
            state = columns
            continue
        if meta.val(ids).numel() > _IDS_PER_TOKEN * tokens:
            continue
        rows = _propagate(gm, {**state.seeds, w.target: Shard(0)}, plan.size, base=state)
        if _accepts(rows, state):
            plan.params[w.target] = ParamPlan(Shard(0), "vocab", "table split by rows: a vocab-parallel lookup")
            state = rows
    return state


def _plan_sliced(gm, plan: TensorParallelPlan, state: Propagation, params: set[str]) -> Propagation:
    """Weights every reader takes the same part of (a depthwise convolution's kernels over split channels, a
    state-space model's decay per channel, a norm over split heads): each rank holds that part only."""
    for node in gm.graph.nodes:
        if node.op != "get_attr" or node.target not in params or node.target in plan.params:
            continue
        wants = {_wanted(state, user, node) for user in node.users}
        if len(wants) == 1 and isinstance(want := next(iter(wants)), Shard):
            candidates = [want]
        elif reads := _split_reads(state, node):  # read through views or casts: any dim may be the one
            candidates = list(dict.fromkeys(Shard(d, r.blocks) for r in reads for d in range(meta.val(node).dim())))
        else:
            continue
        for want in candidates:
            prop = _propagate(gm, {**state.seeds, node.target: want}, plan.size, base=state)
            if _accepts(prop, state) and not _moves_split(prop):
                plan.params[node.target] = ParamPlan(want, "sliced", "each reader takes this part: held split")
                state = prop
                break
    return state


def _wanted(state: Propagation, user: fx.Node, value: fx.Node) -> Placement:
    decision = state.decisions.get(user)
    return decision.want.get(value, R) if decision is not None else R


def _split_reads(state: Propagation, value: fx.Node, depth: int = 6) -> list[Shard]:
    """The parts that readers of ``value``, or of what is computed from it alone (views, casts, ``-exp(A_log)``),
    take."""
    found = []
    for user in value.users:
        if isinstance(want := _wanted(state, user, value), Shard):
            found.append(want)
        elif depth and user.op == "call_function" and user.all_input_nodes == [value]:
            found += _split_reads(state, user, depth - 1)
    return found


def _moves_split(prop: Propagation) -> bool:
    """Whether some value split one way is wanted split another (an all-to-all the cost does not count)."""
    return any(isinstance(prop.of(v), Shard) and dst != prop.of(v)
               for node in prop.changed if (d := prop.decisions.get(node)) is not None for v, dst in d.want.items())


def _shards_when_divisible(gm, plan, state, columns, row) -> bool:
    """Whether the block would be sharded were its sizes divisible (planned for one rank, where every size is): the
    question behind an error that names the degrees that divide. Tried on a scratch plan, quietly."""
    scratch = TensorParallelPlan(size=1, params=dict(plan.params))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _try_region(gm, scratch, _propagate(gm, dict(state.seeds), 1), columns, row, "replicate")
    return any(_weight(c) in scratch.params for c in columns)


def _blocker(prop: Propagation, gm: fx.GraphModule, row: fx.Node) -> str:
    """Why a region was refused, for explain(): the first op that needed a split value whole."""
    layer = meta.module_path(row) or row.name
    for node in gm.graph.nodes:
        decision = prop.decisions.get(node) if node in prop.changed else None
        if decision is None:
            continue
        gathered = [v for v, dst in decision.want.items() if isinstance(prop.of(v), Shard) and dst == R]
        if decision.conflict or gathered or decision.fallback:
            op = getattr(node.target, "__name__", str(node.target))
            where = re.sub(r'File ".*?([^/"]+)", line (\d+), in \w+', r"\1:\2", meta.source_line(node)) or \
                meta.module_path(node) or node.name
            what = decision.conflict or (f"{op} has no rule for a split input" if decision.fallback and not
                                         decision.reason else decision.reason or f"{op} needs its input whole")
            return f"no pattern: the block ending in {layer} would gather at {op} ({what}; {where})"
    return "no pattern shards it"


def _note_refusals(plan: TensorParallelPlan, prop: Propagation) -> None:
    """Say why a candidate was dropped when an op's rule refused an argument its rewrite cannot carry."""
    for node in sorted(prop.changed, key=lambda n: n.name):
        decision = prop.decisions.get(node)
        if decision is None or not decision.reason:
            continue
        where = meta.source_line(node) or meta.module_path(node) or node.name
        note = f"{decision.reason} (from {where}): its inputs stay replicated"
        if note not in plan.notes:
            plan.notes.append(note)
            warnings.warn(f"autoshard: {note}", stacklevel=4)


def _width_problem(gm, columns, blocks, whole, size, *, lone: bool = False) -> tuple[fx.Node, str] | None:
    """A column whose output features the degree does not divide (a lone column's are padded instead)."""
    if lone:
        return None
    for c in columns:
        width = gm.get_parameter(_weight(c)).shape[_out_dim(c)]
        pieces = blocks[c] or (width,)
        if any(p % size for i, p in enumerate(pieces) if i not in whole.get(c, ())):
            works = [d for d in range(1, width + 1) if width % d == 0]
            return c, (f"{width} output features of {meta.module_path(c) or c.name} do not divide over {size} ranks; "
                       f"degrees that divide {width}: {works}")
    return None


def _refined(blocks: tuple[int, ...], pieces: tuple[int, ...]) -> tuple[int, ...] | None:
    """``blocks`` with the one block as wide as ``pieces`` together cut into them: a piece of a fused projection cut
    apart again further on (Mamba2's in_proj: z, then x, B and C together through the conv, then dt). None when no
    block, or more than one, is that wide."""
    at = [i for i, b in enumerate(blocks) if b == sum(pieces)]
    if len(pieces) < 2 or len(at) != 1:
        return None
    return (*blocks[:at[0]], *pieces, *blocks[at[0] + 1:])


def _hint(prop: Propagation, columns) -> tuple[fx.Node, tuple] | None:
    for node in sorted(prop.changed, key=lambda n: n.name):  # the same choice on every rank
        decision = prop.decisions.get(node)
        if decision is not None and decision.blocks_hint:
            for c in columns:
                if _reaches(c, node, prop.changed):
                    return c, decision.blocks_hint
    return None


def _conflicted_blocks(prop: Propagation, column: fx.Node, blocks: tuple[int, ...]) -> tuple[int, ...]:
    """The blocks of a fused ``column`` the degree does not divide, or (as the slices that cut its output apart find
    them) from whose slice a conflict follows (kv heads the degree does not divide); none when all would be."""
    edges = list(itertools.accumulate(blocks, initial=0))
    pieces = _pieces_of(column, edges[-1])
    if not pieces or any(start not in edges or stop not in edges for _, (start, stop) in pieces):
        return ()  # not a projection cut apart into its blocks (heads viewed apart): nothing to hold whole
    conflicted = [n for n in prop.changed if (d := prop.decisions.get(n)) is not None and d.conflict]
    found = {i for i, block in enumerate(blocks) if block % prop.size}
    for piece, (start, stop) in pieces:
        if any(_reaches(piece, n, prop.changed) for n in conflicted):
            found.update(range(edges.index(start), edges.index(stop)))
    return tuple(sorted(found)) if len(found) < len(blocks) else ()


def _pieces_of(column: fx.Node, width: int) -> list[tuple[fx.Node, tuple[int, int]]]:
    """The pieces a fused projection's output is cut into along its last dim, each with its ``[start, stop)``:
    ``qkv[..., a:b]`` slices, and the items of a ``split``."""
    last = meta.val(column).dim() - 1
    pieces = []
    for user in column.users:
        if user.target not in (aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default):
            continue
        dim = arg(user, "dim")
        if not isinstance(dim, int) or dim % (last + 1) != last:
            continue
        if user.target is aten.slice.Tensor and (bounds := slice_bounds(user, width)) is not None:
            pieces.append((user, bounds))
        elif user.target in (aten.split.Tensor, aten.split_with_sizes.default):
            sizes = [int(t.shape[last]) for t in meta.val(user)]
            starts = list(itertools.accumulate(sizes, initial=0))
            for item in user.users:
                if item.target is operator.getitem:
                    pieces.append((item, (starts[item.args[1]], starts[item.args[1] + 1])))
    return pieces


def _conflicted(prop: Propagation, columns) -> dict[fx.Node, str]:
    culprits = {}
    for node in prop.changed:
        decision = prop.decisions.get(node)
        if decision is not None and decision.conflict:
            for c in columns:
                if _reaches(c, node, prop.changed):
                    culprits[c] = decision.conflict
    return culprits


def _reaches(src: fx.Node, dst: fx.Node, within: set[fx.Node]) -> bool:
    seen, todo = set(), [src]
    while todo:
        node = todo.pop()
        if node is dst:
            return True
        if node in seen:
            continue
        seen.add(node)
        todo.extend(u for u in node.users if u in within)
    return False


def _indivisible(gm, row: fx.Node, reason: str, size: int, mode: str) -> None:
    layer = meta.module_path(row) or row.name
    message = f"tensor parallelism over {size} ranks cannot split the block ending in {layer}: {reason}"
    if mode == "error":
        raise TensorParallelError(message, option=("tp_indivisible", "replicate"))
    warnings.warn(message + "; the layer stays replicated", stacklevel=3)


def _convs_fed_split(prop: Propagation, plan: TensorParallelPlan, live, row) -> list[fx.Node]:
    """The convolutions outside the candidates that would gather the channels the region splits: rows inside it (a
    squeeze-and-excitation gate's reducing conv, its small output summed; the block's projection after the gate).
    Found by propagation, as a transformer's blocks have no such rows, only for convolutions."""
    return [n for n in sorted(prop.changed, key=lambda n: n.name)
            if _is_dense_conv(n) and not is_patch_conv(n) and n not in live and n is not row
            and _is_free(n, plan, None) and _fed_split(prop, n)]


_SUMS = {aten.add.Tensor, aten.sub.Tensor, aten.add_.Tensor, aten.sub_.Tensor}  # a residual joined (``h += x``)


def _splits_a_residual(prop: Propagation) -> bool:
    """Whether a split value is added to a whole one of its shape, which each rank then takes its part of: a residual
    stream joined by a block's channels, so that the sum (the stream) would stay split. Megatron's blocks end at their
    row's all-reduce, and the stream stays whole."""
    for node in prop.changed:
        decision = prop.decisions.get(node)
        if node.target in _SUMS and decision is not None and any(
                isinstance(want, Shard) and prop.of(value) == R and meta.val(value).shape == meta.val(node).shape
                for value, want in decision.want.items()):
            return True  # (a bias broadcast over the image is no stream: each rank takes its channels' part)
    return False


def _fed_split(prop: Propagation, c: fx.Node) -> bool:
    """Whether the region splits the features ``c`` reads, which ``c`` as a column would gather."""
    x, decision = _input(c), prop.decisions.get(c)
    feature = 1 if is_convolution(c) else len(meta.val(x).shape) - (2 if _is_left(c) else 1)
    return prop.of(x) == Shard(feature) and decision is not None and decision.want.get(x) == R


def _record(gm, plan, prop, columns, row, blocks, dropped, inner=frozenset(), whole=None) -> None:
    kind = ("attention" if any(_is_attention(n) for n in prop.changed) else "output" if row is None
            else "convolution" if is_convolution(row) else "MLP")
    closed = f"{kind} block closed by {meta.module_path(row) or row.name}" if row is not None else ""
    for c in columns:
        if c in inner:
            for name, placement in _row_seeds(c).items():
                role = "row" if isinstance(placement, Shard) else "replicated"
                plan.params[name] = ParamPlan(placement, role, f"row inside {closed}" if role == "row"
                                              else "bias added after the sum")
            continue
        held = (whole or {}).get(c, ())
        layout = f", blocked {blocks[c]}" if blocks[c] else ""
        if held:
            layout += (f" with block{'s' if len(held) > 1 else ''} {', '.join(str(i) for i in held)} whole on every "
                       "rank (kv heads the degree does not divide, duplicated)")
        alone = ("column alone: its output channels stay split through the layers after it" if is_convolution(c)
                 else "column-parallel output (vocab-parallel loss)")
        reason = f"column of {closed}{layout}" if row is not None else alone
        for name, placement in _column_seeds(c, blocks[c], held).items():
            plan.params[name] = ParamPlan(placement, "column", reason)
    if row is not None:
        for name, placement in _row_seeds(row).items():
            role = "row" if isinstance(placement, Shard) else "replicated"
            why = f"row of {closed}" if role == "row" else "bias added after the sum"
            plan.params[name] = ParamPlan(placement, role, why)
    for c, why in sorted(dropped.items(), key=lambda item: item[0].name):
        where = meta.module_path(c) or c.name
        plan.notes.append(f"{where} kept replicated ({why}); each rank takes its heads")
        for name in filter(None, (_weight(c), _bias(c))):
            plan.params[name] = ParamPlan(R, "replicated", f"heads duplicated in {closed}: each rank takes its share")


def _is_attention(node: fx.Node) -> bool:
    return node.target in (aten.scaled_dot_product_attention.default, aten.softmax.int, aten._softmax.default)


_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
             aten.unsqueeze.default, aten.contiguous.default, aten.clone.default, aten.alias.default}


def _is_input(ids: fx.Node) -> bool:
    """Token ids: a graph input, perhaps reshaped (positions and token types are computed in the graph)."""
    while ids.op == "call_function" and ids.target in _RESHAPES:
        ids = ids.args[0]
    return ids.op == "placeholder"


def _lookup(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """The table and the ids of ``embedding(table, ids)`` or ``table[ids]``, or None for any other op."""
    if node.target is aten.embedding.default:
        return node.args[0], node.args[1]
    return (node.args[0], node.args[1][0]) if is_table_lookup(node) else None


def _plan_vocab(gm, plan: TensorParallelPlan, state: Propagation, params: set[str]) -> Propagation:
    for node in gm.graph.nodes:
        if (lookup := _lookup(node)) is None:
            continue
        w, ids = lookup
        if w.op != "get_attr" or w.target not in params or not _is_input(ids) or w.target in plan.params:
            continue
        vocab = gm.get_parameter(w.target).shape[0]
        prop = _propagate(gm, {**state.seeds, w.target: Shard(0)}, plan.size, base=state)
        new, old = cost(prop, prop.changed), cost(state, prop.changed)
        if new[0] <= old[0] and new[1] <= old[1]:
            padded = f", padded from {vocab} to {-(-vocab // plan.size) * plan.size} rows" if vocab % plan.size else ""
            plan.params[w.target] = ParamPlan(Shard(0), "vocab", f"token embedding: vocab-parallel lookup{padded}")
            state = prop
        else:
            _note_refusals(plan, prop)
    return state


# ------------------------------------------------------------------------------------------------- applying


def tensor_parallel_pass(gm: fx.GraphModule, plan: TensorParallelPlan, *, rank: int, group=None,
                         mark_entries: bool = False) -> fx.GraphModule:
    """Rewrite ``gm`` into what tp rank ``rank`` runs: collectives inserted, sizes local, parameters sharded.

    ``mark_entries`` (sequence parallelism follows): every entry of a region gets Megatron's f, also where no
    gradient flows (a ``torch.no_grad()`` region inlined), so that the sequence is gathered there too. Without
    it a region run without gradients would read the sequence split while its weights are split by heads: each
    rank would hold its heads of its own tokens only, and gathering the keys would join other ranks' heads."""
    size = plan.size
    if size == 1:
        return gm
    shard_axis(gm, tensor_axis(size, mark_entries=mark_entries), plan.placements(), rank=rank, group=group)
    _record_regions(gm)
    _shard_parameters(gm, plan, rank)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm


def _apply(gm: fx.GraphModule, sharding: Sharding, found: dict) -> None:
    on = sharding.axes["tp"]
    tensor_parallel_pass(gm, on.plan, rank=on.rank, group=on.group, mark_entries="sp" in sharding.axes)


def _describe(plan: TensorParallelPlan) -> str:
    split = sum(isinstance(p.placement, Shard) for p in plan.params.values())
    return f"{split} of {len(plan.params)} parameters split over {plan.size} ranks"


TENSOR_PARALLEL = AxisPass(
    "tp", after=("batch statistics",), applies=splitting("tp"), apply=_apply, mesh_axis="tp",
    codec=PlanCodec(encode=lambda plan: json.loads(plan.to_json()),
                    decode=lambda data: TensorParallelPlan.from_json(json.dumps(data)), describe=_describe))


_BORDERS = {CopyToParallel: "entry", ScatterToParallel: "split entry", ReduceFromParallel: "exit",
            ReadWhole: "whole entry"}


def _record_regions(gm: fx.GraphModule) -> None:
    """Where this rank's regions begin and end, on the collectives tp put at their borders (``meta.REGION``)."""
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.meta.get(meta.AXIS) == "tp":
            border = _BORDERS.get(type(gm.get_submodule(node.target)))
            if border is not None:
                node.meta[meta.REGION] = border


def _shard_parameters(gm: fx.GraphModule, plan: TensorParallelPlan, rank: int) -> None:
    present = {name for name, _ in gm.named_parameters()}  # a pipeline stage holds only some of them
    for name, p in plan.params.items():
        if not isinstance(p.placement, Shard) or name not in present:
            continue
        full = gm.get_parameter(name)
        local = torch.nn.Parameter(local_part(full.detach(), p.placement, rank, plan.size).contiguous(),
                                   full.requires_grad)
        owner, _, attr = name.rpartition(".")
        setattr(gm.get_submodule(owner) if owner else gm, attr, local)


