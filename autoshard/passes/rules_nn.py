"""Sharding rules for the layers of a network: reductions, norms, matmuls, attention, embeddings, losses.

Registered into the one table of ``passes.rules`` (which imports this module); see that module for
what a rule decides. Also the rules for the collectives one axis inserts, as seen by another axis.
"""

from __future__ import annotations

import string

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
#
# The products (linear, addmm, matmul, bmm, baddbmm, einsum) decide in einsum subscripts, as DTensor's einsum
# strategies do: each op names the subscripts of its operands and of its output (linear: x ``...k``, weight ``nk``,
# bias ``n`` -> ``...n``), picks the split subscript its own cases allow, and ``_product`` lays that split on all.

# the subscripts of leading (batch) dims: any letter but a matmul's m, k and n
_BATCH = "".join(c for c in string.ascii_letters if c not in "mkn")
Operands = list[tuple[fx.Node, str]]  # each operand with its subscripts


def _product(node: fx.Node, ctx: Context, operands: Operands, out: str, letter: str, split: Shard) -> Decision:
    """The product split along subscript ``letter`` as ``split`` is (its blocks; its dim is not read): every operand
    with that subscript takes the same part of it, one broadcast along it (size 1) or without it is taken whole, and
    the output is split along it where it keeps it, else (a summed subscript) each rank's product is a summand."""
    want: dict[fx.Node, Placement] = {}
    for o, spec in operands:
        d, p = spec.find(letter), ctx.of(o)
        if d >= 0 and ctx.shape(o)[d] != 1:
            if p != split.at(d):
                want[o] = split.at(d)
        elif not isinstance(p, Replicate):
            want[o] = R
    return Decision(split.at(out.index(letter)) if letter in out else Partial(), want)


def _subscript(spec: str, p: Placement) -> str | None:
    """The subscript an operand of subscripts ``spec`` is split along, if it is split."""
    return spec[p.dim] if isinstance(p, Shard) else None


def _trailing(out: str, value) -> str:
    """The subscripts of a value broadcast against an output of subscripts ``out`` (a bias): its trailing ones."""
    return out[len(out) - len(Context.shape(value)):]


@rule(aten.linear.default, flops=cost.linear_flops)
def _linear(node: fx.Node, ctx: Context) -> Decision:
    x, w, b = arg(node, "input"), arg(node, "weight"), arg(node, "bias")
    return _with_weight(node, ctx, x, (w, "nk"), b)


@rule(aten.addmm.default, flops=cost.addmm_flops)
def _addmm(node: fx.Node, ctx: Context) -> Decision:
    b, x, w = arg(node, "self"), arg(node, "mat1"), arg(node, "mat2")
    return _with_weight(node, ctx, x, (w, "kn"), b)


def _with_weight(node: fx.Node, ctx: Context, x: fx.Node, weight: tuple[fx.Node, str], b) -> Decision:
    """A linear layer, ``...k, nk (addmm: kn), n -> ...n``. Column-parallel when the weight's ``n`` is split: the bias
    must be cut with the columns already (a parameter, not sliced here). Row-parallel when its ``k`` is, unblocked:
    x taken split alike, the bias whole, the sum taken inside (the localizer's all-reduce, on any axis) so the output
    is whole, unless it reaches zeros (experts' products joined, JetMoE's): then it stays pending, summed once after
    the join. Else split along x's leading dims, with a whole bias."""
    w, spec = weight
    out = _BATCH[:len(ctx.shape(node)) - 1] + "n"
    operands = [(x, out[:-1] + "k"), weight] + ([(b, _trailing(out, b))] if b is not None else [])
    px, pw = ctx.of(x), ctx.of(w)
    letter = _subscript(spec, pw)
    if letter == "n":
        decision = _product(node, ctx, operands, out, "n", pw)
        return replicate_all(node, ctx) if b in decision.want else decision
    if letter == "k" and pw.blocks is None:
        decision = _product(node, ctx, operands, out, "k", pw)
        if b is not None or not ctx.axis.pending_sums or not sum_reaches_zeros(node):
            decision.out = R
        return decision
    if b is not None and ctx.of(b) != R or isinstance(px, Partial):
        return replicate_all(node, ctx)
    letter = _subscript(operands[0][1], px)
    if letter is None or letter == "k":  # x's features split against a whole weight: gathered
        return replicate_all(node, ctx)
    return _product(node, ctx, operands, out, letter, px)


@rule(aten.matmul.default, aten.bmm.default, flops=cost.mm_flops)
def _matmul(node: fx.Node, ctx: Context) -> Decision:
    """Split as ``_matmul_split`` picks; a product of two whole operands is element-wise's (it may scale a pending
    sum); a vector operand is taken whole."""
    a, b = node.args[:2]
    subscripts = _matmul_subscripts(node, ctx, a, b)
    if subscripts is None:
        return replicate_all(node, ctx)
    split = _matmul_split(ctx, subscripts[0])
    if split is not None:
        return _product(node, ctx, *subscripts, *split)
    return _pointwise(node, ctx) if ctx.of(a) == R and ctx.of(b) == R else replicate_all(node, ctx)


