"""A candidate's bytes per rank, from its compiled rank programs: what ``mesh="auto"`` holds it to under a limit.

Per rank, at the step's peak (the backward of the last microbatch in flight):

- *weights*, *gradients* and the optimizer's *state*: the parameter bytes the rank holds (its tp, pp and ep share)
  once each, and twice for the state (AdamW's two moments; SGD with momentum keeps one, plain SGD none: the planner
  takes AdamW, the common case). DDP copies the gradients into its buckets (one more copy); FSDP2 (one unit per
  replica, as ``data_parallel="fsdp"`` wraps it) keeps the parameters, gradients and state sharded over dp x cp,
  and gathers the whole parameters and gradients during the forward and backward;
- *activations*: what autograd keeps from each microbatch's forward for its backward (:func:`saved_bytes`, read from
  the program's graph), times the microbatches a rank holds at its peak (one without a pipeline, where each
  microbatch's backward runs before the next forward; the schedule's simulated peak under one). Activation
  checkpointing keeps only each stage's input per microbatch in flight, and one microbatch's activations while its
  stage is recomputed.

Transient buffers (an op's workspace, a logits tensor between the forward and the loss) are not counted: the
figure is what a step holds, not the allocator's high-water mark.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import fx

from autoshard import cost, meta

# Ops whose backward needs none of their inputs (a sum's gradient is the incoming gradient, a view's a view of it).
_KEEPS_NOTHING = cost._VIEWS | {
    "add", "add_", "sub", "sub_", "neg", "cat", "stack", "clone", "contiguous", "to", "_to_copy", "type_as",
    "sum", "mean", "pad", "constant_pad_nd", "repeat", "expand_copy", "flatten", "lift_fresh_copy",
    "_assert_tensor_metadata", "_assert_scalar", "sym_size", "sym_numel", "zeros_like", "ones_like", "empty_like",
    "full_like", "new_zeros", "new_ones", "new_empty", "new_full", "arange", "zeros", "ones", "full", "empty",
}
# Ops whose backward reads their output (kept once, as the op's own tensor), not their input.
_KEEPS_OUTPUT = frozenset({"softmax", "_softmax", "sigmoid", "tanh", "exp", "rsqrt", "sqrt"})
# Ops that keep a fresh tensor of their input's size (cross entropy's log-softmax) and the small target.
_KEEPS_INPUT_SIZED = frozenset({"cross_entropy_loss", "log_softmax", "_log_softmax"})
# Products: each side is kept for the other side's gradient, so only where the other side needs one (a mask or a
# rotary table times an activation keeps the table, not the activation).
_PRODUCTS = frozenset({"mul", "linear", "mm", "bmm", "matmul"})
# Dropout keeps a mask: a byte per element.
_DROPOUT = frozenset({"dropout", "native_dropout", "feature_dropout", "alpha_dropout"})


@dataclass(frozen=True)
class Footprint:
    """Bytes per rank, by part."""

    weights: float
    gradients: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations

    def __str__(self) -> str:
        parts = (("weights", self.weights), ("gradients", self.gradients), ("optimizer", self.optimizer),
                 ("activations", self.activations))
        said = ", ".join(f"{name} {cost.format_bytes(v)}" for name, v in parts if v)
        return f"{cost.format_bytes(self.total)} per rank ({said})"


def saved_bytes(gm: fx.GraphModule) -> int:
    """Bytes autograd keeps from one forward of ``gm`` for its backward, read from the graph: each op that needs
    its inputs for its gradient keeps them (a matmul its activation input, a norm its input, a product both sides),
    each tensor once however many ops keep it (a view keeps its base); parameters are counted as weights, not here,
    and nothing computed from values that need no gradient is kept."""
    grads: set[fx.Node] = set()
    kept: dict[fx.Node, int] = {}

    def base(node: fx.Node) -> fx.Node:
        while node.op == "call_function" and cost.op_name(node.target) in cost._VIEWS and node.args \
                and isinstance(node.args[0], fx.Node):
            node = node.args[0]
        return node

    def keep(node: fx.Node, nbytes: int | None = None) -> None:
        node = base(node)
        if node.op == "get_attr":
            return
        kept[node] = max(kept.get(node, 0), node_bytes(node) if nbytes is None else nbytes)

    for node in gm.graph.nodes:
        value = meta.val(node)
        floating = any(t.is_floating_point() for t in cost._tensors(value))
        inputs = [a for a in node.all_input_nodes]
        if node.op == "get_attr":
            if isinstance(value, torch.Tensor) and floating and _is_parameter(gm, node):
                grads.add(node)
            continue
        if node.op == "placeholder":  # a later stage's input: the activation the previous stage sent
            if floating:
                grads.add(node)
            continue
        if node.op not in ("call_function", "call_module") or not floating or not any(a in grads for a in inputs):
            continue
        grads.add(node)
        if node.op == "call_module":  # the passes' modules: their attention keeps its inputs and output
            if type(gm.get_submodule(node.target)).__name__.endswith("Attention"):
                for a in inputs:
                    keep(a)
                keep(node)
            continue
        name = cost.op_name(node.target)
        if name in _KEEPS_NOTHING:
            continue
        if name in _KEEPS_OUTPUT:
            keep(node)
        elif name in _DROPOUT:
            kept[node] = sum(t.numel() for t in cost._tensors(value))
        elif name in _PRODUCTS and len(node.args) >= 2:  # a product with a number keeps nothing
            left, right = node.args[0], node.args[1]
            for side, other in ((left, right), (right, left)):
                if isinstance(side, fx.Node) and (other in grads if isinstance(other, fx.Node) else False):
                    keep(side)
        elif name in _KEEPS_INPUT_SIZED:
            kept[node] = node_bytes(inputs[0]) if inputs else 0
        else:
            for a in inputs:
                keep(a)
            if "attention" in name:  # its output and log-sum-exp too
                keep(node)
    return sum(kept.values())


def footprint(builds: list, mesh, options, in_flight: dict[int, float] | None = None) -> Footprint:
    """The footprint of the rank that holds most: ``builds`` per pp rank (its programs), ``in_flight`` the
    microbatches each pp rank holds at its peak (a pipeline schedule's; one each without)."""
    replicas = mesh.dp * mesh.cp
    worst = None
    for r, build in enumerate(builds):
        mine = held_bytes(build, r)
        holding = (in_flight or {}).get(r, 1.0)
        programs = list(build.programs.values())
        saved = sum(saved_bytes(p.gm) for p in programs)
        if options.activation_checkpointing:  # the stage's inputs per microbatch, one microbatch recomputed
            inputs = sum(node_bytes(n) for p in programs for n in p.gm.graph.nodes if n.op == "placeholder")
            activations = holding * inputs + saved
        else:
            activations = holding * saved
        if options.data_parallel == "fsdp" and replicas > 1:
            found = Footprint(weights=mine + mine / replicas, gradients=mine + mine / replicas,
                              optimizer=2 * mine / replicas, activations=activations)
        else:
            found = Footprint(weights=mine, gradients=mine * (2 if replicas > 1 else 1), optimizer=2 * mine,
                              activations=activations)
        if worst is None or found.total > worst.total:
            worst = found
    return worst


def held_bytes(build, r: int = 0) -> float:
    """The parameter bytes pp rank ``r`` holds: its tp and ep shares of its stages' parameters (the compiler counts
    them where there is a pipeline; without one, the parameters of the rank's program)."""
    if len(build.held_bytes) > r:
        return build.held_bytes[r]
    return float(sum(math.prod(p.shape) * p.element_size() for program in build.programs.values()
                     for p in program.gm.parameters()))


def _is_parameter(gm: fx.GraphModule, node: fx.Node) -> bool:
    try:
        return gm.get_parameter(node.target).requires_grad
    except AttributeError:
        return False


def node_bytes(node: fx.Node) -> int:
    """The bytes of ``node``'s output tensor(s)."""
    return sum(cost.dim_size(t.numel()) * t.dtype.itemsize for t in cost._tensors(meta.val(node)))
