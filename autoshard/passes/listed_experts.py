"""Experts held as separate modules of a list (litgpt's ``LLaMAMoE``), found from the graph alone.

Such a mixture runs a Python loop over its experts: each expert's rows are picked out of the tokens by indices that
come from the router's top-k choices (``token_idx, _ = torch.where(indices == e)``, then ``x[token_idx]``), its
module computes on them, and its output is added back at those rows. Unrolled in the capture, each expert is a
*branch*: the rows it picks (``index(x, [token_idx])``), then products by its own 2-D parameters (``linear``,
``matmul``, ``mm``) and row-local ops (pointwise, casts) between them, ending in one value the rest of the graph
reads; its parameters are read inside its branch only. A *list layer* is the branches that pick rows of one value by
indices of one top-k and compute alike (the same ops in the same order, each with its own parameters).

Expert ``e`` of ``E`` is held by ep rank ``e // (E / ep)`` alone. Each rank sends each expert's rows to its
holder and gets their outputs back, around the branch, with the routing collectives of the stacked experts::

    route = ExpertRoute(offsets)        # offsets: all of this rank's rows to the holder (one entry per ep rank)
    rows' = ExpertDispatch(rows, route)  # every rank's rows of this expert, on its holder (none elsewhere)
    out'  = branch(rows')                # on the holder; elsewhere zero rows, through the dispatched ones
    out   = ExpertCombine(out', route)   # this rank's rows' outputs, in their order

so per expert and layer: one all-gather of ep integers and one read back of the splits, and two all-to-alls each
way (the rows out, their outputs back; in backward their gradients). The holder's gradients are summed over the
ranks that hold the same experts (``ep_replicas``), as a stack's are. Under tp or pp the experts stay whole.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from autoshard import meta

aten = torch.ops.aten

_PICKS = {aten.index.Tensor}
_PRODUCTS = {aten.linear.default, aten.matmul.default, aten.mm.default}
_ROW_LOCAL = {aten.to.dtype, aten._to_copy.default, aten.clone.default, aten.contiguous.default, aten.alias.default}
_TOPK = {aten.topk.default}


@dataclass(frozen=True)
class ListLayer:
    """The experts of one list layer, in graph order: each one's parameters (names in the graph)."""

    experts: tuple[tuple[str, ...], ...]
    where: str = ""


@dataclass
class _Branch:
    pick: fx.Node  # the rows it picks
    body: list[fx.Node]  # in graph order
    out: fx.Node  # the one value the rest of the graph reads
    signature: tuple
    params: tuple[str, ...]


def find_list_layers(gm: fx.GraphModule) -> list[ListLayer]:
    """Every list layer of ``gm`` with at least two experts."""
    return [ListLayer(tuple(b.params for b in branches), _where(branches[0].pick)) for branches in _layers(gm)]


def _layers(gm: fx.GraphModule) -> list[list[_Branch]]:
    groups: dict[tuple, list[_Branch]] = {}
    for node in gm.graph.nodes:
        branch = _branch(node)
        if branch is None:
            continue
        topk = _topk(node.args[1][0])
        if topk is not None:
            groups.setdefault((node.args[0], topk), []).append(branch)
    return [branches for branches in groups.values()
            if len(branches) > 1 and len({b.signature for b in branches}) == 1]


def _branch(pick: fx.Node) -> _Branch | None:
    """The expert's branch that ``pick`` (rows picked by one index tensor) starts, or None."""
    if pick.op != "call_function" or pick.target not in _PICKS or len(pick.args[1]) != 1 or pick.args[1][0] is None:
        return None
    body: list[fx.Node] = []
    params: dict[fx.Node, int] = {}
    inside, waiting = {pick}, set(pick.users)  # only a reader of a value inside can join: none left, none joins
    for node in _after(pick):
        if not waiting:
            break
        waiting.discard(node)
        if node.op != "call_function" or not (node.target in _PRODUCTS or node.target in _ROW_LOCAL
                                              or torch.Tag.pointwise in getattr(node.target, "tags", ())):
            continue
        entries = node.all_input_nodes
        if not any(e in inside for e in entries):
            continue
        if any(e not in inside and not _parameter(e) for e in entries):
            continue  # reads a value of the rest of the graph (the router's weights): the branch has ended
        for e in entries:
            if _parameter(e) and (node.target not in _PRODUCTS or e is node.args[0]):
                return None  # a parameter read other than as a product's matrix
            if _parameter(e):
                params.setdefault(e, len(params))
        body.append(node)
        inside.add(node)
        waiting |= set(node.users)
    leaving = [n for n in inside if any(u not in inside for u in n.users) or not n.users]
    if not params or len(leaving) != 1 or leaving[0] is pick:
        return None
    if any(u not in inside for p in params for u in p.users):
        return None  # a parameter read outside its branch
    names = {pick: "rows", **{p: ("param", i) for p, i in params.items()}, **{n: i for i, n in enumerate(body)}}
    signature = tuple((n.target, tuple(_named(a, names) for a in n.args),
                       tuple(sorted((k, _named(v, names)) for k, v in n.kwargs.items()))) for n in body)
    return _Branch(pick, body, leaving[0], signature, tuple(p.target for p in params))


def _after(pick: fx.Node):
    node = pick.next
    while node.op != "output":
        yield node
        node = node.next


