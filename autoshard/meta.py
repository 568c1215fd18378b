"""Keys that autoshard's analyses and passes write on ``node.meta``, declared in one place.

Written by torch.export (read by every pass):
- ``VAL``: a fake tensor with the node's shape and dtype.
- ``MODULE_STACK``: ``{key: (qualified name, module class)}``, the modules a node came from.
- ``STACK_TRACE``: the user's source lines that produced the node.

Written by autoshard:
- ``SOURCE``: set by passes on the nodes they insert (the name of the pass), read by ``explain()``.
- ``RECEIVED_ACTIVATION``: set by the pipeline split on a stage's inputs that are activations received from the
  previous stage (their gradient is sent back), read by ``passes.propagate.requires_grad``.
"""

import os

import torch

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep

VAL = "val"
MODULE_STACK = "nn_module_stack"
STACK_TRACE = "stack_trace"
SOURCE = "autoshard_source"
RECEIVED_ACTIVATION = "autoshard_received_activation"


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
