"""A machine's measured costs: what ``autoshard calibrate`` writes and the graph-costed planner reads.

The planner's formulas cost a transformer on a preset GPU; a profile is measured where the job runs, in one short
run: compute by rank 0 alone (the other ranks wait, sleeping in a barrier), then how much slower the same compute
runs with every rank computing at once (``crowding``: on a CPU whose cores the ranks share, about the ranks over
the cores), and the collectives with every group communicating at once:

- ``matmul``: a linear's forward and backward time on a grid of shapes (rows, outputs, inputs): a product is costed
  at the nearest measured shape, scaled by its FLOPs;
- ``attention``: ``scaled_dot_product_attention``'s forward and backward by its forward FLOPs, causal;
- ``elementwise``: an op's fixed cost (dispatch and autograd, forward and backward) and its time per byte of output;
  a view's cost;
- ``optimizer``: AdamW's step per byte of parameters and per parameter tensor;
- ``collectives``: per kind (all-reduce, all-gather, reduce-scatter, all-to-all, send/recv) and group size, the
  seconds of a few sizes (``points``), every group of that size communicating at once, each call reached from a
  few ms of compute as a program reaches it (its buffers out of the caches): a size between two measured ones is
  costed between them, one past the largest on the latency and time per byte fitted over them. A point is its
  calls' lower quartile plus the rare slow calls' share of the mean, pooled over every kind and size (``_tail``);
- ``copy``: a copy's time per byte, outside autograd: a collective's buffer packed or unpacked;
- ``large``: per group size, an all-reduce of 16 MiB (a model's gradients), reached the same way: past the
  caches each byte costs more than the fit over the small sizes says; an all-reduce larger than the largest fitted
  size is costed on the line from that size's fit to this point (and on past it);
- ``tiny``: per group size, an all-reduce of one number (a step's loss, a flag per weight), reached the same way:
  gloo takes another path for it, several times faster than the fit's latency here (1 ms against 4 to 7 at 4 ranks);
- ``sync``: per group size, what a blocking collective costs beyond its own latency when the ranks reach it from
  their own compute rather than together: each rank's interruptions (the OS, another process on its core) stall
  the others at the next collective. Fitted as a cost per collective and a share of the compute between them, from
  a loop of matmuls with and without a small all-reduce after each;
- ``memory``: the bytes each rank may use: the machine's physical memory shared by the ranks on it (a GPU's own).

Bytes are counted as ``explain()`` counts them (an all-reduce: the tensor; an all-gather: the gathered tensor; a
reduce-scatter: its input; an all-to-all: what leaves the rank), so no ring factor is applied on top.

    torchrun --standalone --nproc-per-node 4 -m autoshard.planner.profile --out profile.json
    autoshard calibrate --nproc 4 --out profile.json     # the same, launched for you
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import time
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autoshard.passes.collectives import reduce_scatter_single

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
_DDP_BUCKET = 25 * 2**20  # DistributedDataParallel's default bucket: one all-reduce per 25 MiB of gradients
_TINY_BYTES = 64  # an all-reduce of up to this many bytes a call costs the profile's ``tiny``


@dataclass
class Profile:
    """Measured costs of one machine at one world size (seconds, FLOPs and bytes)."""

    world_size: int
    threads: int
    device: str
    cores: int = 0  # the cores the world's processes share (0: unknown, each process taken to have its own)
    matmul: list[tuple[int, int, int, float]] = field(default_factory=list)  # (m, n, k, forward + backward seconds)
    attention: list[tuple[float, float]] = field(default_factory=list)  # the same for causal attention
    op_seconds: float = 0.0  # an op's fixed cost, forward and backward
    view_seconds: float = 0.0  # a view's (no data moves: dispatch and autograd)
    byte_seconds: float = 0.0  # per byte of an op's output, forward and backward
    optimizer_byte_seconds: float = 0.0  # AdamW step and zero_grad per byte of parameters
    optimizer_param_seconds: float = 0.0  # and per parameter tensor (a step runs a few ops on each)
    collectives: dict[str, dict[str, tuple[float, float]]] = field(default_factory=dict)  # kind -> size -> (s, s/B)
    seconds: float = 0.0  # how long the calibration took
    memory: float = 0.0  # bytes each rank may use (0: unknown, no limit)
    sync: dict[str, tuple[float, float]] = field(default_factory=dict)  # size -> (s per collective, s per s computed)
    crowding: float = 0.0  # compute with every rank at once over rank 0 alone (0: not measured)
    tiny: dict[str, float] = field(default_factory=dict)  # size -> seconds of an all-reduce of one number
    # size -> (the largest fitted bytes, a gradient-sized all-reduce's bytes, its seconds): past the caches a byte
    # costs more than the fit's small sizes say (16 MiB over 4 ranks here: 1.04x to 1.3x the fit's extrapolation)
    large: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    # kind -> size -> the (bytes, seconds) the fit was made from: a collective is costed between the two nearest,
    # not on the fit's line, whose latency the large sizes set (2 ms here for an all-reduce of 1 KiB that takes 1)
    points: dict[str, dict[str, list[tuple[float, float]]]] = field(default_factory=dict)
    copy_byte_seconds: float = 0.0  # a copy's per byte (a collective's buffer packed or unpacked; no autograd)
    zero_byte_seconds: float = 0.0  # a zero fill's per byte, of a buffer out of the caches (a fresh allocation)
    # (bytes, seconds) of a receive posted after its send, the sender computing: the transfer waits for the sender's
    # communication thread to get a core (a pipeline's receive of a microbatch sent while it computed)
    late: list[tuple[float, float]] = field(default_factory=list)

    # --------------------------------------------------------------------------------------------- reading

    def matmul_time(self, m: float, n: float, k: float) -> float:
        """A ``(m, k) @ (k, n)`` product forward and backward, at the rate (FLOPs per second) interpolated in log
        sizes between the measured shapes around it: each corner weighted by its closeness in log m, log n and log
        k, those the grid leaves out (its largest products) left out; past the grid's ends at its edge's rate. A
        CPU's rate depends on the shape, not on the FLOPs alone; taking the nearest shape's alone put a size midway
        between two measured ones at whichever came first (a 1024 x 2048 x 256 product at 1.41x its time where one
        point of its two read slow)."""
        if m <= 0 or n <= 0 or k <= 0:
            return 0.0
        if not self.matmul:
            raise ValueError("this profile has no matmul measurements")
        rates = {(pm, pn, pk): math.log(2.0 * pm * pn * pk / seconds) for pm, pn, pk, seconds in self.matmul}
        corners = []
        for i, value in enumerate((m, n, k)):
            axis = sorted({shape[i] for shape in rates})
            at = bisect_left(axis, value)
            if at == len(axis) or at == 0 or axis[at] == value:
                corners.append([(axis[min(at, len(axis) - 1)], 1.0)])
                continue
            low, high = axis[at - 1], axis[at]
            t = math.log(value / low) / math.log(high / low)
            corners.append([(low, 1.0 - t), (high, t)])
        total = weight = 0.0
        for (pm, wm), (pn, wn), (pk, wk) in itertools.product(*corners):
            if (pm, pn, pk) in rates:
                total += wm * wn * wk * rates[pm, pn, pk]
                weight += wm * wn * wk
        if weight <= 0:  # no measured corner (a grid with holes): the nearest shape's rate
            nearest = min(rates, key=lambda p: sum(math.log(a / b) ** 2 for a, b in zip(p, (m, n, k), strict=True)))
            total, weight = rates[nearest], 1.0
        return 2.0 * m * n * k / math.exp(total / weight)

    def attention_time(self, flops: float) -> float:
        """Attention forward and backward doing ``flops`` of work (QK^T and PV, 4 per query, key and head
        dimension, as ``cost`` counts them: a causal mask's skipped half not counted). The profile's points are
        causal runs recorded at 4 b h s^2 d, twice the work they do: read at twice the work."""
        return _interpolate(self.attention, 2 * flops)

    def contention(self, ranks: int) -> float:
        """How much slower compute runs when ``ranks`` processes of ``threads`` threads compute at once than one
        alone: measured at the profile's world size (``crowding``), else the ranks' threads over the profile's
        cores (1 where each has its own), times what the world measured beyond that share where the cores were
        outnumbered: ranks taking turns on a core each find their data gone from its caches."""
        if ranks == self.world_size and self.crowding:
            return max(1.0, self.crowding)
        if not self.cores:
            return 1.0
        share = ranks * self.threads / self.cores
        world_share = self.world_size * self.threads / self.cores
        if share > 1 and world_share > 1 and self.crowding > world_share:
            share *= self.crowding / world_share
        return max(1.0, share)

    def op_time(self, nbytes: float) -> float:
        return self.op_seconds + nbytes * self.byte_seconds

    def copy_time(self, nbytes: float) -> float:
        """A copy of ``nbytes`` outside autograd (a collective's buffer packed or unpacked): a view's fixed cost and
        the copy's bytes (an op's per byte, forward and backward, where the profile has no copy's)."""
        return self.view_seconds + nbytes * (self.copy_byte_seconds or self.byte_seconds)

    def zero_time(self, nbytes: float) -> float:
        """A zero fill of ``nbytes`` just allocated, out of the caches (a copy's time where not measured)."""
        return self.view_seconds + nbytes * (self.zero_byte_seconds or self.copy_byte_seconds or self.byte_seconds)

    def collective_time(self, kind: str, size: int, nbytes: float, calls: int = 1) -> float:
        """``calls`` collectives of ``kind`` over groups of ``size`` moving ``nbytes`` in all."""
        if size <= 1 or not nbytes:
            return 0.0
        fits = self.collectives.get(kind) or self.collectives.get("all_reduce", {})
        if not fits:
            raise ValueError(f"this profile measured no {kind} (its kinds: {sorted(self.collectives)})")
        known = sorted(int(s) for s in fits)
        nearest = min(known, key=lambda s: (abs(math.log(s / size)), s))
        latency, per_byte = fits[str(nearest)]
        each = nbytes / calls
        points = self.points.get(kind, {}).get(str(nearest)) if nearest == size else None
        if points:
            measured = sorted((float(b), float(t)) for b, t in points)
            if kind == "all_reduce" and str(size) in self.tiny:
                measured.insert(0, (4.0, self.tiny[str(size)]))
            top, at_top = measured[-1]
            if each <= top:
                return calls * _between(measured, each)
            slope = per_byte
            if kind == "all_reduce" and str(size) in self.large and self.large[str(size)][1] > top:
                _, big, seconds = self.large[str(size)]
                slope = max((seconds - at_top) / (big - top), per_byte)
            return calls * (at_top + (each - top) * slope)
        if kind == "all_reduce" and nbytes <= _TINY_BYTES * calls and str(nearest) in self.tiny:
            return calls * self.tiny[str(nearest)]
        if kind == "all_reduce" and str(nearest) in self.large and each > self.large[str(nearest)][0]:
            # between the largest fitted size and the large one measured, and beyond, at the slope between them
            top, big, seconds = self.large[str(nearest)]
            slope = max((seconds - latency - top * per_byte) / max(big - top, 1.0), per_byte)
            return calls * (latency + (top * per_byte + (each - top) * slope) * _ring_scale(size, nearest))
        return calls * latency + nbytes * per_byte * _ring_scale(size, nearest)

    def late_receive_time(self, nbytes: float) -> float:
        """A receive of ``nbytes`` posted after its send, while the sender computes (0 where not measured)."""
        if not self.late or not nbytes:
            return 0.0
        points = sorted((float(b), float(t)) for b, t in self.late)
        if nbytes < points[-1][0]:
            return max(0.0, _between(points, nbytes))
        if len(points) == 1:
            return points[-1][1]
        (x0, y0), (x1, y1) = points[-2:]  # beyond the largest: on the line through the last two
        return max(y1, y1 + (y1 - y0) / (x1 - x0) * (nbytes - x1))

    def sync_time(self, size: int, collectives: float, compute: float = 0.0) -> float:
        """What ``collectives`` blocking collectives over groups of ``size`` cost beyond their latency, between
        which the ranks compute ``compute`` seconds: the ranks do not reach them together."""
        if size <= 1 or not self.sync or not (collectives or compute):
            return 0.0
        nearest = min((int(s) for s in self.sync), key=lambda s: (abs(math.log(s / size)), s))
        per_collective, per_second = self.sync[str(nearest)]
        return collectives * per_collective + compute * per_second

    def gradient_sync_time(self, size: int, nbytes: float) -> float:
        """DDP's all-reduce of ``nbytes`` of gradients over ``size`` ranks, in its 25 MiB buckets."""
        return self.collective_time("all_reduce", size, nbytes, calls=max(1, math.ceil(nbytes / _DDP_BUCKET)))

    # --------------------------------------------------------------------------------------------- files

    @property
    def described(self) -> str:
        """The machine the profile measured, as reports name it beside the steps it predicts."""
        cores = f" sharing {self.cores} cores" if self.cores else ""
        return f"{self.device} ({self.world_size} rank(s) of {self.threads} thread(s){cores}, as measured)"

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> Profile:
        data = json.loads(Path(path).read_text())
        data["matmul"] = [tuple(p) for p in data["matmul"]]  # noqa: C416
        data["attention"] = [tuple(p) for p in data["attention"]]
        data["collectives"] = {k: {s: tuple(v) for s, v in fits.items()} for k, fits in data["collectives"].items()}
        data["sync"] = {s: tuple(v) for s, v in data.get("sync", {}).items()}
        data["large"] = {s: tuple(v) for s, v in data.get("large", {}).items()}
        data["points"] = {k: {s: [tuple(p) for p in v] for s, v in sizes.items()}
                          for k, sizes in data.get("points", {}).items()}
        data["late"] = [tuple(p) for p in data.get("late", [])]
        return cls(**data)


def _interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise linear in log-log between measured points; proportional to ``x`` beyond them."""
    if x <= 0:
        return 0.0
    if not points:
        raise ValueError("this profile has no measurement of that kind")
    xs = [p[0] for p in points]
    i = bisect_left(xs, x)
    if i == 0:
        return points[0][1] * x / points[0][0]  # below the smallest: at its rate (the fixed cost is in op_seconds)
    if i == len(points):
        return points[-1][1] * x / points[-1][0]
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))


def _between(points: list[tuple[float, float]], x: float) -> float:
    """Linear between the two measured points around ``x`` (sorted by their first value); the first's value below
    it: a collective's fixed cost is most of a small one's."""
    if x <= points[0][0]:
        return points[0][1]
    i = bisect_left([p[0] for p in points], x)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _ring_scale(size: int, measured: int) -> float:
    """A ring moves ``(n-1)/n`` of the bytes per rank: scale a fit made at ``measured`` ranks to ``size``."""
    return ((size - 1) / size) / ((measured - 1) / measured)


# ------------------------------------------------------------------------------------------------- measuring


_TOGETHER = [True]  # False while rank 0 measures alone: no barriers


def _timed(fn: Callable[[], object], *, repeats: int, warmup: int = 2, sync: bool = True,
           before: Callable[[], object] | None = None, mean: bool = False) -> float:
    """Median (or ``mean``) seconds of ``fn`` over ``repeats`` runs, every rank running together (barriers between
    runs), or rank 0 alone while ``_TOGETHER`` is off; ``before`` runs untimed ahead of each."""
    times = _samples(fn, repeats=repeats, warmup=warmup, sync=sync, before=before)
    return statistics.fmean(times) if mean else statistics.median(times)


def _samples(fn: Callable[[], object], *, repeats: int, warmup: int = 2, sync: bool = True,
             before: Callable[[], object] | None = None) -> list[float]:
    """The seconds of each of ``repeats`` runs of ``fn``, as ``_timed`` runs them."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if sync and _TOGETHER[0] and dist.is_initialized():
            dist.barrier()
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _linear_point(m: int, n: int, k: int, repeats: int) -> tuple[int, int, int, float]:
    """A linear's forward and backward, its weight out of the caches as a program's is (each read once a step, among
    more weights and activations than the caches hold): a product of 256 rows ran 5% to 24% slower so than in a
    loop over the same tensors here, a mixture's experts' most (its compute had been predicted 11% fast)."""
    x = torch.randn(m, k, requires_grad=True)
    w = torch.randn(n, k, requires_grad=True)
    g = torch.randn(m, n)

    def run():
        F.linear(x, w).backward(g)
        x.grad = w.grad = None

    return m, n, k, _timed(run, repeats=repeats, before=_out_of_caches)


_EVICTING: list[torch.Tensor] = []


def _out_of_caches() -> None:
    """Read 128 MiB: what the caches held is gone (11 ms here)."""
    if not _EVICTING:
        _EVICTING.append(torch.zeros(32 << 20))
    _EVICTING[0].sum()


def _attention_point(b: int, h: int, s: int, d: int, repeats: int) -> tuple[float, float]:
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    g = torch.randn(b, h, s, d)

    def run():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)
        q.grad = k.grad = v.grad = None

    return 4.0 * b * h * s * s * d, _timed(run, repeats=repeats)


_MIX = (lambda y, x: y * 1.0001, lambda y, x: F.silu(y), lambda y, x: y + x, lambda y, x: torch.softmax(y, -1),
        lambda y, x: y.pow(2), lambda y, x: y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6),
        lambda y, x: torch.cat([y[..., 1:], y[..., :1]], -1), lambda y, x: y.float() * x)
