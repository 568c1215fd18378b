"""Experts held as separate modules of a list (litgpt's ``LLaMAMoE``), found from the graph alone.

Such a mixture runs a Python loop over its experts: each expert's rows are picked out of the tokens by indices that
come from the router's top-k choices (``token_idx, _ = torch.where(indices == e)``, then ``x[token_idx]``), its
module computes on them, and its output is added back at those rows. Unrolled in the capture, each expert is a
*branch*: the rows it picks (``index(x, [token_idx])``), then products by its own 2-D parameters (``linear``,
``matmul``, ``mm``) and row-local ops (pointwise, casts) between them, ending in one value the rest of the graph
reads; its parameters are read inside its branch only. A *list layer* is the branches that pick rows of one value by
indices of one top-k and compute alike (the same ops in the same order, each with its own parameters).

Expert parallelism does not split such a layer yet: its experts stay whole on every ep rank (data parallel, exact)
and the plan says so, naming the layer.
"""

from __future__ import annotations

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


def find_list_layers(gm: fx.GraphModule) -> list[ListLayer]:
    """Every list layer of ``gm`` with at least two experts."""
    groups: dict[tuple, list[tuple[tuple, tuple[str, ...], fx.Node]]] = {}
    for node in gm.graph.nodes:
        found = _branch(node)
        if found is None:
            continue
        topk = _topk(node.args[1][0])
        if topk is None:
            continue
        signature, params = found
        groups.setdefault((node.args[0], topk), []).append((signature, params, node))
    layers = []
    for branches in groups.values():
        if len(branches) > 1 and len({signature for signature, _, _ in branches}) == 1:
            layers.append(ListLayer(tuple(params for _, params, _ in branches), _where(branches[0][2])))
    return layers


def _branch(pick: fx.Node) -> tuple[tuple, tuple[str, ...]] | None:
    """(what the branch computes, its parameters) where ``pick`` picks rows by one index tensor and starts an expert's
    branch; else None."""
    if pick.op != "call_function" or pick.target not in _PICKS or len(pick.args[1]) != 1 or pick.args[1][0] is None:
        return None
    body: list[fx.Node] = []
    params: dict[fx.Node, int] = {}
    inside = {pick}
    for node in _after(pick):
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
    leaving = [n for n in inside if any(u not in inside for u in n.users) or not n.users]
    if not params or len(leaving) != 1 or leaving[0] is pick:
        return None
    if any(u not in inside for p in params for u in p.users):
        return None  # a parameter read outside its branch
    names = {pick: "rows", **{p: ("param", i) for p, i in params.items()}, **{n: i for i, n in enumerate(body)}}
    signature = tuple((n.target, tuple(_named(a, names) for a in n.args),
                       tuple(sorted((k, _named(v, names)) for k, v in n.kwargs.items()))) for n in body)
    return signature, tuple(p.target for p in params)


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
