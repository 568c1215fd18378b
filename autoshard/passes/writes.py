"""In-place writes: which nodes change a value after it is computed, so that nothing that prunes a graph loses them.

A model that builds a mask, a cache or a position table by writing into it (``mask = torch.full((T, T), -inf)``,
then ``mask[i, lo:hi] = 0`` row by row; ``x.masked_fill_(...)``; ``labels[:, :-1] = ids[:, 1:]``) is captured as
the value's op followed by ops that write into it or into a view of it (``fill_`` of a ``slice`` of a ``select``,
``copy_``, ``index_put_``). Those writers have no users of their own: a walk from what a graph returns back through
inputs never meets them, and a pass that keeps "what the output needs" that way keeps the ``full(-inf)`` and drops
every write into it (all-masked rows, NaN). So every such walk asks here for the writers of what it keeps.

Terms: an *alias* of a value is the value, the value it views (its *base*, up the chain of views), and every view of
that base (down the chain, including the results of in-place ops, which alias what they write). A *writer* is a node
whose schema writes (``Tensor(a!)``) into one of its arguments, here into an alias.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import fx

aten = torch.ops.aten


def _returns_alias(node: fx.Node) -> bool:
    """Whether ``node`` returns an alias of its first argument: a view, or an in-place op's result."""
    schema = getattr(node.target, "_schema", None)
    returns = schema.returns if schema is not None else []
    return (node.op == "call_function" and bool(returns) and returns[0].alias_info is not None
            and bool(node.args) and isinstance(node.args[0], fx.Node))


def written_arguments(node: fx.Node) -> list[fx.Node]:
    """The arguments ``node`` writes into in place (``Tensor(a!)`` in its schema, and the running statistics of
    ``aten.batch_norm`` in training, whose schema does not say it updates them; a module's by its ``writes``, the
    positions of the arguments it updates)."""
    if node.op == "call_module":
        positions = getattr(node.graph.owning_module.get_submodule(node.target), "writes", ())
        return [node.args[i] for i in positions if i < len(node.args) and isinstance(node.args[i], fx.Node)]
    schema = getattr(node.target, "_schema", None)
    if node.target is aten.batch_norm.default:
        training = node.args[5] if len(node.args) > 5 else node.kwargs.get("training", False)
        return [a for a in node.args[3:5] if isinstance(a, fx.Node)] if training else []
    if node.op != "call_function" or schema is None or not schema.is_mutable:
        return []
    found = []
    for position, argument in enumerate(schema.arguments):
        value = node.args[position] if position < len(node.args) else node.kwargs.get(argument.name)
        if argument.alias_info is not None and argument.alias_info.is_write and isinstance(value, fx.Node):
            found.append(value)
    return found


def written_targets(gm: fx.GraphModule) -> list[str]:
    """The attributes of ``gm`` (buffers: BatchNorm's running statistics, a step counter) that running it updates in
    place, each once, by their ``get_attr`` target."""
    return list(dict.fromkeys(base.target for node in gm.graph.nodes
                              for base in map(base_of, written_arguments(node)) if base.op == "get_attr"))


def written_state(gm: fx.GraphModule) -> list[torch.Tensor]:
    """The tensors of ``written_targets(gm)``."""
    found = []
    for target in written_targets(gm):
        owner, _, name = target.rpartition(".")
        found.append(getattr(gm.get_submodule(owner) if owner else gm, name))
    return found


def base_of(value: fx.Node) -> fx.Node:
    """The value ``value`` views (itself when it views nothing)."""
    while _returns_alias(value):
        value = value.args[0]
    return value


def aliases(value: fx.Node) -> set[fx.Node]:
    """Every node sharing ``value``'s memory: its base and the base's views, transitively."""
    found: set[fx.Node] = set()
    todo = [base_of(value)]
    while todo:
        node = todo.pop()
        if node in found:
            continue
        found.add(node)
        todo.extend(user for user in node.users if _returns_alias(user) and user.args[0] is node)
    return found


def writers(value: fx.Node) -> list[fx.Node]:
    """The nodes that write in place into ``value`` or into anything sharing its memory, in graph order."""
    shared = aliases(value)
    found = {user for node in shared for user in node.users if any(w in shared for w in written_arguments(user))}
    return [node for node in value.graph.nodes if node in found] if found else []


def closure(roots: Iterable[fx.Node], inputs: Callable[[fx.Node], Iterable[fx.Node]] | None = None,
            admit: Callable[[fx.Node], bool] | None = None) -> set[fx.Node]:
    """``roots``, what they are computed from, and every write into any of those, with what the writes read.

    ``inputs(node)`` gives the sources to follow (by default all of the node's inputs); a caller that stops at some
    sources (a pipeline stage at another stage's activations) filters them there, and ``admit(writer)`` the writers
    (by default all). Writers are found for every node reached, so a write into a view of a view of a kept value is
    kept too."""
    follow = inputs or (lambda node: node.all_input_nodes)
    found: set[fx.Node] = set()
    todo = list(roots)
    while todo:
        node = todo.pop()
        if node in found:
            continue
        found.add(node)
        todo.extend(follow(node))
        if node.op in ("call_function", "placeholder", "get_attr"):
            todo.extend(w for w in writers(node) if admit is None or admit(w))
    return found


def lost_writes(original: fx.GraphModule, program: fx.GraphModule) -> list[str]:
    """The writes of ``original`` that ``program`` (a rank's program made from it) lost: for each value the
    program keeps (a node of the same name), every write into it in ``original`` that comes before a read the
    program keeps must be in the program too, by name and op. A write after the program's last read of the value
    is another program's (a pipeline stage that sends the value before the write, the next one writing into what it
    receives; whether some program keeps it is the caller's check, see ``dropped_writes``). One line per lost
    write; empty when every kept value keeps its writers."""
    kept = {node.name: node for node in program.graph.nodes}
    order = {node.name: i for i, node in enumerate(original.graph.nodes)}
    lost = []
    for node in original.graph.nodes:
        for value in written_arguments(node):
            base = base_of(value)
            if base.name not in kept or base.op == "placeholder":
                continue  # a value this program does not compute (or an input, written where it is computed)
            copy = kept.get(node.name)
            if copy is not None and copy.target is node.target:
                continue
            reads = [user for alias in aliases(base) for user in alias.users
                     if user.name in kept and user.op != "output" and user is not node]
            if any(order[user.name] > order[node.name] for user in reads):
                lost.append(f"{node.name} ({node.target}) writes into {base.name}, which the program keeps")
    return lost


def dropped_writes(original: fx.GraphModule, programs: Iterable[fx.GraphModule]) -> list[str]:
    """The writes of ``original`` into values some of ``programs`` (the stages of one pipeline) keep that none of
    them runs."""
    programs = list(programs)
    names = {node.name: node.target for program in programs for node in program.graph.nodes}
    dropped = []
    for node in original.graph.nodes:
        for value in written_arguments(node):
            base = base_of(value)
            if base.name in names and base.op != "placeholder" and names.get(node.name) is not node.target:
                dropped.append(f"{node.name} ({node.target}) writes into {base.name}, which no program runs")
    return dropped
