"""Sharding rules for the layers of image and signal models: convolutions, pooling, GroupNorm and BatchNorm.

Registered into the one table of ``passes.rules``. A convolution is a linear over each window of its input, so tp
splits it as Megatron splits linears: by output channels (a *column*: the filters, dim 0 of a convolution's weight,
dim 1 of a transposed one's (in, out / groups, ...), and the bias; the output split along its channel dim 1) or by
input channels (a *row*: the weight's other channel dim; each rank's product a summand, all-reduced once, the bias
added after the sum). A grouped convolution whose group count the degree divides (a depthwise one included) keeps a
channel split: each rank convolves its own groups with their filters. Per-channel layers between a column and a row
keep the split: GroupNorm by whole groups, BatchNorm per channel, pooling per plane. Any other split is taken whole.
"""

from __future__ import annotations

import torch
from torch import fx

from autoshard import cost
from autoshard.passes.placements import R, Shard
from autoshard.passes.rules import Context, Decision, arg, op, replicate_all, rule, tensor_inputs

aten = torch.ops.aten

_TRANSPOSED = (aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input)
CONVOLUTIONS = (aten.conv1d.default, aten.conv1d.padding, aten.conv2d.default, aten.conv2d.padding,
                aten.conv3d.default, aten.conv3d.padding, *_TRANSPOSED, aten.convolution.default)


# Their arithmetic: every overload of these ops counted alike (the transposed ones count an element each)
op(aten.convolution.default, aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
   flops=cost.convolution_flops)


