"""Local rewrites: once placements are final, make every node compute what one rank holds.

Export bakes global sizes into ``view``/``reshape``/``expand``/``split`` arguments; these are rewritten
to the local sizes (computed from the recorded global shape and the output placement, so it works
whatever the model wrote: constants, ``-1`` or sizes computed in the graph). A row-parallel linear
becomes a local matmul, an all-reduce, and its bias added once after the sum; a vocab-parallel
embedding and cross-entropy become their parallel modules. The ``Rewriter`` inserts collective
modules as ``call_module`` nodes, one per (value, kind), so every consumer shares it, and records the
mesh axis they run on as data (``meta.AXIS`` on the node, ``axis`` on the module); their names
(``tp_reducefromparallel_3``) are for reading the generated code only.

The localizers of ``rules.LOCALIZERS`` serve every axis. An axis that rewrites an op its own way (context
parallelism's attention, which needs its token layout) gives the ``Rewriter`` its own ``localizers``,
consulted first; no axis changes the shared table.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping

import torch
from torch import fx

from autoshard import meta
from autoshard.passes.collectives import (
    CopyToParallel,
    ReadWhole,
    ReduceFromParallel,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
)
from autoshard.passes.placements import Partial, R, Shard, local_shape
from autoshard.passes.propagate import Propagation
from autoshard.passes.rules import LOCALIZERS, arg, is_table_lookup, localizer
from autoshard.passes.rules_conv import CONVOLUTIONS, channel_dims, is_patch_conv
from autoshard.passes.rules_nn import grouped_kv_heads

aten = torch.ops.aten
_REDUCTIONS = ("none", "mean", "sum")


Localizer = Callable[[fx.Node, "Rewriter"], None]


class Rewriter:
    """Graph edits for one rank of the axis ``prop`` placed values on: placements to read, collectives to insert,
    nodes replaced so far. The axis's own localizers (op -> function) are consulted before the shared table."""

    def __init__(self, gm: fx.GraphModule, prop: Propagation, *, rank: int, group, grad: set) -> None:
        self.gm = gm
        # the shape this rank holds of (global shape, placement), when ranks hold unequal parts (cp's uneven split)
        self.uneven_local = prop.axis.uneven_local
        self.axis = prop.axis.name
        self.localizers: Mapping[object, Localizer] = dict(prop.axis.localizers)
        self.grad = grad
        self.prop = prop
        self.size = prop.axis.size
        self.rank = rank
        self.group = group
        self._cache: dict[tuple[fx.Node, str], fx.Node] = {}
        self._replaced: dict[fx.Node, fx.Node] = {}
        self._original: dict[fx.Node, fx.Node] = {}
        self._count = 0

    @property
    def collective_args(self) -> dict:
        return {"group": self.group, "size": self.size, "rank": self.rank}

    def placement(self, node):
        return self.prop.placements.get(node, self.prop.placements.get(self._original.get(node), R))

    def local_shape(self, node: fx.Node) -> tuple[int, ...]:
        return self.shape_of(tuple(meta.val(node).shape), self.placement(node))

    def shape_of(self, shape: tuple[int, ...], placement) -> tuple[int, ...]:
        """The shape this rank holds of a value of global ``shape`` under ``placement``."""
        if self.uneven_local is not None:
            return self.uneven_local(shape, placement)
        return local_shape(shape, placement, self.size)

    def even_parts(self, what: str) -> None:
        """Refuse, naming ``what``, a rewrite that assumes every rank holds an equal part."""
        if self.uneven_local is not None:
            raise ValueError(f"{what} along a dim the {self.axis} ranks hold unequal parts of is not supported: use "
                             f"a size the {self.axis} degree divides")

    def original(self, node: fx.Node) -> fx.Node:
        """The node of the propagated graph that ``node`` stands for (itself, unless it replaced one)."""
        return self._original.get(node, node)

    def current(self, node: fx.Node) -> fx.Node:
        while node in self._replaced:
            node = self._replaced[node]
        return node

    def cached(self, value: fx.Node, kind: str, make: Callable[[dict], torch.nn.Module], before: fx.Node) -> fx.Node:
        """One collective node per (value, kind), inserted before its first consumer."""
        value = self.current(value)
        key = (value, kind)
        if key not in self._cache:
            self._cache[key] = self.module(make(self.collective_args), (value,), before=before, like=value)
        return self._cache[key]

    def module(self, module: torch.nn.Module, args: tuple, *, before: fx.Node, like: fx.Node) -> fx.Node:
        while True:  # unique: a graph sharded on two axes holds the collectives of both
            name = f"{self.axis}_{type(module).__name__.lower()}_{self._count}"
            self._count += 1
            if not hasattr(self.gm, name):
                break
        module.axis = self.axis  # for code that holds only the module
        self.gm.add_submodule(name, module)
        with self.gm.graph.inserting_before(before):
            node = self.gm.graph.call_module(name, args)
        node.meta.update(meta.standing_for(like))
        node.meta[meta.AXIS] = self.axis
        return node

    def replace(self, old: fx.Node, new: fx.Node) -> None:
        self.follow(old, new)
        self.gm.graph.erase_node(old)

    def follow(self, old: fx.Node, new: fx.Node) -> None:
        """Every reader of ``old`` reads ``new`` instead, also those whose collectives are inserted later (the graph's
        output gathered); ``new`` may read ``old`` (an op whose output is exchanged after it)."""
        old.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
        self._replaced[old] = new
        self._original[new] = self._original.get(old, old)
        if old in self.grad:
            self.grad.add(new)


