"""Tensor-parallel collectives that a graph pass inserts into a ``torch.fx`` graph, each with its backward twin.

Terms:

- **group**: the ``ProcessGroup`` of one tensor-parallel axis, or ``None`` when a graph is built only to be
  inspected (printed, counted); such a graph refuses to run on more than one rank.
- **size**: the degree of the group (how many ranks share the sharded computation).
- **rank**: this rank's index inside the group, ``0 <= rank < size``.
- **shard**: the part of a tensor one rank holds along one dim. A plain shard is the rank-th 1/size slice.
- **blocked shard**: the dim is made of consecutive blocks given by their global sizes, e.g. a fused q, k, v
  projection ``(48, 48, 48)`` or the same with grouped-query attention ``(48, 24, 24)``; a rank holds the
  rank-th 1/size part of *each* block, concatenated in block order. ``blocks=None`` means one block. Blocks
  named ``whole`` are held whole by every rank (the kv heads of a fused projection the degree does not divide).
- **partial**: a value of which each rank holds a summand; the full value is the sum over the group
  (the output of a row-parallel matmul or of a vocab-parallel embedding lookup).

Every op is an ``nn.Module`` (a readable ``call_module`` node); those that communicate run through a
``torch.autograd.Function`` that carries the backward twin. Each class names its forward and backward
communication in ``kind`` and ``backward_kind`` (one of "identity", "all_reduce", "all_gather", "split",
"local"):

| module                        | forward                              | backward                            |
|-------------------------------|--------------------------------------|-------------------------------------|
| ``CopyToParallel``            | identity                             | all-reduce (sum)                    |
| ``ReduceFromParallel``        | all-reduce (sum) of a partial        | identity                            |
| ``GatherFromParallel``        | all-gather along ``dim`` (blocked)   | split: keep this rank's shard       |
| ``ScatterToParallel``         | split: keep this rank's shard        | all-gather along ``dim`` (blocked)  |
| ``VocabParallelEmbedding``    | lookup of own rows -> partial        | local (grads for own rows only)     |
| ``VocabParallelCrossEntropy`` | all-reduce max, then all-reduce sums | local: (softmax - one-hot) * scale  |

``torch.distributed.nn.functional.all_reduce`` cannot serve as ``ReduceFromParallel``: its backward
all-reduces again, which multiplies replicated gradients by the degree.

With ``size == 1`` every op is an exact local computation and needs no group; with ``size > 1`` and no
group, every op that communicates raises (the embedding lookup, being local, still runs). ``comm_bytes`` counts the
bytes each op's collectives produce per rank, so a graph's communication can be counted without processes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import ClassVar, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from autoshard import peers

ProcessGroup = dist.ProcessGroup

_REDUCTIONS = ("mean", "sum", "none")


# ---------------------------------------------------------------------------------------------------------------
# Blocked-shard index math (pure: no processes)


def check_blocks(n: int, size: int, blocks: Sequence[int] | None = None, whole: Sequence[int] = ()) -> tuple[int, ...]:
    """The global block sizes of a dim of size ``n`` (one block when ``blocks`` is None), validated for ``size``;
    the blocks ``whole`` indexes are held whole by every rank, so need not divide."""
    blocks = (n,) if blocks is None else tuple(int(b) for b in blocks)
    if sum(blocks) != n:
        raise ValueError(f"blocks {blocks} add up to {sum(blocks)}, but the dim has size {n}; "
                         f"give the global block sizes, which must add up to {n}")
    uneven = [b for i, b in enumerate(blocks) if b % size and i not in whole]
    if uneven:
        raise ValueError(f"blocks {uneven} of {blocks} do not divide by the degree {size}; "
                         f"use a degree that divides every block, or pad the blocks")
    return blocks


def _pieces(n: int, rank: int, size: int, blocks, whole) -> list[tuple[int, int]]:
    """(start, length) along the dim of each piece ``rank`` holds, in its local order."""
    pieces, start = [], 0
    for i, block in enumerate(check_blocks(n, size, blocks, whole)):
        part = block if i in whole else block // size
        pieces.append((start if i in whole else start + rank * part, part))
        start += block
    return pieces


def local_indices(n: int, rank: int, size: int, blocks: Sequence[int] | None = None,
                  whole: Sequence[int] = ()) -> torch.Tensor:
    """The global indices along a dim of size ``n`` that ``rank`` holds, in its local order."""
    return torch.cat([torch.arange(start, start + part) for start, part in _pieces(n, rank, size, blocks, whole)])


def shard(x: torch.Tensor, dim: int, rank: int, size: int, blocks: Sequence[int] | None = None,
          whole: Sequence[int] = ()) -> torch.Tensor:
    """This rank's (blocked) shard of ``x`` along ``dim``: ``x.index_select(dim, local_indices(...))``."""
    pieces = [x.narrow(dim, start, part) for start, part in _pieces(x.shape[dim], rank, size, blocks, whole)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def unshard(parts: Sequence[torch.Tensor], dim: int, blocks: Sequence[int] | None = None,
            whole: Sequence[int] = ()) -> torch.Tensor:
    """The global tensor from every rank's (blocked) shard, ``parts`` ordered by rank; the inverse of ``shard``
    (a block held whole is taken from the first part: every rank holds the same)."""
    size = len(parts)
    n = sum(blocks) if blocks is not None else parts[0].shape[dim] * size
    blocks = check_blocks(n, size, blocks, whole)
    if len(blocks) == 1:
        return torch.cat(list(parts), dim)
    pieces, offset = [], 0
    for i, block in enumerate(blocks):
        part = block if i in whole else block // size
        pieces.extend(p.narrow(dim, offset, part) for p in (parts[:1] if i in whole else parts))
        offset += part
    return torch.cat(pieces, dim)


def local_part(full: torch.Tensor, placement, rank: int, size: int) -> torch.Tensor:
    """This rank's part of ``full`` under a ``Shard`` placement: its blocks (some perhaps held whole), or its
    chunk of a dim the degree does not divide, padded up with zeros first (a padded vocabulary)."""
    dim = placement.dim
    if placement.blocks is None and full.shape[dim] % size:
        extra = list(full.shape)
        extra[dim] = -full.shape[dim] % size
        full = torch.cat([full, full.new_zeros(extra)], dim)
    return shard(full, dim, rank, size, placement.blocks, placement.whole)


# ---------------------------------------------------------------------------------------------------------------
# The collectives themselves, without autograd


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, group=None) -> None:  # noqa: A002
    """``dist.reduce_scatter_single`` (a sum), as torch >= 2.12 names it (it warns that ``reduce_scatter_tensor`` is
    deprecated); looked up at the call, so a simulation that replaces it is seen."""
    peers.run(getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor, output, input, group=group)


