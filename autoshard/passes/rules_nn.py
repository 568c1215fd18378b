"""Sharding rules for the layers of a network: reductions, norms, matmuls, attention, embeddings, losses.

Registered into the one table of ``passes.rules`` (which imports this module); see that module for
what a rule decides. Also the rules for the collectives one axis inserts, as seen by another axis.
"""

from __future__ import annotations

import torch
from torch import fx

from autoshard import cost
from autoshard.functions import KEPT_OP, kept_of, per_sample
from autoshard.passes.placements import Partial, Placement, R, Replicate, Shard
from autoshard.passes.rules import (
    Context,
    Decision,
    _dim,
    _indivisible,
    _one_input_shard,
    _pointwise,
    _replicated_like,
    arg,
    op,
    refuse,
    replicate_all,
    rule,
    sum_reaches_zeros,
    tensor_inputs,
)

aten = torch.ops.aten


# ------------------------------------------------------------------------------------------- reductions


@rule(aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default)
def _softmax(node: fx.Node, ctx: Context) -> Decision:
    p = _one_input_shard(node, ctx)
    if p is None:
        return _pointwise(node, ctx)
    dim = _dim(arg(node, "dim"), len(ctx.shape(node)))
    return Decision(p) if dim != p.dim else replicate_all(node, ctx)


@rule(aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default, aten.var.correction,
      aten.logsumexp.default, aten.linalg_vector_norm.default)
def _reduce(node: fx.Node, ctx: Context) -> Decision:
    p = _one_input_shard(node, ctx)
    if p is None:
        return _pointwise(node, ctx)
    ndim = len(ctx.shape(node.args[0]))
    dims = arg(node, "dim")
    dims = [dims] if isinstance(dims, int) else list(dims or ())
    dims = [_dim(d, ndim) for d in dims] or list(range(ndim))  # None and [] both reduce every dim
    keepdim = arg(node, "keepdim")
    if p.dim in dims:
        if ctx.axis.pending_sums and p.blocks is None and node.target in (aten.mean.dim, aten.sum.dim_IntList):
            return Decision(Partial())  # each rank's sum over its part (a mean: divided by the whole count)
        return replicate_all(node, ctx)
    return Decision(p.at(p.dim if keepdim else p.dim - sum(d < p.dim for d in dims)))


# losses of each element: (op, position of ``reduction``); with reduction='none' element-wise
ELEMENTWISE_LOSSES = {aten.mse_loss.default: 2, aten.l1_loss.default: 2, aten.smooth_l1_loss.default: 2,
                      aten.huber_loss.default: 2, aten.binary_cross_entropy.default: 3,
                      aten.binary_cross_entropy_with_logits.default: 4, aten.kl_div.default: 2}


@rule(*ELEMENTWISE_LOSSES)
def _elementwise_loss(node: fx.Node, ctx: Context) -> Decision:
    """``mse_loss`` and its kind: element-wise with reduction='none'; reduced, every input whole. (The batch split's
    analysis reads a reduced one as reduction='none' and then a mean or a sum: ``passes.batch_split``.)"""
    return _pointwise(node, ctx) if arg(node, "reduction") == 0 else replicate_all(node, ctx)


@rule(KEPT_OP)
def _kept(node: fx.Node, ctx: Context) -> Decision:
    """A custom autograd Function (or an op export cannot fake) kept whole: opaque, its inputs whole, except where
    its traced forward and backward prove a split keeps its values apart (``autoshard.functions.per_sample``): on an
    axis that splits the batch's samples, per sample; on any axis, every input split alike (element-wise)."""
    placements = [ctx.of(t) for t in node.args[0]]
    samples = ctx.axis.samples and all(p == R or isinstance(p, Shard) for p in placements)
    alike = len(set(placements)) == 1 and isinstance(placements[0], Shard)  # an element-wise Function, on any axis
    if (samples or alike) and any(p != R for p in placements):
        proven = per_sample(node, placements, ctx.size)
        if proven is not None and (samples or all(isinstance(p, Shard) for p in proven[0])):
            return Decision(*proven)
    kept = kept_of(node)
    return replicate_all(node, ctx, reason=f"{kept.name} (kept whole, as its own forward and backward) at {kept.where}"
                         " is opaque: it runs on whole inputs")


