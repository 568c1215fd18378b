"""Experts looped one at a time over a stack become one grouped matmul.

A mixture of experts may run its experts in a Python loop over pieces of the rows sorted by expert (JetMoE's
``ParallelExperts``): the counts per expert are read back (``counts.tolist()``), the rows split by them, each piece
multiplied by its expert's matrix taken out of a stack, and the pieces concatenated again::

    sizes = [item(counts[0]), ..., item(counts[E-1])]        # data-dependent sizes, read on the host
    pieces = split_with_sizes(x, sizes)                      # rows grouped by expert
    y = cat([linear(pieces[e], select(W, 0, e)) for e in range(E)])

That is one grouped matmul, ``grouped_mm(x, W.transpose(1, 2), offsets=cumsum(counts))``: the same products of the
same rows. An expert may compute more than one product between its piece and its output (torchtitan's
``GroupedExperts`` loop: ``silu(piece @ w1[e].T) * (piece @ w3[e].T) @ w2[e].T``): where every expert computes
alike (the same ops in the same order, differing only in its piece and its matrices ``select(stack, 0, e)``), and
every op is a product by one of its matrices (``linear``, ``matmul``, ``mm``) or row-local (pointwise, a cast) on
values of its own piece, the computation runs once over all rows, each product a grouped matmul. Rewritten so,
the experts' products are nodes every pass reads the way it reads torch's ``_grouped_mm`` (tensor parallelism splits
the stack's features, expert parallelism its experts), and the graph no longer holds shapes that depend on the
routing (the host read-backs and their assertions go with the loop).

The rewrite is all or nothing per graph: where a loop's sizes are read by anything it does not replace, or the
graph cannot be run on fake tensors afterwards, the capture is left as export gave it (the loop stays, each expert
a linear of its own: correct, and its experts stay whole under ep).
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass

import torch
from torch import fx

from autoshard import meta

aten = torch.ops.aten

_READS = {aten.item.default, aten._local_scalar_dense.default}
_ASSERTS = {aten._assert_scalar.default, aten.sym_constrain_range_for_size.default, aten.sym_constrain_range.default}
_PRODUCTS = {aten.linear.default, aten.matmul.default, aten.mm.default}  # a value times an expert's matrix
_TRANSPOSING = {aten.linear.default}  # reads its matrix transposed
_ROW_LOCAL = {aten.to.dtype, aten._to_copy.default, aten.clone.default, aten.contiguous.default, aten.alias.default}
_ON_SIZES = {operator.add, operator.ge, operator.le, operator.eq, operator.lt, operator.gt, operator.and_}  # checks


@torch.library.custom_op("autoshard::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(x, w, offs=offsets)`` in any dtype and on any device: rows ``offsets[e-1]:offsets[e]``
    of ``x`` (2-D) times ``w[e]`` (``w``: experts x in x out), one product per expert."""
    out = x.new_empty(x.shape[0], w.shape[2])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        torch.mm(x[start:end], w[e].to(x.dtype), out=out[start:end])
        start = end
    if start < x.shape[0]:  # rows past the last expert's offset belong to none (as torch's op leaves them)
        out[start:].zero_()
    return out


@grouped_mm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[2])


def _backward(ctx, grad: torch.Tensor):
    x, w, offsets = ctx.saved_tensors
    grad = grad.contiguous()
    grad_w = torch.zeros_like(w)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        grad_w[e] = (x[start:end].t() @ grad[start:end]).to(w.dtype)
        start = end
    return grouped_mm(grad, w.transpose(1, 2), offsets), grad_w, None


grouped_mm.register_autograd(_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))

_LIBRARY = torch.library.Library("autoshard", "FRAGMENT")  # keeps the autocast kernels registered


def _autocast_kernel(device: str):
    """Under autocast, ``x`` and the stack are cast to autocast's dtype first, as autocast casts a linear's inputs
    (whatever dtype it runs in: bf16 or fp16), so the grouped matmul runs in the dtype the loop of linears ran in."""
    key = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, "Autocast" + torch._C._dispatch_key_for_device(device)))

    def kernel(_keys, x, w, offsets):
        dtype = torch.get_autocast_dtype(device)

        def cast(t: torch.Tensor) -> torch.Tensor:  # as autocast casts: floating, not float64, on its device
            eligible = t.is_floating_point() and t.dtype is not torch.float64 and t.device.type == device
            return t.to(dtype) if eligible else t

        with torch._C._ExcludeDispatchKeyGuard(key):
            return grouped_mm(cast(x), cast(w), offsets)

    return kernel


for _device in ("cpu", "cuda"):
    _LIBRARY.impl("grouped_mm", _autocast_kernel(_device), "Autocast" + torch._C._dispatch_key_for_device(_device),
                  with_keyset=True)


