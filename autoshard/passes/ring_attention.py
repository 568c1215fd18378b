"""Ring attention: exact attention of this cp rank's queries against the whole sequence's keys, blockwise.

Context parallelism leaves each of the ``c`` cp ranks holding the token positions ``layout[rank]`` of the
sequence (contiguous chunks, or with load balance chunks ``r`` and ``2c-1-r`` of ``2c``). Attention needs
every key for every query; instead of all-gathering keys and values (``SequenceGather``), ``RingAttention``
passes them around the ring of cp ranks: a rank holds only the block it works on and the one arriving.

Forward (``c`` steps). At step ``s`` rank ``r`` holds the key/value block of rank ``src = (r - s) mod c``,
whose global positions are ``layout[src]``. It posts the exchange for the next step first (send the block
to ``r + 1``, receive the next one from ``r - 1``; ``c - 1`` exchanges in all), then attends its queries to
the block it holds, masking by *global* positions (causal: key position <= query position; an explicit mask
is indexed with the block's key positions), and merges the block into an online softmax: a running row max
``m``, a running sum ``l`` of ``exp(score - m)`` and a running ``exp``-weighted sum of values, all in fp32
(float64 inputs stay float64). The result is ``acc / l``; the saved log-sum-exp ``lse = m + log(l)`` is
all the backward needs of the softmax. Rows whose every key is masked give zeros, as
``F.scaled_dot_product_attention`` does, and no NaN (their ``lse`` is ``-inf``; the backward gives them 0).
Under a causal mask a block is computed in pieces, runs of consecutive query positions against runs of
key positions (one each for contiguous chunks, two under load balance), and a piece whose keys all lie
after its queries is skipped (``RingAttention.pairs``): with load balance about half of every block.

Backward, the twin (``c`` steps over the same ring). The key/value blocks travel again; each step recomputes
the block's probabilities from the saved ``lse`` (``P = exp(score - lse)``) and forms the usual gradients
with ``delta = rowsum(dO * O)``: ``dS = P * (dO @ V^T - delta)``, ``dQ += scale * dS @ K`` (accumulated
locally), ``dK += scale * dS^T @ Q`` and ``dV += P^T @ dO``. The fp32 ``dK``/``dV`` accumulators travel
*with* their block: a rank adds its contribution and sends the accumulator on, and after ``c`` sends (one
more than the key/value blocks) each block's accumulator is back on its owner holding the sum of all ranks'
contributions. A float mask that requires grad receives ``dS`` at its own positions; a bool mask has none.

Communication: batched ``isend``/``irecv`` on ``group``, addressed by group rank. Every exchange posts its
receives before its sends; all ops of a batch are asynchronous, so no rank waits on a peer before posting
its own ops (no deadlock on gloo, whose sends may block until matched). Between one pair of ranks the
messages of a step go in one direction in one order (keys, values, then the gradient accumulators, under a
second tag) and are received in that same order, which gloo's per-pair FIFO matching requires.

Grouped-query attention: keys/values may have fewer heads (dim -3) than the queries, as long as the query
heads are a multiple; the blocks travel with their own (fewer) heads and are repeated (``repeat_interleave``,
as ``enable_gqa=True`` does) only inside the block computation; their gradients are summed back per group.

With ``size == 1`` the same blockwise computation runs on the one local block and needs no group; with
``size > 1`` and no group (a graph built only to be inspected) ``forward`` raises.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.function import once_differentiable

from autoshard import peers
from autoshard.passes.collectives import Wire, _ParallelOp, on_host

_KV_TAG, _GRAD_TAG = 71, 72  # p2p tags of the key/value blocks and of their travelling gradients


class RingAttention(_ParallelOp):
    """``softmax(q k^T * scale + mask) v`` of this rank's queries over the full sequence, keys passed on a ring.

    ``layout[r]`` holds the global token positions of cp rank ``r`` in its local order (all of one length);
    ``causal`` masks key positions greater than the query position; ``scale`` defaults to ``1/sqrt(D)``.
    """

    kind, backward_kind = "ring", "ring"

    def __init__(self, *, causal: bool, scale: float | None, layout: list[torch.Tensor], group, size: int,
                 rank: int) -> None:
        super().__init__(group=group, size=size, rank=rank)
        if len(layout) != size:
            raise ValueError(f"RingAttention: the layout has {len(layout)} ranks' positions, the cp group {size}")
        self.causal, self.scale = bool(causal), scale
        self.layout = [torch.as_tensor(p, dtype=torch.long).cpu() for p in layout]
        # ranks may hold a token more or less (a length cp does not divide): blocks travel padded to the longest
        self.most = max(len(p) for p in self.layout)
        self.seq_len = sum(len(p) for p in self.layout)
        self._pairs: dict = {}  # host-side piece lists per source rank (``pairs``, ``blocks``)
        self._runs = _runs(self.layout[rank]) if causal else [slice(0, len(self.layout[rank]))]
        self._on: dict = {}  # each rank's positions on a device, copied there once

    def positions(self, rank: int, device: torch.device) -> torch.Tensor:
        """Rank ``rank``'s token positions on ``device`` (copied once: a copy per step would wait for the device)."""
        key = (rank, device)
        if key not in self._on:
            self._on[key] = self.layout[rank].to(device)
        return self._on[key]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        self._check_inputs(q, k, v, mask)
        device = q.device.type
        if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):  # SDPA's autocast policy
            dtype = torch.get_autocast_dtype(q.device.type)
            q, k, v = (t.to(dtype) if t.is_floating_point() else t for t in (q, k, v))
            mask = mask.to(dtype) if mask is not None and mask.is_floating_point() else mask
        fused = (on_host(q) and q.dtype == k.dtype == v.dtype and _fusable(q, k, v)
                 and not (mask is not None and mask.requires_grad and torch.is_grad_enabled()))
        out = (_FusedRingFn if fused else _RingAttentionFn).apply(q, k, v, mask, self)
        if out.dim() == 4:  # laid out like SDPA's output, (B, T, H, D) in memory, which models view after a transpose
            out = out.transpose(1, 2).contiguous().transpose(1, 2)
        return out

    def _check_inputs(self, q, k, v, mask) -> None:
        local = len(self.layout[self.rank])
        if q.shape[-2] != local or k.shape[-2] != local or v.shape[-2] != local:
            raise ValueError(f"RingAttention: q, k, v hold {q.shape[-2]}, {k.shape[-2]}, {v.shape[-2]} tokens, "
                             f"but cp rank {self.rank} holds {local} positions")
        if k.shape != v.shape[:-1] + k.shape[-1:] or k.shape[-1] != q.shape[-1]:
            raise ValueError(f"RingAttention: k {tuple(k.shape)} and v {tuple(v.shape)} do not fit q {tuple(q.shape)}")
        if q.dim() >= 3 and q.shape[-3] % k.shape[-3]:
            raise ValueError(f"RingAttention: {q.shape[-3]} query heads are not a multiple of {k.shape[-3]} key heads")
        if mask is not None and (mask.shape[-1] not in (1, self.seq_len)
                                 or mask.dim() >= 2 and mask.shape[-2] not in (1, local)):
            raise ValueError(f"RingAttention: the mask {tuple(mask.shape)} must broadcast to (..., {local}, "
                             f"{self.seq_len}): this rank's query rows by the full sequence's keys in natural order")

    def ring_group(self):
        """The group to exchange blocks over, or None when there is no ring (size 1)."""
        return self._run_group()

    def query_runs(self) -> list[slice]:
        """This rank's queries in the pieces the blocks are computed for: runs of consecutive positions when
        causal (so a wholly masked part can be left out), all at once otherwise."""
        return self._runs

    def pairs(self, src: int) -> list[tuple[slice, list[slice]]]:
        """The parts of rank ``src``'s block this rank's queries attend: for each run of consecutive query
        positions (one, or two under load balance), the runs of ``src``'s key positions that are not wholly
        after it (causal). Parts wholly masked are never computed (host check, cached)."""
        if src not in self._pairs:
            mine, theirs = self.layout[self.rank], self.layout[src]
            out = []
            for rows in self.query_runs():
                last = mine[rows].max()
                runs = _runs(theirs) if self.causal else [slice(0, len(theirs))]
                cols = [c for c in runs if not (self.causal and bool(theirs[c].min() > last))]
                if cols:
                    out.append((rows, cols))
            self._pairs[src] = out
        return self._pairs[src]

    def blocks(self, src: int) -> list[tuple[slice, slice, str]]:
        """The pieces of rank ``src``'s block that this rank's queries attend, as (query rows, key rows, kind): runs
        of consecutive positions paired, each ``"full"`` (every key attended), ``"diagonal"`` (the same positions:
        causal from the top left), or ``"masked"`` (causal by positions, runs that overlap otherwise); under a
        causal mask a piece whose keys all lie after its queries is left out (host check, cached). Without one,
        every piece is ``"full"`` unless an explicit mask says otherwise (``_piece_mask``)."""
        key = ("blocks", src)
        if key not in self._pairs:
            mine, theirs = self.layout[self.rank], self.layout[src]
            out = []
            for rows in _runs(mine):
                for cols in _runs(theirs):
                    qp, kp = mine[rows], theirs[cols]
                    if not self.causal:
                        out.append((rows, cols, "full"))
                    elif not bool(kp.min() > qp.max()):
                        kind = ("diagonal" if torch.equal(qp, kp) else "full" if bool(kp.max() <= qp.min())
                                else "masked")
                        out.append((rows, cols, kind))
            self._pairs[key] = out
        return self._pairs[key]

    def extra_repr(self) -> str:
        return (f"causal={self.causal}, scale={self.scale}, tokens={len(self.layout[self.rank])}/{self.seq_len}, "
                f"size={self.size}, rank={self.rank}")

    def comm_bytes(self, input_shape: Sequence[int], elem_size: int) -> tuple[int, int]:
        """Bytes this rank sends in (forward, backward) for key and value blocks of ``input_shape`` each.

        ``input_shape`` is this rank's key block ``(B, H_kv, T_local, D)`` (the query's shape without GQA).
        Forward: ``c - 1`` key and value blocks. Backward: the ``c - 1`` key and value blocks again, plus
        ``c`` dK/dV accumulators, in fp32 (or the inputs' dtype when wider).
        """
        if self.size == 1:
            return 0, 0
        block, hops = int(torch.Size(input_shape).numel()), self.size - 1
        return 2 * block * elem_size * hops, 2 * block * (elem_size * hops + max(elem_size, 4) * self.size)

    def wires(self, q, k, v, mask=None):
        """Forward: ``size - 1`` shifts of the key and value blocks (each sent on, the previous rank's received),
        padded to the most tokens a rank holds, in the dtype attention runs in. Backward: those shifts again, and
        ``size`` shifts of the travelling key and value gradients, in the accumulation dtype."""
        if self.size == 1:
            return (), ()
        dtype = k.dtype
        if torch.amp.is_autocast_available(k.device.type) and torch.is_autocast_enabled(k.device.type):
            dtype = torch.get_autocast_dtype(k.device.type)
        acc = torch.promote_types(dtype, torch.float32) if q.is_floating_point() else q.dtype
        blocks = [t.numel() // t.shape[-2] * self.most for t in (k, v)]

        def shifts(times: int, of: torch.dtype) -> tuple[Wire, ...]:
            return tuple(Wire(kind, block, of, peer=peer) for _ in range(times) for kind, peer in
                         (("recv", -1), ("send", 1)) for block in blocks)

        return shifts(self.size - 1, dtype), shifts(self.size - 1, dtype) + shifts(self.size, acc)


class _Ring:
    """Shifts tensors one step around the cp ring: send to ``rank + 1``, receive from ``rank - 1``."""

    def __init__(self, group, size: int, rank: int) -> None:
        self.group, self.next, self.prev = group, (rank + 1) % size, (rank - 1) % size

    def shift(self, tensors: list[torch.Tensor], tag: int) -> tuple[list, list[torch.Tensor]]:
        """Post the exchange; returns the requests and the buffers that will hold the previous rank's tensors."""
        sends = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in sends]
        if peers.fake(sends):  # run on fake tensors for its shapes: nothing to send
            return [], received
        ops = [dist.P2POp(dist.irecv, t, group=self.group, group_peer=self.prev, tag=tag) for t in received]
        ops += [dist.P2POp(dist.isend, t, group=self.group, group_peer=self.next, tag=tag) for t in sends]
        peers.issued(self.group)
        for t in received:
            peers.sent("recv", t, self.group, peer=f"from {dist.get_global_rank(self.group, self.prev)}")
        for t in sends:
            peers.sent("send", t, self.group, peer=f"to {dist.get_global_rank(self.group, self.next)}")
        return dist.batch_isend_irecv(ops), received


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows (dim -2) added up to ``rows``: the block a rank holding fewer tokens sends. The pieces
    never read the padding (they take the source's own runs)."""
    if t.shape[-2] == rows:
        return t
    return torch.cat([t, t.new_zeros((*t.shape[:-2], rows - t.shape[-2], t.shape[-1]))], dim=-2)


def _runs(positions: torch.Tensor) -> list[slice]:
    """Runs of consecutive positions, as slices of the local order (load balance gives two per rank)."""
    breaks = [0, *(int(i) + 1 for i in torch.nonzero(positions[1:] - positions[:-1] != 1).flatten()), len(positions)]
    return [slice(a, b) for a, b in zip(breaks, breaks[1:], strict=False)]


def _take(t: torch.Tensor, runs: list[slice]) -> torch.Tensor:
    """The rows (dim -2) of ``t`` in ``runs``: a view for one run."""
    return t[..., runs[0], :] if len(runs) == 1 else torch.cat([t[..., r, :] for r in runs], dim=-2)


def _pieces(op: RingAttention, src: int, block: tuple[torch.Tensor, torch.Tensor]):
    """For each piece of rank ``src``'s block this rank attends (``op.pairs``): the query rows, the block's row
    runs, their keys and values, and those keys' global positions."""
    kpos = op.positions(src, block[0].device)
    for rows, cols in op.pairs(src):
        yield rows, cols, _take(block[0], cols), _take(block[1], cols), torch.cat([kpos[c] for c in cols])


def _rows(mask: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    """An explicit mask's rows for these queries (a mask broadcast over the rows is shared)."""
    if mask is None or mask.dim() < 2 or mask.shape[-2] == 1:
        return mask
    return mask[..., rows, :]


def _wait(works: list) -> None:
    """Wait for the ring's sends and receives for as long as the group allows. Not in ``peers.wait``'s one-second
    slices: a gloo point-to-point wait that times out closes its connection, so a peer a second late (compiling, or
    on a crowded machine) would end a healthy step. A peer's failure here ends the step at the group's timeout."""
    for work in works:
        work.wait()


# ------------------------------------------------------------------------------------------- block math


def _acc(t: torch.Tensor) -> torch.dtype:
    """The accumulation dtype: fp32, or the inputs' own dtype when that is wider (float64)."""
    return torch.promote_types(t.dtype, torch.float32)


def _heads(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Keys/values repeated to the queries' head count (grouped-query attention), in the accumulation dtype."""
    t = t.to(_acc(like))
    if t.dim() >= 3 and t.shape[-3] != like.shape[-3]:
        t = t.repeat_interleave(like.shape[-3] // t.shape[-3], dim=-3)
    return t


def _fold_heads(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The gradient of ``_heads``: sum the repeated heads of each group; then sum any broadcast batch dims."""
    if grad.dim() >= 3 and grad.shape[-3] != like.shape[-3]:
        groups = grad.shape[-3] // like.shape[-3]
        grad = grad.unflatten(-3, (like.shape[-3], groups)).sum(-3)
    return grad.sum_to_size(like.shape)


def _scores(q, k, qpos, kpos, mask, causal: bool, scale: float) -> torch.Tensor:
    """``q k^T * scale`` of one block with its masks applied (``-inf`` where a key is not attended)."""
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if mask is not None:
        block = mask if mask.shape[-1] == 1 else mask.index_select(-1, kpos)
        s = s.masked_fill(~block, float("-inf")) if block.dtype == torch.bool else s + block.to(s.dtype)
    if causal:
        s = s.masked_fill(qpos[:, None] < kpos[None, :], float("-inf"))
    return s


class _Online:
    """The online softmax of one rank's queries: running row max, row sum and weighted value sum."""

    def __init__(self) -> None:
        self.m = self.l = self.acc = None  # shaped by the first block (this rank's own, never skipped)

    def add(self, s: torch.Tensor, v: torch.Tensor) -> None:
        if self.m is None:
            self.m, self.l = s.new_full(s.shape[:-1], float("-inf")), s.new_zeros(s.shape[:-1])
            self.acc = s.new_zeros(*s.shape[:-1], v.shape[-1])
        m = torch.maximum(self.m, s.amax(-1))
        safe = m.masked_fill(m == float("-inf"), 0.0)  # rows with nothing attended yet: keep exp() at 0, not NaN
        p = torch.exp(s - safe[..., None])
        alpha = torch.exp(self.m - safe)
        self.l = self.l * alpha + p.sum(-1)
        self.acc = self.acc * alpha[..., None] + torch.matmul(p, v)
        self.m = m

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention output (zeros on fully masked rows) and the log-sum-exp (``-inf`` there)."""
        empty = self.l == 0
        out = self.acc / self.l.masked_fill(empty, 1.0)[..., None]
        lse = (self.m + torch.log(self.l.masked_fill(empty, 1.0))).masked_fill(empty, float("-inf"))
        return out, lse


# --------------------------------------------------------------------------------------- forward, backward


class _RingAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, op: RingAttention):
        group, size, rank = op.ring_group(), op.size, op.rank
        scale = op.scale if op.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        qpos = op.positions(rank, q.device)
        ring = _Ring(group, size, rank) if size > 1 else None
        qf, block = q.to(_acc(q)), (_padded(k, op.most), _padded(v, op.most))
        states = {rows.start: _Online() for rows in op.query_runs()}  # one online softmax per query run
        for step in range(size):
            src = (rank - step) % size
            works, incoming = ring.shift(list(block), _KV_TAG) if step < size - 1 else ([], block)
            for rows, _, kb, vb, cpos in _pieces(op, src, block):
                s = _scores(qf[..., rows, :], _heads(kb, q), qpos[rows], cpos, _rows(mask, rows), op.causal, scale)
                states[rows.start].add(s, _heads(vb, q))
            _wait(works)
            block = tuple(incoming)
        results = [states[rows.start].result() for rows in op.query_runs()]
        out, lse = torch.cat([r[0] for r in results], dim=-2), torch.cat([r[1] for r in results], dim=-1)
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.op, ctx.scale = op, scale
        return out.to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, mask, out, lse = ctx.saved_tensors
        op, scale = ctx.op, ctx.scale
        size, rank = op.size, op.rank
        ring = _Ring(op.ring_group(), size, rank) if size > 1 else None
        qf, dof = q.to(_acc(q)), dout.to(_acc(q))
        delta = (dof * out).sum(-1, keepdim=True)
        lse = lse.masked_fill(lse == float("-inf"), float("inf"))[..., None]  # fully masked rows: P = 0
        qpos = op.positions(rank, q.device)
        dmask = qf.new_zeros(mask.shape) if _mask_grad(ctx, mask) else None
        dq = qf.new_zeros(q.shape)
        block = (_padded(k, op.most), _padded(v, op.most))
        grads = (qf.new_zeros(block[0].shape), qf.new_zeros(block[1].shape))
        for step in range(size):
            src = (rank - step) % size
            works, incoming = ring.shift(list(block), _KV_TAG) if step < size - 1 else ([], block)
            for rows, cols, kb, vb, cpos in _pieces(op, src, block):
                kf, vf = _heads(kb, q), _heads(vb, q)
                qr, dor = qf[..., rows, :], dof[..., rows, :]
                p = torch.exp(_scores(qr, kf, qpos[rows], cpos, _rows(mask, rows), op.causal, scale)
                              - lse[..., rows, :])
                ds = p * (torch.matmul(dor, vf.transpose(-2, -1)) - delta[..., rows, :])
                dq[..., rows, :] += (torch.matmul(ds, kf) * scale).sum_to_size(dq[..., rows, :].shape)
                _add_rows(grads[0], cols, _fold_heads(torch.matmul(ds.transpose(-2, -1), qr) * scale, kb))
                _add_rows(grads[1], cols, _fold_heads(torch.matmul(p.transpose(-2, -1), dor), vb))
                if dmask is not None:
                    _add_mask_grad(dmask if dmask.dim() < 2 or dmask.shape[-2] == 1 else dmask[..., rows, :],
                                   ds, cpos)
            grad_works, grad_incoming = ring.shift(list(grads), _GRAD_TAG) if ring else ([], grads)
            _wait(works)
            _wait(grad_works)
            block, grads = tuple(incoming), tuple(grad_incoming)
        dmask = None if dmask is None else dmask.to(mask.dtype)
        held = k.shape[-2]
        return dq.to(q.dtype), grads[0][..., :held, :].to(k.dtype), grads[1][..., :held, :].to(v.dtype), dmask, None


def _add_rows(acc: torch.Tensor, runs: list[slice], grad: torch.Tensor) -> None:
    """Add ``grad`` (the rows of ``runs``, concatenated) into the travelling accumulator ``acc``."""
    start = 0
    for r in runs:
        n = r.stop - r.start
        acc[..., r, :] += grad[..., start:start + n, :]
        start += n


def _mask_grad(ctx, mask: torch.Tensor | None) -> bool:
    return mask is not None and ctx.needs_input_grad[3] and mask.dtype != torch.bool


def _add_mask_grad(dmask: torch.Tensor, ds: torch.Tensor, kpos: torch.Tensor) -> None:
    """Add one block's score gradient to the float mask's gradient, at the block's key columns."""
    if dmask.shape[-1] == 1:
        dmask += ds.sum_to_size(dmask.shape)
    else:
        dmask.index_add_(-1, kpos, ds.sum_to_size(*dmask.shape[:-1], ds.shape[-1]))


# ------------------------------------------------------------------------------------- fused block kernel

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu



def _fusable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the fused CPU kernel takes these: one head size for q, k and v (not multi-head latent attention's
    wider q/k), four dims."""
    return q.dim() == k.dim() == v.dim() == 4 and q.shape[-1] == k.shape[-1] == v.shape[-1]
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _piece_mask(op: RingAttention, mask, rows: slice, cols: slice, src: int, kind: str, like: torch.Tensor):
    """How one piece runs: (its additive mask or None, causal from the top left), or None when nothing in it is
    attended (the caller skips it, whatever the mask's kind).

    An explicit mask's rows and key columns are looked at first: a bool piece all false is skipped, all true needs
    no mask, and the lower triangle on the same positions (a causal mask the model built itself) runs as causal;
    any other piece carries its mask (a bool one as ``0 / -inf``), with a ``"masked"`` piece's causal rule by
    positions folded in."""
    qpos, kpos = op.layout[op.rank][rows], op.layout[src][cols]
    block = None
    if mask is not None:
        block = _rows(mask, rows)
        if block.shape[-1] != 1:
            block = block.index_select(-1, kpos.to(block.device))
        if block.dtype == torch.bool:
            if not bool(block.any()):
                return None
            if bool(block.all()):
                block = None
            elif kind != "masked" and torch.equal(qpos, kpos) and block.shape[-1] == block.shape[-2] == len(qpos):
                tril = torch.ones(len(qpos), len(qpos), dtype=torch.bool, device=block.device).tril()
                if torch.equal(block, tril.expand(block.shape)):
                    return None, True
        if block is not None:
            block = (torch.zeros(block.shape, dtype=like.dtype, device=like.device).masked_fill(~block, float("-inf"))
                     if block.dtype == torch.bool else block.to(like.dtype))
    if kind == "masked":
        causal = torch.zeros(len(qpos), len(kpos), dtype=like.dtype, device=like.device)
        causal = causal.masked_fill(qpos[:, None].to(like.device) < kpos[None, :].to(like.device), float("-inf"))
        block = causal if block is None else block + causal
    return block, kind == "diagonal"


class _FusedRingFn(torch.autograd.Function):
    """Ring attention whose pieces run torch's fused CPU attention kernel, merged by their log-sum-exp.

    Forward: each piece gives its output and log-sum-exp; pieces merge as ``out = sum_i exp(lse_i - lse) out_i``
    with ``lse = logsumexp_i lse_i`` (rows no key reaches keep ``lse = -inf`` and a zero output). Backward: the
    kernel's backward of each piece, given the *merged* output and log-sum-exp, is that piece's exact share of
    the gradients (its probabilities are ``exp(score - lse)``, and ``rowsum(dO * O)`` is the whole row's). The
    ring, the travelling key/value gradient accumulators and the skipped pieces are those of ``_RingAttentionFn``.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, op: RingAttention):
        size, rank = op.size, op.rank
        scale = op.scale if op.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        ring = _Ring(op.ring_group(), size, rank) if size > 1 else None
        acc = _acc(q)
        out = q.new_zeros(q.shape, dtype=acc)
        lse = q.new_full((*q.shape[:-1],), float("-inf"), dtype=acc)
        block = (_padded(k, op.most), _padded(v, op.most))
        for step in range(size):
            src = (rank - step) % size
            works, incoming = ring.shift(list(block), _KV_TAG) if step < size - 1 else ([], block)
            for rows, cols, kind in op.blocks(src):
                how = _piece_mask(op, mask, rows, cols, src, kind, q)
                if how is None:
                    continue
                piece, causal = how
                o, m = _FLASH(q[..., rows, :], block[0][..., cols, :], block[1][..., cols, :], 0.0, causal,
                              attn_mask=piece, scale=scale)
                m = m.to(acc)
                if piece is not None:  # rows the piece's mask empties: the kernel says lse 0, they hold nothing
                    m = m.masked_fill(~torch.isfinite(piece).any(-1).expand(m.shape), float("-inf"))
                _merge(out[..., rows, :], lse[..., rows], o.to(acc), m)
            _wait(works)
            block = tuple(incoming)
        ctx.save_for_backward(q, k, v, mask, out.to(q.dtype), lse)
        ctx.op, ctx.scale = op, scale
        return out.to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, mask, out, lse = ctx.saved_tensors
        op, scale = ctx.op, ctx.scale
        size, rank = op.size, op.rank
        ring = _Ring(op.ring_group(), size, rank) if size > 1 else None
        acc = _acc(q)
        lse = lse.masked_fill(lse == float("-inf"), float("inf")).to(torch.float32 if q.dtype != torch.float64
                                                                      else q.dtype)  # no key: probabilities 0
        dout = dout.contiguous()
        dq = q.new_zeros(q.shape, dtype=acc)
        block = (_padded(k, op.most), _padded(v, op.most))
        grads = (k.new_zeros(block[0].shape, dtype=acc), v.new_zeros(block[1].shape, dtype=acc))
        for step in range(size):
            src = (rank - step) % size
            works, incoming = ring.shift(list(block), _KV_TAG) if step < size - 1 else ([], block)
            for rows, cols, kind in op.blocks(src):
                how = _piece_mask(op, mask, rows, cols, src, kind, q)
                if how is None:
                    continue
                piece, causal = how
                gq, gk, gv = _FLASH_BACKWARD(dout[..., rows, :], q[..., rows, :], block[0][..., cols, :],
                                             block[1][..., cols, :], out[..., rows, :], lse[..., rows].contiguous(),
                                             0.0, causal, attn_mask=piece, scale=scale)
                dq[..., rows, :] += gq
                grads[0][..., cols, :] += gk
                grads[1][..., cols, :] += gv
            grad_works, grad_incoming = ring.shift(list(grads), _GRAD_TAG) if ring else ([], grads)
            _wait(works)
            _wait(grad_works)
            block, grads = tuple(incoming), tuple(grad_incoming)
        held = k.shape[-2]
        return dq.to(q.dtype), grads[0][..., :held, :].to(k.dtype), grads[1][..., :held, :].to(v.dtype), None, None


def _merge(out: torch.Tensor, lse: torch.Tensor, piece_out: torch.Tensor, piece_lse: torch.Tensor) -> None:
    """Merge one piece's attention into the running (``out``, ``lse``) of the same rows, in place."""
    new = torch.logaddexp(lse, piece_lse)
    safe = new.masked_fill(new == float("-inf"), 0.0)  # rows nothing reached yet: both weights 0, no NaN
    out.mul_(torch.exp(lse - safe)[..., None]).add_(piece_out * torch.exp(piece_lse - safe)[..., None])
    lse.copy_(new)


# ----------------------------------------------------------------------- causal attention over gathered keys


class GatheredCausalAttention(nn.Module):
    """Causal attention of this cp rank's queries (global positions ``positions``) over the gathered keys and values
    (the whole sequence, in order), without a (T/c x T) mask: each run of consecutive query positions ``[a, b)``
    attends keys ``[0, a)`` whole and keys ``[a, b)`` causally from the top left, both with the fused CPU kernel,
    merged by log-sum-exp; keys after ``b`` are never computed. Off CPU, or with dropout, it is SDPA under the mask
    of positions."""

    def __init__(self, *, positions: torch.Tensor, seq_len: int, scale: float | None, dropout_p: float = 0.0,
                 enable_gqa: bool = False) -> None:
        super().__init__()
        self.positions = torch.as_tensor(positions, dtype=torch.long).cpu()
        self.seq_len, self.scale, self.dropout_p, self.enable_gqa = seq_len, scale, dropout_p, enable_gqa
        self.runs = [(r, int(self.positions[r.start]), int(self.positions[r.stop - 1]) + 1)
                     for r in _runs(self.positions)]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if (not on_host(q) or self.dropout_p or not q.dtype == k.dtype == v.dtype or not _fusable(q, k, v)
                or torch.is_autocast_enabled(q.device.type)):
            mask = self.mask_on(q.device)
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=self.dropout_p, scale=self.scale, enable_gqa=self.enable_gqa)
        else:
            out = _GatheredCausalFn.apply(q, k, v, self)
        if out.dim() == 4:  # laid out like SDPA's output, (B, T, H, D) in memory, which models view after a transpose
            out = out.transpose(1, 2).contiguous().transpose(1, 2)
        return out

    def mask_on(self, device: torch.device) -> torch.Tensor:
        """The causal mask of these queries' positions over the sequence, made on ``device`` once."""
        if getattr(self, "_mask", None) is None or self._mask.device != device:
            self._mask = self.positions.to(device)[:, None] >= torch.arange(self.seq_len, device=device)[None, :]
        return self._mask

    def pieces(self):
        """(query rows, key slice, causal) of every piece computed."""
        for rows, a, b in self.runs:
            if a > 0:
                yield rows, slice(0, a), False
            yield rows, slice(a, b), True

    def extra_repr(self) -> str:
        return f"tokens={len(self.positions)}/{self.seq_len}, runs={len(self.runs)}, scale={self.scale}"


class _GatheredCausalFn(torch.autograd.Function):
    """The fused kernel on each piece (see ``GatheredCausalAttention``); backward, its backward per piece given the
    merged output and log-sum-exp (as ``_FusedRingFn``)."""

    @staticmethod
    def forward(ctx, q, k, v, op: GatheredCausalAttention):
        scale = op.scale if op.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        acc = _acc(q)
        out = q.new_zeros(q.shape, dtype=acc)
        lse = q.new_full((*q.shape[:-1],), float("-inf"), dtype=acc)
        for rows, keys, causal in op.pieces():
            o, m = _FLASH(q[..., rows, :], k[..., keys, :], v[..., keys, :], 0.0, causal, scale=scale)
            _merge(out[..., rows, :], lse[..., rows], o.to(acc), m.to(acc))
        ctx.save_for_backward(q, k, v, out.to(q.dtype), lse)
        ctx.op, ctx.scale = op, scale
        return out.to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        lse = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
        dout, acc = dout.contiguous(), _acc(q)
        dq, dk, dv = (t.new_zeros(t.shape, dtype=acc) for t in (q, k, v))
        for rows, keys, causal in ctx.op.pieces():
            gq, gk, gv = _FLASH_BACKWARD(dout[..., rows, :], q[..., rows, :], k[..., keys, :], v[..., keys, :],
                                         out[..., rows, :], lse[..., rows].contiguous(), 0.0, causal,
                                         scale=ctx.scale)
            dq[..., rows, :] += gq
            dk[..., keys, :] += gk
            dv[..., keys, :] += gv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None
