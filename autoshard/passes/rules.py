"""Sharding rules: for each op, the placement of its output and the local rewrite, as one table.

A rule looks at a node and the placements of its inputs (on one mesh axis of ``size`` ranks) and
returns a ``Decision``: the output placement, the placements it *wants* for inputs that must change
first (the pass inserts the collective), and, when a shard cannot continue, why (``conflict``: a
head count the degree does not divide; ``blocks_hint``: a split that needs a blocked shard).
Rules decide; ``LOCALIZERS`` rewrite a node's arguments to the sizes one rank holds (12 heads become
12/t heads) once the placements are final. An op without a rule gets replicated inputs: correct,
slower, and reported.

Rules never match on names or size values: dims come from the placements of the inputs and the
shapes that capture recorded (``meta.val(node)``).
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import fx

from autoshard import cost, meta
from autoshard.errors import AutoshardError
from autoshard.passes.axis import Axis
from autoshard.passes.loss import LOSS_SCALES
from autoshard.passes.placements import Partial, Placement, R, Replicate, Shard

aten = torch.ops.aten


@dataclass
class Decision:
    out: Placement | tuple[Placement, ...]
    want: dict[fx.Node, Placement] = field(default_factory=dict)
    conflict: str | None = None
    blocks_hint: tuple[int, ...] | None = None
    fallback: bool = False
    reason: str | None = None  # why a rule that could shard this op refuses (an argument it cannot carry)


class Context:
    """What a rule may read: the axis (its degree and capabilities), the placement of each value, and each value's
    global shape. A rule asks the axis what it may do (``ctx.axis.pending_sums``), never which axis it is."""

    def __init__(self, axis: Axis, placements: dict[fx.Node, Placement | tuple]) -> None:
        self.axis = axis
        self.placements = placements

    @property
    def size(self) -> int:
        return self.axis.size

    def of(self, value) -> Placement:
        if not isinstance(value, fx.Node):
            return R
        placement = self.placements.get(value, R)
        return R if isinstance(placement, tuple) else placement

    @staticmethod
    def shape(value) -> tuple[int, ...]:
        val = meta.val(value) if isinstance(value, fx.Node) else None
        if not isinstance(val, torch.Tensor):
            return ()
        # a size that depends on the data (the tokens routed to an expert): a rule may split the other dims, and
        # any use of that size itself (arithmetic, a comparison) refuses the rule: the op stays replicated
        where = f"{value.name} has a size that depends on the data: {tuple(val.shape)}"
        return tuple(s if isinstance(s, int) else _DataDependentSize(where) for s in val.shape)


class DataDependentShape(AutoshardError, ValueError):
    """A value's size is known only when the graph runs: no rule can reason about that dim."""


class _DataDependentSize:
    """A size known only when the graph runs, in a shape a rule reads: reading its value in any way raises
    ``DataDependentShape`` (so ``decide`` replicates the op); its position in the shape is all a rule may use."""

    def __init__(self, where: str) -> None:
        self.where = where

    def _refuse(self, *_):
        raise DataDependentShape(self.where)

    __int__ = __index__ = __bool__ = __hash__ = __float__ = _refuse
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __neg__ = __abs__ = _refuse
    __floordiv__ = __rfloordiv__ = __truediv__ = __rtruediv__ = __mod__ = __rmod__ = __pow__ = __rpow__ = _refuse

    def __repr__(self) -> str:
        return "?"


Rule = Callable[[fx.Node, Context], Decision]
RULES: dict[object, Rule] = {}
# Rules for ops recognised by their signature rather than their identity (a library's own grouped matmul op,
# registered when that library loads): (matches(node), rule), tried when no rule is keyed by the op.
MATCHERS: list[tuple[Callable[[fx.Node], bool], Rule]] = []
LOCALIZERS: dict[object, Callable] = {}


RECORDED: set[tuple[str, object]] = set()  # (table, op) of every entry written by ``op``


def op(*ops, rule: Rule | None = None, localize: Callable | None = None,
       matches: Callable[[fx.Node], bool] | None = None, flops: cost.FlopRule | None = None,
       timing: str = cost.MATMUL) -> None:
    """Record what autoshard knows of ``ops`` (overloads, packets, or the classes of ``call_module`` nodes): their
    sharding ``rule``, their ``localize``r (how one rank runs its part), and their arithmetic (``flops``, the FLOP
    rule ``cost`` counts them by, every overload of the op alike, and the ``timing`` the planner gives them); or,
    with ``matches``, the rule of the ops that predicate recognises by their signature. The one way into ``RULES``,
    ``LOCALIZERS``, ``MATCHERS`` and ``cost.FLOPS``: a second, different record of the same kind for an op is
    refused, so what an op's rule is never depends on which module was imported last."""
    if matches is not None:
        MATCHERS.append((matches, rule))
        RECORDED.add(("matcher", matches))
    for target in ops:
        if rule is not None:
            _record(RULES, "rule", target, rule)
        if localize is not None:
            _record(LOCALIZERS, "localizer", target, localize)
        if flops is not None:
            cost.record(target, flops, timing)
            RECORDED.add(("flops", getattr(target, "overloadpacket", target)))


def _record(table: dict, kind: str, target, fn: Callable) -> None:
    if table.get(target, fn) is not fn:
        raise AssertionError(f"{target} has a {kind} already ({table[target].__qualname__}), and "
                             f"{fn.__qualname__} would replace it: one record per op")
    table[target] = fn
    RECORDED.add((kind, target))


def rule(*ops, **record) -> Callable[[Rule], Rule]:
    """``@rule(ops..., flops=...)``: ``op(*ops, rule=fn, ...)`` as a decorator."""
    def register(fn: Rule) -> Rule:
        op(*ops, rule=fn, **record)
        return fn

    return register


def localizer(*ops) -> Callable:
    """``@localizer(ops...)``: ``op(*ops, localize=fn)`` as a decorator."""
    def register(fn: Callable) -> Callable:
        op(*ops, localize=fn)
        return fn

    return register


