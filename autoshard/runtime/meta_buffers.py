"""Buffers of a model built on ``meta``: the values its materialised programs read.

A *buffer* is a module's tensor that is not trained. A persistent one is part of the model's state (its
``state_dict()``), so only that state can give its value; a non-persistent one (rotary tables, position
ids) is derived from the module's configuration, so the module that owns it can compute it again.

``resolve`` finds a real tensor for every buffer the programs hold on meta: the one the user gave, else
the owning module's own recomputation, by the first rule of ``REBUILDS`` that fills it. A rule counts only
when it fills every element the same way from two different placeholders (so a rule that leaves a buffer
alone, or writes half of it, is never taken for one that computed it), and it runs on a forked random
stream, so it draws nothing an initialiser would. Whatever cannot be found is named in one error.
``install`` then gives each buffer one tensor, shared by the programs and the model, as a model built
with real tensors shares its buffers with its captures.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import fx, nn

from autoshard.capture import MODEL_PREFIX


def resolve(model: nn.Module, programs: list[fx.GraphModule], device: torch.device,
            given: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A tensor on ``device`` for every buffer the programs hold on meta, by its name in the model."""
    needed: dict[str, torch.Tensor] = {}
    for gm in programs:
        for name, buffer in gm.named_buffers(remove_duplicate=False):
            if buffer.device.type == "meta":
                needed.setdefault(name.removeprefix(MODEL_PREFIX), buffer)
    values, problems = {}, []
    for name, meta in needed.items():
        if name in given:
            if tuple(given[name].shape) != tuple(meta.shape):
                problems.append(f"{name}: given with shape {tuple(given[name].shape)}, the model's is "
                                f"{tuple(meta.shape)}")
            else:
                values[name] = given[name].detach().to(device=device, dtype=meta.dtype, copy=True)
    owners: dict[str, list[str]] = {}
    for name in needed:
        if name not in values and name not in given:
            owners.setdefault(name.rpartition(".")[0], []).append(name)
    for path, names in owners.items():
        rebuilt, why = _rebuild(model, path, [n.rpartition(".")[2] for n in names], needed, device)
        values.update(rebuilt)
        problems += why
    if problems:
        raise ValueError(_refusal(device, [n for n in needed if n not in values], problems))
    return values


def install(model: nn.Module, programs: list[fx.GraphModule], values: dict[str, torch.Tensor],
            device: torch.device) -> None:
    """Put ``values`` into the programs and the model (one tensor per buffer); move other buffers to ``device``."""
    for name, value in values.items():
        owner, attr = _owner(model, name)
        if owner is not None:
            owner.register_buffer(attr, value, persistent=attr not in owner._non_persistent_buffers_set)
    for gm in programs:
        for name, buffer in list(gm.named_buffers(remove_duplicate=False)):
            value = values.get(name.removeprefix(MODEL_PREFIX))
            if value is None and buffer.device != device:  # real data (autoshard's own masks, say): move it
                value = buffer.to(device)
            if value is not None:
                owner, _, attr = name.rpartition(".")
                (gm.get_submodule(owner) if owner else gm).register_buffer(attr, value, persistent=False)


def _refusal(device: torch.device, missing: list[str], problems: list[str]) -> str:
    them = "it" if len(missing) == 1 else "them"
    return (
        f"materialize({str(device)!r}): the programs read {len(missing)} buffer(s) of the model that are on meta, "
        f"and autoshard cannot compute {them}:\n  " + "\n  ".join(problems)
        + "\nPass their values: materialize(buffers={" + ", ".join(f"{n!r}: tensor" for n in missing) + "}), "
        "e.g. dict(model.named_buffers()) of the model built on the CPU, or the entries of the state dict you load; "
        "or let the module compute its non-persistent buffers: keep its constructor's arguments as attributes of "
        "the same names, or give it init_weights(buffer_device=None)"
    )


# ------------------------------------------------------------------------------------------------ rebuilding


