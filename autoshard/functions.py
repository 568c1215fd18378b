"""Custom autograd Functions, and ops export cannot fake, kept whole in the capture.

``torch.export`` (non-strict) runs a ``torch.autograd.Function``'s forward as ordinary ops: the captured graph
differentiates those ops and the Function's own backward is never called (a straight-through estimator's
``round`` gets a zero gradient), and a forward that writes in place leaves autograd a graph it cannot
differentiate. During the capture every ``Function.apply`` (and ``F.ctc_loss``, whose output shape under fake
tensors depends on the data) is recorded instead as one node, ``autoshard.kept(tensors, key)``: when the graph
runs, the node calls the Function itself, so its forward, its ``ctx`` and its backward are the Function's own.
``key`` names the call in ``KEPT`` (the Function, its non-tensor arguments, how its outputs nest).

Planned, a kept node is opaque: every axis replicates its inputs (speed, never correctness), except an axis that
splits the batch's samples, where it runs on each rank's rows only when ``per_sample`` proves, on the traced
forward and backward, that its rows do not mix (``passes.rules_nn``'s rule for it).

A Function proven the identity is not kept at all (``identity_pass``): another tensor-parallel library's region
mappings (Megatron's copy-to, reduce-from, gather-from and scatter-to a region), run in a process of their own,
hand their input back and their gradient back unchanged, and the graph then reads the input itself, so that every
axis plans through them as if they were not there.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import operator
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.nn import functional as F  # noqa: N812
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autoshard.errors import AutoshardError

LIB = torch.library.Library("autoshard", "FRAGMENT")
LIB.define("kept(Tensor[] tensors, int key) -> Tensor[]")
KEPT_OP = torch.ops.autoshard.kept.default

aten = torch.ops.aten
_function_apply = torch.autograd.Function.apply.__func__
_ctc_loss = F.ctc_loss
_keys = itertools.count()


class KeptFunctionError(AutoshardError, ValueError):
    """A Function that cannot be kept whole (it reads a tensor it is not passed): refused at capture."""


@dataclass(eq=False)
class Kept:
    """One call kept whole: ``call(*args, **kwargs)`` with the tensors put back among the constant arguments."""

    name: str  # what messages call it: the Function's class, or the op
    call: Callable
    spec: pytree.TreeSpec  # of (args, kwargs)
    leaves: list  # the constant leaves, None where a tensor goes
    at: list[int]  # the positions of the tensors among the leaves
    where: str  # the model's line that called it
    fake: Callable | None = None  # the outputs' shapes where running the call on fake tensors cannot give them
    # a call known to keep samples apart (the ctc loss per sample): the dim of the samples in each tensor input,
    # then in its output; None for a call proven on its trace
    rows: tuple[int, ...] | None = None
    out_spec: pytree.TreeSpec | None = None
    out_leaves: list = field(default_factory=list)  # the outputs' constant leaves, None where a tensor goes
    proofs: dict = field(default_factory=dict)  # (placements, size) -> the output placements, or None

    def arguments(self, tensors) -> tuple[tuple, dict]:
        leaves = list(self.leaves)
        for i, t in zip(self.at, tensors, strict=True):
            leaves[i] = t
        return pytree.tree_unflatten(leaves, self.spec)

    def run(self, tensors) -> list[torch.Tensor]:
        args, kwargs = self.arguments(tensors)
        flat, spec = pytree.tree_flatten(self.call(*args, **kwargs))
        if self.out_spec is None:
            self.out_spec = spec
            self.out_leaves = [None if isinstance(v, torch.Tensor) else v for v in flat]
        return [v for v in flat if isinstance(v, torch.Tensor)]

    def rebuild(self, tensors) -> object:
        leaves, it = list(self.out_leaves), iter(tensors)
        leaves = [next(it) if v is None else v for v in leaves]
        return pytree.tree_unflatten(leaves, self.out_spec)


KEPT: dict[int, Kept] = {}


def kept_of(node: fx.Node) -> Kept | None:
    """The call a kept node runs (None for any other node)."""
    return KEPT.get(node.args[1]) if node.op == "call_function" and node.target is KEPT_OP else None


def _fake(tensors, key):
    kept = KEPT[key]
    if kept.fake is not None:
        outs = kept.fake(*kept.arguments(tensors)[0])
        if kept.out_spec is None:
            kept.out_spec, kept.out_leaves = pytree.tree_flatten(outs)[1], [None]
        return [outs]
    with torch.no_grad(), _Reads() as reads:
        outs = kept.run(tensors)
    given = {id(t) for t in tensors}
    if any(id(t) not in given for t in reads.found):
        raise KeptFunctionError(
            f"the custom autograd Function {kept.name} (called at {kept.where}) reads a tensor that takes a gradient "
            "without being passed to it (a parameter or an activation held in a closure or an attribute): kept "
            "whole, as its own forward and backward, its gradient could not reach the model's copy that each rank "
            f"trains. Pass that tensor to {kept.name}.apply as an argument")
    # a kept node's outputs are new tensors (a Function's forward may hand an input back: identity forwards)
    ids = {id(t) for t in tensors}
    return [o.clone() if id(o) in ids or o._is_view() else o for o in outs]


class _Reads(TorchDispatchMode):
    """The tensors that take gradients which the ops run inside it read."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.found += [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
        return func(*args, **(kwargs or {}))


