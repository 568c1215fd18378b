"""Step time of a mesh predicted from its compiled rank programs and a measured profile, not from a formula.

For a candidate (a mesh and its options) the model is compiled as ``parallelize`` would compile it, in this process
and without process groups (``compile_rank`` with no groups: the collectives are there, counted, not run), once per
pipeline coordinate. Each program is costed node by node from the profile (``profile.py``):

- a matmul (``linear``, ``mm``, ``addmm``, ``bmm``, ...) by its forward FLOPs at the rank's local shapes, forward and
  backward as measured together; attention likewise; a view by the fixed cost of an op; any other op by the fixed
  cost plus its output's bytes;
- each collective the passes put in (tp's, cp's, sp's, ep's) by its kind, group size and counted bytes, forward and
  backward (its two kinds), as ``explain()`` counts them;

and the step is assembled as the runtime runs it: microbatches one after another (a pipeline's schedule simulated
with each stage's own time, its sends costed from the bytes a stage hands on), then the gradients' all-reduce over
dp x cp in DDP's buckets (FSDP2: its all-gathers of the parameters and the reduce-scatter of the gradients) and the
optimizer's step over the rank's parameters (its share under FSDP2). Activation checkpointing runs each forward
again, its collectives with it, in the backward. A CPU computes and communicates on the same cores, so the parts
add up; where the ranks outnumber the cores (the profile's), every rank's compute is slowed by their ratio, and a
pipeline's schedule is simulated event by event with the ranks busy at once sharing the cores. Each candidate's
bytes per rank come with it (``memory.py``).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from autoshard import batching, cost, meta
from autoshard.explain import spec_bytes
from autoshard.mesh import Mesh
from autoshard.options import CompileOptions
from autoshard.planner.memory import Footprint, footprint, held_bytes, node_bytes
from autoshard.planner.profile import Profile

_GROUPED = frozenset({"_grouped_mm", "grouped_mm", "grouped_mm_fallback", "_grouped_mm_fallback"})  # experts' rows
_ZEROED = frozenset({"grouped_mm_fallback", "_grouped_mm_fallback"})  # transformers' loop: zeros, then each expert
_CONVERSIONS = frozenset({"to", "type_as", "contiguous"})  # their input itself where nothing changes
_ATTENTION = frozenset({"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
                        "_scaled_dot_product_flash_attention"})  # attention's kernels, beside the op's own record
_RING_PIECE_OPS = 6  # a ring piece's merge (scale, add, the weighted piece) and its gradients' three additions
# a pass's module that computes besides its collectives: as many ops (forward and backward) over its first input
# or its output. tp's loss over the local logits runs max, subtract, exp, sum and a divide, and backward a copy,
# an index_put and a product (8.5 ms of a mixture's tp2 step here, where it had been costed nothing); tp's
# embedding masks its ids and its rows, and backward adds its rows' gradients into the weight's
_MODULE_OPS = {"VocabParallelCrossEntropy": (3, "input"), "VocabParallelEmbedding": (2, "output")}
_COLLECTIVE_KIND = {"all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
                    "all_to_all": "all_to_all", "ring": "send_recv"}


@dataclass
class Prediction:
    """A candidate's predicted step (seconds), by part."""

    mesh: Mesh
    options: dict
    step: float
    parts: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # why the candidate cannot run (it does not compile for this model)
    measured: float | None = None  # under autotune: its step measured on the job's ranks (seconds)
    memory: Footprint | None = None  # its bytes per rank at the step's peak
    over_limit: float | None = None  # the bytes per rank it was refused for exceeding (its step still predicted)
    device: str = ""  # the machine the step is modelled on (the profile's, ``Profile.described``)

    def label(self) -> str:
        extra = ",".join(f"{k}={v}" for k, v in sorted(self.options.items()))
        return f"{self.mesh}" + (f" [{extra}]" if extra else "")

    def __str__(self) -> str:
        if self.error:
            return f"{self.label()}: refused ({self.error})"
        parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in self.parts.items() if v)
        memory = f"; {self.memory}" if self.memory is not None else ""
        measured = f"; measured {self.measured * 1e3:.1f} ms" if self.measured is not None else ""
        return f"{self.label()}: {self.step * 1e3:.1f} ms ({parts}){memory}{measured}"


