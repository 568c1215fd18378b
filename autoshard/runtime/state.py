"""Training state across ranks: global-norm clipping, full state dicts, and distributed checkpoints.

Every parameter of the original model is held by the ranks of one pp coordinate (two for a tied
weight used on two stages), as whole tensors or tp shards, replicated over dp x cp (or, under FSDP2,
split along dim 0 over dp x cp). So a global quantity counts each tensor once: a tp-replicated tensor
contributes from every tp rank divided by the degree, a tied one only on the first pp rank that holds
it, and nothing is summed over dp x cp (their gradients were already reduced) unless FSDP2 split it.

Checkpoints use torch.distributed.checkpoint: each rank writes only its own shards, as DTensors on
the tp group (a fused q/k/v weight is written as one tensor per block, so its layout does not
depend on the degree) or, under FSDP2, as DTensors over (tp, dp x cp), and a checkpoint loads under
any other mesh, with or without FSDP2: every rank reads exactly the part it holds.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from autoshard.passes.collectives import shard
from autoshard.passes.placements import Shard
from autoshard.runtime import meta_buffers
from autoshard.runtime.gather import gather

_BLOCK = "@block"


def _entries(pm):
    """(target, original name, local parameter, placement) for every parameter this rank holds."""
    store = pm.replica.store
    for target, names in pm.names.items():
        local = store.find(target)
        if local is None:
            continue
        placement = pm.plan.params[target].placement if pm.plan is not None else None
        yield target, names[0], local, placement if isinstance(placement, Shard) else None


def clip_grad_norm_(pm, max_norm: float, eps: float = 1e-6) -> torch.Tensor:
    """Scale every gradient so that the global norm is at most ``max_norm``; returns the norm before."""
    total = torch.zeros((), dtype=torch.float64, device=pm.device)
    tied = pm.pipeline.tied if pm.pipeline is not None else {}
    pp_index = pm.coord("pp")
    for target, _, param, placement in _entries(pm):
        if param.grad is None:
            continue
        if target in tied and pp_index != min(tied[target]):
            continue
        weight = 1.0 if placement is not None else 1.0 / pm.mesh.tp
        grad = param.grad.detach()
        grad = grad.to_local() if hasattr(grad, "to_local") else grad  # an FSDP2 shard over dp x cp
        total += weight * grad.double().pow(2).sum()
    axes = ("tp", "pp", "data") if pm.sync.sharded else ("tp", "pp")
    for axis in axes:
        if (pm.mesh.dp * pm.mesh.cp if axis == "data" else pm.mesh.degree(axis)) > 1:
            dist.all_reduce(total, group=pm.groups.group(axis))
    norm = total.sqrt().float()
    coef = max_norm / (norm.item() + eps)
    if coef < 1.0:
        for _, _, param, _ in _entries(pm):
            if param.grad is not None:
                param.grad.mul_(coef)
    return norm


def state_dict(pm) -> dict[str, torch.Tensor]:
    """The original model's ``state_dict()``: exactly its keys, in its order, every parameter at full shape.

    The keys are what ``model.state_dict()`` gives (persistent buffers only, a tied weight under every name
    it lists, extra state, its hooks' renames), so the result loads with ``strict=True`` into the unmodified
    model. Parameters are gathered from the ranks' shards (a collective: every rank calls); buffers are the
    model's own, which its programs share.
    """
    full = pm.full_parameters()
    name_of: dict[int, str] = {}
    for name, param in pm.model.named_parameters(remove_duplicate=False):
        name_of.setdefault(id(param), name)
    own = pm.model.state_dict(keep_vars=True)  # the model's tensors themselves: a parameter is known by identity
    out: dict[str, torch.Tensor] = OrderedDict()
    for key, value in own.items():
        name = name_of.get(id(value), key)
        if name in full:
            out[key] = full[name]
        else:
            out[key] = value.detach() if isinstance(value, torch.Tensor) else value
    out._metadata = getattr(own, "_metadata", None)  # the modules' versions, which load_state_dict reads
    return out


def load_state_dict(pm, state: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Load a full state dict of the original model (its keys and shapes): each rank keeps its shards.

    As ``model.load_state_dict``: with ``strict`` a missing or an unexpected key is an error naming them all.
    """
    tp_rank, size = pm.coord("tp"), pm.mesh.tp
    missing = [name for _, name, _, _ in _entries(pm) if name not in state]
    unexpected = sorted(set(state) - set(pm.model.state_dict()))
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"loading a state dict into {type(pm.model).__name__}: missing keys {_few(missing)}, unexpected keys "
            f"{_few(unexpected)}: pass this model's state dict (model.state_dict() or pm.state_dict()), or strict=False"
        )
    with torch.no_grad():
        for target, name, param, placement in _entries(pm):
            if name not in state:
                continue
            full = state[name]
            if tuple(full.shape) != pm.full_shape(target):
                raise ValueError(f"{name} has shape {tuple(full.shape)} in the state dict, the model expects "
                                 f"{pm.full_shape(target)}")
            local = _local_part(full, placement, tp_rank, size)
            if hasattr(param, "device_mesh"):  # an FSDP2 shard over dp x cp
                from torch.distributed.tensor import distribute_tensor

                local = distribute_tensor(local, param.device_mesh, param.placements)
            param.copy_(local)
        buffers = {k: v for k, v in state.items() if k in dict(pm.model.named_buffers())}
        for key, value in buffers.items():
            _set_buffer(pm.model, key, value)


