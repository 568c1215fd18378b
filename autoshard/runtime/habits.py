"""PyTorch's habits applied to a parallel model: made exact, or refused where they would train something else.

After ``parallelize`` a rank trains its own tensors (``pm.parameters()``: its shards of a split parameter, its
stages' under pp). The user's model keeps its parameters as they were, so three habits would go wrong silently:

- An optimizer over ``model.parameters()`` (built before or after ``parallelize``, as FSDP2 users write it) would
  step the model's tensors, which get no gradient, and never the tensors that train. At its first step (torch's
  global step hook) it is made to hold this rank's tensors instead, group by group (the groups' options kept), as
  an optimizer over ``pm.parameters()`` would; one that has already stepped those parameters is refused.
- ``torch.nn.utils.clip_grad_norm_`` over ``pm.parameters()`` or ``model.parameters()`` would clip each rank by
  its own shards' norm: it takes the global norm (``pm.clip_grad_norm_``); over part of them where they are split
  it is refused.
- The model itself (``model(x)``, ``model.generate``, ``model.state_dict()``, ``save_pretrained``) would compute
  with the weights from before training, differently on each rank. Once this rank's tensors have changed, calling
  the model or reading its state is refused until ``pm.update_model()`` (every rank) writes the trained weights
  into it; the HF Trainer calls that at the end of ``train()``.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

_LIVE: weakref.WeakSet = weakref.WeakSet()  # the parallel models of this process
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> (builds, the ids it held) checked
_BUILDS = 0  # builds made in this process so far: a new one may train tensors an optimizer checked before holds
_WRITTEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # pm -> {id(its tensor): version} when written
_HOOK = None
_OWN_USE = 0  # > 0 while autoshard itself reads the model (its state dict, to gather or load)
_torch_clip = torch.nn.utils.clip_grad_norm_


def watch(pm: nn.Module) -> None:
    """Apply this module's habits to ``pm`` and the model it was made from, from now on."""
    global _HOOK
    _LIVE.add(pm)
    _WRITTEN[pm] = {}
    pm.model.register_forward_pre_hook(_Stale(pm, "called"))
    pm.model.register_state_dict_pre_hook(_Stale(pm, "read (state_dict, save_pretrained)"))
    if _HOOK is None:
        _HOOK = register_optimizer_step_pre_hook(_check)
        torch.nn.utils.clip_grad_norm_ = clip_grad_norm_


# ------------------------------------------------------------------------------- the tensors that train

def trained_for(pm) -> dict[int, torch.Tensor | None]:
    """The ids of the user's model's parameters that this rank does not train itself -> the tensor that trains it
    here (its shard, its FSDP shard, its ep experts), or None where another rank trains it (another stage's)."""
    if not pm.builds:
        return {}
    here = dict(pm.named_parameters(remove_duplicate=False))
    anywhere = {name for every in pm.names.values() for name in every}
    out: dict[int, torch.Tensor | None] = {}
    for name, param in pm.model.named_parameters(remove_duplicate=False):
        mine = here.get(name)
        if mine is not param and (mine is not None or name in anywhere):
            out[id(param)] = mine
    return out


def take_over(optimizer: torch.optim.Optimizer, pm) -> None:
    """Make ``optimizer``'s groups hold this rank's tensors where they hold the model's parameters that those
    tensors train (dropping those another rank trains): it then steps what ``pm.step`` computes gradients for."""
    trains = trained_for(pm)
    found = [p for group in optimizer.param_groups for p in group["params"] if id(p) in trains]
    if not found:
        return
    stepped = [p for p in found if optimizer.state.get(p)]
    if stepped:
        names = {id(p): n for n, p in pm.model.named_parameters(remove_duplicate=False)}
        raise ValueError(
            f"this {type(optimizer).__name__} has already stepped parameters of the model given to "
            f"autoshard.parallelize ({_few(sorted(names[id(p)] for p in stepped))}): its state is of the whole "
            "tensors, while this rank trains its own tensors for them (its shards under tp, FSDP or ep, its stages "
            "under pp). Build a new optimizer after parallelize (over model.parameters() or pm.parameters()), "
            "and train from there")
    placed: set[int] = set()
    for group in optimizer.param_groups:
        held = []
        for param in group["params"]:
            param = trains.get(id(param), param)
            if param is not None and id(param) not in placed:  # (a tied weight: one tensor, stepped once)
                placed.add(id(param))
                held.append(param)
        group["params"] = held


