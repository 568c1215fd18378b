"""Expert parallelism: each ep rank holds whole experts, and the tokens travel to the rank of their expert.

Terms: an *expert layer* is a mixture of experts as the graph shows it, found from structure alone: grouped
matmuls (``is_grouped_mm``) of rows sorted by expert, over stacks of expert matrices (3-D parameters, experts on
dim 0), that share one vector of cumulative row counts per expert (the *offsets*). The rows live in the *sorted
space*: N rows (tokens x top-k), grouped by expert, downstream of the routing's ``sort``. The layer's *segment* is
every node on a path from one of its grouped matmuls to another (the activation between the two projections)
plus the matmuls; every node in it must be row-local (row i of its output reads row i of its inputs only).

The rewrite, on each ep rank (its experts ``[rank * E/ep, (rank + 1) * E/ep)``):

    route = ExpertRoute(offsets)          # counts exchanged (one all-to-all of E integers), splits, permutation
    x'    = ExpertDispatch(x, route)      # rows sent to their expert's rank, grouped by local expert
    ...   grouped matmuls over the local experts with the route's local offsets ...
    y     = ExpertCombine(y', route)      # rows sent back, in the sorted order the rest of the graph expects

Dispatch and combine are one linear map and its transpose (all-to-all with per-rank counts, then a permutation),
so each is the other's backward. Dropless: every token reaches its expert, whatever the imbalance; sizes that
depend on the routing are read once per layer and step (the splits an all-to-all needs), never recaptured.
The expert matrices are sliced on dim 0; their gradients come whole from every rank's tokens through the
all-to-alls, so they are summed only over the ranks that hold the same experts (``ep_replicas``), not over dp.

A layer whose segment holds an op that is not row-local (attention between two projections that share a routing,
as JetMoE's attention experts have) runs each matmul between a dispatch and a combine of its own, from the one
route. A layer whose matmuls' inputs are not the routed rows, or whose stacks are read elsewhere, keeps its experts
whole on every ep rank (data parallel, as without ep), and the plan says why.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import fx

from autoshard import meta, peers
from autoshard.errors import AutoshardError
from autoshard.passes.axis_pass import AxisPass, PlanCodec, Sharding, present
from autoshard.passes.collectives import Wire, _ParallelOp
from autoshard.passes.listed_experts import ListLayer, find_list_layers, split_list_layers
from autoshard.passes.rules_nn import is_grouped_mm

aten = torch.ops.aten

_SORTS = {aten.sort.default, aten.sort.stable, aten.argsort.default, aten.argsort.stable}
_WEIGHT_READS = {aten.transpose.int, aten.detach.default, aten.to.dtype, aten.alias.default, aten._to_copy.default}
_CASTS = {aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout, aten.type_as.default, aten.clone.default,
          aten.contiguous.default, aten.alias.default}
_ALONG = {aten.chunk.default: 2, aten.split.Tensor: 2, aten.split_with_sizes.default: 2, aten.slice.Tensor: 1,
          aten.narrow.default: 1}  # op -> position of its dim argument (default 0 where absent)


class ExpertParallelError(AutoshardError, ValueError):
    """The experts cannot be split over ep as asked; the message names the layer and the degrees that work."""


@dataclass(frozen=True)
class ExpertLayer:
    """One mixture of experts: its offsets node, its number of experts, and its stacks of expert matrices."""

    offsets: str  # node name of the cumulative row counts per expert
    experts: int
    weights: tuple[str, ...]  # parameters (experts on dim 0) its grouped matmuls read
    where: str = ""  # the model's source line


@dataclass
class ExpertParallelPlan:
    size: int
    layers: list[ExpertLayer] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # layers left whole, and why
    capacity: float | None = None  # rows each rank sends each expert, as a factor of an even share (None: all)
    lists: list[ListLayer] = field(default_factory=list)  # experts held as modules of a list, split over ep

    def params(self) -> dict[str, int]:
        """Every expert-split parameter -> its number of experts (the dim-0 size, split in ep equal blocks)."""
        return {w: layer.experts for layer in self.layers for w in layer.weights}

    def holders(self) -> dict[str, int]:
        """Every parameter of an expert held as a module of a list -> the ep rank that holds it alone."""
        return {w: e // (len(layer.experts) // self.size) for layer in self.lists
                for e, params in enumerate(layer.experts) for w in params}

    def __str__(self) -> str:
        lines = [f"expert-parallel plan over {self.size} ranks:"]
        for layer in self.layers:
            lines.append(f"  {layer.experts} experts, {layer.experts // self.size} per rank: "
                         f"{', '.join(layer.weights)}  ({layer.where})")
        for layer in self.lists:
            lines.append(f"  {len(layer.experts)} experts held as modules of a list, {len(layer.experts) // self.size} "
                         f"per rank  ({layer.where})")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Finding the layers


def plan_expert_parallel(gm: fx.GraphModule, size: int, *, lists: bool = True) -> ExpertParallelPlan:
    """The expert layers of ``gm`` split over ``size`` ep ranks; raises when a layer's experts do not divide.
    ``lists``: whether experts held as modules of a list are split too (not under tp or pp)."""
    plan = ExpertParallelPlan(size)
    for offsets, matmuls in _by_offsets(gm).items():
        layer, why = _layer(gm, offsets, matmuls)
        if layer is None:
            plan.notes.append(f"experts at {_where(matmuls[0])} stay whole on every ep rank: {why}")
            continue
        if layer.experts % size:
            fits = [d for d in range(1, layer.experts + 1) if layer.experts % d == 0]
            raise ExpertParallelError(
                f"ep={size} does not divide the {layer.experts} experts at {layer.where}: each ep rank holds whole "
                f"experts, so ep must divide their number; use ep in {fits}")
        plan.layers.append(layer)
    listed = find_list_layers(gm)
    for layer in listed if size > 1 else []:
        if lists and len(layer.experts) % size == 0:
            plan.lists.append(layer)
            continue
        why = (f"ep={size} does not divide them" if len(layer.experts) % size else
               "they are split only without tp and pp")
        plan.notes.append(f"{len(layer.experts)} experts at {layer.where} are held as separate modules of a list "
                          f"(each its own parameters, its rows picked by the router's top-k): they stay whole on every "
                          f"ep rank ({why})")
    if not plan.layers and not listed:
        plan.notes.append("no mixture of experts found (grouped matmuls over stacks of expert matrices): ep splits "
                          "nothing, and its ranks are data parallel")
    return plan


def _by_offsets(gm: fx.GraphModule) -> dict[fx.Node, list[fx.Node]]:
    out: dict[fx.Node, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if is_grouped_mm(node) and isinstance(node.args[2], fx.Node):
            out.setdefault(node.args[2], []).append(node)
    return out


def _stack(w) -> fx.Node | None:
    """The 3-D parameter (experts on dim 0) behind a grouped matmul's weight argument (read through a transpose of
    its last two dims, a cast or a detach), or None."""
    while isinstance(w, fx.Node) and w.target in _WEIGHT_READS:
        if w.target is aten.transpose.int and 0 in {d % 3 for d in w.args[1:3]}:
            return None
        w = w.args[0]
    return w if isinstance(w, fx.Node) and w.op == "get_attr" and _shape(w) is not None and len(_shape(w)) == 3 \
        else None


def _layer(gm: fx.GraphModule, offsets: fx.Node, matmuls: list[fx.Node]) -> tuple[ExpertLayer | None, str]:
    experts = _shape(offsets)[0]
    stacks = [_stack(m.args[1]) for m in matmuls]
    if any(s is None for s in stacks):
        return None, "a grouped matmul's weight is not a stack of expert matrices held as one parameter"
    if any(_shape(s)[0] != experts for s in stacks):
        return None, "a stack's experts differ in number from the offsets' entries"
    # The routing's sort: of the ids the offsets count (transformers), or of the rows' order (torchtitan sorts the
    # rows by expert and counts the ids apart, with histc)
    sorts = _sorts(offsets, matmuls)
    if not sorts:
        return None, "neither the offsets nor the rows come from a sort of the routed expert ids"
    groups, why = _groups(offsets, matmuls, sorts)
    if not groups:
        return None, why
    names = tuple(dict.fromkeys(s.target for s in stacks))
    readers = {u for s in stacks for u in _weight_users(s)}
    if any(r not in matmuls for r in readers):
        return None, "a stack of expert matrices is read outside the grouped matmuls (it must stay whole)"
    return ExpertLayer(offsets.name, experts, names, _where(matmuls[0])), ""


def _sorts(offsets: fx.Node, matmuls: list[fx.Node]) -> set[fx.Node]:
    routed = _ancestors(offsets).union(*(_ancestors(m.args[0]) for m in matmuls))
    return {a for a in routed if a.target in _SORTS}


def _groups(offsets: fx.Node, matmuls: list[fx.Node], sorts: set[fx.Node]) -> tuple[list[list[fx.Node]], str]:
    """The matmuls in groups that each run between one dispatch and one combine (all together where the path
    between them keeps rows apart, as an MLP's activation does; else each alone, as with attention between two
    experts' projections that share a routing), and why not where neither works."""
    rows = _shape(matmuls[0].args[0])[0]
    why = _row_local(_segment(matmuls), matmuls, offsets, rows, sorts)
    if not why:
        return [matmuls], ""
    if len(matmuls) > 1 and not any(_row_local(_segment([m]), [m], offsets, rows, sorts) for m in matmuls):
        return [[m] for m in matmuls], ""
    return [], why


def _weight_users(param: fx.Node) -> set[fx.Node]:
    """The nodes that read ``param`` itself (through its casts and transposes)."""
    out, todo = set(), list(param.users)
    while todo:
        node = todo.pop()
        if node.target in _WEIGHT_READS:
            todo += list(node.users)
        else:
            out.add(node)
    return out


def _segment(matmuls: list[fx.Node]) -> list[fx.Node]:
    """The matmuls and every node on a path from one of them to another, in graph order."""
    after = set()
    todo = list(matmuls)
    while todo:
        for user in todo.pop().users:
            if user not in after:
                after.add(user)
                todo.append(user)
    before = set()
    for m in matmuls:
        before |= _ancestors(m)
    inside = (after & before) | set(matmuls)
    return [n for n in matmuls[0].graph.nodes if n in inside]


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen, todo = set(), list(node.all_input_nodes)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += n.all_input_nodes
    return seen


def _row_local(segment: list[fx.Node], matmuls: list[fx.Node], offsets: fx.Node, rows: int,
               sorts: set[fx.Node]) -> str:
    """Why some node of the segment mixes rows (or reads rows from outside the sorted space), or ''."""
    inside = set(segment)
    for node in segment:
        if node in matmuls:
            entries = [node.args[0]]
        elif node.target is operator.getitem:
            continue
        elif node.target in _ALONG:
            position = _ALONG[node.target]
            dim = node.args[position] if len(node.args) > position else node.kwargs.get("dim", 0)
            if dim % len(_shape(node.args[0])) == 0:
                return f"{node.name} ({node.target}) splits the rows at {_where(node)}"
            entries = [node.args[0]]
        elif node.target in _CASTS or _pointwise(node):
            entries = [a for a in node.all_input_nodes]
        else:
            return f"{node.name} ({node.target}) at {_where(node)} is not known to keep rows apart"
        out = _rows_shape(node)
        if out is None or not out or out[0] != rows:
            return f"{node.name} at {_where(node)} does not keep the {rows} routed rows on dim 0"
        for value in entries:
            if value is offsets:
                return f"{node.name} at {_where(node)} reads the offsets as data"
            if value in inside:
                continue
            shape = _shape(value)
            if shape is None:
                return f"{value.name} feeds the experts and is not a tensor"
            aligned = _aligned(shape, out, rows)
            if aligned and not (_ancestors(value) & sorts):
                return f"{value.name} feeds the experts with {rows} rows that are not the routed ones"
            if not aligned and len(shape) == len(out) and shape[0] != 1:
                return f"{value.name} feeds the experts with a shape {tuple(shape)} that is not per row"
    return ""


def _rows_shape(node: fx.Node) -> tuple[int, ...] | None:
    """The shape whose dim 0 holds the routed rows at ``node``: its output's, or its input's for a split."""
    return _shape(node.args[0]) if node.target in _ALONG else _shape(node)


def _aligned(shape: tuple[int, ...], out: tuple[int, ...] | None, rows: int) -> bool:
    """Whether a value of ``shape`` read where the rows are ``out`` holds one row per routed row (not broadcast)."""
    return bool(out) and len(shape) == len(out) and bool(shape) and shape[0] == rows


def _pointwise(node: fx.Node) -> bool:
    return node.op == "call_function" and torch.Tag.pointwise in getattr(node.target, "tags", ())


def _shape(node) -> tuple[int, ...] | None:
    val = meta.val(node) if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _where(node: fx.Node) -> str:
    return meta.module_path(node) or meta.source_line(node) or node.name


# ---------------------------------------------------------------------------------------------------------------
# The collectives


@dataclass
class Route:
    """One step's routing of one layer on this rank: what it sends to and receives from each ep rank, and the
    permutation from received order (by source rank, then expert) to grouped order (by local expert)."""

    send: list[int]
    recv: list[int]
    order: torch.Tensor  # grouped row i is received row order[i]
    counts: torch.Tensor  # (ep, experts per rank): rows received from each rank for each local expert
    keep: torch.Tensor | None = None  # under a capacity: the rows (of this rank's, in the sorted order) it sends
    rows: int = 0  # under a capacity: this rank's rows in the sorted order


def _all_to_all(x: torch.Tensor, out_rows: int, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((out_rows, *x.shape[1:]))
    peers.run(dist.all_to_all_single, out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def _dispatch(x: torch.Tensor, route: Route, group) -> torch.Tensor:
    if route.keep is not None:  # the rows within each expert's capacity; the others are dropped
        x = x.index_select(0, route.keep)
    received = _all_to_all(x, sum(route.recv), route.recv, route.send, group)
    return received.index_select(0, route.order)


def _combine(y: torch.Tensor, route: Route, group) -> torch.Tensor:
    received = torch.empty_like(y).index_copy_(0, route.order, y)
    back = _all_to_all(received, sum(route.send), route.send, route.recv, group)
    if route.keep is None:
        return back
    return back.new_zeros((route.rows, *back.shape[1:])).index_copy_(0, route.keep, back)  # a dropped row: zeros


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, route, group):
        ctx.route, ctx.group = route, group
        return _dispatch(x, route, group)

    @staticmethod
    def backward(ctx, grad):
        return _combine(grad.contiguous(), ctx.route, ctx.group), None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, route, group):
        ctx.route, ctx.group = route, group
        return _combine(y, route, group)

    @staticmethod
    def backward(ctx, grad):
        return _dispatch(grad.contiguous(), ctx.route, ctx.group), None, None


class ExpertRoute(_ParallelOp):
    """From this rank's offsets (cumulative rows per expert, all experts): the layer's route and the offsets of the
    rows this rank's experts receive. One all-gather of the counts (every rank learns the layer's whole load); the
    only read back of a step's layer is the per-rank splits, which the all-to-alls of the rows need on the host."""

    kind, backward_kind = "all_gather", "identity"
    calls = (1, 0)

    def __init__(self, *, experts: int, group, size: int, rank: int, capacity: float | None = None) -> None:
        super().__init__(group=group, size=size, rank=rank)
        self.experts, self.capacity = experts, capacity
        self.last: torch.Tensor | None = None  # the last step's rows per local expert (load, for explain())
        self.dropped: torch.Tensor | None = None  # under a capacity: (rows dropped, rows) at the last step

    def extra_repr(self) -> str:
        return f"experts={self.experts}, size={self.size}" + (f", capacity={self.capacity}" if self.capacity else "")

    def forward(self, offsets: torch.Tensor) -> tuple[torch.Tensor, Route]:
        group = self._run_group()
        per = self.experts // self.size
        counts = torch.diff(offsets.long(), prepend=offsets.new_zeros(1).long())  # this rank's rows per expert
        first_rows, rows = None, 0
        if self.capacity is not None:  # each expert's first rows up to its capacity, in the sorted order
            limit = torch.ceil(offsets[-1].double() * self.capacity / self.experts).long()
            kept = torch.minimum(counts, limit)
            first_rows = torch.cumsum(counts, 0) - counts
            self.dropped = torch.stack([counts.sum() - kept.sum(), counts.sum()]).detach()
            rows = int(self.dropped[1])  # a second read back, under a capacity only
            counts = kept
        every = counts.new_empty(self.size * self.experts)
        peers.run(dist.all_gather_into_tensor, every, counts, group=group)
        every = every.view(self.size, self.experts)  # (source rank, expert): every rank's rows per expert
        recv = every[:, self.rank * per:(self.rank + 1) * per]  # (source rank, local expert)
        send = counts.view(self.size, per)
        splits = torch.stack([send.sum(1), recv.sum(1)]).tolist()  # the one read back
        flat = recv.reshape(-1)
        starts = (torch.cumsum(flat, 0) - flat).view(self.size, per).t().reshape(-1)  # by local expert, then rank
        lengths = recv.t().reshape(-1)
        order = _runs(starts, lengths, int(sum(splits[1])))
        local = torch.cumsum(recv.sum(0), 0).to(offsets.dtype)
        self.last = every.sum(0).detach()  # the layer's rows per expert over the ep group (load, for explain())
        if first_rows is None:
            return local, Route(splits[0], splits[1], order, recv)
        return local, Route(splits[0], splits[1], order, recv, _runs(first_rows, counts, int(sum(splits[0]))), rows)

    def comm_bytes(self, input_shape, elem_size: int) -> tuple[int, int]:
        return self.experts * 8 * self.size, 0

    def wires(self, offsets, *others):
        return (Wire("all_gather", self.experts, torch.int64),), ()


def _runs(starts: torch.Tensor, lengths: torch.Tensor, total: int) -> torch.Tensor:
    """The indices ``starts[i] .. starts[i] + lengths[i] - 1`` of every run ``i``, one run after another."""
    first = torch.repeat_interleave(starts - (torch.cumsum(lengths, 0) - lengths), lengths, output_size=total)
    return first + torch.arange(total, device=starts.device)


class _Rows(_ParallelOp):
    """Rows moved over the ep group by an all-to-all with a route's splits (forward and backward alike)."""

    kind, backward_kind = "all_to_all", "all_to_all"
    function: ClassVar[type[torch.autograd.Function]]

    def forward(self, x: torch.Tensor, route: Route) -> torch.Tensor:
        return self.function.apply(x, route, self._run_group())

    def extra_repr(self) -> str:
        return f"size={self.size}"

    def comm_bytes(self, input_shape, elem_size: int) -> tuple[int, int]:
        moved = _numel(input_shape) * elem_size * (self.size - 1) // self.size  # a uniform routing's share
        return moved, moved

    def wires(self, x, *others):
        routed = Wire("all_to_all", x.numel(), x.dtype, routed=True)
        return (routed,), (routed,)


class ExpertDispatch(_Rows):
    """Rows to their expert's rank (all-to-all with the route's splits), grouped by local expert; backward: combine."""

    function = _Dispatch


class ExpertCombine(_Rows):
    """Rows back to the rank of their token, in the sorted order; backward: dispatch."""

    function = _Combine


def _numel(shape) -> int:
    return int(torch.Size(shape).numel())


EXPERT_OPS: tuple[type, ...] = (ExpertRoute, ExpertDispatch, ExpertCombine)


# ---------------------------------------------------------------------------------------------------------------
# The rewrite


def expert_parallel_pass(gm: fx.GraphModule, plan: ExpertParallelPlan, *, rank: int, group=None) -> fx.GraphModule:
    """Rewrite ``gm`` into what ep rank ``rank`` runs: its experts' slices of the stacks, routes, dispatches and
    combines around each planned layer. ``gm`` is a rank's graph after tp, cp and sp (its local shapes)."""
    if plan.size == 1 or not (plan.layers or plan.lists):
        return gm
    if plan.lists:
        split_list_layers(gm, plan.lists, rank=rank, group=group, size=plan.size)
    wanted = {layer.offsets: layer for layer in plan.layers}  # a pipeline stage holds some of them
    rewritten: set[fx.Node] = set()
    for offsets, matmuls in _by_offsets(gm).items():
        layer = wanted.get(offsets.name)
        if layer is None:
            continue
        again, why = _layer(gm, offsets, matmuls)
        if again is None or again.weights != layer.weights:
            raise ExpertParallelError(f"the experts at {layer.where} no longer match their plan on this rank's "
                                      f"graph ({why or 'other stacks'}): run with ep=1")
        groups, _ = _groups(offsets, matmuls, _sorts(offsets, matmuls))
        _rewrite(gm, offsets, groups, layer, rank, group, plan.size, plan.capacity)
        rewritten.update(matmuls)
    split = plan.params()
    for node in gm.graph.nodes:  # a stack sliced under a matmul that routes nothing would read other experts
        if is_grouped_mm(node) and node not in rewritten and (stack := _stack(node.args[1])) is not None \
                and stack.target in split:
            raise ExpertParallelError(
                f"the experts at {_where(node)} are split over ep, but this graph reads them without their routing "
                "(a pipeline cut between the routing and the experts?): cut elsewhere (cut_after=) or use ep=1")
    _slice_stacks(gm, plan, rank)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm


def _apply(gm: fx.GraphModule, sharding: Sharding, found: dict) -> None:
    on = sharding.axes["ep"]
    expert_parallel_pass(gm, on.plan, rank=on.rank, group=on.group)


def _from_json(ep: dict) -> ExpertParallelPlan:
    layers = [ExpertLayer(**dict(layer, weights=tuple(layer["weights"]))) for layer in ep["layers"]]
    lists = [ListLayer(tuple(tuple(e) for e in layer["experts"]), layer["where"]) for layer in ep.get("lists", [])]
    return ExpertParallelPlan(ep["size"], layers, list(ep["notes"]), ep.get("capacity"), lists)


# last: it reads the rows each routed layer holds after every other split
EXPERT_PARALLEL = AxisPass(
    "ep", after=("batch statistics", "tp", "sp regions", "cp", "sp", "batch norm"), applies=present("ep"),
    apply=_apply, mesh_axis="ep",
    codec=PlanCodec(encode=dataclasses.asdict, decode=_from_json,
                    describe=lambda plan: f"{len(plan.layers)} expert layers split over {plan.size} ranks"))


def _rewrite(gm, offsets: fx.Node, groups: list[list[fx.Node]], layer: ExpertLayer, rank: int, group, size: int,
             capacity: float | None = None) -> None:
    """One route from the offsets; each group of matmuls between a dispatch and a combine of its own."""
    graph = gm.graph
    index = len([n for n in gm.named_children() if n[0].startswith("expert_route")])

    def add(name: str, module) -> str:
        gm.add_submodule(f"{name}_{index}", module)
        return f"{name}_{index}"

    route_mod = add("expert_route", ExpertRoute(experts=layer.experts, group=group, size=size, rank=rank,
                                                capacity=capacity))
    dispatch_mod = add("expert_dispatch", ExpertDispatch(group=group, size=size, rank=rank))
    combine_mod = add("expert_combine", ExpertCombine(group=group, size=size, rank=rank))
    with graph.inserting_after(offsets):
        routed = graph.call_module(route_mod, (offsets,))
    routed.meta[meta.AXIS] = "ep"
    with graph.inserting_after(routed):
        local_offsets = graph.call_function(operator.getitem, (routed, 0))
    with graph.inserting_after(local_offsets):
        route = graph.call_function(operator.getitem, (routed, 1))
    for matmuls in groups:
        for m in matmuls:
            m.replace_input_with(offsets, local_offsets)
        _between(graph, matmuls, local_offsets, route, dispatch_mod, combine_mod)


def _between(graph: fx.Graph, matmuls: list[fx.Node], local_offsets: fx.Node, route: fx.Node, dispatch_mod: str,
             combine_mod: str) -> None:
    """A dispatch of every routed value entering the matmuls' segment, a combine of every value leaving it."""
    segment = _segment(matmuls)
    inside = set(segment)
    rows = _shape(matmuls[0].args[0])[0]
    dispatched: dict[fx.Node, fx.Node] = {}
    for node in segment:
        for value in node.all_input_nodes:
            if value in inside or value is local_offsets or _stack_read(value, matmuls):
                continue
            if not _aligned(_shape(value) or (), _rows_shape(node), rows):
                continue  # broadcast over the rows (checked by _row_local)
            if value not in dispatched:  # before its first reader in the segment (after the route: every
                with graph.inserting_before(node):  # segment node follows the first matmul, which reads the offsets)
                    dispatched[value] = graph.call_module(dispatch_mod, (value, route))
                dispatched[value].meta[meta.AXIS] = "ep"
                if meta.VAL in value.meta:
                    dispatched[value].meta[meta.VAL] = value.meta[meta.VAL]
            node.replace_input_with(value, dispatched[value])
    for node in segment:
        outside = [u for u in node.users if u not in inside]
        if not outside:
            continue
        with graph.inserting_after(node):
            combined = graph.call_module(combine_mod, (node, route))
        combined.meta.update({k: node.meta[k] for k in (meta.VAL,) if k in node.meta})
        combined.meta[meta.AXIS] = "ep"
        for user in outside:
            user.replace_input_with(node, combined)


def _stack_read(value: fx.Node, matmuls: list[fx.Node]) -> bool:
    return any(m.args[1] is value for m in matmuls)


def _slice_stacks(gm: fx.GraphModule, plan: ExpertParallelPlan, rank: int) -> None:
    present = {name for name, _ in gm.named_parameters()}
    for name in plan.params():
        if name not in present:
            continue
        full = gm.get_parameter(name)
        local = torch.nn.Parameter(expert_part(full.detach(), rank, plan.size).contiguous(), full.requires_grad)
        owner, _, attr = name.rpartition(".")
        setattr(gm.get_submodule(owner) if owner else gm, attr, local)


def expert_part(full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This ep rank's experts of a stack (dim 0)."""
    per = full.shape[0] // size
    return full.narrow(0, rank * per, per)

