"""BatchNorm in training mode over a batch that data parallelism splits: the statistics of the whole batch.

A BatchNorm in training normalises each channel with the mean and variance of the batch it sees. Under dp each rank
sees 1/dp of the batch, so its own statistics differ from the model's run whole. This pass rewrites every
``aten.batch_norm`` in training into ``BatchNormOverGroup``, which computes the statistics of every rank's part
together, as ``torch.nn.SyncBatchNorm`` does:

- each rank computes its per-channel mean, biased variance and count (``var_mean``, exact on its part);
- one all-gather brings every rank's (mean, variance, count) to every rank;
- they are combined by Chan's parallel formula: ``mean = sum(n_r mean_r) / n`` and
  ``var = sum(n_r (var_r + (mean_r - mean)^2)) / n``, with no ``E[x^2] - E[x]^2`` cancellation;
- the running statistics take the global mean and the unbiased global variance, as the unsharded model's do,
  so every dp rank's copy of them stays equal to the model's.

Backward: the gathered statistics are the same on every rank, so the gradient of rank ``r``'s own statistics is the
sum over ranks of what each rank's loss sends back through them: an all-reduce of the gathered gradient, of which
``r`` keeps its row. That is what makes the gradient of every input exact, whatever the loss's scaling over dp.

The ranks of the group must see parts of one batch, no element twice (dp's slices of the batch dim).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import fx

from autoshard import meta, peers
from autoshard.passes.axis_pass import AxisPass, Sharding, present
from autoshard.passes.collectives import ProcessGroup, Wire, _all_reduce, _ParallelOp

aten = torch.ops.aten

_TRAINING = 5  # position of ``training`` in ``aten.batch_norm``'s arguments


class _GatherStats(torch.autograd.Function):
    """Every rank's ``stats`` stacked in rank order; backward sums the gradient over ranks and keeps this row."""

    @staticmethod
    def forward(ctx, stats, rank, size, group):
        ctx.rank, ctx.group = rank, group
        if group is None:
            return stats[None]
        parts = [torch.empty_like(stats) for _ in range(size)]
        peers.run(dist.all_gather, parts, stats.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group)[ctx.rank], None, None, None


class BatchNormOverGroup(_ParallelOp):
    """``aten.batch_norm`` in training with the statistics of every rank of ``group`` together (SyncBatchNorm).

    Called as the op is: ``(input, weight, bias, running_mean, running_var, momentum, eps)``; it updates the
    running statistics in place (``writes`` names their positions, for the passes that keep in-place writes)."""

    kind, backward_kind = "all_gather", "all_reduce"
    writes = (3, 4)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None, momentum: float,
                eps: float) -> torch.Tensor:
        dims = [0, *range(2, x.dim())]
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        var, mean = torch.var_mean(xf, dims, correction=0)
        count = torch.full_like(mean, x.numel() // x.shape[1])
        every = _GatherStats.apply(torch.stack([mean, var, count]), self.rank, self.size, self._run_group())
        means, variances, counts = every.unbind(1)  # each (ranks, C)
        n = counts.sum(0)
        mean = (counts * means).sum(0) / n
        var = (counts * (variances + (means - mean) ** 2)).sum(0) / n
        shape = (1, -1, *([1] * (x.dim() - 2)))
        y = (xf - mean.view(shape)) * torch.rsqrt(var.view(shape) + eps)
        if weight is not None:
            y = y * weight.view(shape)
        if bias is not None:
            y = y + bias.view(shape)
        with torch.no_grad():
            if running_mean is not None:
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            if running_var is not None:
                unbiased = var * (n / (n - 1).clamp(min=1))
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"size={self.size}, rank={self.rank}"

    def comm_bytes(self, input_shape: Sequence[int], elem_size: int) -> tuple[int, int]:
        if self.size == 1:
            return 0, 0
        stats = 3 * int(input_shape[1]) * max(elem_size, 4)
        return stats * self.size, stats * self.size

    def wires(self, x, *others):
        """Every rank's mean, variance and count per channel gathered (in fp32 at least); backward, their
        gradients summed, where the input takes a gradient (the statistics depend on it alone)."""
        stats = Wire("all_gather", 3 * x.shape[1], torch.promote_types(x.dtype, torch.float32))
        back = (Wire("all_reduce", 3 * x.shape[1] * self.size, stats.dtype),) if x.requires_grad else ()
        return (stats,), back


def training_batch_norms(gm: fx.GraphModule) -> list[fx.Node]:
    """The ``aten.batch_norm`` nodes of ``gm`` that run in training mode."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.batch_norm.default
            and len(n.args) > _TRAINING and n.args[_TRAINING] is True]


def batch_norm_pass(gm: fx.GraphModule, *, group: ProcessGroup | None, size: int, rank: int,
                    axis: str = "dp") -> int:
    """Rewrite every BatchNorm in training of ``gm`` to compute its statistics over ``group``; how many."""
    found = training_batch_norms(gm)
    for index, node in enumerate(found):
        x, weight, bias, running_mean, running_var, _, momentum, eps = node.args[:8]
        module = BatchNormOverGroup(group=group, size=size, rank=rank)
        module.axis = axis
        name = f"{axis}_batchnormovergroup_{index}"
        gm.add_submodule(name, module)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_module(name, (x, weight, bias, running_mean, running_var, momentum, eps))
        new.meta.update(meta.standing_for(node))
        new.meta[meta.AXIS] = axis
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    if found:
        gm.graph.lint()
        gm.recompile()
    return len(found)


def _apply(gm: fx.GraphModule, sharding: Sharding, found: dict) -> None:
    on = sharding.axes["batch norm"]
    batch_norm_pass(gm, group=on.group, size=on.plan.size, rank=on.rank)


BATCH_NORM = AxisPass("batch norm", after=("tp", "cp", "sp"), applies=present("batch norm"), apply=_apply)