def program_time(gm: fx.GraphModule, profile: Profile) -> tuple[float, float, float]:
    """(compute, communication, the forward's share of the communication) seconds of one forward and backward of
    ``gm``."""
    costs = cost.annotate(gm)
    compute = communication = forward = 0.0
    widest = 0  # the largest group a collective of the program spans
    for node in gm.graph.nodes:
        if node.op == "call_module":
            sent = _collective_time(gm, node, profile)
            communication += sum(sent)
            forward += sent[0]
            compute += _attention_module_time(gm, node, profile) + _module_ops_time(gm, node, profile)
            if any(sent):
                widest = max(widest, getattr(gm.get_submodule(node.target), "size", 1))
            continue
        if node.op != "call_function":
            continue
        name = cost.op_name(node.target)
        spent = costs.get(node)
        flops = float(spent.flops) if spent is not None and isinstance(spent.flops, int) else 0.0
        if name in _GROUPED:  # each row through its expert's matrix: 2 x rows x outputs x inputs
            compute += _grouped_time(node, float(cost._matmul_rule(0, adds=False)(node, tuple)), profile)
            if name in _ZEROED:  # a loop over the experts writing into zeroed buffers: its output, and backward
                # the input's and the stacked weights' gradients (13 ms of a mixture's 224 ms step here)
                compute += profile.zero_time(node_bytes(node) + sum(node_bytes(a) for a in node.args[:2]
                                                                    if isinstance(a, fx.Node)))
        elif cost.timing(node.target) == cost.MATMUL and flops:
            out = meta.val(node)
            n = cost.dim_size(out.shape[-1]) if isinstance(out, torch.Tensor) and out.dim() else 1
            rows = (cost._output_numel(node, tuple) / n) if n else 0
            compute += profile.matmul_time(rows, n, flops / max(2.0 * rows * n, 1.0))
        elif (cost.timing(node.target) == cost.ATTENTION or name in _ATTENTION) and flops:
            compute += profile.attention_time(flops)
        elif (name in cost._VIEWS or name in ("sym_size", "_assert_tensor_metadata", "_assert_scalar")
              or name in _CONVERSIONS and _unchanged(node)):
            compute += profile.view_seconds  # no data moves; dispatch and autograd only
        else:
            nbytes = spent.activation_bytes if spent is not None and isinstance(spent.activation_bytes, int) else 0
            if name in cost._PER_INPUT_ELEMENT:  # a reduction or a loss: what it reads, not its small output
                nbytes = max(nbytes, *(node_bytes(a) for a in node.all_input_nodes), 0)
            compute += profile.op_time(nbytes)
    if widest > 1:  # the ranks reach each collective from their own compute (as crowded as it runs), not together
        waits = profile.sync_time(widest, 0, compute * profile.contention(profile.world_size))
        communication += waits
        forward += waits / 3
    return compute, communication, forward


def _unchanged(node: fx.Node) -> bool:
    """Whether a conversion (``.to``, ``.type_as``, ``.contiguous``) returns its input as it is: the dtype and
    device it has, already contiguous, no copy asked for (an RMSNorm's ``.to(float32)`` of a float32 tensor)."""
    if node.kwargs.get("copy") or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    out, src = meta.val(node), meta.val(node.args[0])
    if not (isinstance(out, torch.Tensor) and isinstance(src, torch.Tensor)):
        return False
    return out.dtype == src.dtype and out.device == src.device and src.is_contiguous() and out.is_contiguous()


