"""An optimizer over the user's model instead of the parallel model: refused at its first step, naming the tensors.

After ``parallelize`` a rank trains its own tensors (``pm.parameters()``: its shards of a split parameter, its
stages' under pp). A parameter of the user's model that such a tensor stands for is left as it was: an optimizer
over ``model.parameters()`` (built before or after ``parallelize``, as FSDP2 users write it) would step it with no
gradient and never step the tensor that trains, so the split parameters would not train at all, with no error.
Every optimizer's ``step`` is checked once per set of tensors it holds (``torch.optim``'s global step hook).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

_LIVE: weakref.WeakSet = weakref.WeakSet()  # the parallel models of this process
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> the ids of the tensors it held
_HOOK = None


def watch(pm: nn.Module) -> None:
    """Check every optimizer's step against ``pm``'s stand-ins from now on."""
    global _HOOK
    _LIVE.add(pm)
    if _HOOK is None:
        _HOOK = register_optimizer_step_pre_hook(_check)


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
