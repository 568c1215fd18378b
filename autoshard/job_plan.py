"""The job plan: what the compiler decides for a whole job, made once and read by every rank's build.

A ``JobPlan`` holds, for one capture of the model, the decisions every rank shares: the tensor-parallel plan,
where context parallelism splits the sequence, where sequence parallelism does (``None`` when it is off:
``sequence_parallel="auto"`` is settled here and nowhere else), where the pipeline is cut, which weights are
spread over the pp ranks, whether BatchNorm sums its statistics over dp, and the notes a person should read.
Each rank's build is then a pure function of (capture, plan, coordinates): ``compile.compile_rank``.

A later capture of the same model (another input shape, inference) is planned from the first one's plan
(``earlier``): the same tp plan, cuts and spread weights, so every capture places every parameter on the same
rank; its cp plan is the first one's when its sequence is as long, else its own.

A plan prints, and round-trips through JSON (``to_json``, ``from_json``), so ``autoshard inspect`` and a running
job can be compared by it.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from autoshard import codegen, meta, schedules, spread_choice
from autoshard.capture import Captured
from autoshard.layout import ParamLayout
from autoshard.mesh import Mesh
from autoshard.options import CompileOptions
from autoshard.passes.axis_passes import PLANNED
from autoshard.passes.context_parallel import ContextParallelError, ContextParallelPlan, plan_context_parallel
from autoshard.passes.expert_parallel import ExpertParallelPlan, plan_expert_parallel
from autoshard.passes.partition import Partition, partition
from autoshard.passes.pipeline_split import split_pipeline
from autoshard.passes.placements import Shard
from autoshard.passes.sequence_parallel import SequenceParallelError, SequenceParallelPlan, check_applies
from autoshard.passes.tensor_parallel import plan_tensor_parallel, tensor_parallel_pass
from autoshard.plan import TensorParallelPlan

aten = torch.ops.aten


def _axis(name: str, doc: str) -> property:
    def get(plan: JobPlan):
        return plan.axes.get(name)

    def put(plan: JobPlan, value) -> None:
        if value is None:
            plan.axes.pop(name, None)
        else:
            plan.axes[name] = value

    return property(get, put, doc=doc)


@dataclass
class JobPlan:
    """The decisions of a whole job for one capture (see the module docstring).

    ``axes``: each sharding axis's plan by name (the codec of its ``AxisPass`` in ``passes.axis_passes.PLANNED``
    says how each is written and read back); ``tp_plan``, ``cp_plan``, ``sp_plan`` and ``ep_plan`` read and set
    them."""

    mesh: Mesh
    options: CompileOptions
    axes: dict[str, Any] = field(default_factory=dict)
    cut_after: tuple[str, ...] | None = None  # under pp: the last activation of every stage but the last
    spread: tuple[str, ...] = ()  # weights stored in rows over the pp ranks, gathered for each step
    batch_norm_sync: bool = False  # BatchNorm in training mode sums its statistics over the dp ranks
    batch_sums: bool = False  # the loss's whole-batch statistics are summed over the dp ranks (passes.batch_statistics)
    batch_sizes: dict[str, list] = field(default_factory=dict)  # numbers that are sizes of the batch, by node
    loss_sum: bool = False  # the loss is a sum over the batch's samples: the parts' losses are added, not averaged
    notes: list[str] = field(default_factory=list)
    partition: Partition | None = field(default=None, compare=False, repr=False)  # the cuts' costs (not in JSON)

    tp_plan = _axis("tp", "tensor parallelism's plan")
    cp_plan = _axis("cp", "context parallelism's plan")
    sp_plan = _axis("sp", "where sequence parallelism splits the sequence over tp")
    ep_plan = _axis("ep", "the experts split over ep (the mesh's ep > 1)")

    @property
    def splits(self) -> dict[str, int]:
        """Nodes after which cp's split starts inside the graph (an image's patch tokens), by name -> dim."""
        return dict(self.cp_plan.values) if self.cp_plan is not None else {}

    def to_json(self) -> str:
        options = {f.name: getattr(self.options, f.name) for f in dataclasses.fields(self.options)}
        options["timeout"] = options["timeout"].total_seconds()
        options["tp_plan"] = options["tp_plan"] is not None  # the plan given is the tp plan below
        options = {k: (str(v) if hasattr(v, "value") else list(v) if isinstance(v, tuple) else v)
                   for k, v in options.items()}
        axes = {f"{name}_plan": axis.codec.encode(self.axes[name]) if name in self.axes else None
                for name, axis in PLANNED.items()}
        return json.dumps({
            "mesh": dataclasses.asdict(self.mesh), "options": options, **axes,
            "cut_after": list(self.cut_after) if self.cut_after is not None else None,
            "spread": list(self.spread), "batch_norm_sync": self.batch_norm_sync, "batch_sums": self.batch_sums,
            "batch_sizes": self.batch_sizes, "loss_sum": self.loss_sum,
            "notes": self.notes,
        }, indent=1)

    @classmethod
    def from_json(cls, text: str) -> JobPlan:
        data = json.loads(text)
        axes = {name: axis.codec.decode(data[f"{name}_plan"]) for name, axis in PLANNED.items()
                if data.get(f"{name}_plan")}
        options = dict(data["options"], timeout=datetime.timedelta(seconds=data["options"]["timeout"]))
        options["tp_plan"] = axes.get("tp") if options["tp_plan"] else None
        return cls(Mesh(**data["mesh"]), CompileOptions(**options), axes=axes,
                   cut_after=tuple(data["cut_after"]) if data["cut_after"] is not None else None,
                   spread=tuple(data["spread"]), batch_norm_sync=data["batch_norm_sync"],
                   batch_sums=data.get("batch_sums", False),
                   batch_sizes={k: [tuple(e) for e in v] for k, v in data.get("batch_sizes", {}).items()},
                   loss_sum=data.get("loss_sum", False),
                   notes=list(data["notes"]))

    def __str__(self) -> str:
        lines = [f"job plan for {self.mesh}:"]
        lines += [f"  {name}: {axis.codec.describe(self.axes[name])}" for name, axis in PLANNED.items()
                  if name in self.axes]
        if self.cut_after is not None:
            lines.append(f"  pp: cuts after {', '.join(self.cut_after)}")
        if self.spread:
            lines.append(f"  spread over pp: {', '.join(self.spread)}")
        if self.batch_norm_sync:
            lines.append("  BatchNorm statistics summed over dp")
        if self.batch_sums:
            lines.append("  the loss's whole-batch statistics summed over dp")
        if self.loss_sum:
            lines.append("  the loss is a sum over the batch's samples: the parts' losses are added")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def plan_job(captured: Captured, mesh: Mesh, options: CompileOptions, *, earlier: JobPlan | None = None) -> JobPlan:
    """The decisions for ``captured`` on ``mesh``, or for a later capture of the same model like ``earlier``.

    Refusals (BatchNorm where no rank sees the batch, a sequence that cannot split, ...) are raised here, alike on
    every rank and before any collective. Notes are made for the first capture only."""
    notes: list[str] = []
    plan = JobPlan(mesh, options, batch_norm_sync=check_batch_norm(captured, mesh, options, notes))
    if earlier is None:
        plan.batch_sums, plan.batch_sizes, plan.loss_sum = check_batch_split(captured, mesh, options, notes)
    elif earlier.batch_sums or earlier.loss_sum:  # a later capture (another shape): its own sizes of the batch
        plan.batch_sums, plan.batch_sizes, plan.loss_sum = check_batch_split(captured, mesh, options, None)
    plan.tp_plan = earlier.tp_plan if earlier is not None else _tp_plan(captured, mesh, options, notes)
    plan.cp_plan = _cp_plan(captured, mesh, options, earlier.cp_plan if earlier is not None else None)
    if plan.cp_plan is not None and plan.cp_plan.note and earlier is None:
        notes.append(plan.cp_plan.note)
    plan.sp_plan = _sp_plan(captured, plan, notes)
    if mesh.ep > 1:
        plan.ep_plan = _ep_plan(captured, mesh, earlier.ep_plan if earlier is not None else None)
        plan.ep_plan.capacity = options.expert_capacity
        if options.expert_capacity is not None and plan.ep_plan.lists:
            raise ValueError(f"expert_capacity drops rows of experts held as stacks only, and the experts at "
                             f"{plan.ep_plan.lists[0].where} are modules of a list (every row reaches them): leave "
                             "expert_capacity unset for this model")
        notes.extend(plan.ep_plan.notes)
    if mesh.pp > 1:
        _pipeline(captured, plan, earlier)
    if plan.sp_plan is not None and options.sequence_parallel == "auto":
        _settle_sequence_parallel(captured, plan, notes)
    plan.notes = notes if earlier is None else []  # said once, for the first capture
    return plan


def tp_shape(captured: Captured, plan: JobPlan, name: str) -> tuple[int, ...]:
    """The shape of parameter ``name``'s tp part under ``plan``, from its layout (before any build exists)."""
    tp = plan.tp_plan
    placement = tp.params[name].placement if tp is not None and name in tp.params else None
    return ParamLayout.of(name, captured.gm.get_parameter(name).shape, plan.mesh, placement, 0, False).tp_shape()


