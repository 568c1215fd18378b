"""Every rank holds the same model and is given the same batch: checked, since nothing else would notice.

autoshard takes the whole model on every rank and the global batch on every rank (with ``local_batch``, each dp
rank's own part, alike on the ranks of one dp coordinate), and cuts from them what each rank computes. A rank that
built the model under another seed, or read another batch (a ``DistributedSampler`` kept from a DDP script, a data
pipeline whose random augmentation differs per process), trains the parts of models and batches that were never one:
the losses stay finite and nothing fails. So the model is compared across the ranks when it is parallelized, and
every batch when a step starts: a few numbers per rank (sums of each tensor, and sums weighted by position, so that
a reordered batch differs too), gathered along each axis of the mesh; a difference is refused on every rank alike
(they all see the gathered numbers), before any collective of the step.

Cost: one pass over the parameters once, and over the batch each step, and a gather of a few numbers per mesh axis.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from autoshard import peers
from autoshard.errors import AutoshardError
from autoshard.mesh import MeshGroups


class RanksDiffer(AutoshardError, ValueError):
    """The ranks were given different models or batches; the message names the rank and what to change."""


_CHUNK = 1 << 24
_NUMBERS = 3  # per tensor: its element count, its sum, its weighted sum
_WEIGHTS = 251  # positions are weighted 1..251, cyclically: a permutation of rows or of elements changes the sum


def signature(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Per tensor, its element count, its sum and its position-weighted sum, in float64: equal on two ranks given
    equal tensors (the same reductions of the same values), and different for the mistakes above. Summed in chunks,
    so that a large embedding costs no more than a few hundred MB at a time."""
    numbers = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(-1)
        total = torch.zeros(_NUMBERS, dtype=torch.float64, device=device)
        total[0] = flat.numel()
        for start in range(0, flat.numel(), _CHUNK):
            part = flat[start:start + _CHUNK].to(torch.float64)
            weights = torch.arange(start, start + part.numel(), device=part.device, dtype=torch.float64)
            total[1:] += torch.stack([part.sum(), (part * weights.remainder_(_WEIGHTS).add_(1)).sum()]).to(device)
        numbers.append(total)
    return torch.cat(numbers) if numbers else torch.zeros(0, dtype=torch.float64, device=device)


def check(what: str, tensors: list[torch.Tensor], groups: MeshGroups | None, axes: tuple[str, ...], fix: str,
          device: torch.device) -> None:
    """Refuse, on every rank of each group along ``axes``, ``tensors`` that differ from the group's first rank's:
    ``what`` names them and ``fix`` says what to change."""
    if groups is None:
        return
    mine = signature(tensors, device)
    for axis in axes:
        if groups.mesh.degree(axis) == 1:
            continue
        ranks = groups.ranks(axis)
        gathered = [torch.empty_like(mine) for _ in ranks]
        with peers.phase("checks"):
            peers.run(dist.all_gather, gathered, mine, group=groups.group(axis))
        for rank, theirs in zip(ranks[1:], gathered[1:], strict=True):
            if not torch.equal(theirs, gathered[0]):
                raise RanksDiffer(f"{what} on rank {rank} differs from rank {ranks[0]}'s (ranks of one {axis} group): "
                                  f"{fix}")


def batch_axes(local_batch: bool) -> tuple[str, ...]:
    """The axes along which every rank is given the same batch: all of them, or (each dp rank its own part) the
    ranks of one dp coordinate."""
    return ("cp", "tp", "pp") if local_batch else ("dp", "cp", "tp", "pp")


def collectives(mesh, tensors: int, local_batch: bool) -> list[tuple[str, int, float]]:
    """``(kind, group size, bytes gathered)`` of the gathers that compare a batch of ``tensors`` tensors."""
    return [("all_gather", mesh.degree(axis), 8.0 * _NUMBERS * tensors * mesh.degree(axis))
            for axis in batch_axes(local_batch) if mesh.degree(axis) > 1]
