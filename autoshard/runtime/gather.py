"""Full tensors from this rank's shards: parameters and gradients at the original model's shapes and names.

A parameter is held as a tp shard (``Shard`` placements of the tp plan, fused blocks and padded vocabularies
included), possibly further split over dp x cp by FSDP2, and only on the pipeline ranks whose stages read
it. ``full_tensors`` gathers all of that back, so every rank sees the whole model's tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from autoshard.passes.collectives import unshard
from autoshard.runtime import spread


def full_tensors(pm, read: Callable) -> dict[str, torch.Tensor | None]:
    """``read(parameter)`` of every parameter at full shape, keyed by all of the original model's names.

    Gathered over tp; under pp every rank contributes the parameters of its stages (and the spread ones whole).
    """
    with spread.of(pm).whole(pm.store):
        return _full_tensors(pm, read)


def _full_tensors(pm, read: Callable) -> dict[str, torch.Tensor | None]:
    store = pm.store
    names = pm.names
    mine = {}
    for target in sorted(names):
        local = store.find(target)
        if pm.layout(target).holder is not None:  # every rank of the ep group takes part
            mine[target] = _from_holder(pm, pm.layout(target), read(local) if local is not None else None)
        elif local is not None:
            mine[target] = gather(pm, target, read(local))
    if pm.mesh.pp > 1:
        everyone: list = [None] * pm.mesh.pp
        # on the CPU: a pickled CUDA tensor would unpickle onto the sender's GPU index
        dist.all_gather_object(everyone, {t: v.detach().cpu() if v is not None else None for t, v in mine.items()},
                               group=pm.groups.group("pp"))
        mine = {t: v for part in everyone for t, v in part.items()}
    # A parameter the graph never reads is held by no program: report the model's own (never trained) tensor.
    own = dict(pm.model.named_parameters(remove_duplicate=False))
    return {name: mine[target] if target in mine else read(own[name]) for target, every in names.items()
            for name in every}


def _from_holder(pm, layout, value: torch.Tensor | None) -> torch.Tensor | None:
    """A parameter one ep rank holds alone (an expert held as a module of a list), sent by it to its ep group."""
    holder = pm.mesh.expert_group_of(pm.groups.rank)[layout.holder]
    box = [value.detach().cpu() if value is not None else None]
    dist.broadcast_object_list(box, src=holder, group=pm.groups.group("ep"))
    return box[0].to(pm.device) if box[0] is not None else None


def gather(pm, target: str, local: torch.Tensor | None) -> torch.Tensor | None:
    """Parameter ``target`` (its name in the captures) at full shape from this rank's ``local`` part of it."""
    if local is not None and hasattr(local, "full_tensor"):  # sharded over dp x cp by FSDP2
        local = local.full_tensor()
    layout = pm.layout(target)
    if local is not None and layout.experts:  # this ep rank's experts: join every ep rank's on dim 0
        parts = [torch.empty_like(local) for _ in range(pm.mesh.ep)]
        dist.all_gather(parts, local.contiguous(), group=pm.groups.group("ep"))
        local = torch.cat(parts, 0)
    placement = layout.tp
    if local is None or placement is None:
        return local
    parts = [torch.empty_like(local) for _ in range(pm.mesh.tp)]
    dist.all_gather(parts, local.contiguous(), group=pm.groups.group("tp"))
    full = unshard(parts, placement.dim, placement.blocks, placement.whole)
    return full.narrow(placement.dim, 0, layout.shape[placement.dim])  # drop vocab padding