def spread_bytes(captured: Captured, plan: JobPlan, holders: dict[str, frozenset[int]]) -> dict[str, int]:
    """The bytes of each held parameter on one rank (its tp shard)."""
    return {name: math.prod(tp_shape(captured, plan, name))
            * captured.gm.get_parameter(name).element_size() for name in holders}


def holders_of(stages: list, plan: JobPlan) -> dict[str, frozenset[int]]:
    """Each parameter the stages read -> the pp ranks whose stages read it."""
    placement = schedules.placement_of(plan.options.schedule)
    holders: dict[str, set[int]] = {}
    for stage in stages:
        for name in stage.parameters:
            holders.setdefault(name, set()).add(schedules.stage_rank(stage.index, plan.mesh.pp, placement))
    return {name: frozenset(ranks) for name, ranks in holders.items()}


# ------------------------------------------------------------------------------------------ the decisions


def _tp_plan(captured: Captured, mesh: Mesh, options: CompileOptions, notes: list[str]) -> TensorParallelPlan | None:
    if mesh.tp == 1:
        return None
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


def _ep_plan(captured: Captured, mesh: Mesh, earlier: ExpertParallelPlan | None) -> ExpertParallelPlan:
    """This capture's expert layers (node names differ between captures); the experts they split must be the
    first capture's, as every capture reads the parameters one store holds."""
    plan = plan_expert_parallel(captured.gm, mesh.ep, lists=mesh.tp == 1 and mesh.pp == 1)
    if earlier is not None and (plan.params() != earlier.params() or plan.holders() != earlier.holders()):
        differ = sorted(set(plan.params()) ^ set(earlier.params()) | set(plan.holders()) ^ set(earlier.holders()))
        raise ValueError(f"the capture at input shapes {captured.input_shapes} splits other experts over ep than the "
                         f"first capture ({', '.join(differ[:3])}): every capture must read the same stacks of "
                         "experts the same way; use ep=1 for this model")
    return plan