# The ops a split with blocks held whole may reach (the fused projection that makes it, its bias, the slices that
# cut it into q, k and v, casts): any other is run on the gathered value, a cost that keeps the planner from it.
WHOLE_BLOCK_OPS = {aten.linear.default, aten.add.Tensor, aten.slice.Tensor, aten.split.Tensor,
                   aten.split_with_sizes.default, aten._to_copy.default, aten.to.dtype, operator.getitem}


def decide(node: fx.Node, ctx: Context) -> Decision:
    """The decision for ``node``: its rule's, or the general fallback (replicate every input)."""
    if node.target not in WHOLE_BLOCK_OPS and any(isinstance(p := ctx.of(n), Shard) and p.whole
                                                  for n in node.all_input_nodes):
        return replicate_all(node, ctx)
    if node.op == "call_module":
        fn = rule_of(node)
        return fn(node, ctx) if fn is not None else replicate_all(node, ctx)
    fn = rule_of(node)
    if fn is not None:
        try:
            return fn(node, ctx)
        except DataDependentShape as e:  # replicated is always right, whatever the sizes turn out to be
            return replicate_all(node, ctx, reason=f"{node.target}: {e}")
    decision = replicate_all(node, ctx)
    written = [n for n in written_inputs(node) if ctx.of(n) != R]
    if written:  # run replicated, the op would write into a gathered copy and the write would be lost
        names = ", ".join(n.name for n in written)
        decision.reason = f"{node.target}: writes in place into {names}, which this axis splits"
    return decision


def rule_of(node: fx.Node) -> Rule | None:
    """The rule that decides ``node`` (by its op, its op's overload packet, its module's type or a matcher), or None:
    then the general fallback replicates it."""
    if node.op == "call_module":
        return RULES.get(type(node.graph.owning_module.get_submodule(node.target)))
    fn = RULES.get(node.target)
    if fn is None and hasattr(node.target, "overloadpacket"):
        fn = RULES.get(node.target.overloadpacket)
    return fn if fn is not None else next((rule for matches, rule in MATCHERS if matches(node)), None)


def written_inputs(node: fx.Node) -> list[fx.Node]:
    """The inputs an op writes into in place (``Tensor(a!)`` in its schema): ``embedding_renorm_``'s weight."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    return [value for a, value in zip(schema.arguments, node.args, strict=False)
            if a.alias_info is not None and a.alias_info.is_write and isinstance(value, fx.Node)]


def read_after(value: fx.Node, writer: fx.Node) -> bool:
    """Whether the write of ``writer`` into ``value`` matters: ``value`` views model state (a parameter, a
    buffer, an input) or a later node reads it. An intermediate nothing reads again may take the write on a copy."""
    base = value
    while base.op == "call_function" and base.args and isinstance(base.args[0], fx.Node) and is_view(base):
        base = base.args[0]
    if base.op in ("get_attr", "placeholder"):
        return True
    later = False
    for n in writer.graph.nodes:
        if later and (value in n.all_input_nodes or base in n.all_input_nodes):
            return True
        later = later or n is writer
    return False


def is_view(node: fx.Node) -> bool:
    """Whether ``node`` returns a view of its first argument (an alias it does not write)."""
    schema = getattr(node.target, "_schema", None)
    returns = schema.returns if schema is not None else []
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def replicate_all(node: fx.Node, ctx: Context, conflict: str | None = None, hint=None,
                  reason: str | None = None) -> Decision:
    """All inputs replicated, output replicated; a fallback only if some input was not replicated."""
    want = {n: R for n in tensor_inputs(node) if not isinstance(ctx.of(n), Replicate)}
    return Decision(_replicated_like(node), want, conflict=conflict, blocks_hint=hint, fallback=bool(want),
                    reason=reason if want else None)


def refuse(node: fx.Node, ctx: Context, argument: str, why: str) -> Decision:
    """Replicate ``node`` because its rewrite cannot carry ``argument``; the reason names the op and the value."""
    value = arg(node, argument)
    shown = "<a tensor>" if isinstance(value, fx.Node) else repr(value)
    reason = f"{node.target}: {argument}={shown} {why}"
    return replicate_all(node, ctx, reason=reason)


_MISSING = object()


def arg(node: fx.Node, name: str, default=_MISSING):
    """Argument ``name`` of an op node, positional or keyword, else its schema's default.

    Rules and localizers read every argument by name through this, so a positional and a keyword
    spelling of the same call are one case, and an argument can never be silently skipped.
    """
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return node.kwargs.get(name, None if default is _MISSING else default)
    for i, a in enumerate(schema.arguments):
        if a.name != name:
            continue
        if i < len(node.args) and not a.kwarg_only:
            return node.args[i]
        if name in node.kwargs:
            return node.kwargs[name]
        if default is not _MISSING:
            return default
        return a.default_value if a.has_default_value() else None
    raise KeyError(f"{node.target} has no argument {name!r}; its schema: {schema}")


def _replicated_like(node: fx.Node):
    val = meta.val(node)
    return tuple(R for _ in val) if isinstance(val, (list, tuple)) else R


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    return [n for n in node.all_input_nodes if isinstance(meta.val(n), torch.Tensor)]


def _dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


# ------------------------------------------------------------------------------------------ element-wise

_POINTWISE = (
    "add", "sub", "rsub", "mul", "div", "pow", "neg", "rsqrt", "sqrt", "exp", "log", "tanh", "sigmoid", "gelu",
    "silu", "relu", "cos", "sin", "erf", "abs", "clamp", "where", "masked_fill", "eq", "ne", "lt", "le", "gt", "ge",
    "__and__", "__or__", "logical_not", "bitwise_not", "to", "_to_copy", "type_as", "contiguous", "clone", "alias",
    "dropout", "detach", "lift_fresh_copy", "reciprocal", "square", "maximum", "minimum", "fill", "zeros_like",
    "ones_like", "full_like", "native_dropout", "hardtanh", "leaky_relu", "elu", "softplus", "mish",
    "expm1", "log1p", "sign", "floor", "clamp_min", "clamp_max", "logical_and", "logical_or", "lerp", "addcmul",
    "expand_as", "round", "ceil", "trunc", "frac", "empty_like",
)
_IN_PLACE = ("add_", "sub_", "mul_", "div_", "masked_fill_", "copy_")


def _pointwise(node: fx.Node, ctx: Context, out_ndim: int | None = None) -> Decision:
    out_ndim = len(ctx.shape(node)) if out_ndim is None else out_ndim
    inputs = tensor_inputs(node)
    shards: set[Shard] = set()
    for n in inputs:
        p = ctx.of(n)
        if isinstance(p, Shard):
            shards.add(p.at(p.dim + out_ndim - len(ctx.shape(n))))
    if len(shards) > 1:
        return replicate_all(node, ctx)
    if not shards and (_scales_a_sum(node, ctx) or _scales_the_loss(node, ctx)):
        return Decision(Partial())
    if not shards:
        return Decision(R, {n: R for n in inputs if isinstance(ctx.of(n), Partial)})
    (out,) = shards
    want: dict[fx.Node, Placement] = {}
    for n in inputs:
        p, shape = ctx.of(n), ctx.shape(n)
        if isinstance(p, Shard):
            continue
        d = out.dim - (out_ndim - len(shape))
        if d >= 0 and shape[d] != 1:
            want[n] = out.at(d)  # a full-size replicated operand: each rank takes its part
        elif isinstance(p, Partial):
            want[n] = R
    return Decision(out, want)


_ZEROS = {aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default}
SCALES = (aten.mul.Tensor, aten.div.Tensor)  # ops that may scale a pending sum (see ``_scales_a_sum``)
_CARRIES = {aten.cat.default, *SCALES}


def sum_reaches_zeros(node: fx.Node, depth: int = 4) -> bool:
    """Whether every reader of ``node`` carries it on (a ``cat``, a scale) to an ``index_add`` of it into zeros whose
    result nothing adds into again: JetMoE's experts' products, joined, weighted by the routing weights and added
    back at their tokens' rows. Along such a path a pending sum may stay pending and be reduced once, on the
    tokens' rows; a reader without a rule for pending sums would have it reduced first, a fallback."""
    if not node.users or depth == 0:
        return False
    return all(_adds_into_zeros(user, node) or (user.target in _CARRIES and sum_reaches_zeros(user, depth - 1))
               for user in node.users)