def _rebuild(model: nn.Module, path: str, attrs: list[str], needed: dict[str, torch.Tensor],
             device: torch.device) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The buffers ``attrs`` of the module at ``path`` that the module computes; and why not, for the others."""
    full = [f"{path}.{a}" if path else a for a in attrs]
    try:
        module = model.get_submodule(path)
    except AttributeError:
        module = None
    if module is None or any(a not in module._buffers for a in attrs):
        return {}, [f"{', '.join(full)}: not buffers of the model (tensors its forward made on meta?)"]
    owner = f"of {type(module).__name__}{f' at {path}' if path else ''}"
    persistent = [n for a, n in zip(attrs, full, strict=True) if a not in module._non_persistent_buffers_set]
    problems = [f"{', '.join(persistent)} ({owner}): persistent, so part of the model's state, which only a state "
                "dict holds"] if persistent else []
    attrs = [a for a in attrs if a in module._non_persistent_buffers_set]
    full = [n for n in full if n not in persistent]
    if not attrs:
        return {}, problems
    reasons = []
    for what, rule in REBUILDS:
        first = _attempt(rule, model, path, module, attrs, needed, full, device, fill=0)
        if isinstance(first, str):
            reasons.append(f"{what}: {first}")
            continue
        second = _attempt(rule, model, path, module, attrs, needed, full, device, fill=1)
        if isinstance(second, dict) and all(torch.equal(first[n], second[n]) for n in full):
            return first, problems
        reasons.append(f"{what}: {second if isinstance(second, str) else 'it left some elements as they were'}")
    them = "it" if len(attrs) == 1 else "them"
    return {}, [*problems, f"{', '.join(full)} ({owner}): non-persistent, but nothing computes {them}: "
                           + "; ".join(reasons)]


def _attempt(rule: Callable, model: nn.Module, path: str, module: nn.Module, attrs: list[str],
             needed: dict[str, torch.Tensor], full: list[str], device: torch.device, *, fill: int):
    """Run ``rule`` on ``module`` with its buffers ``attrs`` set to ``fill``; the values it leaves, or why not."""
    saved = {a: module._buffers[a] for a in attrs}
    for attr, name in zip(attrs, full, strict=True):
        module._buffers[attr] = torch.full(needed[name].shape, fill, dtype=needed[name].dtype, device=device)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            why = rule(model, path, module, attrs, device)
        if why is not None:
            return why
        values = {}
        for attr, name in zip(attrs, full, strict=True):
            value = module._buffers.get(attr)
            if not isinstance(value, torch.Tensor) or value.device.type == "meta" or value.shape != needed[name].shape:
                return f"it left {attr} {'on meta' if isinstance(value, torch.Tensor) else 'unset'} or of another shape"
            values[name] = value.detach().to(device=device, dtype=needed[name].dtype, copy=True)
        return values
    except Exception as e:  # noqa: BLE001 - a rule that fails is one that does not apply; the error says why
        return f"it raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        module._buffers.update(saved)


def _hf_init_weights(model: nn.Module, path: str, module: nn.Module, attrs: list[str], device: torch.device):
    """HuggingFace: the nearest enclosing model's ``_init_weights(module)`` (how ``from_pretrained`` fills them)."""
    parts = path.split(".") if path else []
    for i in range(len(parts), -1, -1):
        above = model.get_submodule(".".join(parts[:i]))
        if callable(getattr(above, "_init_weights", None)):
            above._init_weights(module)
            return None
    return "no model above it defines one"


def _init_weights_buffer_device(model: nn.Module, path: str, module: nn.Module, attrs: list[str],
                                device: torch.device):
    """torchtitan: the module's ``init_weights(buffer_device=...)``, which recomputes its buffers there."""
    init = getattr(module, "init_weights", None)
    if not callable(init) or "buffer_device" not in inspect.signature(init).parameters:
        return "it has none"
    init(buffer_device=device)
    return None


def _construct_again(model: nn.Module, path: str, module: nn.Module, attrs: list[str], device: torch.device):
    """Any module without parameters: its constructor called again on ``device``, with the arguments it kept.

    An argument is found as the module's attribute of the same name; the rebuilt module must then agree with
    the original in every plain attribute, so an argument kept under another name is caught, not defaulted.
    """
    if next(module.parameters(), None) is not None:
        return "it holds parameters, which building it again would allocate in full"
    kept = {k: v for k, v in vars(module).items() if not k.startswith("_")}
    args, kwargs = [], {}
    for name, p in list(inspect.signature(type(module).__init__).parameters.items())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if name in kept and p.kind == p.POSITIONAL_ONLY:
            args.append(kept[name])
        elif name in kept:
            kwargs[name] = kept[name]
        elif p.default is p.empty:
            return f"it takes {name!r}, which the module does not keep as an attribute"
    with torch.device(device):
        fresh = type(module)(*args, **kwargs)
    differ = [k for k in sorted(set(kept) | set(vars(fresh))) if not k.startswith("_")
              and not _same(kept.get(k), vars(fresh).get(k))]
    if differ:
        return (f"built again from {', '.join(kwargs) or 'no arguments'}, it differs in {', '.join(differ)} "
                "(an argument kept under another name?)")
    for attr in attrs:
        module._buffers[attr] = fresh._buffers.get(attr)
    return None


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return True  # a plain tensor attribute is on meta in the model: nothing to compare
    if inspect.ismethod(a) and inspect.ismethod(b):
        return a.__func__ is b.__func__
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an attribute without a truthy == compares by identity
        return a is b


# what can compute a module's non-persistent buffers, tried in order (the error names why each did not)
REBUILDS: tuple[tuple[str, Callable], ...] = (
    ("HuggingFace's _init_weights(module)", _hf_init_weights),
    ("init_weights(buffer_device=...)", _init_weights_buffer_device),
    ("its constructor, called again", _construct_again),
)


def _owner(model: nn.Module, name: str) -> tuple[nn.Module | None, str]:
    path, _, attr = name.rpartition(".")
    try:
        owner = model.get_submodule(path) if path else model
    except AttributeError:
        return None, attr
    return (owner, attr) if attr in owner._buffers else (None, attr)