def _cp_plan(captured: Captured, mesh: Mesh, options: CompileOptions,
             earlier: ContextParallelPlan | None) -> ContextParallelPlan | None:
    """The first capture's cp plan when this capture's sequence is as long, else a plan of its own."""
    if mesh.cp == 1:
        return None
    if earlier is not None:
        names = [n.target for n in captured.gm.graph.nodes if n.op == "placeholder"]
        present = [(name, dim) for name, dim in earlier.inputs.items() if name in names]
        if all(captured.input_shapes[names.index(name)][dim] == earlier.seq_len for name, dim in present):
            return earlier  # the same sequence length (an inference capture, whose inputs are named otherwise, too)
    plan = plan_context_parallel(captured.gm, mesh.cp, load_balance=options.cp_load_balance,
                                 attention=options.cp_attention, tp=mesh.tp)
    if not plan.even and mesh.pp > 1:
        raise ContextParallelError(
            f"the sequence of {plan.seq_len} tokens does not split evenly over cp={mesh.cp} "
            f"({plan.parts} chunks), and pipeline stages need every cp rank to hand on as many tokens: with pp > 1 "
            f"use a cp degree that divides {plan.seq_len} (or pad the sequence)")
    return plan


def _sp_plan(captured: Captured, plan: JobPlan, notes: list[str]) -> SequenceParallelPlan | None:
    """Where sequence parallelism splits the sequence over tp (found as context parallelism finds it, on the graph
    with cp's splits in it). Under ``"auto"``, none where it does not apply, with a note saying why."""
    mesh, options = plan.mesh, plan.options
    if not options.sequence_parallel or mesh.tp == 1:
        return None
    gm = codegen.prepare(captured, plan.splits) if plan.splits else captured.gm
    try:
        return _sequence(gm, mesh)
    except SequenceParallelError as e:
        if options.sequence_parallel != "auto":
            raise
        notes.append(_SP_OFF + str(e))
        return None


