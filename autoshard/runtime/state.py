"""Training state across ranks: global-norm clipping, full state dicts, and materialising a model built on meta.

Every parameter of the original model is held by the ranks of one pp coordinate (two for a tied
weight used on two stages), as whole tensors or tp shards, replicated over dp x cp (or, under FSDP2,
split along dim 0 over dp x cp). So a global quantity counts each tensor once: a tp-replicated tensor
contributes from every tp rank divided by the degree, a tied one only on the first pp rank that holds
it, and nothing is summed over dp x cp (their gradients were already reduced) unless FSDP2 split it.

Distributed checkpoints (parameters, optimizer state, random streams) are in ``runtime.checkpoint``.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.distributed as dist

from autoshard.layout import ParamLayout
from autoshard.passes.placements import Shard
from autoshard.runtime import habits, meta_buffers, spread


def _entries(pm):
    """(target, original name, local parameter, layout) for every parameter this rank holds."""
    store = pm.replica.store
    for target, names in pm.names.items():
        local = store.find(target)
        if local is None:
            continue
        yield target, names[0], local, pm.layout(target)


def clip_grad_norm_(pm, max_norm: float, eps: float = 1e-6) -> torch.Tensor:
    """Scale every gradient so that the global norm is at most ``max_norm``; returns the norm before."""
    total = torch.zeros((), dtype=torch.float64, device=pm.device)
    tied = pm.pipeline.tied if pm.pipeline is not None else {}
    pp_index = pm.coord("pp")
    for target, _, param, layout in _entries(pm):
        placement = layout.tp
        if param.grad is None:
            continue
        if target in tied and pp_index != min(tied[target]):
            continue
        grad, share = param.grad.detach(), 1.0
        if hasattr(grad, "to_local"):  # an FSDP2 shard over dp x cp
            if placement is not None and placement.whole:  # its blocks are known in the whole tp shard only
                grad, share = grad.full_tensor(), 1.0 / (pm.mesh.dp * pm.mesh.cp)
            else:
                grad = grad.to_local()
        # split over ep: summed over it; every other gradient is alike on the ep ranks
        total += share * _squares(grad, placement, pm.mesh.tp) * _ep_weight(pm, layout.split_over_ep)
    axes = ("tp", "pp", "data") if pm.sync.sharded else ("tp", "pp")
    for axis in axes:
        if (pm.mesh.dp * pm.mesh.cp if axis == "data" else pm.mesh.degree(axis)) > 1:
            dist.all_reduce(total, group=pm.groups.group(axis))
    if pm.mesh.ep > 1 and not pm.sync.sharded:  # under FSDP2 the sum over dp x cp took the ep ranks in already
        dist.all_reduce(total, group=pm.groups.group("ep"))
    norm = total.sqrt().float()
    coef = torch.clamp(max_norm / (norm + eps), max=1.0)  # on the device: no read back (1 leaves a gradient as is)
    for _, _, param, _ in _entries(pm):
        if param.grad is not None:
            grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad  # an FSDP2 shard
            grad.mul_(coef.to(grad.dtype))
    return norm


def _ep_weight(pm, expert: bool) -> float:
    """What this rank's squares of one gradient count for under ep. Under DDP the total is summed over the ep ranks:
    an expert's once (each holds its own), every other gradient 1/ep (alike on them). Under FSDP2 it is summed over
    dp x cp: every other gradient is a disjoint shard (once), an expert's is held alike by dp x cp / ep ranks."""
    if pm.mesh.ep == 1:
        return 1.0
    if pm.sync.sharded:
        return pm.mesh.ep / (pm.mesh.dp * pm.mesh.cp) if expert else 1.0
    return 1.0 if expert else 1.0 / pm.mesh.ep


