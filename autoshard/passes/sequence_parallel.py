"""Sequence parallelism (Megatron, Korthikanti et al.): between tensor-parallel regions, split the sequence.

Plain tensor parallelism leaves everything outside the column -> row regions (norms, residual adds, dropout,
the embedding output) computed and stored whole on every tp rank. Sequence parallelism splits those values
along the sequence over the same tp ranks:

- a region's exit, the all-reduce of the row-parallel partial sums (``ReduceFromParallel``), becomes a
  reduce-scatter along the sequence (``ReduceScatterToSequence``; backward: all-gather);
- a region's entry, Megatron's f before the column-parallel linears (``CopyToParallel``), is preceded by an
  all-gather of the sequence whose backward reduce-scatters the partial gradient (the two fused into
  ``GatherSequenceToParallel``), so the bytes per layer equal plain TP's;
- in between, ops run on each rank's 1/tp of the tokens. A replicated weight read there (a norm's) gets a
  gradient from this rank's tokens only, so its read gets an f: its gradient is summed over tp.

The regions are read from what tensor parallelism recorded at their borders (``meta.REGION`` on its f's, splits
and all-reduces), not found again. Where the sequence is, is found as context parallelism finds it
(``plan_context_parallel`` on the same graph): the tp graph is propagated once with the sequence split from the
inputs, and every all-reduce whose value carries that split dim becomes a reduce-scatter along it. Then a
propagation on the tp axis from those reduce-scatters decides every other value, and ``apply_placements`` inserts
what it asks for (a scatter where a replicated value meets a split one, a gather where a whole sequence is
needed), tensor parallelism's way: a replicated value's gradient is whole on every rank.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import fx

from autoshard import meta, peers
from autoshard.errors import AutoshardError
from autoshard.passes import localize
from autoshard.passes.axis import Axis
from autoshard.passes.axis_pass import AxisPass, PlanCodec, Sharding, present
from autoshard.passes.collectives import (
    CopyToParallel,
    GatherFromParallel,
    ReadWhole,
    ScatterToParallel,
    Wire,
    _ParallelOp,
    reduce_scatter_single,
)
from autoshard.passes.context_parallel import ContextParallelPlan, gathered_attention, insert_splits, remove_splits
from autoshard.passes.placements import R, Shard
from autoshard.passes.propagate import propagate
from autoshard.passes.rules import Decision, op
from autoshard.passes.sharding import IDLE_F, shard_axis

aten = torch.ops.aten


class SequenceParallelError(AutoshardError, ValueError):
    """Sequence parallelism cannot split this model's sequence over tp; the message says why and what works."""


@dataclass(frozen=True)
class SequenceParallelPlan:
    """Where sequence parallelism splits the sequence over the ``size`` tp ranks: the inputs that carry it (name ->
    dim), the nodes where a sequence made inside the model starts (name -> dim), and its length (under context
    parallelism, each cp rank's: ``for_cp_rank``)."""

    size: int
    inputs: dict[str, int] = field(default_factory=dict)
    seq_len: int = 0
    values: dict[str, int] = field(default_factory=dict)

    @classmethod
    def found(cls, plan: ContextParallelPlan) -> SequenceParallelPlan:
        """The sequence context parallelism's search found over the tp ranks (``plan_context_parallel``)."""
        return cls(plan.size, dict(plan.inputs), plan.seq_len, dict(plan.values))

    @classmethod
    def from_json(cls, data: dict) -> SequenceParallelPlan:
        return cls(data["size"], dict(data.get("inputs", {})), data.get("seq_len", 0), dict(data.get("values", {})))

    def axis(self) -> Axis:
        """The axis that finds where the sequence is: the split of the inputs, with attention gathering it."""
        return Axis("cp", self.size, sequence=self.seq_len)

    def with_inputs(self, inputs: dict[str, int]) -> SequenceParallelPlan:
        return dataclasses.replace(self, inputs=inputs)

    def for_cp_rank(self, tokens: int) -> SequenceParallelPlan:
        """Under context parallelism tp splits each cp rank's ``tokens``."""
        return dataclasses.replace(self, seq_len=tokens)


def _all_gather(x: torch.Tensor, dim: int, size: int, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(size)]
    peers.run(dist.all_gather, parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, size: int, group) -> torch.Tensor:
    parts = torch.stack(x.chunk(size, dim=dim)).contiguous()
    out = parts.new_empty(parts.shape[1:])
    reduce_scatter_single(out.view(-1), parts.view(-1), group=group)
    return out


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, size, group):
        ctx.dim, ctx.size, ctx.group = dim, size, group
        return _reduce_scatter(x, dim, size, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.size, ctx.group), None, None, None