def _adds_into_zeros(node: fx.Node, source: fx.Node) -> bool:
    """Whether ``node`` is ``zeros.index_add(dim, index, source)``, the zeros read by nothing else and the result
    added into by nothing."""
    x = node.args[0] if node.target is aten.index_add.default else None
    return (isinstance(x, fx.Node) and x.target in _ZEROS and len(x.users) == 1 and node.args[3] is source
            and x is not source and not any(user.target is aten.index_add.default for user in node.users))


def _scales_a_sum(node: fx.Node, ctx: Context) -> bool:
    """``a * b`` or ``a / b`` of a pending sum ``a`` and a whole ``b`` on its way to an ``index_add`` into zeros
    (experts' outputs weighted by their routing weights, tp only): the sum of the scaled summands, so the sum may
    stay pending. ``b``'s gradient is then a sum over the ranks too (Megatron's f, put in where the placements are
    applied)."""
    if not ctx.axis.pending_sums or node.target not in SCALES:
        return False
    operands = [a for a in node.args[:2] if isinstance(a, fx.Node)]
    sums = [a for a in operands if isinstance(ctx.of(a), Partial)]
    return (len(sums) == 1 and all(ctx.of(a) == R for a in operands if a is not sums[0])
            and (node.target is aten.mul.Tensor or sums[0] is node.args[0]) and sum_reaches_zeros(node))


def _scales_the_loss(node: fx.Node, ctx: Context) -> bool:
    """``2.0 * loss``, ``loss / steps``, ``-loss`` or a cast of a pending scalar sum (a token loss's sum over split
    tokens) on its way to the graph's output: linear, so the sum may stay pending to the output, which says where it
    is reduced."""
    tensors = tensor_inputs(node)
    if node.target not in LOSS_SCALES or len(tensors) != 1 or not isinstance(ctx.of(tensors[0]), Partial) \
            or ctx.shape(node) != ():
        return False
    if node.target in (aten.div.Tensor, aten.div.Scalar) and node.args[0] is not tensors[0]:
        return False  # a number divided by a sum is no sum
    return _reaches_output(node)


def _reaches_output(node: fx.Node, depth: int = 6) -> bool:
    """Whether every reader of ``node`` is the graph's output, or another scale on its way there."""
    return depth > 0 and bool(node.users) and all(
        user.op == "output" or (user.target in LOSS_SCALES and _reaches_output(user, depth - 1))
        for user in node.users)


op(*(getattr(aten, name) for name in _POINTWISE if hasattr(aten, name)), rule=_pointwise)
op(aten.min.other, aten.max.other, rule=_pointwise)  # element-wise overloads of packets whose others reduce


@rule(aten.broadcast_tensors.default)
def _broadcast_tensors(node: fx.Node, ctx: Context) -> Decision:
    """Every tensor expanded to the common shape (``mse_loss``'s first step): placed as an element-wise op's output,
    each of them (an operand of size 1 along the split dim is expanded to each rank's part)."""
    outputs = meta.val(node)
    decision = _pointwise(node, ctx, out_ndim=outputs[0].dim())
    out = R if decision.fallback else decision.out
    return Decision(tuple(out for _ in outputs), decision.want, fallback=decision.fallback)


def _pointwise_in_place(node: fx.Node, ctx: Context) -> Decision:
    """``x.add_(y)`` and its kin: element-wise, so each rank may write its own part of ``x``. A redistributed ``x``
    is a copy that takes the write: right when nothing reads ``x`` (or what it views) after this op, as when
    ``mlp_out += attn_out`` sums a row-parallel product in place."""
    decision = _pointwise(node, ctx)
    written = node.args[0]
    if (written in decision.want or decision.out != ctx.of(written)) and read_after(written, node):
        return replicate_all(node, ctx, reason=f"{node.target}: writes in place into {written.name}, whose "
                                               f"placement the other operands would change")
    return decision


op(*(getattr(aten, name) for name in _IN_PLACE), rule=_pointwise_in_place)