def grouped_experts_pass(gm: fx.GraphModule) -> int:
    """Rewrite every loop of experts over stacks into grouped matmuls; returns how many loops were rewritten (0: the
    graph is left untouched)."""
    if not any(_loop(node) is not None for node in gm.graph.nodes):
        return 0
    candidate = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    graph = candidate.graph
    loops = [found for node in graph.nodes if (found := _loop(node)) is not None]
    offsets: dict[fx.Node, fx.Node] = {}
    reads: set[fx.Node] = set()
    for loop in loops:
        reads.update(loop.sizes)
        if loop.counts not in offsets:
            with graph.inserting_after(loop.counts):
                offsets[loop.counts] = graph.call_function(aten.cumsum.default, (loop.counts, 0))
        with graph.inserting_before(loop.cat):
            out = _grouped(graph, loop, offsets[loop.counts])
        loop.cat.replace_all_uses_with(out)
    graph.eliminate_dead_code()
    if not _drop_reads(graph, reads):
        return 0
    try:
        _propagate(candidate)
    except Exception:  # noqa: BLE001 - a graph fake tensors cannot run is kept as export gave it
        return 0
    gm.graph = candidate.graph
    gm.recompile()
    return len(loops)


@dataclass
class _Expert:
    """One expert's computation in a loop: the nodes from its piece of the rows (``piece``) to its output (``out``),
    and the reads of its matrices (``select(stack, 0, e)``, perhaps transposed) -> (stack, transposed)."""

    piece: fx.Node
    out: fx.Node
    nodes: list[fx.Node]  # in graph order, the reads of matrices apart
    matrices: dict[fx.Node, tuple[fx.Node, bool]]


@dataclass
class _Loop:
    cat: fx.Node
    x: fx.Node  # the rows, sorted by expert, that the loop splits
    first: _Expert  # expert 0's computation, which every other expert's repeats with its own piece and matrices
    counts: fx.Node
    sizes: list[fx.Node]


def _grouped(graph: fx.Graph, loop: _Loop, offsets: fx.Node) -> fx.Node:
    """Expert 0's computation over all rows, each product with its expert's matrix one grouped matmul."""
    first = loop.first
    env: dict[fx.Node, fx.Node] = {first.piece: loop.x}
    for node in first.nodes:
        if node.target in _PRODUCTS:
            stack, transposed = first.matrices[node.args[1]]
            w = graph.call_function(aten.transpose.int, (stack, 1, 2)) if (node.target in _TRANSPOSING) != \
                transposed else stack  # grouped_mm(x, w) multiplies row by w[e]: linear's W[e].T is W.transpose(1, 2)
            new = graph.call_function(torch.ops.autoshard.grouped_mm.default, (env[node.args[0]], w, offsets))
            if w is not stack:
                w.meta.update({k: v for k, v in node.meta.items() if k in (meta.MODULE_STACK, meta.STACK_TRACE)})
        else:
            new = graph.node_copy(node, lambda n: env[n])
        new.meta.update({k: v for k, v in node.meta.items() if k in (meta.MODULE_STACK, meta.STACK_TRACE)})
        env[node] = new
    return env[first.out]


def _loop(cat: fx.Node) -> _Loop | None:
    """The loop whose outputs ``cat`` concatenates: one computation per expert of stacks, alike for every expert,
    over the pieces of one split of ``x`` by sizes read from ``counts``, in expert order; else None."""
    if cat.op != "call_function" or cat.target is not aten.cat.default or not cat.args[0]:
        return None
    if (cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)) != 0:
        return None
    outs = cat.args[0]
    if len(set(outs)) != len(outs):
        return None
    experts = [_expert(out, e, cat) for e, out in enumerate(outs)]
    if any(expert is None for expert in experts):
        return None
    splits = {expert.piece.args[0] for expert in experts}
    if len(splits) != 1 or len({_signature(expert) for expert in experts}) != 1:
        return None
    split = splits.pop()
    if split.target is not aten.split_with_sizes.default or _dim(split) != 0 or len(split.users) != len(outs):
        return None
    x, sizes = split.args[0], split.args[1]
    stacks = {stack for stack, _ in experts[0].matrices.values()}
    if len(_shape(x) or ()) != 2 or any(len(_shape(s) or ()) != 3 or _shape(s)[0] != len(outs) for s in stacks):
        return None
    counts = _counts(sizes, len(outs))
    return None if counts is None else _Loop(cat, x, experts[0], counts, list(sizes))