def _attention_module_time(gm: fx.GraphModule, node: fx.Node, profile: Profile) -> float:
    """Attention a pass wrapped in a module (cp's gathered, ring or all-to-all attention): this rank's queries over
    the whole sequence's keys (a ring's keys arrive a rank's part at a time)."""
    module = gm.get_submodule(node.target)
    if not type(module).__name__.endswith("Attention") or len(node.args) < 2:
        return 0.0
    q, k = (meta.val(a) if isinstance(a, fx.Node) else None for a in node.args[:2])
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)) or q.dim() < 2:
        return 0.0
    numel = 1
    for d in q.shape:
        numel *= cost.dim_size(d)
    positions = getattr(module, "positions", None)
    if positions is None and getattr(module, "layout", None) is not None and getattr(module, "causal", False):
        positions = module.layout[module.rank]  # a ring's: the global positions of this rank's queries
    merging = 0.0
    if callable(getattr(module, "blocks", None)) and getattr(module, "size", 1) > 1:
        # a ring runs its pieces (each run of its query rows against each of another rank's, causally reached) one
        # kernel at a time, and merges each into the running output by its log-sum-exp (forward) or adds its
        # gradients into the running ones (backward): a few ops over the piece's rows each
        per_row = numel / cost.dim_size(q.shape[-2]) * q.element_size()
        for src in range(module.size):
            for rows, _, _ in module.blocks(src):
                merging += _RING_PIECE_OPS * profile.op_time(per_row * (rows.stop - rows.start))
    if isinstance(positions, torch.Tensor) and positions.numel() == cost.dim_size(q.shape[-2]):
        # causal: the query at position t attends t + 1 keys, 4 b h d of work each
        pairs = float((positions.double() + 1).sum())
        return merging + profile.attention_time(4.0 * numel / positions.numel() * pairs)
    keys = cost.dim_size(k.shape[-2]) * (getattr(module, "size", 1) if hasattr(module, "comm_bytes") else 1)
    return merging + profile.attention_time(4.0 * numel * keys)


def _module_ops_time(gm: fx.GraphModule, node: fx.Node, profile: Profile) -> float:
    """The compute of a pass's module that does some besides its collectives (``_MODULE_OPS``)."""
    ops, over = _MODULE_OPS.get(type(gm.get_submodule(node.target)).__name__, (0, ""))
    if not ops:
        return 0.0
    value = node.args[0] if over == "input" and node.args else node
    return ops * profile.op_time(node_bytes(value)) if isinstance(value, fx.Node) else 0.0


def _collective_time(gm: fx.GraphModule, node: fx.Node, profile: Profile) -> tuple[float, float]:
    """(forward, backward) seconds of a pass's collective module."""
    module = gm.get_submodule(node.target)
    size = getattr(module, "size", 1)
    if not hasattr(module, "comm_bytes") or size <= 1:
        return 0.0, 0.0
    arg = meta.val(node.args[0]) if node.args and hasattr(node.args[0], "meta") else None
    shape = [cost.dim_size(d) for d in arg.shape] if isinstance(arg, torch.Tensor) else []
    forward, backward = module.comm_bytes(shape, arg.element_size() if isinstance(arg, torch.Tensor) else 4)
    calls = getattr(module, "calls", (1, 1))
    spent = [0.0, 0.0]
    for i, (kind, nbytes, count) in enumerate(((module.kind, forward, calls[0]),
                                               (module.backward_kind, backward, calls[1]))):
        if nbytes and kind in _COLLECTIVE_KIND:
            # and the copy that packs or unpacks it (a cat of gathered parts, a stack of the parts to scatter, the
            # clone an in-place all-reduce writes into), outside autograd: the profile times the collectives on
            # ready buffers
            spent[i] += profile.collective_time(_COLLECTIVE_KIND[kind], size, nbytes, calls=count)
            spent[i] += profile.copy_time(nbytes) + profile.sync_time(size, count)
    return spent[0], spent[1]


class CandidateCompiler:
    """Compiles a model for candidate meshes in this process, one capture per microbatch shape."""

    def __init__(self, model: nn.Module, inputs: tuple, target: torch.Tensor, loss_fn) -> None:
        self.model, self.inputs, self.target, self.loss_fn = model, inputs, target, loss_fn
        self._captures: dict = {}

    def experts(self) -> int:
        """The fewest experts of the model's mixtures that ep can split (0 without one), from the whole batch's
        capture."""
        from autoshard.passes.expert_parallel import plan_expert_parallel

        captured = self._capture(self.inputs, self.target)
        return min((layer.experts for layer in plan_expert_parallel(captured.gm, 1).layers), default=0)

    def _capture(self, inputs: tuple, target: torch.Tensor):
        from autoshard.compile import capture_for_training

        key = tuple(tuple(v.shape) for v in (*inputs, target) if isinstance(v, torch.Tensor))
        if key not in self._captures:
            self._captures[key] = capture_for_training(self.model, inputs, target, self.loss_fn,
                                                       training=self.model.training)
        return self._captures[key]

    def builds(self, mesh: Mesh, options: CompileOptions) -> list[list]:
        """Per pipeline coordinate, one build per cp coordinate (causal attention gives cp ranks unequal work); dp,
        tp and ep coordinate 0, whose programs are alike."""
        from autoshard.compile import compile_rank
        from autoshard.job_plan import plan_job

        options.check_mesh(mesh)
        batch = batching.batch_size(self.inputs)
        batching.check(batch, microbatches=options.microbatches, dp=mesh.dp, local=False)
        values = batching.split((*self.inputs, self.target), mesh.dp * options.microbatches)[0]
        captured = self._capture(values[:-1], values[-1])
        plan = plan_job(captured, mesh, options)
        first = {axis: 0 for axis in ("dp", "tp") if mesh.degree(axis) > 1}
        return [[compile_rank(captured, plan, mesh.coords(mesh.rank_of(**first, **({"pp": r} if mesh.pp > 1 else {}),
                                                                       **({"cp": c} if mesh.cp > 1 else {}))))
                 for c in range(mesh.cp)] for r in range(mesh.pp)]


