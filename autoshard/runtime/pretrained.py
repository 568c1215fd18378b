"""``pm.save_pretrained(directory)``: the model in HuggingFace's format, gathered from any mesh a tensor at a time.

Rank 0 writes the model's ``config.json`` (and ``generation_config.json``) with the model's own
``save_pretrained`` of its config, and the tensors as safetensors files of at most ``max_shard_size`` bytes (with
``model.safetensors.index.json`` when there are several), named and laid out as ``transformers`` lays them out,
so the unmodified ``from_pretrained`` loads them. Each tensor is gathered alone: over tp (fused blocks, padded
vocabularies), over dp x cp for FSDP2 shards, whole for weights spread over the pipeline ranks, then sent to rank 0
by the first rank holding it, and written into its file at once: the file's header (every tensor's dtype, shape and
place) is known before any tensor is gathered, so no rank holds more than one whole tensor beyond its own shards.
A tied weight is written once, under its first name, as ``transformers`` writes it.

``pm.load_pretrained(directory)`` is the reverse: each rank reads from such a directory only its part of each
tensor it holds (safetensors slices: its tp blocks, its rows of a padded vocabulary, its stages' weights), so a
model built on ``meta`` and materialized (``pm.materialize()``) starts from a checkpoint no rank holds whole.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from autoshard.passes.collectives import _pieces
from autoshard.passes.placements import Shard
from autoshard.runtime import committed, habits, spread, state

INDEX = "model.safetensors.index.json"


def save_pretrained(pm, directory: str, max_shard_size: int | str = "5GB") -> None:
    """Write ``pm``'s model into ``directory`` as ``transformers``' ``save_pretrained`` does (a collective: every
    rank calls it)."""
    if _is_adapted(pm.model):  # PEFT: its own files (the adapter and its config), from the trained weights
        state.update_model(pm)
        if (dist.get_rank() if dist.is_initialized() else 0) == 0:
            pm.model.save_pretrained(directory)
        return
    limit, directory = _bytes(max_shard_size), committed.as_typed(directory)
    config = getattr(pm.model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):  # said on every rank, before any collective
        raise ValueError(f"save_pretrained writes HuggingFace's format, and {type(pm.model).__name__} has no "
                         "HuggingFace config (model.config): use pm.state_dict() or pm.save_checkpoint() instead")
    entries = _entries(pm)
    files = _files(entries, limit)
    holders = _holders(pm)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        os.makedirs(directory, exist_ok=True)
        config.save_pretrained(directory)
        generation = getattr(pm.model, "generation_config", None)
        if generation is not None and hasattr(generation, "save_pretrained"):
            generation.save_pretrained(directory)
    with spread.of(pm).whole(pm.store):
        for number, keys in enumerate(files, 1):
            writer = _Writer(os.path.join(directory, _name(number, len(files))),
                             {key: _layout(pm, entries[key]) for key in keys}) if rank == 0 else None
            for key in keys:
                tensor = _tensor(pm, entries[key], holders, rank)
                if writer is not None:
                    writer.write(key, tensor.detach().to("cpu").contiguous())
                del tensor
            if writer is not None:
                writer.close()
    if rank == 0 and len(files) > 1:
        total = sum(_size(entry) for entry in entries.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {key: _name(n, len(files)) for n, keys in enumerate(files, 1) for key in keys}}
        with open(os.path.join(directory, INDEX), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    if dist.is_initialized():
        dist.barrier()


def _is_adapted(model) -> bool:
    """Whether ``model`` is a PEFT model (an adapter over a base model), whose ``save_pretrained`` writes the adapter
    alone, in the files ``PeftModel.from_pretrained`` reads."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model") and hasattr(model, "save_pretrained")


