"""Applying placements: insert the collectives a propagation asks for and make every node local.

Shared by every mesh axis: ``shard_axis(gm, axis, seeds)`` is the one driver tp, cp and sp run through. It
propagates the seeds' placements over the graph and rewrites it with the axis's axis (``passes.axis.Axis``): how
a sharded value is gathered and a replicated one split (tensor parallelism cuts contiguous chunks; context
parallelism may give a rank two non-contiguous chunks of the sequence), and which replicated inputs of a sharded
computation need Megatron's f (their gradient is a partial sum over the axis).
"""

from __future__ import annotations

import torch
from torch import fx

from autoshard import meta
from autoshard.passes import localize
from autoshard.passes.axis import Axis, Outputs
from autoshard.passes.collectives import CopyToParallel, ReduceFromParallel
from autoshard.passes.placements import Partial, Placement, R, Replicate, Shard
from autoshard.passes.propagate import Propagation, propagate, requires_grad
from autoshard.passes.rules import SCALES

FALLBACKS = meta.FALLBACKS  # re-exported: where the ops that ran replicated for want of a rule are listed
IDLE_F = meta.IDLE_F


def shard_axis(gm: fx.GraphModule, axis: Axis, seeds: dict[str, Placement], *, rank: int, group=None,
               outputs: Outputs = Outputs.WHOLE) -> Propagation:
    """Rewrite ``gm`` in place into what rank ``rank`` of ``axis`` runs, the values ``seeds`` names placed so (by
    parameter target or input name) and every other placed as propagation decides; the propagation, for what
    the pass reads after (where its outputs were)."""
    prop = propagate(gm, seeds, axis, outputs=outputs)
    rw = localize.Rewriter(gm, prop, rank=rank, group=group, grad=requires_grad(gm))
    apply_placements(gm, prop, rw)
    return prop


def apply_placements(gm: fx.GraphModule, prop: Propagation, rw: localize.Rewriter) -> None:
    """Rewrite ``gm`` in place so that it computes this rank's part under ``prop``'s placements."""
    axis = prop.axis
    for node in list(gm.graph.nodes):
        decision = prop.decisions.get(node)
        if decision is None:
            continue
        if decision.fallback:
            _refuse_lost_writes(node, prop, axis.name)
            gm.meta.setdefault(FALLBACKS, []).append(_warn_fallback(node, axis.name, decision.reason))
        # an op split by ranks, or a pending sum scaled by a whole value: the whole value's gradient sums over ranks
        sharded = _has_shard(prop.of(node)) or (isinstance(prop.of(node), Partial) and node.target in SCALES)
        for value, dst in decision.want.items():
            if prop.of(value) != dst:
                new = _redistribute(rw, value, prop.of(value), dst, node, axis)
                if sharded and dst == R and _flows(value, rw, axis) and axis.needs_copy(value):
                    new = _f(rw, new, node, idle=value not in rw.grad)  # gathered, then used per rank
                node.replace_input_with(rw.current(value), new)
        if sharded:
            for value in list(node.all_input_nodes):
                original = rw.original(value)
                if original not in prop.placements or prop.of(original) != R or not _flows(original, rw, axis):
                    continue
                if decision.want.get(original, R) == R and axis.needs_copy(original):
                    node.replace_input_with(value, _f(rw, value, node, idle=original not in rw.grad))
        localize.localize(node, rw)
    _local_metadata(gm, prop, rw)


def _flows(value: fx.Node, rw: localize.Rewriter, axis: Axis) -> bool:
    """Whether an f on ``value`` is wanted: where its gradient flows, or everywhere when the axis asks so."""
    return value in rw.grad or axis.copy_without_grad


def _f(rw: localize.Rewriter, value: fx.Node, consumer: fx.Node, *, idle: bool) -> fx.Node:
    """Megatron's f on ``value``; ``idle`` where no gradient flows back through it (marked ``IDLE_F``)."""
    node = rw.cached(value, "f", lambda a: CopyToParallel(**a), consumer)
    if idle:
        node.meta[IDLE_F] = True
    return node


def _has_shard(placement) -> bool:
    if isinstance(placement, tuple):
        return any(isinstance(p, Shard) for p in placement)
    return isinstance(placement, Shard)


