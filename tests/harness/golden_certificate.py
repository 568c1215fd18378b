"""Per-rank checks of the communication certificate (``autoshard.certificate``): a step records what it sends and
equals its build's certificate; a step that sends something else is refused on every rank.

Each function runs on every rank of a worker pool (see ``launcher.py``) and returns plain data. ``tampered`` seeds
one fault for the length of a step and takes it out again (the pool's processes run later tasks).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

import autoshard
from autoshard import peers
from autoshard.certificate import Certificate
from autoshard.passes import collectives
from autoshard.runtime.communication import CommunicationDiffers, differences
from autoshard.runtime.executor import PipelineExecutor

from harness.golden import groups_for
from harness.models import build


def certified(name: str, mesh_kwargs: dict, **options) -> dict:
    """Two steps recorded and compared with the certificate (``verify_communication="every"``); what the
    certificate says, and whether it reads back from its JSON."""
    case = build(name)
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn, target=case.target,
                               groups=groups_for(mesh), verify_communication="every", **options)
    for _ in range(2):
        pm.step(*case.inputs, target=case.target)
    certificate = pm.certificate(*case.inputs, target=case.target)
    with peers.recording() as sent:
        pm.step(*case.inputs, target=case.target)
    return {"phases": sorted({c.phase for c in certificate.collectives}),
            "kinds": sorted({c.kind for c in certificate.collectives}),
            "differences": differences(certificate, sent),
            "round trip": Certificate.from_json(certificate.to_json()) == certificate,
            "unchecked": certificate.unchecked, "text": str(certificate)}


def certified_or_refused(name: str, mesh_kwargs: dict, **options) -> dict:
    """``certified``, or what the cell was refused with where autoshard refuses the model at that mesh (a sequence
    context parallelism cannot find, heads the degree does not divide)."""
    try:
        return certified(name, mesh_kwargs, **options)
    except autoshard.AutoshardError as e:
        if isinstance(e, CommunicationDiffers):
            raise
        return {"refused": str(e).splitlines()[0]}


def tampered(name: str, mesh_kwargs: dict, fault: str, **options) -> str:
    """The first step with ``fault`` seeded: ``"dtype"`` (Megatron's all-reduces sent in float64, the same sums at
    twice the bytes), ``"extra"`` (one more all-reduce of zeros after each), ``"shape"`` (every pipeline message a
    row longer, both ends alike). Returns what the step raised ("" when it raised nothing)."""
    case = build(name)
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn, target=case.target,
                               groups=groups_for(mesh), **options)
    with _FAULTS[fault]():
        try:
            pm.step(*case.inputs, target=case.target)
        except CommunicationDiffers as e:
            return str(e)
    return ""


@contextlib.contextmanager
def _replaced(owner, name: str, value):
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


def _in_float64(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is None:
        return x
    out = x.contiguous().to(torch.float64)
    peers.run(dist.all_reduce, out, op=op, group=group)
    return out.to(x.dtype)


def _twice(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is None:
        return x
    out = x.contiguous().clone()
    peers.run(dist.all_reduce, out, op=op, group=group)
    peers.run(dist.all_reduce, torch.zeros_like(out), op=dist.ReduceOp.SUM, group=group)
    return out


@contextlib.contextmanager
def _longer_messages():
    """Every pipeline message flattened and one element longer; the receiver takes the element off again."""
    send, receive = PipelineExecutor._send, PipelineExecutor._receive

    def longer(self, tensors, to_stage):
        return send(self, [torch.cat([t.reshape(-1), t.new_zeros(1)]) for t in tensors], to_stage)

    def received(self, specs, from_stage, laid_out=False):
        flat = receive(self, [type(s)((math.prod(s.shape) + 1,), s.dtype) for s in specs], from_stage)
        return [_as(g[:-1], s, laid_out) for g, s in zip(flat, specs, strict=True)]

    with _replaced(PipelineExecutor, "_send", longer), _replaced(PipelineExecutor, "_receive", received):
        yield


def _as(flat: torch.Tensor, spec, laid_out: bool) -> torch.Tensor:
    """``flat`` as the receiver would have received it: in the sender's memory order (activations) or row-major."""
    if not laid_out:
        return flat.reshape(spec.shape).clone()
    buffer, value = spec.allocate(flat.device)
    buffer.view(-1).copy_(flat)
    return value


_FAULTS = {
    "dtype": lambda: _replaced(collectives, "_all_reduce", _in_float64),
    "extra": lambda: _replaced(collectives, "_all_reduce", _twice),
    "shape": _longer_messages,
}


def explained(name: str, mesh_kwargs: dict, **options) -> str:
    """``explain()`` after a first step: with the certificate checked and each axis's bytes against the least."""
    case = build(name)
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn, target=case.target,
                               groups=groups_for(mesh), **options)
    pm.step(*case.inputs, target=case.target)
    return pm.explain()