_VIEW_MIX = (lambda y: y.transpose(0, 1), lambda y: y.reshape(y.shape[1], -1), lambda y: y.unsqueeze(0).squeeze(0),
             lambda y: y.t())


def _elementwise(repeats: int) -> tuple[float, float, float]:
    """(fixed seconds, seconds per output byte) of an op forward and backward, from a chain of the ops transformers
    are made of (scale, SiLU, add, softmax, power, a norm, a rotation's cat, a cast) over a small and a large
    tensor, the difference giving the per-byte part; and a view's seconds."""
    rounds = 4

    def chain(rows: int, ops) -> float:
        x = torch.randn(rows, 64, requires_grad=True)

        def run():
            y = x
            for _ in range(rounds):
                for op in ops:
                    y = op(y, x) if ops is _MIX else op(y)
            y.sum().backward()
            x.grad = None

        return _timed(run, repeats=repeats) / (rounds * len(ops))

    small, large = 1, 1 << 14
    t_small, t_large = chain(small, _MIX), chain(large, _MIX)
    per_byte = max(t_large - t_small, 0.0) / ((large - small) * 64 * 4)
    return t_small, per_byte, chain(small, _VIEW_MIX)


def _copy(repeats: int) -> float:
    """Seconds per byte of a 4 MiB clone, the copy a collective's buffer takes (no autograd) of a value just
    computed."""
    x = torch.randn(1 << 20)
    return _timed(x.clone, repeats=2 * repeats) / (x.numel() * 4)


