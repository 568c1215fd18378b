"""Whole-batch statistics under data parallelism: a loss term computed from the whole batch at once, exact.

A router's load-balancing loss multiplies two statistics of the batch's tokens (how many each expert got, and its
mean probability); a cross-entropy inside a larger loss divides its sum by the batch's count of tokens whose target
is not ignored. Under dp each rank holds ``1/dp`` of the batch, so its own statistics differ from the whole batch's,
and no sum of per-rank losses gives the model's. This pass makes each rank's program take them over the whole batch.

Terms: the batch dim's split is propagated through the training graph (``Axis("dp")`` with pending sums, as
``job_plan.check_batch_split`` does). The *statistics* are the nodes none of whose readers, to the loss, carries the
batch split (``Shard``): the loss's own arithmetic on small tensors, apart from the model's forward (a router's
per-token counts that place its rows stay this rank's, as its rows do). In the statistics:

- a sum over the split dim is pending over the ranks (``Partial``); so is a histogram of split values (``histc``,
  ``bincount``) and a ``scatter_add``/``index_add`` of split values into zeros: each rank's part a summand;
- a mean over the split dim becomes this rank's sum divided by the whole batch's count (``dp`` times its own);
- a cross-entropy averaged over its counted tokens becomes its sum divided by the count of counted tokens;
- a number the capture took from the batch's size (``total_rows += weights.shape[0]``: transformers' mixtures) is
  the whole batch's: found by capturing the model again at twice the batch and comparing the two graphs' numbers
  (one that doubles is a size of the batch, ``dp`` times larger over the whole batch; one that changes otherwise
  is refused);
- where a pending sum is read by anything but another sum, it is all-reduced over dp first (``DataAllReduce``), so
  every rank reads the whole batch's value; a loss still pending at the output is all-reduced there.

Any other op of the statistics reading split values (a ``sort``, a ``max`` over the batch) cannot be summed: refused.

The loss is then the whole batch's on every rank. The runtime divides it by ``dp`` and sums the gradients over dp;
``DataAllReduce``'s backward is an all-reduce too, so the gradient reaching each rank's own part of a statistic is
the sum over the ranks of what each rank's loss sends back through it: exactly the unsharded model's.

Microbatches, pipeline stages and cp are not covered (a statistic over the whole batch cannot be taken before every
part of it has run): ``job_plan`` refuses there, or runs each part alone under ``batch_statistics="local"``.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from autoshard import meta
from autoshard.errors import AutoshardError
from autoshard.functions import KEPT_OP, kept_of
from autoshard.passes.axis import Axis, Outputs
from autoshard.passes.axis_pass import AxisPass, Sharding, present
from autoshard.passes.batch_gather import insert_dp_collective
from autoshard.passes.batch_split import _FULL  # full reductions -> by dims
from autoshard.passes.collectives import Wire, _all_reduce, _ParallelOp
from autoshard.passes.loss import _TOKEN_LOSSES, is_token_mean
from autoshard.passes.placements import Partial, R, Shard
from autoshard.passes.propagate import Propagation, propagate, redistributions

aten = torch.ops.aten

_SUM = 2  # cross_entropy's reduction code for a sum
# reductions of split values that are sums (a histogram counts; a scatter into zeros adds): their parts are summands
_SUMMING = {aten.histc.default, aten.bincount.default, aten.scatter_add.default, aten.scatter_add_.default,
            aten.index_add.default, aten.index_add_.default}
_ZEROS = {aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default}


class BatchStatisticsError(AutoshardError, ValueError):
    """A whole-batch statistic that this pass cannot make exact; the message says where and what works."""


class _SumOverRanks(torch.autograd.Function):
    """The sum over ``group``; its backward sums the gradient over the group too (each rank's loss reads the sum)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.contiguous(), ctx.group), None


class DataAllReduce(_ParallelOp):
    """A pending sum over the dp ranks made whole: all-reduce forward and backward (see the module docstring)."""

    kind, backward_kind = "all_reduce", "all_reduce"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SumOverRanks.apply(x, self._run_group())

    def extra_repr(self) -> str:
        return f"size={self.size}"

    def comm_bytes(self, input_shape, elem_size: int) -> tuple[int, int]:
        moved = int(torch.Size(input_shape).numel()) * elem_size * 2 * (self.size - 1) // self.size
        return moved, moved

    def wires(self, x, *others):
        return (Wire("all_reduce", x.numel(), x.dtype),), (Wire("all_reduce", x.numel(), x.dtype),)


class _Summand(nn.Module):
    """Marks a sum of split values (a histogram): pending over the dp ranks. Removed once the sums are placed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


@dataclass
class BatchStatisticsPlan:
    """What a dp rank's training program takes over the whole batch: named for ``explain()``."""

    size: int
    sums: list[str] = field(default_factory=list)  # values all-reduced over dp (each pending sum read whole)
    gathered: list[str] = field(default_factory=list)  # split values gathered for a term that couples the rows
    sizes: dict[str, float] = field(default_factory=dict)  # node -> the whole batch's size it now reads
    where: str = ""  # the model's line of the first statistic

    def __str__(self) -> str:
        sizes = f", {len(self.sizes)} size(s) of the batch taken whole" if self.sizes else ""
        return (f"whole-batch statistics over dp={self.size}: {len(self.sums)} sum(s) all-reduced before they are "
                f"read{sizes}, first at {self.where}")


def _propagate(gm: fx.GraphModule, batch: int) -> Propagation:
    seeds = {n.target: Shard(0) for n in gm.graph.nodes
             if n.op == "placeholder" and isinstance(meta.val(n), torch.Tensor) and meta.val(n).dim() > 0
             and meta.val(n).shape[0] == batch}
    return propagate(gm, seeds, Axis("dp", 2, pending_sums=True, samples=True), outputs=Outputs.PARTIAL)


def _where(node: fx.Node) -> str:
    where = meta.source_line(node) or node.name
    return f"{node.name} in the loss_fn" if "autoshard" in where and "capture.py" in where else where


def batch_sizes(small: fx.GraphModule, large: fx.GraphModule, factor: int) -> dict[str, list]:
    """Numbers in ``small``'s nodes that are sizes of its batch, by comparison with ``large`` (the same capture at
    ``factor`` times the batch): node name -> [(argument position, value)] for each number that grows ``factor``
    times, and ``None`` as the value of one that changes otherwise. Raises where the graphs differ in structure."""
    a, b = list(small.graph.nodes), list(large.graph.nodes)
    if len(a) != len(b) or any(x.op != y.op or x.target != y.target for x, y in zip(a, b, strict=True)):
        raise BatchStatisticsError("the model's graph at twice the batch differs from its graph at this batch (an "
                                   "op chosen by the batch's size): its sizes of the batch cannot be told apart")
    found: dict[str, list] = {}
    for x, y in zip(a, b, strict=True):
        pairs = [*enumerate(zip(x.args, y.args, strict=False)),
                 *((k, (v, y.kwargs.get(k))) for k, v in x.kwargs.items())]
        if x.target is KEPT_OP:  # its key names the call; the call's own numbers are held beside the graph
            pairs = [] if kept_of(x).leaves == kept_of(y).leaves else [(None, (0, 1))]
        for position, (u, v) in pairs:
            if isinstance(u, (int, float)) and not isinstance(u, bool) and isinstance(v, (int, float)) and u != v:
                found.setdefault(x.name, []).append((position, u if v == u * factor else None))
        if x.op == "get_attr" and not isinstance(_attr(small, x.target), nn.Parameter):
            u, v = _attr(small, x.target), _attr(large, y.target)
            if isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor) and (u.shape != v.shape or
                                                                                not torch.equal(u, v)):
                found.setdefault(x.name, []).append((None, None))  # a tensor the capture made of the batch's size
    return found