@rule(aten.gather.default)
def _gather(node: fx.Node, ctx: Context) -> Decision:
    """``x.gather(dim, index)`` along another dim than the split one, ``x`` and ``index`` split alike (a token's
    log-probability of its label, rows split): each rank picks from its own rows."""
    x, index = arg(node, "self"), arg(node, "index")
    p, ndim = ctx.of(x), len(ctx.shape(x))
    if not (isinstance(p, Shard) and p.blocks is None and ctx.of(index) == p and _dim(arg(node, "dim"), ndim) != p.dim
            and ctx.shape(x)[p.dim] == ctx.shape(index)[p.dim]) or arg(node, "sparse_grad"):
        return replicate_all(node, ctx)
    return Decision(p)


@rule(aten.max.dim, aten.min.dim)
def _reduce_with_indices(node: fx.Node, ctx: Context) -> Decision:
    """``x.max(dim)``: values and indices, both split as ``x`` when ``dim`` is not its split dim (attention sinks'
    ``logits.max(dim=-1)`` with heads split); over the split dim each rank would find its own part's extreme."""
    p = _one_input_shard(node, ctx)
    if p is None:
        return Decision(_replicated_like(node), {node.args[0]: R} if isinstance(ctx.of(node.args[0]), Partial) else {})
    ndim = len(ctx.shape(node.args[0]))
    dim = _dim(arg(node, "dim"), ndim)
    if dim == p.dim:
        return replicate_all(node, ctx)
    out = p.at(p.dim if arg(node, "keepdim") else p.dim - (dim < p.dim))
    return Decision((out, out))


@rule(aten.layer_norm.default, aten.rms_norm.default)
def _layer_norm(node: fx.Node, ctx: Context) -> Decision:
    """Normalised over the trailing ``normalized_shape`` dims: a shard elsewhere stays, weight and bias whole."""
    p = ctx.of(node.args[0])
    params = {n: R for n in tensor_inputs(node) if n is not node.args[0] and not isinstance(ctx.of(n), Replicate)}
    if not isinstance(p, Shard):  # a sharded weight or bias is gathered: every row needs all of it
        return Decision(R, {**params, node.args[0]: R} if isinstance(p, Partial) else params)
    ndim = len(ctx.shape(node))
    if p.dim >= ndim - len(arg(node, "normalized_shape")):
        return replicate_all(node, ctx)
    return Decision(p, params)


# ------------------------------------------------------------------------------------- matmuls and attention


@rule(aten.linear.default, flops=cost.linear_flops)
def _linear(node: fx.Node, ctx: Context) -> Decision:
    x, w, b = arg(node, "input"), arg(node, "weight"), arg(node, "bias")
    return _matmul_with_weight(node, ctx, x, w, b, out_dim_of_weight=0)


@rule(aten.addmm.default, flops=cost.addmm_flops)
def _addmm(node: fx.Node, ctx: Context) -> Decision:
    b, x, w = arg(node, "self"), arg(node, "mat1"), arg(node, "mat2")
    return _matmul_with_weight(node, ctx, x, w, b, out_dim_of_weight=1)


def _matmul_with_weight(node, ctx: Context, x, w, b, out_dim_of_weight: int) -> Decision:
    """A linear layer: column-parallel when the weight's output dim is sharded, row when its input dim is."""
    px, pw = ctx.of(x), ctx.of(w)
    x_last = len(ctx.shape(x)) - 1
    out_last = len(ctx.shape(node)) - 1
    if isinstance(pw, Shard) and pw.dim == out_dim_of_weight:
        bias_ok = b is None or ctx.of(b) == pw.at(0)
        if not bias_ok:
            return replicate_all(node, ctx)
        return Decision(pw.at(out_last), {x: R} if px != R else {})
    if isinstance(pw, Shard) and pw.blocks is None:  # row-parallel: input sharded on its last dim; summed inside
        want = {} if px == Shard(x_last) else {x: Shard(x_last)}
        if b is not None and ctx.of(b) != R:
            want[b] = R
        if b is None and ctx.axis.pending_sums and sum_reaches_zeros(node):
            return Decision(Partial(), want)  # experts' products joined (JetMoE's): summed once, after the join
        return Decision(R, want)
    if b is not None and ctx.of(b) != R or isinstance(px, Partial):
        return replicate_all(node, ctx)
    if isinstance(px, Shard) and px.dim != x_last:
        return Decision(px.at(px.dim + out_last - x_last))
    return replicate_all(node, ctx)