def _named(value, names: dict):
    return fx.node.map_aggregate(value, lambda a: ("node", names[a]) if isinstance(a, fx.Node) else a)


def _parameter(node: fx.Node) -> bool:
    return node.op == "get_attr" and isinstance(meta.val(node), torch.Tensor) and meta.val(node).dim() == 2


def _topk(index: fx.Node) -> fx.Node | None:
    """The top-k whose choices ``index`` (the rows an expert picks) is computed from, or None."""
    seen, todo = set(), [index]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.target in _TOPK:
            return node
        todo += node.all_input_nodes
    return None


def _where(node: fx.Node) -> str:
    return meta.module_path(node) or meta.source_line(node) or node.name


# ---------------------------------------------------------------------------------------------------------------
# The rewrite


def split_list_layers(gm: fx.GraphModule, layers: list[ListLayer], *, rank: int, group, size: int) -> None:
    """Rewrite the planned list layers of ``gm`` into what ep rank ``rank`` runs: its own experts' branches between
    a dispatch and a combine, every other expert's rows sent to its holder and their outputs received back."""
    from autoshard.passes.expert_parallel import ExpertCombine, ExpertDispatch, ExpertParallelError, ExpertRoute

    planned = {layer.experts: layer for layer in layers}
    found = {tuple(b.params for b in branches): branches for branches in _layers(gm)}
    for experts, layer in planned.items():
        branches = found.get(experts)
        if branches is None:
            raise ExpertParallelError(f"the experts at {layer.where} no longer match their plan on this rank's graph "
                                      "(a pipeline cut between the routing and the experts?): use ep=1")
        per = len(branches) // size
        for e, branch in enumerate(branches):
            index = len([n for n, _ in gm.named_children() if n.startswith("expert_route")])
            modules = []
            for name, cls in (("expert_route", ExpertRoute), ("expert_dispatch", ExpertDispatch),
                              ("expert_combine", ExpertCombine)):
                extra = {"experts": size} if cls is ExpertRoute else {}
                gm.add_submodule(f"{name}_{index}", cls(group=group, size=size, rank=rank, **extra))
                modules.append(f"{name}_{index}")
            _around(gm, branch, e // per == rank, e // per, size, modules)
    gm.graph.eliminate_dead_code()
    for experts in planned:
        per = len(experts) // size
        for name in (name for e, params in enumerate(experts) if e // per != rank for name in params):
            owner, _, attr = name.rpartition(".")
            delattr(gm.get_submodule(owner) if owner else gm, attr)


def _around(gm: fx.GraphModule, branch: _Branch, mine: bool, holder: int, size: int, modules: list[str]) -> None:
    graph = gm.graph
    route_mod, dispatch_mod, combine_mod = modules
    pick, out = branch.pick, branch.out
    with graph.inserting_after(pick):
        offsets = graph.call_function(to_holder, (pick, holder, size))
    with graph.inserting_after(offsets):
        routed = graph.call_module(route_mod, (offsets,))
    with graph.inserting_after(routed):
        route = graph.call_function(operator.getitem, (routed, 1))
    with graph.inserting_after(route):
        moved = graph.call_module(dispatch_mod, (pick, route))
    for user in list(pick.users):
        if user in branch.body:
            user.replace_input_with(pick, moved)
    readers = [u for u in out.users if u not in branch.body]
    if mine:
        with graph.inserting_after(out):
            last = graph.call_function(needing_grad, (out,))
    else:
        with graph.inserting_after(moved):
            last = graph.call_function(no_rows, (moved, meta.val(out).shape[-1]))
    last.meta[meta.VAL] = meta.val(out)
    with graph.inserting_after(last):
        combined = graph.call_module(combine_mod, (last, route))
    for new in (offsets, routed, moved, combined):
        new.meta[meta.AXIS] = "ep"
    moved.meta[meta.VAL], combined.meta[meta.VAL] = meta.val(pick), meta.val(out)
    for user in readers:
        user.replace_input_with(out, combined)
    if not mine:
        for node in reversed(branch.body):
            graph.erase_node(node)


def to_holder(rows: torch.Tensor, holder: int, size: int) -> torch.Tensor:
    """Cumulative rows per ep rank with all of ``rows`` for ep rank ``holder``: the offsets of a route that sends
    them there."""
    n = rows.shape[0]
    return torch.tensor([0] * holder + [n] * (size - holder), dtype=torch.int64, device=rows.device)


def no_rows(moved: torch.Tensor, width: int) -> torch.Tensor:
    """The output an expert held elsewhere gives the rows it receives here (none): ``(0, width)``, computed from them
    so that the combine's backward reaches the dispatch's, and needing a gradient wherever gradients are recorded
    (as the holder's output does: ``needing_grad``)."""
    return moved @ moved.new_zeros(moved.shape[-1], width).requires_grad_(torch.is_grad_enabled())


def needing_grad(out: torch.Tensor) -> torch.Tensor:
    """The holder's output of an expert, made to need a gradient wherever gradients are recorded, even where neither
    its rows nor its parameters need one (frozen): every rank of the ep group then runs the combine's backward, a
    collective, and a rank that runs it alone would pair it with another collective (wrong gradients, silently)."""
    if out.requires_grad or not torch.is_grad_enabled():
        return out
    return out + out.new_zeros(()).requires_grad_()