def _squares(grad: torch.Tensor, placement: Shard | None, tp: int) -> torch.Tensor:
    """This rank's summand of the squared global norm of a gradient, to be summed over the tp ranks: what it holds
    of a split, and ``1/tp`` of what every rank holds alike (a replicated weight, a fused weight's blocks held
    whole)."""
    squares = grad.double().pow(2)
    if placement is None:
        return squares.sum() / tp
    if not placement.whole:
        return squares.sum()
    sizes = [b if i in placement.whole else b // tp for i, b in enumerate(placement.blocks)]
    parts = squares.split(sizes, placement.dim)
    return sum(part.sum() / (tp if i in placement.whole else 1) for i, part in enumerate(parts))


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
    with habits.own_use():
        own = pm.model.state_dict(keep_vars=True)  # the model's tensors themselves: a parameter is known by identity
    out: dict[str, torch.Tensor] = OrderedDict()
    for key, value in own.items():
        name = name_of.get(id(value), key)
        if name in full:
            out[key] = full[name]
        else:
            out[key] = value.detach() if isinstance(value, torch.Tensor) else value
    if pm.mesh.pp > 1:  # a buffer one stage updates (BatchNorm's running statistics) is current on its rank only
        everyone: list = [None] * pm.mesh.pp
        mine = _written_buffers(pm)
        dist.all_gather_object(everyone, {k: out[k].cpu() for k in mine if k in out}, group=pm.groups.group("pp"))
        for part in everyone:
            out.update({k: v.to(out[k].device) for k, v in part.items() if k not in mine})
    out._metadata = getattr(own, "_metadata", None)  # the modules' versions, which load_state_dict reads
    return out


def _written_buffers(pm) -> set[str]:
    """The state-dict keys of the buffers this rank's programs write in place."""
    from autoshard.passes.writes import written_targets

    return {target.removeprefix("model.") for build in pm.builds for program in build.programs.values()
            for target in written_targets(program.gm)}


def load_state_dict(pm, state: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Load a full state dict of the original model (its keys and shapes): each rank keeps its shards.

    As ``model.load_state_dict``: with ``strict`` a missing or an unexpected key is an error naming them all.
    """
    missing = [name for _, name, _, _ in _entries(pm) if name not in state]
    with habits.own_use():
        unexpected = sorted(set(state) - set(pm.model.state_dict()))
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"loading a state dict into {type(pm.model).__name__}: missing keys {_few(missing)}, unexpected keys "
            f"{_few(unexpected)}: pass this model's state dict (model.state_dict() or pm.state_dict()), or strict=False"
        )
    with torch.no_grad(), spread.of(pm).whole(pm.store):
        for _, name, param, layout in _entries(pm):
            if name not in state:
                continue
            full = state[name]
            if tuple(full.shape) != layout.shape:
                raise ValueError(f"{name} has shape {tuple(full.shape)} in the state dict, the model expects "
                                 f"{layout.shape}")
            local = rank_part(pm, layout, full)
            if hasattr(param, "device_mesh"):  # an FSDP2 shard over dp x cp
                from torch.distributed.tensor import distribute_tensor

                local = distribute_tensor(local, param.device_mesh, param.placements)
            param.copy_(local)
        buffers = {k: v for k, v in state.items() if k in dict(pm.model.named_buffers())}
        for key, value in buffers.items():
            _set_buffer(pm.model, key, value)


def update_model(pm) -> None:
    """Write the trained weights (``state_dict(pm)``, gathered: every rank calls) into the model given to
    ``parallelize``; a model built on the meta device takes the gathered tensors themselves."""
    if habits.trained_for(pm):  # under dp alone the model's own tensors are the trained ones
        full = state_dict(pm)
        on_meta = any(p.device.type == "meta" for p in pm.model.parameters())
        with habits.own_use():
            pm.model.load_state_dict(full, assign=on_meta)
    habits.written(pm)


def _few(names: list[str]) -> str:
    return f"{names[:5]}{'...' if len(names) > 5 else ''}"


def _set_buffer(model: torch.nn.Module, key: str, value: torch.Tensor) -> None:
    owner, _, attr = key.rpartition(".")
    getattr(model.get_submodule(owner) if owner else model, attr).copy_(value)


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
    for captured in pm._traced.values():  # an inference capture taken with a training one, compiled at first use
        _rewrite_devices(captured.gm, device)
    meta_buffers.install(pm.model, programs, values, device)
    pm.materialized = (device, dict(buffers or {}))
    if init is not None:
        with spread.of(pm).whole(store):  # each rank writes the whole weight, then keeps its rows
            _initialise(pm, device, init)
    return allocated


def materialized_build(pm, programs: list) -> None:
    """Programs compiled after ``materialize`` (a new shape, inference) from the model still on meta: bound to this
    rank's real parameters and buffers, and their devices rewritten, as ``materialize`` did for the others."""
    device, given = pm.materialized
    values = meta_buffers.resolve(pm.model, programs, device, given)
    for gm in programs:
        pm.replica.store.adopt(gm)
        _rewrite_devices(gm, device)
    meta_buffers.install(pm.model, programs, values, device)


def _hf_hint(model: torch.nn.Module) -> str:
    """A HuggingFace model initialises itself by ``_init_weights``, not ``reset_parameters``: say so."""
    if callable(getattr(model, "_init_weights", None)):
        return (f"; {type(model).__name__} is a HuggingFace model, which initialises every module with its own "
                "_init_weights: pm.materialize(init=model._init_weights)")
    return ""


def _initialise(pm, device: torch.device, init) -> None:
    """Run the model's initialisers module by module (``Module.apply``'s order); keep this rank's parts."""
    if init is not True and not callable(init):
        raise ValueError(f"init={init!r}: use True (every module's reset_parameters()) or a function of a module")
    target_of = {name: target for target, names in pm.names.items() for name in names}
    held = {target: (param, layout) for target, _, param, layout in _entries(pm)}
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
                        "or load a checkpoint instead" + _hf_hint(pm.model)
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


def _copy_part(pm, local, full: torch.Tensor, layout: ParamLayout) -> None:
    """Write this rank's part of the full tensor ``full`` into its parameter ``local``."""
    local.copy_(fsdp_part(local, rank_part(pm, layout, full.detach())))


def rank_part(pm, layout: ParamLayout, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter's full tensor (or of a tensor laid out as it), as its ``layout`` says."""
    return layout.part(full, pm.coord("tp"), pm.mesh.expert_coord(pm.groups.coords) if layout.experts else 0)


def fsdp_part(like, tp_local: torch.Tensor) -> torch.Tensor:
    """``tp_local`` (a tp rank's whole tensor) split over dp x cp as ``like`` is when FSDP2 holds it: each rank keeps
    its own part, with no communication (every rank holds the same ``tp_local``); else ``tp_local`` itself."""
    if not hasattr(like, "device_mesh"):
        return tp_local
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(tp_local, like.device_mesh, like.placements, src_data_rank=None)


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