def _all_reduce(x: torch.Tensor, group: ProcessGroup | None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """A reduced copy of ``x``; the input is left alone because autograd may still need it."""
    if group is None:
        return x
    out = x.contiguous().clone()
    peers.run(dist.all_reduce, out, op=op, group=group)
    return out


def _all_gather(x: torch.Tensor, dim: int, size: int, blocks: tuple[int, ...] | None, group,
                whole: tuple[int, ...] = ()) -> torch.Tensor:
    if group is None:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    peers.run(dist.all_gather, parts, x, group=group)
    return unshard(parts, dim, blocks, whole)


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, rank, size, blocks, group, whole=()):
        ctx.args = (dim, rank, size, blocks, whole)
        return _all_gather(x, dim, size, blocks, group, whole)

    @staticmethod
    def backward(ctx, grad):
        if grad.layout != torch.strided:  # a sparse gradient (an embedding with sparse=True, run replicated)
            grad = grad.to_dense()
        return shard(grad, *ctx.args).contiguous(), None, None, None, None, None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, rank, size, blocks, group, whole=()):
        ctx.args = (dim, size, blocks, group, whole)
        return shard(x, dim, rank, size, blocks, whole).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, *ctx.args), None, None, None, None, None, None


# ---------------------------------------------------------------------------------------------------------------
# Modules


