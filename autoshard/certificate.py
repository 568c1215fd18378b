"""What a rank sends in a step, planned: the communication certificate.

Each build knows, from its programs and its schedule, every collective its rank issues in a step: the collective
modules of its graphs (tp's all-reduces, sp's gathers and reduce-scatters, cp's gathers, all-to-alls and ring
messages, ep's routing), each saying what one call sends (``passes.collectives.Wire``); the pipeline's messages at
each cut, from the schedule's actions and the stages' specs; and, once per step, the loss's sums, the gradient sync
and the check that every rank was given the same batch (``runtime.communication`` adds those). A ``Certificate``
lists them, one ``Collective`` per module call site and direction (with its node and the model's line) or per
step-level sum, and says what one step sends in total per (phase, kind, group, dtype): the unit the first step's
record is compared in (``runtime.communication.check``), and what ``explain()`` and ``autoshard inspect
--certificate`` print.

Counting: a collective's elements are those this rank hands it (an all-reduce's buffer, an all-gather's part, a
reduce-scatter's whole input, an all-to-all's input, a message). Where the data decides how many (rows routed to
experts, gradients only some steps produce, the collectives torch's early stop recomputes), the kind, group and
dtype are certified, not the elements; DDP's buckets by their total (how many buckets is DDP's choice).
``wire_bytes`` turns an entry into the bytes a ring algorithm puts on the wire, ``counted`` sums them per axis.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.utils import _pytree as pytree

from autoshard import meta, schedules
from autoshard.cost import dim_size, format_bytes
from autoshard.kinds import ActionKind
from autoshard.mesh import Mesh
from autoshard.passes.collectives import Seen, Wire
from autoshard.passes.propagate import requires_grad
from autoshard.passes.writes import closure

PHASES = ("checks", "forward", "backward", "recompute", "pipeline", "parameter gathers", "gradient sync", "loss")


@dataclass(frozen=True)
class Collective:
    """Collectives one step issues from one place: ``count`` calls (None: as many as the buckets) of ``kind`` on
    ``group`` (an axis and its ranks: ``tp 0,1``; a message: ``to 3`` / ``from 3``), handing ``numel`` elements of
    ``dtype`` in all (as many as the data decides where ``routed``), for ``phase``; ``node`` and ``line``: the
    graph node that issues them and the model's line it stands for; ``axis``: the mesh axis it runs on."""

    phase: str
    kind: str
    group: str
    dtype: str
    numel: int
    count: int | None = 1
    node: str = ""
    line: str = ""
    routed: bool = False
    axis: str = ""  # the mesh axis it runs on (data: dp x cp; experts: the ranks holding the same experts)

    @property
    def key(self) -> tuple[str, str, str, str]:
        """What the record is compared by: per (phase, kind, group's ranks or message's peer, dtype)."""
        return self.phase, self.kind, members(self.group), self.dtype

    @property
    def bytes(self) -> int:
        return self.numel * _itemsize(self.dtype)

    def describe(self) -> str:
        calls = "calls" if self.count is None else f"{self.count} call{'s' * (self.count != 1)}"
        where = f" at {self.node}" if self.node else ""
        line = f" ({self.line})" if self.line else ""
        most = "data-dependent, here " if self.routed else ""
        return (f"{self.phase}: {self.kind} on {self.group}, {calls}, {most}{self.numel} x {self.dtype} "
                f"({format_bytes(self.bytes)}){where}{line}")