def _sequence(gm, mesh: Mesh) -> SequenceParallelPlan:
    try:
        plan = plan_context_parallel(gm, mesh.tp, attention="gather")
    except ContextParallelError as e:
        raise SequenceParallelError(f"sequence parallelism splits the sequence over tp and could not find it: {e}; "
                                    "use sequence_parallel=False") from e
    if mesh.cp > 1 and plan.seq_len % (mesh.cp * mesh.tp):
        raise SequenceParallelError(
            f"under context parallelism, sequence parallelism splits each cp rank's tokens over tp: the sequence of "
            f"{plan.seq_len} tokens must divide by cp x tp = {mesh.cp * mesh.tp}: pad it to a multiple, or use "
            "sequence_parallel=False")
    return SequenceParallelPlan.found(plan)


def _pipeline(captured: Captured, plan: JobPlan, earlier: JobPlan | None) -> None:
    """The cuts (the first capture's, repeated on a later one) and the weights spread over the pp ranks."""
    options = plan.options
    gm = codegen.prepare(captured, plan.splits)
    stages = plan.mesh.pp * options.chunks
    if earlier is None:
        plan.partition = partition(gm, stages, starts=options.pipeline_starts, balance=options.pipeline_balance,
                                   v_shape=schedules.placement_of(options.schedule) == "v")
    else:
        plan.partition = partition(gm, stages, cut_after=earlier.cut_after)
    plan.cut_after = plan.partition.cut_after
    if earlier is not None:
        plan.spread = earlier.spread
    elif options.data_parallel != "fsdp":  # FSDP2 shards them over dp x cp already
        holders = holders_of(split_pipeline(gm, plan.partition.stage_of, stages), plan)
        rows = {name: (tp_shape(captured, plan, name) or (0,))[0] for name in holders}
        plan.spread = spread_choice.choose(holders, spread_bytes(captured, plan, holders), rows, plan.mesh.pp,
                                           balance=options.pipeline_balance != "time")


def _settle_sequence_parallel(captured: Captured, plan: JobPlan, notes: list[str]) -> None:
    """Under ``"auto"``: where sequence parallelism could not split the sequence of this plan (tp ranks that do not
    divide each cp rank's tokens; no tensor-parallel region whose output carries the sequence, without a pipeline),
    the plan leaves it off, with a note. Read off tp rank 0's graph (tp's rewrite alone, on parameters that hold no
    data), before any rank builds."""
    cp = plan.cp_plan
    tokens = ([len(cp.positions(rank)) for rank in range(cp.size)] if cp is not None and cp.size > 1
              else [plan.sp_plan.seq_len])
    gm = codegen.prepare(_weightless(captured), plan.splits)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the rank's own build says what tp finds
            tensor_parallel_pass(gm, plan.tp_plan, rank=0, mark_entries=True)
        check_applies(gm, plan.sp_plan, tokens=tokens, whole=plan.mesh.pp == 1)
    except SequenceParallelError as e:
        notes.append(_SP_OFF + str(e))
        plan.sp_plan = None


_SP_OFF = "sequence_parallel='auto' leaves sequence parallelism off: "


def _weightless(captured: Captured) -> Captured:
    """The capture with its parameters on ``meta`` (its graph copied, its buffers shared): a trial build then
    allocates no shards. A parameter held by a module the graph calls is shared with the capture and kept."""
    gm = fx.GraphModule(captured.gm, copy.deepcopy(captured.gm.graph))
    for name, p in list(gm.named_parameters()):
        owner, _, attr = name.rpartition(".")
        container = gm.get_submodule(owner) if owner else gm
        if container is not (captured.gm.get_submodule(owner) if owner else captured.gm):
            setattr(container, attr, nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad))
    return dataclasses.replace(captured, gm=gm)