class Seen(NamedTuple):
    """A module's input as the program runs, for ``wires``: its shape, dtype, whether a gradient flows back through
    it, and the device it is on (a fake tensor answers the same questions)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False
    device: torch.device = torch.device("cpu")

    def numel(self) -> int:
        return _numel(self.shape)

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point


class Wire(NamedTuple):
    """One collective a module issues in one call of its forward or backward, as this rank puts it on the wire:
    its kind and the elements and dtype of what this rank hands it (an all-reduce's buffer, an all-gather's part,
    a reduce-scatter's whole input, an all-to-all's input, a point-to-point message). ``routed``: how many
    elements depends on the data (rows routed to experts): not certified, nor how many such calls a step makes
    (an expert held by one rank routes its rows back in the backward where they take a gradient), only their
    dtype. ``peer``: a
    message's other rank, as an offset in the group (+1: the next rank, -1: the previous)."""

    kind: str
    numel: int
    dtype: torch.dtype
    routed: bool = False
    peer: int = 0


class _ParallelOp(nn.Module):
    """Common part: the group, its degree and this rank's index; ``kind`` names the forward communication."""

    kind: ClassVar[str]
    backward_kind: ClassVar[str]
    calls: ClassVar[tuple[int, int]] = (1, 1)  # collectives per (forward, backward) where that pass communicates

    def __init__(self, *, group: ProcessGroup | None, size: int, rank: int) -> None:
        super().__init__()
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"{type(self).__name__}: rank {rank} is not in a group of size {size}")
        self.group, self.size, self.rank = group, size, rank
        self._checked = False

    def _run_group(self) -> ProcessGroup | None:
        """The group to communicate over, or None when the op is local (size 1)."""
        if self.size == 1:
            return None
        if self.group is None:
            raise RuntimeError(
                f"{type(self).__name__}({self.extra_repr()}): this graph was built for inspection: it has no "
                f"process group, so it cannot run on {self.size} ranks. Build it with the groups of a launched "
                f"mesh to run it."
            )
        if not self._checked:
            actual = (dist.get_world_size(self.group), dist.get_rank(self.group))
            if actual != (self.size, self.rank):
                raise RuntimeError(f"{type(self).__name__}({self.extra_repr()}) was built for rank {self.rank} of "
                                   f"{self.size}, but runs as rank {actual[1]} of a group of {actual[0]}")
            self._checked = True
        return self.group

    def comm_bytes(self, input_shape: Sequence[int], elem_size: int) -> tuple[int, int]:
        """Bytes produced per rank by the (forward, backward) collectives for an input of ``input_shape``."""
        raise NotImplementedError

    def wires(self, *inputs) -> tuple[tuple[Wire, ...], tuple[Wire, ...]]:
        """The collectives one call issues in its (forward, backward), for ``inputs`` (each with the ``shape``
        and ``dtype`` it has as the program runs; None where not a tensor): what ``autoshard.certificate``
        certifies and the first step checks."""
        raise NotImplementedError(f"{type(self).__name__} does not say what it sends")

    def __deepcopy__(self, memo: dict) -> _ParallelOp:
        # A process group is a handle on live communicators, not a value: copies share it.
        if self.group is not None:
            memo[id(self.group)] = self.group
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new


def _numel(shape: Sequence[int]) -> int:
    return int(torch.Size(shape).numel())


class CopyToParallel(_ParallelOp):
    """Megatron's f: hands a replicated value to sharded consumers; their partial gradients are summed."""

    kind, backward_kind = "identity", "all_reduce"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Copy.apply(x, self._run_group())

    def extra_repr(self) -> str:
        return f"size={self.size}"

    def comm_bytes(self, input_shape: Sequence[int], elem_size: int) -> tuple[int, int]:
        return 0, (_numel(input_shape) * elem_size if self.size > 1 else 0)

    def wires(self, x, *others):
        return (), ((Wire("all_reduce", x.numel(), x.dtype),) if self.size > 1 else ())