def load_pretrained(pm, directory: str) -> int:
    """Fill this rank's parameters (and the buffers the files hold) from HuggingFace's format in ``directory``,
    reading only this rank's part of each tensor; returns the bytes this rank read. Refuses a directory that lacks
    a parameter or holds one of another shape, naming them, before changing anything. No collective."""
    directory = committed.as_typed(directory)
    on_meta = [name for _, name, param, _ in state._entries(pm) if param.device.type == "meta"]
    if on_meta:
        raise ValueError(f"load_pretrained into parameters on the meta device ({state._few(on_meta)}), which hold no "
                         "storage to read into: call pm.materialize() first (it allocates this rank's shards), then "
                         "pm.load_pretrained(directory)")
    try:
        from safetensors import safe_open
    except ImportError as e:
        raise ImportError("load_pretrained reads safetensors files: pip install safetensors") from e
    where = _weight_map(directory)
    aliases: dict[int, list[str]] = {}
    for name, param in pm.model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    plan, missing = [], []
    for target, name, param, layout in state._entries(pm):
        names = [*pm.names[target], *aliases.get(id(pm.model.get_parameter(name)), [])]
        key = next((n for n in names if n in where), None)
        if key is None:
            missing.append(name)
        else:
            plan.append((key, param, layout))
    if missing:
        raise ValueError(f"{directory} holds no tensor for {state._few(missing)}: load_pretrained reads the "
                         f"model's own names, as pm.save_pretrained writes them ({type(pm.model).__name__}); "
                         "transformers >= 5 writes some models (mixtures of experts among them) under their "
                         "original checkpoint's names: load such a directory with from_pretrained on the CPU "
                         "and parallelize that model")
    tp_rank, tp = pm.coord("tp"), pm.mesh.tp
    read = 0
    handles: dict[str, object] = {}

    def sliced(key: str):
        if where[key] not in handles:
            handles[where[key]] = safe_open(os.path.join(directory, where[key]), framework="pt", device="cpu")
        return handles[where[key]].get_slice(key)

    for key, _, layout in plan:
        if tuple(sliced(key).get_shape()) != layout.shape:
            raise ValueError(f"{key} has shape {tuple(sliced(key).get_shape())} in {directory}, the model expects "
                             f"{layout.shape}")
    with torch.no_grad(), spread.of(pm).whole(pm.store):
        for key, param, layout in plan:
            if layout.experts:  # this ep rank's experts (rows of dim 0), then their tp part
                per = layout.shape[0] // layout.ep_size
                first = pm.mesh.expert_coord(pm.groups.coords) * per
                local = _local_experts(sliced(key), first, per, layout.tp, tp_rank, tp)
            else:
                local = _read_part(sliced(key), layout.tp, tp_rank, tp)
            local = local.to(param.dtype)
            read += local.numel() * local.element_size()
            if hasattr(param, "device_mesh"):  # an FSDP2 shard over dp x cp
                from torch.distributed.tensor import distribute_tensor

                local = distribute_tensor(local, param.device_mesh, param.placements)
            param.copy_(local)
        buffers = dict(pm.model.named_buffers())
        for key in sorted(set(where) & set(buffers)):
            value = sliced(key)[:]
            read += value.numel() * value.element_size()
            state._set_buffer(pm.model, key, value.to(buffers[key].dtype))
    return read


def _weight_map(directory: str) -> dict[str, str]:
    """Each tensor's file, from the index (several files) or the one file."""
    index = os.path.join(directory, INDEX)
    if os.path.exists(index):
        with open(index) as f:
            return dict(json.load(f)["weight_map"])
    single = os.path.join(directory, _name(1, 1))
    if not os.path.exists(single):
        raise FileNotFoundError(f"{directory} holds neither {INDEX} nor {_name(1, 1)}: load_pretrained reads "
                                "HuggingFace's safetensors format (save_pretrained's)")
    from safetensors import safe_open

    with safe_open(single, framework="pt", device="cpu") as f:
        return dict.fromkeys(f.keys(), _name(1, 1))


def _local_experts(sliced, first: int, per: int, placement, rank: int, size: int) -> torch.Tensor:
    """Experts ``first .. first + per`` of a stack in a file (reading those rows only), then this tp rank's part."""
    from autoshard.passes.collectives import local_part

    rows = sliced[first:first + per]
    return rows if placement is None else local_part(rows, placement, rank, size)