def _attr(gm: fx.GraphModule, target: str):
    try:
        return operator.attrgetter(target)(gm)
    except AttributeError:
        return None


def batch_statistics_pass(gm: fx.GraphModule, *, batch: int, size: int, rank: int, group=None,
                          sizes: dict[str, list] | None = None) -> BatchStatisticsPlan:
    """Rewrite the training graph ``gm`` of one dp rank (its local batch of ``batch`` samples, one of ``size``
    ranks) to take its whole-batch statistics over the dp ranks; what it did. ``sizes``: ``batch_sizes`` of this
    graph. Raises ``BatchStatisticsError`` where it cannot, before any collective."""
    plan = BatchStatisticsPlan(size)
    plan.gathered = _gather_coupled(gm, batch, size, rank, group)
    prop = _propagate(gm, batch)
    for node in [n for n in gm.graph.nodes if is_token_mean(n) and isinstance(prop.of(n.args[0]), Shard)]:
        _count_tokens(gm, node)
    prop = _propagate(gm, batch)
    region = _statistics(gm, prop)
    for r in redistributions(prop):  # split values the statistics read: each rank's part a summand, or refused
        if r.consumer in region and isinstance(r.src, Shard) and r.dst == R:
            _summand(gm, r.consumer)
    prop = _propagate(gm, batch)
    region = _statistics(gm, prop)
    for node in [n for n in region if n.target is aten.mean.dim and isinstance(prop.of(n), Partial)]:
        _whole_mean(gm, node, size)
    prop = _propagate(gm, batch)
    region = _statistics(gm, prop)
    whole = [r for r in redistributions(prop) if isinstance(r.src, Partial) and r.dst == R]
    for r in redistributions(prop):
        gathered = isinstance(r.src, Shard) and r.dst == R and not _marked(gm, r.consumer) \
            and _reaches_unsplit(r.consumer, prop, region)
        if gathered or (r in whole and r.consumer not in region):
            raise BatchStatisticsError(f"{r.consumer.name} at {_where(r.consumer)} reads values of the whole batch "
                                       "in a term that is not a sum over them; keep the batch whole (dp=1) or pass "
                                       "batch_statistics='local'")
    output = next(n for n in gm.graph.nodes if n.op == "output")
    returned = [v for v in output.all_input_nodes if isinstance(prop.of(v), Partial)]
    for index, value in enumerate(dict.fromkeys([r.value for r in whole] + returned)):
        readers = [r.consumer for r in whole if r.value is value] + ([output] if value in returned else [])
        insert_dp_collective(gm, value, f"dp_dataallreduce_{index}", DataAllReduce(group=group, size=size, rank=rank),
                             readers)
        plan.sums.append(value.name)
    _take_whole_sizes(gm, region, sizes or {}, size, plan)
    for node in [n for n in gm.graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target),
                                                                                 _Summand)]:
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
        gm.delete_submodule(node.target)
    first = next((n for n in gm.graph.nodes if n.name in plan.sums), None)
    plan.where = _where(first) if first is not None else ""
    gm.graph.lint()
    gm.recompile()
    return plan