@rule(aten.matmul.default, aten.bmm.default, flops=cost.mm_flops)
def _matmul(node: fx.Node, ctx: Context) -> Decision:
    return _batched_matmul(node, ctx, node.args[0], node.args[1])


@rule(aten.baddbmm.default, flops=cost.addmm_flops)
def _baddbmm(node: fx.Node, ctx: Context) -> Decision:
    """``bias + a @ b`` (BLOOM adds its ALiBi bias to the scores so): the product's shard, and the bias cut the same
    way (a per-head bias built in the graph: each rank takes its heads' rows, no communication)."""
    bias, a, b = node.args[:3]
    if ctx.of(a) == R and ctx.of(b) == R:  # the product is whole: so must the bias be
        return Decision(R, {} if ctx.of(bias) == R else {bias: R})
    decision = _batched_matmul(node, ctx, a, b)
    out, p = decision.out, ctx.of(bias)
    if not isinstance(out, Shard) or decision.fallback:
        return decision if p == R or decision.fallback else replicate_all(node, ctx)
    shape, nout = ctx.shape(bias), len(ctx.shape(node))
    d = out.dim - (nout - len(shape))
    if p != Shard(d, out.blocks):
        if d >= 0 and shape[d] != 1:
            decision.want[bias] = Shard(d, out.blocks)
        elif not isinstance(p, Replicate):
            decision.want[bias] = R
    return decision


def einsum_letters(equation: str, operands: int) -> tuple[list[str], str] | None:
    """The subscripts of each operand of ``einsum(equation, ...)`` and of its output (implicit output: the letters
    seen once, in alphabetical order); None for an ellipsis or a count that does not match."""
    equation = equation.replace(" ", "")
    if "." in equation:
        return None
    inputs, _, out = equation.partition("->")
    specs = inputs.split(",")
    if len(specs) != operands:
        return None
    if "->" not in equation:
        letters = "".join(specs)
        out = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    return specs, out


@rule(aten.einsum.default, flops=cost.einsum_flops)
def _einsum(node: fx.Node, ctx: Context) -> Decision:
    """A split subscript stays split: every operand that has it takes the same part, and the output is split along
    it, or, when the subscript is summed over (a row: ``ibnd,hnd->ibh`` with heads split), each rank's product is a
    summand (tp only). XLNet's attention, written in einsums over (hidden, heads, head dim) weights, so keeps its heads
    split from the q, k, v projections to the output one."""
    operands = list(node.args[1])
    letters = einsum_letters(node.args[0], len(operands))
    placements = [ctx.of(o) for o in operands]
    if letters is None:  # an ellipsis: whole operands
        return replicate_all(node, ctx)
    split = {(spec[p.dim], p.blocks) for spec, p in zip(letters[0], placements, strict=True) if isinstance(p, Shard)}
    if len(split) != 1 or any(isinstance(p, Partial) for p in placements):
        return replicate_all(node, ctx)  # nothing split (a pending sum taken whole), or two subscripts split
    specs, out = letters
    ((letter, blocks),) = split
    if any(spec.count(letter) > 1 for spec in specs) or (letter not in out and not ctx.axis.pending_sums):
        return replicate_all(node, ctx)
    want: dict[fx.Node, Placement] = {}
    for o, spec, p in zip(operands, specs, placements, strict=True):
        d = spec.find(letter)
        if d >= 0 and ctx.shape(o)[d] != 1:
            if p != Shard(d, blocks):
                want[o] = Shard(d, blocks)
        elif not isinstance(p, Replicate):
            want[o] = R
    return Decision(Shard(out.index(letter), blocks) if letter in out else Partial(), want)