def _zeros(repeats: int) -> float:
    """Seconds per byte of a 4 MiB ``torch.zeros``, each after a read of 128 MiB: a fresh buffer is out of the
    caches (a zero fill of 2 to 8 MiB takes 0.05 ms per MiB in a loop here and 0.14 to 0.19 after such a pass, as a
    mixture's expert loops' zero fills took in its step)."""
    return _timed(lambda: torch.zeros(1 << 20), repeats=2 * repeats, before=_out_of_caches) / ((1 << 20) * 4)


def _optimizer(repeats: int) -> tuple[float, float]:
    """(seconds per parameter byte, seconds per parameter tensor) of AdamW's step: four 4 MiB tensors against
    sixty-four of 4 KiB, its state out of the caches as a step's is after the backward (in a loop it read 0.78x to
    0.81x the programs' steps here)."""

    def seconds(count: int, numel: int) -> float:
        params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(count)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-4)
        return _timed(opt.step, repeats=repeats, before=_out_of_caches)

    big, small = (4, 1 << 20), (64, 1 << 10)
    t_big, t_small = seconds(*big), seconds(*small)
    per_byte = max(t_big - t_small * big[0] / small[0], 0.0) / (big[0] * big[1] * 4)
    per_param = max(t_small - per_byte * small[0] * small[1] * 4, 0.0) / small[0]
    return per_byte, per_param


