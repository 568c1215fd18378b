"""Loss normalisation: one global divisor so that every gradient reduction is a plain sum.

A token loss such as ``cross_entropy(logits, target, ignore_index=-100)`` with mean reduction divides
by the number of non-ignored tokens *of its own batch*. Averaging such means over microbatches and
data-parallel ranks is wrong as soon as ignored tokens are spread unevenly. So the captured loss is
rewritten to a sum, and the runtime divides each microbatch's sum by the number of non-ignored
tokens of the whole global batch, counted up front by a small parameter-free graph cut out of the
training graph (the ancestors of the loss's target). Losses that are not recognised keep their
mean and are divided by the number of microbatches in the global batch, which is exact for a mean
over equal-sized microbatches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from autoshard.passes.writes import closure

aten = torch.ops.aten

# op -> (position of reduction, position of ignore_index, position of weight) in its arguments
_TOKEN_LOSSES = {
    aten.cross_entropy_loss.default: (3, 4, 2),
    aten.nll_loss_nd.default: (3, 4, 2),
    aten.nll_loss.default: (3, 4, 2),
}
_MEAN = 1
_SUM = 2


@dataclass(frozen=True)
class TokenLoss:
    """A mean-reduced token loss found in a training graph: the node name and its ignore index."""

    node: str
    ignore_index: int


# ops that scale a loss by a number (``2.0 * loss``, ``loss / accumulation_steps``, a cast): the loss stays a token
# loss, its sum scaled alike
_SCALES = {aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar}
_KEEPS = {aten.neg.default, aten.to.dtype, aten._to_copy.default, aten.clone.default, aten.alias.default}
LOSS_SCALES = frozenset(_SCALES | _KEEPS)  # what a loss's sum may pass through and stay a sum (``rules``)


def _unscaled(node: fx.Node) -> fx.Node:
    """The loss ``node`` scales by numbers (itself where it scales nothing): each step read by it alone."""
    while isinstance(node, fx.Node):
        by_number = node.target in _SCALES and isinstance(node.args[0], fx.Node) \
            and isinstance(node.args[1], (int, float))
        if node.target in _KEEPS or by_number:
            inner = node.args[0]
        elif node.target in (aten.mul.Tensor, aten.mul.Scalar) and isinstance(node.args[0], (int, float)) \
                and isinstance(node.args[1], fx.Node):
            inner = node.args[1]
        else:
            return node
        if not isinstance(inner, fx.Node) or len(inner.users) != 1:
            return node
        node = inner
    return node


def is_token_mean(node: fx.Node) -> bool:
    """A cross-entropy or NLL averaged over its counted tokens (mean reduction): its divisor depends on the targets."""
    if node.op != "call_function" or node.target not in _TOKEN_LOSSES:
        return False
    positions = _TOKEN_LOSSES[node.target]
    return _arg(node, positions[0], _MEAN) == _MEAN


def find_token_loss(gm: fx.GraphModule) -> TokenLoss | None:
    """The token loss whose value the graph returns (scaled by numbers or not), when it is a mean-reduced
    cross-entropy or NLL."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    returned = fx.node.map_arg(output.args[0], lambda n: n)
    node = returned[0] if isinstance(returned, (tuple, list)) and len(returned) == 1 else returned
    node = _unscaled(node) if isinstance(node, fx.Node) else node
    if not isinstance(node, fx.Node) or node.target not in _TOKEN_LOSSES:
        return None
    positions = _TOKEN_LOSSES[node.target]
    reduction, ignore, weight = (_arg(node, i, d) for i, d in zip(positions, (_MEAN, -100, None), strict=True))
    if reduction != _MEAN or weight is not None:
        return None
    return TokenLoss(node=node.name, ignore_index=int(ignore))


def sum_loss_pass(gm: fx.GraphModule, loss: TokenLoss) -> fx.GraphModule:
    """Rewrite the loss node of ``gm`` from mean to sum reduction."""
    node = _node(gm, loss.node)
    position = _TOKEN_LOSSES[node.target][0]
    args = list(node.args) + [None] * max(0, position + 1 - len(node.args))
    defaults = (None, _MEAN, loss.ignore_index)
    for i in range(len(node.args), position):
        args[i] = defaults[i - 2]
    args[position] = _SUM
    node.args = tuple(args)
    node.kwargs = {k: v for k, v in node.kwargs.items() if k != "reduction"}
    gm.graph.lint()
    gm.recompile()
    return gm


def token_count_graph(gm: fx.GraphModule, loss: TokenLoss) -> fx.GraphModule:
    """A graph taking the same flat inputs as ``gm`` that returns the number of counted tokens."""
    node = _node(gm, loss.node)
    target = node.args[1]
    needed = ancestors(target)
    if any(n.op in ("get_attr", "call_module") for n in needed):
        raise ValueError(f"the target of the loss {loss.node} depends on parameters; cannot count its tokens")
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder" or n in needed:
            env[n] = graph.node_copy(n, lambda a: env[a])
    counted = graph.call_function(aten.ne.Scalar, (env[target], loss.ignore_index))
    graph.output(graph.call_function(aten.sum.default, (counted,)))
    graph.lint()
    return fx.GraphModule(torch.nn.Module(), graph)


def ancestors(node: fx.Node) -> set[fx.Node]:
    """``node``, every node it is computed from, and every in-place write into those (a target built as
    ``labels[:, :-1] = ids[:, 1:]``)."""
    return closure([node])


def _node(gm: fx.GraphModule, name: str) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)


def _arg(node: fx.Node, position: int, default):
    if position < len(node.args):
        return node.args[position]
    name = {2: "weight", 3: "reduction", 4: "ignore_index"}[position]
    return node.kwargs.get(name, default)