def _batched_matmul(node: fx.Node, ctx: Context, a, b) -> Decision:
    pa, pb = ctx.of(a), ctx.of(b)
    na, nb, nout = len(ctx.shape(a)), len(ctx.shape(b)), len(ctx.shape(node))
    if na < 2 or nb < 2:
        return replicate_all(node, ctx)
    batch_a = pa.dim + nout - na if isinstance(pa, Shard) and pa.dim < na - 2 else None
    batch_b = pb.dim + nout - nb if isinstance(pb, Shard) and pb.dim < nb - 2 else None
    dim = batch_a if batch_a is not None else batch_b
    if dim is None:
        if isinstance(pa, Shard) and pa.dim == na - 2:  # rows of a (tokens): b is needed whole
            return Decision(pa.at(nout - 2), {b: R} if pb != R else {})
        if na == 2 and ctx.axis.pending_sums and pa == Shard(1) and pb in (R, Shard(nb - 2)):
            # W @ x with W's input features split: a row, x taken split alike, each rank's product a summand
            return Decision(Partial(), {b: Shard(nb - 2)} if pb == R else {})
        if nb == 2 and pa == R and pb == Shard(1, pb.blocks if isinstance(pb, Shard) else None):
            return Decision(pb.at(nout - 1))  # x @ W.T with W's output features split: a column
        if (nb == 2 and ctx.axis.pending_sums and isinstance(pa, Shard) and pa.dim == na - 1 and isinstance(pb, Shard)
                and pb.dim == 0 and pa.blocks == pb.blocks):
            return Decision(Partial())  # x @ W.T with the input features split: a row, each rank's product a summand
        if nb == 2 and ctx.axis.pending_sums and pa == R and pb == Shard(0):
            return Decision(Partial(), {a: Shard(na - 1)})  # ... a row alone: each rank takes its part of x
        if nb == 3 and pa == R and isinstance(pb, Shard) and pb.dim == 2:
            return Decision(pb.at(nout - 1))  # tokens per expert @ experts' columns (Llama 4's experts)
        if (nb == 3 and ctx.axis.pending_sums and isinstance(pa, Shard) and pa.dim == na - 1 and isinstance(pb, Shard)
                and pb.dim == 1 and pa.blocks == pb.blocks):
            return Decision(Partial())  # ... and their rows: each rank's product a summand
        return _pointwise(node, ctx) if pa == R and pb == R else replicate_all(node, ctx)
    # A blocked batch shard (heads merged into a (batch * heads) dim: each rank holds its heads of every
    # sample) stays blocked, and the other operand must hold the same elements: the same blocks.
    blocks = pa.blocks if batch_a is not None else pb.blocks
    want = {}
    for n, p, nd in ((a, pa, na), (b, pb, nb)):
        d = dim - (nout - nd)
        if p == Shard(d, blocks):
            continue
        if d >= 0 and ctx.shape(n)[d] != 1:
            want[n] = Shard(d, blocks)
        elif not isinstance(p, Replicate):
            want[n] = R
    return Decision(Shard(dim, blocks), want)


def is_grouped_mm(node: fx.Node) -> bool:
    """A grouped matmul of mixture-of-experts layers: rows of ``x`` (tokens sorted by expert) times their expert's
    matrix, ``out[rows of e] = x[rows of e] @ w[e]`` with the row ranges given by ``offsets`` (torch's
    ``_grouped_mm``, and libraries' own ops of the same signature)."""
    if node.op != "call_function" or "grouped_mm" not in str(node.target) or len(node.args) < 3:
        return False
    x, w, offsets = node.args[:3]
    shapes = [Context.shape(v) if isinstance(v, fx.Node) else () for v in (x, w, offsets)]
    out = Context.shape(node)
    return (len(shapes[0]) == 2 and len(shapes[1]) == 3 and len(shapes[2]) == 1 and len(out) == 2
            and shapes[0][1] == shapes[1][1] and out == (shapes[0][0], shapes[1][2]))


def _grouped_mm(node: fx.Node, ctx: Context) -> Decision:
    """Each expert's matmul as a linear: its output features split (column: ``w`` split on dim 2, ``x`` whole) or its
    input features split (row: ``x`` and ``w``'s dim 1 split alike; each rank's product is a summand)."""
    x, w, offsets = node.args[:3]
    px, pw = ctx.of(x), ctx.of(w)
    if isinstance(ctx.of(offsets), Shard):
        return replicate_all(node, ctx)
    if px == R and isinstance(pw, Shard) and pw.dim == 2:
        return Decision(pw.at(1))
    if isinstance(px, Shard) and px.dim == 1 and isinstance(pw, Shard) and pw.dim == 1 and px.blocks == pw.blocks:
        return Decision(Partial())
    if px == R and pw == Shard(1) and ctx.axis.pending_sums:  # a row alone: each rank takes its part of x
        return Decision(Partial(), {x: Shard(1)})
    if isinstance(px, Shard) and px.dim == 0 and pw == R:  # tokens split (another axis): rows stay rows
        return replicate_all(node, ctx)
    return _pointwise(node, ctx) if px == R and pw == R else replicate_all(node, ctx)


