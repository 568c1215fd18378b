"""``compile_rank``: from a captured graph to everything one rank of a mesh runs, as one plain object.

Terms: a *capture* (``capture.Captured``) is the model (and its loss, for training) as one fx graph at one
set of input shapes; a *rank build* (``RankBuild``) is all that the compiler decided for one rank from one
capture: the tensor- and context-parallel plans, the pipeline partition and its stages, the rank's
*programs* (one per stage it runs; stage 0 without pipelining), the parameters tied across pipeline
ranks, the schedule, the input range checks, and the notes and fallbacks a person should read.

``compile_rank`` is pure: it needs no process group (without groups the collectives it inserts print and
count but cannot run), so ``autoshard inspect`` builds any rank of any mesh in one process, and the
runtime builds its own rank with its groups. A later capture of the same model (another input shape,
inference) is compiled ``like`` the first one: the same tp plan and the same pipeline cuts, so every
capture places every parameter on the same rank.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from autoshard import batching, codegen, meta, schedules, spread_choice
from autoshard.capture import Captured, capture
from autoshard.mesh import Mesh, MeshGroups
from autoshard.options import CompileOptions
from autoshard.passes.axis import Axis, Outputs
from autoshard.passes.context_parallel import (
    PARTIAL_OUTPUT,
    ContextParallelError,
    ContextParallelPlan,
    check_divisible,
    insert_splits,
    plan_context_parallel,
)
from autoshard.passes.input_checks import InputChecks, input_checks
from autoshard.passes.loss import find_token_loss, sum_loss_pass, token_count_graph
from autoshard.passes.partition import Partition, partition
from autoshard.passes.pipeline_split import Stage, TensorSpec
from autoshard.passes.placements import R, Shard
from autoshard.passes.propagate import propagate, reaching_output, redistributions
from autoshard.passes.sequence_parallel import SequenceParallelError
from autoshard.passes.sharding import FALLBACKS
from autoshard.passes.tensor_parallel import plan_tensor_parallel
from autoshard.plan import TensorParallelPlan

aten = torch.ops.aten


@dataclass
class RankBuild:
    """What the compiler decided for the rank at ``coords`` of ``mesh`` from one capture."""

    captured: Captured
    mesh: Mesh
    coords: dict[str, int]
    options: CompileOptions
    programs: dict[int, codegen.RankProgram]  # this rank's programs, by stage (0 without pipelining)
    tp_plan: TensorParallelPlan | None = None
    cp_plan: ContextParallelPlan | None = None
    partition: Partition | None = None
    stages: list[Stage] = field(default_factory=list)  # every stage, its specs at global shapes (empty without pp)
    local_specs: dict[int, tuple[list[TensorSpec], list[TensorSpec]]] = field(default_factory=dict)  # this rank's
    # stages: (received, sent) at the shapes this rank holds
    tied: dict[str, frozenset[int]] = field(default_factory=dict)  # parameter -> the pp coordinates that read it
    spread: tuple[str, ...] = ()  # parameters stored in rows over the pp ranks, gathered for each step
    held_bytes: list[float] = field(default_factory=list)  # parameter bytes each pp rank stores (tp shards)
    read_bytes: float = 0.0  # the bytes of every parameter the stages read (tp shards), each counted once
    spread_bytes: float = 0.0  # the bytes of the spread weights, whole (tp shards)
    actions: schedules.Schedule | None = None
    checks: InputChecks | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def rank(self) -> int:
        return self.mesh.rank_of(**self.coords)

    def tp_local_shape(self, name: str) -> tuple[int, ...]:
        """The shape of parameter ``name``'s tp shard (padded up to a multiple of tp, as the tp pass pads it)."""
        plan = self.tp_plan
        placement = plan.params[name].placement if plan is not None and name in plan.params else None
        shape = list(self.captured.gm.get_parameter(name).shape)
        if isinstance(placement, Shard) and self.mesh.tp > 1:
            shape[placement.dim] = -(-shape[placement.dim] // self.mesh.tp)
        return tuple(shape)

    def stored_shape(self, name: str) -> tuple[int, ...]:
        """The shape this rank stores of parameter ``name`` between steps: its tp shard, or that shard's rows on this
        pp rank when the weight is spread over the pp ranks."""
        shape = self.tp_local_shape(name)
        if name in self.spread:
            return (shape[0] // self.mesh.pp, *shape[1:])
        return shape

    @property
    def largest_held_share(self) -> float:
        """Under pp: the most parameter bytes one pp rank stores, over the bytes of all the stages read."""
        return max(self.held_bytes) / self.read_bytes if self.read_bytes else 0.0

    @property
    def training(self) -> bool:
        return self.captured.with_loss

    @property
    def program(self) -> codegen.RankProgram:
        """The first program of this rank (its only one without pipelining)."""
        return self.programs[min(self.programs)]

    @property
    def num_stages(self) -> int:
        return self.mesh.pp * self.options.chunks if self.mesh.pp > 1 else 1

    @property
    def fallbacks(self) -> list[str]:
        return [note for program in self.programs.values() for note in program.gm.meta.get(FALLBACKS, [])]

    @property
    def cp_copies(self) -> int:
        """How many cp ranks hold the whole loss (1 when each holds a partial sum of it)."""
        if self.mesh.cp == 1:
            return 1
        last = self.programs.get(self.num_stages - 1) if self.mesh.pp > 1 else self.program
        if last is None:  # a pipeline rank without the last stage computes no loss
            return 1
        return 1 if last.gm.meta.get(PARTIAL_OUTPUT, False) else self.mesh.cp

    def placeholder_names(self) -> list[str]:
        return [n.target for n in self.captured.gm.graph.nodes if n.op == "placeholder"]

    def sequence_dims(self) -> dict[int, int]:
        """The position of every input cp splits, and its sequence dim."""
        if self.cp_plan is None:
            return {}
        names = self.placeholder_names()
        return {names.index(name): dim for name, dim in self.cp_plan.inputs.items() if name in names}

    def check_sequence(self, values: tuple) -> None:
        """Refuse, on every rank alike and before any collective, a sequence the cp ranks cannot split."""
        for position, dim in self.sequence_dims().items():
            value = values[position] if position < len(values) else None
            if isinstance(value, torch.Tensor) and value.dim() > dim:
                check_divisible(dataclasses.replace(self.cp_plan, seq_len=value.shape[dim]))

    def check_data(self, values: tuple) -> None:
        """Refuse ids and targets outside the vocabulary, on every rank alike, before any collective.

        ``values`` is what this rank was given (the global batch, or its own slice with ``local_batch``); the
        checks run on every microbatch-sized piece of it, as the capture is at the microbatch's shape.
        """
        if not self.checks.checks:
            return
        batch = batching.batch_size(values)
        size = next((s[0] for s in self.captured.input_shapes if isinstance(s, tuple) and s), None)
        parts = batch // size if batch and size and batch % size == 0 else 1
        for piece in batching.split(values, parts):
            self.checks.run(*piece)

    def local_inputs(self, args: tuple) -> tuple:
        """This cp rank's tokens of the sequence-split inputs (all of every other input)."""
        if self.cp_plan is None:
            return args
        index = self.cp_plan.positions(self.coords["cp"])
        return tuple(a.index_select(self.cp_plan.inputs[name], index.to(a.device)) if name in self.cp_plan.inputs
                     else a for name, a in zip(self.placeholder_names(), args, strict=True))

    @functools.cached_property
    def batched_outputs(self) -> list[bool] | None:
        """For each flat output of an inference capture: whether it carries the capture's batch along dim 0 (so
        dp ranks may compute slices of a batch and gather them). None when an op mixes the batch."""
        gm = codegen.prepare(self.captured)  # without export's shape guards (they read every input)
        batch = next((s[0] for s in self.captured.input_shapes if isinstance(s, tuple) and s), None)
        seeds = {n.target: Shard(0) for n in gm.graph.nodes if n.op == "placeholder" and _leading_dim(n) == batch}
        prop = propagate(gm, seeds, Axis("dp", max(self.mesh.dp, 2)), outputs=Outputs.KEPT)
        if any(not _broadcast_over_batch(r) for r in redistributions(prop)):
            return None  # some op needs the whole batch: computing slices would be wrong
        output = next(n for n in gm.graph.nodes if n.op == "output")
        placements = [prop.of(leaf) if isinstance(leaf, fx.Node) else R for leaf in pytree.tree_leaves(output.args[0])]
        if any(p not in (R, Shard(0)) for p in placements):
            return None
        return [p == Shard(0) for p in placements]

    def trained_parameters(self) -> set[str]:
        """The parameters (by name in the capture) from which a differentiable path reaches the loss."""
        return {n.target for n in reaching_output(self.program.gm) if n.op == "get_attr"}


def capture_for_training(model: nn.Module, inputs: tuple, target: torch.Tensor, loss_fn, *,
                         training: bool = True) -> Captured:
    """The training capture (model and loss in one graph), its loss rewritten to a sum when it is a token mean."""
    captured = capture(model, inputs, loss_fn=loss_fn, example_target=target, training=training)
    _check_loss_trains(captured, model)
    captured.token_loss = find_token_loss(captured.gm)
    if captured.token_loss is not None:
        captured.count_gm = token_count_graph(captured.gm, captured.token_loss)
        sum_loss_pass(captured.gm, captured.token_loss)
    return captured


def compile_rank(captured: Captured, mesh: Mesh, coords: dict[str, int], options: CompileOptions, *,
                 like: RankBuild | None = None, groups: MeshGroups | None = None,
                 store: codegen.ParamStore | None = None) -> RankBuild:
    """Everything the rank at ``coords`` runs for ``captured``; ``like`` is the model's first build, if any."""
    coords = {axis: coords.get(axis, 0) for axis in ("pp", "dp", "cp", "tp")}
    build = RankBuild(captured, mesh, coords, options, programs={})
    syncs = _check_batch_norm(captured, mesh, options, build.notes if like is None else [])
    build.tp_plan = _tp_plan(captured, mesh, options, like, build.notes)
    build.cp_plan = _cp_plan(captured, mesh, options, like)
    if build.cp_plan is not None and build.cp_plan.note and like is None:
        build.notes.append(build.cp_plan.note)
    sharding = codegen.Sharding(
        tp_plan=build.tp_plan, tp_rank=coords["tp"], cp_plan=build.cp_plan, cp_rank=coords["cp"],
        sp_plan=_sp_plan(captured, mesh, options, build.notes if like is None else []),
        tp_group=groups.group("tp") if groups is not None and mesh.tp > 1 else None,
        cp_group=groups.group("cp") if groups is not None and mesh.cp > 1 else None,
        training=captured.with_loss,
        batch_norm=(mesh.dp, coords["dp"], groups.group("dp") if groups is not None else None) if syncs else None,
    )
    try:
        _programs(build, sharding, like, store)
    except SequenceParallelError as e:  # found on the sharded graph (a split value the model detaches, ...)
        if options.sequence_parallel != "auto" or sharding.sp_plan is None:
            raise
        if like is None:
            build.notes.append(f"sequence_parallel='auto' leaves sequence parallelism off: {e}")
        _programs(build, dataclasses.replace(sharding, sp_plan=None), like, store)
    build.checks = input_checks(captured.gm)
    return build


def _programs(build: RankBuild, sharding: codegen.Sharding, like: RankBuild | None,
              store: codegen.ParamStore | None) -> None:
    if build.mesh.pp == 1:
        build.programs = {0: codegen.build(build.captured, sharding, store=store)}
    else:
        _pipeline(build, sharding, like, store)


def compile_global_batch(model: nn.Module, inputs: tuple, mesh: Mesh, rank: int, options: CompileOptions, *,
                         target: torch.Tensor | None = None, loss_fn=None) -> RankBuild:
    """Rank ``rank``'s build from a global batch (its dp slice, its first microbatch), without processes: what
    ``parallelize`` compiles on that rank. With ``loss_fn`` and ``target`` the training graph, else inference."""
    options.check_mesh(mesh)
    coords = mesh.coords(rank)
    values = (*inputs, target) if loss_fn is not None else inputs
    batching.check(batching.batch_size(inputs), microbatches=options.microbatches, dp=mesh.dp, local=False)
    if mesh.dp > 1:
        values = batching.split(values, mesh.dp)[coords["dp"]]
    values = batching.split(values, options.microbatches)[0]
    if loss_fn is not None:
        captured = capture_for_training(model, values[:-1], values[-1], loss_fn, training=model.training)
    else:
        captured = capture(model, values, training=model.training)
    return compile_rank(captured, mesh, coords, options)


def _tp_plan(captured: Captured, mesh: Mesh, options: CompileOptions, like: RankBuild | None,
             notes: list[str]) -> TensorParallelPlan | None:
    if mesh.tp == 1:
        return None
    if like is not None:
        return like.tp_plan
    plan = options.tp_plan or plan_tensor_parallel(captured.gm, mesh.tp, indivisible=options.tp_indivisible)
    if all(not isinstance(p.placement, Shard) for p in plan.params.values()):
        notes.append(f"no block to split over tp={mesh.tp} was found (no column -> row pattern, no vocab-parallel "
                     "embedding): the tp ranks run the model replicated")
    else:
        notes.extend(_replicated_weights(captured, plan, mesh.tp))
    return plan


def _replicated_weights(captured: Captured, plan: TensorParallelPlan, tp: int, share: float = 0.01) -> list[str]:
    """A note naming every matrix (or stack of expert matrices) of more than ``share`` of the parameters that tp left
    replicated: each tp rank holds it whole, which is the memory tp exists to save."""
    params = dict(captured.gm.named_parameters())
    total = sum(p.numel() for p in params.values())
    found = [(name, p.numel() / total) for name, p in params.items()
             if p.dim() >= 2 and p.numel() > share * total and plan.params.get(name) is not None
             and plan.params[name].role == "replicated"]
    if not found:
        return []
    found.sort(key=lambda item: -item[1])
    named = "; ".join(f"{captured.names.get(name, [name])[0]} ({part:.1%}): {plan.params[name].reason}"
                      for name, part in found[:4])
    more = f"; and {len(found) - 4} more" if len(found) > 4 else ""
    return [f"{len(found)} weight(s) holding {sum(part for _, part in found):.0%} of the parameters stay replicated "
            f"under tp={tp} (every tp rank holds them whole): {named}{more}"]


def _sp_plan(captured: Captured, mesh: Mesh, options: CompileOptions, notes: list[str]) -> ContextParallelPlan | None:
    """Where sequence parallelism splits the sequence over tp (found as context parallelism finds it). Under
    ``"auto"``, none where it does not apply, with a note saying why."""
    if not options.sequence_parallel or mesh.tp == 1:
        return None
    try:
        return _sequence(captured, mesh)
    except SequenceParallelError as e:
        if options.sequence_parallel != "auto":
            raise
        notes.append(f"sequence_parallel='auto' leaves sequence parallelism off: {e}")
        return None


def _sequence(captured: Captured, mesh: Mesh) -> ContextParallelPlan:
    try:
        plan = plan_context_parallel(captured.gm, mesh.tp, attention="gather")
    except ContextParallelError as e:
        raise SequenceParallelError(f"sequence parallelism splits the sequence over tp and could not find it: {e}; "
                                    "use sequence_parallel=False") from e
    if mesh.cp > 1 and plan.seq_len % (mesh.cp * mesh.tp):
        raise SequenceParallelError(
            f"under context parallelism, sequence parallelism splits each cp rank's tokens over tp: the sequence of "
            f"{plan.seq_len} tokens must divide by cp x tp = {mesh.cp * mesh.tp}: pad it to a multiple, or use "
            "sequence_parallel=False")
    return plan


def _cp_plan(captured: Captured, mesh: Mesh, options: CompileOptions,
             like: RankBuild | None) -> ContextParallelPlan | None:
    """The first capture's cp plan when this capture's sequence is as long, else a plan of its own."""
    if mesh.cp == 1:
        return None
    plan = like.cp_plan if like is not None else None
    if plan is not None:
        names = [n.target for n in captured.gm.graph.nodes if n.op == "placeholder"]
        present = [(name, dim) for name, dim in plan.inputs.items() if name in names]
        if all(captured.input_shapes[names.index(name)][dim] == plan.seq_len for name, dim in present):
            insert_splits(captured.gm, plan.values)
            return plan  # the same sequence length (an inference capture, whose inputs are named otherwise, too)
    plan = plan_context_parallel(captured.gm, mesh.cp, load_balance=options.cp_load_balance,
                                 attention=options.cp_attention, tp=mesh.tp)
    if not plan.even and mesh.pp > 1:
        raise ContextParallelError(
            f"the sequence of {plan.seq_len} tokens does not split evenly over cp={mesh.cp} "
            f"({plan.parts} chunks), and pipeline stages need every cp rank to hand on as many tokens: with pp > 1 "
            f"use a cp degree that divides {plan.seq_len} (or pad the sequence)")
    insert_splits(captured.gm, plan.values)  # a split that starts inside the graph (an image's patch tokens)
    return plan


def _pipeline(build: RankBuild, sharding: codegen.Sharding, like: RankBuild | None,
              store: codegen.ParamStore | None) -> None:
    """Cut the capture into stages (after the same nodes as ``like``) and build this rank's."""
    p, v, options = build.mesh.pp, build.options.chunks, build.options
    gm = codegen.prepare(build.captured)
    if like is None:
        build.partition = partition(gm, build.num_stages, starts=options.pipeline_starts,
                                    balance=options.pipeline_balance,
                                    v_shape=schedules.placement_of(options.schedule) == "v")
    else:
        build.partition = partition(gm, build.num_stages, cut_after=like.partition.cut_after)
    placement = schedules.placement_of(options.schedule)
    mine = [s for s in range(build.num_stages) if schedules.rank_of(s, p, placement) == build.coords["pp"]]
    build.stages, build.programs, build.local_specs = codegen.build_stages(
        build.captured, sharding, build.partition.stage_of, build.num_stages, mine, store=store,
        autocast=torch.bfloat16 if options.mixed_precision == "bf16" and build.captured.with_loss else None)
    holders: dict[str, set[int]] = {}
    for stage in build.stages:
        for name in stage.parameters:
            holders.setdefault(name, set()).add(schedules.rank_of(stage.index, p, placement))
    holders = {name: frozenset(ranks) for name, ranks in holders.items()}
    build.spread, build.held_bytes, nbytes = _spread(build, holders, like.spread if like else None)
    build.read_bytes, build.spread_bytes = float(sum(nbytes.values())), float(sum(nbytes[n] for n in build.spread))
    build.tied = {name: ranks for name, ranks in sorted(holders.items()) if len(ranks) > 1 and name not in build.spread}
    build.actions = schedules.schedule(options.schedule, p, options.microbatches, v)
    schedules.validate(build.actions, p, v, placement)


def _spread(build: RankBuild, holders: dict[str, frozenset[int]],
            chosen: tuple[str, ...] | None) -> tuple[tuple[str, ...], list[float], dict[str, int]]:
    """The weights to store in rows over the pp ranks (``runtime.spread``; ``chosen`` when an earlier capture chose
    them; none under FSDP2, which shards them over dp x cp already), the parameter bytes each pp rank stores, and
    each parameter's bytes on a rank (its tp shard)."""
    nbytes, rows = {}, {}
    for name in holders:
        shape = build.tp_local_shape(name)
        nbytes[name] = math.prod(shape) * build.captured.gm.get_parameter(name).element_size()
        rows[name] = shape[0] if shape else 0
    p = build.mesh.pp
    if chosen is None:
        chosen = () if build.options.data_parallel == "fsdp" else spread_choice.choose(
            holders, nbytes, rows, p, balance=build.options.pipeline_balance != "time")
    return chosen, spread_choice.held_bytes(holders, nbytes, chosen, p), nbytes


def _check_loss_trains(captured: Captured, model: nn.Module) -> None:
    """Refuse, on every rank alike and before any collective, a captured loss that no trainable parameter reaches."""
    trainable = {name for name, p in captured.gm.named_parameters() if p.requires_grad}
    if trainable and not any(n.op == "get_attr" and n.target in trainable for n in reaching_output(captured.gm)):
        raise ValueError(
            f"the captured graph of {type(model).__name__} computes a loss that does not depend on its parameters, "
            "although the model's does: a part of the model hides its computation from the capture (a custom "
            "autograd Function that runs its forward without gradients and recomputes in backward, such as "
            "reversible layers), so autoshard cannot train it; replace that part by plain modules"
        )


_BATCH_NORMS = {aten.batch_norm.default: 5, aten.native_batch_norm.default: 5, aten._native_batch_norm_legit.default: 5,
                aten._native_batch_norm_legit_functional.default: 5}  # op -> position of ``training``


def _check_batch_norm(captured: Captured, mesh: Mesh, options: CompileOptions, notes: list[str]) -> bool:
    """A BatchNorm in training mode normalises with the statistics of the batch it sees. Under dp with
    ``batch_norm="unsharded"`` they are computed over the dp group (``passes.batch_norm``: whether to, returned).
    Where a microbatch or a cp or sp rank sees part of the batch no rank can compute them: refused before any
    collective, naming the layers and what works, or said once (``"local"``)."""
    found = [n for n in captured.gm.graph.nodes if n.op == "call_function" and n.target in _BATCH_NORMS
             and len(n.args) > _BATCH_NORMS[n.target] and n.args[_BATCH_NORMS[n.target]] is True]
    layers = sorted({meta.module_path(n).removeprefix("model.") or n.name for n in found})
    syncs = options.batch_norm == "unsharded" and all(n.target is aten.batch_norm.default for n in found)
    parts = [why for why, on in (
        (f"dp={mesh.dp} gives each rank 1/{mesh.dp} of the batch", mesh.dp > 1 and not syncs),
        (f"cp={mesh.cp} gives each rank 1/{mesh.cp} of the sequence", mesh.cp > 1),
        (f"microbatches={options.microbatches} normalise each microbatch alone (a microbatch cannot pass the "
         "layer before every microbatch of the step has reached it)", options.microbatches > 1),
        (f"sequence parallelism gives each tp rank 1/{mesh.tp} of the tokens",
         mesh.tp > 1 and options.sequence_parallel is True),
    ) if on]
    if not layers:
        return False
    shown = ", ".join(layers[:6]) + (f" and {len(layers) - 6} more" if len(layers) > 6 else "")
    if options.batch_norm == "local":
        if parts:
            notes.append(f"BatchNorm in training mode ({shown}) keeps each rank's and each microbatch's own "
                         f"statistics (batch_norm='local'): {'; '.join(parts)}, so it normalises otherwise than the "
                         "model run whole")
        return False
    if parts:
        raise ValueError(
            f"BatchNorm in training mode ({shown}) normalises with the statistics of the batch it sees, and here "
            f"{'; '.join(parts)}: the training would differ from the model run whole. Run it with cp=1 and one "
            "microbatch (dp sums the statistics over its ranks; tp and pp keep the whole batch), put the BatchNorm "
            "layers in eval mode, or pass batch_norm='local' to keep each rank's own statistics as DDP does")
    if mesh.dp > 1:
        notes.append(f"BatchNorm in training mode ({shown}) computes the whole batch's statistics over the "
                     f"{mesh.dp} dp ranks (one all-gather of each layer's per-channel statistics, as SyncBatchNorm)")
        return True
    return False


def _leading_dim(node: fx.Node) -> int | None:
    val = node.meta.get("val")
    return val.shape[0] if isinstance(val, torch.Tensor) and val.dim() > 0 else None


def _broadcast_over_batch(redistribution) -> bool:
    """A replicated value that a batch slice needs sliced is harmless when it is an expand over the batch dim:
    every slice of it is the same (an attention mask broadcast to the batch, for example)."""
    value = redistribution.value
    if redistribution.src != R or redistribution.dst != Shard(0) or value.target is not torch.ops.aten.expand.default:
        return False
    source = value.args[0].meta.get("val")
    target = value.meta.get("val")
    return isinstance(source, torch.Tensor) and (source.dim() < target.dim() or source.shape[0] == 1)


def with_coords(build: RankBuild, coords: dict[str, int]) -> RankBuild:
    """The same capture compiled for another rank of the mesh (without process groups)."""
    return compile_rank(build.captured, build.mesh, coords, build.options, like=build)