def localize(node: fx.Node, rw: Rewriter) -> None:
    """Rewrite ``node`` to what one rank computes: by the axis's own localizer for its op, else the shared one."""
    fn = _lookup(rw.localizers, node.target) or _lookup(LOCALIZERS, node.target)
    if fn is not None:
        fn(node, rw)


def _lookup(table: Mapping[object, Localizer], target) -> Localizer | None:
    fn = table.get(target)
    if fn is None and hasattr(target, "overloadpacket"):
        fn = table.get(target.overloadpacket)
    return fn


@localizer(aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default)
def _sizes(node: fx.Node, rw: Rewriter) -> None:
    if isinstance(rw.placement(node), Shard):
        node.args = (node.args[0], list(rw.local_shape(node)), *node.args[2:])


@localizer(aten.reshape_as.default, aten.view_as.default)
def _reshape_as(node: fx.Node, rw: Rewriter) -> None:
    """A reshape to the local shape: the tensor that lent its shape may be split another way (or not at all)."""
    node.target, node.args, node.kwargs = aten.reshape.default, (node.args[0], list(rw.local_shape(node))), {}


@localizer(aten.unflatten.int, aten.flatten.using_ints)
def _unflatten(node: fx.Node, rw: Rewriter) -> None:
    """Dims unflattened or flattened (a packed q/k/v projection into (3, width), RoPE's pairs back into features):
    as a reshape to the local shape."""
    if isinstance(rw.placement(node), Shard):
        node.target = aten.reshape.default
        node.args = (node.args[0], list(rw.local_shape(node)))
        node.kwargs = {}


@localizer(aten.mean.dim)
def _pending_mean(node: fx.Node, rw: Rewriter) -> None:
    """A mean over the split dim left pending: this rank's summand is its sum divided by the whole count (the node
    becomes that division, so every consumer and every record of it stays as it is)."""
    if not isinstance(rw.placement(node), Partial):
        return
    source = meta.val(rw.original(node.args[0])).shape
    dims = arg(node, "dim")
    dims = [dims] if isinstance(dims, int) else list(dims or range(len(source)))
    count = math.prod(source[d % len(source)] for d in dims)
    with rw.gm.graph.inserting_before(node):
        total = rw.gm.graph.call_function(aten.sum.dim_IntList, node.args, node.kwargs)
    total.meta.update(node.meta)
    node.target, node.args, node.kwargs = aten.div.Tensor, (total, count), {}