def _sync_fit(group, repeats: int) -> tuple[float, float]:
    """(seconds per collective, seconds per second of compute): a loop of ``k`` matmuls and a 4 KiB all-reduce, on
    every rank of ``group`` at once, against the same loop without the all-reduce and the all-reduce alone, reached
    from compute as the collectives' fits reach it; the excess per all-reduce, fitted over ``k`` (0.4 to 25 ms of
    compute here at 2 ranks, 50 ms at 4 on 2 cores: the gaps between a program's collectives, up to a DDP step's
    whole backward) as a fixed part and a share of the compute before it."""
    a, b, x = torch.randn(192, 192), torch.randn(192, 192), torch.randn(1024)

    def loop(k: int, reduce: bool) -> tuple[Callable[[], None], int]:
        rounds = max(4, 128 // k)

        def run():
            for _ in range(rounds):
                for _ in range(k):
                    torch.mm(a, b)
                if reduce:
                    dist.all_reduce(x, group=group)
        return run, rounds

    alone = _timed(lambda: dist.all_reduce(x, group=group), repeats=3 * repeats, sync=False, before=_compute_between,
                   mean=True)
    points = []
    for k in (4, 16, 64, 256):
        (computing, rounds), (syncing, _) = loop(k, False), loop(k, True)
        computed = _timed(computing, repeats=repeats) / rounds
        synced = _timed(syncing, repeats=repeats) / rounds
        # unclipped: in a loop the all-reduce may cost less than alone and cold, and clipping those points to 0
        # left the slope to the last point's noise (0 to 0.45 over five calibrations at 4 ranks here)
        points.append((computed, synced - computed - alone))
    n = len(points)
    mx, my = sum(p[0] for p in points) / n, sum(p[1] for p in points) / n
    slope = sum((p[0] - mx) * (p[1] - my) for p in points) / max(sum((p[0] - mx) ** 2 for p in points), 1e-30)
    slope = max(slope, 0.0)
    return max(my - slope * mx, 0.0), slope


def _compute_between() -> None:
    """A few ms of a matmul and a pass over 16 MiB: what a program runs between two collectives, enough to evict
    their buffers from the caches."""
    if not _BETWEEN:
        _BETWEEN.extend((torch.randn(512, 512), torch.randn(512, 512), torch.zeros(4 << 20)))
    x, w, big = _BETWEEN
    torch.mm(x, w)
    big.mul_(1.0)
    dist.barrier()  # the ranks then start together: what they wait for one another is the sync fit's


_BETWEEN: list[torch.Tensor] = []


def _groups_of(world: int) -> dict[int, list]:
    """For each group size that divides the world: every group of consecutive ranks of that size (created alike
    on every rank)."""
    made = {}
    for size in range(2, world + 1):
        if world % size:
            continue
        groups = [dist.new_group(list(range(start, start + size))) for start in range(0, world, size)]
        made[size] = groups[dist.get_rank() // size]
    return made


def _collective_samples(kind: str, group, size: int, sizes: list[int],
                        repeats: int) -> list[tuple[int, list[float]]]:
    """``kind`` over ``group`` at each of ``sizes``: its bytes (as explain() counts them) and the seconds of each
    call, every call reached from compute as a program reaches it (its buffers out of the caches, the ranks starting
    together: what they wait for one another is the sync fit's), in two passes over the sizes (a slow spell lands on
    several)."""
    points = []
    rank = dist.get_rank(group)
    for nbytes in sizes:
        numel = max(size, nbytes // 4 // size * size)
        x = torch.randn(numel)
        if kind == "all_reduce":
            fn, counted = (lambda x=x: dist.all_reduce(x, group=group)), numel * 4
        elif kind == "all_gather":  # into a list of parts, as the passes gather
            parts = [torch.empty(numel) for _ in range(size)]
            fn, counted = (lambda x=x, parts=parts: dist.all_gather(parts, x, group=group)), numel * size * 4
        elif kind == "reduce_scatter":  # the passes' call: gloo's reduce_scatter_tensor took 1.35x to 1.45x as long
            out = torch.empty(numel // size)
            fn, counted = (lambda x=x, out=out: reduce_scatter_single(out, x, group=group)), numel * 4
        elif kind == "all_to_all":
            out = torch.empty_like(x)
            fn = lambda x=x, out=out: dist.all_to_all_single(out, x, group=group)  # noqa: E731
            counted = numel * 4 * (size - 1) // size
        else:  # a pair's exchange: even group ranks send to the next one, which receives
            peer = dist.get_global_rank(group, rank ^ 1) if (rank ^ 1) < size else None

            def fn(x=x, peer=peer, rank=rank):
                if peer is None:
                    return
                if rank % 2 == 0:
                    dist.send(x, peer, group=None)
                else:
                    dist.recv(x, peer, group=None)
            counted = numel * 4
        points.append((counted, fn))
    samples: list[list[float]] = [[] for _ in points]
    for _ in range(2):
        for taken, (_, fn) in zip(samples, points, strict=True):
            taken += _samples(fn, repeats=repeats, sync=False, before=_compute_between)
    return [(counted, taken) for (counted, _), taken in zip(points, samples, strict=True)]


def _late_receives(sizes: list[int], repeats: int) -> list[tuple[float, float]]:
    """Each of ``sizes`` sent by every odd rank to the even one before it while the sender goes on computing, and
    received late (the receiver computes a few ms first, as a pipeline's rank reaches a microbatch's receive after
    its neighbour sent it): the mean seconds of rank 0's receive. The data waits for the sender's communication
    thread, which shares a core with its compute: a mean of 1 to 2 ms for 256 KiB here (and a tail to 6), where a
    receive posted first ends 0.05 ms after its send; three of them on an interleaved pipeline's path."""
    rank, world = dist.get_rank(), dist.get_world_size()
    peer = rank + 1 if rank % 2 == 0 else rank - 1
    if peer >= world:
        peer = None
    a, w = torch.randn(1024, 256), torch.randn(256, 256)

    def compute(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            F.silu(a @ w).mul_(2.0)

    points = []
    for nbytes in sizes:
        x = torch.randn(nbytes // 4)
        taken = []
        for _ in range(repeats):
            dist.barrier()
            if peer is None:
                continue
            if rank % 2:
                works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer)])
                compute(0.012)
                for work in works:
                    work.wait()
            else:
                compute(0.004)
                start = time.perf_counter()
                for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, x, peer)]):
                    work.wait()
                taken.append(time.perf_counter() - start)
        if rank == 0:
            points.append((float(nbytes), statistics.fmean(taken)))
    return points