@dataclass
class Certificate:
    """What rank ``rank`` sends in one step (``collectives``), and what it could not certify (``unchecked``: a
    module that does not say what it sends; a step run compiled)."""

    rank: int
    collectives: list[Collective] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)

    def totals(self) -> dict[tuple, tuple[int | None, int, bool]]:
        """(phase, kind, ranks, dtype) -> (calls or None, elements, whether the data decides the elements)."""
        found: dict[tuple, tuple[int | None, int, bool]] = {}
        for c in self.collectives:
            calls, numel, routed = found.get(c.key, (0, 0, False))
            found[c.key] = (None if calls is None or c.count is None else calls + c.count, numel + c.numel,
                            routed or c.routed)
        return found

    def to_json(self) -> str:
        return json.dumps({"rank": self.rank, "collectives": [dataclasses.asdict(c) for c in self.collectives],
                           "unchecked": self.unchecked}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Certificate:
        data = json.loads(text)
        return cls(data["rank"], [Collective(**c) for c in data["collectives"]], list(data["unchecked"]))

    def __str__(self) -> str:
        lines = [f"communication certificate of rank {self.rank}: per step"]
        for phase in PHASES:
            here = [c for c in self.collectives if c.phase == phase]
            if here:
                total = sum(c.bytes for c in here)
                lines.append(f"  {phase} ({format_bytes(total)}):")
                lines += [f"    {c.describe().split(': ', 1)[1]}" for c in here]
        if len(lines) == 1:
            lines.append("  nothing")
        lines += [f"  not certified: {what}" for what in self.unchecked]
        return "\n".join(lines)


def members(group: str) -> str:
    """A group as the record and the certificate are compared by: its ranks in order (``tp 1,0`` -> ``0,1``), or a
    message's peer (``to 3``)."""
    if group.startswith(("to ", "from ")):
        return group
    return ",".join(sorted(group.split(" ")[-1].split(","), key=int))


def wire_bytes(c: Collective) -> float:
    """The bytes this rank puts on the wire for ``c`` with ring algorithms over its group of ``n``: an all-reduce
    ``2 (n-1)/n`` of its buffer, an all-gather ``n - 1`` parts, a reduce-scatter and an all-to-all ``(n-1)/n`` of
    their input, a message its size (a receive nothing)."""
    if c.kind in ("send", "recv", "broadcast"):
        return float(c.bytes) if c.kind != "recv" else 0.0
    n = len(c.group.split(" ")[-1].split(","))
    return c.bytes * {"all_reduce": 2 * (n - 1) / n, "all_gather": n - 1}.get(c.kind, (n - 1) / n)


def counted(certificate: Certificate) -> dict[str, float]:
    """The bytes each mesh axis puts on the wire in a step (``wire_bytes``), by axis."""
    found: dict[str, float] = {}
    for c in certificate.collectives:
        axis = c.axis or "?"
        found[axis] = found.get(axis, 0.0) + wire_bytes(c)
    return found


def of_build(build, *, runs: int | None = None, device: str = "cpu", exact: bool = True) -> Certificate:
    """What ``build``'s rank sends for its programs in a training step of ``runs`` microbatches (the options'),
    on a ``device`` of that type: each program's collectives and, under pp, the schedule's messages. The step's
    own (the batch check, the loss's sums, the gradient sync) are added where the step runs
    (``runtime.communication``). ``exact``: the programs run on fake tensors (``as_run``), else read off their
    recorded values (``as_recorded``, a fraction of the time)."""
    mesh, options, rank = build.mesh, build.options, build.rank
    runs = options.microbatches if runs is None else runs
    how = {"training": build.training, "recomputed": options.activation_checkpointing, "device": device, "exact": exact,
           "autocast": torch.bfloat16 if options.mixed_precision == "bf16" and build.training else None}
    found = Certificate(rank)
    for index, program in sorted(build.programs.items()):
        sent, unknown = program_collectives(program.gm, mesh, rank, runs=runs,
                                            last=not build.stages or index == build.num_stages - 1, **how)
        found.collectives += sent
        found.unchecked += unknown
    if build.stages and build.actions is not None:
        placement = schedules.placement_of(options.schedule)
        pp_index = mesh.coords(rank)["pp"]
        found.collectives += pipeline_messages(build.actions[pp_index], build.local_specs, mesh.pp, placement,
                                               mesh.group_of("pp", rank))
    return found


def program_collectives(gm: fx.GraphModule, mesh: Mesh, rank: int, *, runs: int, training: bool,
                        autocast: torch.dtype | None = None, recomputed: bool = False, last: bool = True,
                        device: str = "cpu", exact: bool = True) -> tuple[list[Collective], list[str]]:
    """The collectives ``runs`` runs of ``gm`` (forward, and backward where ``training``) issue on ``rank``, the
    program running on a ``device`` of that type under ``autocast`` (a dtype, or None). A forward ``recomputed``
    in the backward (activation checkpointing) issues some of its forward's collectives again (as many as torch's
    early stop runs). ``last``: the program ends the model (its first output is the loss), else a pipeline stage
    whose outputs all take gradients back. ``exact``: each module's inputs as the program runs on fake tensors
    (``as_run``), else as the passes recorded them (``as_recorded``: where no autocast changes a dtype, the same
    on every graph the passes recorded right, in a fraction of the time). Returns the collectives and the modules
    that do not say what they send."""
    found, unknown = [], []
    if not any(_module(gm, n) is not None for n in gm.graph.nodes):
        calls = {}
    elif autocast is None and not exact:
        calls = as_recorded(gm, device)
    else:
        calls = as_run(gm, autocast, device)
    backward = _reaching_gradients(gm, last) if training else set()
    for node in gm.graph.nodes:
        module = _module(gm, node)
        if module is None or node.name not in calls:
            continue
        inputs = calls[node.name]
        if not hasattr(module, "wires"):
            unknown.append(f"{node.name} ({type(module).__name__})")
            continue
        with _autocast(device, autocast):  # a module that casts under autocast (ring attention) says so
            forward_wires, backward_wires = module.wires(*inputs)
        axis = node.meta.get(meta.AXIS, "tp")
        holders = ranks(mesh, axis, rank)
        line = meta.source_line(node)
        phases = [("forward", forward_wires)]
        grad = any(getattr(x, "requires_grad", False) for x in inputs)
        if node in backward and grad:
            phases.append(("backward", backward_wires))
        for phase, wires in phases:
            for wire in wires:
                found.append(_of(wire, phase, axis, holders, rank, runs, node.name, line))
        if recomputed and training:  # as many of them as torch's early stop runs again
            found += [dataclasses.replace(_of(wire, "recompute", axis, holders, rank, runs, node.name, line),
                                          count=None, routed=True) for wire in forward_wires]
    return found, unknown


def as_recorded(gm: fx.GraphModule, device: str = "cpu") -> dict[str, list]:
    """What each communicating module of ``gm`` is called with, by node name, read off the values the passes
    recorded (this rank's shapes and dtypes) and whether a gradient flows back through each
    (``propagate.requires_grad``): what ``as_run`` finds where no autocast changes the dtypes and the passes
    recorded every value right, in a fraction of its time."""
    grads = requires_grad(gm)
    where = torch.device(device)

    def seen(value, node):
        if not isinstance(value, torch.Tensor):
            return value
        return Seen(tuple(dim_size(d) for d in value.shape), value.dtype, node in grads and value.is_floating_point(),
                    where)

    return {node.name: [seen(meta.val(a), a) if isinstance(a, fx.Node) else a for a in node.args]
            for node in gm.graph.nodes if _module(gm, node) is not None}


def as_run(gm: fx.GraphModule, autocast: torch.dtype | None, device: str = "cpu") -> dict[str, list]:
    """What each communicating module of ``gm`` is called with as the program runs (under ``autocast``), by node
    name: fake tensors with the dtype autocast gives them and whether a gradient flows back through them (the
    parameters that train and the activations a pipeline stage receives take gradients; the batch does not)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    seen: dict[str, list] = {}

    def blank(value, grad: bool, dtype: torch.dtype | None = None):
        """A fake tensor of ``value``'s shape (a routed size at its hint) and dtype, taking gradients where
        ``grad``; other values as they are."""
        if not isinstance(value, torch.Tensor):
            return value
        dtype = dtype if dtype is not None and value.is_floating_point() else value.dtype
        with mode:
            out = torch.empty([dim_size(d) for d in value.shape], dtype=dtype, device=device)
        return out.requires_grad_(grad and out.is_floating_point())

    def stand_in(node: fx.Node, args):
        """``node``'s recorded value, in the dtype of its first floating input (a collective hands on what it was
        given), taking gradients where an input does."""
        leaves = [a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]
        grad = any(a.requires_grad for a in leaves)
        first = next((a.dtype for a in leaves if a.is_floating_point()), None)
        return pytree.tree_map(lambda v: blank(v, grad, first), meta.val(node))

    class _AsRun(fx.Interpreter):
        def run_node(self, node: fx.Node):
            if node.op == "placeholder":
                return blank(meta.val(node), meta.RECEIVED in node.meta)
            if node.op == "get_attr":
                attr = self.fetch_attr(node.target)
                value = meta.val(node)
                return blank(value, attr.requires_grad) if isinstance(value, torch.Tensor) else attr
            args, _ = self.fetch_args_kwargs_from_env(node)
            if _module(gm, node) is not None:
                seen[node.name] = list(args)
            try:  # a communicating module too: on fake tensors its collectives are skipped (``peers.run``)
                with mode:
                    return super().run_node(node)
            except Exception:  # noqa: BLE001 - an op fake tensors cannot run: its recorded value stands in
                return stand_in(node, args)

    with _autocast(device, autocast):
        _AsRun(gm).run(*[None for n in gm.graph.nodes if n.op == "placeholder"])
    return seen


def _autocast(device: str, dtype: torch.dtype | None):
    return torch.autocast(device, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def _reaching_gradients(gm: fx.GraphModule, last: bool) -> set[fx.Node]:
    """The nodes a gradient reaches in the backward: those the loss (a pipeline stage's every output) reads through
    floating-point values (not a router's scores read only for the top-k's indices), a value written in place into
    one it reads included (keys written into a buffer)."""
    grad = requires_grad(gm)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    roots = [r for r in pytree.tree_leaves(output.args[0]) if isinstance(r, fx.Node)]

    def sources(node: fx.Node) -> list[fx.Node]:
        return [] if node.target is torch.ops.aten.detach.default else [n for n in node.all_input_nodes if n in grad]

    return closure([r for r in (roots[:1] if last else roots) if r in grad], inputs=sources,
                   admit=lambda writer: writer in grad)


def pipeline_messages(actions: Iterable, local_specs: dict, p: int, placement: str, pp_ranks: list[int]
                      ) -> list[Collective]:
    """The messages a pp rank's ``actions`` send and receive: activations forward, their gradients (and one
    flag per gradient) backward, at the shapes and dtypes of the stages' specs."""
    found = []
    for action in actions:
        kind = action.kind
        if kind not in (ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B):
            continue
        received, sent = local_specs[action.stage]
        forward = kind in (ActionKind.SEND_F, ActionKind.RECV_F)
        towards = action.stage + 1 if kind in (ActionKind.SEND_F, ActionKind.RECV_B) else action.stage - 1
        peer = pp_ranks[schedules.stage_rank(towards, p, placement)]
        specs = sent if kind in (ActionKind.SEND_F, ActionKind.RECV_B) else received
        sends = kind in (ActionKind.SEND_F, ActionKind.SEND_B)
        shapes = [(tuple(s.shape), s.dtype) for s in specs]
        if not forward:
            shapes.append(((len(specs),), torch.uint8))
        what = "activations" if forward else "gradients"
        for shape, dtype in shapes:
            found.append(Collective("pipeline", "send" if sends else "recv", f"{'to' if sends else 'from'} {peer}",
                                    _name(dtype), math.prod(shape), node=f"{what} of stage {action.stage}, "
                                    f"microbatch {action.microbatch}", axis="pp"))
    return found


