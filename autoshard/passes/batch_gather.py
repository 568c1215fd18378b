"""Coupled loss terms made exact under dp: the rows they read gathered from every dp rank, with their gradients.

A contrastive loss (``image @ text.T`` over the batch), in-batch negatives (a ``logsumexp`` over rows) or preference
pairs (row ``i`` against row ``i + n``) read rows of the whole batch at once (``passes.batch_split`` finds them: the
*coupled region*, from where the batch split is misread to the loss). Under dp each rank holds ``1/dp`` of the
rows. This pass gathers, at the region's entry, every split value the region reads (the embeddings, the per-row
log-probabilities: the smallest values that make the term whole, as open_clip's ``gather_with_grad`` does by hand),
so every rank computes the coupled part on the whole batch; the numbers of the region that are sizes of the batch
(``arange(B)`` labels, a ``view`` to ``B`` rows) become the whole batch's (``passes.batch_statistics`` takes them
over, with the region's pending sums).

Gradients: every rank's loss is then the whole batch's, which the runtime divides by ``dp`` and whose parameter
gradients it sums over dp. The gather's backward sums the gradient of the gathered value over the ranks and keeps
this rank's rows (a reduce-scatter): ``sum_r (1/dp) dL/dG`` at this rank's rows is ``dL/dG`` there, so the sum over
ranks of each rank's parameter gradient is the unsharded model's.

dp with one microbatch and no pp or cp, beside tp and ep too: this pass runs first, on the graph of the rank's rows,
and the region then runs at the whole batch's sizes. tp, sp and ep split the region's values on other dims than
the batch's (the gather is element-wise to them: a tp shard or a pending tp sum of each row is gathered as it is),
and their passes localize the region's views by those dims alone. Under microbatches or pp a part cannot see the
rows of later parts, and under cp the rows' sequence is split too: the job plan refuses, naming the term and what
works.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import fx

from autoshard import meta, peers
from autoshard.errors import AutoshardError
from autoshard.passes.collectives import Wire, _all_gather, _ParallelOp
from autoshard.passes.placements import Shard
from autoshard.passes.propagate import Propagation


class _GatherRows(torch.autograd.Function):
    """Every rank's part concatenated along ``dim``; backward: the gradient summed over the ranks, this rank's rows."""

    @staticmethod
    def forward(ctx, x, dim, size, rank, group):
        ctx.dim, ctx.size, ctx.rank, ctx.group, ctx.rows = dim, size, rank, group, x.shape[dim]
        return _all_gather(x, dim, size, None, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.group is None:
            return grad, None, None, None, None
        rows = grad.movedim(ctx.dim, 0).contiguous()  # (size * rows, ...)
        mine = torch.empty((ctx.rows, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
        peers.run(dist.reduce_scatter_tensor, mine, rows, group=ctx.group)
        return mine.movedim(0, ctx.dim), None, None, None, None


class DataAllGather(_ParallelOp):
    """A value split by rows of the batch over the dp ranks made whole, for a loss term that couples them."""

    kind, backward_kind = "all_gather", "reduce_scatter"

    def __init__(self, *, dim: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _GatherRows.apply(x, self.dim, self.size, self.rank, self._run_group())

    def extra_repr(self) -> str:
        return f"dim={self.dim}, size={self.size}"

    def comm_bytes(self, input_shape, elem_size: int) -> tuple[int, int]:
        moved = int(torch.Size(input_shape).numel()) * elem_size * (self.size - 1)
        return moved, moved

    def wires(self, x, *others):
        return (Wire("all_gather", x.numel(), x.dtype),), (Wire("reduce_scatter", x.numel() * self.size, x.dtype),)


class CoupledTermError(AutoshardError, ValueError):
    """A coupled term whose inputs cannot be gathered whole; the message says which and what works."""


def batch_gather_pass(gm: fx.GraphModule, prop: Propagation, region: set[fx.Node], *, size: int, rank: int,
                      group=None) -> list[str]:
    """Gather over the dp ranks every split value the coupled ``region`` of ``gm`` reads (see the module
    docstring); the names of the values gathered. ``prop``: the batch split of ``gm``."""
    gathered: list[str] = []
    for value in [n for n in gm.graph.nodes if n not in region and any(u in region for u in n.users)]:
        placement = prop.of(value)
        if not isinstance(placement, Shard):
            continue  # whole (a parameter, a constant) or a pending sum (summed over dp where it is read whole)
        if placement.blocks is not None:
            raise CoupledTermError(f"{value.name} at {meta.source_line(value) or value.name} is split in blocks where "
                                   "a loss term reads the whole batch's rows; keep the batch whole (dp=1) or pass "
                                   "batch_statistics='local'")
        insert_dp_collective(gm, value, f"dp_dataallgather_{len(gathered)}",
                             DataAllGather(dim=placement.dim, group=group, size=size, rank=rank),
                             [u for u in value.users if u in region])
        gathered.append(value.name)
    gm.graph.lint()
    gm.recompile()
    return gathered


def insert_dp_collective(gm: fx.GraphModule, value: fx.Node, name: str, module: _ParallelOp,
                         readers: list[fx.Node]) -> fx.Node:
    """``module`` (a collective over dp) run on ``value`` as submodule ``name``, read by ``readers`` in its place."""
    module.axis = "dp"
    gm.add_submodule(name, module)
    with gm.graph.inserting_after(value):
        node = gm.graph.call_module(name, (value,))
    node.meta.update(value.meta)
    node.meta[meta.AXIS] = "dp"
    for reader in readers:
        reader.replace_input_with(value, node)
    return node


def _gathered_rule(node: fx.Node, ctx) -> object:
    """The dp axis: the whole batch's rows on every rank. Any other axis: element-wise."""
    from autoshard.passes.placements import R
    from autoshard.passes.rules import Decision, _pointwise

    return Decision(R) if ctx.axis.name == "dp" else _pointwise(node, ctx)


def _register() -> None:
    from autoshard.passes.rules import op

    op(DataAllGather, rule=_gathered_rule)


_register()