def _autograd(tensors, key):
    from torch._subclasses.fake_tensor import FakeTensor

    if torch.compiler.is_exporting() and any(isinstance(t, FakeTensor) for t in tensors):
        with torch._C._AutoDispatchBelowAutograd():  # the capture records the node and takes the fake outputs
            return KEPT_OP(tensors, key)
    return KEPT[key].run(tensors)  # the Function itself: its forward, ctx and backward


torch.library.register_fake("autoshard::kept", _fake, lib=LIB)
LIB.impl("kept", _autograd, "Autograd")
LIB.impl("kept", lambda tensors, key: KEPT[key].run(tensors), "CompositeExplicitAutograd")


def _record(name: str, call: Callable, args: tuple, kwargs: dict, fake: Callable | None = None,
            rows: tuple[int, ...] | None = None) -> object:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    at = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    key = next(_keys)
    KEPT[key] = kept = Kept(name, call, spec, [None if i in at else v for i, v in enumerate(leaves)], at,
                            _model_line(), fake=fake, rows=rows)
    return kept.rebuild(KEPT_OP([leaves[i] for i in at], key))


def _model_line() -> str:
    frames = [f for f in traceback.extract_stack()[:-3]
              if "/torch/" not in f.filename and "/autoshard/" not in f.filename]
    if not frames:
        return "?"
    where = frames[-1].filename.rpartition("site-packages/")[2]  # a library's file by its package path
    return f"{where}:{frames[-1].lineno}"


def _kept_apply(cls, *args, **kwargs):
    if not torch.compiler.is_exporting() or cls.__module__.startswith("torch."):
        return _function_apply(cls, *args, **kwargs)  # torch's own Functions are ops it knows how to capture
    return _record(cls.__qualname__, functools.partial(_function_apply, cls), args, kwargs)


def _kept_ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, reduction="mean",
                   zero_infinity=False):
    if not torch.compiler.is_exporting():
        return _ctc_loss(log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity)
    args = (log_probs, targets, input_lengths, target_lengths)
    # each sample's loss reads its own column of log_probs (T, N, C), its row of the padded targets (N, S) and its
    # lengths: the samples stay apart (concatenated 1-D targets cannot be cut by sample)
    dims = [1 if log_probs.dim() == 3 else None, 0 if targets.dim() == 2 else None, 0, 0]
    rows = tuple(d for a, d in zip(args, dims, strict=True) if isinstance(a, torch.Tensor)) + (0,)
    losses = _record("ctc_loss", functools.partial(_ctc_loss, reduction="none"), (*args, blank),
                     {"zero_infinity": zero_infinity},
                     fake=lambda lp, *_: lp.new_empty(lp.shape[1] if lp.dim() == 3 else ()),
                     rows=None if None in rows else rows)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    lengths = torch.as_tensor(target_lengths, device=losses.device).to(losses.dtype)  # torch's own mean
    return (losses / lengths.clamp(min=1)).mean()


@contextlib.contextmanager
def kept_whole() -> Iterator[None]:
    """While capturing: every user Function's ``apply`` and ``F.ctc_loss`` recorded as kept nodes."""
    apply, ctc = torch.autograd.Function.__dict__["apply"], F.ctc_loss  # the classmethod itself, not bound
    torch.autograd.Function.apply = classmethod(_kept_apply)
    F.ctc_loss = _kept_ctc_loss
    try:
        yield
    finally:
        torch.autograd.Function.apply, F.ctc_loss = apply, ctc


def per_sample(node: fx.Node, placements: list, size: int):
    """The placements of a kept node's outputs when its inputs are ``placements`` (each whole or split by samples,
    ``Shard``) over ``size`` ranks of an axis that splits the batch's samples; None where it is not proven.

    Proven on the call itself, traced (forward, and forward with its backward, at the capture's shapes): the split
    propagates through both without a collective (no op reads the split rows together), each output is split or a
    pending sum, each split input's gradient is split and each whole input's a pending sum (summed over the ranks
    as a parameter's is); and, traced again on one rank's rows, the shapes are those parts (no size of the whole
    batch held in the call as a number)."""
    kept = kept_of(node)
    if kept.rows is not None:
        return _declared(node, kept.rows, placements)
    key = (tuple(placements), size)
    if key not in kept.proofs:
        kept.proofs[key] = None
        for level in (True, False):  # traced as export traces (matmul, linear), then as autograd runs it (mm, views)
            with contextlib.suppress(Exception):  # a call that cannot be traced is not proven: it is replicated
                kept.proofs[key] = _prove(kept, node, placements, size, level)
            if kept.proofs[key] is not None:
                break
    return kept.proofs[key]