@rule(aten.topk.default)
def _topk(node: fx.Node, ctx: Context) -> Decision:
    """The dp axis: ``topk`` along a dim the batch is not split on keeps each row's k (values and indices split as the
    input). Other axes: as without a rule (gathered)."""
    p = _one_input_shard(node, ctx)
    if ctx.axis.name != "dp" or p is None:
        return replicate_all(node, ctx)
    ndim = len(ctx.shape(node.args[0]))
    dim = arg(node, "dim")
    dim = -1 if dim is None else dim
    return replicate_all(node, ctx) if dim % ndim == p.dim else Decision((p, p))


@rule(aten.index_add.default)
def _index_add(node: fx.Node, ctx: Context) -> Decision:
    """``x.index_add(dim, index, source)`` (experts' outputs added back at their tokens' rows): element-wise in every
    dim but ``dim``, so a split of another dim stays split, each rank adding its part. Any other case replicates."""
    x, index, source = node.args[0], node.args[2], node.args[3]
    dim = _dim(node.args[1], len(ctx.shape(x)))
    if (ctx.axis.pending_sums and isinstance(ctx.of(source), Partial) and ctx.of(index) == R
            and _adds_into_zeros(node, source)):
        return Decision(Partial())  # summands added into zeros: each rank's rows a summand, reduced once after
    placements = {ctx.of(x), ctx.of(source)}
    shards = {p for p in placements if isinstance(p, Shard)}
    if ctx.of(index) != R or len(shards) != 1 or any(isinstance(p, Partial) for p in placements) \
            or next(iter(shards)).dim == dim:
        return replicate_all(node, ctx)
    (p,) = shards
    return Decision(p, {v: p for v in (x, source) if ctx.of(v) != p})


@rule(aten.scatter_add.default, aten.scatter_add_.default)
def _scatter_add(node: fx.Node, ctx: Context) -> Decision:
    """``x.scatter_add(dim, index, source)`` (torchtitan's experts' outputs added back at their tokens' rows, onto the
    shared expert's): ``x`` plus ``source`` placed by ``index``, linear in ``(x, source)`` together. Pending sums of
    both stay one pending sum, reduced once after (each rank's ``x`` and ``source`` a summand); a pending ``source``
    added into zeros stays pending too. Any other pending sum is reduced first. All three split alike along another
    dim than ``dim``, at one size there (a cross-entropy's gradient, rows split): each rank scatters into its own
    rows. Any other split replicates."""
    x, index, source = node.args[0], node.args[2], node.args[3]
    px, ps = ctx.of(x), ctx.of(source)
    if ctx.axis.pending_sums and isinstance(ps, Partial) and ctx.of(index) == R and (
            isinstance(px, Partial) or (isinstance(x, fx.Node) and x.target in _ZEROS and len(x.users) == 1)):
        return Decision(Partial())
    values = [v for v in (x, index, source) if isinstance(v, fx.Node)]
    if len(values) == 3 and isinstance(px, Shard) and px.blocks is None and all(ctx.of(v) == px for v in values) \
            and px.dim != _dim(node.args[1], len(ctx.shape(x))) and len({ctx.shape(v)[px.dim] for v in values}) == 1:
        return Decision(px)
    if any(isinstance(ctx.of(v), Shard) for v in values):
        return replicate_all(node, ctx)
    return Decision(R, {v: R for v in (x, source) if isinstance(v, fx.Node) and isinstance(ctx.of(v), Partial)})


def is_table_lookup(node: fx.Node) -> bool:
    """``table[ids]`` of a 2-D parameter by one tensor of integer ids: an embedding lookup (Whisper's positions)."""
    if node.target is not aten.index.Tensor:
        return False
    x, indices = node.args[0], node.args[1]
    return (isinstance(x, fx.Node) and x.op == "get_attr"
            and meta.val(x).dim() == 2 and len(indices) == 1 and isinstance(indices[0], fx.Node)
            and not meta.val(indices[0]).dtype.is_floating_point and meta.val(indices[0]).dtype != torch.bool)


@rule(aten.index.Tensor)
def _index(node: fx.Node, ctx: Context) -> Decision:
    """``x[ids]`` (tokens gathered per expert, rows put back in order): integer index tensors on the leading dims
    pick whole slices of the dims after them, so a split of a later dim stays split. Any other case replicates."""
    x, indices = node.args[0], list(node.args[1])
    p = ctx.of(x)
    leading = len(indices)
    if is_table_lookup(node) and p == Shard(0) and ctx.axis.pending_sums:  # a table split by rows: vocab-parallel
        return Decision(R, {indices[0]: R} if ctx.of(indices[0]) != R else {})
    if not isinstance(p, Shard) or p.dim < leading or any(
            not isinstance(i, fx.Node) or meta.val(i).dtype == torch.bool or ctx.of(i) != R for i in indices):
        return replicate_all(node, ctx)
    return Decision(p.at(p.dim - leading + len(ctx.shape(node)) - (len(ctx.shape(x)) - leading)))


@rule(aten.index_select.default)
def _index_select(node: fx.Node, ctx: Context) -> Decision:
    """``x.index_select(dim, ids)`` (XLNet's relative shift keeps the first positions): a split of another dim stays."""
    p, ids = _one_input_shard(node, ctx), arg(node, "index")
    if p is None or ctx.of(ids) != R or p.dim == _dim(arg(node, "dim"), len(ctx.shape(node))):
        return replicate_all(node, ctx) if p is not None or ctx.of(ids) != R else _pointwise(node, ctx)
    return Decision(p)


@rule(aten.index_put.default, aten.index_put_.default)
def _masked_put(node: fx.Node, ctx: Context) -> Decision:
    """``x[mask] = value`` with a boolean mask of ``x``'s shape and one value for every masked element: element-wise
    (a ``masked_fill``), so each rank writes its own part. Any other indexing replicates."""
    x, indices, values = node.args[0], arg(node, "indices"), arg(node, "values")
    mask = indices[0] if len(indices) == 1 and isinstance(indices[0], fx.Node) else None
    if (mask is None or meta.val(mask).dtype != torch.bool or ctx.shape(mask) != ctx.shape(x)
            or not isinstance(values, fx.Node) or meta.val(values).numel() != 1 or arg(node, "accumulate")):
        return replicate_all(node, ctx)
    p = ctx.of(x)
    if not isinstance(p, Shard) or ctx.of(mask) not in (p, R) or ctx.of(values) != R:
        return replicate_all(node, ctx)
    return Decision(p, {mask: p} if ctx.of(mask) == R else {})  # x keeps its split: a write in place stays local