op(matches=is_grouped_mm, rule=_grouped_mm)


@rule(aten.scaled_dot_product_attention.default, flops=cost.attention_flops, timing=cost.ATTENTION)
def _sdpa(node: fx.Node, ctx: Context) -> Decision:
    q, k, v = node.args[:3]
    ndim = len(ctx.shape(q))
    heads, seq = ndim - 3, ndim - 2
    if ctx.of(q) == Shard(seq):  # queries split by position: every key is needed (gathered, or passed around a ring)
        if ctx.axis.keeps_keys_split and arg(node, "dropout_p"):
            return refuse(node, ctx, "dropout_p", "is not applied by ring or all-to-all attention (use cp "
                          "attention='gather')")
        kv = Shard(seq) if ctx.axis.keeps_keys_split else R
        want: dict[fx.Node, Placement] = {t: kv for t in (k, v) if ctx.of(t) != kv}
        _mask_rows(node, ctx, want, seq, ndim)
        return Decision(Shard(seq), want)
    blocked = {ctx.of(t) for t in (q, k, v) if isinstance(ctx.of(t), Shard) and ctx.of(t).dim == heads
               and ctx.of(t).blocks is not None}
    if len(blocked) == 1 and not arg(node, "enable_gqa"):
        # heads split in blocks (keys tiled for several query groups): query head i reads key head i, so q, k and v
        # take the same heads, the same blocks
        (p,) = blocked
        if any(ctx.of(t) not in (p, R) for t in (q, k, v)):  # heads laid out otherwise: not one head per head
            return replicate_all(node, ctx)
        want = {t: p for t in (q, k, v) if ctx.of(t) != p}  # replicated ones take their heads locally
        _mask_rows(node, ctx, want, heads, ndim)
        mask = arg(node, "attn_mask")
        if mask in want and want[mask] != R:  # a mask per head: its heads would need the blocks too
            return replicate_all(node, ctx)
        return Decision(p, want)
    for dim in (heads, *range(heads)):  # attention is independent along the head and batch dims
        if any(ctx.of(t) == Shard(dim) for t in (q, k, v)):
            if dim == heads and arg(node, "enable_gqa"):
                return _grouped_query(node, ctx, dim, ndim)
            want = {t: Shard(dim) for t in (q, k, v) if ctx.of(t) != Shard(dim)}
            _mask_rows(node, ctx, want, dim, ndim)
            return Decision(Shard(dim), want)
    return _pointwise(node, ctx) if all(ctx.of(t) == R for t in (q, k, v)) else replicate_all(node, ctx)


def _grouped_query(node: fx.Node, ctx: Context, dim: int, ndim: int) -> Decision:
    """``enable_gqa=True`` split by heads: query head ``h`` reads kv head ``h // (heads // kv heads)``, so a rank's
    query heads read the kv heads it holds when the degree splits both evenly (each its ``1/t``), or, where the kv
    heads divide the degree instead, one kv head: k and v then stay whole on every rank (duplicated, as a model that
    repeats them does) and the localizer takes the head this rank's queries read. Any other count is a conflict."""
    q, k, v = node.args[:3]
    heads = ctx.shape(q)[dim]
    kv = {ctx.shape(t)[dim] for t in (k, v)}
    if heads % ctx.size or any(c % ctx.size and ctx.size % c for c in kv):  # else a rank would read parts of heads
        what = "heads of the grouped-query attention (enable_gqa=True)"
        count = heads if heads % ctx.size else min(c for c in kv if c % ctx.size and ctx.size % c)
        return replicate_all(node, ctx, conflict=_indivisible(count, ctx.size, what))
    want: dict[fx.Node, Placement] = {}
    for t in (q, k, v):
        split = t is q or ctx.shape(t)[dim] % ctx.size == 0
        if ctx.of(t) != Shard(dim) and (split or not isinstance(ctx.of(t), Replicate)):
            want[t] = Shard(dim) if split else R  # a pending sum or another split is made whole first
    _mask_rows(node, ctx, want, dim, ndim)
    return Decision(Shard(dim), want)


def grouped_kv_heads(heads: int, kv: int, size: int, rank: int) -> tuple[int, int]:
    """The kv heads ``[start, stop)`` that query heads ``rank``'s ``1/size`` of ``heads`` read under grouped-query
    attention (query head ``h`` reads kv head ``h // (heads // kv)``)."""
    group, per_rank = heads // kv, heads // size
    return rank * per_rank // group, ((rank + 1) * per_rank - 1) // group + 1


