"""A stage's backward in two parts, for the zero-bubble schedules: input gradients now, weight gradients later.

``input_gradients`` runs the part of the backward that leads to the stage's inputs (``I``: what the previous
stage waits for) and returns the rest as ``WeightGradients``, whose ``run`` (``W``) computes the parameters'
gradients later, without recomputing anything ``I`` computed.

How the autograd graph is cut (the zero-bubble paper's split, done on the recorded graph as PyTorch's pipelining
does): the *input closure* is every node on a path from the outputs to an input. A parameter's gradient flows
out of that closure at *intermediate* nodes (for a linear, its matmul's backward, which makes both dX and dW).
``I`` runs the backward to the inputs only (the engine computes just dX there) and records, by a hook, the
gradient arriving at each intermediate. ``W`` restarts the engine at those intermediates with the recorded
gradients, asking for the parameters only, so each intermediate now computes just dW. A parameter whose
gradient never meets the closure (every parameter of the first stage, whose inputs are token ids; a bias
computed from weights alone) starts from the outputs themselves. Parameters that share an intermediate (a
linear's weight and bias) are one group, one engine call; ``W`` accumulates into ``.grad`` through autograd
itself, so post-accumulate hooks (the data-parallel buckets) fire as in one backward. Gradients are bitwise
those of one ``backward()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


@dataclass(eq=False)
class _Group:
    params: list[torch.Tensor]
    starts: list = field(default_factory=list)  # autograd nodes the weight backward starts at
    from_outputs: list[int] = field(default_factory=list)  # indices into the roots for a group reached from them


@dataclass
class WeightGradients:
    """The deferred half of a backward; ``run`` once."""

    groups: list[_Group]
    saved: dict  # intermediate node -> the gradients that arrived at it during ``I``
    roots: list[torch.Tensor]
    root_grads: list[torch.Tensor]

    def run(self) -> None:
        for group in self.groups:
            edges, grads = [], []
            for node in group.starts:
                for i, grad in enumerate(self.saved.get(node, ())):
                    if grad is not None:
                        edges.append(GradientEdge(node, i))
                        grads.append(grad)
            for k in group.from_outputs:
                edges.append(self.roots[k])
                grads.append(self.root_grads[k])
            if not edges:
                continue
            # where one start feeds another (a weight read by two layers), the later start would receive the
            # earlier one's flow on top of its recorded total: each start returns its recorded gradients instead
            hooks = [node.register_prehook(lambda _, saved=self.saved[node]: saved)
                     for node in group.starts if len(group.starts) > 1 and node in self.saved]
            try:
                torch.autograd.backward(edges, grads, inputs=group.params, retain_graph=True)
            finally:
                for hook in hooks:
                    hook.remove()
        self.groups, self.saved, self.roots, self.root_grads = [], {}, [], []


def input_gradients(roots: list[torch.Tensor], root_grads: list[torch.Tensor], inputs: list[torch.Tensor]
                    ) -> tuple[list[torch.Tensor | None], WeightGradients]:
    """Run the backward from ``roots`` (with ``root_grads``) to ``inputs`` only; return the inputs' gradients
    (None where unused) and the rest, to ``run`` later: the gradients of every other leaf the graph reads (the
    parameters, whichever tensors hold them now: FSDP2's gathered ones too)."""
    pairs = [(r, g) for r, g in zip(roots, root_grads, strict=True) if r.requires_grad]
    roots, root_grads = [r for r, _ in pairs], [g for _, g in pairs]
    parents = _parents([r.grad_fn for r in roots if r.grad_fn is not None])
    wanted = [x for x in inputs if x.requires_grad]
    input_nodes = [get_gradient_edge(x).node for x in wanted]
    closure = _upstream(input_nodes, parents)
    leaves = [node for node in parents if hasattr(node, "variable") and node not in set(input_nodes)]
    groups = _groups(leaves, roots, parents, closure)
    inputs_held = {id(x) for x in wanted}
    # an output that is a parameter itself (``D.float()`` of a float weight, handed to the next stage): its
    # gradient is the output's, accumulated in W
    groups += [_Group([r], [], [k]) for k, r in enumerate(roots) if r.grad_fn is None and id(r) not in inputs_held]
    saved: dict = {}
    hooks = [node.register_prehook(lambda grads, node=node: saved.__setitem__(node, grads))
             for node in {n for g in groups for n in g.starts}]
    try:
        grads = torch.autograd.grad(roots, wanted, root_grads, retain_graph=True, allow_unused=True) \
            if wanted and roots else [None] * len(wanted)
    finally:
        for hook in hooks:
            hook.remove()
    by_input = dict(zip(map(id, wanted), grads, strict=True))
    return [by_input.get(id(x)) for x in inputs], WeightGradients(groups, saved, roots, root_grads)


def _parents(roots: list) -> dict:
    """For every autograd node reachable from ``roots``, the nodes whose backward feeds it."""
    parents: dict = {root: [] for root in roots}
    todo = list(roots)
    while todo:
        node = todo.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                todo.append(child)
            parents[child].append(node)
    return parents


def _upstream(nodes: list, parents: dict) -> set:
    """``nodes`` and every node on a path from the roots to one of them."""
    seen = {n for n in nodes if n in parents}
    todo = list(seen)
    while todo:
        for parent in parents[todo.pop()]:
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


def _groups(leaves: list, roots: list[torch.Tensor], parents: dict, closure: set) -> list[_Group]:
    """For each parameter (its gradient accumulator, a leaf node), where its weight backward starts; parameters
    sharing a start merged."""
    root_index = {r.grad_fn: k for k, r in enumerate(roots) if r.grad_fn is not None}
    groups: list[_Group] = []
    group_of: dict = {}  # start node (or ("root", k)) -> group
    for node in leaves:
        param = node.variable
        starts, outputs, seen, todo = set(), set(), {node}, [node]
        while todo:
            current = todo.pop()
            if current in root_index:
                outputs.add(root_index[current])
            for parent in parents[current]:
                if parent in closure:
                    starts.add(parent)
                elif parent not in seen:
                    seen.add(parent)
                    todo.append(parent)
        keys = list(starts) + [("root", k) for k in outputs]
        found = {id(group_of[k]): group_of[k] for k in keys if k in group_of}
        group = _Group([param], sorted(starts, key=id), sorted(outputs))
        for other in found.values():  # merge every group sharing a start with this one
            group.params = other.params + group.params
            group.starts = sorted(set(other.starts) | set(group.starts), key=id)
            group.from_outputs = sorted(set(other.from_outputs) | set(group.from_outputs))
            groups.remove(other)
        groups.append(group)
        for key in list(starts) + [("root", k) for k in group.from_outputs] + list(group.starts):
            group_of[key] = group
        for other in found.values():
            for key, value in list(group_of.items()):
                if value is other:
                    group_of[key] = group
    return groups