def _declared(node: fx.Node, rows: tuple[int, ...], placements: list):
    """A call known to keep the samples apart: each input split by its samples' dim (a whole input holding the
    batch's rows there taken in parts); else None."""
    from autoshard import meta
    from autoshard.passes.placements import R, Shard

    tensors = node.args[0]
    split = [p for p, d in zip(placements, rows, strict=False) if p == Shard(d)]
    if not split:
        return None
    batch = next(meta.val(t).shape[d] for t, p, d in zip(tensors, placements, rows, strict=False) if p == Shard(d))
    want = {}
    for t, p, d in zip(tensors, placements, rows, strict=False):
        if p == R and meta.val(t).shape[d] == batch:
            want[t] = Shard(d)
        elif p != Shard(d):
            return None
    return (Shard(rows[-1]),), want


def _prove(kept: Kept, node: fx.Node, placements: list, size: int, pre_dispatch: bool):
    from autoshard import meta
    from autoshard.passes import batch_split
    from autoshard.passes.axis import Axis, Outputs
    from autoshard.passes.placements import Partial, R, Shard
    from autoshard.passes.propagate import propagate, redistributions

    def grown(shape, placement) -> tuple:
        shape = list(shape)
        if isinstance(placement, Shard):
            shape[placement.dim] *= 2
        return tuple(shape)

    def placed(gm: fx.GraphModule, seeds: list):
        batch_split.reductions_by_dims(gm)
        names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
        prop = propagate(gm, dict(zip(names, seeds, strict=True)), axis, outputs=Outputs.PARTIAL)
        # a split value read whole, or a pending sum read before it is summed, mixes the ranks' rows (a whole value
        # taken in parts does not; the outputs are read as placed)
        mixed = [r for r in redistributions(prop) if r.consumer.op != "output" and r.src != R]
        return (None if mixed else [prop.of(v) for v in _outputs(gm)]), prop

    inputs, outputs = [meta.val(t) for t in node.args[0]], list(meta.val(node))
    if any(isinstance(p, Shard) and (p.blocks is not None or v.shape[p.dim] % size)
           for v, p in zip(inputs, placements, strict=True)):
        return None
    axis = Axis("samples", size, pending_sums=True, samples=True)
    forward, _ = placed(_trace(kept, [v.shape for v in inputs], inputs, pre_dispatch=pre_dispatch), placements)
    if forward is None or any(not isinstance(p, (Shard, Partial)) for p in forward):
        return None  # (an output the same on every rank would take a gradient from each: not a part's)
    differentiable = [i for i, v in enumerate(outputs) if v.dtype.is_floating_point]
    seeds = [*placements, *(R if isinstance(forward[i], Partial) else forward[i] for i in differentiable)]
    unused: list[int] = []
    gm = _trace(kept, [v.shape for v in inputs], inputs, [outputs[i] for i in differentiable], differentiable, unused,
                pre_dispatch=pre_dispatch)
    grads, prop = placed(gm, seeds)
    if grads is None:
        return None
    wanted = [p for i, (p, v) in enumerate(zip(placements, inputs, strict=True))
              if v.dtype.is_floating_point and i not in unused]
    if any(g != w if isinstance(w, Shard) else not isinstance(g, Partial)
           for g, w in zip(grads[len(outputs):], wanted, strict=True)):
        return None  # (a whole input's gradient must be each rank's part of a sum, as a parameter's is)
    # traced again with twice the rows, every value grows along its split dim alone: no size of the rows is held
    # in the call as a number (its rows, whatever their count, are run as the rows they are)
    twice = _trace(kept, [grown(v.shape, p) for v, p in zip(inputs, placements, strict=True)], inputs,
                   [torch.empty(grown(outputs[i].shape, forward[i]), dtype=outputs[i].dtype, device=outputs[i].device)
                    for i in differentiable], differentiable, [], pre_dispatch=pre_dispatch)
    pairs = list(zip(gm.graph.nodes, twice.graph.nodes, strict=False))
    if len(gm.graph.nodes) != len(twice.graph.nodes) or any(
            a.target != b.target or _shape(b) != (grown(_shape(a), prop.of(a)) if _shape(a) is not None else None)
            for a, b in pairs):
        return None
    return tuple(forward), {}


