"""``compile_rank``: from a captured graph and the job's plan to everything one rank of a mesh runs, as one object.

Terms: a *capture* (``capture.Captured``) is the model (and its loss, for training) as one fx graph at one
set of input shapes; the *job plan* (``job_plan.JobPlan``) is what the compiler decided for every rank at once
from that capture (tp and cp plans, sequence parallelism, pipeline cuts, spread weights); a *rank build*
(``RankBuild``) is what one rank runs of it: its *programs* (one per stage it runs; stage 0 without
pipelining), the stages, the parameters tied across pipeline ranks, the schedule, the input range checks, and
the notes and fallbacks a person should read.

``compile_rank(captured, plan, coords)`` is pure: it leaves the capture as it is (every program is built on a
copy), and it needs no process group (without groups the collectives it inserts print and count but cannot
run), so ``autoshard inspect`` builds any rank of any mesh in one process from one plan, and the runtime builds
its own rank with its groups. A later capture of the same model gets a plan made like the first one's
(``job_plan.plan_job(..., earlier=)``), so every capture places every parameter on the same rank.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from autoshard import batching, codegen, meta, schedules, spread_choice
from autoshard.capture import Captured, capture
from autoshard.certificate import Certificate, of_build
from autoshard.job_plan import JobPlan, holders_of, plan_job, spread_bytes, two_passes
from autoshard.layout import ParamLayout
from autoshard.mesh import Mesh, MeshGroups
from autoshard.options import CompileOptions
from autoshard.passes.axis import Axis, Outputs
from autoshard.passes.axis_pass import BatchSync, On, Sharding
from autoshard.passes.axis_passes import PLANNED
from autoshard.passes.context_parallel import PARTIAL_OUTPUT, ContextParallelPlan, check_divisible
from autoshard.passes.input_checks import InputChecks, input_checks
from autoshard.passes.loss import find_token_loss, sum_loss_pass, token_count_graph
from autoshard.passes.partition import Partition, partition
from autoshard.passes.pipeline_split import Stage, TensorSpec
from autoshard.passes.placements import R, Shard
from autoshard.passes.propagate import propagate, reaching_output, redistributions
from autoshard.passes.sharding import FALLBACKS
from autoshard.plan import TensorParallelPlan

aten = torch.ops.aten


@dataclass
class RankBuild:
    """What the compiler decided for the rank at ``coords`` of ``mesh`` from one capture."""

    captured: Captured
    plan: JobPlan  # the job's decisions this build was made from: its mesh, options, tp and cp plans
    coords: dict[str, int]
    programs: dict[int, codegen.RankProgram]  # this rank's programs, by stage (0 without pipelining)
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
    layouts: dict[str, ParamLayout] = field(default_factory=dict, repr=False, compare=False)  # by parameter, made once

    @property
    def mesh(self) -> Mesh:
        return self.plan.mesh

    @property
    def options(self) -> CompileOptions:
        return self.plan.options

    @property
    def tp_plan(self) -> TensorParallelPlan | None:
        return self.plan.tp_plan

    @property
    def cp_plan(self) -> ContextParallelPlan | None:
        return self.plan.cp_plan

    @property
    def rank(self) -> int:
        return self.mesh.rank_of(**self.coords)

    def tp_local_shape(self, name: str) -> tuple[int, ...]:
        """The shape of parameter ``name``'s tp shard (padded up to a multiple of tp, as the tp pass pads it)."""
        return self.layout(name).tp_shape()

    def stored_shape(self, name: str) -> tuple[int, ...]:
        """The shape this rank stores of parameter ``name`` between steps: its tp shard, or that shard's rows on this
        pp rank when the weight is spread over the pp ranks, or its ep rank's experts."""
        return self.layout(name).local_shape()

    def layout(self, name: str) -> ParamLayout:
        """How this rank holds parameter ``name`` (its name in the captured graphs), made once."""
        made = self.layouts
        if name not in made:
            tp_plan, ep_plan = self.tp_plan, self.plan.ep_plan
            placement = tp_plan.params[name].placement if tp_plan is not None and name in tp_plan.params else None
            experts = ep_plan.params().get(name, 0) if ep_plan is not None else 0
            holder = ep_plan.holders().get(name) if ep_plan is not None else None
            made[name] = ParamLayout.of(name, tuple(self.captured.gm.get_parameter(name).shape), self.mesh,
                                        placement, experts, name in self.spread, holder)
        return made[name]

    @property
    def largest_held_share(self) -> float:
        """Under pp: the most parameter bytes one pp rank stores, over the bytes of all the stages read."""
        return max(self.held_bytes) / self.read_bytes if self.read_bytes else 0.0

    @property
    def certificate(self) -> Certificate:
        """What this rank sends for its programs in a training step: each collective, its kind, group, dtype and
        elements (``autoshard.certificate.of_build``; a step adds the batch check, the loss's sums and the gradient
        sync: ``ParallelModel.certificate``)."""
        return of_build(self)

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
        gm = codegen.prepare(self.captured, self.plan.splits)  # without export's shape guards
        batch = next((s[0] for s in self.captured.input_shapes if isinstance(s, tuple) and s), None)
        seeds = {n.target: Shard(0) for n in gm.graph.nodes if n.op == "placeholder" and _leading_dim(n) == batch}
        prop = propagate(gm, seeds, Axis("dp", max(self.mesh.dp, 2), samples=True), outputs=Outputs.KEPT)
        if any(not _broadcast_over_batch(r) for r in redistributions(prop)):
            return None  # some op needs the whole batch: computing slices would be wrong
        output = next(n for n in gm.graph.nodes if n.op == "output")
        placements = [prop.of(leaf) if isinstance(leaf, fx.Node) else R for leaf in pytree.tree_leaves(output.args[0])]
        if any(p not in (R, Shard(0)) for p in placements):
            return None
        return [p == Shard(0) for p in placements]