# --------------------------------------------------------------------------------------- dims and views


def _one_input_shard(node: fx.Node, ctx: Context) -> Shard | None:
    p = ctx.of(node.args[0])
    return p if isinstance(p, Shard) else None


# Views that move dims without changing their sizes, as data: for a view node, its input's shape and its output's
# rank, which input dim each output dim is (None: a dim the view adds), or None where the view is not one of these
# (``t`` of other than a matrix). One interpreter (``_moved``) reads them all.
DimMap = tuple[int | None, ...] | None


def _transposed(node: fx.Node, shape: tuple, out: int) -> DimMap:
    n = len(shape)
    names = ("dim0", "dim1") if node.target is aten.transpose.int else ("axis0", "axis1")
    a, b = (_dim(arg(node, name), out) for name in names)
    dims = list(range(n))
    dims[a], dims[b] = dims[b], dims[a]
    return tuple(dims)


def _moved_dim(node: fx.Node, shape: tuple, out: int) -> DimMap:
    n = len(shape)
    source, destination = _dim(arg(node, "source"), out), _dim(arg(node, "destination"), out)
    dims: list[int | None] = [d for d in range(n) if d != source]
    dims.insert(destination, source)
    return tuple(dims)


def _unsqueezed(node: fx.Node, shape: tuple, out: int) -> DimMap:
    n = len(shape)
    dims: list[int | None] = list(range(n))
    dims.insert(_dim(arg(node, "dim"), out), None)
    return tuple(dims)


def _squeezed(node: fx.Node, shape: tuple, out: int) -> DimMap:
    n = len(shape)
    dims = range(n) if node.target is aten.squeeze.default else arg(node, "dim")
    dims = dims if isinstance(dims, (list, tuple, range)) else [dims]
    removed = {d for d in (_dim(d, n) for d in dims) if shape[d] == 1}
    return tuple(d for d in range(n) if d not in removed)


VIEW_DIMS: dict[object, Callable[[fx.Node, tuple, int], DimMap]] = {
    aten.transpose.int: _transposed,
    aten.swapaxes.default: _transposed,
    aten.t.default: lambda node, shape, out: (1, 0) if out == 2 else None,  # numpy_T reverses every dim
    aten.numpy_T.default: lambda node, shape, out: (1, 0) if out == 2 else None,
    aten.permute.default: lambda node, shape, out: tuple(_dim(d, out) for d in arg(node, "dims")),
    aten.movedim.int: _moved_dim,
    aten.unsqueeze.default: _unsqueezed,
    aten.squeeze.dim: _squeezed,
    aten.squeeze.dims: _squeezed,
    aten.squeeze.default: _squeezed,
    aten.expand.default: lambda node, shape, out: (*(None,) * (out - len(shape)), *range(len(shape))),
}


def _moved(node: fx.Node, ctx: Context) -> Decision:
    """A view of ``VIEW_DIMS``: the split moves with its dim (its blocks kept); a replicated input stays so."""
    p = _one_input_shard(node, ctx)
    if p is None:
        return _pointwise(node, ctx)
    dims = VIEW_DIMS[node.target](node, ctx.shape(node.args[0]), len(ctx.shape(node)))
    if dims is None or p.dim not in dims:
        return replicate_all(node, ctx)
    return Decision(p.at(dims.index(p.dim)))


op(*VIEW_DIMS, rule=_moved)


@rule(aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unflatten.int, aten.flatten.using_ints)
def _reshape(node: fx.Node, ctx: Context) -> Decision:
    p = _one_input_shard(node, ctx)
    if p is None:
        return _pointwise(node, ctx)
    in_shape, out_shape = ctx.shape(node.args[0]), ctx.shape(node)
    if p.blocks is not None and len(p.blocks) > 1 and len(set(p.blocks)) == 1 and ctx.axis.blocked_splits:
        # equal blocks are an inner dim split whole: rows of (tokens x heads) with heads split, back to features
        inner = [*in_shape[:p.dim], len(p.blocks), p.blocks[0], *in_shape[p.dim + 1:]]
        group = _dim_group(inner, out_shape, p.dim + 1)
        if group is not None:
            ins, outs = group
            if len(ins) == len(outs) == 1:
                return Decision(Shard(outs[0]))
            if len(ins) == 1:
                return _split_dim(node, ctx, Shard(p.dim + 1), [out_shape[o] for o in outs], outs)
            return _split_and_merge(node, ctx, Shard(p.dim + 1), [inner[d] for d in ins], ins,
                                    [out_shape[d] for d in outs], outs)
    group = _dim_group(in_shape, out_shape, p.dim)
    if group is None:
        return replicate_all(node, ctx)
    ins, outs = group
    if len(ins) == 1 and len(outs) == 1:
        return Decision(p.at(outs[0]))
    if len(ins) == 1:  # one dim split into several: the shard moves to the outermost that is not a block index
        return _split_dim(node, ctx, p, [out_shape[o] for o in outs], outs)
    if len(outs) == 1 and p.blocks is None:  # dims merged into one
        if ins[0] == p.dim:  # the outermost is sharded: one contiguous shard
            return Decision(Shard(outs[0]))
        # an inner dim is sharded (tokens of a flattened batch): every outer index holds a block
        outer = math.prod(in_shape[d] for d in ins if d < p.dim)
        block = math.prod(in_shape[d] for d in ins if d >= p.dim)
        return Decision(Shard(outs[0], (block,) * outer))
    if p.blocks is None and ctx.axis.blocked_splits:  # cp: contiguous chunks, never blocks
        return _split_and_merge(node, ctx, p, [in_shape[d] for d in ins], ins, [out_shape[d] for d in outs], outs)
    return replicate_all(node, ctx)