class _GatherReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, size, group):
        ctx.dim, ctx.size, ctx.group = dim, size, group
        return _all_gather(x, dim, size, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.size, ctx.group), None, None, None


class _AlongSequence(_ParallelOp):
    def __init__(self, *, group, size: int, rank: int, dim: int) -> None:
        super().__init__(group=group, size=size, rank=rank)
        self.dim = dim

    def extra_repr(self) -> str:
        return f"dim={self.dim}, size={self.size}"


class ReduceScatterToSequence(_AlongSequence):
    """A region's exit: the row-parallel partial sums reduce-scattered along the sequence (this rank's tokens,
    summed); backward all-gathers the gradient of every rank's tokens."""

    kind, backward_kind = "reduce_scatter", "all_gather"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self._run_group()
        if self.size == 1:
            return x
        return _ReduceScatter.apply(x, self.dim, self.size, group)

    def comm_bytes(self, input_shape, elem_size: int) -> tuple[int, int]:
        """The tensor it reduces, as an all-reduce counts; backward, the gathered gradient (the same size)."""
        numel = int(torch.Size(input_shape).numel())
        return numel * elem_size, numel * elem_size

    def wires(self, x):
        numel, dtype = x.numel(), x.dtype
        return (Wire("reduce_scatter", numel, dtype),), (Wire("all_gather", numel // self.size, dtype),)


class GatherSequenceToParallel(_AlongSequence):
    """A region's entry: every rank's tokens all-gathered into the whole sequence for the column-parallel
    linears; backward reduce-scatters their partial gradients (Megatron's f and the gather in one)."""

    kind, backward_kind = "all_gather", "reduce_scatter"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self._run_group()
        if self.size == 1:
            return x
        return _GatherReduceScatter.apply(x, self.dim, self.size, group)

    def comm_bytes(self, input_shape, elem_size: int) -> tuple[int, int]:
        numel = int(torch.Size(input_shape).numel()) * self.size
        return numel * elem_size, numel * elem_size

    def wires(self, x):
        numel, dtype = x.numel(), x.dtype
        return (Wire("all_gather", numel, dtype),), (Wire("reduce_scatter", numel * self.size, dtype),)


class _EntryMark(CopyToParallel):
    """Megatron's f while sequence parallelism is planned: asks for its input whole (gathered)."""


class _WholeEntryMark(ReadWhole):
    """``ReadWhole`` while sequence parallelism is planned: asks for its input whole (gathered), then is dropped:
    the gather's backward splits the gradient back without summing it."""


class _SplitEntryMark(ScatterToParallel):
    """A split of the hidden dim before a row-parallel linear alone (an MLM head's transform), while sequence
    parallelism is planned: its weight's shards need every token, so it asks for its input whole too."""


def _entry_rule(node: fx.Node, ctx) -> Decision:
    (x,) = node.args
    return Decision(R, {x: R} if ctx.of(x) != R else {})


def _exit_rule(node: fx.Node, ctx) -> Decision:
    """Partial sums of the whole sequence out of a region, reduce-scattered to this rank's tokens."""
    (x,) = node.args
    split = Shard(node.graph.owning_module.get_submodule(node.target).dim)
    return Decision(split, {x: R} if ctx.of(x) != R else {})


op(_EntryMark, _WholeEntryMark, _SplitEntryMark, rule=_entry_rule)
op(ReduceScatterToSequence, rule=_exit_rule)


def region_exits(gm: fx.GraphModule, plan: SequenceParallelPlan) -> dict[str, int]:
    """The regions' all-reduces of a tensor-parallel graph that sequence parallelism turns into reduce-scatters:
    node name -> the sequence dim of the value they sum. Those whose value carries the sequence (propagated from
    the inputs) and reaches the residual stream."""
    size = plan.size
    if not plan.inputs and not plan.values:
        raise SequenceParallelError("sequence parallelism needs the sequence as a dim of the model's inputs (token "
                                    "ids, or embeddings of shape (batch, sequence, ...)); use sequence_parallel=False")
    _check_divides(plan)
    markers = insert_splits(gm, plan.values)  # a sequence made inside the model (patches and a class token)
    try:
        probe = propagate(gm, {name: Shard(dim) for name, dim in plan.inputs.items()},
                          Axis("sp", size, sequence=plan.seq_len))
    finally:
        remove_splits(gm, markers)
    from_inputs = _from_inputs(gm)
    exits = {}
    for node in gm.graph.nodes:
        if node.op != "call_module" or node.meta.get(meta.REGION) != "exit":
            continue
        where = probe.of(node.args[0])
        if isinstance(where, Shard) and where.blocks is None and _feeds_residual(node, from_inputs):
            exits[node.name] = where.dim
    return exits


def sequence_parallel_pass(gm: fx.GraphModule, plan: SequenceParallelPlan, *, rank: int, group=None,
                           stage: bool = False, exits: dict[str, int] | None = None) -> fx.GraphModule:
    """Rewrite a tensor-parallel rank's graph ``gm`` so that values between its regions hold this rank's tokens.

    ``plan`` says where the sequence is (found as context parallelism finds it, for ``size`` = the tp degree).
    ``stage``: ``gm`` is one pipeline stage, which receives and hands on its activations whole along the sequence;
    a stage without a region's exit (the last norm and the head alone) is left as tensor parallelism made it.
    ``exits``: the ``region_exits`` found before context parallelism split the graph's sequence (tp then splits
    each cp rank's tokens; cp's attention is inside the regions, where the sequence is whole over tp).
    """
    size = plan.size
    if size == 1:
        return gm
    if exits is None:
        exits = region_exits(gm, plan)
    _check_divides(plan)
    by_name = {node.name: node for node in gm.graph.nodes}
    exits = [(by_name[name], dim) for name, dim in exits.items()]
    idle = _idle_entries(gm)
    if not exits and stage:
        _drop(gm, idle)
        gm.recompile()
        return gm
    if not exits:
        raise SequenceParallelError(_NO_REGION)
    for node, dim in exits:  # the sequence's own collectives are on the "sp" axis (the tp group), as explain shows
        _swap(gm, node, ReduceScatterToSequence(group=group, size=size, rank=rank, dim=dim))
        node.meta[meta.AXIS] = gm.get_submodule(node.target).axis = "sp"
    entries = []
    for node in list(gm.graph.nodes):
        if node.op != "call_module":
            continue
        module, border = gm.get_submodule(node.target), node.meta.get(meta.REGION)
        if border == "entry":
            _swap(gm, node, _EntryMark(group=group, size=size, rank=rank))
        elif border == "whole entry":
            _swap(gm, node, _WholeEntryMark(group=group, size=size, rank=rank))
            idle.append(node)
        elif border == "split entry":
            marked = _SplitEntryMark(group=group, size=size, rank=rank, dim=module.dim, blocks=module.blocks)
            _swap(gm, node, marked)
            entries.append((node, module))
    shard_axis(gm, sequence_axis(size, plan.seq_len), {}, rank=rank, group=group)
    _fuse_entries(gm, group, size, rank)
    _drop(gm, idle)
    for node, module in entries:
        _swap(gm, node, module)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm


def _regions(gm: fx.GraphModule, sharding: Sharding, found: dict) -> None:
    found["sp exits"] = region_exits(gm, sharding.plan("sp"))


def _apply(gm: fx.GraphModule, sharding: Sharding, found: dict) -> None:
    on = sharding.axes["sp"]
    plan = on.plan
    if sharding.splits("cp"):  # tp splits each cp rank's tokens
        cp = sharding.axes["cp"]
        plan = plan.for_cp_rank(len(cp.plan.positions(cp.rank)))
    sequence_parallel_pass(gm, plan, rank=on.rank, group=on.group, stage=sharding.stage, exits=found["sp exits"])


# the regions' exits are read while the graph is tp's, before cp splits its sequence
SP_REGIONS = AxisPass("sp regions", after=("tp",), applies=present("sp"), apply=_regions)
SEQUENCE_PARALLEL = AxisPass(
    "sp", after=("sp regions", "cp"), applies=present("sp"), apply=_apply, mesh_axis="tp",
    codec=PlanCodec(encode=dataclasses.asdict, decode=SequenceParallelPlan.from_json,
                    describe=lambda plan: f"the sequence of {plan.seq_len} split over tp between its regions"))


_NO_REGION = ("sequence parallelism found no tensor-parallel region whose output carries the sequence (no row-parallel "
              "linear or vocab-parallel embedding ends on a value split by position): use sequence_parallel=False")


def check_applies(gm: fx.GraphModule, plan: SequenceParallelPlan, *, tokens: list[int], whole: bool) -> None:
    """Raise the ``SequenceParallelError`` this plan's pass would raise on the tensor-parallel graph ``gm``, without
    rewriting it: where the tp ranks cannot split the sequence evenly (``tokens``: each cp rank's, or the whole
    sequence's), or, where ``gm`` is the whole model (``whole``: no pipeline), where no region's output carries it."""
    for count in tokens:
        _check_divides(plan.for_cp_rank(count))
    if not region_exits(gm, plan) and whole:
        raise SequenceParallelError(_NO_REGION)


def sequence_axis(size: int, seq_len: int) -> Axis:
    """The sp axis: the tp group, splitting a sequence of ``seq_len`` between the regions. Inside a region the
    sequence is whole and the heads split, so sums may stay pending and splits be blocked as on tp."""
    return Axis(
        "sp", size, pending_sums=True, blocked_splits=True, sequence=seq_len,
        # a region's exit reduce-scatters partial sums: its input's gradient comes back whole, so no f before it
        needs_copy=lambda value: not all(_is_exit(u) for u in value.users),
        localizers={aten.scaled_dot_product_attention.default: functools.partial(_attention, size, seq_len),
                    aten.dropout.default: localize.dropout_of_part},
    )


def _attention(size: int, seq_len: int, node: fx.Node, rw: localize.Rewriter) -> None:
    """Attention reached with the sequence split (a region that gathers it after its attention): this rank's
    contiguous chunk of queries against the gathered keys, as cp's gather attention computes it."""
    q = node.args[0]
    if rw.placement(q) == Shard(len(meta.val(q).shape) - 2):
        positions = torch.arange(rw.rank * seq_len // size, (rw.rank + 1) * seq_len // size)
        gathered_attention(node, rw, positions, seq_len)


def _check_divides(plan: SequenceParallelPlan) -> None:
    if plan.seq_len % plan.size:
        works = [t for t in range(2, plan.seq_len + 1) if plan.seq_len % t == 0][:6]
        fix = "an input size that makes" if plan.values else "a sequence length of"  # tokens made inside the model
        raise SequenceParallelError(
            f"sequence parallelism splits the sequence of {plan.seq_len} tokens (under context parallelism, each cp "
            f"rank's) over tp={plan.size} ranks, which does not divide it: use {fix} a multiple of {plan.size} "
            f"tokens, a tp degree in {works}, or sequence_parallel=False")


_THROUGH = {aten.type_as.default, aten._to_copy.default, aten.to.dtype, aten.clone.default, aten.contiguous.default,
            aten.dropout.default, aten.native_dropout.default, aten.mul.Tensor, aten.add.Tensor}


def _feeds_residual(node: fx.Node, from_inputs: set[fx.Node], depth: int = 6) -> bool:
    """Whether a region's summed output reaches the residual stream: an add of it (after a bias, a cast, a
    dropout) to another value computed from the inputs. A sum that feeds attention (keys and values one
    row-parallel product makes whole) stays an all-reduce: its readers split heads, and its gradient is a sum over
    tp that a split along the sequence would lose."""
    if depth == 0:
        return False
    for user in node.users:
        if user.target is aten.add.Tensor and any(isinstance(a, fx.Node) and a is not node and a in from_inputs
                                                  for a in user.args):
            return True
        if user.target in _THROUGH and _feeds_residual(user, from_inputs, depth - 1):
            return True
    return False


def _from_inputs(gm: fx.GraphModule) -> set[fx.Node]:
    """The values computed from the graph's inputs (activations; a bias or a position table is not one)."""
    found: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder" or any(n in found for n in node.all_input_nodes):
            found.add(node)
    return found


def _is_exit(node: fx.Node) -> bool:
    return node.op == "call_module" and isinstance(node.graph.owning_module.get_submodule(node.target),
                                                   ReduceScatterToSequence)


def _swap(gm: fx.GraphModule, node: fx.Node, module: torch.nn.Module) -> None:
    owner, _, attr = node.target.rpartition(".")
    setattr(gm.get_submodule(owner) if owner else gm, attr, module)


def _idle_entries(gm: fx.GraphModule) -> list[fx.Node]:
    """The f's tensor parallelism put where no gradient flows (see ``tensor_parallel_pass``'s ``mark_entries``)."""
    return [node for node in gm.graph.nodes if node.meta.get(IDLE_F)]


def _drop(gm: fx.GraphModule, entries: list[fx.Node]) -> None:
    """Once the sequence is gathered at them, these f's have nothing left to do (one fused into its gather is
    gone already)."""
    live = set(gm.graph.nodes)
    for node in entries:
        if node in live:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)


def _fuse_entries(gm: fx.GraphModule, group, size: int, rank: int) -> None:
    """A gather of the sequence then f: one all-gather whose backward reduce-scatters. An f whose input was
    whole already stays plain f."""
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or not isinstance(gm.get_submodule(node.target), _EntryMark):
            continue
        (x,) = node.args
        gather = gm.get_submodule(x.target) if x.op == "call_module" else None
        if type(gather) is GatherFromParallel and gather.blocks is None and len(x.users) == 1:
            _swap(gm, x, GatherSequenceToParallel(group=group, size=size, rank=rank, dim=gather.dim))
            node.replace_all_uses_with(x)
            gm.graph.erase_node(node)
        else:
            _swap(gm, node, CopyToParallel(group=group, size=size, rank=rank))