_BATCH_NORMS = {aten.batch_norm.default: 5, aten.native_batch_norm.default: 5, aten._native_batch_norm_legit.default: 5,
                aten._native_batch_norm_legit_functional.default: 5}  # op -> position of ``training``


def check_batch_split(captured: Captured, mesh: Mesh, options: CompileOptions,
                      notes: list[str] | None = None) -> tuple[bool, dict[str, list], bool]:
    """Whether the loss, its batch split (dp, microbatches), needs statistics of the whole batch; refused, before any
    collective, where they cannot be had. Returns whether each dp rank's program takes them over the dp ranks, and
    the numbers of the graph that are sizes of the batch (``passes.batch_statistics.batch_sizes``).

    dp and microbatches run the graph on parts of the batch and add up the parts' losses (a token mean rewritten to
    a sum, or a mean over samples). A loss term computed from means over the whole batch at once (a router's
    load-balancing loss: the fraction of tokens each expert got times its mean probability), or a cross-entropy
    averaged over its counted tokens inside a larger loss, is not such a sum: each part would compute it from its
    own tokens, and the training would differ from the model run whole. The batch dim is split in a propagation of
    the training graph: where a sum over it (pending over the parts) is needed whole before the loss, the loss is no
    such sum. Under dp alone (one microbatch, no pp or cp) every rank's program sums those over the dp ranks first
    (``passes.batch_statistics``): exact. Elsewhere it is refused; with ``batch_statistics="local"`` each part
    computes it from its own samples (DDP's and gradient accumulation's loss), said in ``notes``. (BatchNorm is
    ``check_batch_norm``'s; cp and tp keep the batch whole.) A loss that couples the samples (``passes.batch_split``)
    is gathered over dp with one microbatch and no pp or cp, beside tp and ep too (``passes.batch_gather``), and
    refused elsewhere. The third value: whether the loss is
    a sum over the samples (the parts' losses added, where the runtime would average a mean's)."""
    if captured.second_pass:  # a sum over the parts by construction (``two_passes``)
        return False, {}, True
    if not captured.with_loss or captured.token_loss is not None or (mesh.dp == 1 and options.microbatches == 1):
        return False, {}, False
    from autoshard.passes import batch_split
    from autoshard.passes.loss import is_token_mean
    from autoshard.passes.placements import Partial, R
    from autoshard.passes.propagate import redistributions

    gm = codegen.prepare(captured, None)
    if any(n.op == "call_function" and n.target in _BATCH_NORMS for n in gm.graph.nodes):
        return False, {}, False
    over = " and ".join(filter(None, [f"dp={mesh.dp}" if mesh.dp > 1 else "",
                                      f"microbatches={options.microbatches}" if options.microbatches > 1 else ""]))
    batch = next((s[0] for s in captured.input_shapes if isinstance(s, tuple) and s), None)
    source, recaptured = captured, False
    if batch == 1 and captured.recapture is not None:  # one sample a part: the same graph at two tells the rows apart
        source, batch, recaptured = captured.recapture(2), 2, True
    analysed = codegen.prepare(source, None)
    prop, whole, findings = None, [], []
    if batch and batch >= 2:
        prop, findings = _batch_propagation(analysed, batch)
        whole = [f.node for f in findings if f.kind == batch_split.STATISTIC] + \
            [r.value for r in redistributions(prop) if isinstance(r.src, Partial) and r.dst == R]
    coupled = [f for f in findings if f.kind != batch_split.STATISTIC]
    gathers = mesh.dp > 1 and options.microbatches == 1 and mesh.pp == 1 and mesh.cp == 1  # beside tp and ep too
    if coupled and (options.batch_statistics == "local" or not gathers or recaptured):
        _refuse_coupled(coupled, over, options, notes)
        return False, {}, False
    if coupled:
        return (*_gather_coupled(captured, gm, batch, mesh.dp, coupled, notes), False)
    split = [n for n in analysed.graph.nodes
             if is_token_mean(n) and (prop is None or isinstance(prop.of(n.args[0]), Shard))]
    if not whole and not split:
        return False, {}, prop is not None and _sums_over_samples(captured, source, analysed, prop, recaptured)
    where = " and ".join(dict.fromkeys(_where(n) for n in [*whole[:1], *split[:1]]))
    what = (["a term computed from the whole batch at once (such as a router's load-balancing loss from the fraction "
             "of tokens each expert got)"] if whole else []) + \
        (["a cross-entropy averaged over its counted tokens inside a larger loss (such as ce + 0.01 * z_loss)"]
         if split else [])
    what = " and ".join(what)
    if options.batch_statistics == "local":
        if notes is not None:
            notes.append(f"the loss holds {what} (here at {where}); with batch_statistics='local' {over} compute it "
                         "from each part's own samples and average the parts' losses, as DDP and gradient "
                         "accumulation do, which differs from the model run on the whole batch")
        return False, {}, False
    if mesh.dp > 1 and options.microbatches == 1 and mesh.pp == 1 and mesh.cp == 1 and prop is not None \
            and not recaptured:
        sizes, reason = _whole_batch_trial(captured, gm, batch, mesh.dp)
        if reason is not None:
            raise ValueError(f"the loss holds {what} (here at {where}), and dp={mesh.dp} cannot take it over the "
                             f"whole batch: {reason}")
        if notes is not None:
            notes.append(f"the loss holds {what} (here at {where}): every dp rank sums its part of each such statistic "
                         f"over the {mesh.dp} dp ranks before reading it, so the loss is the whole batch's")
        return True, sizes, False
    raise ValueError(
        f"the loss is not a sum over the batch's samples (it holds {what}; here at {where}): {over} would compute it "
        "on each part of the batch alone, and the sum of those would not be the model's loss; a statistic of the "
        "whole batch cannot be taken before every part of it has run (with two samples or more a part, microbatches "
        "and pp take it in two passes; one sample a part, or cp beside dp, cannot). Use dp alone with one microbatch "
        "(no pp or cp: each statistic is then summed over the dp ranks, exact), keep the batch whole (dp=1, one "
        "microbatch: tp, cp and pp with one microbatch are exact), pass batch_statistics='local' to compute it on "
        "each part as DDP and gradient accumulation do, or leave that term out of the loss (for transformers' "
        "mixtures of experts, output_router_logits=False; for a cross-entropy, return it alone, scaled by a number or "
        "not)")