@rule(aten.reshape_as.default, aten.view_as.default)
def _reshape_as(node: fx.Node, ctx: Context) -> Decision:
    """``x.reshape_as(y)`` (RoFormer's rotary), ``x.view_as(y)`` (what autograd makes of an input a custom Function
    hands back, ``x.view_as(x)``): a reshape to ``y``'s shape. ``y`` lends only its shape, so its placement is never
    asked for (the rewrite reshapes to the local shape, without ``y``)."""
    x, shape_of = node.args[0], node.args[1]
    if _one_input_shard(node, ctx) is None:
        return Decision(R, {x: R} if isinstance(ctx.of(x), Partial) else {})
    decision = _reshape(node, ctx)
    if shape_of in decision.want:
        want = {n: p for n, p in decision.want.items() if n is not shape_of}
        decision = Decision(decision.out, want, decision.conflict, decision.blocks_hint,
                            decision.fallback and bool(want), decision.reason)
    return decision


def _split_and_merge(node: fx.Node, ctx: Context, p: Shard, in_sizes, ins, out_sizes, outs) -> Decision:
    """Several dims reshaped into several others ((tokens, batch, width) to (tokens, batch * heads, head dim), as
    torch's MultiheadAttention views q): as the split of the sharded dim into pieces, then a merge of pieces.

    The pieces are the finest sizes both shapes are made of. The shard goes to the outermost piece of the
    sharded input dim (its heads); in the output dim holding that piece, pieces outside it make blocks
    (each batch row holds its heads), as a merge of dims does."""
    bounds = sorted({math.prod(in_sizes[:i]) for i in range(1, len(in_sizes) + 1)} |
                    {math.prod(out_sizes[:i]) for i in range(1, len(out_sizes) + 1)})
    if any(b % a for a, b in itertools.pairwise(bounds)):
        return replicate_all(node, ctx)
    pieces = [bounds[0], *(b // a for a, b in itertools.pairwise(bounds))]

    def owner(sizes: list[int], index: int) -> int:  # the dim of ``sizes`` that piece ``index`` belongs to
        return next(d for d in range(len(sizes)) if bounds[index] <= math.prod(sizes[:d + 1]))

    mine = [i for i in range(len(pieces)) if ins[owner(in_sizes, i)] == p.dim and pieces[i] != 1]
    if not mine:
        return replicate_all(node, ctx)
    first = mine[0]
    if pieces[first] % ctx.size:
        reason = _indivisible(pieces[first], ctx.size, f"heads (a dim of {math.prod(in_sizes)} viewed as "
                                                       f"{tuple(out_sizes)})")
        return replicate_all(node, ctx, conflict=reason)
    out = owner(out_sizes, first)
    together = [i for i in range(len(pieces)) if owner(out_sizes, i) == out]
    outer = math.prod(pieces[i] for i in together if i < first)
    if outer == 1:
        return Decision(Shard(outs[out]))
    return Decision(Shard(outs[out], (math.prod(pieces[i] for i in together if i >= first),) * outer))


def _split_dim(node: fx.Node, ctx: Context, p: Shard, sizes: list[int], outs: list[int]) -> Decision:
    lead = 0
    if p.blocks is not None:
        if len(set(p.blocks)) != 1 or not sizes or sizes[0] != len(p.blocks):
            return replicate_all(node, ctx)
        lead = 1  # the outermost output dim indexes the blocks; the shard moves to the next one
    target = next((i for i in range(lead, len(sizes)) if sizes[i] != 1), None)
    if target is None:
        return replicate_all(node, ctx)
    if sizes[target] % ctx.size:
        what = f"heads (a dim of {math.prod(sizes)} viewed as {tuple(sizes)})"
        reason = _indivisible(sizes[target], ctx.size, what)
        if p.blocks is None and target == 0 and len(sizes) > 2:
            # (parts, heads, head dim): a fused q/k/v viewed whole; as a blocked shard each rank takes its heads
            # of every part, so let the planner retry with blocks before calling the heads indivisible
            return replicate_all(node, ctx, hint=(math.prod(sizes[1:]),) * sizes[0])
        if p.blocks is None and target == 0 and len(sizes) == 2:
            # (parts, width) as torch's packed in_proj views q/k/v, or (heads, head dim) of too few heads: the
            # planner tries the blocked layout and, when it does not help, takes the conflict
            return replicate_all(node, ctx, conflict=reason, hint=(sizes[1],) * sizes[0])
        return replicate_all(node, ctx, conflict=reason)
    return Decision(Shard(outs[target]))


def _indivisible(count: int, size: int, what: str) -> str:
    """A conflict message; it starts with the count that does not divide (the planner ranks by it)."""
    works = [d for d in range(1, count + 1) if count % d == 0]
    return f"{count} {what} do not divide over {size} ranks; degrees that divide {count}: {works}"


def _dim_group(in_shape, out_shape, dim: int) -> tuple[list[int], list[int]] | None:
    """The input dims and output dims of a reshape that hold the same elements as input ``dim``."""
    i = j = 0
    while i < len(in_shape) or j < len(out_shape):
        ins, outs = [], []
        pi = pj = 1
        while True:
            if pi == pj and ins and outs:
                break
            if (pi <= pj or j >= len(out_shape)) and i < len(in_shape):
                pi *= in_shape[i]
                ins.append(i)
                i += 1
            elif j < len(out_shape):
                pj *= out_shape[j]
                outs.append(j)
                j += 1
            else:
                break
        ins = [d for d in ins if in_shape[d] != 1] or ins
        outs = [d for d in outs if out_shape[d] != 1] or outs
        if dim in ins:
            return ins, outs
        if not ins and not outs:
            return None
    return None


@rule(aten.slice.Tensor, aten.select.int, aten.narrow.default)
def _slice(node: fx.Node, ctx: Context) -> Decision:
    p = _one_input_shard(node, ctx)
    if p is None:
        return _pointwise(node, ctx)
    shape = ctx.shape(node.args[0])
    dim = _dim(arg(node, "dim"), len(shape))
    if dim == p.dim:
        if _whole_slice(node, shape[dim]):  # x[:, :] keeps every element, and so the shard
            return Decision(p)
        if _strided_whole(node, shape[dim], p, ctx.size):  # gpt-oss's interleaved gate/up: x[..., ::2], x[..., 1::2]
            return Decision(Shard(dim))
        bounds = slice_bounds(node, shape[dim])
        if bounds is None:
            return replicate_all(node, ctx)
        if p.blocks is None:  # a fused projection cut apart by slices (phi3's qkv[..., :q]): blocked at every cut
            cuts = {0, shape[dim]}
            for user in node.args[0].users:
                if user.target is aten.slice.Tensor and _dim(arg(user, "dim"), len(shape)) == dim:
                    cuts.update(slice_bounds(user, shape[dim]) or ())
            edges = sorted(cuts)
            return replicate_all(node, ctx, hint=tuple(b - a for a, b in zip(edges, edges[1:], strict=False)))
        edges = list(itertools.accumulate(p.blocks, initial=0))
        if bounds[0] not in edges or bounds[1] not in edges:
            return replicate_all(node, ctx)
        return Decision(_blocks_of(p, edges.index(bounds[0]), edges.index(bounds[1])))
    removed = node.target is aten.select.int and dim < p.dim
    return Decision(p.at(p.dim - removed))


def _strided_whole(node: fx.Node, size: int, p: Shard, ranks: int) -> bool:
    """``x[start::step]`` over the whole split dim, ``start < step``, each rank's part a whole number of steps:
    the same slice of every part is that part's share of the result."""
    if node.target is not aten.slice.Tensor or p.blocks is not None:
        return False
    start, end, step = arg(node, "start") or 0, arg(node, "end"), arg(node, "step")
    return (isinstance(step, int) and step > 1 and isinstance(start, int) and 0 <= start < step
            and (end is None or end >= size) and size % ranks == 0 and (size // ranks) % step == 0)


def slice_bounds(node: fx.Node, size: int) -> tuple[int, int] | None:
    """``[start, end)`` of a step-1 ``slice`` over a dim of ``size``, clamped as Python clamps; None otherwise."""
    if node.target is not aten.slice.Tensor or arg(node, "step") != 1:
        return None
    start, end = arg(node, "start"), arg(node, "end")
    if not all(isinstance(v, int) or v is None for v in (start, end)):
        return None
    start = 0 if start is None else start + size if start < 0 else start
    end = size if end is None else end + size if end < 0 else end
    start, end = min(max(start, 0), size), min(max(end, 0), size)
    return (start, end) if start < end else None


def _whole_slice(node: fx.Node, size: int) -> bool:
    if node.target is not aten.slice.Tensor:
        return False
    return slice_bounds(node, size) == (0, size)  # x[:, :], x[:, -n:] of a dim of n


@rule(aten.split.Tensor, aten.split_with_sizes.default, aten.tensor_split.indices, aten.tensor_split.sections,
      aten.chunk.default, aten.unbind.int)
def _split(node: fx.Node, ctx: Context) -> Decision:
    p = _one_input_shard(node, ctx)
    pieces = meta.val(node)
    if p is None:
        if isinstance(ctx.of(node.args[0]), Partial):
            return replicate_all(node, ctx)
        return Decision(_replicated_like(node))
    in_shape = ctx.shape(node.args[0])
    dim = _dim(arg(node, "dim"), len(in_shape))
    if dim != p.dim:
        shift = node.target is aten.unbind.int and dim < p.dim
        return Decision(tuple(p.at(p.dim - shift) for _ in pieces))
    sizes = tuple(int(piece.shape[dim]) for piece in pieces)
    if node.target is aten.unbind.int:
        return replicate_all(node, ctx)
    if p.blocks is not None and _aligned(sizes, p.blocks):  # every piece whole blocks: each rank's part of each
        if any(b % ctx.size for i, b in enumerate(p.blocks) if i not in p.whole):
            reason = _indivisible(math.gcd(*p.blocks), ctx.size, f"(the common width of a fused projection {sizes})")
            return replicate_all(node, ctx, conflict=reason)
        edges = list(itertools.accumulate(p.blocks, initial=0))
        return Decision(tuple(_blocks_of(p, edges.index(a), edges.index(b))
                              for a, b in itertools.pairwise(itertools.accumulate(sizes, initial=0))))
    return replicate_all(node, ctx, hint=sizes if p.blocks is None and len(sizes) > 1 else None)


def _blocks_of(p: Shard, first: int, stop: int) -> Placement:
    """The placement of blocks ``[first, stop)`` of ``p`` cut out of it: each rank's part of each (those held
    whole, whole: replicated when all of them are)."""
    blocks = p.blocks[first:stop]
    whole = tuple(i - first for i in p.whole if first <= i < stop)
    if len(whole) == len(blocks):
        return R
    if len(blocks) == 1:
        return Shard(p.dim)
    return Shard(p.dim, blocks, whole)


def _aligned(sizes: tuple[int, ...], blocks: tuple[int, ...]) -> bool:
    """Whether every piece of ``sizes`` starts and ends at an edge of ``blocks`` (both cover one dim)."""
    edges = set(itertools.accumulate(blocks, initial=0))
    return sum(sizes) == sum(blocks) and set(itertools.accumulate(sizes, initial=0)) <= edges


@rule(aten.view_as_complex.default, aten.view_as_real.default)
def _complex_view(node: fx.Node, ctx: Context) -> Decision:
    """Rotary embeddings as complex numbers (Llama 4): the trailing pair of reals becomes one complex number and
    back. A split elsewhere stays; the pair dim itself cannot be split."""
    p = _one_input_shard(node, ctx)
    if p is None:
        return _pointwise(node, ctx)
    if node.target is aten.view_as_complex.default and p.dim == len(ctx.shape(node.args[0])) - 1:
        return replicate_all(node, ctx)
    return Decision(p)


@rule(aten.cumsum.default, aten.cumprod.default)
def _scan(node: fx.Node, ctx: Context) -> Decision:
    """A running sum along one dim: a split on another dim stays."""
    p = _one_input_shard(node, ctx)
    if p is None:
        return _pointwise(node, ctx)
    return replicate_all(node, ctx) if _dim(arg(node, "dim"), len(ctx.shape(node))) == p.dim else Decision(p)


@rule(aten.tril.default, aten.triu.default)
def _triangle(node: fx.Node, ctx: Context) -> Decision:
    """A triangle of the last two dims: a split on a leading dim stays."""
    p = _one_input_shard(node, ctx)
    if p is None:
        return _pointwise(node, ctx)
    return replicate_all(node, ctx) if p.dim >= len(ctx.shape(node)) - 2 else Decision(p)


@rule(aten.pad.default, aten.constant_pad_nd.default)
def _pad(node: fx.Node, ctx: Context) -> Decision:
    """Padding the trailing dims (``pad`` lists them from the last): a split on a dim it leaves alone stays."""
    p = _one_input_shard(node, ctx)
    if p is None:
        return _pointwise(node, ctx)
    widths = list(node.args[1])
    ndim = len(ctx.shape(node.args[0]))
    padded = {ndim - 1 - i // 2 for i, w in enumerate(widths) if w != 0}
    return replicate_all(node, ctx) if p.dim in padded else Decision(p)


@rule(aten.cat.default)
def _cat(node: fx.Node, ctx: Context) -> Decision:
    ndim = len(ctx.shape(node))
    # cat skips a 1-D empty tensor whatever the other dims (a key/value cache's empty start, XLM's): it takes no part
    tensors = [t for t in node.args[0] if not (len(ctx.shape(t)) == 1 and ctx.shape(t)[0] == 0 and ndim != 1)]
    dim = _dim(arg(node, "dim"), ndim)
    shards = {ctx.of(t) for t in tensors if isinstance(ctx.of(t), Shard)}
    if (ctx.axis.pending_sums and tensors and all(isinstance(ctx.of(t), Partial) for t in tensors)
            and sum_reaches_zeros(node)):
        return Decision(Partial())  # pending sums joined (each expert's row-parallel product): one sum, reduced once
    if not shards:
        return _pointwise(node, ctx)
    if (ctx.axis.blocked_splits and len(tensors) > 1  # a split in contiguous chunks (cp) is never blocks
            and all(isinstance(ctx.of(t), Shard) and ctx.of(t).dim == dim for t in tensors)):
        # the parts of q, k and v joined along their split features (a linear attention's mixed qkv): each rank
        # holds its part of each, a blocked shard
        blocks = tuple(b for t in tensors for b in (ctx.of(t).blocks or (ctx.shape(t)[dim],)))
        if all(b % ctx.size == 0 for b in blocks):
            return Decision(Shard(dim, blocks))
    (p,) = shards if len(shards) == 1 else (None,)
    if p is not None and p.dim == dim:
        joined = [t for t in tensors if ctx.shape(t)[dim] != 0]
        if joined == [t for t in tensors if ctx.of(t) == p] and len(joined) == 1:
            return Decision(p)  # an empty cache joined to the split sequence along it: the split, unchanged
    if p is None or p.dim == dim:
        return replicate_all(node, ctx)
    return Decision(p, {t: p for t in tensors if ctx.of(t) != p})


@rule(aten.stack.default)
def _stack(node: fx.Node, ctx: Context) -> Decision:
    """Stacking values sharded alike (RoPE's ``stack((-x2, x1), -1)`` on a rank's heads): the shard keeps its dim,
    moved one out when the new dim is inserted before it."""
    tensors = node.args[0]
    dim = _dim(arg(node, "dim", 0), len(ctx.shape(node)))
    shards = {ctx.of(t) for t in tensors if isinstance(ctx.of(t), Shard)}
    if not shards:
        return _pointwise(node, ctx)
    if len(shards) > 1:
        return replicate_all(node, ctx)
    (p,) = shards
    want = {t: p for t in tensors if ctx.of(t) != p}
    return Decision(p.at(p.dim + (p.dim >= dim)), want)


@rule(aten.repeat_interleave.self_int)
def _repeat_interleave(node: fx.Node, ctx: Context) -> Decision:
    p = _one_input_shard(node, ctx)
    if p is None or p.blocks is not None:
        return _pointwise(node, ctx) if p is None else replicate_all(node, ctx)
    if arg(node, "dim") is None and len(ctx.shape(node.args[0])) > 1:  # repeats the flattened tensor
        return replicate_all(node, ctx)
    return Decision(p)  # repeating each of this rank's heads gives exactly its share of the repeated heads


@rule(aten.repeat.default)
def _repeat(node: fx.Node, ctx: Context) -> Decision:
    """``x.repeat(...)``: a split dim repeated n times (a key's heads tiled for the queries of each routed slot,
    JetMoE's attention experts) holds, on each rank, its part of every copy: a blocked split of n blocks."""
    p = _one_input_shard(node, ctx)
    if p is None:
        return _pointwise(node, ctx)
    repeats = list(node.args[1])
    dim = p.dim + len(repeats) - len(ctx.shape(node.args[0]))  # repeat prepends the dims it adds
    width = ctx.shape(node.args[0])[p.dim]
    if repeats[dim] == 1:
        return Decision(p.at(dim))
    if not ctx.axis.blocked_splits:  # a split in contiguous chunks (cp) is never blocks
        return replicate_all(node, ctx)
    blocks = (p.blocks or (width,)) * repeats[dim]
    if any(b % ctx.size for b in blocks):
        return replicate_all(node, ctx)
    return Decision(Shard(dim, blocks))


@rule(aten._assert_tensor_metadata.default, aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default,
      aten.new_full.default)
def _reads_no_values(node: fx.Node, ctx: Context) -> Decision:  # noqa: ARG001 - every rule's signature
    """Ops that read only their input's dtype and device, so any placement passes them: export's check after
    ``x.to(dtype)`` (removed before code is generated; without this rule every such check on a sharded value,
    QK-norm inside attention, asked for a gather and the whole attention stayed replicated), and ``x.new_zeros(size)``
    and its kind, a fresh tensor of the size given, whole on every rank (without it a state-space scan's unused
    initial state, ``A.new_zeros(batch, *A.shape)``, asked for the decay per channel whole)."""
    return Decision(R)


# The rules for reductions, norms, matmuls, attention, embeddings and losses register themselves.
from autoshard.passes import rules_nn  # noqa: E402, F401
