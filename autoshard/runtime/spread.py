"""Weights spread over the pipeline ranks: stored in parts, gathered for each step (ZeRO-3 over pp).

A pipeline rank holds the parameters its stages read. Some models leave one rank with most of them: a weight
that stages on two ranks read (a tied embedding and head, ALBERT's one shared layer, a recurrent core that
every stage applies) is held whole by each of them, and one weight larger than the rest of the model cannot
be balanced by any cut. Such a weight is *spread*: each pp rank keeps its own block of rows (dim 0 of its tp
shard), so the parameter, its gradient and the optimizer's state for it are stored once over the pp ranks.

- For a step, every pp rank all-gathers the rows (the parameter object stays the same: its ``data`` is
  swapped, so the optimizer, the programs and the dp x cp reducer all keep pointing at it).
- After the last backward and the dp x cp sums, the gradients are reduce-scattered over the pp ranks: each
  rank gets its rows of the sum of every stage's gradient (a rank that does not read the weight adds
  zeros). That is the tied weights' all-reduce, split into its two halves, so the step moves the same bytes.
- The optimizer then steps each rank's rows: element-wise optimizers (SGD, Adam, ...) give what they give
  the whole weight.

Functions that need the whole weights (full state dicts, checkpoints, the optimizer's full state) run
inside :meth:`Spread.whole`, which gathers them (with their gradients and optimizer state) on every pp rank
and gives each rank its rows back afterwards.

Which weights are spread is chosen when the job is compiled (``autoshard.spread_choice``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from autoshard import peers
from autoshard.passes.collectives import reduce_scatter_single


class Spread:
    """The weights spread over this rank's pp group, and the collectives that move them."""

    def __init__(self, names: tuple[str, ...], group, p: int, index: int, ranks: list[int]) -> None:
        self.names = names
        self.group = group
        self.p = p
        self.index = index  # this rank's pp coordinate
        self.ranks = ranks  # the global ranks of the pp group, by coordinate
        self._gathered = False

    def __bool__(self) -> bool:
        return bool(self.names)

    def setup(self, store, programs: list, device: torch.device) -> None:
        """Give every pp rank its rows of each spread weight (collective over pp): the first rank that reads a
        weight sends it whole, each keeps its block; the store's parameter becomes those rows, and ``programs``
        are rebound to it. A weight on ``meta`` stays there, as rows, until it is materialised."""
        mine = {name: store.find(name) for name in self.names if store.find(name) is not None}
        info = {name: (tuple(p.shape), p.dtype, p.requires_grad, p.device.type == "meta") for name, p in mine.items()}
        everyone: list = [None] * self.p
        dist.all_gather_object(everyone, info, group=self.group)
        for name in self.names:
            src = next(i for i, held in enumerate(everyone) if name in held)
            shape, dtype, requires_grad, on_meta = everyone[src][name]
            block = shape[0] // self.p
            if on_meta:
                rows = torch.empty((block, *shape[1:]), dtype=dtype, device="meta")
            else:
                whole = mine[name].detach().contiguous() if name in mine else torch.empty(shape, dtype=dtype,
                                                                                            device=device)
                dist.broadcast(whole, src=self.ranks[src], group=self.group)
                rows = whole[self.index * block:(self.index + 1) * block].clone()
            store._register(name, nn.Parameter(rows, requires_grad=requires_grad))
        for gm in programs:
            store.adopt(gm)

    def certified(self, store) -> list[tuple[str, str, torch.dtype, int, bool]]:
        """The collectives a step's ``gather`` and ``scatter`` issue over pp, for ``runtime.communication``:
        (phase, kind, dtype, elements, whether the data decides them and their calls: the weights that got a
        gradient)."""
        params = self._params(store) if self.names else []
        found = [("gradient sync", "all_reduce", torch.float32, len(params), False)] if params else []
        for indices in _by_dtype(params):
            rows = sum(params[i].numel() for i in indices)
            found.append(("parameter gathers", "all_gather", params[indices[0]].dtype, rows, False))
            found.append(("gradient sync", "reduce_scatter", params[indices[0]].dtype, rows * self.p, True))
        return found

    def _params(self, store) -> list[nn.Parameter]:
        return [store.get_parameter(name) for name in self.names]

    def _gather(self, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every rank's rows of each tensor, stacked whole: one all-gather per dtype."""
        out: list[torch.Tensor | None] = [None] * len(rows)
        for indices in _by_dtype(rows):
            flat = torch.cat([rows[i].reshape(-1) for i in indices])
            parts = [torch.empty_like(flat) for _ in range(self.p)]
            peers.run(dist.all_gather, parts, flat, group=self.group)
            offset = 0
            for i in indices:
                n = rows[i].numel()
                out[i] = torch.cat([part[offset:offset + n].view(rows[i].shape) for part in parts])
                offset += n
        return out

    def _reduce_scatter(self, wholes: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's rows of the sum over the pp ranks of each tensor: one reduce-scatter per dtype."""
        out: list[torch.Tensor | None] = [None] * len(wholes)
        for indices in _by_dtype(wholes):
            blocks = [[wholes[i].chunk(self.p)[r].reshape(-1) for i in indices] for r in range(self.p)]
            flat = torch.cat([b for rank in blocks for b in rank])
            mine = flat.new_empty(flat.numel() // self.p)
            reduce_scatter_single(mine, flat, group=self.group)
            offset = 0
            for i, block in zip(indices, blocks[0], strict=True):
                shape = (wholes[i].shape[0] // self.p, *wholes[i].shape[1:])
                out[i] = mine[offset:offset + block.numel()].view(shape).clone()
                offset += block.numel()
        return out

    def _rows(self, whole: torch.Tensor) -> torch.Tensor:
        block = whole.shape[0] // self.p
        return whole[self.index * block:(self.index + 1) * block].clone()

    def gather(self, store) -> None:
        """Before a step: every spread weight whole on every pp rank (their gradients were set aside)."""
        if not self.names:
            return
        params = self._params(store)
        with peers.phase("parameter gathers"):
            wholes = self._gather([p.data for p in params])
        for param, whole in zip(params, wholes, strict=True):
            param.data = whole
        self._gathered = True

    def scatter(self, store) -> None:
        """After the step's sums: each rank's rows of every weight and of the sum of its gradients over pp. A weight
        no rank got a gradient for (read only without gradients) keeps none, as in the model run whole."""
        if not self._gathered:
            return
        params = self._params(store)
        some = torch.tensor([float(p.grad is not None) for p in params], device=params[0].device)
        with peers.phase("gradient sync"):
            peers.run(dist.all_reduce, some, group=self.group)
            found = [p for p, flag in zip(params, some.tolist(), strict=True) if flag]
            grads = self._reduce_scatter([p.grad if p.grad is not None else torch.zeros_like(p) for p in found])
        grad_of = {id(p): g for p, g in zip(found, grads, strict=True)}
        for param in params:
            param.data = self._rows(param.data)
            param.grad = grad_of.get(id(param))
        self._gathered = False

    def restore(self, store) -> None:
        """After a step that failed: the rows back, this step's gradients dropped (no collective)."""
        if not self._gathered:
            return
        for param in self._params(store):
            param.data = self._rows(param.data)
            param.grad = None
        self._gathered = False

    @contextlib.contextmanager
    def whole(self, store, optimizer=None) -> Iterator[None]:
        """Every spread weight whole on every pp rank, with its gradient and ``optimizer``'s state of its shape
        (collective over pp); afterwards each rank keeps its rows of whatever they then hold (a loaded state)."""
        if not self.names or self._gathered:  # nothing spread, or whole already (a step, an enclosing call)
            yield
            return
        self._gathered = True
        params = self._params(store)
        slots: list[tuple[object, object]] = []  # (holder, key): where each gathered tensor goes
        rows: list[torch.Tensor] = []
        for param in params:
            if optimizer is not None:
                state = optimizer.state.get(param, {})
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.dim() and value.shape == param.shape:
                        slots.append((state, key))
                        rows.append(value)
            slots.append((param, "data"))
            rows.append(param.data)
            if param.grad is not None:
                slots.append((param, "grad"))
                rows.append(param.grad)
        for (holder, key), whole in zip(slots, self._gather(rows), strict=True):
            if isinstance(holder, dict):
                holder[key] = whole
            else:
                setattr(holder, key, whole)  # "data" comes before "grad": a gradient takes its parameter's shape
        try:
            yield
        finally:
            self._gathered = False
            for param in params:
                param.data = self._rows(param.data)
                if param.grad is not None:
                    param.grad = self._rows(param.grad)
            if optimizer is not None:  # a load may have installed state of the whole shape
                for param in params:
                    state = optimizer.state.get(param, {})
                    whole_shape = (param.shape[0] * self.p, *param.shape[1:])
                    for key, value in list(state.items()):
                        if isinstance(value, torch.Tensor) and value.dim() and tuple(value.shape) == whole_shape:
                            state[key] = self._rows(value)


NONE = Spread((), None, 1, 0, [0])


def _by_dtype(tensors: list[torch.Tensor]) -> list[list[int]]:
    """The positions of ``tensors``, grouped by dtype (and device), in order."""
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    return list(groups.values())


def of(pm) -> Spread:
    """The spread weights of parallel model ``pm`` (none without pipelining)."""
    return pm.pipeline.spread if pm.pipeline is not None else NONE
