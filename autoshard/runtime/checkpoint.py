"""Distributed checkpoints of a training run: parameters, optimizer state, random streams and the user's state.

Written with torch.distributed.checkpoint (DCP): each rank writes only its own shards, as DTensors on the
tp group (a fused q/k/v weight is written as one tensor per block, so its layout does not depend on the
degree) or, under FSDP2, as DTensors over (tp, dp x cp). Every per-parameter optimizer tensor (AdamW's
two moments, SGD's momentum) is written the same way as its parameter, under
``optim.state.<parameter name>.<key>``, so it moves with the parameter to any other mesh, with or without
FSDP2: on load every rank reads exactly the part it holds. Keys are the original model's parameter names.

Written once, by rank 0: ``autoshard.training``, a small record of the optimizer's kind, its
hyperparameters by group, every parameter's scalar state (AdamW's ``step``), the mesh and the steps
taken; and ``autoshard.extra``, the user's own state (``extra=``: the step, an LR scheduler's
``state_dict()``). Each rank writes its random streams under ``autoshard.rng.<rank>``: restored under the
same mesh; under another, every rank's stream is seeded from the saved seed, the steps taken and its rank
(dropout then draws other masks than an uninterrupted run would, which is exact only with dropout off).

Loading runs no code from the files: every record is numbers, strings, containers, dtypes and tensors, read
back with ``torch.load(weights_only=True)`` (``extra=`` holding anything else is refused when saving, naming the
key), and DCP's own metadata file is unpickled with only the classes it is made of. A checkpoint that names
anything else is refused.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import pickle
import warnings
from typing import NamedTuple

import torch
import torch.distributed.checkpoint as dcp

from autoshard.layout import ParamLayout
from autoshard.runtime import committed, optimizer_state, spread
from autoshard.runtime.gather import gather
from autoshard.runtime.state import _entries, _few, fsdp_part, rank_part

_BLOCK = "@block"
_OPTIM = "optim.state."
_TRAINING = "autoshard.training"
_EXTRA = "autoshard.extra"
_RNG = "autoshard.rng."


class Item(NamedTuple):
    """One tensor laid out as a parameter: its key in the checkpoint, this rank's tensor and how the parameter is
    held (``layout.name`` is its name in the captures)."""

    key: str
    local: torch.Tensor  # the parameter itself, or optimizer state of its (local) shape
    layout: ParamLayout


def save_checkpoint(pm, path: str, optimizer=None, extra: dict | None = None, asynchronous: bool = False,
                    keep: int | None = None):
    """Write this rank's shards of every parameter (and of the optimizer's state) to ``path`` (all ranks call).

    The checkpoint is written aside and renamed into place once complete (``committed``): a save killed at any
    point leaves the previous checkpoint loadable. With ``keep``, ``path`` is a root holding the newest ``keep``
    checkpoints (``step-<steps>``); ``load_checkpoint(root)`` takes the newest. With ``asynchronous``, the shards are
    copied to host memory and written in the background (``torch.distributed.checkpoint.async_save``, on a process
    group of its own so that training's collectives are not interleaved with it): returns a future whose
    ``result()`` waits for the write (and, on rank 0, puts the checkpoint in place).
    """
    path = committed.as_typed(path)
    final = committed.target(path, keep, pm.steps)
    partial = committed.begin(final, pm.rank)
    with spread.of(pm).whole(pm.store, optimizer):  # the view keeps the whole tensors; training swaps in others
        written = _save(pm, partial, optimizer, extra, asynchronous)

    def commit() -> None:
        if pm.rank == 0:
            committed.finish(partial, final, keep, path)

    if asynchronous:
        return committed.Pending(written, commit)
    commit()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank returns with the checkpoint in place
    return None


def _save(pm, path: str, optimizer, extra: dict | None, asynchronous: bool):
    schema = optimizer_state.merged_schema(pm, optimizer) if optimizer is not None else None
    items = _parameter_items(pm)
    if optimizer is not None:
        for _, name, param, layout in optimizer_state.held(pm, optimizer).values():
            for key, value in optimizer.state.get(param, {}).items():
                if key in schema.params[name].tensors:
                    items.append(Item(f"{_OPTIM}{name}.{key}", value, layout))
    if extra is not None:
        _check_extra(extra)
    view = _view(pm, items, for_load=False, metadata=None)
    if pm.rank == 0:
        view[_TRAINING] = _record({"mesh": str(pm.mesh), "steps": pm.steps, "seed": torch.initial_seed(),
                                   "optimizer": schema.to_record() if schema is not None else None})
        if extra is not None:
            view[_EXTRA] = _record(extra)
    view[f"{_RNG}{pm.rank}"] = _record(_rng_state(pm))
    if asynchronous:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(StagingOptions(False, False, False, False))  # plain host copies: CPU-only works
        view = {key: _own_storage(value) for key, value in view.items()}
        return dcp.async_save(view, checkpoint_id=path, process_group=_background_group(pm), async_stager=stager)
    dcp.save(view, checkpoint_id=path)
    return None


_BACKGROUND: dict = {}


def _own_storage(value):
    """A tensor that is part of another's storage (one block of a fused weight), copied out: the host staging of
    async_save copies whole storages and fails on a second view of one it has already staged."""
    if not isinstance(value, torch.Tensor):
        return value
    local = value.to_local() if hasattr(value, "to_local") else value
    if local.untyped_storage().nbytes() == local.numel() * local.element_size():
        return value
    if not hasattr(value, "to_local"):
        return local.clone()
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local.clone(), value.device_mesh, value.placements, run_check=False,
                              shape=value.shape, stride=value.stride())


def _background_group(pm):
    """A gloo group over every rank for checkpoints written in the background (made once, by every rank)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    key = id(pm.groups)
    if key not in _BACKGROUND:
        _BACKGROUND[key] = dist.new_group(backend="gloo", timeout=pm.groups.timeout)
    return _BACKGROUND[key]


def load_checkpoint(pm, path: str, optimizer=None) -> dict:
    """Read a checkpoint written under any mesh into this rank's shards (all ranks call); returns ``extra``.

    Every check (the files of every rank, this model's parameters, the optimizer's kind and groups) runs
    before the first collective."""
    path, metadata = _metadata(path)
    _check_matches(pm, path, metadata)
    training = _read_object(path, metadata, _TRAINING)
    schema = training.get("optimizer") if training else None
    schema = optimizer_state.Schema.from_record(schema) if schema is not None else None
    if optimizer is not None:
        _check_optimizer(pm, path, optimizer, schema)
    extra = _read_object(path, metadata, _EXTRA)  # every record read (and checked) before any tensor is
    with spread.of(pm).whole(pm.store, optimizer):  # each rank reads the whole weight, then keeps its rows
        _read(pm, path, optimizer, schema, metadata)
    if training:
        pm.steps = training["steps"]
        _restore_rng(pm, path, metadata, training)
    return extra if extra is not None else {}


def read_extra(path: str) -> dict:
    """The ``extra`` a checkpoint was saved with, read by this rank alone (no model needed, no collective)."""
    path, metadata = _metadata(path)
    extra = _read_object(path, metadata, _EXTRA)
    return extra if extra is not None else {}


def _metadata(path: str) -> tuple[str, dict]:
    """The complete checkpoint at ``path`` (or the newest under a root), its files checked, and DCP's metadata of
    its entries, read once its classes are known to be DCP's own."""
    path = committed.resolve(path)
    _check_metadata_classes(path)
    return path, dcp.FileSystemReader(path).read_metadata().state_dict_metadata


def _read(pm, path: str, optimizer, schema, metadata) -> None:
    """Read this rank's shards of the parameters (and of ``optimizer``'s state) from the checkpoint at ``path``."""
    items = _parameter_items(pm)
    states: dict[int, dict] = {}
    if optimizer is not None:
        items += _optimizer_items(pm, optimizer, schema, metadata, states)
    view = _view(pm, items, for_load=True, metadata=metadata)
    dcp.load(view, checkpoint_id=path, planner=_WeightsOnly())
    with torch.no_grad():
        for item in items:
            item.local.copy_(_read_local(pm, item, view, metadata))
    if optimizer is not None:
        _install(pm, optimizer, schema, states)


def _parameter_items(pm) -> list[Item]:
    return [Item(name, param, layout) for _, name, param, layout in _entries(pm)]


# ------------------------------------------------------------------------------------------ optimizer


def _check_optimizer(pm, path: str, optimizer, schema) -> None:
    if schema is None:
        raise ValueError(
            f"the checkpoint at {path} holds no optimizer state: it was saved without optimizer=. Load it without "
            "optimizer= (a fresh optimizer), or save with pm.save_checkpoint(path, optimizer=opt)")
    here = optimizer_state.kind(optimizer)
    if schema.kind != here:
        raise ValueError(f"the checkpoint at {path} holds the state of a {schema.kind}, not of a {here}: build the "
                         "optimizer the run was saved with")
    names = [name for _, name, _, _ in optimizer_state.held(pm, optimizer).values()]
    missing = [name for name in names if name not in schema.params]
    if missing:
        raise ValueError(f"the checkpoint at {path} holds no optimizer state for {_few(missing)}: the optimizer "
                         "that was saved did not train them; build it over the same parameters")


def _optimizer_items(pm, optimizer, schema, metadata, states: dict) -> list[Item]:
    """Tensors to read the optimizer's state into, laid out as their parameters; scalars go into ``states``."""
    items = []
    for _, name, param, layout in optimizer_state.held(pm, optimizer).values():
        saved = schema.params[name]
        values = {key: value.clone() if isinstance(value, torch.Tensor) else value
                  for key, value in saved.scalars.items()}
        for key, dtype in saved.tensors.items():
            values[key] = torch.zeros_like(param, dtype=dtype)
            items.append(Item(f"{_OPTIM}{name}.{key}", values[key], layout))
        if values:
            states[id(param)] = values
    return items


def _install(pm, optimizer, schema, states: dict) -> None:
    hyper_of = {id(param): schema.hyper_of(name)
                for _, name, param, _ in optimizer_state.held(pm, optimizer).values()}
    optimizer_state.install(optimizer, states, hyper_of)


# ------------------------------------------------------------------------------------- random streams


def _rng_state(pm) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if pm.device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(pm.device)
    return state


def _restore_rng(pm, path: str, metadata, training: dict) -> None:
    """This rank's saved streams under the same mesh; under another, a seed derived from the saved one."""
    saved = _read_object(path, metadata, f"{_RNG}{pm.rank}") if training["mesh"] == str(pm.mesh) else None
    if saved is None:
        digest = hashlib.sha256(f"{training['seed']}:{training['steps']}:{pm.rank}".encode()).digest()
        torch.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
        return
    torch.set_rng_state(saved["cpu"])
    if "cuda" in saved and pm.device.type == "cuda":
        torch.cuda.set_rng_state(saved["cuda"], pm.device)


def _read_object(path: str, metadata, key: str):
    """A record of the checkpoint, read by this rank alone (no collective); None when absent."""
    if key not in metadata:
        return None
    holder = {key: b""}
    try:
        with warnings.catch_warnings():  # DCP says, on every call, that no_dist reads in one process: as asked
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(holder, checkpoint_id=path, no_dist=True, planner=_WeightsOnly())
    except BaseException as e:  # DCP wraps what the weights-only load refused (a BaseException), per rank
        causes = [e, *(f[0] if isinstance(f, tuple) else f for f in getattr(e, "failures", {}).values())]
        if not any(isinstance(c, pickle.UnpicklingError) for c in causes):
            raise
        raise ValueError(f"the checkpoint at {path} holds a value ({key}) that is not plain data (it would run code "
                         "to load); refused. Checkpoints written by autoshard hold numbers, strings, containers and "
                         "tensors only") from None
    return _from_record(path, key, holder[key])


def _record(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _from_record(path: str, key: str, data) -> object:
    if not isinstance(data, bytes):
        raise ValueError(f"the checkpoint at {path} holds a {type(data).__name__} under {key}, not a record autoshard "
                         "writes: refused")
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"the checkpoint at {path} holds a record ({key}) that is not plain data (it would run code "
                         f"to load: {str(e).splitlines()[0][:200]}); refused. Checkpoints written by autoshard hold "
                         "numbers, strings, containers and tensors only") from e


def _check_extra(extra: dict) -> None:
    """Refuse, naming the key, an ``extra=`` value a weights-only load cannot read back (an object of a class)."""
    if not isinstance(extra, dict):
        raise TypeError(f"extra= must be a dict (the step, a scheduler's state_dict(), ...), not "
                        f"{type(extra).__name__}")
    for key, value in extra.items():
        try:
            torch.load(io.BytesIO(_record(value)), weights_only=True)
        except Exception as e:  # noqa: BLE001 - pickling or the weights-only unpickler refused it
            raise TypeError(f"extra[{key!r}] is a {type(value).__name__} (or holds an object of a class), which a "
                            "checkpoint cannot hold safely: loading it would have to run code. Give numbers, strings, "
                            "lists, dicts and tensors (an LR scheduler's state_dict(), not the scheduler)") from e


class _WeightsOnly(dcp.DefaultLoadPlanner):
    """DCP's loading with its non-tensor values read back weights-only (DCP's own unpickles them whole)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        read = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], read)
        else:
            self.state_dict[read_item.dest_index.fqn] = read


# DCP's metadata file is a pickle of these (and of dtypes): anything else in one is refused, not run
_METADATA_CLASSES = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                     ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("pathlib", "PosixPath"),
                     ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module == "torch.distributed.checkpoint.metadata" or (module, name) in _METADATA_CLASSES
                or module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def _check_metadata_classes(path: str) -> None:
    """Unpickle DCP's metadata file(s) with only the classes they are made of, before DCP reads them whole."""
    for name in sorted(os.listdir(path)):
        if not name.endswith(".metadata"):
            continue
        with open(os.path.join(path, name), "rb") as f:
            try:
                _MetadataUnpickler(f).load()
            except pickle.UnpicklingError as e:
                raise ValueError(f"the checkpoint at {path} has a metadata file ({name}) that names "
                                 f"{str(e).split(' is not')[0]}, which no checkpoint holds: loading it would run "
                                 "code; refused") from e


# -------------------------------------------------------------------------------------------- checks


def _check_matches(pm, path: str, metadata) -> None:
    """Refuse, before any collective, a checkpoint of another model: missing tensors or other shapes."""
    problems = []
    for _, name, _, layout in _entries(pm):
        expected = layout.shape
        blocks = _saved_blocks(metadata, name)
        if blocks:  # a fused tensor written block by block: the blocks hold its elements
            sizes = [tuple(metadata[f"{name}{_BLOCK}{i}"].size) for i in blocks]
            if sum(math.prod(s) for s in sizes) != math.prod(expected):
                problems.append(f"{name} is blocks {sizes} there, {expected} here")
        elif name not in metadata:
            problems.append(f"{name} is missing")
        elif tuple(metadata[name].size) != expected:
            problems.append(f"{name} is {tuple(metadata[name].size)} there, {expected} here")
    if problems:
        raise ValueError(
            f"the checkpoint at {path} was not written for this model: {'; '.join(problems[:4])}"
            f"{' ...' if len(problems) > 4 else ''}. Load a checkpoint saved from the same model (any mesh works)"
        )


# ---------------------------------------------------------------------------------- layout of tensors


def _is_fsdp(tensor) -> bool:
    return hasattr(tensor, "device_mesh")


def _fsdp_direct(item: Item, saved_blocks) -> bool:
    """Whether an FSDP2 shard is written and read as it is (not padded over tp, not blocked, here or there)."""
    return _is_fsdp(item.local) and saved_blocks is None and item.layout.tp_direct


def _view(pm, items: list[Item], *, for_load: bool, metadata) -> dict:
    """The state dict DCP reads or writes: DTensors on the tp group for shards, blocks as separate keys.

    On load, a tensor stored in another layout than this rank holds (blocked vs not) is read whole
    and cut here; everything else is read as exactly this rank's part. Under FSDP2 a tensor is
    written as a DTensor over (tp, dp x cp): sharded over tp as placed, then its dim 0 over dp x cp,
    so each rank writes only its FSDP2 shard. A blocked or padded one is gathered over dp x cp first
    and written as without FSDP2.
    """
    meshes: dict = {"tp": _tp_mesh(pm)}  # and the (tp, dp x cp) mesh for FSDP2 shards, the (ep, tp) mesh, made once
    view = {}
    for item in items:
        key, local, layout = item
        placement = layout.tp
        blocked_here = placement is not None and placement.blocks is not None
        saved = _saved_blocks(metadata, key) if for_load else None
        if _fsdp_direct(item, saved):
            view[key] = _fsdp_dtensor(pm, item, for_load, meshes)
            continue
        if _is_fsdp(local):  # the whole tp-local tensor, as without FSDP2
            local = torch.empty(local.shape, dtype=local.dtype) if for_load else local.full_tensor()
        if layout.padded:
            # a padded shard's layout depends on the degree: write and read the tensor whole
            view[key] = (torch.empty(layout.shape, dtype=local.dtype) if for_load
                         else gather(pm, layout.name, local.detach()))
            continue
        if layout.experts and "ep" not in meshes:
            meshes["ep"] = _ep_tp_mesh(pm)
        mesh, split = (meshes["ep"], True) if layout.experts else (meshes["tp"], False)
        same_layout = not for_load or (saved is not None) == blocked_here
        if blocked_here and same_layout:
            sizes = [b if i in placement.whole else b // pm.mesh.tp for i, b in enumerate(placement.blocks)]
            for i, part in enumerate(local.split(sizes, placement.dim)):  # a block held whole: written once
                whole = i in placement.whole
                view[f"{key}{_BLOCK}{i}"] = _dtensor(part, mesh, None if whole else placement.dim, for_load, split)
        elif (placement is not None or split) and same_layout:
            view[key] = _dtensor(local, mesh, placement.dim if placement is not None else None, for_load, split)
        elif not for_load:
            view[key] = local.detach()
        elif saved is not None:
            for i in saved:
                block = f"{key}{_BLOCK}{i}"
                view[block] = torch.empty(tuple(metadata[block].size), dtype=local.dtype)
        else:
            view[key] = torch.empty(tuple(metadata[key].size), dtype=local.dtype)
    return view


def _read_local(pm, item: Item, view: dict, metadata) -> torch.Tensor:
    """This rank's part of ``item`` (in the layout of ``item.local``) from what DCP read into ``view``."""
    key, local, layout = item
    if _fsdp_direct(item, _saved_blocks(metadata, key)):  # read as exactly this rank's part of its FSDP2 shard
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(view[key].to_local(), local.device_mesh, local.placements, run_check=False,
                                  shape=local.shape, stride=local.stride())
    part = rank_part(pm, layout, view[key]) if layout.padded else _assemble(pm, item, view, metadata)
    return fsdp_part(local, part)  # under FSDP2, this rank's part of the tp-local tensor


def _fsdp_dtensor(pm, item: Item, for_load: bool, meshes: dict):
    """An FSDP2 shard of a (tp-sharded) tensor as a DTensor of the whole tensor over (tp, dp x cp)."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor import Shard as DShard

    local = item.local.to_local()
    data = torch.empty_like(local) if for_load else local.detach()
    shape = item.layout.shape
    stride = torch.empty(shape, device="meta").stride()
    if pm.mesh.tp == 1:
        return DTensor.from_local(data, item.local.device_mesh, [DShard(0)], run_check=False, shape=shape,
                                  stride=stride)
    tp = DShard(item.layout.tp.dim) if item.layout.tp is not None else Replicate()
    if "tp x data" not in meshes:
        meshes["tp x data"] = _tp_data_mesh(pm)
    return DTensor.from_local(data, meshes["tp x data"], [tp, DShard(0)], run_check=False, shape=shape,
                              stride=stride)


def _tp_data_mesh(pm):
    """A DeviceMesh (tp, dp x cp) over this rank's pp coordinate, on the groups that already exist."""
    from torch.distributed.device_mesh import DeviceMesh

    tp, pp_index = pm.mesh.tp, pm.coord("pp")
    rows = pm.mesh.data_groups()[pp_index * tp:(pp_index + 1) * tp]  # row t: the data group of tp rank t
    layout = torch.tensor(rows, dtype=torch.int)
    groups = [pm.groups.group("tp"), pm.groups.group("data")]
    return DeviceMesh.from_group(groups, pm.device.type, mesh=layout, mesh_dim_names=("tp", "data"))


def _saved_blocks(metadata, key: str) -> list[int] | None:
    sizes, i = [], 0
    while f"{key}{_BLOCK}{i}" in metadata:
        sizes.append(i)
        i += 1
    return sizes or None


def _dtensor(local: torch.Tensor, mesh, dim: int | None, for_load: bool, experts: bool = False):
    """``local`` as this rank's part of a DTensor over tp: split along ``dim``, or replicated where None. With
    ``experts``, over (ep, tp): its experts (dim 0) split over ep first (a mesh of ep alone at tp=1)."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor import Shard as DShard

    data = torch.empty_like(local) if for_load else local.detach().contiguous()
    placements = [Replicate() if dim is None else DShard(dim)] if mesh.ndim == 1 + experts else []
    return DTensor.from_local(data, mesh, [DShard(0), *placements] if experts else placements, run_check=False)


def _ep_tp_mesh(pm):
    """A DeviceMesh (ep, tp) of the ranks that split this rank's experts and their tp shards (ep alone at tp=1)."""
    from torch.distributed.device_mesh import DeviceMesh

    rows = [[pm.mesh.rank_of(**{**pm.mesh.coords(peer), "tp": t}) for t in range(pm.mesh.tp)]
            for peer in pm.mesh.expert_group_of(pm.groups.rank)]
    if pm.mesh.tp == 1:
        return DeviceMesh.from_group(pm.groups.group("ep"), pm.device.type)
    groups = [pm.groups.group("ep"), pm.groups.group("tp")]
    return DeviceMesh.from_group(groups, pm.device.type, mesh=torch.tensor(rows, dtype=torch.int),
                                 mesh_dim_names=("ep", "tp"))


def _tp_mesh(pm):
    from torch.distributed.device_mesh import DeviceMesh

    if pm.mesh.tp == 1:
        return None
    return DeviceMesh.from_group(pm.groups.group("tp"), pm.device.type)


def _assemble(pm, item: Item, view: dict, metadata) -> torch.Tensor:
    """This rank's part of ``item`` from what DCP read into ``view``."""
    key, local, layout = item
    placement = layout.tp
    blocks = _saved_blocks(metadata, key)
    keys = [f"{key}{_BLOCK}{i}" for i in blocks] if blocks else [key]
    parts = [view[k].to_local() if hasattr(view[k], "to_local") else view[k] for k in keys]
    blocked_here = placement is not None and placement.blocks is not None
    if all(hasattr(view[k], "to_local") for k in keys):  # read as this rank's part already
        return torch.cat(parts, placement.dim) if blocked_here else parts[0]
    full = torch.cat(parts, _block_dim(metadata, key, local)) if blocks else parts[0]
    return rank_part(pm, layout, full)


def _block_dim(metadata, key: str, local: torch.Tensor) -> int:
    """The dim along which saved blocks were cut: the one where the blocks' sizes differ from each other's sum."""
    sizes = [tuple(metadata[f"{key}{_BLOCK}{i}"].size) for i in _saved_blocks(metadata, key)]
    for dim in range(len(sizes[0])):
        if len({s[dim] for s in sizes}) > 1 or sum(s[dim] for s in sizes) == local.shape[dim]:
            return dim
    return 0