class ReadWhole(_ParallelOp):
    """The input of blocks every rank computes whole (the k and v of a fused projection whose kv heads the degree
    does not divide), beside an f that feeds the split blocks: the identity both ways, since their gradient is
    whole on every rank, not a part to sum. A region's entry all the same: sequence parallelism gathers the
    sequence here, and splits the gradient back without summing it."""

    kind, backward_kind = "identity", "identity"
    calls = (0, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def extra_repr(self) -> str:
        return f"size={self.size}"

    def comm_bytes(self, input_shape: Sequence[int], elem_size: int) -> tuple[int, int]:
        return 0, 0

    def wires(self, *inputs):
        return (), ()


class ReduceFromParallel(_ParallelOp):
    """Megatron's g: sums a partial value over the group; the gradient of a sum is passed through."""

    kind, backward_kind = "all_reduce", "identity"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Reduce.apply(x, self._run_group())

    def extra_repr(self) -> str:
        return f"size={self.size}"

    def comm_bytes(self, input_shape: Sequence[int], elem_size: int) -> tuple[int, int]:
        return (_numel(input_shape) * elem_size if self.size > 1 else 0), 0

    def wires(self, x, *others):
        return ((Wire("all_reduce", x.numel(), x.dtype),) if self.size > 1 else ()), ()


class _AlongDim(_ParallelOp):
    def __init__(self, *, group: ProcessGroup | None, size: int, rank: int, dim: int,
                 blocks: Sequence[int] | None = None, whole: Sequence[int] = ()) -> None:
        super().__init__(group=group, size=size, rank=rank)
        self.dim = dim
        self.blocks = None if blocks is None else tuple(int(b) for b in blocks)
        self.whole = tuple(whole)
        if self.blocks is not None:
            check_blocks(sum(self.blocks), size, self.blocks, self.whole)

    def extra_repr(self) -> str:
        blocks = "" if self.blocks is None else f", blocks={self.blocks}"
        whole = f", whole={self.whole}" if self.whole else ""
        return f"dim={self.dim}{blocks}{whole}, size={self.size}, rank={self.rank}"


class GatherFromParallel(_AlongDim):
    """All-gathers (blocked) shards along ``dim`` into the global tensor; backward keeps this rank's shard."""

    kind, backward_kind = "all_gather", "split"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Gather.apply(x, self.dim, self.rank, self.size, self.blocks, self._run_group(), self.whole)

    def comm_bytes(self, input_shape: Sequence[int], elem_size: int) -> tuple[int, int]:
        return (_numel(input_shape) * self.size * elem_size if self.size > 1 else 0), 0

    def wires(self, x, *others):
        return ((Wire("all_gather", x.numel(), x.dtype),) if self.size > 1 else ()), ()


class ScatterToParallel(_AlongDim):
    """Keeps this rank's (blocked) shard of a replicated tensor along ``dim``; backward all-gathers."""

    kind, backward_kind = "split", "all_gather"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Scatter.apply(x, self.dim, self.rank, self.size, self.blocks, self._run_group(), self.whole)

    def comm_bytes(self, input_shape: Sequence[int], elem_size: int) -> tuple[int, int]:
        return 0, (_numel(input_shape) * elem_size if self.size > 1 else 0)

    def wires(self, x, *others):
        if self.size == 1:
            return (), ()
        shape = tuple(x.shape)
        held = sum(part for _, part in _pieces(shape[self.dim], self.rank, self.size, self.blocks, self.whole))
        return (), (Wire("all_gather", _numel(shape) // shape[self.dim] * held, x.dtype),)


class _VocabRange(_ParallelOp):
    def __init__(self, *, group: ProcessGroup | None, size: int, rank: int, vocab_start: int, vocab_end: int) -> None:
        super().__init__(group=group, size=size, rank=rank)
        if not 0 <= vocab_start < vocab_end:
            raise ValueError(f"{type(self).__name__}: empty vocab range [{vocab_start}, {vocab_end})")
        self.vocab_start, self.vocab_end = vocab_start, vocab_end

    def _check_local(self, n: int, what: str) -> None:
        if n != self.vocab_end - self.vocab_start:
            raise ValueError(f"{type(self).__name__}({self.extra_repr()}): {what} has {n} vocab entries, but the "
                             f"range [{self.vocab_start}, {self.vocab_end}) holds {self.vocab_end - self.vocab_start}")


HOST_DEVICES = ("cpu",)  # where kernels run op by op and a value read back costs nothing (tests may pretend not)


def on_host(t: torch.Tensor) -> bool:
    """Whether ``t``'s kernels take the host path: CPU's fused kernels, and checks that read values back. Elsewhere
    (CUDA) every kernel is one that exists on the device, and nothing is read back to the host within a step."""
    return t.device.type in HOST_DEVICES


def _refuse_bad(values: torch.Tensor, bad: Callable[[torch.Tensor], torch.Tensor],
                message: Callable[[object], str]) -> None:
    """Raise ``IndexError(message(v))`` for the first of ``values`` where ``bad(values)`` holds. On the host (CPU,
    run op by op) the value is named; where reading it back would stall the device or break a compiled graph (CUDA,
    ``torch.compile``) the check runs on the device without a host sync (``_assert_async``), and the message says
    "an id" instead. Values without data (a graph run on meta or fake tensors to find shapes) are not checked."""
    if values.device.type == "meta" or isinstance(values, FakeTensor) and not torch.compiler.is_compiling():
        return
    if torch.compiler.is_compiling() or not on_host(values):
        torch._assert_async(~bad(values).any(), message("an id"))
        return
    found = values[bad(values)]
    if found.numel():
        raise IndexError(message(int(found[0])))


class VocabParallelEmbedding(_VocabRange):
    """Looks up the ids in this rank's vocab range [vocab_start, vocab_end); other ids give zeros (a partial).

    No communication: the pass follows it with a ``ReduceFromParallel``. ``padding_idx`` is a global id whose
    row gets no gradient, as in ``F.embedding``. ``num_embeddings`` is the real (unpadded) vocabulary: an id
    outside it raises ``F.embedding``'s ``IndexError`` on every rank (they all see the same ids), where it
    would otherwise count as another rank's id and look up zeros.
    """

    kind, backward_kind = "local", "local"

    def __init__(self, *, group: ProcessGroup | None, size: int, rank: int, vocab_start: int, vocab_end: int,
                 num_embeddings: int | None = None, padding_idx: int | None = None) -> None:
        super().__init__(group=group, size=size, rank=rank, vocab_start=vocab_start, vocab_end=vocab_end)
        self.num_embeddings = (vocab_end - vocab_start) * size if num_embeddings is None else num_embeddings
        self.padding_idx = padding_idx

    def forward(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        self._check_local(weight.shape[0], "the local weight")
        _refuse_bad(ids, lambda v: (v < 0) | (v >= self.num_embeddings),
                    lambda bad: f"index out of range in self: token id {bad} is not in the vocabulary of "
                                f"{self.num_embeddings} (ids must be in [0, {self.num_embeddings}); check that the "
                                f"tokenizer matches the model's vocabulary)")
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = torch.where(outside, 0, ids - self.vocab_start)  # row 0 stands in, then is zeroed
        pad = self.padding_idx
        local_pad = pad - self.vocab_start if pad is not None and self.vocab_start <= pad < self.vocab_end else None
        rows = F.embedding(local_ids, weight, padding_idx=local_pad)
        # masked_fill, not multiplication: a zero gradient flows to the stand-in row, never inf * 0
        return rows.masked_fill(outside.unsqueeze(-1), 0.0)

    def extra_repr(self) -> str:
        pad = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        return (f"vocab_start={self.vocab_start}, vocab_end={self.vocab_end}, num_embeddings={self.num_embeddings}"
                f"{pad}, size={self.size}")

    def comm_bytes(self, input_shape: Sequence[int], elem_size: int) -> tuple[int, int]:
        return 0, 0

    def wires(self, *inputs):
        return (), ()


class VocabParallelCrossEntropy(_VocabRange):
    """``F.cross_entropy`` over logits sharded along the vocab (last) dim, without gathering the logits.

    ``forward(logits_local (..., V_local), target (...))``. Local columns at global index >= ``vocab_size``
    are padding (the vocab padded to divide the degree) and count as -inf logits. Computed in fp32 (float64
    logits in float64); the loss
    has the logits' dtype, or float32 under autocast (cross-entropy is on autocast's float32 list, so eager
    autocast returns a float32 loss). A target outside [0, vocab_size) that is not ``ignore_index`` raises
    ``F.cross_entropy``'s ``IndexError`` on every rank, before any communication.
    """

    kind, backward_kind = "all_reduce", "local"
    calls = (2, 0)  # the row maxima, then the stacked sums

    def __init__(self, *, group: ProcessGroup | None, size: int, rank: int, vocab_start: int, vocab_end: int,
                 vocab_size: int, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0) -> None:
        super().__init__(group=group, size=size, rank=rank, vocab_start=vocab_start, vocab_end=vocab_end)
        if reduction not in _REDUCTIONS:
            raise ValueError(f"VocabParallelCrossEntropy: reduction {reduction!r} is not one of {_REDUCTIONS}")
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"VocabParallelCrossEntropy: label_smoothing {label_smoothing} is not in [0, 1]")
        self.vocab_size, self.ignore_index = vocab_size, ignore_index
        self.reduction, self.label_smoothing = reduction, label_smoothing

    @property
    def real_columns(self) -> int:
        """How many local columns are real vocab entries; the rest are padding."""
        return max(0, min(self.vocab_end, self.vocab_size) - self.vocab_start)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self._check_local(logits.shape[-1], "the local logits")
        if target.shape != logits.shape[:-1]:
            raise ValueError(f"VocabParallelCrossEntropy: target of shape {tuple(target.shape)} does not match "
                             f"logits of shape {tuple(logits.shape)} (the vocab must be the last dim)")
        _refuse_bad(target, lambda v: (v != self.ignore_index) & ((v < 0) | (v >= self.vocab_size)),
                    lambda bad: f"Target {bad} is out of bounds. The vocabulary has {self.vocab_size} entries and "
                                f"the ignored target is {self.ignore_index}; check the labels against the model's "
                                f"vocabulary")
        device = logits.device.type
        autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
        out_dtype = torch.float32 if autocast else logits.dtype
        return _CrossEntropy.apply(logits, target, self, self._run_group(), out_dtype)

    def extra_repr(self) -> str:
        extra = f", label_smoothing={self.label_smoothing}" if self.label_smoothing else ""
        return (f"vocab_start={self.vocab_start}, vocab_end={self.vocab_end}, vocab_size={self.vocab_size}, "
                f"ignore_index={self.ignore_index}, reduction={self.reduction!r}{extra}, size={self.size}")

    def comm_bytes(self, input_shape: Sequence[int], elem_size: int) -> tuple[int, int]:
        if self.size == 1:
            return 0, 0
        rows = _numel(input_shape[:-1])
        sums = 3 if self.label_smoothing else 2
        return rows * 4 * (1 + sums), 0  # fp32 whatever the logits' dtype: max, then the stacked sums

    def wires(self, logits, *others):
        if self.size == 1:
            return (), ()
        rows, compute = _numel(logits.shape[:-1]), torch.promote_types(logits.dtype, torch.float32)
        sums = 3 if self.label_smoothing else 2
        return (Wire("all_reduce", rows, compute), Wire("all_reduce", rows * sums, compute)), ()


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, op: VocabParallelCrossEntropy, group, out_dtype):
        compute = torch.promote_types(logits.dtype, torch.float32)  # at least fp32; float64 stays float64
        x = logits.to(compute).reshape(-1, logits.shape[-1])  # (N, V_local)
        t = target.reshape(-1)  # (N,)
        real = op.real_columns
        if real < x.shape[1]:
            x = x.masked_fill(torch.arange(x.shape[1], device=x.device) >= real, float("-inf"))
        # Subtracting the global max keeps exp finite; a rank holding only padding has max -inf, which the
        # all-reduce replaces.
        shifted = x - _all_reduce(x.max(dim=1).values, group, dist.ReduceOp.MAX).unsqueeze(1)
        keep = t != op.ignore_index
        owned = keep & (t >= op.vocab_start) & (t < op.vocab_end)
        local_t = torch.where(owned, t - op.vocab_start, 0)
        picked = torch.where(owned, shifted.gather(1, local_t.unsqueeze(1)).squeeze(1), 0.0)
        exp = shifted.exp()
        stats = [exp.sum(dim=1), picked]
        if op.label_smoothing:
            stats.append(shifted[:, :real].sum(dim=1))
        stats = _all_reduce(torch.stack(stats), group)  # one collective for all the sums: (2 or 3, N)
        log_z = stats[0].log()
        loss = log_z - stats[1]
        eps = op.label_smoothing
        if eps:
            loss = (1 - eps) * loss + eps * (log_z - stats[2] / op.vocab_size)
        loss = torch.where(keep, loss, 0.0)
        count = keep.sum()
        ctx.save_for_backward(exp.div_(stats[0].unsqueeze(1)), local_t, owned, keep, count)
        ctx.op, ctx.shape, ctx.dtype = op, logits.shape, logits.dtype
        if op.reduction == "none":
            return loss.reshape(target.shape).to(out_dtype)
        total = loss.sum()
        return (total / count if op.reduction == "mean" else total).to(out_dtype)

    @staticmethod
    def backward(ctx, grad_out):
        softmax, local_t, owned, keep, count = ctx.saved_tensors
        op = ctx.op
        eps = op.label_smoothing
        # d loss / d logit = softmax - (1 - eps) * onehot - eps / vocab_size over real columns; padding gets 0.
        grad = softmax.clone()  # the saved softmax stays intact for a second backward
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad.index_put_((rows, local_t), -(1 - eps) * owned.to(grad.dtype), accumulate=True)
        if eps:
            grad[:, : op.real_columns] -= eps / op.vocab_size
        grad_out = grad_out.to(grad.dtype)
        scale = grad_out.reshape(-1) if op.reduction == "none" else grad_out.expand(keep.shape)
        if op.reduction == "mean":
            scale = scale / count
        grad *= torch.where(keep, scale, 0.0).unsqueeze(1)
        return grad.reshape(ctx.shape).to(ctx.dtype), None, None, None, None


COLLECTIVES: tuple[type[_ParallelOp], ...] = (
    CopyToParallel,
    ReduceFromParallel,
    GatherFromParallel,
    ScatterToParallel,
    VocabParallelEmbedding,
    VocabParallelCrossEntropy,
)


def comm_bytes(module: nn.Module, input_shape: Sequence[int], elem_size: int) -> tuple[int, int]:
    """(forward, backward) bytes that ``module``'s collectives produce per rank for one call on ``input_shape``.

    An all-reduce counts the reduced tensor, an all-gather the gathered one; a split and local work count 0.
    ``input_shape`` is the shape of the module's first input (the local shard where the input is sharded).
    """
    if not isinstance(module, _ParallelOp):
        raise TypeError(f"comm_bytes: {type(module).__name__} is not one of {[c.__name__ for c in COLLECTIVES]}")
    return module.comm_bytes(input_shape, elem_size)
