"""Activation checkpointing by segments: a program cut where the fewest bytes cross, each part recomputed alone.

Checkpointing a whole program keeps nothing between its forward and its backward, but its backward recomputes every
activation at once: the step's peak is what it was without checkpointing. HuggingFace checkpoints each layer, so
only one layer's activations are alive at a time in the backward. Here the layers are found from the graph: a
sweep in execution order counts the bytes of the values alive across each point (computed before it, read after
it; the program's inputs and parameters are held anyway), and the program is cut wherever that is as low as at its
typical valley (between the blocks of a stack of layers, and between their attention and MLP halves, only the
residual stream and what every layer reads cross), segments at least ``MIN_NODES`` long, never where a value some
op writes in place would be a segment's input. Each segment runs under ``torch.utils.checkpoint`` (non-reentrant,
the random streams restored, the buffers it writes in place put back after its recomputation), so its backward
keeps its inputs and recomputes the rest of it alone.
"""

from __future__ import annotations

import contextlib
import statistics
import weakref

import torch
from torch import fx, nn

from autoshard import peers
from autoshard.cost import activation_bytes
from autoshard.passes.writes import aliases, written_arguments, written_state

MIN_NODES = 8  # a segment shorter than this is not worth its boundary
TOLERANCE = 1.05  # a point whose crossing bytes are within this of the valleys' median is a cut

# program -> (what its segments were made from, its segmented module or None)
_SEGMENTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def segmented(gm: fx.GraphModule) -> nn.Module | None:
    """``gm`` run as its segments, each checkpointed (None where it has fewer than two). Made again where the
    program changed since: its code recompiled (devices rewritten by ``materialize``) or its tensors rebound."""
    made_from = (type(gm).forward, *map(id, gm.parameters()), *map(id, gm.buffers()))
    if gm not in _SEGMENTED or _SEGMENTED[gm][0] != made_from:
        _SEGMENTED[gm] = (made_from, _segmented(gm))
    return _SEGMENTED[gm][1]


