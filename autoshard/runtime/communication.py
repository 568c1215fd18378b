"""The first step's communication checked against its certificate (``autoshard.certificate``).

A step's certificate is its builds' (the collectives of the programs each microbatch ran, the pipeline's
messages) and the step's own: the check that every rank was given the same batch, the loss's sums, and the
gradient sync of the data-parallel strategy (DDP's buckets, FSDP2's gathers and reduce-scatters, the pipeline's
reducer, the experts' sums). The first step runs recording what each collective is handed (``peers.recording``)
and the record must equal the certificate per (phase, kind, group, dtype): a difference in count, elements or
dtype raises ``CommunicationDiffers`` naming the collectives on each side, their nodes and the model's lines.
``verify_communication`` chooses when: the first step (the default), every step, or never.
"""

from __future__ import annotations

import collections
import math

import torch
from torch.utils import _pytree as pytree

from autoshard import meta, peers
from autoshard.certificate import Certificate, Collective, counted, members, of_build, ranks, wire_bytes
from autoshard.cost import format_bytes
from autoshard.errors import AutoshardError
from autoshard.runtime import alike


class CommunicationDiffers(AutoshardError, RuntimeError):
    """A step sent something its certificate does not list (or not what it lists); the message says what."""


def step_certificate(pm, builds: list, values: tuple, *, exact: bool = True) -> Certificate:
    """What ``pm``'s rank sends in a training step whose microbatches ran ``builds`` (one per microbatch) on the
    batch ``values`` (inputs and target); ``exact``: as ``certificate.of_build``."""
    mesh, options, rank = pm.mesh, pm.options, pm.rank
    found = Certificate(rank)
    tensors = [v for v in pytree.tree_leaves(values) if isinstance(v, torch.Tensor)]
    for axis in alike.batch_axes(options.local_batch):
        if mesh.degree(axis) > 1:
            found.collectives.append(_step_level("checks", "all_gather", axis, mesh, rank, torch.float64,
                                                 3 * len(tensors), "the batch alike on every rank"))
    if pm.pipeline is None:
        runs_of = collections.Counter(id(build) for build in builds)
        for build in {id(build): build for build in builds}.values():
            programs = of_build(build, runs=runs_of[id(build)], device=pm.device.type, exact=exact)
            found.collectives += programs.collectives
            found.unchecked += programs.unchecked
    else:
        programs = of_build(builds[0], device=pm.device.type, exact=exact)
        found.collectives += programs.collectives
        found.unchecked += programs.unchecked
        pp = pm.pipeline
        found.collectives.append(_step_level("loss", "all_reduce", "pp", mesh, rank, torch.float32, 1,
                                             "the last stage's loss to every pp rank"))
        for holders, dtype, numel, count in pp.tied_certified(pm.store):
            group = f"pp {','.join(map(str, holders))}"
            what = "the tied weights' gradients" if count is None else "which tied weights got gradients"
            found.collectives.append(Collective("gradient sync", "all_reduce", group, _dtype(dtype), numel, count,
                                                what, routed=count is None, axis="pp"))
        for phase, kind, dtype, numel, routed in pp.spread.certified(pm.store):
            found.collectives.append(_step_level(phase, kind, "pp", mesh, rank, dtype, numel,
                                                 "the weights spread over pp", count=None if routed else 1,
                                                 routed=routed))
    found.collectives += _gradient_sync(pm)
    if mesh.dp * mesh.cp > 1:
        if options.local_batch and builds[0].captured.count_gm is not None:
            found.collectives.append(_step_level("loss", "all_reduce", "data", mesh, rank, torch.float32, 1,
                                                 "the items the loss counts, summed"))
        found.collectives.append(_step_level("loss", "all_reduce", "data", mesh, rank, torch.float32, 1,
                                             "the loss, summed"))
    if pm.compiler is not None:
        found.unchecked.append("the programs run compiled (torch.compile issues their collectives)")
    return found


def _gradient_sync(pm) -> list[Collective]:
    mesh, rank, sync = pm.mesh, pm.rank, pm.sync
    found = []
    if mesh.dp * mesh.cp > 1 and sync.sharded:
        found += _fully_sharded(pm)
    elif mesh.dp * mesh.cp > 1:
        held = [(name, p) for name, p in sync.replica.store.named_parameters() if p.requires_grad]
        by_dtype: dict[torch.dtype, int] = collections.Counter()
        for name, p in held:
            if name not in sync.experts:
                by_dtype[p.dtype] += p.numel()
        what = "DDP's buckets" if pm.pipeline is None else "the reducer's buckets (parameters given a gradient)"
        for dtype, numel in by_dtype.items():
            found.append(_step_level("gradient sync", "all_reduce", "data", mesh, rank, dtype, numel, what,
                                     count=None, routed=pm.pipeline is not None))
    if sync.experts_group is not None:
        for name in sync.experts:
            p = sync.replica.store.find(name)
            if p is not None and p.requires_grad:
                found.append(_step_level("gradient sync", "all_reduce", "experts", mesh, rank, p.dtype, p.numel(),
                                         f"{name}'s gradient over its replicas", count=None, routed=True))
    return found


