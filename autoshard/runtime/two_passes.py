"""A step whose loss couples the samples of the batch where its parts run apart (microbatches, pp): two passes.

``job_plan.two_passes`` cuts the training graph (``passes.batch_two_passes``). Each step, every rank: forwards its
microbatches through the first pass's build without gradients, to the values the coupled term reads; concatenates
the split ones along the batch and gathers them over dp into the whole batch's; runs the term on them (the loss of
the whole batch, the same on every rank) and takes its gradient with respect to each; and hands each microbatch its
rows of those gradients as the second pass's extra inputs. The second pass is the surrogate's ordinary step: its
loss is a sum over the samples, so its parameter gradients, added over microbatches, stages and dp ranks, are the
model's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from autoshard import batching, peers
from autoshard.runtime import inference


class TwoPassStep:
    """The first pass and the coupled term of one capture (see the module docstring)."""

    def __init__(self, passes, first) -> None:
        self.passes = passes  # passes.batch_two_passes.TwoPasses
        self.first = first  # the first pass's RankBuild

    def run(self, pm, microbatches: list) -> tuple[list, torch.Tensor]:
        """Each microbatch's inputs with its rows of the term's gradients added (before the target), and the
        whole batch's loss."""
        with torch.no_grad(), pm.precision():
            outputs = [inference.run(pm, self.first, (*inputs, target)) for inputs, target in microbatches]
        values = []
        for index, b in enumerate(self.passes.boundary):
            parts = [out[index] for out in outputs]
            if b.summed:  # each part's share, added over the microbatches and the dp ranks
                values.append(_sum_over_dp(pm, torch.stack(parts).sum(0)))
            else:
                values.append(parts[0] if b.dim is None else _over_dp(pm, torch.cat(parts, b.dim), b.dim))
        leaves = [v.detach().requires_grad_(b.trained) for v, b in zip(values, self.passes.boundary, strict=True)]
        with pm.precision():
            loss = self.passes.term(*leaves)
        trained = [(i, b) for i, b in enumerate(self.passes.boundary) if b.trained]
        grads = torch.autograd.grad(loss, [leaves[i] for i, _ in trained], allow_unused=True)
        sizes = [batching.batch_size((*inputs, target)) for inputs, target in microbatches]
        rows = sum(sizes) * pm.mesh.dp
        fed = [[] for _ in microbatches]
        for (index, b), grad in zip(trained, grads, strict=True):
            grad = torch.zeros_like(leaves[index]) if grad is None else grad.detach()
            if b.summed:  # the same whole gradient for every part's share
                for i in range(len(microbatches)):
                    fed[i].append(grad.unsqueeze(0))
                continue
            if b.dim is None:
                for i, size in enumerate(sizes):
                    fed[i].append((grad / rows).expand(size, *grad.shape).contiguous())
                continue
            mine = grad.movedim(b.dim, 0).chunk(pm.mesh.dp)[pm.coord("dp")]
            held = [out[index].shape[b.dim] for out in outputs]  # each microbatch's rows
            for i, part in enumerate(mine.split(held)):
                fed[i].append(part.contiguous())
        fed_in = [((*inputs, *fed[i]), target) for i, (inputs, target) in enumerate(microbatches)]
        return fed_in, loss.detach().float()


def _sum_over_dp(pm, local: torch.Tensor) -> torch.Tensor:
    if pm.groups is None or pm.mesh.dp == 1:
        return local
    local = local.clone()
    peers.run(dist.all_reduce, local, group=pm.groups.group("dp"))
    return local


def _over_dp(pm, local: torch.Tensor, dim: int) -> torch.Tensor:
    """The whole batch's rows of a value each dp rank holds its rows of (dp ranks in order)."""
    if pm.groups is None or pm.mesh.dp == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(pm.mesh.dp)]
    peers.run(dist.all_gather, parts, local.contiguous(), group=pm.groups.group("dp"))
    return torch.cat(parts, dim)