def _expert(out, e: int, cat: fx.Node) -> _Expert | None:
    """Expert ``e``'s computation ending at ``out``: products of values by its matrices (``linear``, ``matmul``,
    ``mm``) and row-local ops (pointwise, casts) of values computed from its piece alone, read by nothing else."""
    if not isinstance(out, fx.Node):
        return None
    nodes: set[fx.Node] = set()
    matrices: dict[fx.Node, tuple[fx.Node, bool]] = {}
    piece, todo = None, [out]
    while todo:
        node = todo.pop()
        if node in nodes or node in matrices or node is piece:
            continue
        if node.target is operator.getitem and node.args[0].target is aten.split_with_sizes.default:
            if piece is not None or node.args[1] != e:
                return None  # another expert's piece
            piece = node
        elif (read := _matrix(node, e)) is not None:
            matrices[node] = read
        elif node.op == "call_function" and (node.target in _PRODUCTS or node.target in _ROW_LOCAL
                                             or _pointwise(node)):
            nodes.add(node)
            todo += node.all_input_nodes
        else:
            return None
    if piece is None or not nodes:
        return None
    for node in nodes:
        if node.target in _PRODUCTS:
            if len(node.args) != 2 or node.kwargs or node.args[1] not in matrices or node.args[0] in matrices:
                return None
        elif any(a in matrices for a in node.all_input_nodes):
            return None
    inside = nodes | set(matrices) | {piece}
    if any(u not in inside for n in inside - {out} for u in n.users) or set(out.users) != {cat}:
        return None
    return _Expert(piece, out, [n for n in out.graph.nodes if n in nodes], matrices)


def _matrix(node: fx.Node, e: int) -> tuple[fx.Node, bool] | None:
    """``(stack, transposed)`` where ``node`` is ``select(stack, 0, e)`` of a parameter, perhaps transposed."""
    transposed = node.target is aten.t.default or (node.target is aten.transpose.int
                                                   and {d % 2 for d in node.args[1:3]} == {0, 1})
    select = node.args[0] if transposed else node
    if select.target is not aten.select.int or select.args[1:] != (0, e) or select.args[0].op != "get_attr":
        return None
    if transposed and len(select.users) != 1:
        return None
    return select.args[0], transposed


def _signature(expert: _Expert) -> tuple:
    """What an expert computes, with its own piece and matrices named by their role: alike for every expert of a loop
    whose experts differ only in their rows and matrices."""
    names: dict[fx.Node, object] = {expert.piece: "piece", **{n: ("matrix", s.target, t)
                                                             for n, (s, t) in expert.matrices.items()}}
    names.update({n: i for i, n in enumerate(expert.nodes)})

    def arg(a):
        return ("node", names[a]) if isinstance(a, fx.Node) else a

    return tuple((n.target, tuple(fx.node.map_aggregate(n.args, arg)),
                  tuple(sorted((k, fx.node.map_aggregate(v, arg)) for k, v in n.kwargs.items())))
                 for n in expert.nodes)


def _pointwise(node: fx.Node) -> bool:
    return torch.Tag.pointwise in getattr(node.target, "tags", ())


def _dim(split: fx.Node) -> int:
    return split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)


def _counts(sizes, experts: int) -> fx.Node | None:
    """The 1-D integer tensor whose entries, read back one by one, are ``sizes``; None otherwise."""
    if not isinstance(sizes, (list, tuple)) or len(sizes) != experts:
        return None
    found = set()
    for e, size in enumerate(sizes):
        if not (isinstance(size, fx.Node) and size.target in _READS):
            return None
        entry = size.args[0]
        if entry.target is operator.getitem and entry.args[0].target is aten.unbind.int and entry.args[1] == e \
                and (entry.args[0].args[1:] or (0,))[0] == 0:
            found.add(entry.args[0].args[0])
        elif entry.target is aten.select.int and entry.args[1] == 0 and entry.args[2] == e:
            found.add(entry.args[0])
        else:
            return None
    if len(found) != 1:
        return None
    counts = found.pop()
    val = meta.val(counts)
    ok = isinstance(val, torch.Tensor) and val.dim() == 1 and val.shape[0] == experts and not val.is_floating_point()
    return counts if ok else None


def _drop_reads(graph: fx.Graph, reads: set[fx.Node]) -> bool:
    """Erase the read-backs of the sizes and the assertions on them; False where anything else still reads one."""
    doomed: set[fx.Node] = set()
    todo = list(reads)
    while todo:
        node = todo.pop()
        if node in doomed:
            continue
        doomed.add(node)
        for user in node.users:
            if user.target not in _ASSERTS and user.target not in _ON_SIZES:
                return False
            todo.append(user)
    for node in reversed(list(graph.nodes)):
        if node in doomed:
            graph.erase_node(node)
    graph.eliminate_dead_code()
    return True


def _propagate(gm: fx.GraphModule) -> None:
    """Every node's fake value again, now that no shape depends on the routing."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    inputs = [mode.from_tensor(meta.val(n)) if isinstance(meta.val(n), torch.Tensor) else meta.val(n)
              for n in gm.graph.nodes if n.op == "placeholder"]
    FakeTensorProp(gm, mode).propagate(*inputs)


def _shape(node) -> tuple | None:
    val = meta.val(node) if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None
