"""The optimizer's state of a parallel model, by the original model's parameter names.

A torch optimizer keeps, for each parameter it holds, a dict of state (AdamW: ``step``, ``exp_avg``,
``exp_avg_sq``; SGD: ``momentum_buffer``) and, for each group, its hyperparameters. Under autoshard a
rank's optimizer holds that rank's shards, so a state tensor of its parameter's shape is laid out
exactly as the parameter (the same tp blocks and vocabulary padding, the same FSDP2 split over dp x cp)
and moves with it between meshes. Every other entry must be a scalar (a 0-d tensor, a number, or
``None``) and is kept whole. An optimizer with other state (LBFGS's flat history, factored second
moments) is refused: its state has no layout to follow.

Full (unsharded) optimizer state uses PyTorch's convention of
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``: ``{"state": {name: {key: value}},
"param_groups": [{hyperparameters..., "params": [names]}]}``, so it moves to and from a single-process
optimizer with that module's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from autoshard.runtime import gather, spread
from autoshard.runtime.state import _entries, _few, fsdp_part, rank_part


@dataclass
class ParamState:
    """What the optimizer keeps for one parameter: the keys laid out as it, and its scalars."""

    group: int  # index into ``Schema.hyper``
    tensors: dict[str, torch.dtype] = field(default_factory=dict)
    scalars: dict[str, object] = field(default_factory=dict)


@dataclass
class Schema:
    """An optimizer's kind, hyperparameters and per-parameter state, keyed by the model's parameter names."""

    kind: str
    hyper: list[dict]
    params: dict[str, ParamState]

    def hyper_of(self, name: str) -> dict:
        return self.hyper[self.params[name].group]

    def to_record(self) -> dict:
        """Plain containers, numbers, strings, dtypes and tensors: what a weights-only load reads back."""
        return {"kind": self.kind, "hyper": self.hyper,
                "params": {name: {"group": p.group, "tensors": p.tensors, "scalars": p.scalars}
                           for name, p in self.params.items()}}

    @classmethod
    def from_record(cls, record: dict) -> Schema:
        return cls(record["kind"], record["hyper"], {name: ParamState(p["group"], p["tensors"], p["scalars"])
                                                     for name, p in record["params"].items()})


def kind(optimizer: torch.optim.Optimizer) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def held(pm, optimizer: torch.optim.Optimizer) -> dict[int, tuple]:
    """``id(parameter) -> (target, name, parameter, layout)`` for every parameter the optimizer holds.

    Refuses an optimizer that holds a tensor this rank's parameters do not include."""
    entries = {id(param): entry for entry in _entries(pm) for param in [entry[2]]}
    out = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in entries:
                raise ValueError(
                    f"the optimizer holds a tensor of shape {tuple(param.shape)} that is not one of this parallel "
                    "model's parameters: build it from pm.parameters() or pm.named_parameters() (each rank's shards; "
                    "for a model built on meta, after pm.materialize())"
                )
            out[id(param)] = entries[id(param)]
    return out


def local_schema(pm, optimizer: torch.optim.Optimizer) -> Schema:
    """This rank's optimizer as a ``Schema`` (its own parameters only); refuses state with no layout to follow."""
    hyper: list[dict] = []
    keys: dict[bytes, int] = {}
    params: dict[str, ParamState] = {}
    entries = held(pm, optimizer)
    for group in optimizer.param_groups:
        values = {k: v for k, v in group.items() if k != "params"}
        key = pickle.dumps(values)
        if key not in keys:
            keys[key] = len(hyper)
            hyper.append(values)
        for param in group["params"]:
            _, name, _, _ = entries[id(param)]
            params[name] = _param_state(optimizer, param, name, keys[key])
    return Schema(kind(optimizer), hyper, params)


def _param_state(optimizer, param, name: str, group: int) -> ParamState:
    out = ParamState(group)
    for key, value in optimizer.state.get(param, {}).items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape:
            out.tensors[key] = value.dtype
        elif isinstance(value, torch.Tensor) and value.dim() == 0:
            out.scalars[key] = value.detach().cpu().clone()
        elif value is None or isinstance(value, (bool, int, float)):
            out.scalars[key] = value
        else:
            what = (f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
                    else type(value).__name__)
            raise ValueError(
                f"{type(optimizer).__name__} keeps state {key!r} for {name} as {what}: autoshard moves optimizer "
                f"state that is a tensor of its parameter's shape ({tuple(param.shape)} on this rank) or a scalar, so "
                "that it follows the parameter's shards. Use an optimizer with per-parameter state (SGD, Adam, AdamW, "
                "Adagrad, RMSprop, ...)"
            )
    return out


def merged_schema(pm, optimizer: torch.optim.Optimizer) -> Schema:
    """The ``Schema`` of every rank's optimizer together (a collective over the world, after local checks)."""
    mine = local_schema(pm, optimizer)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    hyper: list[dict] = []
    keys: dict[bytes, int] = {}
    params: dict[str, ParamState] = {}
    for schema in everyone:
        if schema.kind != mine.kind:
            raise ValueError(f"the ranks' optimizers differ ({schema.kind} and {mine.kind}): build the same one "
                             "on every rank")
        for name, state in schema.params.items():
            values = schema.hyper[state.group]
            key = pickle.dumps(values)
            if key not in keys:
                keys[key] = len(hyper)
                hyper.append(values)
            params.setdefault(name, ParamState(keys[key], state.tensors, state.scalars))
    return Schema(mine.kind, hyper, params)


# ------------------------------------------------------------------------------------- full state dicts


