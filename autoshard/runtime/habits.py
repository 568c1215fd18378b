"""PyTorch's habits applied to a parallel model: refused where they would train something else, or made exact.

After ``parallelize`` a rank trains its own tensors (``pm.parameters()``: its shards of a split parameter, its
stages' under pp). A parameter of the user's model that such a tensor stands for is left as it was: an optimizer
over ``model.parameters()`` (built before or after ``parallelize``, as FSDP2 users write it) would step it with no
gradient and never step the tensor that trains, so the split parameters would not train at all, with no error.
Every optimizer's ``step`` is checked once per set of tensors it holds (``torch.optim``'s global step hook).

``torch.nn.utils.clip_grad_norm_(pm.parameters(), max_norm)``, the call every PyTorch loop writes, would clip each
rank by its own shards' norm: over a parallel model's parameters it takes the global norm
(``pm.clip_grad_norm_``), and over part of them where they are split it is refused.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

_LIVE: weakref.WeakSet = weakref.WeakSet()  # the parallel models of this process
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> the ids of the tensors it held
_HOOK = None
_torch_clip = torch.nn.utils.clip_grad_norm_


def watch(pm: nn.Module) -> None:
    """Check every optimizer's step against ``pm``'s stand-ins, and clip its gradients by their global norm, from
    now on."""
    global _HOOK
    _LIVE.add(pm)
    if _HOOK is None:
        _HOOK = register_optimizer_step_pre_hook(_check)
        torch.nn.utils.clip_grad_norm_ = clip_grad_norm_


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """torch's ``clip_grad_norm_``; over a parallel model's parameters, by the norm of the whole model's gradient
    over every rank (a collective: every rank calls it, as every rank runs the loop)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    held = {id(p) for p in params}
    for pm in [pm for pm in list(_LIVE) if pm.builds]:
        mine = {id(p) for p in pm.parameters()}
        if not held & mine:
            continue
        split = pm.mesh.world_size > pm.mesh.dp or pm.options.data_parallel == "fsdp"
        if held == mine and float(norm_type) == 2.0:
            return pm.clip_grad_norm_(max_norm)
        if split:
            raise ValueError(
                "torch.nn.utils.clip_grad_norm_ over part of a parallel model's parameters, or by a norm other than "
                "2, would clip each rank by its own shards' norm (this rank holds only its part of each split "
                "parameter and of the pipeline): pass pm.parameters(), all of them (the global L2 norm is taken over "
                "every rank), or call pm.clip_grad_norm_(max_norm)")
    return _torch_clip(params, max_norm, norm_type, error_if_nonfinite, foreach)


def stand_ins(pm) -> dict[int, str]:
    """The ids of the user's model's parameters that a different tensor of ``pm`` trains, with their names."""
    if not pm.builds:
        return {}
    trained = {name: param for name, param in pm.named_parameters(remove_duplicate=False)}
    return {id(param): name for name, param in pm.model.named_parameters(remove_duplicate=False)
            if name in trained and trained[name] is not param}


def _check(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    held = frozenset(id(p) for group in optimizer.param_groups for p in group["params"])
    if _CHECKED.get(optimizer) == held:
        return
    live = [pm for pm in list(_LIVE) if pm.builds]
    trained = {id(p) for pm in live for p in pm.parameters()}  # (a model parallelized twice: either one's)
    for pm in live:
        stale = stand_ins(pm)
        found = [stale[i] for i in held if i in stale and i not in trained]
        if found:
            shown = ", ".join(sorted(found)[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
            raise ValueError(
                f"this {type(optimizer).__name__} holds parameters of the model given to autoshard.parallelize "
                f"({shown}), which this rank does not train: it trains its own tensors for them (its shards under "
                "tp, FSDP or ep), so the optimizer would never step those and the model would not learn. Build the "
                "optimizer over the parallel model: torch.optim.AdamW(pm.parameters()), or groups from "
                "pm.named_parameters() (the model's own names)")
    _CHECKED[optimizer] = held