def two_passes(captured: Captured, mesh: Mesh, options: CompileOptions) -> tuple[Captured, Captured, object] | None:
    """A loss that couples the samples where the parts of the batch run apart (microbatches, pp): the captures of
    the two passes (``passes.batch_two_passes``: the first pass's, up to the values the coupled term reads, and the
    second's, fed their gradients) and the cut, or None where the loss needs none (no coupled term, or dp gathers
    its rows). Refused, before any collective, where they do not apply; ``check_batch_split`` says the rest."""
    from autoshard.passes import batch_split, batch_statistics
    from autoshard.passes.batch_two_passes import TwoPassesError, cut
    from autoshard.passes.loss import is_token_mean
    from autoshard.passes.placements import Partial, R
    from autoshard.passes.propagate import redistributions

    parts = options.microbatches > 1 or (mesh.pp > 1 and mesh.dp > 1)  # parts that run apart, dp cannot gather
    if not captured.with_loss or captured.token_loss is not None or not parts or mesh.cp > 1 \
            or options.batch_statistics == "local":
        return None
    batch = next((s[0] for s in captured.input_shapes if isinstance(s, tuple) and s), None)
    if not batch or batch < 2:
        return None  # one sample a part: check_batch_split tells the rows apart at two, and refuses
    gm = codegen.prepare(captured, None)
    if any(n.op == "call_function" and n.target in _BATCH_NORMS for n in gm.graph.nodes):
        return None
    prop, findings = _batch_propagation(gm, batch)
    whole = [f.node for f in findings if f.kind == batch_split.STATISTIC] + \
        [r.value for r in redistributions(prop) if isinstance(r.src, Partial) and r.dst == R]
    split = [n for n in gm.graph.nodes if is_token_mean(n) and isinstance(prop.of(n.args[0]), Shard)]
    coupled = [f for f in findings if f.kind != batch_split.STATISTIC]
    if not (coupled or whole or split):
        return None
    found = "; ".join(f.describe() for f in coupled[:3]) if coupled else \
        f"a term computed from the whole batch at once, or a mean over its counted tokens inside a larger loss, at " \
        f"{_where([*whole, *split][0])}"
    parts = mesh.dp * options.microbatches
    try:
        if captured.recapture is None:
            raise TwoPassesError("this capture cannot be taken again at another batch size")
        sizes = batch_statistics.batch_sizes(captured.gm, captured.recapture(2).gm, 2)
        prop, region = batch_statistics.whole_batch_region(gm, batch, parts)  # the analysed graph, its means rewritten
        passes = cut(gm, prop, region, sizes, parts, _where)
    except (TwoPassesError, batch_statistics.BatchStatisticsError) as e:
        raise ValueError(f"the loss is not a sum over the batch's samples: {found}. Under microbatches and pp it is "
                         f"taken in two passes over the batch, which cannot run it: {e}. Keep the batch whole (dp=1 "
                         "and one microbatch), use dp with one microbatch and no pp or cp (the rows it reads are then "
                         "gathered over dp), or pass batch_statistics='local' to train each part's own loss") from e
    first = Captured(passes.first, False, captured.input_shapes, captured.names, training=captured.training,
                     first_pass=True)
    shapes = (*captured.input_shapes[:-1], *passes.gradient_shapes, captured.input_shapes[-1])
    second = Captured(passes.surrogate, True, shapes, captured.names, training=captured.training, second_pass=True)
    passes.note = _two_passes_note(passes, found, mesh)
    return first, second, passes