def _read_part(sliced, placement, rank: int, size: int) -> torch.Tensor:
    """This tp rank's part of a tensor in a file, reading that part only: ``local_part`` of the whole tensor."""
    shape = tuple(sliced.get_shape())
    if placement is None:
        return sliced[:]
    dim, n = placement.dim, shape[placement.dim]

    def rows(start: int, length: int) -> torch.Tensor:
        return sliced[tuple([slice(None)] * dim + [slice(start, start + length)])]

    if placement.blocks is None and n % size:  # a padded dim: this rank's chunk of it, zeros past the end
        chunk = -(-n // size)
        start = min(rank * chunk, n)
        part = rows(start, min(chunk, n - start))
        extra = list(part.shape)
        extra[dim] = chunk - part.shape[dim]
        return torch.cat([part, part.new_zeros(extra)], dim)
    pieces = [rows(start, length) for start, length in _pieces(n, rank, size, placement.blocks, placement.whole)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def _layout(pm, entry: tuple) -> tuple[torch.dtype, tuple[int, ...]]:
    if entry[0] == "buffer":
        return entry[1].dtype, tuple(entry[1].shape)
    _, target, own = entry
    return own.dtype, pm.layout(target).shape if target is not None else tuple(own.shape)


class _Writer:
    """A safetensors file written a tensor at a time: its header first (from every tensor's dtype and shape),
    then each tensor's bytes as they come, in the header's order."""

    def __init__(self, path: str, layouts: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for key, (dtype, shape) in layouts.items():
            if dtype not in _DTYPES:
                raise ValueError(f"save_pretrained: {key} is {dtype}, which safetensors does not store")
            size = torch.Size(shape).numel() * dtype.itemsize
            header[key] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.layouts, self.order = layouts, list(layouts)
        self.file = open(path, "wb")  # noqa: SIM115 - closed by close()
        self.file.write(len(text).to_bytes(8, "little") + text)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        expected = self.order.pop(0)
        dtype, shape = self.layouts[key]
        if key != expected or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise RuntimeError(f"save_pretrained: {key} came as {tensor.dtype} {tuple(tensor.shape)}, the header "
                               f"holds {expected} as {dtype} {shape}")
        if tensor.numel():
            self.file.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))

    def close(self) -> None:
        self.file.close()


def _entries(pm) -> dict[str, tuple]:
    """The model's ``state_dict`` keys in order, each ``("param", target, like)`` or ``("buffer", tensor)``; a
    parameter under several names (tied) keeps its first."""
    target_of = {name: target for target, names in pm.names.items() for name in names}
    name_of: dict[int, str] = {}
    for name, param in pm.model.named_parameters(remove_duplicate=False):
        name_of.setdefault(id(param), name)
    out, seen = {}, set()
    with habits.own_use():
        own = pm.model.state_dict(keep_vars=True)
    for key, value in own.items():
        name = name_of.get(id(value))
        if name is None:
            out[key] = ("buffer", value)
            continue
        if id(value) in seen:
            continue
        seen.add(id(value))
        out[key] = ("param", target_of.get(name), value)
    return out


def _size(entry: tuple) -> int:
    tensor = entry[-1]
    return tensor.numel() * tensor.element_size()


def _files(entries: dict, limit: int) -> list[list[str]]:
    """Keys grouped into files of at most ``limit`` bytes (a larger tensor alone in its file), in order."""
    files: list[list[str]] = [[]]
    used = 0
    for key, entry in entries.items():
        size = _size(entry)
        if files[-1] and used + size > limit:
            files.append([])
            used = 0
        files[-1].append(key)
        used += size
    return files


def _name(number: int, count: int) -> str:
    return "model.safetensors" if count == 1 else f"model-{number:05d}-of-{count:05d}.safetensors"


def _holders(pm) -> dict[str, int]:
    """The first global rank holding each parameter (in the captures' names)."""
    held = sorted(t for t in pm.names if pm.store.find(t) is not None)
    if not dist.is_initialized():
        return dict.fromkeys(held, 0)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, held)
    first: dict[str, int] = {}
    for r, targets in enumerate(everyone):
        for target in targets:
            first.setdefault(target, r)
    return first