@rule(aten.baddbmm.default, flops=cost.addmm_flops)
def _baddbmm(node: fx.Node, ctx: Context) -> Decision:
    """``bias + a @ b`` (BLOOM adds its ALiBi bias to the scores so): the product's split, and the bias cut the same
    way (a per-head bias built in the graph: each rank takes its heads' rows, no communication). A summed subscript
    is refused: every rank's summand would add the bias."""
    bias, a, b = node.args[:3]
    if ctx.of(a) == R and ctx.of(b) == R:  # the product is whole: so must the bias be
        return Decision(R, {} if ctx.of(bias) == R else {bias: R})
    operands, out = _matmul_subscripts(node, ctx, a, b)  # both 3-D
    split = _matmul_split(ctx, operands)
    if split is None or split[0] not in out:
        return replicate_all(node, ctx)
    return _product(node, ctx, [*operands, (bias, _trailing(out, bias))], out, *split)


def _matmul_subscripts(node: fx.Node, ctx: Context, a: fx.Node, b: fx.Node) -> tuple[Operands, str] | None:
    """``...mk, ...kn -> ...mn``, the batch dims broadcast from the right: the operands' subscripts and the output's;
    None for a vector operand."""
    na, nb, nout = len(ctx.shape(a)), len(ctx.shape(b)), len(ctx.shape(node))
    if na < 2 or nb < 2:
        return None
    batch = _BATCH[:nout - 2]
    return [(a, batch[nout - na:] + "mk"), (b, batch[nout - nb:] + "kn")], batch + "mn"


def _matmul_split(ctx: Context, operands: Operands) -> tuple[str, Shard] | None:
    """The subscript a matmul splits, and how; None where none of its cases holds:

    - a batch dim either operand splits, a's first (a blocked one, heads merged into (batch * heads): each rank holds
      its heads of every sample, stays blocked, and the other operand takes the same blocks);
    - a's rows ``m`` (tokens), b taken whole;
    - ``k`` (each rank's product a summand) where one operand is a weight (``_sums_k``);
    - b's columns ``n`` with a whole, where b is a weight: ``x @ W.T`` or a stack of experts' matrices (Llama 4's)."""
    (a, sa), (b, sb) = operands
    pa, pb = ctx.of(a), ctx.of(b)
    la, lb = _subscript(sa, pa), _subscript(sb, pb)
    if la is not None and la in _BATCH:
        return la, Shard(0, pa.blocks)
    if lb is not None and lb in _BATCH:
        return lb, Shard(0, pb.blocks)
    if la == "m":
        return "m", pa
    if ctx.axis.pending_sums and _sums_k(pa, pb, la, lb, len(sa), len(sb)):
        return "k", pa if la == "k" else pb
    if lb == "n" and pa == R and len(sb) <= 3:
        return "n", pb
    return None


def _sums_k(pa: Placement, pb: Placement, la: str | None, lb: str | None, na: int, nb: int) -> bool:
    """Whether a matmul splits its summed ``k``: a row of a weight, b of 2 dims (``x @ W.T``) or 3 (experts' rows)
    split alike, or a of 2 (Mamba's ``W @ x``) unblocked; or a weight's row alone, unblocked, the other operand whole
    and taken split alike (a of 2 dims, or b of 2)."""
    if la == lb == "k":
        return pa.blocks == pb.blocks and (nb <= 3 or na == 2 and pa.blocks is None)
    if la == "k" and pb == R:
        return na == 2 and pa.blocks is None
    return lb == "k" and pa == R and nb == 2 and pb.blocks is None


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
    split from the q, k, v projections to the output one. Taken whole: an ellipsis, a pending sum, two subscripts
    split, a split subscript repeated in an operand (a diagonal)."""
    operands = list(node.args[1])
    letters = einsum_letters(node.args[0], len(operands))
    placements = [ctx.of(o) for o in operands]
    if letters is None:
        return replicate_all(node, ctx)
    specs, out = letters
    split = {(_subscript(spec, p), p.blocks) for spec, p in zip(specs, placements, strict=True) if isinstance(p, Shard)}
    if len(split) != 1 or any(isinstance(p, Partial) for p in placements):
        return replicate_all(node, ctx)
    ((letter, blocks),) = split
    if any(spec.count(letter) > 1 for spec in specs) or (letter not in out and not ctx.axis.pending_sums):
        return replicate_all(node, ctx)
    return _product(node, ctx, list(zip(operands, specs, strict=True)), out, letter, Shard(0, blocks))


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