def _fully_sharded(pm) -> list[Collective]:
    """FSDP2's collectives over dp x cp: one all-gather of every rank's shards (each parameter's dim 0 padded to
    divide by the ranks) for each forward and, resharded after it, each backward (once per step under pp, where
    the parameters stay gathered), and one reduce-scatter of the gradients after the last backward."""
    mesh, rank, sync, options = pm.mesh, pm.rank, pm.sync, pm.options
    n = mesh.dp * mesh.cp
    gathers = 1 if pm.pipeline is not None else 2 * options.microbatches
    shards: dict[torch.dtype, int] = collections.Counter()
    grads: dict[torch.dtype, int] = collections.Counter()
    for name, p in sync.replica.store.named_parameters():
        if name in sync.experts:
            continue
        whole = tuple(p.full_tensor().shape) if hasattr(p, "full_tensor") else tuple(p.shape)
        shard = -(-whole[0] // n) * math.prod(whole[1:]) if whole else 1
        shards[p.dtype] += shard
        if p.requires_grad:
            grads[p.dtype] += shard * n
    found = [_step_level("parameter gathers", "all_gather", "data", mesh, rank, dtype, numel * gathers,
                         "FSDP2's gathers of the parameters", count=gathers) for dtype, numel in shards.items()]
    found += [_step_level("gradient sync", "reduce_scatter", "data", mesh, rank, dtype, numel,
                          "FSDP2's reduce-scatter of the gradients") for dtype, numel in grads.items()]
    return found


def _step_level(phase: str, kind: str, axis: str, mesh, rank: int, dtype: torch.dtype, numel: int, what: str, *,
                count: int | None = 1, routed: bool = False) -> Collective:
    group = f"{axis} {','.join(map(str, ranks(mesh, axis, rank)))}"
    return Collective(phase, kind, group, _dtype(dtype), numel, count, what, routed=routed, axis=axis)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def totals(sent: list[peers.Sent]) -> dict[tuple, tuple[int, int]]:
    """The record per (phase, kind, ranks, dtype): (calls, elements)."""
    found: dict[tuple, tuple[int, int]] = {}
    for s in sent:
        key = (s.phase, s.kind, members(s.group), str(s.dtype).removeprefix("torch."))
        calls, numel = found.get(key, (0, 0))
        found[key] = (calls + 1, numel + s.numel)
    return found


def differences(certificate: Certificate, sent: list[peers.Sent]) -> list[str]:
    """Where the record ``sent`` differs from ``certificate``, one line each; empty when they agree."""
    planned = certificate.totals()
    recorded = totals(sent)
    lines = []
    for key in sorted(set(planned) | set(recorded), key=str):
        calls, numel, routed = planned.get(key, (0, 0, False))
        got_calls, got_numel = recorded.get(key, (0, 0))
        if (calls is None or calls == got_calls) and (routed or got_numel == numel) and key in planned:
            continue
        phase, kind, group, dtype = key
        want = (f"{'any number of' if calls is None else calls} call(s), "
                f"{'as many elements as the data routes' if routed else f'{numel} elements'}")
        lines.append(f"{phase} {kind} on [{group}] in {dtype}: certified {want}; sent {got_calls} call(s), "
                     f"{got_numel} elements" + _where(certificate, sent, key))
    return lines


def check(certificate: Certificate, sent: list[peers.Sent], step: int) -> None:
    """Raise ``CommunicationDiffers`` where step ``step``'s record ``sent`` differs from ``certificate``."""
    lines = differences(certificate, sent)
    if lines:
        lines += [f"not certified: {what}" for what in certificate.unchecked]
        raise CommunicationDiffers(
            f"rank {certificate.rank}'s step {step} did not send what its certificate lists (a collective sent in "
            f"another dtype or shape, or one more or fewer than planned: a bug in autoshard; please report it with "
            f"this message):\n  " + "\n  ".join(lines) +
            "\npass verify_communication=False to parallelize to train without this check")


def _where(certificate: Certificate, sent: list[peers.Sent], key: tuple) -> str:
    planned = [c for c in certificate.collectives if c.key == key]
    recorded = [s for s in sent if totals([s]).keys() == {key}]
    out = "".join(f"\n      certified: {c.describe()}" for c in planned[:6])
    by_place = collections.Counter(" <- ".join(reversed(s.where)) or "?" for s in recorded)
    out += "".join(f"\n      sent {n} x from {place}" for place, n in list(by_place.items())[:4])
    return out



# ------------------------------------------------------------------------------- against the least it could be


def minimum(pm, build, certificate: Certificate) -> dict[str, tuple[float, str]]:
    """What each axis of ``pm``'s mesh must put on the wire in a step of ``build`` (this rank, ring algorithms),
    by the formula of its pattern, with the formula: Megatron tp (two all-reduces of each attention block's
    activation and two of its MLP's, forward and backward; sequence parallelism the same bytes as all-gathers and
    reduce-scatters), cp by its attention (gathered keys and values, the ring, Ulysses' all-to-alls), dp's
    all-reduce of the gradients (FSDP2: each parameter gathered for the forward and the backward and its gradient
    reduce-scattered), pp's activations and their gradients at each cut, ep's rows routed there and back."""
    mesh, options, m = pm.mesh, pm.options, pm.options.microbatches
    found: dict[str, tuple[float, str]] = {}
    attentions = _attentions(build)
    itemsize = 2 if options.mixed_precision == "bf16" else 4
    if mesh.tp > 1 and attentions:
        n, act = mesh.tp, sum(q for q, _ in attentions) / mesh.cp * itemsize
        found["tp"] = (m * 4 * act * 2 * (n - 1) / n, f"{m} microbatch(es) x {len(attentions)} block(s) x 4 "
                       "all-reduces of the activation (2 forward, 2 backward) x 2(n-1)/n")
    if mesh.cp > 1 and attentions:
        c, kv = mesh.cp, sum(k for _, k in attentions) / mesh.cp * itemsize / mesh.tp
        qo = sum(q for q, _ in attentions) / mesh.cp * itemsize / mesh.tp
        how = options.cp_attention.value if hasattr(options.cp_attention, "value") else str(options.cp_attention)
        if how == "ring":
            acc = 4 / itemsize
            found["cp"] = (m * kv * (4 * (c - 1) + 2 * c * acc),
                           "keys and values passed c-1 hops forward and backward, their gradients c hops")
        elif how == "alltoall":
            found["cp"] = (m * 2 * (2 * qo + 2 * kv) * (c - 1) / c,
                           "q, k, v and the output all-to-all'd forward and backward x (c-1)/c")
        else:
            found["cp"] = (m * 4 * kv * (c - 1), "keys and values all-gathered forward, reduce-scattered backward")
    data = mesh.dp * mesh.cp
    if data > 1:
        params = [p for name, p in pm.sync.replica.store.named_parameters() if name not in pm.sync.experts]
        if pm.sync.sharded:
            whole = sum(math.prod(p.full_tensor().shape if hasattr(p, "full_tensor") else p.shape) * p.element_size()
                        for p in params)
            found["data"] = (3 * whole * (data - 1) / data, "FSDP2: the parameters gathered twice and their gradients "
                             "reduce-scattered, x (n-1)/n")
        else:
            grads = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
            found["data"] = (2 * grads * (data - 1) / data, "one all-reduce of the gradients x 2(n-1)/n")
    if mesh.pp > 1:
        sent = sum(_spec_bytes(build.local_specs[i][1]) + _spec_bytes(build.local_specs[i][0])
                   for i in build.programs)
        found["pp"] = (m * sent, "each cut's activations forward and their gradients back, per microbatch")
    if mesh.ep > 1:
        routed = sum(wire_bytes(c) for c in certificate.collectives if c.axis == "ep" and c.kind == "all_to_all")
        found["ep"] = (routed, "the rows routed to their experts and back, forward and backward")
    return found


def _attentions(build) -> list[tuple[int, int]]:
    """Per attention of this rank's stages, the elements of its queries and of its keys (whole, one microbatch)."""
    stage_of = build.partition.stage_of if build.partition is not None and build.stages else None
    found = []
    for node in build.captured.gm.graph.nodes:
        if node.target is torch.ops.aten.scaled_dot_product_attention.default:
            if stage_of is not None and stage_of.get(node.name) not in build.programs:
                continue
            q, k = (meta.val(a) for a in node.args[:2])
            found.append((q.numel(), k.numel()))
    return found


def _spec_bytes(specs) -> int:
    return sum(math.prod(s.shape) * s.dtype.itemsize for s in specs)


def against_minimum(pm, build, certificate: Certificate) -> list[str]:
    """``explain()``'s lines: each axis's bytes on the wire per step, the least its pattern needs, and the ratio."""
    least, sent = minimum(pm, build, certificate), counted(certificate)
    lines = []
    for axis, (bytes_, formula) in least.items():
        count = sent.get(axis, 0.0)
        ratio = f"{count / bytes_:.2f}x" if bytes_ else "-"
        phases: dict[str, float] = collections.Counter()
        for c in certificate.collectives:
            if c.axis == axis:
                phases[c.phase] += wire_bytes(c)
        parts = ", ".join(f"{phase} {format_bytes(b)}" for phase, b in phases.items() if b)
        lines.append(f"  {axis}: {ratio}: {format_bytes(count)} sent ({parts}); the least {format_bytes(bytes_)}: "
                     f"{formula}")
    return lines