def _tensor(pm, entry: tuple, holders: dict[str, int], rank: int) -> torch.Tensor | None:
    """The whole tensor of one entry on rank 0 (None elsewhere), which only rank 0 ever holds whole: each rank of
    its first holder's tp group sends its part to rank 0, which receives a part that is one run of rows in place
    and any other into one part's buffer at a time, copying its pieces into place (as ``gather`` assembles it)."""
    if entry[0] == "buffer":
        return entry[1]
    _, target, own = entry
    if target is None or target not in holders:  # read by no program: the model's own, never trained
        return own if rank == 0 else None
    local = pm.store.find(target)
    if local is not None and hasattr(local, "full_tensor"):  # an FSDP2 shard: every dp x cp holder takes part
        local = local.full_tensor()
    layout = pm.layout(target)
    placement = layout.tp
    # ep rank e holds experts [e * per, (e + 1) * per): rows of the whole, from its tp group
    holders_e = pm.mesh.expert_group_of(holders[target]) if layout.experts else [holders[target]]
    groups = [pm.mesh.group_of("tp", h) if placement is not None else [h] for h in holders_e]
    if rank != 0:
        if any(rank in senders for senders in groups):
            for rows in _row_chunks(local, placement.dim if placement is not None else 0):
                dist.send(rows.contiguous(), dst=0)
        return None
    layout.check_whole_save()
    if len(groups) == 1 and placement is None and groups[0][0] == 0:
        return local.detach()
    full = torch.empty(layout.shape, dtype=own.dtype, device=pm.device)
    per = full.shape[0] // len(groups)
    for e, senders in enumerate(groups):
        out = full.narrow(0, e * per, per) if len(groups) > 1 else full
        if placement is None:
            if senders[0] == 0:
                out.copy_(local.detach())
            else:
                dist.recv(out, src=senders[0])
            continue
        out = _receive(pm, target, own, placement, local, senders, out)
        if len(groups) == 1:
            return out
    return full


def _receive(pm, target: str, own, placement: Shard, local, senders: list[int], into: torch.Tensor) -> torch.Tensor:
    """Rank 0: the tp-split tensor whose parts ``senders`` hold (rank 0's own from ``local``), assembled into
    ``into`` (or into a padded buffer, returned narrowed, when the degree does not divide the split dim)."""
    dim, tp = placement.dim, len(senders)
    part_shape = _part_shape(pm, tuple(into.shape), placement)
    n = sum(placement.blocks) if placement.blocks is not None else part_shape[dim] * tp  # padded
    if n != into.shape[dim]:
        shape = list(into.shape)
        shape[dim] = n
        full = torch.empty(shape, dtype=own.dtype, device=pm.device)
    else:
        full = into
    buffer = None
    for r, source in enumerate(senders):
        pieces = _pieces(n, r, tp, placement.blocks, placement.whole)
        if source != 0 and dim == 0 and len(pieces) == 1:  # one run of rows: received in place
            dist.recv(full.narrow(0, *pieces[0]), src=source)
            continue
        part = local.detach() if source == 0 else torch.empty(part_shape, dtype=own.dtype, device="meta")
        first = 0
        for rows in _row_chunks(part, dim):  # a split along another dim: a chunk of rows at a time
            count = rows.shape[0]
            if source != 0:
                if buffer is None or buffer.numel() < rows.numel():
                    buffer = torch.empty(rows.numel(), dtype=own.dtype, device=pm.device)
                rows = buffer[:rows.numel()].view(rows.shape)
                dist.recv(rows, src=source)
            target_rows = full if dim == 0 else full.narrow(0, first, count)
            offset = 0
            for start, length in pieces:
                target_rows.narrow(dim, start, length).copy_(rows.narrow(dim, offset, length))
                offset += length
            first += count
    return full.narrow(dim, 0, into.shape[dim])  # a padded vocabulary's padding dropped


_CHUNK_BYTES = 4 * 2**20


def _row_chunks(part: torch.Tensor, dim: int) -> list[torch.Tensor]:
    """A part split along ``dim`` > 0 as chunks of its rows (dim 0) of about 4 MiB each, as sender and receiver
    both cut it; a part split along dim 0 whole."""
    if dim == 0 or part.numel() == 0:
        return [part]
    row = max(1, part[0].numel() * part.element_size())
    return list(part.split(max(1, _CHUNK_BYTES // row), 0))


def _part_shape(pm, shape: tuple[int, ...], placement: Shard) -> tuple[int, ...]:
    """The shape of one tp rank's part of a tensor of ``shape`` (for rank 0 receiving parts it does not hold)."""
    from autoshard.passes.placements import local_shape

    return tuple(local_shape(shape, placement, pm.mesh.tp))


def _bytes(size: int | str) -> int:
    if isinstance(size, int):
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    text = size.strip().upper()
    for unit, scale in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * scale)
    raise ValueError(f"max_shard_size={size!r}: give bytes, or a size like '5GB' or '500MB'")