def _mask_rows(node: fx.Node, ctx: Context, want: dict, dim: int, ndim: int) -> None:
    """An explicit mask follows the queries' shard on ``dim`` unless it broadcasts there."""
    mask = arg(node, "attn_mask")
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
    if pw == Shard(0):  # vocab-parallel: each rank looks up its rows (padding_idx is carried)
        if arg(node, "scale_grad_by_freq"):
            return refuse(node, ctx, "scale_grad_by_freq", "is not supported by the vocab-parallel lookup (counts "
                          "would include other ranks' ids)")
        if arg(node, "sparse"):
            return refuse(node, ctx, "sparse", "(sparse gradients) is not supported by the vocab-parallel lookup")
        return Decision(R, {ids: R} if pids != R else {})
    if pw == R and isinstance(pids, Shard):
        return Decision(Shard(pids.dim))
    if pw == Shard(1) and pids == R:  # each rank looks up its columns of every row
        return Decision(Shard(len(ctx.shape(node)) - 1))
    return replicate_all(node, ctx)


@rule(aten.cross_entropy_loss.default)
def _cross_entropy(node: fx.Node, ctx: Context) -> Decision:
    logits, target = node.args[0], node.args[1]
    weight = arg(node, "weight")
    p, ndim = ctx.of(logits), len(ctx.shape(logits))
    probabilities = ctx.shape(target) == ctx.shape(logits)  # class probabilities, not class indices
    if p == Shard(1) and ndim >= 2:  # the class dim split: the vocab-parallel loss
        if weight is not None:
            return refuse(node, ctx, "weight", "(class weights) is not supported by the vocab-parallel loss")
        if probabilities:
            return refuse(node, ctx, "target", "(class probabilities, not indices) is not supported by the "
                          "vocab-parallel loss")
        return Decision(R, {target: R} if ctx.of(target) != R else {})
    reduction = arg(node, "reduction")
    if isinstance(p, Shard) and p.dim != 1 and ndim >= 2 and reduction in (0, 2):  # rows (tokens) split
        rows = p.at(p.dim if probabilities or p.dim == 0 else p.dim - 1)  # the target has no class dim
        want: dict[fx.Node, Placement] = {target: rows} if ctx.of(target) != rows else {}
        if isinstance(weight, fx.Node) and ctx.of(weight) != R:
            want[weight] = R
        return Decision(rows if reduction == 0 else Partial(), want)
    return replicate_all(node, ctx)


# ------------------------------------------------------------------- collectives inserted for another axis


def _vocab_embedding_module(node: fx.Node, ctx: Context) -> Decision:
    ids = node.args[0]
    p = ctx.of(ids)
    return Decision(p) if isinstance(p, Shard) else replicate_all(node, ctx)


def _vocab_cross_entropy_module(node: fx.Node, ctx: Context) -> Decision:
    p = ctx.of(node.args[0])
    module = node.graph.owning_module.get_submodule(node.target)
    vocab_dim = len(ctx.shape(node.args[0])) - 1  # the module takes the vocab last, the target without it
    if isinstance(p, Shard) and p.dim < vocab_dim and module.reduction in ("sum", "none"):
        target, rows = node.args[1], p
        want = {target: rows} if ctx.of(target) != rows else {}
        return Decision(rows if module.reduction == "none" else Partial(), want)
    return replicate_all(node, ctx)


def _register_collectives() -> None:
    """Tensor-parallel collectives act on the tp dims only: on another axis they pass shards through."""
    from autoshard.passes import collectives

    op(collectives.CopyToParallel, collectives.ReduceFromParallel, collectives.GatherFromParallel,
       collectives.ScatterToParallel, rule=_pointwise)
    op(collectives.VocabParallelEmbedding, rule=_vocab_embedding_module)
    op(collectives.VocabParallelCrossEntropy, rule=_vocab_cross_entropy_module)


_register_collectives()


# The arithmetic of mm, whose sharding tp's planner decides (it finds the weight): every overload counted alike.
op(aten.mm.default, flops=cost.mm_flops)

# The rules for convolutions, pooling and the norms of images register themselves.
from autoshard.passes import rules_conv  # noqa: E402, F401