@localizer(aten.split.Tensor, aten.split_with_sizes.default, aten.tensor_split.indices)
def _split(node: fx.Node, rw: Rewriter) -> None:
    """Pieces along the split dim (whole blocks of it, as the rule kept them split): their sizes, or the indices
    they start at, over this rank's part. ``tensor_split`` into a number of sections needs nothing: equal whole
    blocks stay equal."""
    source = rw.placement(node.args[0])
    if not isinstance(source, Shard):
        return
    ndim = len(meta.val(node.args[0]).shape)
    if arg(node, "dim") % ndim != source.dim:
        return
    rw.even_parts(f"{node.target}")
    sizes = node.args[1]
    if source.whole:  # pieces of whole blocks, some held whole: each piece's size here
        sizes = [int(t.shape[source.dim]) for t in meta.global_val(node)]
        edges = [_local_edge(source, e, rw.size) for e in itertools.accumulate(sizes, initial=0)]
        local = [b - a for a, b in itertools.pairwise(edges)]
        node.target, node.args = aten.split_with_sizes.default, (node.args[0], local, *node.args[2:])
        return
    local = [s // rw.size for s in sizes] if isinstance(sizes, (list, tuple)) else sizes // rw.size
    node.args = (node.args[0], local, *node.args[2:])


def _local_edge(source: Shard, edge: int, size: int) -> int:
    """Where the block edge ``edge`` (a global index along the split dim) lies in this rank's part."""
    local = start = 0
    for i, block in enumerate(source.blocks):
        if start == edge:
            return local
        local += block if i in source.whole else block // size
        start += block
    if start == edge:
        return local
    raise ValueError(f"{edge} is not an edge of the blocks {source.blocks}")


@localizer(aten.slice.Tensor)
def _slice(node: fx.Node, rw: Rewriter) -> None:
    """Whole blocks of a blocked shard (one of a fused projection's parts): the same blocks of this rank's part."""
    from autoshard.passes.rules import slice_bounds

    source = rw.placement(node.args[0])
    shape = meta.val(rw.original(node.args[0])).shape
    held = isinstance(rw.placement(node), Shard) or isinstance(source, Shard) and bool(source.whole)
    if (not isinstance(source, Shard) or not held
            or arg(node, "dim") % len(shape) != source.dim or slice_bounds(node, shape[source.dim]) is None):
        return
    start, end = slice_bounds(node, shape[source.dim])
    if source.whole:  # blocks of a split holding some whole (k of a fused q, k, v): where they lie here
        edges = (_local_edge(source, start, rw.size), _local_edge(source, end, rw.size))
        node.args, node.kwargs = (node.args[0], source.dim, *edges, 1), {}
        return
    if source.blocks is None:  # the whole dim (x[:, -n:] of a dim of n): the whole local part, not its last n
        node.args, node.kwargs = (node.args[0], source.dim, 0, None, 1), {}
        return
    rw.even_parts("a slice of whole blocks")
    node.args = (node.args[0], source.dim, start // rw.size, end // rw.size, 1)
    node.kwargs = {}


@localizer(*CONVOLUTIONS)
def _conv(node: fx.Node, rw: Rewriter) -> None:
    """A convolution over what this rank holds: a patch embedding's kernel rows, a row's input channels (summed,
    then the bias), or whole groups (one group count per rank). A column and a split of the samples run as they
    are."""
    w, out = arg(node, "weight"), rw.placement(node)
    if rw.placement(w) == Shard(2) and is_patch_conv(node):
        _row_patch_conv(node, rw)
    elif isinstance(out, Shard) and out.dim == 1 and arg(node, "groups") > 1:
        _set_arg(node, "groups", arg(node, "groups") // rw.size)
    elif arg(node, "groups") == 1 and rw.placement(w) == Shard(channel_dims(node)[1]) and out == R:
        _row_conv(node, rw)


@localizer(aten.group_norm.default)
def _group_norm(node: fx.Node, rw: Rewriter) -> None:
    """GroupNorm over this rank's channels: its whole groups."""
    if rw.placement(node) == Shard(1):
        _set_arg(node, "num_groups", arg(node, "num_groups") // rw.size)


def _set_arg(node: fx.Node, name: str, value) -> None:
    """Argument ``name`` of ``node`` set to ``value``, by position (the schema's defaults filled up to it) or by
    keyword, as the node passes it."""
    if name in node.kwargs:
        node.kwargs = {**node.kwargs, name: value}
        return
    schema = node.target._schema.arguments
    at = next(i for i, a in enumerate(schema) if a.name == name)
    args = list(node.args) + [arg(node, a.name) for a in schema[len(node.args):at + 1]]
    args[at] = value
    node.args = tuple(args)


def _row_conv(node: fx.Node, rw: Rewriter) -> None:
    """This rank's input channels convolved with its slice of the filters, a partial sum: all-reduced, then the
    bias added once (cast to the sum's dtype, as the one convolution would have it under autocast)."""
    b = arg(node, "bias")
    graph = node.graph
    with graph.inserting_before(node):
        partial = graph.call_function(node.target, node.args, node.kwargs)
    partial.meta.update(node.meta)
    _set_arg(partial, "bias", None)
    out = rw.module(ReduceFromParallel(**rw.collective_args), (partial,), before=node, like=node)
    if b is not None:
        with graph.inserting_before(node):
            cast = graph.call_function(aten.type_as.default, (b, out))
            bias = graph.call_function(aten.view.default, (cast, [-1] + [1] * (meta.val(node).dim() - 2)))
            out = graph.call_function(aten.add.Tensor, (out, bias))
        for new in (cast, bias, out):
            new.meta.update(node.meta)
    rw.replace(node, out)


def _row_patch_conv(node: fx.Node, rw: Rewriter) -> None:
    """A patch embedding with this rank's rows of the kernel: the rows of every patch they read taken from the
    image ((H / kh) patches of kh rows, this rank's kh / t of each), convolved with the patch's stride, the partial
    products all-reduced, then the bias added once."""
    x, w, b = arg(node, "input"), arg(node, "weight"), arg(node, "bias")
    rw.even_parts("a patch embedding's kernel rows")
    _, channels, height, width = meta.val(x).shape
    kernel, kw = meta.val(w).shape[2:]
    rows = kernel // rw.size
    graph = node.graph

    def add(op, args) -> fx.Node:
        with graph.inserting_before(node):
            new = graph.call_function(op, args)
        new.meta.update(node.meta)
        return new

    if x in rw.grad:  # Megatron's f: each rank's gradient covers its rows of the image; summed
        x = rw.cached(x, "f", lambda args: CopyToParallel(**args), before=node)
    patches = add(aten.view.default, (x, [-1, channels, height // kernel, kernel, width]))
    mine = add(aten.slice.Tensor, (patches, 3, rw.rank * rows, (rw.rank + 1) * rows))
    image = add(aten.reshape.default, (mine, [-1, channels, height // kernel * rows, width]))
    partial = add(aten.conv2d.default, (image, w, None, [rows, kw]))
    out = rw.module(ReduceFromParallel(**rw.collective_args), (partial,), before=node, like=node)
    if b is not None:
        bias = add(aten.view.default, (add(aten.type_as.default, (b, out)), [-1, 1, 1]))
        out = add(aten.add.Tensor, (out, bias))
    rw.replace(node, out)


@localizer(aten.repeat_interleave.self_int)
def _repeat_interleave(node: fx.Node, rw: Rewriter) -> None:
    placement = rw.placement(node)
    if isinstance(placement, Shard) and node.kwargs.get("output_size") is not None:
        node.kwargs = {**node.kwargs, "output_size": rw.local_shape(node)[placement.dim]}


def grouped_query_attention(node: fx.Node, rw: Rewriter) -> None:
    """tp's localizer of attention: ``enable_gqa=True`` over this rank's query heads, k and v whole (fewer kv heads
    than ranks; see the rule): k and v become the kv heads those queries read. Their gradient, this rank's heads
    only, is summed over the ranks by the f before them."""
    q = node.args[0]
    heads = meta.global_val(q).dim() - 3
    if not arg(node, "enable_gqa") or rw.placement(node) != Shard(heads):
        return
    args = list(node.args)
    for i in (1, 2):
        t, val = args[i], meta.global_val(args[i])  # k and v are whole on tp: the held value is the whole
        if val.shape[heads] % rw.size == 0:  # split: this rank's 1/t of the kv heads, those its query heads read
            continue
        start, stop = grouped_kv_heads(meta.global_val(node).shape[heads], val.shape[heads], rw.size, rw.rank)
        with node.graph.inserting_before(node):
            args[i] = node.graph.call_function(aten.slice.Tensor, (t, heads, start, stop))
        args[i].meta.update(meta.standing_for(t))  # the whole k or v, and (below) the heads this rank reads of it
        shape = (*val.shape[:heads], stop - start, *val.shape[heads + 1:])
        args[i].meta[meta.LOCAL] = torch.empty(shape, dtype=val.dtype, device="meta")
    node.args = tuple(args)


@localizer(aten.linear.default, aten.addmm.default)
def _linear(node: fx.Node, rw: Rewriter) -> None:
    placement = rw.placement(arg(node, "weight" if node.target is aten.linear.default else "mat2"))
    if isinstance(placement, Shard) and placement.whole:
        _column_with_whole_blocks(node, rw, placement)
    else:
        _row_linear(node, rw)


def _column_with_whole_blocks(node: fx.Node, rw: Rewriter, placement: Shard) -> None:
    """A fused column holding some blocks whole (k and v, kv heads the degree does not divide): their outputs are
    whole on every rank, and so are their gradients, which must not be summed over the ranks as the split blocks'
    are. So the split blocks read the input through Megatron's f, the whole ones through ``ReadWhole`` (no sum):
    one linear per run of blocks of one kind, joined in block order."""
    x, w, b = node.args[0], node.args[1], arg(node, "bias")
    f = x if x.op == "call_module" and isinstance(rw.gm.get_submodule(x.target), CopyToParallel) else None
    if f is None:  # no gradient is summed into the input: the one linear is right
        return
    raw = rw.cached(f.args[0], "whole", lambda args: ReadWhole(**args), before=node)
    graph, runs, start = node.graph, [], 0
    for i, block in enumerate(placement.blocks):
        kept = i in placement.whole
        part = block if kept else block // rw.size
        if runs and runs[-1][0] == kept:
            runs[-1][2] += part
        else:
            runs.append([kept, start, part])
        start += part
    last = meta.val(node).dim() - 1

    def add(op, args, shape) -> fx.Node:
        with graph.inserting_before(node):
            new = graph.call_function(op, args)
        new.meta.update(node.meta)
        new.meta[meta.VAL] = new.meta[meta.LOCAL] = torch.empty(shape, dtype=meta.val(node).dtype, device="meta")
        return new

    outs = []
    for kept, begin, width in runs:
        rows = add(aten.slice.Tensor, (w, 0, begin, begin + width), (width, meta.val(w).shape[1]))
        bias = None if b is None else add(aten.slice.Tensor, (b, 0, begin, begin + width), (width,))
        shape = (*meta.val(node).shape[:last], width)
        outs.append(add(aten.linear.default, (raw if kept else f, rows, bias), shape))
    rw.replace(node, add(aten.cat.default, (outs, last), (*meta.val(node).shape[:last], start)))


def _row_linear(node: fx.Node, rw: Rewriter) -> None:
    """alpha * x @ W_local is a partial sum: all-reduce it, then add beta * bias once.

    The bias is cast to the partial's dtype, as the one linear would have: under autocast the sum is
    in the autocast dtype, and a float32 bias must not promote it.
    """
    linear = node.target is aten.linear.default
    x, w, b = (arg(node, n) for n in (("input", "weight", "bias") if linear else ("mat1", "mat2", "self")))
    alpha, beta = (1, 1) if linear else (arg(node, "alpha"), arg(node, "beta"))
    placement = rw.placement(w)
    if not isinstance(placement, Shard) or placement.dim == (0 if linear else 1):
        return
    graph = node.graph

    def add(op, args, kwargs=None) -> fx.Node:
        with graph.inserting_before(node):
            new = graph.call_function(op, args, kwargs or {})
        new.meta.update(node.meta)
        return new

    partial = add(aten.linear.default if linear else aten.mm.default, (x, w))
    if alpha != 1:
        partial = add(aten.mul.Tensor, (partial, alpha))
    if isinstance(rw.placement(node), Partial):  # left pending: summed where a reader needs it whole
        rw.replace(node, partial)
        return
    out = rw.module(ReduceFromParallel(**rw.collective_args), (partial,), before=node, like=node)
    if b is not None:
        out = add(aten.add.Tensor, (out, add(aten.type_as.default, (b, out))), {"alpha": beta} if beta != 1 else {})
    rw.replace(node, out)


@localizer(aten.embedding.default, aten.index.Tensor)
def _vocab_embedding(node: fx.Node, rw: Rewriter) -> None:
    """The vocab-parallel lookup, carrying ``padding_idx`` (the rule refuses the arguments it cannot carry); also of
    ``table[ids]``, the same lookup without a padding row."""
    if node.target is aten.index.Tensor:
        if not is_table_lookup(node):
            return
        w, ids, pad = node.args[0], node.args[1][0], -1
    else:
        w, ids, pad = arg(node, "weight"), arg(node, "indices"), arg(node, "padding_idx")
    if rw.placement(w) != Shard(0):
        return
    if node.target is aten.embedding.default:
        assert not arg(node, "scale_grad_by_freq") and not arg(node, "sparse"), "the embedding rule refuses these"
    vocab = meta.val(w).shape[0]
    start, end = _vocab_range(vocab, rw)
    module = VocabParallelEmbedding(vocab_start=start, vocab_end=end, num_embeddings=vocab,
                                    padding_idx=None if pad == -1 else pad, **rw.collective_args)
    lookup = rw.module(module, (ids, w), before=node, like=node)
    rw.replace(node, rw.module(ReduceFromParallel(**rw.collective_args), (lookup,), before=node, like=node))


@localizer(aten.cross_entropy_loss.default)
def _vocab_cross_entropy(node: fx.Node, rw: Rewriter) -> None:
    """The vocab-parallel loss, carrying reduction, ignore_index and label_smoothing (the rule refuses the rest)."""
    logits, target = arg(node, "self"), arg(node, "target")
    if rw.placement(logits) != Shard(1):
        return
    assert arg(node, "weight") is None, "the cross-entropy rule refuses class weights"
    vocab = meta.val(logits).shape[1]
    start, end = _vocab_range(vocab, rw)
    module = VocabParallelCrossEntropy(
        vocab_start=start, vocab_end=end, vocab_size=vocab, ignore_index=arg(node, "ignore_index"),
        reduction=_REDUCTIONS[arg(node, "reduction")], label_smoothing=arg(node, "label_smoothing"),
        **rw.collective_args,
    )
    if meta.val(logits).dim() > 2:  # (N, C, d1, ...): the module takes the classes last
        with node.graph.inserting_before(node):
            logits = node.graph.call_function(aten.movedim.int, (logits, 1, -1))
        logits.meta.update({k: v for k, v in node.meta.items() if k not in meta.SHAPES})
        for key in meta.SHAPES:
            if key in logits.args[0].meta:
                val = logits.args[0].meta[key]
                logits.meta[key] = torch.empty(val.movedim(1, -1).shape, dtype=val.dtype, device="meta")
    rw.replace(node, rw.module(module, (logits, target), before=node, like=node))


def _vocab_range(vocab: int, rw: Rewriter) -> tuple[int, int]:
    per_rank = -(-vocab // rw.size)  # padded up when the degree does not divide the vocabulary
    return rw.rank * per_rank, (rw.rank + 1) * per_rank


class DropoutOfPart(torch.nn.Module):
    """Dropout of this rank's part of a value split evenly over the ranks along ``dim``.

    The mask of the whole value is drawn from the random stream every rank of the axis shares, and each rank keeps
    its part: ranks draw masks of their own for their own tokens or features (Megatron's per-rank stream), the
    shared stream stays in step on every rank for the dropout of replicated values, and the masks are the ones the
    model run whole draws with the same seed (on CPU bit for bit: ``aten.dropout``'s own noise, scaled alike).
    """

    def __init__(self, p: float, *, dim: int, size: int, rank: int) -> None:
        super().__init__()
        self.p, self.dim, self.size, self.rank = p, dim, size, rank

    def extra_repr(self) -> str:
        return f"p={self.p}, dim={self.dim}, size={self.size}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = list(x.shape)
        part = shape[self.dim]
        shape[self.dim] = part * self.size
        if self.p >= 1:
            return x * torch.zeros((), dtype=x.dtype, device=x.device)
        if x.device.type == "cpu":  # aten.dropout off the fused kernels: noise drawn, divided, multiplied
            noise = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(1 - self.p).div_(1 - self.p)
            return x * noise.narrow(self.dim, self.rank * part, part)
        _, mask = aten.native_dropout.default(torch.empty(shape, dtype=x.dtype, device=x.device), self.p, True)
        return x * mask.narrow(self.dim, self.rank * part, part) * (1.0 / (1 - self.p))


def dropout_of_part(node: fx.Node, rw: Rewriter) -> None:
    """A dropout of a value split evenly over the axis draws the whole value's mask and keeps this rank's part
    (``DropoutOfPart``); one of a replicated value, or one that draws nothing, stays as it is."""
    x, p, train = node.args[0], arg(node, "p"), arg(node, "train")
    where = rw.placement(node)
    if not train or not p or not isinstance(where, Shard) or where.blocks is not None:
        return
    rw.replace(node, rw.module(DropoutOfPart(float(p), dim=where.dim, size=rw.size, rank=rw.rank), (x,), before=node,
                               like=node))
