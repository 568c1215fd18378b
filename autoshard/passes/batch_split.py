"""What the batch split cannot prove: the values a loss reads that are not provably the batch's rows.

dp and microbatches run the training graph on parts of the batch, each part alone: no rank gathers another's
rows. ``job_plan.check_batch_split`` propagates the batch split (``Shard(0)`` on every input that carries the
batch) through the graph with the same rule table as tp and cp. Where a consumer would need a split value in
another placement (whole, or split along another dim), the propagation records a redistribution that *no rank
performs*: the consumer reads this part's rows as if they were something else. So the propagation past such a
point describes a program other than the one that runs, and this module says which values it reaches:

- a **coupled** value: a rule read split rows whole (a ``B x B`` similarity of two split embeddings, a
  ``logsumexp`` over the batch, row ``i`` paired with row ``i + n`` by a slice): the term couples the samples.
  Nothing downstream of it is per-sample.
- an **unknown** value: an op with no batch rule read split rows (the fallback, which is no gather either). It
  may keep rows apart or not; the analysis cannot tell, and a loss that reads it is refused.

Inside the model's forward (not in the ``loss_fn``) such a value may flow back into the batch's rows where a rule
takes it in parts (a mixture's dispatch: tokens sorted by expert, run, scattered back, then added to the residual
split by rows): from there it is taken as this part's rows again. That one assumption is what the corpus and the
differential test of the rules (``tests/test_batch_split.py``) check by execution. In the ``loss_fn`` nothing is
taken back: ``(ce * softmax(-ce, dim=0)).sum()`` weighs each row by the whole batch.
- a **statistic**: a histogram or a scatter-add of split values into zeros, a sum each part can contribute to
  (``passes.batch_statistics`` sums those over dp); as unknown values otherwise.

Terms: the *output* is the training graph's first output, the loss. A *finding* is the node where the
propagation first stops modelling what runs, with its kind and the model's source line.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from autoshard import meta
from autoshard.functions import kept_of
from autoshard.passes.loss import is_token_mean
from autoshard.passes.placements import Partial, R, Shard
from autoshard.passes.propagate import Propagation, redistributions
from autoshard.passes.rules import rule_of

aten = torch.ops.aten
COUPLED, UNKNOWN, STATISTIC = "coupled", "unknown", "statistic"


@dataclass(frozen=True)
class Unproven:
    """A node that reads rows of the batch split as if they were the whole batch (see the module docstring)."""

    node: fx.Node
    kind: str  # COUPLED, UNKNOWN or STATISTIC
    where: str  # the model's source line, or the node's name in the loss_fn

    def describe(self) -> str:
        op = getattr(self.node.target, "_opname", None) or getattr(self.node.target, "__name__", str(self.node.target))
        if kept_of(self.node) is not None:  # a call kept whole: proven per-sample on its trace, or it is not
            return (f"the custom autograd Function {kept_of(self.node).name} at {self.where} is not proven to keep the "
                    "samples apart (its forward or backward reads other rows, or it holds a size of the batch)")
        if self.kind == COUPLED:
            return f"{op} at {self.where} reads the rows of the whole batch (it couples the samples)"
        if self.kind == UNKNOWN:
            return (f"{op} at {self.where} has no rule for a split batch, so whether it keeps the samples apart is "
                    "unknown")
        return f"{op} at {self.where} counts over the whole batch"


def _kind(node: fx.Node) -> str:
    from autoshard.passes.batch_statistics import _SUMMING

    if node.target in _SUMMING:
        return STATISTIC
    return COUPLED if rule_of(node) is not None else UNKNOWN


def in_loss_fn(node: fx.Node) -> bool:
    """Whether ``node`` was traced in the ``loss_fn`` (outside the model's forward: no module of the model)."""
    return meta.module_path(node) == ""


def where(node: fx.Node) -> str:
    found = meta.source_line(node) or node.name
    return f"{node.name} in the loss_fn" if "autoshard" in found and "capture.py" in found else found


def unproven(gm: fx.GraphModule, prop: Propagation) -> list[Unproven]:
    """The findings whose values reach the loss without being taken back as rows of the batch, in graph order (where
    each coupling starts: none downstream of another)."""
    found, reaches, loss = _trace(gm, prop)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    first = [found[o] for o in reaches.get(loss, ())
             if not any(reaches.get(v, frozenset()) - {o} for v in o.all_input_nodes)]
    return sorted(first, key=lambda f: order[f.node])


def coupled_region(gm: fx.GraphModule, prop: Propagation) -> set[fx.Node]:
    """The nodes from the findings to the loss whose values depend on a finding: what must run on the whole batch
    for the loss to be the model's (``passes.batch_gather``)."""
    _, reaches, loss = _trace(gm, prop)
    region, todo = set(), [loss] if loss in reaches else []
    while todo:
        node = todo.pop()
        if node in region:
            continue
        region.add(node)
        todo += [v for v in node.all_input_nodes if v in reaches and reaches[v] & reaches[node]]
    return region


def _trace(gm: fx.GraphModule, prop: Propagation):
    """(findings by node, node -> the findings its value depends on, the loss node)."""
    misread: set[tuple[fx.Node, fx.Node]] = set()  # (value, consumer): split rows read as something else
    taken: set[tuple[fx.Node, fx.Node]] = set()  # (value, consumer): a whole value taken in parts, as rows
    for r in redistributions(prop):
        if isinstance(r.src, Shard) and r.dst != r.src and not is_token_mean(r.consumer):
            misread.add((r.value, r.consumer))  # (a token mean is job_plan's own case: its counts are summed)
        elif r.src == R and isinstance(r.dst, Shard):
            taken.add((r.value, r.consumer))
    found: dict[fx.Node, Unproven] = {}
    reaches: dict[fx.Node, frozenset[fx.Node]] = {}
    for node in gm.graph.nodes:
        origins: set[fx.Node] = set()
        for value in node.all_input_nodes:
            if (value, node) in misread:
                found.setdefault(node, Unproven(node, _kind(node), where(node)))
                origins.add(node)
            for origin in reaches.get(value, ()):
                if (value, node) in taken and not in_loss_fn(node) and not in_loss_fn(origin):
                    continue  # back in the batch's rows inside the model (a mixture's dispatch scattered back)
                origins.add(origin)
        if origins:
            reaches[node] = frozenset(origins)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    loss = output.args[0][0] if isinstance(output.args[0], (tuple, list)) else output.args[0]
    return found, reaches, loss if isinstance(loss, fx.Node) else None


MEAN, SUM, WHOLE, MIXED = "mean", "sum", "whole", "mixed"


def loss_reduction(gm: fx.GraphModule, prop: Propagation, divisors: frozenset[str] = frozenset()) -> str:
    """How the loss adds up over the parts of the batch: ``MEAN`` (the average of the parts' losses is the model's:
    a mean over the samples), ``SUM`` (their sum is: ``loss.sum()``, ``reduction='sum'``), ``WHOLE`` (no part of it
    is pending: every part computes the same) or ``MIXED`` (a sum beside a mean: neither). ``divisors``: the nodes
    that divide by a size of the batch (``passes.batch_statistics.batch_sizes``): a sum over the samples divided by
    their count is a mean."""
    _, _, loss = _trace(gm, prop)
    kinds: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:  # in order: every input's kind first
        if not isinstance(prop.of(node), Partial):
            continue
        pending = {kinds[v] for v in node.all_input_nodes if v in kinds}
        if not pending:  # where the sum over the parts starts
            kinds[node] = MEAN if node.target is aten.mean.dim else SUM
        elif len(pending) > 1:
            kinds[node] = MIXED
        elif node.name in divisors:
            kinds[node] = MEAN if pending == {SUM} else MIXED
        else:
            kinds[node] = pending.pop()
    return kinds.get(loss, WHOLE) if loss is not None else WHOLE


_FULL = {aten.mean.default: aten.mean.dim, aten.sum.default: aten.sum.dim_IntList}  # full reductions -> by dims


def reductions_by_dims(gm: fx.GraphModule) -> None:
    """For the analysis, on its own copy of the graph: ``x.mean()`` and ``x.sum()`` -> the same over every dim, which
    the rules know, and ``mse_loss(x, y)`` (and its kind) -> ``mse_loss(x, y, reduction='none')`` then that mean
    or sum: a mean over the samples is a sum each part contributes to (the runtime averages the parts' losses), not
    a value read whole."""
    from autoshard.passes.rules import arg
    from autoshard.passes.rules_nn import ELEMENTWISE_LOSSES

    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in ELEMENTWISE_LOSSES and arg(node, "reduction") in (1, 2):
            reduce = aten.mean.dim if arg(node, "reduction") == 1 else aten.sum.dim_IntList
            at = ELEMENTWISE_LOSSES[node.target]
            args = list(node.args) + [None] * max(0, at + 1 - len(node.args))
            for i in range(len(node.args), at):
                args[i] = _default(node, i)
            args[at] = 0
            node.args, node.kwargs = tuple(args), {k: v for k, v in node.kwargs.items() if k != "reduction"}
            with gm.graph.inserting_after(node):
                reduced = gm.graph.call_function(reduce, (node, list(range(meta.val(node.args[0]).dim()))))
            node.replace_all_uses_with(reduced, delete_user_cb=lambda user, made=reduced: user is not made)
            reduced.meta.update(node.meta)
            node.meta["val"] = meta.val(node.args[0]).new_empty(meta.val(node.args[0]).shape)
        elif node.target in _FULL and isinstance(meta.val(node.args[0]), torch.Tensor):
            dims = list(range(meta.val(node.args[0]).dim()))
            node.target, node.args = _FULL[node.target], (node.args[0], dims, False, *node.args[1:])
    gm.recompile()


def _default(node: fx.Node, i: int):
    a = node.target._schema.arguments[i]
    return a.default_value if a.has_default_value() else None