def _few(names: list[str]) -> str:
    return f"{names[:5]}{'...' if len(names) > 5 else ''}"


def _local_part(full: torch.Tensor, placement: Shard | None, rank: int, size: int) -> torch.Tensor:
    """This tp rank's part of a full tensor (padded up first when the degree does not divide the dim)."""
    if placement is None:
        return full
    from autoshard.passes.tensor_parallel import _pad

    return shard(_pad(full, placement.dim, size), placement.dim, rank, size, placement.blocks)


def _set_buffer(model: torch.nn.Module, key: str, value: torch.Tensor) -> None:
    owner, _, attr = key.rpartition(".")
    getattr(model.get_submodule(owner) if owner else model, attr).copy_(value)


# -------------------------------------------------------------------------------------------- checkpoints


def save_checkpoint(pm, path: str) -> None:
    """Write this rank's shards of every parameter to a distributed checkpoint at ``path`` (all ranks call)."""
    dcp.save(_checkpoint_view(pm, for_load=False, metadata=None), checkpoint_id=path)


def load_checkpoint(pm, path: str) -> None:
    """Read a checkpoint written under any mesh into this rank's shards (all ranks call)."""
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    _check_matches(pm, path, metadata)
    view = _checkpoint_view(pm, for_load=True, metadata=metadata)
    dcp.load(view, checkpoint_id=path)
    with torch.no_grad():
        for target, name, param, placement in _entries(pm):
            if _fsdp_direct(pm, target, param, placement, _saved_blocks(metadata, name)):
                param.to_local().copy_(view[name].to_local())  # read as exactly this rank's part of its shard
                continue
            if placement is not None and pm.full_shape(target)[placement.dim] % pm.mesh.tp:
                local = _local_part(view[name], placement, pm.coord("tp"), pm.mesh.tp)
            else:
                local = _assemble(pm, name, view, metadata, param, placement)
            if _is_fsdp(param):  # the tp-local tensor: keep this rank's FSDP2 part of it
                from torch.distributed.tensor import distribute_tensor

                local = distribute_tensor(local, param.device_mesh, param.placements, src_data_rank=None)
            param.copy_(local)


def _is_fsdp(param) -> bool:
    return hasattr(param, "device_mesh")


def _fsdp_direct(pm, target: str, param, placement: Shard | None, saved_blocks) -> bool:
    """Whether an FSDP2 shard is written and read as it is (not padded over tp, not blocked, here or there)."""
    if not _is_fsdp(param) or saved_blocks is not None:
        return False
    return placement is None or (placement.blocks is None and pm.full_shape(target)[placement.dim] % pm.mesh.tp == 0)