def _redistribute(rw, value: fx.Node, src: Placement, dst: Placement, consumer: fx.Node, axis: Axis):
    """The collectives that turn ``value`` from ``src`` into ``dst``, shared by every consumer."""
    if isinstance(src, Partial):
        value = rw.cached(value, "reduce", lambda a: ReduceFromParallel(**a), consumer)
        src = R
    if isinstance(src, Shard) and src != dst:
        axis.check(value, src)
        make = lambda a, s=src: axis.gather(dim=s.dim, blocks=s.blocks, **_whole(s), **a)  # noqa: E731
        full = meta.val(value).shape[src.dim]
        value = rw.cached(value, f"gather{src.dim}", make, consumer)
        if full % rw.size:  # a padded dim: drop the padding the last rank held
            value = _trim(rw, value, src.dim, full, consumer)
        src = R
    if isinstance(src, Replicate) and isinstance(dst, Shard):
        axis.check(value, dst)
        make = lambda a, d=dst: axis.scatter(dim=d.dim, blocks=d.blocks, **_whole(d), **a)  # noqa: E731
        value = rw.cached(value, f"split{dst.dim}", make, consumer)
    return rw.current(value)


def _whole(placement: Shard) -> dict:
    """The blocks every rank holds whole, as the gather and scatter take them (only tp's blocked splits have any)."""
    return {"whole": placement.whole} if placement.whole else {}


def _trim(rw, value: fx.Node, dim: int, size: int, consumer: fx.Node) -> fx.Node:
    key = (value, f"trim{dim}")
    if key not in rw._cache:
        with rw.gm.graph.inserting_before(consumer):
            node = rw.gm.graph.call_function(torch.ops.aten.slice.Tensor, (value, dim, 0, size))
        node.meta.update(value.meta)
        rw._cache[key] = node
    return rw._cache[key]


def _local_metadata(gm: fx.GraphModule, prop: Propagation, rw) -> None:
    """Record local shapes on sharded nodes (``meta.LOCAL``), so a pass for another axis sees what this rank holds;
    a node that replaced a propagated one (cp's attention module) holds that one's part, as its readers read it (a
    pipeline stage's sends are sized so, and the gradients they get back: at the global shape, a stage whose cut
    followed cp's attention received them into buffers twice the size, and its backward failed on every rank).
    Such a node took its metadata from the one it replaced, and with it the part an earlier axis's pass left (tp's
    heads): this axis's part is taken of that, unless this pass recorded one of its own."""
    inherited = {node for node, original in ((n, rw.original(n)) for n in gm.graph.nodes)
                 if original is not node and node.meta.get(meta.LOCAL) is original.meta.get(meta.LOCAL)}
    for node in gm.graph.nodes:
        placement = prop.placements.get(node)
        if placement is None and node in inherited:
            placement = prop.placements.get(rw.original(node))
        val = meta.val(node)
        if isinstance(placement, Shard) and isinstance(val, torch.Tensor):
            node.meta[meta.LOCAL] = torch.empty(rw.shape_of(tuple(val.shape), placement), dtype=val.dtype,
                                                device="meta")


def _refuse_lost_writes(node: fx.Node, prop: Propagation, axis: str) -> None:
    """An op that writes in place into a split value cannot run replicated: its write would land on a copy."""
    from autoshard.passes.rules import read_after, written_inputs

    written = [n for n in written_inputs(node) if prop.of(n) != R and read_after(n, node)]
    if written:
        where = meta.source_line(node) or meta.module_path(node) or "unknown source"
        raise ValueError(
            f"{node.target} ({node.name}, from {where}) writes in place into {', '.join(n.name for n in written)}, "
            f"which the {axis} plan splits ({', '.join(repr(prop.of(n)) for n in written)}), and no {axis} rule "
            f"rewrites it: run on a gathered copy, the write would be lost. Keep the tensor it writes replicated on "
            f"{axis} (for an embedding with max_norm: leave its weight out of the plan)"
        )


def _warn_fallback(node: fx.Node, axis: str, reason: str | None = None) -> str:
    import warnings

    where = meta.source_line(node) or meta.module_path(node) or "unknown source"
    what = f"the {axis} rewrite refuses {reason}" if reason else f"no {axis} sharding rule for {node.target}"
    message = (f"{what} ({node.name}, from {where}): its sharded inputs are gathered and it runs replicated "
               "(correct, but slower)")
    warnings.warn(f"autoshard: {message}", stacklevel=3)
    return message