def _shape(node: fx.Node) -> tuple | None:
    from autoshard import meta

    value = meta.val(node)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _outputs(gm: fx.GraphModule) -> list[fx.Node]:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return [v for v in pytree.tree_leaves(output.args[0]) if isinstance(v, fx.Node)]


def _trace(kept: Kept, shapes: list, like: list, grads: list | None = None, differentiable: list[int] | None = None,
           unused: list[int] | None = None, *, pre_dispatch: bool = True) -> fx.GraphModule:
    """The call traced (on fake tensors of ``shapes``, with the dtypes and devices of ``like``): its forward, or
    with ``grads`` (of the outputs at ``differentiable``) its forward then its backward, returning the outputs and
    the gradients of its floating inputs; the positions of those it gives no gradient go into ``unused``."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def forward(*tensors):
        return kept.run(tensors)

    def joint(*values):
        tensors = [t.detach().requires_grad_(t.dtype.is_floating_point) for t in values[:len(shapes)]]
        outs = kept.run(tensors)
        wrt = [i for i, t in enumerate(tensors) if t.requires_grad]
        found = torch.autograd.grad([outs[i] for i in differentiable], [tensors[i] for i in wrt],
                                    values[len(shapes):], allow_unused=True)
        unused.extend(i for i, g in zip(wrt, found, strict=True) if g is None)
        return [*outs, *(g for g in found if g is not None)]

    examples = [torch.empty(s, dtype=v.dtype, device=v.device) for s, v in zip(shapes, like, strict=True)]
    if grads is None:
        return make_fx(forward, tracing_mode="fake", pre_dispatch=pre_dispatch)(*examples)
    examples += [torch.empty(g.shape, dtype=g.dtype, device=g.device) for g in grads]
    return make_fx(joint, tracing_mode="fake", pre_dispatch=pre_dispatch)(*examples)


# ops that hand back the values they are given: the alias autograd makes of an input a Function returns
# (``view_as`` itself, or ``view`` once decomposed), a view or reshape to the same shape, a copy, a detach
_UNCHANGED = {aten.alias.default, aten.view_as.default, aten.view.default, aten._unsafe_view.default,
              aten.reshape.default, aten.clone.default, aten.contiguous.default, aten.detach.default}


def identity_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Every kept call proven the identity (``is_identity``) replaced by its input: the graph reads the input itself.

    Exact at the captured shapes, where the capture ran the call: the graph means what the model computes there,
    as export's own graphs do for the Python branches they took (a region mapping's ``if group.size() == 1``)."""
    for node in list(gm.graph.nodes):
        if kept_of(node) is None or not is_identity(node):
            continue
        if any(user.target is not operator.getitem or user.args[1] != 0 for user in node.users):
            continue
        for user in list(node.users):
            user.replace_all_uses_with(node.args[0][0])
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm


def is_identity(node: fx.Node) -> bool:
    """Whether the kept ``node`` is the identity, proven on its traces: one floating tensor in, one out of its shape
    and dtype; its forward only hands its input back (``_UNCHANGED``) and its backward only hands the output's
    gradient back as the input's. Any other op in either (an all-reduce, a scale, a round), a gradient it does not
    give, a call that cannot be traced: not proven, and the call stays kept whole."""
    from autoshard import meta

    inputs, outputs = [meta.val(t) for t in node.args[0]], list(meta.val(node))
    if len(inputs) != 1 or len(outputs) != 1 or not inputs[0].dtype.is_floating_point \
            or (outputs[0].shape, outputs[0].dtype) != (inputs[0].shape, inputs[0].dtype):
        return False
    kept, shapes, unused = kept_of(node), [inputs[0].shape], []
    try:
        forward = _trace(kept, shapes, inputs)
        joint = _trace(kept, shapes, inputs, outputs, [0], unused)
    except Exception:  # noqa: BLE001 - a call that cannot be traced is not proven: it stays kept whole
        return False
    return not unused and _hands_back(forward, 0, 0) and _hands_back(joint, 1, 1)


def _hands_back(gm: fx.GraphModule, output: int, placeholder: int) -> bool:
    """Whether ``gm`` runs only ``_UNCHANGED`` ops and its output ``output`` is its input ``placeholder`` through
    them, at that input's shape and dtype all the way."""
    from autoshard import meta

    if any(n.op not in ("placeholder", "output", "call_function") or
           (n.op == "call_function" and n.target not in _UNCHANGED) for n in gm.graph.nodes):
        return False
    source = [n for n in gm.graph.nodes if n.op == "placeholder"][placeholder]
    value, like = _outputs(gm)[output], meta.val(source)
    while value.op == "call_function":
        held = meta.val(value)
        if not isinstance(value.args[0], fx.Node) or (held.shape, held.dtype) != (like.shape, like.dtype):
            return False
        value = value.args[0]
    return value is source