def _apply(gm: fx.GraphModule, sharding: Sharding, found: dict) -> None:
    on = sharding.axes["batch statistics"]
    batch_statistics_pass(gm, batch=on.plan.batch, size=on.plan.size, rank=on.rank, group=on.group,
                          sizes=on.plan.sizes)


# first: it finds the loss's whole-batch statistics on the graph as the job plan did
BATCH_STATISTICS = AxisPass("batch statistics", after=(), applies=present("batch statistics"), apply=_apply)


def whole_batch_region(gm: fx.GraphModule, batch: int, parts: int) -> tuple[Propagation, set[fx.Node]]:
    """For two passes (``passes.batch_two_passes``): the loss terms of ``gm`` (a part's graph, ``batch`` rows, one of
    ``parts`` parts) that need the whole batch, made readable from what each part holds. A token mean inside a larger
    loss becomes its sum over the tokens divided by their count, and a mean over the split rows their sum divided by
    the whole batch's count, so each is read from sums every part contributes to. Returns the propagation after those
    rewrites and the region: the statistics and the coupled terms, from the values they read (the sums, the split
    rows read whole) to the loss."""
    from autoshard.passes import batch_split

    prop = _propagate(gm, batch)
    for node in [n for n in gm.graph.nodes if is_token_mean(n) and isinstance(prop.of(n.args[0]), Shard)]:
        _count_tokens(gm, node)
    prop = _propagate(gm, batch)
    for node in [n for n in _statistics(gm, prop) if n.target is aten.mean.dim and isinstance(prop.of(n), Partial)]:
        _whole_mean(gm, node, parts)
    gm.graph.lint()
    gm.recompile()
    prop = _propagate(gm, batch)
    starts = {n for n in gm.graph.nodes if isinstance(prop.of(n), Partial)  # a sum each part contributes to
              and any(isinstance(prop.of(v), Shard) for v in n.all_input_nodes)}
    return prop, (_statistics(gm, prop) - starts) | batch_split.coupled_region(gm, prop)


def _gather_coupled(gm: fx.GraphModule, batch: int, size: int, rank: int, group) -> list[str]:
    """A loss term that couples the batch's rows (``passes.batch_split``): the split values it reads gathered over
    dp (``passes.batch_gather``), so it runs on the whole batch; the names gathered."""
    from autoshard.passes import batch_split
    from autoshard.passes.batch_gather import CoupledTermError, batch_gather_pass

    if not batch_split.coupled_region(gm, _propagate(gm, batch)):
        return []
    batch_split.reductions_by_dims(gm)  # the same values, by dims: what the analysis read
    prop = _propagate(gm, batch)
    try:
        return batch_gather_pass(gm, prop, batch_split.coupled_region(gm, prop), size=size, rank=rank, group=group)
    except CoupledTermError as e:
        raise BatchStatisticsError(str(e)) from e


