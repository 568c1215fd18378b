"""Experts looped one at a time over a stack become one grouped matmul.

A mixture of experts may run its experts in a Python loop over pieces of the rows sorted by expert (JetMoE's
``ParallelExperts``): the counts per expert are read back (``counts.tolist()``), the rows split by them, each piece
multiplied by its expert's matrix taken out of a stack, and the pieces concatenated again::

    sizes = [item(counts[0]), ..., item(counts[E-1])]        # data-dependent sizes, read on the host
    pieces = split_with_sizes(x, sizes)                      # rows grouped by expert
    y = cat([linear(pieces[e], select(W, 0, e)) for e in range(E)])

That is one grouped matmul, ``grouped_mm(x, W.transpose(1, 2), offsets=cumsum(counts))``: the same products of the
same rows. Rewritten so, the experts are one node every pass reads the way it reads torch's ``_grouped_mm``
(tensor parallelism splits the stack's features, expert parallelism its experts), and the graph no longer holds
shapes that depend on the routing (the host read-backs and their assertions go with the loop).

The rewrite is all or nothing per graph: where a loop's sizes are read by anything it does not replace, or the
graph cannot be run on fake tensors afterwards, the capture is left as export gave it (the loop stays, each expert
a linear of its own: correct, and its experts stay whole under ep).
"""

from __future__ import annotations

import copy
import operator

import torch
from torch import fx

from autoshard import meta

aten = torch.ops.aten

_READS = {aten.item.default, aten._local_scalar_dense.default}
_ASSERTS = {aten._assert_scalar.default, aten.sym_constrain_range_for_size.default, aten.sym_constrain_range.default}
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
    """Rewrite every loop of experts over a stack into a grouped matmul; returns how many were rewritten (0: the
    graph is left untouched)."""
    loops = [found for node in gm.graph.nodes if (found := _loop(node)) is not None]
    if not loops:
        return 0
    candidate = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    graph = candidate.graph
    twin = {a.name: b for a, b in zip(gm.graph.nodes, graph.nodes, strict=True)}
    offsets: dict[fx.Node, fx.Node] = {}
    reads: set[fx.Node] = set()
    for cat, x, stack, counts, sizes in loops:
        cat, x, stack, counts = twin[cat.name], twin[x.name], twin[stack.name], twin[counts.name]
        reads.update(twin[s.name] for s in sizes)
        if counts not in offsets:
            with graph.inserting_after(counts):
                offsets[counts] = graph.call_function(aten.cumsum.default, (counts, 0))
        with graph.inserting_before(cat):
            w = graph.call_function(aten.transpose.int, (stack, 1, 2))
            out = graph.call_function(torch.ops.autoshard.grouped_mm.default, (x, w, offsets[counts]))
        for new in (w, out):
            new.meta.update({k: v for k, v in cat.meta.items() if k in (meta.MODULE_STACK, meta.STACK_TRACE)})
        cat.replace_all_uses_with(out)
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


def _loop(cat: fx.Node):
    """``(cat, x, stack, counts, sizes)`` when ``cat`` concatenates one linear per expert of a stack over the pieces
    of one split of ``x`` by sizes read from ``counts``, in expert order; else None."""
    if cat.op != "call_function" or cat.target is not aten.cat.default or not cat.args[0]:
        return None
    if (cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)) != 0:
        return None
    pieces, weights = [], []
    for e, lin in enumerate(cat.args[0]):
        if not (isinstance(lin, fx.Node) and lin.target is aten.linear.default and len(lin.args) == 2
                and not lin.kwargs and len(lin.users) == 1):
            return None
        piece, weight = lin.args
        if not (piece.target is operator.getitem and piece.args[1] == e and len(piece.users) == 1):
            return None
        if not (weight.target is aten.select.int and weight.args[1] == 0 and weight.args[2] == e):
            return None
        pieces.append(piece.args[0])
        weights.append(weight.args[0])
    split, stack = pieces[0], weights[0]
    experts = len(pieces)
    if any(p is not split for p in pieces) or any(w is not stack for w in weights):
        return None
    if split.target is not aten.split_with_sizes.default or _dim(split) != 0 or len(split.users) != experts:
        return None
    x, sizes = split.args[0], split.args[1]
    shape = _shape(stack)
    if shape is None or len(shape) != 3 or shape[0] != experts or len(_shape(x) or ()) != 2:
        return None
    counts = _counts(sizes, experts)
    return None if counts is None else (cat, x, stack, counts, list(sizes))


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