def is_convolution(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in CONVOLUTIONS


def channel_dims(node: fx.Node) -> tuple[int, int]:
    """The dims of a convolution's weight holding its output and its input channels: (0, 1), or (1, 0) for a
    transposed convolution, whose weight is stored (in, out / groups, ...)."""
    transposed = node.target in _TRANSPOSED or (node.target is aten.convolution.default and arg(node, "transposed"))
    return (1, 0) if transposed else (0, 1)


def _per_sample(node: fx.Node, ctx: Context) -> Decision | None:
    """A convolution split along its batch of samples (dim 0 of a batched input, the filters whole): each rank
    convolves its own samples. None for any other split."""
    x, w = arg(node, "input"), arg(node, "weight")
    p = ctx.of(x)
    batched = isinstance(p, Shard) and p.dim == 0 and p.blocks is None and len(ctx.shape(x)) == len(ctx.shape(w))
    if not batched or any(ctx.of(n) != R for n in tensor_inputs(node) if n is not x):
        return None
    return Decision(p)


@rule(*CONVOLUTIONS)
def _conv(node: fx.Node, ctx: Context) -> Decision:
    """Split by samples, by the rows of a patch embedding's kernel, as a column, as a row, or by whole groups."""
    decided = _per_sample(node, ctx) or _patch_rows(node, ctx)
    if decided is not None:
        return decided
    x, w, b = arg(node, "input"), arg(node, "weight"), arg(node, "bias")
    px, pw, pb = ctx.of(x), ctx.of(w), ctx.of(b) if b is not None else None
    out_dim, in_dim = channel_dims(node)
    groups, batched = arg(node, "groups"), len(ctx.shape(x)) == len(ctx.shape(w))
    if not batched:  # an unbatched input (channels first): its channel dim is 0, not 1
        return replicate_all(node, ctx)
    if groups == 1 and pw == Shard(out_dim) and px == R:  # a column: this rank's filters over the whole input
        return Decision(Shard(1), {b: Shard(0)} if b is not None and pb != Shard(0) else {})
    if groups == 1 and pw == Shard(in_dim) and ctx.axis.pending_sums and ctx.shape(w)[in_dim] % ctx.size == 0 \
            and px in (R, Shard(1)) and pb in (None, R):
        return Decision(R, {x: Shard(1)} if px == R else {})  # a row: summed, then the bias (the localizer's)
    if _whole_groups(node, ctx, px, groups):  # this rank's groups of input channels, their filters, their outputs
        cut = px.at(0)
        if pw in (R, cut) and pb in (None, R, cut):
            return Decision(px, {n: cut for n in (w, b) if n is not None and ctx.of(n) != cut})
    return replicate_all(node, ctx)


def _whole_groups(node: fx.Node, ctx: Context, px, groups: int) -> bool:
    """Whether a grouped convolution's input is split by its channels into whole groups: evenly, the degree dividing
    the groups; or in blocks (a fused projection's pieces, Mamba2's x, B and C) where each channel is its own group
    with one filter (depthwise), so that any cut of the channels is a cut of the groups."""
    if not (isinstance(px, Shard) and px.dim == 1 and groups > 1):
        return False
    if px.blocks is None:
        return groups % ctx.size == 0
    channels = ctx.shape(arg(node, "input"))[1]
    return groups == channels == ctx.shape(arg(node, "weight"))[0] and not px.whole


def is_patch_conv(node: fx.Node) -> bool:
    """A 2-D convolution whose stride is its kernel, without padding, dilation or groups, over an image whose
    height the kernel divides: a vision model's patch embedding, a linear over each patch's pixels. (A 1x1 one is a
    linear over each pixel's channels, split by its channels as any convolution: its kernel has one row.)"""
    if node.op != "call_function" or node.target not in (aten.conv2d.default, aten.conv2d.padding):
        return False
    x, w, padding = arg(node, "input"), arg(node, "weight"), arg(node, "padding")
    shape, kernel = Context.shape(x), list(Context.shape(w)[2:])
    return (len(shape) == 4 and len(kernel) == 2 and kernel[0] > 1 and shape[2] % kernel[0] == 0
            and arg(node, "groups") == 1
            and list(arg(node, "stride")) == kernel and (padding == "valid" or not isinstance(padding, str)
                                                          and not any(padding))
            and list(arg(node, "dilation")) == [1, 1])


def _patch_rows(node: fx.Node, ctx: Context) -> Decision | None:
    """A patch embedding split by rows of its kernel (tp only): each rank convolves its rows of every patch, and one
    all-reduce sums the products (the localizer's; the bias is added once, after it). None for any other split."""
    w = arg(node, "weight")
    others = [n for n in tensor_inputs(node) if n is not w]
    if (ctx.of(w) == Shard(2) and ctx.axis.pending_sums and is_patch_conv(node) and ctx.shape(w)[2] % ctx.size == 0
            and all(ctx.of(n) == R for n in others)):
        return Decision(R)
    return None


_POOLS = {aten.avg_pool1d.default: 1, aten.avg_pool2d.default: 2, aten.max_pool1d.default: 1,
          aten.max_pool2d.default: 2, aten.adaptive_avg_pool1d.default: 1, aten.adaptive_avg_pool2d.default: 2,
          aten.upsample_nearest2d.default: 2}  # op -> how many trailing dims it pools over


@rule(*_POOLS)
def _pool(node: fx.Node, ctx: Context) -> Decision:
    """Pooling and resampling act on each (sample, channel) plane: a split of the samples or the channels stays."""
    p, ndim = ctx.of(node.args[0]), len(ctx.shape(node.args[0]))
    if not (isinstance(p, Shard) and p.blocks is None and ndim >= 3 and p.dim < ndim - _POOLS[node.target]):
        return replicate_all(node, ctx)
    return Decision(p)


@rule(aten.group_norm.default)
def _group_norm(node: fx.Node, ctx: Context) -> Decision:
    """GroupNorm normalises each sample over each group of its channels: a split of the samples stays, weight and bias
    whole; a split of the channels stays where the degree divides the groups (each rank normalises its whole groups;
    weight and bias cut alike)."""
    x, w, b = node.args[0], arg(node, "weight"), arg(node, "bias")
    p, groups = ctx.of(x), arg(node, "num_groups")
    if isinstance(p, Shard) and p.dim == 0 and p.blocks is None and all(
            ctx.of(n) == R for n in tensor_inputs(node) if n is not x):
        return Decision(p)
    if p == Shard(1) and len(ctx.shape(x)) >= 2 and groups % ctx.size == 0:
        return Decision(p, {n: Shard(0) for n in (w, b) if n is not None and ctx.of(n) != Shard(0)})
    return replicate_all(node, ctx)


@rule(aten.batch_norm.default)
def _batch_norm(node: fx.Node, ctx: Context) -> Decision:
    """BatchNorm split by channels: each channel's statistics are over the batch and space, which every rank holds
    whole for its channels, so each rank normalises its own (weight, bias and running statistics cut alike). In
    training the running statistics are written in place: kept whole (a rank would update its copy's part only),
    so only a BatchNorm without them (``track_running_stats=False``) trains split. Any other split is gathered."""
    x = node.args[0]
    stats = [arg(node, "running_mean"), arg(node, "running_var")]
    if ctx.of(x) != Shard(1) or len(ctx.shape(x)) < 2 or (arg(node, "training") and any(s is not None for s in stats)):
        return replicate_all(node, ctx)
    cut = [arg(node, "weight"), arg(node, "bias"), *stats]
    return Decision(Shard(1), {n: Shard(0) for n in cut if n is not None and ctx.of(n) != Shard(0)})
