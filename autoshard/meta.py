"""Keys that autoshard's analyses and passes write on ``node.meta``, declared in one place.

Written by torch.export (read by every pass):
- ``VAL``: a fake tensor with the node's shape and dtype.
- ``MODULE_STACK``: ``{key: (qualified name, module class)}``, the modules a node came from.
- ``STACK_TRACE``: the user's source lines that produced the node.

Written by autoshard:
- ``SOURCE``: set by passes on the nodes they insert (the name of the pass), read by ``explain()``.
"""

VAL = "val"
MODULE_STACK = "nn_module_stack"
STACK_TRACE = "stack_trace"
SOURCE = "autoshard_source"


def source_line(node) -> str:
    """The last line of the model's source that produced ``node``, or '' when unknown."""
    trace = node.meta.get(STACK_TRACE) or ""
    lines = [line.strip() for line in trace.strip().splitlines() if line.strip()]
    files = [line for line in lines if line.startswith("File ")]
    if not files:
        return ""
    last = files[-1]
    code = lines[lines.index(last) + 1] if lines.index(last) + 1 < len(lines) else ""
    return f"{last}: {code}" if code and not code.startswith("File ") else last


def module_path(node) -> str:
    """The qualified name of the innermost module ``node`` came from ('' at the top level)."""
    stack = node.meta.get(MODULE_STACK) or {}
    if not stack:
        return ""
    name, _cls = list(stack.values())[-1]
    return name