def _statistics(gm: fx.GraphModule, prop: Propagation) -> set[fx.Node]:
    """The nodes none of whose readers, to the output, holds the batch split: the loss's statistics and arithmetic."""
    region: set[fx.Node] = set()
    live: set[fx.Node] = set()  # what the output is computed from (a value nothing reads, topk's unused values, is not)
    for node in reversed(list(gm.graph.nodes)):
        if node.op == "output" or any(user in live for user in node.users):
            live.add(node)
        computed = node.op in ("call_function", "call_module") and node in live
        if node.op == "output" or (computed and not isinstance(prop.of(node), Shard)
                                   and all(user in region for user in node.users if user in live)):
            region.add(node)
    return region


def _reaches_unsplit(node: fx.Node, prop: Propagation, region: set[fx.Node]) -> bool:
    """Whether ``node`` (which the propagation takes to read a split value whole: the program reads this rank's part)
    reaches the statistics with no split value on the way: then a statistic would be this rank's, not the batch's.
    (The model's forward reads parts as wholes too, a router's counts placing its own rows; the split comes back
    before the loss.)"""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen or (n is not node and isinstance(prop.of(n), Shard)):
            continue
        if n in region:
            return True
        seen.add(n)
        todo += list(n.users)
    return False


def _marked(gm: fx.GraphModule, node: fx.Node) -> bool:
    return any(user.op == "call_module" and isinstance(gm.get_submodule(user.target), _Summand)
               for user in node.users)


def _summand(gm: fx.GraphModule, node: fx.Node) -> None:
    """Mark ``node``, a statistic reading split values, as each rank's summand; refuse one that is no sum."""
    if node.target in _FULL:  # mean() / sum() of everything: by dims, which the rules take as pending sums
        dims = list(range(len(meta.val(node.args[0]).shape)))
        node.target, node.args = _FULL[node.target], (node.args[0], dims, *node.args[1:])
        return
    into_zeros = node.target not in (aten.histc.default, aten.bincount.default)
    if node.target not in _SUMMING or (into_zeros and not (isinstance(node.args[0], fx.Node)
                                                             and node.args[0].target in _ZEROS and node.args[1] == 0)):
        raise BatchStatisticsError(f"{node.name} ({node.target}) at {_where(node)} reads values of the whole batch in "
                                   "a loss term, and it is no sum over them; keep the batch whole (dp=1) or pass "
                                   "batch_statistics='local'")
    if _marked(gm, node):
        return
    name = f"dp_summand_{node.name}"
    gm.add_submodule(name, _Summand())
    with gm.graph.inserting_after(node):
        marked = gm.graph.call_module(name, (node,))
    marked.meta.update(node.meta)
    node.replace_all_uses_with(marked, delete_user_cb=lambda user: user is not marked)


def _count_tokens(gm: fx.GraphModule, node: fx.Node) -> None:
    """``cross_entropy(x, t, reduction=mean)`` -> ``cross_entropy(x, t, reduction=sum) / (t != ignore).sum()``:
    two sums over the split rows, each pending until the division reads them."""
    reduction_at, ignore_at, weight_at = _TOKEN_LOSSES[node.target]
    args = list(node.args) + [None] * max(0, reduction_at + 1 - len(node.args))
    kwargs = dict(node.kwargs)
    weight = node.args[weight_at] if weight_at < len(node.args) else kwargs.get("weight")
    ignore = node.args[ignore_at] if ignore_at < len(node.args) else kwargs.get("ignore_index", -100)
    target = node.args[1]
    if weight is not None or not isinstance(meta.val(target), torch.Tensor) \
            or meta.val(target).dtype.is_floating_point:
        raise BatchStatisticsError(
            f"{node.name} at {_where(node)} averages a cross-entropy with class weights or class probabilities inside "
            "a larger loss: its divisor is no count of tokens; return the cross-entropy alone, keep the batch whole "
            "(dp=1), or pass batch_statistics='local'")
    for i in range(len(node.args), reduction_at):
        args[i] = {2: None, 3: 1, 4: -100}.get(i)
    args[reduction_at] = _SUM
    kwargs.pop("reduction", None)
    node.args, node.kwargs = tuple(args), kwargs
    first_reader = next(iter(node.users))
    with gm.graph.inserting_before(first_reader):
        counted = gm.graph.call_function(aten.ne.Scalar, (target, -100 if ignore is None else ignore))
        count = gm.graph.call_function(aten.sum.dim_IntList, (counted, list(range(meta.val(target).dim()))))
        ratio = gm.graph.call_function(aten.div.Tensor, (node, count))
    counted.meta["val"] = torch.zeros(meta.val(target).shape, dtype=torch.bool)
    count.meta["val"] = torch.zeros((), dtype=torch.int64)
    ratio.meta.update(node.meta)
    node.replace_all_uses_with(ratio, delete_user_cb=lambda user: user is not ratio)