def _check_matches(pm, path: str, metadata) -> None:
    """Refuse, before any collective, a checkpoint of another model: missing tensors or other shapes."""
    problems = []
    for target, name, _, _ in _entries(pm):
        expected = pm.full_shape(target)
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


def _checkpoint_view(pm, *, for_load: bool, metadata) -> dict:
    """The state dict DCP reads or writes: DTensors on the tp group for shards, blocks as separate keys.

    On load, a tensor stored in another layout than this rank holds (blocked vs not) is read whole
    and cut here; everything else is read as exactly this rank's part. Under FSDP2 a parameter is
    written as a DTensor over (tp, dp x cp): sharded over tp as placed, then its dim 0 over dp x cp,
    so each rank writes only its FSDP2 shard. A blocked or padded one is gathered over dp x cp first
    and written as without FSDP2.
    """
    mesh = _tp_mesh(pm)
    meshes: dict = {}  # the (tp, dp x cp) mesh for FSDP2 shards, made once
    view = {}
    for target, name, param, placement in _entries(pm):
        padded = placement is not None and pm.full_shape(target)[placement.dim] % pm.mesh.tp
        blocked_here = placement is not None and placement.blocks is not None
        saved = _saved_blocks(metadata, name) if for_load else None
        if _fsdp_direct(pm, target, param, placement, saved):
            view[name] = _fsdp_dtensor(pm, target, param, placement, for_load, meshes)
            continue
        if _is_fsdp(param):  # the whole tp-local tensor, as without FSDP2
            param = torch.empty(param.shape, dtype=param.dtype) if for_load else param.full_tensor()
        if padded:
            # a padded shard's layout depends on the degree: write and read the tensor whole
            view[name] = (torch.empty(pm.full_shape(target), dtype=param.dtype) if for_load
                          else gather(pm, target, param.detach()))
            continue
        same_layout = not for_load or (saved is not None) == blocked_here
        if blocked_here and same_layout:
            for i, part in enumerate(param.split([b // pm.mesh.tp for b in placement.blocks], placement.dim)):
                view[f"{name}{_BLOCK}{i}"] = _dtensor(part, mesh, placement.dim, for_load)
        elif placement is not None and same_layout:
            view[name] = _dtensor(param, mesh, placement.dim, for_load)
        elif not for_load:
            view[name] = param.detach()
        elif saved is not None:
            for i in saved:
                key = f"{name}{_BLOCK}{i}"
                view[key] = torch.empty(tuple(metadata[key].size), dtype=param.dtype)
        else:
            view[name] = torch.empty(tuple(metadata[name].size), dtype=param.dtype)
    return view


def _fsdp_dtensor(pm, target: str, param, placement: Shard | None, for_load: bool, meshes: dict):
    """An FSDP2 shard of a (tp-sharded) parameter as a DTensor of the whole parameter over (tp, dp x cp)."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor import Shard as DShard

    local = param.to_local()
    data = torch.empty_like(local) if for_load else local.detach()
    shape = pm.full_shape(target)
    stride = torch.empty(shape, device="meta").stride()
    if pm.mesh.tp == 1:
        return DTensor.from_local(data, param.device_mesh, [DShard(0)], run_check=False, shape=shape, stride=stride)
    tp = DShard(placement.dim) if placement is not None else Replicate()
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


def _saved_blocks(metadata, name: str) -> list[int] | None:
    sizes, i = [], 0
    while f"{name}{_BLOCK}{i}" in metadata:
        sizes.append(i)
        i += 1
    return sizes or None


def _dtensor(local: torch.Tensor, mesh, dim: int, for_load: bool):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Shard as DShard

    data = torch.empty_like(local) if for_load else local.detach().contiguous()
    return DTensor.from_local(data, mesh, [DShard(dim)], run_check=False)


def _tp_mesh(pm):
    from torch.distributed.device_mesh import DeviceMesh

    if pm.mesh.tp == 1:
        return None
    return DeviceMesh.from_group(pm.groups.group("tp"), pm.device.type)


def _assemble(pm, name: str, view: dict, metadata, param: torch.Tensor, placement: Shard | None) -> torch.Tensor:
    """This rank's part of ``name`` from what DCP read into ``view``."""
    blocks = _saved_blocks(metadata, name)
    keys = [f"{name}{_BLOCK}{i}" for i in blocks] if blocks else [name]
    parts = [view[k].to_local() if hasattr(view[k], "to_local") else view[k] for k in keys]
    blocked_here = placement is not None and placement.blocks is not None
    if all(hasattr(view[k], "to_local") for k in keys):  # read as this rank's part already
        return torch.cat(parts, placement.dim) if blocked_here else parts[0]
    full = torch.cat(parts, _block_dim(metadata, name, param)) if blocks else parts[0]
    return _local_part(full, placement, pm.coord("tp"), pm.mesh.tp)


def _block_dim(metadata, name: str, param: torch.Tensor) -> int:
    """The dim along which saved blocks were cut: the one where the blocks' sizes differ from each other's sum."""
    sizes = [tuple(metadata[f"{name}{_BLOCK}{i}"].size) for i in _saved_blocks(metadata, name)]
    for dim in range(len(sizes[0])):
        if len({s[dim] for s in sizes}) > 1 or sum(s[dim] for s in sizes) == param.shape[dim]:
            return dim
    return 0



# ---------------------------------------------------------------------------------------- materialising


def materialize(pm, device: str | torch.device | None = None, *, buffers: dict[str, torch.Tensor] | None = None,
                init=None) -> int:
    """Give a model built on ``meta`` real storage: this rank's shards only, then fill them.

    Every parameter this rank holds becomes a tensor of its local shape on ``device``; the captured
    programs are rebound to them, and the devices baked into their graphs (``arange(..., device=meta)``)
    are rewritten. Buffers on ``meta`` that the programs read come from ``buffers`` (by their names in the
    model); a non-persistent one not given there is recomputed by the module that owns it (HuggingFace's
    ``_init_weights``, an ``init_weights(buffer_device=...)``, or its constructor called again; see
    ``runtime.meta_buffers``), and one error names every buffer still missing. The model and its programs
    then share one tensor per buffer, as they do for a model built with real tensors. Returns the bytes
    allocated for parameters. ``device`` defaults to the rank's own (its CUDA device under NCCL, else the CPU).

    ``init=None`` leaves the shards zero for ``load_checkpoint``. Otherwise the model's own
    initialisers fill them: ``init=True`` calls every module's ``reset_parameters()``, and a function
    ``init(module)`` is applied as ``model.apply(init)`` would (children first). Each module is
    initialised on its own with its direct parameters allocated at full shape, and this rank keeps its
    part of them; every rank draws the random numbers of the whole model in the same order, so a seed
    set before ``materialize`` gives exactly the parameters that ``torch.manual_seed(seed);
    model.apply(init)`` gives the unsharded model. Peak memory is this rank's shards plus the largest
    module's parameters. An initialiser that reads parameters of other modules sees them on ``meta``.
    """
    device = pm.device if device is None else torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if pm.groups is not None and device.type != pm.groups.device_type:
        raise ValueError(f"materialize({str(device)!r}): this rank's process groups communicate on "
                         f"{pm.groups.device_type}; materialize there (the default)")
    programs = _programs(pm)
    values = meta_buffers.resolve(pm.model, programs, device, buffers or {})  # raises before any allocation
    store = pm.replica.store
    allocated = 0
    if pm.replica.sharded_data:  # FSDP2 allocates its own shards (of dp x cp) of this rank's parameters
        pm.replica.to_empty(device=device)
        with torch.no_grad():
            for param in store.parameters():
                param.to_local().zero_()
                allocated += param.to_local().numel() * param.element_size()
    for target, param in list(store.named_parameters()):
        if param.device == device:
            continue
        fresh = torch.nn.Parameter(torch.zeros(param.shape, dtype=param.dtype, device=device), param.requires_grad)
        allocated += fresh.numel() * fresh.element_size()
        owner, _, attr = target.rpartition(".")
        setattr(store.get_submodule(owner) if owner else store, attr, fresh)
    for gm in programs:
        store.adopt(gm)
        _rewrite_devices(gm, device)
    meta_buffers.install(pm.model, programs, values, device)
    if init is not None:
        _initialise(pm, device, init)
    return allocated


def _initialise(pm, device: torch.device, init) -> None:
    """Run the model's initialisers module by module (``Module.apply``'s order); keep this rank's parts."""
    if init is not True and not callable(init):
        raise ValueError(f"init={init!r}: use True (every module's reset_parameters()) or a function of a module")
    target_of = {name: target for target, names in pm.names.items() for name in names}
    held = {target: (param, placement) for target, _, param, placement in _entries(pm)}
    order = _apply_order(pm.model)
    last_visit: dict[int, int] = {}  # a tied parameter keeps its full tensor until its last module has run
    for index, (_, module) in enumerate(order):
        for param in module._parameters.values():
            if param is not None:
                last_visit[id(param)] = index
    full: dict[int, torch.nn.Parameter] = {}
    for index, (prefix, module) in enumerate(order):
        originals = {attr: p for attr, p in module._parameters.items() if p is not None}
        if not originals:
            if init is not True:
                with torch.no_grad():
                    init(module)  # it may draw random numbers (the unsharded model's apply would too)
            continue
        fresh = [id(p) not in full for p in originals.values()]
        for param in originals.values():
            if id(param) not in full:
                full[id(param)] = torch.nn.Parameter(
                    torch.full(param.shape, math.nan, dtype=param.dtype, device=device), param.requires_grad)
        module._parameters.update({attr: full[id(p)] for attr, p in originals.items()})
        try:
            with torch.no_grad():
                _run_initialiser(module, init, defaults=all(fresh), device=device)
        finally:
            module._parameters.update(originals)
        for attr, param in originals.items():
            name = f"{prefix}.{attr}" if prefix else attr
            value = full[id(param)]
            if last_visit[id(param)] == index:
                full.pop(id(param))
                if value.detach().sum().isnan():  # a NaN left anywhere (no full-size mask allocated)
                    raise ValueError(
                        f"materialize(init=...): {name} was not initialised ({type(module).__name__} has no "
                        "reset_parameters() and the init function did not set it): set it in the init function, "
                        "or load a checkpoint instead"
                    )
                target = target_of.get(name)
                if target in held:
                    with torch.no_grad():
                        _copy_part(pm, held[target][0], value, held[target][1])


def _run_initialiser(module: torch.nn.Module, init, *, defaults: bool, device: torch.device) -> None:
    """``init(module)``, after the module's own defaults (``reset_parameters``, on a forked random stream so
    that it draws nothing the unsharded ``apply(init)`` would not) for the parameters ``init`` leaves alone."""
    reset = getattr(module, "reset_parameters", None)
    if init is True:
        if callable(reset):
            reset()
        return
    if defaults and callable(reset):
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            reset()
    init(module)


def _apply_order(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Modules in the order ``model.apply`` visits them: children before their parent."""
    out: list[tuple[str, torch.nn.Module]] = []

    def visit(prefix: str, module: torch.nn.Module) -> None:
        for name, child in module.named_children():
            visit(f"{prefix}.{name}" if prefix else name, child)
        out.append((prefix, module))

    visit("", model)
    return out


def _copy_part(pm, local, full: torch.Tensor, placement: Shard | None) -> None:
    """Write this rank's part of the full tensor ``full`` into its parameter ``local``."""
    part = _local_part(full.detach(), placement, pm.coord("tp"), pm.mesh.tp)
    if _is_fsdp(local):
        from torch.distributed.tensor import distribute_tensor

        part = distribute_tensor(part, local.device_mesh, local.placements, src_data_rank=None)
    local.copy_(part)


def _programs(pm) -> list:
    return [program.gm for build in pm.builds for program in build.programs.values()]


def _rewrite_devices(gm, device: torch.device) -> None:
    """Nodes that create or move tensors carry the device they were captured on; point them at ``device``."""
    changed = False

    def moved(value):
        nonlocal changed
        if isinstance(value, torch.device) and value != device:
            changed = True
            return device
        return value

    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.args = tuple(moved(a) for a in node.args)
            node.kwargs = {k: moved(v) for k, v in node.kwargs.items()}
    if changed:
        gm.recompile()