def _check(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    held = frozenset(id(p) for group in optimizer.param_groups for p in group["params"])
    if _CHECKED.get(optimizer) == (_BUILDS, held):
        return
    for pm in [pm for pm in list(_LIVE) if pm.builds]:
        take_over(optimizer, pm)
    _CHECKED[optimizer] = (_BUILDS, frozenset(id(p) for group in optimizer.param_groups for p in group["params"]))


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """torch's ``clip_grad_norm_``; over a parallel model's parameters (or its model's), by the norm of the whole
    model's gradient over every rank (a collective: every rank calls it, as every rank runs the loop)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    held = {id(p) for p in params}
    for pm in [pm for pm in list(_LIVE) if pm.builds]:
        mine = {id(p) for p in pm.parameters()}
        theirs = {id(p) for p in pm.model.parameters()}
        if not held & (mine | theirs):
            continue
        if held in (mine, theirs) and float(norm_type) == 2.0:
            return pm.clip_grad_norm_(max_norm)
        if pm.mesh.world_size > pm.mesh.dp or pm.options.data_parallel == "fsdp" or held & theirs - mine:
            raise ValueError(
                "torch.nn.utils.clip_grad_norm_ over part of a parallel model's parameters, or by a norm other than "
                "2, would clip each rank by its own shards' norm (this rank holds only its part of each split "
                "parameter and of the pipeline): pass pm.parameters(), all of them (the global L2 norm is taken over "
                "every rank), or call pm.clip_grad_norm_(max_norm)")
    return _torch_clip(params, max_norm, norm_type, error_if_nonfinite, foreach)


# ------------------------------------------------------------------------------------- the model object

def written(pm) -> None:
    """The model holds the weights ``pm``'s tensors hold now (after ``pm.update_model()``, or as built)."""
    _WRITTEN[pm] = {id(p): p._version for p in pm.parameters()}


def built(pm) -> None:
    """The tensors of a new build hold the model's weights."""
    global _BUILDS
    _BUILDS += 1
    versions = _WRITTEN.setdefault(pm, {})
    for param in pm.parameters():
        versions.setdefault(id(param), param._version)


def stale(pm) -> bool:
    """Whether this rank's tensors have changed since they were the model's weights, where they are not the
    model's own tensors (under dp alone the model trains in place and is never stale)."""
    versions = _WRITTEN.get(pm, {})
    changed = any(versions.get(id(p), -1) != p._version for p in pm.parameters())
    return changed and bool(trained_for(pm))


@contextlib.contextmanager
def own_use():
    """autoshard reading the model's state itself (to gather it, to load into it): not the user's habit."""
    global _OWN_USE
    _OWN_USE += 1
    try:
        yield
    finally:
        _OWN_USE -= 1


class _Stale:
    """A hook on the user's model: refuses to run or give its state once its weights are not the trained ones."""

    def __init__(self, pm, what: str) -> None:
        self.pm = weakref.ref(pm) if pm is not None else None
        self.model = weakref.ref(pm.model) if pm is not None else None
        self.what = what

    def __call__(self, module: nn.Module, *args) -> None:
        pm = self.pm() if self.pm is not None else None
        if pm is None or module is not self.model() or _OWN_USE or torch.compiler.is_exporting() or not pm.builds:
            return  # (a copy of the model, autoshard's own capture or gather)
        if stale(pm):
            raise RuntimeError(
                f"this {type(module).__name__} was given to autoshard.parallelize and is {self.what} with the "
                "weights it had then: this rank trains its own tensors for its parameters (its shards under tp, "
                "FSDP or ep, its stages under pp), not the model's. Call pm.update_model() on every rank first (it "
                "gathers the trained weights into the model), or use the parallel model: pm(...), "
                "pm.state_dict(), pm.save_pretrained(dir)")

    def __reduce__(self):  # a pickled model's hook does nothing (the parallel model is not pickled with it)
        return _Stale, (None, self.what)


def _few(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
