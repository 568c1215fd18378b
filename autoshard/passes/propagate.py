"""Sharding propagation: the placement of every value of a graph on one mesh axis, from its parameters'.

``propagate(gm, seeds, axis)`` walks the graph in order. Placeholders (the model's inputs) are
replicated, parameters take their placement from ``seeds`` (keyed by ``get_attr`` target), and every
other node takes the decision of its rule (``rules.decide``). The result records, per node, the
output placement and the decision, from which ``redistributions`` lists every collective the graph
needs and ``cost`` counts the expensive ones.

Propagation is incremental: given a previous result, only the nodes downstream of parameters whose
seed changed are decided again, so the planner can try a candidate region in time proportional to
the region, not to the model.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch
from torch import fx

from autoshard import meta
from autoshard.passes.axis import Axis, Outputs
from autoshard.passes.placements import Partial, Placement, R, Replicate, Shard
from autoshard.passes.rules import Context, Decision, decide, is_view, read_after, replicate_all, written_inputs


@dataclass
class Propagation:
    axis: Axis
    seeds: dict[str, Placement]  # by get_attr target (parameters) or placeholder name (inputs)
    outputs: Outputs = Outputs.WHOLE  # what the graph may return (see Outputs)
    whole: set[fx.Node] = field(default_factory=set)  # values kept replicated: a later write needs them whole
    placements: dict[fx.Node, Placement | tuple] = field(default_factory=dict)
    decisions: dict[fx.Node, Decision] = field(default_factory=dict)
    changed: set[fx.Node] = field(default_factory=set)

    @property
    def size(self) -> int:
        return self.axis.size

    def of(self, node: fx.Node) -> Placement | tuple:
        return self.placements.get(node, R)


@dataclass(frozen=True)
class Redistribution:
    """A value that a consumer needs in another placement: the collective the pass inserts."""

    value: fx.Node
    consumer: fx.Node
    src: Placement
    dst: Placement

    @property
    def kind(self) -> str:
        if isinstance(self.src, Partial):
            return "all_reduce" if self.dst == R else "reduce_scatter"
        if isinstance(self.src, Shard) and self.dst == R:
            return "all_gather"
        if isinstance(self.src, Replicate) and isinstance(self.dst, Shard):
            return "split"
        return "all_to_all"


def propagate(
    gm: fx.GraphModule, seeds: dict[str, Placement], axis: Axis, *, base: Propagation | None = None,
    outputs: Outputs = Outputs.WHOLE,
) -> Propagation:
    """Placements of every node of ``gm`` on ``axis`` given the placements ``seeds`` of parameters and inputs."""
    result = Propagation(axis=axis, seeds=dict(seeds), outputs=outputs)
    nodes = list(gm.graph.nodes)
    if base is None:
        todo = nodes
    else:
        result.placements = dict(base.placements)
        result.decisions = dict(base.decisions)
        changed = {t for t in set(seeds) | set(base.seeds) if seeds.get(t, R) != base.seeds.get(t, R)}
        todo = [n for n in nodes if n.op in ("get_attr", "placeholder") and n.target in changed]
        result.whole = set(base.whole)
    _run(result, nodes, todo)
    while lost := _lost_writes(result, nodes) - result.whole:
        result.whole |= lost
        _run(result, nodes, list(lost))
    return result


def _lost_writes(result: Propagation, nodes: list[fx.Node]) -> set[fx.Node]:
    """Values the model writes in place through a view that reads a redistributed copy of them (``out[:, t] = x``
    with ``out`` split along ``t``): the write would land in the copy while later readers see the original. Such a
    value must be computed replicated, so the view and the write are local (see ``propagate``)."""
    lost = set()
    for node in nodes:
        if node.op != "call_function":
            continue
        for written in written_inputs(node):
            base, copied = written, False
            while base.op == "call_function" and is_view(base) and base.args and isinstance(base.args[0], fx.Node):
                decision = result.decisions.get(base)
                copied = copied or (decision is not None and base.args[0] in decision.want)
                base = base.args[0]
            if copied and base.op == "call_function" and read_after(written, node):
                lost.add(base)
    return lost


def _run(result: Propagation, nodes: list[fx.Node], todo: list[fx.Node]) -> None:
    ctx = Context(result.axis, result.placements)
    if len(todo) == len(nodes):
        for node in nodes:
            _store(result, node, ctx)
        return
    # Incremental: graph order is a topological order, so popping by position decides every input first.
    order = {n: i for i, n in enumerate(nodes)}
    heap = sorted(order[n] for n in todo)
    done: set[int] = set()
    while heap:
        index = heapq.heappop(heap)
        if index in done:
            continue
        done.add(index)
        node = nodes[index]
        before = result.placements.get(node)
        if _store(result, node, ctx) != before or node.op in ("get_attr", "placeholder"):
            for user in node.users:
                heapq.heappush(heap, order[user])


def _store(result: Propagation, node: fx.Node, ctx: Context):
    placement, decision = _decide(node, ctx, result)
    result.placements[node] = placement
    result.changed.add(node)
    if decision is not None:
        result.decisions[node] = decision
    else:
        result.decisions.pop(node, None)
    return placement


def _decide(node: fx.Node, ctx: Context, result: Propagation):
    if node.op in ("placeholder", "get_attr"):
        return result.seeds.get(node.target, R), None
    if node.op == "output":
        if result.outputs is Outputs.KEPT:  # handed on split only as the next stage seeds what it receives (a
            # plain split); a split in blocks of a dim (the tokens of a flattened batch) or a partial sum whole
            want = {n: R for n in node.all_input_nodes if not handed_on(ctx.placements.get(n, R))}
            return R, Decision(R, want)
        want = {}
        for n in node.all_input_nodes:
            p = ctx.placements.get(n, R)
            if isinstance(p, (tuple, Replicate)) or (isinstance(p, Partial) and result.outputs is Outputs.PARTIAL):
                continue
            want[n] = R
        return R, Decision(R, want)
    if node.op == "call_function" and node.target.__name__ == "getitem" and isinstance(node.args[0], fx.Node):
        parent = ctx.placements.get(node.args[0], R)
        return (parent[node.args[1]] if isinstance(parent, tuple) else parent), None
    if node.op not in ("call_function", "call_module"):
        return R, None
    if node in result.whole:
        decision = replicate_all(node, ctx, reason=f"{node.target}: written in place later through a view that "
                                                   "needs it whole")
        return decision.out, decision
    decision = decide(node, ctx)
    if result.axis.sequence and not _whole_sequences(decision.out, node, result.axis.sequence):
        # The sequence split would move into a dim that holds no whole sequences (a reshape of tokens into chunks
        # of a linear attention): no gather could put such a value back in order, so gather before it instead.
        decision = replicate_all(node, ctx, reason=f"{node.target}: would split the sequence into parts of a dim")
    return decision.out, decision


def handed_on(placement) -> bool:
    """Whether a pipeline stage sends a value placed so as it is: whole, or split plainly along one dim, as the
    receiving stage seeds its inputs (``codegen._with_received``). Any other placement is gathered first."""
    return isinstance(placement, (tuple, Replicate)) or (isinstance(placement, Shard) and placement.blocks is None)


def _whole_sequences(out, node: fx.Node, sequence: int) -> bool:
    val = meta.val(node)
    if not isinstance(out, Shard) or not isinstance(val, torch.Tensor) or out.dim >= val.dim():
        return True
    return val.shape[out.dim] % sequence == 0


def redistributions(prop: Propagation) -> list[Redistribution]:
    """Every (value, consumer) pair whose placements differ, in graph order."""
    found = []
    for node, decision in prop.decisions.items():
        for value, dst in decision.want.items():
            src = prop.of(value)
            if not isinstance(src, tuple) and src != dst:
                found.append(Redistribution(value, node, src, dst))
    return found


def cost(prop: Propagation, nodes=None) -> tuple[int, int, list[str]]:
    """(all-gathers of sharded values, fallbacks, conflicts) among ``nodes`` (all decided nodes by default)."""
    gathers = fallbacks = 0
    conflicts: list[str] = []
    for node in prop.decisions if nodes is None else nodes:
        decision = prop.decisions.get(node)
        if decision is None:
            continue
        gathers += sum(1 for v, dst in decision.want.items() if isinstance(prop.of(v), Shard) and dst == R)
        fallbacks += decision.fallback
        if decision.conflict:
            conflicts.append(decision.conflict)
    return gathers, fallbacks, conflicts


def requires_grad(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes whose value depends on a trainable parameter (their gradient flows back).

    A pipeline stage's inputs received from the previous stage count as such: their gradient is sent back, so a
    collective's backward twin on them (the all-reduce behind Megatron's f) must not be left out. A value the
    model computes with gradients off (``torch.no_grad()``, captured as ``wrap_with_set_grad_enabled(False,
    ...)``, or inlined with its inputs detached) does not. A collective another axis put in (a rank's graph after
    tensor parallelism, which context and sequence parallelism rewrite again) passes the gradient on like any op.
    """
    params = {name for name, p in gm.named_parameters() if p.requires_grad}
    found: set[fx.Node] = set()
    for node in gm.graph.nodes:
        parameter = node.op == "get_attr" and node.target in params
        if parameter or (node.op == "placeholder" and meta.RECEIVED in node.meta):
            found.add(node)
        elif node.op == "call_function" and (_grad_disabled(node) or node.target is torch.ops.aten.detach.default):
            continue
        elif node.op in ("call_function", "call_module") and any(n in found for n in node.all_input_nodes):
            val = meta.val(node)
            if not isinstance(val, torch.Tensor) or val.is_floating_point():
                found.add(node)
    return found


def _grad_disabled(node: fx.Node) -> bool:
    """Whether ``node`` runs a region of the model with gradients off."""
    return getattr(node.target, "__name__", "") == "wrap_with_set_grad_enabled" and node.args[:1] == (False,)


def reaching_output(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes the graph's output depends on through floating-point values: gradients flow to these only.

    A parameter read only to pick positions (a top-k's indices) or by a value the output ignores is not among
    them: it gets no gradient.
    """
    grad = requires_grad(gm)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    found: set[fx.Node] = set()
    todo = [n for n in output.all_input_nodes if n in grad]
    while todo:
        node = todo.pop()
        if node in found:
            continue
        found.add(node)
        if node.target is not torch.ops.aten.detach.default:
            todo.extend(n for n in node.all_input_nodes if n in grad)
    return found
