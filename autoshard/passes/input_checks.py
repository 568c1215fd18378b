"""Data checks: ids and targets outside the vocabulary fail as they fail in the unsharded model.

An embedding or a token loss whose vocabulary is split over tp ranks treats an id outside a rank's range
as "another rank's": an id outside every range (a tokenizer that does not fit the model, a negative id,
a target past the vocabulary) would then train silently. And under pipeline or data parallelism only
some ranks look up or score a given id, so a local error would leave the others waiting on them.

So every lookup and token loss whose indices are computed from the inputs alone (no parameters) gets a
check, run on every rank on the whole global batch before any collective: a small parameter-free graph
cut out of the capture (the ancestors of those indices) computes them, and ids outside ``[0, rows)``
raise the unsharded model's ``IndexError``, naming the offending value, the vocabulary size and the
model's source line.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from autoshard import meta
from autoshard.passes.loss import ancestors

aten = torch.ops.aten

_LOOKUPS = {aten.embedding.default: (0, 1)}  # op -> (position of the weight, position of the indices)
_LOSSES = {  # op -> position of ignore_index in its arguments (the target is argument 1, class scores argument 0)
    aten.cross_entropy_loss.default: 4,
    aten.nll_loss_nd.default: 4,
    aten.nll_loss.default: 4,
}


@dataclass(frozen=True)
class RangeCheck:
    """Values of one graph value must lie in ``[0, size)`` (those equal to ``ignore`` excepted)."""

    node: str
    size: int
    kind: str  # "lookup" or "target"
    ignore: int | None
    where: str  # the model's source line, or ''

    def check(self, values: torch.Tensor) -> None:
        if values.numel() == 0 or values.is_floating_point() or values.device.type == "meta":
            return  # no data to check (a capture on meta)
        bad = (values < 0) | (values >= self.size)
        if self.ignore is not None:
            bad &= values != self.ignore
        if not bool(bad.any()):
            return
        value = int(values[bad][0])
        where = f" (at {self.where})" if self.where else ""
        if self.kind == "target":
            raise IndexError(
                f"Target {value} is out of bounds. The loss{where} scores {self.size} classes, so targets must lie "
                f"in [0, {self.size}) or equal ignore_index={self.ignore}: check that the labels come from a "
                "tokenizer that fits the model's vocabulary"
            )
        raise IndexError(
            f"index out of range in self: id {value} looked up in an embedding of {self.size} rows{where}; ids must "
            f"lie in [0, {self.size}): check that the tokenizer fits the model's vocabulary"
        )


@dataclass
class InputChecks:
    """The range checks of one capture and the graph that computes their values from its flat inputs."""

    checks: list[RangeCheck]
    gm: fx.GraphModule | None

    def run(self, *args) -> None:
        if not self.checks:
            return
        for check, values in zip(self.checks, self.gm(*args), strict=True):
            check.check(values)


def input_checks(gm: fx.GraphModule) -> InputChecks:
    """The range checks of every lookup and token loss in ``gm`` whose indices depend on no parameter."""
    found: list[tuple[fx.Node, RangeCheck]] = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _LOOKUPS:
            w, i = _LOOKUPS[node.target]
            weight, ids = node.args[w], node.args[i]
            size = _size(weight, 0)
            if size is not None and isinstance(ids, fx.Node):
                found.append((ids, RangeCheck(ids.name, size, "lookup", None, meta.source_line(node))))
        elif node.target in _LOSSES:
            scores, target = node.args[0], node.args[1]
            size = _size(scores, 1 if _ndim(scores) > 1 else 0)
            ignore = _arg(node, _LOSSES[node.target], "ignore_index", -100)
            if size is not None and isinstance(target, fx.Node):
                found.append((target, RangeCheck(target.name, size, "target", int(ignore), meta.source_line(node))))
    found = [(n, c) for n, c in found if not any(a.op in ("get_attr", "call_module") for a in ancestors(n))]
    if not found:
        return InputChecks([], None)
    return InputChecks([c for _, c in found], _cut(gm, [n for n, _ in found]))


def _cut(gm: fx.GraphModule, values: list[fx.Node]) -> fx.GraphModule:
    """A graph taking ``gm``'s flat inputs that returns ``values``, computed by their ancestors alone."""
    needed = set().union(*(ancestors(v) for v in values))
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder" or n in needed:
            env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(tuple(env[v] for v in values))
    graph.lint()
    return fx.GraphModule(torch.nn.Module(), graph)


def _size(node, dim: int) -> int | None:
    val = meta.val(node) if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() <= dim:
        return None
    return int(val.shape[dim])


def _ndim(node) -> int:
    val = meta.val(node) if isinstance(node, fx.Node) else None
    return val.dim() if isinstance(val, torch.Tensor) else 0


def _arg(node: fx.Node, position: int, name: str, default):
    if position < len(node.args) and node.args[position] is not None:
        return node.args[position]
    return node.kwargs.get(name, default)