def _two_passes_note(passes, found: str, mesh: Mesh) -> str:
    over = f" over the {mesh.dp} dp ranks" if mesh.dp > 1 else ""
    rows = ", ".join(b.name for b in passes.boundary if b.dim is not None)
    sums = ", ".join(b.name for b in passes.boundary if b.summed)
    reads = "; ".join(filter(None, [f"{rows}, gathered{over} into the whole batch's rows" if rows else "",
                                    f"{sums}, each microbatch's share added up{over}" if sums else ""]))
    return (f"the loss is not a sum over the batch's samples ({found}): each step takes it in two passes (as GradCache "
            f"does): the first forwards every microbatch to the values the term reads ({reads}); the term and its "
            "gradient with respect to them are computed on the whole batch; the second forwards and backwards each "
            "microbatch fed its part of that gradient, so the loss and every gradient are the model's")


def _batch_propagation(gm: fx.GraphModule, batch: int):
    """The batch split (``Shard(0)`` on every input of ``batch`` rows) through ``gm``, and what it cannot prove of
    the loss (``passes.batch_split``)."""
    from autoshard.passes import batch_split
    from autoshard.passes.axis import Axis, Outputs
    from autoshard.passes.propagate import propagate

    batch_split.reductions_by_dims(gm)
    seeds = {n.target: Shard(0) for n in gm.graph.nodes
             if n.op == "placeholder" and isinstance(meta.val(n), torch.Tensor) and meta.val(n).dim() > 0
             and meta.val(n).shape[0] == batch}
    prop = propagate(gm, seeds, Axis("dp", 2, pending_sums=True, samples=True), outputs=Outputs.PARTIAL)
    return prop, batch_split.unproven(gm, prop)


def _sums_over_samples(captured: Captured, source: Captured, gm: fx.GraphModule, prop, recaptured: bool) -> bool:
    """Whether the loss is a sum over the batch's samples (``passes.batch_split.loss_reduction``); refused where it
    adds a sum to a mean, before any collective."""
    from autoshard.passes import batch_split, batch_statistics

    kind = batch_split.loss_reduction(gm, prop)
    if kind in (batch_split.SUM, batch_split.MIXED) and captured.recapture is not None:
        try:  # the numbers of the graph analysed (``source``'s) that double with its batch
            sizes = batch_statistics.batch_sizes(source.gm, captured.recapture(4 if recaptured else 2).gm, 2)
        except batch_statistics.BatchStatisticsError:
            sizes = {}
        divisors = frozenset(name for name, found in sizes.items() if any(at == 1 and v is not None for at, v in found))
        kind = batch_split.loss_reduction(gm, prop, divisors)
    if kind == batch_split.MIXED:
        raise ValueError("the loss adds a sum over the batch's samples to a mean over them (or divides a mean by a "
                         "size of the batch): the parts of the batch cannot add up to it, whether their losses are "
                         "summed or averaged. Use one reduction (.mean() or .sum() over the samples of every term), "
                         "or keep the batch whole (dp=1, one microbatch)")
    return kind == batch_split.SUM


