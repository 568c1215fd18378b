"""Graphviz DOT text of an FX graph: one box per node with its op and shape, collectives highlighted.

    from autoshard.dot import to_dot, write_dot
    write_dot(program.gm, "graphs/rank1.dot", title="rank 1")   # then: dot -Tsvg graphs/rank1.dot -o rank1.svg

The text is written here directly (no pydot or graphviz package is needed to produce it). Each node's
label has its name, its op (``aten.linear``; a collective's module with its forward and backward
communication, ``ReduceFromParallel`` / ``forward all_reduce, backward identity``; a parameter) and the
shape and dtype of its value (``2x16x48 float32``), so a sharded graph shows its local sizes.
Communication is filled in colour:

===============================  =========  ==========================================================
node                             colour     what it is
===============================  =========  ==========================================================
tp collective call_module        orange     a tensor-parallel collective (all-reduce, all-gather, ...)
cp collective call_module        blue       a context-parallel collective (sequence gather or scatter)
other collective call_module     purple     a collective of another axis
received placeholder             green      an activation received from the previous pipeline stage
output of a stage that sends     green      the activations sent to the next pipeline stage
===============================  =========  ==========================================================

Inputs are ellipses, parameters and buffers (``get_attr``) grey boxes, everything else white boxes.
A collective's axis and a received input are read from the metadata the passes write (``meta.AXIS``,
``meta.RECEIVED``), not from node names.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import fx

from autoshard import meta

AXIS_COLOURS = {"tp": "#ffcc80", "sp": "#ffe0b2", "cp": "#90caf9"}
OTHER_COLLECTIVE = "#ce93d8"
PIPELINE = "#a5d6a7"
PARAMETER = "#eeeeee"
PLAIN = "#ffffff"


def to_dot(gm: fx.GraphModule, *, name: str = "graph", title: str | None = None, sends: bool = False) -> str:
    """The DOT text of ``gm``'s graph; ``sends`` marks the output as activations sent to a next pipeline stage."""
    ids = {node: f"n{i}" for i, node in enumerate(gm.graph.nodes)}
    lines = [
        f"digraph {_quote(name)} {{",
        f"  graph [rankdir=TB, fontname=Helvetica, labelloc=t, label={_quote(title or name)}];",
        f'  node [shape=box, style="rounded,filled", fillcolor="{PLAIN}", fontname=Helvetica, fontsize=10];',
        "  edge [arrowsize=0.6];",
    ]
    for node in gm.graph.nodes:
        attrs = {"label": "\n".join(_label(gm, node))}
        attrs.update(_style(gm, node, sends))
        lines.append(f"  {ids[node]} [{', '.join(f'{k}={_quote(v)}' for k, v in attrs.items())}];")
    for node in gm.graph.nodes:
        for source in node.all_input_nodes:
            lines.append(f"  {ids[source]} -> {ids[node]};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def write_dot(gm: fx.GraphModule, path: str | Path, *, title: str | None = None, sends: bool = False) -> Path:
    """Write ``to_dot(gm)`` to ``path`` (its folder is created) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_dot(gm, name=path.stem, title=title, sends=sends))
    return path


def collective(gm: fx.GraphModule, node: fx.Node) -> torch.nn.Module | None:
    """The communication module a ``call_module`` node runs, or None when the node does not communicate."""
    if node.op != "call_module":
        return None
    module = gm.get_submodule(node.target)
    if hasattr(module, "comm_bytes") and getattr(module, "size", 1) > 1:
        return module
    return None


def axis_of(node: fx.Node) -> str:
    """The mesh axis of a rewritten graph's collective node (``tp``, ``cp``), or '' for a node no pass inserted."""
    return node.meta.get(meta.AXIS, "")


def _label(gm: fx.GraphModule, node: fx.Node) -> list[str]:
    return [line for line in (node.name, _op(gm, node), _shape(meta.val(node))) if line]


def _op(gm: fx.GraphModule, node: fx.Node) -> str:
    if node.op == "call_function":
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            return f"aten.{target.__name__.split('.')[0]}" if target.namespace == "aten" else str(target)
        return getattr(target, "__name__", str(target))
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        kinds = [f"{when} {kind}" for when, kind in (("forward", getattr(module, "kind", "")),
                                                    ("backward", getattr(module, "backward_kind", ""))) if kind]
        return "\n".join([type(module).__name__, ", ".join(kinds)] if kinds else [type(module).__name__])
    if node.op == "get_attr":
        return "parameter" if isinstance(_attribute(gm, node.target), torch.nn.Parameter) else "buffer"
    if node.op == "call_method":
        return f".{node.target}()"
    return node.op  # placeholder, output


def _shape(value) -> str:
    if isinstance(value, torch.Tensor):
        shape = "x".join(map(str, value.shape)) or "scalar"
        return f"{shape} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_shape(v) for v in value) + ")"
    return "" if value is None else type(value).__name__


def _style(gm: fx.GraphModule, node: fx.Node, sends: bool) -> dict[str, str]:
    if collective(gm, node) is not None:
        return {"fillcolor": AXIS_COLOURS.get(axis_of(node), OTHER_COLLECTIVE), "penwidth": "2"}
    if node.op == "placeholder":
        return {"shape": "ellipse", "fillcolor": PIPELINE if meta.RECEIVED in node.meta else PLAIN}
    if node.op == "output":
        return {"shape": "ellipse", "fillcolor": PIPELINE if sends else PLAIN}
    if node.op == "get_attr":
        return {"fillcolor": PARAMETER, "fontsize": "8"}
    return {}


def _attribute(gm: fx.GraphModule, target: str):
    value = gm
    for part in target.split("."):
        value = getattr(value, part, None)
    return value


def _quote(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def write_build(build, folder: str | Path, *, title: str) -> list[Path]:
    """One file per program of a ``RankBuild``: ``rank{R}.dot``, or ``rank{R}_stage{S}.dot`` per pipeline stage."""
    written = []
    for index, program in sorted(build.programs.items()):
        name = f"rank{build.rank}_stage{index}" if build.stages else f"rank{build.rank}"
        sends = bool(build.stages and build.stages[index].sends)
        written.append(write_dot(program.gm, Path(folder) / f"{name}.dot",
                                 title=title + (f", stage {index}" if build.stages else ""), sends=sends))
    return written