def capture_for_training(model: nn.Module, inputs: tuple, target: torch.Tensor, loss_fn, *,
                         training: bool = True, outputs: bool = False) -> Captured:
    """The training capture (model and loss in one graph), its loss rewritten to a sum when it is a token mean; with
    ``outputs``, the inference graph at the same shapes too (``Captured.inference``, from the same export)."""
    captured = capture(model, inputs, loss_fn=loss_fn, example_target=target, training=training, outputs=outputs)
    _check_loss_trains(captured, model)

    def recapture(factor: int) -> Captured:
        batch = target.shape[0] if target.dim() else None
        grown = tuple(torch.cat([v] * factor) if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == batch
                      else v for v in (*inputs, target))
        # taken as the first one was (with its outputs split off, which drops what only they read): the same graph
        return capture(model, grown[:-1], loss_fn=loss_fn, example_target=grown[-1], training=training,
                       outputs=outputs)

    captured.recapture = recapture
    captured.token_loss = find_token_loss(captured.gm)
    if captured.token_loss is not None:
        captured.count_gm = token_count_graph(captured.gm, captured.token_loss)
        sum_loss_pass(captured.gm, captured.token_loss)
    return captured


def _local_batch(captured: Captured) -> int:
    """The batch size this capture holds (its first input's first dim)."""
    return next(s[0] for s in captured.input_shapes if isinstance(s, tuple) and s)


def compile_rank(captured: Captured, plan: JobPlan, coords: dict[str, int], *, groups: MeshGroups | None = None,
                 store: codegen.ParamStore | None = None) -> RankBuild:
    """Everything the rank at ``coords`` runs for ``captured`` under ``plan`` (made by ``job_plan.plan_job``)."""
    mesh = plan.mesh
    coords = {axis: coords.get(axis, 0) for axis in ("pp", "dp", "cp", "tp")}
    build = RankBuild(captured, plan, coords, programs={}, notes=list(plan.notes))
    sharding = sharding_of(plan, coords, groups, training=captured.with_loss,
                           batch=_local_batch(captured) if plan.batch_sums else 0)
    if mesh.pp == 1:
        build.programs = {0: codegen.build(captured, sharding, store=store, autocast=_autocast(build))}
    else:
        _pipeline(build, sharding, store)
    build.checks = input_checks(captured.gm)
    return build


