"""Sharding rules for the layers of a network: reductions, norms, matmuls, attention, embeddings, losses.

Registered into the one table of ``passes.rules`` (which imports this module); see that module for
what a rule decides. Also the rules for the collectives one axis inserts, as seen by another axis.
"""

from __future__ import annotations

import torch
from torch import fx

from autoshard.passes.placements import Partial, Placement, R, Replicate, Shard
from autoshard.passes.rules import (
    RULES,
    Context,
    Decision,
    _dim,
    _one_input_shard,
    _pointwise,
    replicate_all,
    rule,
    tensor_inputs,
)

aten = torch.ops.aten


# ------------------------------------------------------------------------------------------- reductions


@rule(aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default)
def _softmax(node: fx.Node, ctx: Context) -> Decision:
    p = _one_input_shard(node, ctx)
    if p is None:
        return _pointwise(node, ctx)
    dim = _dim(node.args[1], len(ctx.shape(node)))
    return Decision(p) if dim != p.dim else replicate_all(node, ctx)


@rule(aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.var.correction)
def _reduce(node: fx.Node, ctx: Context) -> Decision:
    p = _one_input_shard(node, ctx)
    if p is None:
        return _pointwise(node, ctx)
    ndim = len(ctx.shape(node.args[0]))
    dims = node.args[1] if len(node.args) > 1 and node.args[1] is not None else list(range(ndim))
    dims = [_dim(d, ndim) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if p.dim in dims:
        return replicate_all(node, ctx)
    return Decision(Shard(p.dim if keepdim else p.dim - sum(d < p.dim for d in dims), p.blocks))


@rule(aten.layer_norm.default)
def _layer_norm(node: fx.Node, ctx: Context) -> Decision:
    p = _one_input_shard(node, ctx)
    if p is None:
        return _pointwise(node, ctx)
    ndim = len(ctx.shape(node))
    if p.dim >= ndim - len(node.args[1]):
        return replicate_all(node, ctx)
    return Decision(p, {n: R for n in tensor_inputs(node)[1:] if not isinstance(ctx.of(n), Replicate)})


# ------------------------------------------------------------------------------------- matmuls and attention


@rule(aten.linear.default)
def _linear(node: fx.Node, ctx: Context) -> Decision:
    x, w = node.args[0], node.args[1]
    b = node.args[2] if len(node.args) > 2 else None
    return _matmul_with_weight(node, ctx, x, w, b, out_dim_of_weight=0)


@rule(aten.addmm.default)
def _addmm(node: fx.Node, ctx: Context) -> Decision:
    b, x, w = node.args[0], node.args[1], node.args[2]
    return _matmul_with_weight(node, ctx, x, w, b, out_dim_of_weight=1)


def _matmul_with_weight(node, ctx: Context, x, w, b, out_dim_of_weight: int) -> Decision:
    """A linear layer: column-parallel when the weight's output dim is sharded, row when its input dim is."""
    px, pw = ctx.of(x), ctx.of(w)
    x_last = len(ctx.shape(x)) - 1
    out_last = len(ctx.shape(node)) - 1
    if isinstance(pw, Shard) and pw.dim == out_dim_of_weight:
        bias_ok = b is None or ctx.of(b) == Shard(0, pw.blocks)
        if not bias_ok:
            return replicate_all(node, ctx)
        return Decision(Shard(out_last, pw.blocks), {x: R} if px != R else {})
    if isinstance(pw, Shard) and pw.blocks is None:  # row-parallel: input sharded on its last dim; summed inside
        want = {} if px == Shard(x_last) else {x: Shard(x_last)}
        if b is not None and ctx.of(b) != R:
            want[b] = R
        return Decision(R, want)
    if b is not None and ctx.of(b) != R or isinstance(px, Partial):
        return replicate_all(node, ctx)
    if isinstance(px, Shard) and px.dim != x_last:
        return Decision(Shard(px.dim + out_last - x_last, px.blocks))
    return replicate_all(node, ctx)


@rule(aten.matmul.default, aten.bmm.default)
def _matmul(node: fx.Node, ctx: Context) -> Decision:
    a, b = node.args[0], node.args[1]
    pa, pb = ctx.of(a), ctx.of(b)
    na, nb, nout = len(ctx.shape(a)), len(ctx.shape(b)), len(ctx.shape(node))
    if na < 2 or nb < 2:
        return replicate_all(node, ctx)
    batch_a = pa.dim + nout - na if isinstance(pa, Shard) and pa.dim < na - 2 else None
    batch_b = pb.dim + nout - nb if isinstance(pb, Shard) and pb.dim < nb - 2 else None
    dim = batch_a if batch_a is not None else batch_b
    if dim is None:
        if isinstance(pa, Shard) and pa.dim == na - 2:  # rows of a (tokens): b is needed whole
            return Decision(Shard(nout - 2, pa.blocks), {b: R} if pb != R else {})
        return _pointwise(node, ctx) if pa == R and pb == R else replicate_all(node, ctx)
    want = {}
    for n, p, nd in ((a, pa, na), (b, pb, nb)):
        d = dim - (nout - nd)
        if isinstance(p, Shard) and p.dim == d:
            continue
        if d >= 0 and ctx.shape(n)[d] != 1:
            want[n] = Shard(d)
        elif not isinstance(p, Replicate):
            want[n] = R
    return Decision(Shard(dim), want)


@rule(aten.scaled_dot_product_attention.default)
def _sdpa(node: fx.Node, ctx: Context) -> Decision:
    q, k, v = node.args[:3]
    ndim = len(ctx.shape(q))
    heads, seq = ndim - 3, ndim - 2
    if ctx.of(q) == Shard(seq):  # queries split by position: every key is needed (gathered, or passed around a ring)
        kv = Shard(seq) if ctx.ring_attention else R
        want: dict[fx.Node, Placement] = {t: kv for t in (k, v) if ctx.of(t) != kv}
        _mask_rows(node, ctx, want, seq, ndim)
        return Decision(Shard(seq), want)
    for dim in (heads, *range(heads)):  # attention is independent along the head and batch dims
        if any(ctx.of(t) == Shard(dim) for t in (q, k, v)):
            want = {t: Shard(dim) for t in (q, k, v) if ctx.of(t) != Shard(dim)}
            _mask_rows(node, ctx, want, dim, ndim)
            return Decision(Shard(dim), want)
    return _pointwise(node, ctx) if all(ctx.of(t) == R for t in (q, k, v)) else replicate_all(node, ctx)


def _mask_rows(node: fx.Node, ctx: Context, want: dict, dim: int, ndim: int) -> None:
    """An explicit mask follows the queries' shard on ``dim`` unless it broadcasts there."""
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if not isinstance(mask, fx.Node):
        return
    mshape = ctx.shape(mask)
    d = dim - (ndim - len(mshape))
    if d >= 0 and mshape[d] != 1:
        if ctx.of(mask) != Shard(d):
            want[mask] = Shard(d)
    elif ctx.of(mask) != R:
        want[mask] = R


# ----------------------------------------------------------------------------------- embedding and loss


@rule(aten.embedding.default)
def _embedding(node: fx.Node, ctx: Context) -> Decision:
    w, ids = node.args[0], node.args[1]
    pw, pids = ctx.of(w), ctx.of(ids)
    if pw == Shard(0):
        return Decision(R, {ids: R} if pids != R else {})
    if pw == R and isinstance(pids, Shard):
        return Decision(Shard(pids.dim))
    return replicate_all(node, ctx)


@rule(aten.cross_entropy_loss.default)
def _cross_entropy(node: fx.Node, ctx: Context) -> Decision:
    logits, target = node.args[0], node.args[1]
    weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
    if ctx.of(logits) == Shard(1) and weight is None:
        return Decision(R, {target: R} if ctx.of(target) != R else {})
    p = ctx.of(logits)
    reduction = node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", 1)
    if isinstance(p, Shard) and p.dim == 0 and reduction in (0, 2):  # rows (tokens) split: a per-token loss
        want = {target: Shard(0, p.blocks)} if ctx.of(target) != Shard(0, p.blocks) else {}
        return Decision(Shard(0, p.blocks) if reduction == 0 else Partial(), want)
    return replicate_all(node, ctx)


# ------------------------------------------------------------------- collectives inserted for another axis


def _vocab_embedding_module(node: fx.Node, ctx: Context) -> Decision:
    ids = node.args[0]
    p = ctx.of(ids)
    return Decision(Shard(p.dim, p.blocks)) if isinstance(p, Shard) else replicate_all(node, ctx)


def _vocab_cross_entropy_module(node: fx.Node, ctx: Context) -> Decision:
    p = ctx.of(node.args[0])
    module = node.graph.owning_module.get_submodule(node.target)
    if isinstance(p, Shard) and p.dim == 0 and module.reduction in ("sum", "none"):
        target = node.args[1]
        want = {target: Shard(0, p.blocks)} if ctx.of(target) != Shard(0, p.blocks) else {}
        return Decision(Shard(0, p.blocks) if module.reduction == "none" else Partial(), want)
    return replicate_all(node, ctx)


def _register_collectives() -> None:
    """Tensor-parallel collectives act on the tp dims only: on another axis they pass shards through."""
    from autoshard.passes import collectives

    for cls in (collectives.CopyToParallel, collectives.ReduceFromParallel, collectives.GatherFromParallel,
                collectives.ScatterToParallel):
        RULES[cls] = _pointwise
    RULES[collectives.VocabParallelEmbedding] = _vocab_embedding_module
    RULES[collectives.VocabParallelCrossEntropy] = _vocab_cross_entropy_module


_register_collectives()
