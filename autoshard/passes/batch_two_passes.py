"""Coupled loss terms made exact under microbatches and pp: two passes over the batch, as GradCache runs them.

A part of the batch that runs alone (a microbatch, a pipeline's microbatch) cannot see the rows of the parts that
run after it, so a coupled term (``passes.batch_split``'s *region*: a contrastive ``image @ text.T``, in-batch
negatives, preference pairs) cannot be gathered as dp gathers it (``passes.batch_gather``). ``cut`` splits the
training graph at the region's entry, its *boundary* (the values the region reads from outside it: the embeddings,
the per-row log-probabilities, a learnt temperature), into three graphs:

- ``first``: the graph up to the boundary, which it returns. The first pass runs it on every part without
  gradients; the boundary's split values are concatenated (and gathered over dp) into the whole batch's, and its
  sums each part holds a share of (a cross-entropy summed over the part's counted tokens, the count, tokens per
  expert: ``passes.batch_statistics.whole_batch_region`` cuts there) are added up over the parts.
- ``term``: the region alone, its numbers that are sizes of the batch (``arange(B)``, ``logp[:n]``) made the whole
  batch's. It runs once per step on the whole batch's boundary values, on every rank alike: the loss, and its
  gradient with respect to each boundary value.
- ``surrogate``: the graph up to the boundary again, its loss ``sum(value * gradient)`` over the boundary values,
  each part fed its own rows of the gradient as inputs (after the model's, before the target). It adds up over the
  parts under microbatches, pp and dp (``Captured.second_pass``: the batch analysis takes it as such a sum), and by
  the chain rule through the boundary its parameter gradients are the model's. A whole boundary value (a learnt
  temperature, read by every part) has its gradient fed as rows of ``gradient / B``, summed over each part's rows:
  once over the whole batch; a summed one has the whole gradient fed to every part, for its share.

Two passes apply where the forward up to the boundary computes the same values twice: no random op (dropout would
draw other masks). Elsewhere ``cut`` raises ``TwoPassesError``, saying why.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import fx, nn

from autoshard import meta
from autoshard.errors import AutoshardError
from autoshard.passes.batch_statistics import _attr, whole_arguments
from autoshard.passes.placements import Partial, Shard
from autoshard.passes.propagate import Propagation

aten = torch.ops.aten
_RANDOM = {aten.native_dropout.default, aten.bernoulli.default, aten.bernoulli.p, aten.bernoulli_.float,
           aten.rand.default, aten.randn.default, aten.rand_like.default, aten.randn_like.default,
           aten.randint.default, aten.randint_like.default, aten.randperm.default, aten.multinomial.default,
           aten.normal.Tensor_float, aten.uniform_.default, aten.normal_.default, aten.dropout.default}


class TwoPassesError(AutoshardError, ValueError):
    """A coupled term the two passes cannot take; the message says why."""


@dataclass(frozen=True)
class Boundary:
    """A value the coupled region reads from outside it."""

    name: str
    dim: int | None  # the batch's dim where it is split by rows; None where every part holds it whole (or a share)
    trained: bool  # floating and computed from the parameters: its gradient is fed to the second pass
    summed: bool = False  # a sum each part holds its share of (a token count, a loss summed over its tokens)


@dataclass
class TwoPasses:
    """The training graph cut at a coupled region (see the module docstring)."""

    first: fx.GraphModule  # (*inputs, target) -> the boundary values, in ``boundary``'s order
    surrogate: fx.GraphModule  # (*inputs, *gradients of the trained boundary values, target) -> sum(value * gradient)
    term: fx.GraphModule  # the whole batch's boundary values -> the loss
    boundary: list[Boundary]
    gradient_shapes: list[tuple[int, ...]]  # each gradient input's shape at this capture's batch (rows first)
    note: str = ""  # what the job does, for explain()


def cut(gm: fx.GraphModule, prop: Propagation, region: set[fx.Node], sizes: dict[str, list], factor: int,
        where) -> TwoPasses:
    """The two passes' graphs of the training graph ``gm`` (prepared, its batch split propagated as ``prop``; the
    coupled ``region``, by ``passes.batch_split.coupled_region``). ``sizes``: the numbers of the graph that are sizes
    of the batch (``passes.batch_statistics.batch_sizes``); ``factor``: how many parts make the whole batch;
    ``where(node)``: the model's line, for messages."""
    random = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _RANDOM and n not in region]
    if random:
        raise TwoPassesError(f"{random[0].name} at {where(random[0])} draws random numbers (dropout): the two passes "
                             "would forward the batch with other draws the second time")
    region = region | _constants(gm, region)
    boundary = _boundary(gm, prop, region, where)
    surrogate, shapes = _surrogate(gm, boundary, prop)
    return TwoPasses(_first(gm, boundary), surrogate, _term(gm, region, boundary, sizes, factor, where), boundary,
                     shapes)


def _constants(gm: fx.GraphModule, region: set[fx.Node]) -> set[fx.Node]:
    """The values the region reads that are computed from neither the parameters nor the batch (``arange(B)``
    labels, a mask of ones): the term computes them itself, at the whole batch's sizes."""
    depends: dict[fx.Node, bool] = {}
    for node in gm.graph.nodes:
        source = node.op == "placeholder" or (node.op == "get_attr" and isinstance(_attr(gm, node.target),
                                                                                  nn.Parameter))
        depends[node] = source or any(depends[v] for v in node.all_input_nodes)
    found: set[fx.Node] = set()
    todo = [v for n in region for v in n.all_input_nodes if v not in region and not depends[v]]
    while todo:
        node = todo.pop()
        if node not in found and node.op == "call_function":
            found.add(node)
            todo += node.all_input_nodes
    return found