def predict(compiler: CandidateCompiler, mesh: Mesh, profile: Profile, options: CompileOptions | None = None,
            **option_fields) -> Prediction:
    """The predicted step of ``mesh`` with ``options`` or ``option_fields`` (``parallelize``'s keyword options)."""
    options = options if options is not None else CompileOptions(**option_fields)
    if not option_fields and options.microbatches > 1:  # what the label shows
        option_fields = {"microbatches": options.microbatches}
    try:
        builds = compiler.builds(mesh, options)
    except (ValueError, NotImplementedError, RuntimeError) as e:
        return Prediction(mesh, option_fields, math.inf, error=str(e).split("\n")[0][:200], device=profile.described)
    m = options.microbatches
    stages: dict[int, tuple[float, float]] = {}  # per stage, its slowest cp rank's (compute, communication)
    stage_times = []  # per pp rank, the sum of its stages': one microbatch through every chunk it holds
    for per_cp in builds:
        for index in per_cp[0].programs:
            stages[index] = max((_recomputed(program_time(build.programs[index].gm, profile), options)
                                 for build in per_cp), key=sum)
        stage_times.append(tuple(sum(stages[i][part] for i in per_cp[0].programs) for part in (0, 1)))
    builds = [per_cp[0] for per_cp in builds]
    parts: dict[str, float] = {}
    crowd = profile.contention(mesh.world_size)
    in_flight = None
    if mesh.pp == 1:
        compute, comm = stage_times[0]
        parts["compute"], parts["collectives"] = m * compute * crowd, m * comm
    else:
        found, in_flight = _pipeline(builds, stage_times, stages, mesh, options, profile)
        parts.update(found)
    mine = max(held_bytes(build, r) for r, build in enumerate(builds))  # the whole model's before: tp's share
    experts = _expert_bytes(builds[0])
    replicas = mesh.dp * mesh.cp
    fsdp = options.data_parallel == "fsdp" and replicas > 1
    if fsdp:  # the parameters gathered for each forward and backward (once a step under a pipeline, which keeps
        # them), the gradients reduce-scattered once
        gathers = 1 if mesh.pp > 1 else 2 * m
        parts["gradient sync"] = (profile.collective_time("all_gather", replicas, gathers * (mine - experts),
                                                          calls=gathers)
                                  + profile.collective_time("reduce_scatter", replicas, mine - experts))
    elif replicas > 1:  # DDP (a pipeline's reducer alike) copies the gradients into flat buckets and the sums back
        parts["gradient sync"] = (profile.gradient_sync_time(replicas, mine - experts)
                                  + profile.op_time(mine - experts) * crowd)
    else:
        parts["gradient sync"] = 0.0
    if replicas > 1:  # the ranks reach the gradients' collectives from their own backward (where the programs have
        # collectives of their own, their waits are counted there); then the step's loss is summed over them
        alone = not parts.get("collectives") and mesh.pp == 1
        parts["gradient sync"] += (profile.sync_time(replicas, 1, parts["compute"] if alone else 0.0)
                                   + profile.collective_time("all_reduce", replicas, 4))
    if experts and replicas // mesh.ep > 1:  # the experts' gradients, summed over the ranks holding the same ones
        parts["gradient sync"] += profile.gradient_sync_time(replicas // mesh.ep, experts)
    tensors = max(_parameter_count(build) for build in builds)
    parts["optimizer"] = ((mine / replicas if fsdp else mine) * profile.optimizer_byte_seconds
                          + tensors * profile.optimizer_param_seconds) * crowd
    return Prediction(mesh, option_fields, sum(parts.values()), parts,
                      memory=footprint(builds, mesh, options, in_flight), device=profile.described)


def _recomputed(spent: tuple[float, float, float], options: CompileOptions) -> tuple[float, float]:
    """A program's (compute, communication), with its forward run again under activation checkpointing (a forward
    is taken as a third of forward and backward, as the profile measures them together)."""
    compute, communication, forward = spent
    if options.activation_checkpointing:
        return compute * 4 / 3, communication + forward
    return compute, communication


def _parameter_count(build) -> int:
    """The parameter tensors this rank's programs read (the optimizer steps each)."""
    found = set()
    for program in build.programs.values():
        for node in program.gm.graph.nodes:
            if node.op == "get_attr":
                with contextlib.suppress(AttributeError):  # a buffer or a constant
                    found.add(id(program.gm.get_parameter(node.target)))
    return len(found)


def _expert_bytes(build) -> float:
    """Bytes of the experts this rank holds under ep (outside DDP: their gradients arrive through the all-to-alls)."""
    plan = build.plan.ep_plan
    if plan is None or build.mesh.ep == 1:
        return 0.0
    return float(sum(math.prod(build.stored_shape(name)) * 4 for name in plan.params()))


def _grouped_time(node: fx.Node, flops: float, profile: Profile) -> float:
    """A grouped matmul runs each expert's rows through its matrix: as many products as the stack holds experts,
    each of its share of the rows (the routing taken as even), each with an op's fixed cost around it."""
    out, stack = meta.val(node), meta.val(node.args[1]) if len(node.args) > 1 else None
    if not isinstance(out, torch.Tensor) or not isinstance(stack, torch.Tensor) or stack.dim() != 3:
        return 0.0
    experts = cost.dim_size(stack.shape[0])
    n = cost.dim_size(out.shape[-1])
    rows = cost._output_numel(node, tuple) / max(n, 1)
    k = flops / max(2.0 * rows * n, 1.0)
    return experts * (profile.matmul_time(rows / experts, n, k) + 3 * profile.op_seconds)


def _pipeline(builds: list, stage_times: list, stages: dict, mesh: Mesh, options: CompileOptions,
              profile: Profile) -> tuple[dict, dict[int, float]]:
    """A pipeline's schedule simulated with each stage's microbatch time (compute and the collectives inside it),
    each send costed from the bytes its stage hands on, the ranks computing at once sharing the cores
    (``_shared_makespan``); and the microbatches each rank holds at its peak."""
    from autoshard import schedules

    p, v, m = mesh.pp, options.chunks, options.microbatches
    sent = max(sum(spec_bytes(specs[1]) for specs in build.local_specs.values()) for build in builds)
    send = profile.collective_time("send_recv", 2, sent / max(1, len(builds[0].local_specs))) if sent else 0.0
    name = str(options.schedule)
    actions = schedules.schedule(name, p, m, v)
    slowest = max(c + k for c, k in stage_times)
    sim = schedules.simulate(actions, p, v, forward_cost=slowest / 3, backward_cost=2 * slowest / 3,
                             send_cost=send, placement=schedules.placement_of(name))  # the peaks in flight
    late = profile.late_receive_time(sent / max(1, len(builds[0].local_specs)))
    makespan = _shared_makespan(actions, stages, send, mesh.world_size // p, profile, late=late)
    busy = m * max(c for c, _ in stage_times)
    sums = _pipeline_sums(builds[0], p, profile)
    return {"compute": busy, "bubble": max(makespan - busy, 0.0), "pipeline sums": sums}, sim.peak_in_flight


def pipeline_collectives(build, p: int) -> list[tuple[str, int, float]]:
    """``(kind, group size, bytes)`` of each collective a pipeline step runs around its schedule
    (``runtime.pipeline``, ``runtime.spread``): the loss summed over the pp ranks (the last stage's holds it); the
    weights spread over the pp ranks all-gathered before the step, a flag per weight, their gradients reduce-scattered
    after it; the weights held whole on several pp ranks (tied), a flag per weight and an all-reduce of each
    gradient over its holders; and before the step, the gathers that check every rank was given the same batch."""
    from autoshard.job_plan import spread_bytes
    from autoshard.runtime import alike

    tensors = sum(isinstance(shape, tuple) for shape in build.captured.input_shapes)
    out = [("all_reduce", p, 4.0), *alike.collectives(build.mesh, tensors, build.options.local_batch)]
    if build.spread:
        out += [("all_gather", p, build.spread_bytes), ("all_reduce", p, 4.0 * len(build.spread)),
                ("reduce_scatter", p, build.spread_bytes)]
    by_ranks: dict[frozenset, list[str]] = {}
    for name, ranks in build.tied.items():
        by_ranks.setdefault(ranks, []).append(name)
    for ranks, names in by_ranks.items():
        nbytes = spread_bytes(build.captured, build.plan, dict.fromkeys(names))
        out += [("all_reduce", len(ranks), 4.0 * len(names)), *(("all_reduce", len(ranks), nbytes[n]) for n in names)]
    return out


def _pipeline_sums(build, p: int, profile: Profile) -> float:
    """``pipeline_collectives`` costed, with the copies that pack the spread weights and unpack them."""
    return (sum(profile.collective_time(kind, size, nbytes) for kind, size, nbytes in pipeline_collectives(build, p))
            + (2 * profile.op_time(build.spread_bytes) if build.spread else 0.0))


def _shared_makespan(actions: dict, stages: dict, send: float, replicas: int, profile: Profile, *,
                     late: float = 0.0) -> float:
    """The schedule run event by event: each stage's forward a third of its (compute, communication) and its
    backward two thirds (a zero-bubble schedule's I and W halves of that), each chunk of an interleaved rank at its
    own stage's time (a rank's chunks are not alike: the first holds the embedding, the last the head and the loss),
    its sends ``send``; the compute of the
    ranks busy at once slowed by their crowding on the cores (each pipeline rank stands for its ``replicas`` of dp,
    tp and cp), a collective's or a receive's wait leaving the core to the others. The profile times collectives
    with every rank of the world communicating at once: where fewer ranks are busy (a pipeline filling or
    draining, the others asleep in a receive) they end as much sooner as those ranks are less crowded. A rank's
    receive waits for its partner's send, or where it is reached after the send ended, waits ``late`` (the data
    waits for the sender's communication thread, which shares a core with its compute; the profile's
    ``late_receive_time``); ranks run their lists in order."""
    share = {"F": 1 / 3, "B": 2 / 3, "I": 1 / 3, "W": 1 / 3}
    position = dict.fromkeys(actions, 0)
    phases: dict[int, list[list]] = {}  # rank -> its current action's remaining [kind, seconds] phases
    ended: dict = {}
    now = 0.0
    crowded = profile.contention(len(actions) * replicas)  # what the profile's collectives were timed under

    def start(rank: int) -> None:
        """Begin ``rank``'s next action; a receive whose send has ended passes at once, one whose send has not
        waits."""
        while position[rank] < len(actions[rank]):
            action = actions[rank][position[rank]]
            if action.is_compute:
                compute, communication = stages[action.stage]
                part = share[str(action.kind)]
                phases[rank] = [["cpu", compute * part], ["wait", communication * part]]
                return
            if action.is_send:
                phases[rank] = [["cpu", send]]
                return
            if action.partner() not in ended:
                return
            if late and ended[action.partner()] < now - 1e-12:
                phases[rank] = [["wait", late]]
                return
            ended[action] = now
            position[rank] += 1

    while True:
        for rank in actions:
            if rank not in phases:
                start(rank)
        if not phases:
            if any(position[r] < len(actions[r]) for r in actions):
                raise RuntimeError("the pipeline schedule deadlocks in simulation")
            return now
        computing = [r for r, ph in phases.items() if ph[0][0] == "cpu"]
        rate = 1.0 / profile.contention(len(computing) * replicas) if computing else 1.0
        waiting = crowded / profile.contention(len(phases) * replicas)
        step = min(ph[0][1] / (rate if ph[0][0] == "cpu" else waiting) for ph in phases.values())
        now += step
        for rank in list(phases):
            phase = phases[rank][0]
            phase[1] -= step * (rate if phase[0] == "cpu" else waiting)
            while phases[rank] and phases[rank][0][1] <= 1e-12:
                phases[rank].pop(0)
            if not phases[rank]:
                del phases[rank]
                ended[actions[rank][position[rank]]] = now
                position[rank] += 1