def _tail(samples: list[list[float]]) -> float:
    """The seconds a collective's rare slow calls add to its mean, pooled over ``samples`` (each one size's calls).

    Such a call here takes its time or, a third of the calls, 1 to 8 ms more (a 512 KiB all-reduce: 0.3 to 0.7
    ms, then 1.3 to 7.9, as its thread sleeps or not), whatever its kind and size, and a program's many
    collectives cost their mean. Ten calls do not price so rare a tail (one size's mean moved 0.3 to 2 ms between
    calibrations, and so did its median where the slow calls came near half): a point is its calls' lower quartile
    (``_base``), which holds still, plus this, the mean's excess over it over every kind and size."""
    return statistics.fmean(statistics.fmean(t) - _base(t) for t in samples)


def _base(samples: list[float]) -> float:
    """The lower quartile of ``samples``: a collective's time without the tail."""
    return statistics.quantiles(samples, n=4)[0] if len(samples) > 1 else samples[0]


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(latency, seconds per byte): least squares over ``points`` (bytes, seconds), neither below 0."""
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    slope = sum((p[0] - mx) * (p[1] - my) for p in points) / max(sum((p[0] - mx) ** 2 for p in points), 1e-30)
    slope = max(slope, 0.0)
    return max(my - slope * mx, 0.0), slope


def calibrate(*, quick: bool = False) -> Profile:
    """Measure this machine on every rank of the initialised world at once (or alone without one); rank 0's
    numbers, which every rank returns. ``quick`` takes fewer sizes and repeats (a test's)."""
    start = time.perf_counter()
    repeats = 3 if quick else 5
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    cores = _cores()
    profile = Profile(world_size=world, threads=torch.get_num_threads(), device="cpu", cores=cores,
                      memory=_memory_per_rank())
    if rank == 0:  # compute alone: the other ranks sleep in the barrier below
        _TOGETHER[0] = False
        try:
            _measure_compute(profile, quick, repeats)
        finally:
            _TOGETHER[0] = True
    if world > 1:
        dist.barrier()
        profile.crowding = _crowding(repeats)
    if world > 1:
        sizes = [4 << 10, 256 << 10, 2 << 20] if quick else [4 << 10, 64 << 10, 512 << 10, 4 << 20]
        made = _groups_of(world)
        for size, group in made.items():
            taken = {kind: _collective_samples(kind, group, size, sizes, repeats) for kind in KINDS}
            tail = _tail([t for calls in taken.values() for _, t in calls])
            for kind, calls in taken.items():
                points = [(float(counted), _base(t) + tail) for counted, t in calls]
                profile.collectives.setdefault(kind, {})[str(size)] = _line(points)
                profile.points.setdefault(kind, {})[str(size)] = points
            profile.sync[str(size)] = _sync_fit(group, 2 * repeats)  # the noisiest fit: twice the samples
            one = torch.zeros(1)
            profile.tiny[str(size)] = _base(_samples(  # and the all-reduces' tail, as their points'
                lambda one=one, group=group: dist.all_reduce(one, group=group), repeats=3 * repeats, sync=False,
                before=_compute_between)) + tail
            if not quick:  # a model's gradients: 16 MiB, four times the largest fitted size
                grads = torch.randn(4 << 20)
                profile.large[str(size)] = (float(sizes[-1]), float(grads.numel() * 4), _timed(
                    lambda grads=grads, group=group: dist.all_reduce(grads, group=group), repeats=repeats, sync=False,
                    before=_compute_between, mean=True))
        profile.late = _late_receives(sizes, 3 * repeats)
        dist.barrier()
        for group in made.values():  # left alive, a group's threads slow what runs next
            dist.destroy_process_group(group)
        shared = [asdict(profile)]
        dist.broadcast_object_list(shared, src=0)
        profile = Profile(**{**shared[0], "collectives": {k: {s: tuple(v) for s, v in f.items()}
                                                           for k, f in shared[0]["collectives"].items()},
                             "sync": {s: tuple(v) for s, v in shared[0]["sync"].items()},
                             "large": {s: tuple(v) for s, v in shared[0]["large"].items()},
                             "points": {k: {s: [tuple(p) for p in v] for s, v in sizes.items()}
                                        for k, sizes in shared[0]["points"].items()},
                             "late": [tuple(p) for p in shared[0]["late"]]})
    profile.seconds = time.perf_counter() - start
    return profile


def _measure_compute(profile: Profile, quick: bool, repeats: int) -> None:
    sizes, rows = ((128, 512), (256, 2048)) if quick else ((128, 512, 2048), (64, 256, 1024, 4096))
    shapes = [(m, n, k) for m in rows for n in sizes for k in sizes if 2 * m * n * k <= 2.2e9]
    # two passes over the shapes, each shape's faster median kept: a slow spell of the machine lands on a few
    # consecutive shapes of one pass (one read 114 GFLOP/s among neighbours of 140 to 165 here)
    passes = [[_linear_point(*shape, repeats) for shape in shapes] for _ in range(2)]
    profile.matmul = [min(points, key=lambda point: point[3]) for points in zip(*passes, strict=True)]
    shapes = ((1, 4, 64, 32), (2, 8, 256, 64)) if quick else ((1, 4, 64, 32), (2, 8, 128, 64), (2, 8, 256, 64),
                                                                (4, 8, 512, 64))
    profile.attention = sorted(_attention_point(*shape, repeats) for shape in shapes)
    profile.op_seconds, profile.byte_seconds, profile.view_seconds = _elementwise(repeats)
    profile.copy_byte_seconds, profile.zero_byte_seconds = _copy(repeats), _zeros(repeats)
    profile.optimizer_byte_seconds, profile.optimizer_param_seconds = _optimizer(repeats)
    _EVICTING.clear()


def _crowding(repeats: int) -> float:
    """Rank 0's time for a block of matmuls and elementwise ops with every rank running it at once, over its time
    alone (the others sleeping in a barrier): the median of ``repeats`` rounds of the two side by side, so that a
    slow spell of the machine slows both halves of a ratio (timed as two runs of three apart, one calibration in
    six read 1.17 at 2 ranks on 2 cores where the rest read 1.00 to 1.07)."""
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def block():  # about 0.2 s alone here: long enough that the ranks overlap whole, not only where they start
        for _ in range(600):
            c = torch.mm(a, b)
            torch.nn.functional.silu(c).add_(c)

    rank = dist.get_rank()
    block()
    ratios = []
    for _ in range(repeats):
        dist.barrier()
        alone = 0.0
        if rank == 0:
            start = time.perf_counter()
            block()
            alone = time.perf_counter() - start
        dist.barrier()
        start = time.perf_counter()
        block()
        ratios.append((time.perf_counter() - start) / alone if rank == 0 else 0.0)
    if rank:
        return 0.0
    # where the ranks outnumber the cores, they take turns on each and find their data gone from its caches: 4 ranks
    # on 2 cores here run this block 2.13x slower than one alone, and a Llama's, GPT-2's and a mixture's programs
    # 1.95x to 2.14x. Bounded at a quarter above the ranks' threads over the cores (more is a slow spell of the
    # machine, not crowding: one run here measured 2.6)
    share = dist.get_world_size() * torch.get_num_threads() / max(1, _cores())
    return min(statistics.median(ratios), max(1.0, 1.25 * share))


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


def _memory_per_rank() -> float:
    """The physical memory of this machine over the ranks that share it (torchrun's ``LOCAL_WORLD_SIZE``)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 0.0
    return float(total) / max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autoshard.planner.profile", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the profile's JSON file")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    args = parser.parse_args(argv)
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("gloo")
    profile = calibrate(quick=args.quick)
    if not dist.is_initialized() or dist.get_rank() == 0:
        profile.save(args.out)
        print(f"autoshard: calibrated {profile.world_size} rank(s) in {profile.seconds:.1f} s -> {args.out}",
              flush=True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