def full_state_dict(pm, optimizer: torch.optim.Optimizer) -> dict:
    """The whole optimizer's state at full shapes, keyed by the model's parameter names (a collective)."""
    with spread.of(pm).whole(pm.store, optimizer):
        return _full_state_dict(pm, optimizer)


def _full_state_dict(pm, optimizer: torch.optim.Optimizer) -> dict:
    schema = merged_schema(pm, optimizer)
    keys = sorted({key for state in schema.params.values() for key in state.tensors})
    full = {key: gather.full_tensors(pm, lambda p, key=key: _state_tensor(optimizer, p, key)) for key in keys}
    order = [name for name, _ in pm.model.named_parameters() if name in schema.params]
    state = {}
    for name in order:
        own = schema.params[name]
        values = {key: full[key][name].clone() for key in own.tensors}  # not the live state of a replicated one
        values.update({key: value.clone() if isinstance(value, torch.Tensor) else value
                       for key, value in own.scalars.items()})
        if values:
            state[name] = values
    groups = [dict(values, params=[n for n in order if schema.params[n].group == i])
              for i, values in enumerate(schema.hyper)]
    return {"state": state, "param_groups": [g for g in groups if g["params"]]}


def _state_tensor(optimizer, param, key: str):
    value = optimizer.state.get(param, {}).get(key) if param in optimizer.state else None
    return value.detach() if isinstance(value, torch.Tensor) else None


def load_full_state_dict(pm, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    """Give this rank's optimizer its part of a full optimizer state dict keyed by parameter names."""
    if not isinstance(state_dict, dict) or set(state_dict) != {"state", "param_groups"}:
        raise ValueError("an optimizer state dict has the keys 'state' and 'param_groups'")
    if any(not isinstance(k, str) for k in state_dict["state"]) or any(
            not isinstance(p, str) for g in state_dict["param_groups"] for p in g["params"]):
        raise ValueError(
            "this optimizer state dict is keyed by positions (optimizer.state_dict()), which do not say which "
            "parameter each entry belongs to: pass torch.distributed.checkpoint.state_dict."
            "get_optimizer_state_dict(model, optimizer), keyed by the model's parameter names, or "
            "pm.optimizer_state_dict(optimizer)")
    with spread.of(pm).whole(pm.store, optimizer):
        _load_full_state_dict(pm, optimizer, state_dict)


def _load_full_state_dict(pm, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    group_of = {name: g for g in state_dict["param_groups"] for name in g["params"]}
    entries = held(pm, optimizer)
    missing = [name for _, name, _, _ in entries.values() if _lookup(pm, group_of, name) is None]
    if missing:
        raise ValueError(f"the optimizer state dict has no group for {_few(missing)}: pass the state of an optimizer "
                         "of this model (every parameter the optimizer holds)")
    states, hyper_of = {}, {}
    for _, name, param, layout in entries.values():
        hyper_of[id(param)] = {k: v for k, v in _lookup(pm, group_of, name).items() if k != "params"}
        saved = _lookup(pm, state_dict["state"], name) or {}
        values = {}
        for key, value in saved.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                if tuple(value.shape) != layout.shape:
                    raise ValueError(f"{name}'s optimizer state {key!r} has shape {tuple(value.shape)}, the parameter "
                                     f"{layout.shape}: pass the state of an optimizer of this model")
                value = _shard_like(param, rank_part(pm, layout, value).to(param.device))
            values[key] = value
        if values:
            states[id(param)] = values
    install(optimizer, states, hyper_of)


def _lookup(pm, table: dict, name: str):
    """``table``'s entry for parameter ``name`` under any of its names (a tied weight has several)."""
    for names in pm.names.values():
        if name in names:
            return next((table[n] for n in names if n in table), None)
    return table.get(name)


def _shard_like(param, local: torch.Tensor) -> torch.Tensor:
    """``local`` (the tp-local tensor) split as ``param`` is over dp x cp when FSDP2 holds it; a copy otherwise."""
    return fsdp_part(param, local) if hasattr(param, "device_mesh") else local.clone()


def install(optimizer: torch.optim.Optimizer, states: dict[int, dict], hyper_of: dict[int, dict]) -> None:
    """Replace the optimizer's state and hyperparameters: ``states`` and ``hyper_of`` by ``id(parameter)``.

    Through the optimizer's own ``load_state_dict``, which casts each tensor to its parameter's dtype and
    device as it would for a checkpoint of its own. A group whose parameters were saved with different
    hyperparameters is refused: its groups were not built as when the state was saved.
    """
    own = optimizer.state_dict()
    order = [param for group in optimizer.param_groups for param in group["params"]]
    groups = []
    for group, saved in zip(optimizer.param_groups, own["param_groups"], strict=True):
        found = {pickle.dumps(hyper_of[id(p)]): hyper_of[id(p)] for p in group["params"] if id(p) in hyper_of}
        if len(found) > 1:
            differ = sorted({k for a in found.values() for b in found.values() for k in a if a.get(k) != b.get(k)})
            raise ValueError(
                f"optimizer group {len(groups)} holds parameters that were saved with different hyperparameters "
                f"({', '.join(differ)}): build the optimizer's groups as when the state was saved (for example by "
                "the same rule over pm.named_parameters())")
        hyper = next(iter(found.values())) if found else {}
        groups.append({**saved, **hyper, "params": saved["params"]})
    index = {id(param): i for i, param in enumerate(order)}
    optimizer.load_state_dict({"state": {index[k]: v for k, v in states.items()}, "param_groups": groups})