def _of(wire: Wire, phase: str, axis: str, holders: list[int], rank: int, runs: int, node: str, line: str
        ) -> Collective:
    if wire.kind in ("send", "recv"):
        peer = holders[(holders.index(rank) + wire.peer) % len(holders)]
        group = f"{'to' if wire.kind == 'send' else 'from'} {peer}"
    else:
        group = f"{axis} {','.join(map(str, holders))}"
    return Collective(phase, wire.kind, group, _name(wire.dtype), wire.numel * runs, None if wire.routed else runs,
                      node, line, wire.routed, "tp" if axis == "sp" else axis)


def _module(gm: fx.GraphModule, node: fx.Node):
    """The module ``node`` calls where it communicates (a ``comm_bytes`` of its own, more than one rank)."""
    if node.op != "call_module":
        return None
    module = gm.get_submodule(node.target)
    return module if hasattr(module, "comm_bytes") and getattr(module, "size", 1) > 1 else None


def ranks(mesh: Mesh, axis: str, rank: int) -> list[int]:
    """The ranks of ``rank``'s group along ``axis`` (``data``: dp x cp; ``experts``: the ranks holding the same
    experts), ordered as its process group orders them."""
    if axis == "ep":
        return mesh.expert_group_of(rank)
    if axis == "sp":  # sequence parallelism splits the sequence over the tp ranks
        axis = "tp"
    found = {"data": mesh.data_groups, "experts": mesh.expert_replica_groups}.get(axis)
    if found is not None:
        return sorted(next(group for group in found() if rank in group))
    return mesh.group_of(axis, rank)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _itemsize(dtype: str) -> int:
    return getattr(torch, dtype).itemsize