def cuts(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes each segment after the first starts at."""
    order = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    if len(order) < 2 * MIN_NODES:
        return []
    position = {n: i for i, n in enumerate(order)}
    change = [0] * (len(order) + 2)
    for node in order:  # alive across the points after it up to its last reader (the output: to the end)
        last = max((position.get(u, len(order)) for u in node.users), default=position[node])
        size = activation_bytes(node)
        change[position[node] + 1] += size
        change[last + 1] -= size
    crossing, alive = [], 0  # crossing[i]: the bytes alive across the point before order[i]
    for delta in change[:len(order) + 1]:
        alive += delta
        crossing.append(alive)
    held = _written_across(gm, order, position)
    inner = range(MIN_NODES, len(order) - MIN_NODES + 1)
    # the valleys: points no nearer point undercuts; in a stack of layers most are between its blocks, so their
    # median is what crosses there (the residual stream, and what every layer reads)
    valleys = [crossing[i] for i in inner if crossing[i] == min(crossing[i - MIN_NODES:i + MIN_NODES + 1])]
    if not valleys:  # falling or rising throughout: no point between blocks to tell
        return []
    limit = TOLERANCE * statistics.median(valleys)
    found, start = [], 0
    for i in inner:
        if crossing[i] <= limit and i - start >= MIN_NODES and not held[i]:
            found.append(order[i])
            start = i
    return found


def _written_across(gm: fx.GraphModule, order: list[fx.Node], position: dict) -> list[bool]:
    """Per point, whether a value some op writes in place (or a view of it) is alive across it: a segment would
    take it as an input, which checkpointing keeps at its version, and the write (or the restoring of a buffer after
    a recomputation) would change it under the kept one."""
    written = {alias for node in gm.graph.nodes for value in written_arguments(node) for alias in aliases(value)}
    span = [0] * (len(order) + 2)
    for node in written:
        if node.op == "get_attr":  # an attribute of the segments that read it, not an input
            continue
        first = position[node] + 1 if node in position else 0  # an input: from the start
        last = max((position.get(u, len(order)) for u in node.users), default=first - 1)
        if last >= first:
            span[first] += 1
            span[last + 1] -= 1
    held, count = [], 0
    for delta in span[:len(order) + 1]:
        count += delta
        held.append(count > 0)
    return held


def _segmented(gm: fx.GraphModule) -> nn.Module | None:
    starts = set(cuts(gm))
    return _Segments(gm, starts) if starts else None


class _Segments(nn.Module):
    """``gm`` as consecutive segments, each its own graph module (its parameters and buffers read as attributes,
    not passed: checkpointing keeps what it is passed at its version, and a buffer is written in place), run in
    order, each value handed from the segment that computes it to those that read it."""

    def __init__(self, gm: fx.GraphModule, starts: set[fx.Node]) -> None:
        super().__init__()
        self.inputs = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        self.returned = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        parts: list[list[fx.Node]] = [[]]
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "get_attr", "output"):
                continue
            if node in starts:
                parts.append([])
            parts[-1].append(node)
        later: dict[fx.Node, int] = {}  # each node -> the last part (or the output, len(parts)) that reads it
        index = {node: k for k, part in enumerate(parts) for node in part}
        for node in gm.graph.nodes:
            for source in node.all_input_nodes:
                later[source] = max(later.get(source, -1), index.get(node, len(parts)))
        self.parts = nn.ModuleList()
        self.reads: list[list[str]] = []
        self.gives: list[list[str]] = []
        for k, part in enumerate(parts):
            graph, env, reads = fx.Graph(), {}, []

            def value(node: fx.Node, graph=graph, env=env, reads=reads) -> fx.Node:
                if node not in env:
                    if node.op == "get_attr":
                        env[node] = graph.get_attr(node.target)
                    else:  # an input of the program, or a value an earlier part computes
                        env[node] = graph.placeholder(node.name)
                        reads.append(node.name)
                return env[node]
            for node in part:
                env[node] = graph.node_copy(node, value)
            gives = [node for node in part if later.get(node, -1) > k]
            graph.output(tuple(env[node] for node in gives))
            self.parts.append(_Checkpointed(fx.GraphModule(gm, graph)))
            self.reads.append(reads)
            self.gives.append([node.name for node in gives])

    def forward(self, *args):
        env = dict(zip(self.inputs, args, strict=True))
        for part, reads, gives in zip(self.parts, self.reads, self.gives, strict=True):
            env.update(zip(gives, part(*(env[name] for name in reads)), strict=True))
        return fx.node.map_arg(self.returned, lambda node: env[node.name])


class _Checkpointed(nn.Module):
    """A segment whose activations are recomputed in the backward."""

    def __init__(self, segment: fx.GraphModule) -> None:
        super().__init__()
        self.segment = segment
        self.written = written_state(segment)

    def forward(self, *args):
        restored = Restored(self.written)
        return torch.utils.checkpoint.checkpoint(self.segment, *args, use_reentrant=False,
                                                 context_fn=lambda: (contextlib.nullcontext(), restored))


class Restored:
    """Activation checkpointing's recomputation runs the forward again: the buffers the forward updated in place
    (BatchNorm's running statistics, its step counter) are put back as the forward left them, not updated twice.
    Reusable: a split backward (input, then weight gradients) may recompute more than once. The collectives the
    recomputation issues are recorded as the recompute's (``peers.phase``): how many of them run, torch's early
    stop decides."""

    def __init__(self, state: list[torch.Tensor]) -> None:
        self.state, self.saved, self.phases = state, [], []

    def __enter__(self) -> None:
        self.saved.append([t.detach().clone() for t in self.state])
        self.phases.append(peers.phase("recompute"))
        self.phases[-1].__enter__()

    def __exit__(self, *exc) -> None:
        self.phases.pop().__exit__(*exc)
        with torch.no_grad():
            for tensor, value in zip(self.state, self.saved.pop(), strict=True):
                tensor.copy_(value)