def sharding_of(plan: JobPlan, coords: dict[str, int], groups: MeshGroups | None = None, *, training: bool = True,
                batch: int = 0) -> Sharding:
    """What the rank at ``coords`` applies of ``plan``: each axis's plan with its coordinate and group on the axis's
    mesh axis (None without ``groups``: a build that runs no collective). ``batch``: the local batch the capture
    holds."""
    mesh = plan.mesh

    def group(axis: str):
        return groups.group(axis) if groups is not None and getattr(mesh, axis) > 1 else None

    axes = {name: On(plan.axes[name], mesh.coord(axis.mesh_axis, coords), group(axis.mesh_axis))
            for name, axis in PLANNED.items() if plan.axes.get(name) is not None}
    dp = On(BatchSync(mesh.dp), coords["dp"], groups.group("dp") if groups is not None else None)
    if plan.batch_norm_sync:
        axes["batch norm"] = dp
    if plan.batch_sums:
        axes["batch statistics"] = dataclasses.replace(dp, plan=BatchSync(mesh.dp, batch, plan.batch_sizes))
    return Sharding(axes, training=training)


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
    notes = []
    if loss_fn is not None:
        captured = capture_for_training(model, values[:-1], values[-1], loss_fn, training=model.training)
        cut = two_passes(captured, mesh, options)
        if cut is not None:  # a loss coupling the samples: the second pass's build (``runtime.two_passes``)
            _, captured, passes = cut
            notes.append(passes.note)
    else:
        captured = capture(model, values, training=model.training)
    plan = plan_job(captured, mesh, options)
    plan.notes.extend(notes)
    return compile_rank(captured, plan, coords)


def _pipeline(build: RankBuild, sharding: Sharding, store: codegen.ParamStore | None) -> None:
    """This rank's stages of the plan's cuts, what each pp rank holds, and the schedule."""
    p, v, options, plan = build.mesh.pp, build.options.chunks, build.options, build.plan
    if plan.partition is not None:
        build.partition = plan.partition
    else:  # a plan read from JSON holds the cuts alone
        build.partition = partition(codegen.prepare(build.captured, plan.splits), build.num_stages,
                                    cut_after=plan.cut_after)
    placement = schedules.placement_of(options.schedule)
    mine = [s for s in range(build.num_stages) if schedules.stage_rank(s, p, placement) == build.coords["pp"]]
    autocast = _autocast(build)  # what crosses a cut has the dtype autocast gives it
    build.stages, build.programs, build.local_specs = codegen.build_stages(
        build.captured, sharding, build.partition.stage_of, build.num_stages, mine, store=store, autocast=autocast)
    holders = holders_of(build.stages, plan)
    nbytes = spread_bytes(build.captured, plan, holders)
    build.spread = plan.spread
    build.held_bytes = spread_choice.held_bytes(holders, nbytes, plan.spread, p)
    build.read_bytes, build.spread_bytes = float(sum(nbytes.values())), float(sum(nbytes[n] for n in build.spread))
    build.tied = {name: ranks for name, ranks in sorted(holders.items()) if len(ranks) > 1 and name not in build.spread}
    build.actions = schedules.schedule(options.schedule, p, options.microbatches, v)
    schedules.validate(build.actions, p, v, placement)


def _autocast(build: RankBuild) -> torch.dtype | None:
    """The dtype the training programs (and the first of two passes) run under autocast to, or None."""
    trains = build.captured.with_loss or build.captured.first_pass
    return torch.bfloat16 if build.options.mixed_precision == "bf16" and trains else None


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


def _leading_dim(node: fx.Node) -> int | None:
    val = meta.val(node)
    return val.shape[0] if isinstance(val, torch.Tensor) and val.dim() > 0 else None


def _broadcast_over_batch(redistribution) -> bool:
    """A replicated value that a batch slice needs sliced is harmless when it is an expand over the batch dim:
    every slice of it is the same (an attention mask broadcast to the batch, for example)."""
    value = redistribution.value
    if redistribution.src != R or redistribution.dst != Shard(0) or value.target is not torch.ops.aten.expand.default:
        return False
    source = meta.val(value.args[0])
    target = meta.val(value)
    return isinstance(source, torch.Tensor) and (source.dim() < target.dim() or source.shape[0] == 1)


def with_coords(build: RankBuild, coords: dict[str, int]) -> RankBuild:
    """The same capture compiled for another rank of the mesh under the same plan (without process groups)."""
    return compile_rank(build.captured, build.plan, coords)