def _whole_batch_trial(captured: Captured, gm: fx.GraphModule, batch: int, dp: int) -> tuple[dict, str | None]:
    """The numbers of the capture that are sizes of the batch, and why ``passes.batch_statistics`` would refuse to
    take the loss over the whole batch on a copy of ``gm`` (None where it would not)."""
    from autoshard.passes import batch_statistics

    try:
        if captured.recapture is None:
            raise batch_statistics.BatchStatisticsError("this capture cannot be taken again at another batch size")
        sizes = batch_statistics.batch_sizes(captured.gm, captured.recapture(2).gm, 2)
    except batch_statistics.BatchStatisticsError as e:
        return {}, str(e)
    return sizes, batch_statistics.refusal(gm, batch, dp, sizes)


def _gather_coupled(captured: Captured, gm: fx.GraphModule, batch: int, dp: int, coupled: list,
                    notes: list[str] | None) -> tuple[bool, dict[str, list]]:
    """dp with one microbatch (no pp or cp): the rows a coupled loss term reads gathered over the dp ranks
    (``passes.batch_gather``), or refused, before any collective, saying why."""
    from autoshard.passes import batch_statistics

    found = "; ".join(f.describe() for f in coupled[:3])
    sizes, reason = _whole_batch_trial(captured, gm, batch, dp)
    if reason is not None:
        raise ValueError(f"the loss is not a sum over the batch's samples: {found}; dp={dp} cannot gather the rows "
                         f"it reads: {reason}")
    if notes is not None:
        trial = fx.GraphModule(gm, copy.deepcopy(gm.graph))
        gathered = batch_statistics.batch_statistics_pass(trial, batch=batch, size=dp, rank=0, sizes=sizes).gathered
        notes.append(f"the loss couples the samples of the batch ({found}): every dp rank gathers "
                     f"{', '.join(gathered)} from the {dp} dp ranks (an all-gather whose backward sums the gradient "
                     "and keeps each rank's rows) and computes that term on the whole batch, so the loss is the "
                     "model's")
    return True, sizes


def _refuse_coupled(coupled: list, over: str, options: CompileOptions, notes: list[str] | None) -> None:
    """A loss that reads rows of the batch together (or through an op the batch split has no rule for): refused
    naming each, or said where ``batch_statistics='local'`` asks for each part's own loss."""
    found = "; ".join(f.describe() for f in coupled[:3]) + (f"; and {len(coupled) - 3} more" if len(coupled) > 3
                                                             else "")
    if options.batch_statistics == "local":
        if notes is not None:
            notes.append(f"the loss couples the samples of the batch ({found}); with batch_statistics='local' {over} "
                         "compute it from each part's own samples and average the parts' losses, as DDP and gradient "
                         "accumulation do, which differs from the model run on the whole batch")
        return
    raise ValueError(
        f"the loss is not a sum over the batch's samples: {found}. {over} would run each part of the batch alone, "
        "and no rank sees another part's rows: each part would train its own loss (a contrastive loss over its own "
        "samples, preference pairs split apart), a different objective from the model run on the whole batch (with "
        "two samples or more a part, microbatches and pp take it in two passes; one sample a part, or cp beside dp, "
        "cannot). Keep the batch whole (dp=1 and one microbatch: tp, cp, and pp with one microbatch are exact), use "
        "dp with one "
        "microbatch and no pp or cp (beside tp or ep too: the rows the term reads are then gathered over dp, exact), "
        "or pass batch_statistics='local' to train each part's own loss as DDP and gradient accumulation do")


def _where(node: fx.Node) -> str:
    where = meta.source_line(node) or node.name
    if "autoshard" in where and "capture.py" in where:  # the loss_fn's own lines are not in the trace
        return f"{node.name} in the loss_fn given to parallelize"
    return where


def check_batch_norm(captured: Captured, mesh: Mesh, options: CompileOptions, notes: list[str]) -> bool:
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