def _whole_mean(gm: fx.GraphModule, node: fx.Node, size: int) -> None:
    """A mean over the split dim -> this rank's sum divided by the whole batch's count (``size`` times its own)."""
    source = meta.val(node.args[0]).shape
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    dims = [dims] if isinstance(dims, int) else list(dims or range(len(source)))
    count = math.prod(source[d % len(source)] for d in dims) * size
    with gm.graph.inserting_before(node):
        total = gm.graph.call_function(aten.sum.dim_IntList, node.args, node.kwargs)
    total.meta.update(node.meta)
    node.target, node.args, node.kwargs = aten.div.Tensor, (total, count), {}


def _take_whole_sizes(gm: fx.GraphModule, region: set[fx.Node], sizes: dict[str, list], size: int,
                      plan: BatchStatisticsPlan) -> None:
    """The numbers of the statistics that are sizes of this rank's batch -> the whole batch's (``size`` times)."""
    for node in gm.graph.nodes:
        read = node.op == "get_attr" and any(user in region for user in node.users)  # a constant the loss reads
        if not (node in region or read) or node.name not in sizes or node.target is operator.getitem:
            continue
        node.args, node.kwargs = whole_arguments(node, sizes, size)
        for position, _ in sizes[node.name]:
            plan.sizes[node.name] = (node.kwargs if isinstance(position, str) else node.args)[position]


def whole_arguments(node: fx.Node, sizes: dict[str, list], size: int) -> tuple[tuple, dict]:
    """``node``'s arguments with each number that is a size of a part's batch (``batch_sizes``) made the whole
    batch's, ``size`` times it; raises ``BatchStatisticsError`` where the whole batch's value is unknown."""
    if node.name not in sizes or node.target is operator.getitem:
        return node.args, node.kwargs
    args, kwargs = list(node.args), dict(node.kwargs)
    for position, value in sizes[node.name]:
        if value is None and kept_of(node) is not None:
            raise BatchStatisticsError(
                f"the custom autograd Function {kept_of(node).name} at {kept_of(node).where} is passed a number "
                "that changes with the batch's size: run on the whole batch, it would still be given this rank's; "
                "pass it no size of the batch (read it from its tensors' shapes) or keep the batch whole (dp=1)")
        if value is None:
            raise BatchStatisticsError(f"{node.name} at {_where(node)} reads a value that changes with the "
                                       "batch's size, not in proportion to it or held as a tensor: its whole "
                                       "batch's value is unknown; keep the batch whole (dp=1) or pass "
                                       "batch_statistics='local'")
        held = kwargs if isinstance(position, str) else args
        held[position] = type(held[position])(value * size)
    return tuple(args), kwargs


def refusal(gm: fx.GraphModule, batch: int, size: int, sizes: dict[str, list] | None) -> str | None:
    """Why ``batch_statistics_pass`` would refuse ``gm`` (on a copy), or None: for the job plan, before any rank
    builds its program."""
    import copy

    trial = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    try:
        batch_statistics_pass(trial, batch=batch, size=size, rank=0, sizes=sizes)
    except BatchStatisticsError as e:
        return str(e)
    return None


def _summand_rule(node: fx.Node, ctx) -> object:
    """The dp axis: each rank's histogram of its split values is a summand. Any other axis: element-wise."""
    from autoshard.passes.rules import Decision, _pointwise

    return Decision(Partial()) if ctx.axis.name == "dp" else _pointwise(node, ctx)


def _register() -> None:
    """On every axis a sum over the dp ranks acts element-wise: placements pass through it."""
    from autoshard.passes.rules import _pointwise, op

    op(DataAllReduce, rule=_pointwise)
    op(_Summand, rule=_summand_rule)


_register()
