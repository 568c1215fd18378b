"""Keys that autoshard's analyses and passes write on ``node.meta`` and ``GraphModule.meta``, declared in one place.

Written by torch.export (read by every pass):
- ``VAL``: a fake tensor with the node's shape and dtype.
- ``MODULE_STACK``: ``{key: (qualified name, module class)}``, the modules a node came from.
- ``STACK_TRACE``: the user's source lines that produced the node.

Written by autoshard:
- ``AXIS``: the mesh axis (``tp``, ``cp``) whose pass inserted the node, set by ``passes.localize.Rewriter`` on the
  collective nodes it inserts (and carried by what copies their metadata, such as the trim after a padded gather);
  read by ``dot.axis_of`` (and ``explain()``'s communication counts) to attribute communication to an axis. The
  collective module itself carries the same name in its ``axis`` attribute, for code that holds only the module.
- ``RECEIVED``: set by the pipeline split on every stage input received from the previous stage: the name (in the
  whole graph) of the activation it receives. Its gradient is sent back, so ``passes.propagate.requires_grad``
  reads it, as do ``codegen`` (the receive specs, the cp split of received values) and ``dot`` (the colour).
- ``IDLE_F``: on a Megatron f put where no gradient flows, only to mark a tp region's entry for sequence
  parallelism (``passes.sharding``); sequence parallelism drops them once it has read them.
- ``COST``: a ``cost.NodeCost``, written by ``cost.annotate``; read by the planner and the partitioner.
- ``REGION``: on the collectives at the borders of tensor parallelism's regions, written by
  ``tensor_parallel_pass``: ``"entry"`` (Megatron's f before the columns), ``"split entry"`` (a replicated value split
  where a split consumer reads it, such as a row-parallel linear alone), ``"whole entry"`` (``ReadWhole``: the input of
  a fused column's blocks every rank computes whole) or ``"exit"`` (the all-reduce of the rows' partial sums). Read
  by sequence
  parallelism, which gathers the sequence at the entries and reduce-scatters it at the exits.

On ``GraphModule.meta``:
- ``FALLBACKS``: the ops a pass ran replicated for want of a rule, with the warning each gave
  (``passes.sharding``); read by ``explain()``.
- ``PARTIAL_OUTPUT``: the loss the graph returns is this cp rank's partial sum (``passes.context_parallel``); read
  by the runtime, which then sums it over cp instead of averaging.

Written by the passes that split values (``passes.sharding``, after an axis's rewrite):
- ``LOCAL``: on every value the pass split, a fake tensor of the part this rank holds. ``VAL`` stays what export
  recorded (the global value), so a pass for another axis that runs next (tp, then cp, then sp) sees what this
  rank holds through ``val`` and the whole through ``global_val``; rewrites that stand a new node for an old one
  copy both (``SHAPES``).

``val(node)``: the value as this graph holds it (``LOCAL`` where a pass split it, else ``VAL``; None where there
is none), the one way code here reads it; ``global_val(node)``: export's ``VAL`` alone.
"""

import os

import torch

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep

VAL = "val"
MODULE_STACK = "nn_module_stack"
STACK_TRACE = "stack_trace"
AXIS = "autoshard_axis"
RECEIVED = "autoshard_received"
IDLE_F = "autoshard_idle_f"
COST = "autoshard_cost"
FALLBACKS = "autoshard_fallbacks"
PARTIAL_OUTPUT = "autoshard_partial_output"
LOCAL = "autoshard_local_val"
REGION = "autoshard_region"
SHAPES = (VAL, LOCAL)  # what a node standing for another takes of its metadata about the value


def val(node):
    """The fake tensor (or value) of ``node``'s output as this graph holds it: this rank's part where a pass split
    it, else what export recorded; None for a node without one."""
    found = node.meta
    return found[LOCAL] if LOCAL in found else found.get(VAL)


def standing_for(node) -> dict:
    """The metadata a node inserted to stand for ``node``'s value takes from it: its values and where it came from."""
    return {k: v for k, v in node.meta.items() if k in (*SHAPES, MODULE_STACK, STACK_TRACE)}


def global_val(node):
    """What export recorded for ``node``'s output (the whole value, however a pass split it); None without one."""
    return node.meta.get(VAL)


def source_line(node) -> str:
    """The innermost line of the model's own source (not torch's) that produced ``node``, or ''."""
    trace = node.meta.get(STACK_TRACE) or ""
    lines = [line.strip() for line in trace.strip().splitlines() if line.strip()]
    for i in reversed(range(len(lines))):
        line = lines[i]
        if not line.startswith("File ") or _TORCH_DIR in line:
            continue
        code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
        return f"{line}: {code}" if code else line
    return ""


def module_path(node) -> str:
    """The qualified name of the innermost module ``node`` came from ('' at the top level)."""
    stack = node.meta.get(MODULE_STACK) or {}
    if not stack:
        return ""
    name, _cls = list(stack.values())[-1]
    return name