def _boundary(gm: fx.GraphModule, prop: Propagation, region: set[fx.Node], where) -> list[Boundary]:
    found = []
    for value in [n for n in gm.graph.nodes if n not in region and any(u in region for u in n.users)]:
        if value.op == "get_attr" and not isinstance(_attr(gm, value.target), nn.Parameter):
            continue  # a constant: the term reads it itself
        placement, val = prop.of(value), meta.val(value)
        if not isinstance(placement, (Shard, Partial)) and value.op == "call_function" and _reads_batch(value):
            raise TwoPassesError(f"{value.name} at {where(value)} is computed from the whole batch where the coupled "
                                 "term reads it: no part holds it")
        if isinstance(placement, Shard) and placement.blocks is not None:
            raise TwoPassesError(f"{value.name} at {where(value)} is split in blocks where the coupled term reads the "
                                 "whole batch's rows")
        trained = isinstance(val, torch.Tensor) and val.is_floating_point() and value.op != "placeholder"
        found.append(Boundary(value.name, placement.dim if isinstance(placement, Shard) else None, trained,
                              isinstance(placement, Partial)))
    return found


def _reads_batch(node: fx.Node) -> bool:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n.op == "placeholder":
            return True
        if n not in seen:
            seen.add(n)
            todo += n.all_input_nodes
    return False


def _first(gm: fx.GraphModule, boundary: list[Boundary]) -> fx.GraphModule:
    graph = copy.deepcopy(gm.graph)
    nodes = {n.name: n for n in graph.nodes}
    output = next(n for n in graph.nodes if n.op == "output")
    output.args = (tuple(nodes[b.name] for b in boundary),)
    graph.eliminate_dead_code()
    first = fx.GraphModule(gm, graph)
    first.recompile()
    return first


def _surrogate(gm: fx.GraphModule, boundary: list[Boundary], prop: Propagation):
    graph = copy.deepcopy(gm.graph)
    nodes = {n.name: n for n in graph.nodes}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    batch = next(meta.val(n).shape[prop.of(n).dim] for n in placeholders if isinstance(prop.of(n), Shard))
    output = next(n for n in graph.nodes if n.op == "output")
    target = nodes[placeholders[-1].name]

    def made(target, *args):
        with graph.inserting_before(output):
            node = graph.call_function(target, args)
        node.meta["val"] = target(*[meta.val(a) if isinstance(a, fx.Node) else a for a in args])
        return node

    total, sums, shapes = None, None, []
    for index, b in enumerate(x for x in boundary if x.trained):
        value = nodes[b.name]
        val = meta.val(value)
        if b.summed:  # the whole gradient, read by every part (one row: no rows of the batch to split)
            shape = (1, *val.shape)
        else:
            shape = tuple(val.movedim(b.dim, 0).shape) if b.dim is not None else (batch, *val.shape)
        with graph.inserting_before(target):
            grad = graph.placeholder(f"two_passes_grad_{index}")
        grad.meta["val"] = val.new_empty(shape)
        shapes.append(shape)
        if b.summed:
            product = made(aten.sum.default, made(aten.mul.Tensor, value, made(aten.select.int, grad, 0, 0)))
            sums = product if sums is None else made(aten.add.Tensor, sums, product)
            continue
        rows = made(aten.movedim.int, value, b.dim, 0) if b.dim not in (0, None) else value
        product = made(aten.mul.Tensor, rows, grad)  # (rows, ...): a whole value broadcast over the part's rows
        if len(shape) > 1:
            product = made(aten.sum.dim_IntList, product, list(range(1, len(shape))))
        total = product if total is None else made(aten.add.Tensor, total, product)
    if total is not None:
        total = made(aten.sum.default, total)
    if sums is not None:
        total = sums if total is None else made(aten.add.Tensor, total, sums)
    if total is None:
        raise TwoPassesError("the coupled term reads nothing computed from the parameters: nothing to train")
    output.args = ((total,),)
    graph.eliminate_dead_code()
    surrogate = fx.GraphModule(gm, graph)
    surrogate.recompile()
    return surrogate, shapes


def _term(gm: fx.GraphModule, region: set[fx.Node], boundary: list[Boundary], sizes: dict[str, list], factor: int,
          where) -> fx.GraphModule:
    graph = fx.Graph()
    env = {b.name: graph.placeholder(b.name) for b in boundary}
    output = next(n for n in gm.graph.nodes if n.op == "output")
    loss = output.args[0][0] if isinstance(output.args[0], (tuple, list)) else output.args[0]
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.name not in env and any(u in region for u in node.users):
            if node.name in sizes:
                raise TwoPassesError(f"{node.name} at {where(node)} is a tensor the capture made of the batch's size: "
                                     "its whole batch's value is unknown")
            env[node.name] = graph.get_attr(node.target)
        if node not in region or node.op == "output":
            continue
        args, kwargs = whole_arguments(node, sizes, factor)
        env[node.name] = graph.node_copy(node, lambda n: env[n.name]) if (args, kwargs) == (node.args, node.kwargs) \
            else graph.create_node(node.op, node.target, fx.map_arg(args, lambda n: env[n.name]),
                                   fx.map_arg(kwargs, lambda n: env[n.name]), node.name)
    graph.output(env[loss.name])
    term = fx.GraphModule(gm, graph)
    term.recompile()
    return term
