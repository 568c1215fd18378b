"""Data-parallel gradient sums for pipelines, overlapped with the backward that produces them.

Under pipeline parallelism a rank runs several backwards per step (one per microbatch and stage),
so DistributedDataParallel's one-backward-per-step contract does not hold. ``GradientReducer`` does
what DDP does inside the one backward that finishes each gradient: a parameter's gradient is final
after the last backward (in the schedule's order) of the last stage on this rank that reads it.
During that backward, a post-accumulate-grad hook marks the parameter ready; buckets of parameters
(in reverse order of use, the order in which backward finishes them) are summed with asynchronous
all-reduces as soon as they are complete, while the rest of the backward still runs. ``finish()``
waits for them at the end of the step.

Every rank of the group runs the same schedule on the same stages, so buckets are launched in the
same order everywhere: bucket k only after buckets 0..k-1 (collectives on one group are matched by
order).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from autoshard import peers
from autoshard.schedules import Action

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb


@dataclass
class _Bucket:
    stage: int
    params: list[nn.Parameter]
    ready: set[int] = field(default_factory=set)  # ids of the parameters whose gradient is final
    work: object = None
    grads: list[torch.Tensor] = field(default_factory=list)
    flat: torch.Tensor | None = None

    @property
    def complete(self) -> bool:
        return len(self.ready) == len(self.params)


class GradientReducer:
    """Sums this rank's gradients over ``group`` during the last backward of each of its stages."""

    def __init__(self, stage_params: dict[int, list[nn.Parameter]], actions: list[Action], group,
                 bucket_bytes: int | None = None) -> None:
        self.group = group
        backwards = [(a.stage, a.microbatch) for a in actions if a.kind in ("B", "W")]
        self.final = dict(backwards)  # the last B or W of each stage (later pairs overwrite earlier ones)
        order = {stage: i for i, (stage, _) in enumerate(backwards)}  # later final backward -> larger
        owner: dict[int, int] = {}
        for stage, params in stage_params.items():
            for p in params:
                if id(p) not in owner or order.get(stage, -1) > order.get(owner[id(p)], -1):
                    owner[id(p)] = stage
        cap = BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        self.buckets: list[_Bucket] = []
        for stage in sorted(stage_params, key=lambda s: order.get(s, -1)):
            mine = list({id(p): p for p in reversed(stage_params[stage]) if owner[id(p)] == stage}.values())
            self.buckets += _buckets(stage, mine, cap)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._armed: int | None = None
        self._next = 0  # the first bucket not launched yet
        self._overlapped = 0
        self.overlapped = 0  # of the last step's buckets, how many were launched while a backward still ran
        for bucket in self.buckets:
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(self._ready)

    def before_backward(self, stage: int, microbatch: int) -> None:
        self._armed = stage if self.final.get(stage) == microbatch else None

    def after_backward(self, stage: int, microbatch: int) -> None:
        """After a stage's final backward, every one of its buckets is launched (unused parameters too)."""
        if self.final.get(stage) != microbatch:
            return
        self._armed = None
        for bucket in self.buckets:
            if bucket.stage == stage:
                bucket.ready = {id(p) for p in bucket.params}
        self._launch_ready()

    def reset(self) -> None:
        """Forget a step that failed part-way (its launched sums are abandoned), so the next starts clean."""
        for bucket in self.buckets:
            bucket.ready, bucket.work, bucket.grads, bucket.flat = set(), None, [], None
        self._next, self._overlapped, self._armed = 0, 0, None

    def finish(self, named_parameters=()) -> None:
        """Wait for every bucket's sum and write it back into the gradients; ready for the next step.

        Gradients of ``named_parameters`` that no bucket holds (first read by a capture made after this
        reducer) are summed too, in one flat all-reduce in name order.
        """
        for bucket in self.buckets:
            bucket.ready = {id(p) for p in bucket.params}
        self._launch_ready()
        rest = _Bucket(-1, [p for _, p in sorted(named_parameters, key=lambda item: item[0])
                            if p.grad is not None and id(p) not in self._bucket_of])
        self.buckets.append(rest)
        _launch(rest, self.group)
        for bucket in self.buckets:
            if bucket.work is not None:
                peers.wait(bucket.work)
                for grad, summed in zip(bucket.grads, torch._utils._unflatten_dense_tensors(bucket.flat, bucket.grads),
                                        strict=True):
                    grad.copy_(summed)
            bucket.ready, bucket.work, bucket.grads, bucket.flat = set(), None, [], None
        self.buckets.remove(rest)
        self._next = 0
        self.overlapped, self._overlapped = self._overlapped, 0

    def _ready(self, param: nn.Parameter) -> None:
        bucket = self._bucket_of.get(id(param))
        if bucket is None or self._armed != bucket.stage:
            return
        bucket.ready.add(id(param))
        before = self._next
        self._launch_ready()
        self._overlapped += self._next - before

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].complete:
            _launch(self.buckets[self._next], self.group)
            self._next += 1


def _launch(bucket: _Bucket, group) -> None:
    """Start the asynchronous sum of a bucket's gradients (one flat tensor)."""
    bucket.grads = [p.grad for p in bucket.params if p.grad is not None]
    if bucket.grads:
        bucket.flat = torch._utils._flatten_dense_tensors(bucket.grads)
        peers.issued(group)
        peers.sent("all_reduce", bucket.flat, group, phase="gradient sync")
        bucket.work = dist.all_reduce(bucket.flat, group=group, async_op=True)


def _buckets(stage: int, params: list[nn.Parameter], cap: int) -> list[_Bucket]:
    """Consecutive parameters of one dtype, up to ``cap`` bytes each (a larger parameter is a bucket alone)."""
    out: list[_Bucket] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not out or size + nbytes > cap or out[-1].params[0].dtype != p.dtype:
            out.append(_Bucket(stage, []))
            size = 0
        out[-1].params.append(p)
        size += nbytes
    return out
