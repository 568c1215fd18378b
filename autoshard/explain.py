"""The report of what the compiler did for one rank, rendered from its ``RankBuild``s.

``pm.explain()`` and ``autoshard inspect`` print this same report for the same rank. Sections: the model,
the mesh and the rank's place in it; the captured graphs; how the loss is normalised; every parameter
with its role, placement and local shape; the context-parallel plan; the pipeline (cuts, costs, bubble,
the schedule's timeline); optionally the code of each of the rank's programs; the collectives per
microbatch and per step with their bytes; the planner's lint of the mesh.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from autoshard import meta, schedules
from autoshard.cost import dim_size, format_bytes
from autoshard.mesh import AXES, Mesh
from autoshard.options import CompileOptions
from autoshard.passes.expert_parallel import ExpertRoute

_PREFIX = re.compile(r"(?<![\w.])model\.")  # the capture's prefix of parameter names, in a plan's reasons


def render(builds: list, *, model: nn.Module, mesh: Mesh, rank: int, options: CompileOptions, lint: list | None,
           code: bool = False, compiler=None, ranking: list | None = None) -> str:
    """The report of rank ``rank`` from its ``builds`` (every capture so far; the latest is described)."""
    sections = [_header(model, mesh, rank), planner_ranking(ranking, options), _graphs(builds, options, mesh, compiler)]
    if builds:
        build = ([b for b in builds if b.training] or builds)[-1]
        sections += [_loss(build, options, mesh), _parameters(build), _context_parallel(build), _experts(build),
                     _pipeline(build)]
        sections += _code(build) if code else []
        sections.append(_collectives(build))
    if lint is not None:
        sections.append(_lint(lint, mesh))
    return "\n\n".join("\n".join(lines) for lines in sections if lines)


def _header(model: nn.Module, mesh: Mesh, rank: int) -> list[str]:
    params = {id(p): p.numel() for p in model.parameters()}
    coords = mesh.coords(rank)
    lines = [f"autoshard: {type(model).__name__}, {_count(sum(params.values()))} parameters",
             f"mesh: {mesh}, world size {mesh.world_size}; rank {rank} at "
             + ", ".join(f"{axis}={coords[axis]}" for axis in AXES)]
    groups = [f"{axis} {mesh.group_of(axis, rank)}" for axis in ("tp", "cp", "dp", "pp") if mesh.degree(axis) > 1]
    if groups:
        lines.append(f"  groups of rank {rank}: {'; '.join(groups)}")
    return lines


def profile_source(options: CompileOptions) -> str:
    """Where ``mesh="auto"``'s measured costs came from."""
    return "a calibration of this job's ranks" if options.calibrate else f"the profile {options.planner_profile}"


def planner_ranking(ranking: list | None, options: CompileOptions, top: int = 5) -> list[str]:
    """``mesh="auto"`` with a profile: the ``top`` fastest predictions, and what the winner gains over the next."""
    if not ranking:
        return []
    device = next((p.device for p in ranking if p.device), "")
    lines = [f"mesh='auto' from {profile_source(options)}: the {min(top, len(ranking))} fastest of "
             f"{len(ranking)} predicted steps" + (f", modelled on {device}" if device else "")]
    lines += [f"  {i}. {prediction}" for i, prediction in enumerate(ranking[:top], 1)]
    measured = [p for p in ranking if p.measured is not None]
    if options.autotune and measured:
        best = measured[0]
        lines.append(f"  measured: the {len(measured)} fastest predicted trained on this job's ranks (autotune="
                     f"{options.autotune}); {best.label()} ran fastest, {best.measured * 1e3:.1f} ms"
                     + (f", {measured[1].label()} {measured[1].measured * 1e3:.1f} ms" if len(measured) > 1 else ""))
        return lines
    if len(ranking) > 1 and ranking[1].error is None:
        best, next_ = ranking[0], ranking[1]
        diffs = sorted(((next_.parts.get(k, 0.0) - best.parts.get(k, 0.0), k) for k in {*best.parts, *next_.parts}),
                       key=lambda d: -abs(d[0]))
        said = ", ".join(f"{k} {d * 1e3:+.2f} ms" for d, k in diffs if abs(d) >= 0.01 * best.step)
        lines.append(f"  why: {next_.label()} would take {(next_.step - best.step) * 1e3:.2f} ms more ({said})")
    over = [p for p in ranking if p.over_limit is not None and p.step < ranking[0].step]
    if over:
        lines.append(f"  over the memory limit, though predicted faster: {over[0].label()} "
                     f"({over[0].step * 1e3:.1f} ms) {over[0].error}"
                     + (f", and {len(over) - 1} more" if len(over) > 1 else ""))
    return lines


def _graphs(builds: list, options: CompileOptions, mesh: Mesh, compiler=None) -> list[str]:
    per = f"{options.microbatches} microbatch(es) per dp rank" + (f", {mesh.dp} dp ranks" if mesh.dp > 1 else "")
    lines = [f"captured graphs, at the shapes of one microbatch ({per}):"]
    for build in builds:
        c = build.captured
        kind = "training graph (forward, loss, backward)" if c.with_loss else "inference graph"
        mode = "" if c.training else " (eval mode)"
        lines.append(f"  {kind} {_shapes(c.input_shapes)}{mode}: {c.num_nodes} nodes, captured in {c.seconds:.2f} s")
    if not builds:
        lines.append("  none yet (the training graph is captured at the first step())")
    if compiler is not None:
        lines.append(f"  torch.compile (compile=True): {compiler.summary()} so far (each program once, on its first "
                     "call; the same shapes again compile nothing)")
    return lines


def _loss(build, options: CompileOptions, mesh: Mesh) -> list[str]:
    if not build.training:
        return ["loss: none (an inference graph: give a loss_fn and a target to compile training)"]
    token = build.captured.token_loss
    if token is not None:
        return [f"loss: token loss {token.node} (ignore_index={token.ignore_index}) summed per microbatch and "
                "divided by the number of counted tokens of the global batch"]
    return [f"loss: kept as captured and divided by the {options.microbatches * mesh.dp} microbatches of the "
            "global batch (exact for a mean over equal-sized microbatches)"]


def _parameters(build) -> list[str]:
    captured, plan = build.captured, build.tp_plan
    full = dict(captured.gm.named_parameters())
    # what this rank stores between steps, as compiled (a spread weight's rows, also of one its stages do not read)
    local = {name: build.stored_shape(name) for program in build.programs.values()
             for name, _ in program.gm.named_parameters()}
    local.update({name: build.stored_shape(name) for name in build.spread})
    holder = {name: s.index for s in build.stages for name in s.parameters}
    held = sum(math.prod(shape) * full[name].element_size() for name, shape in local.items())
    title = f"tensor-parallel plan over tp={build.mesh.tp}" if plan is not None else "tp=1, each whole"
    whole = sum(p.numel() * p.element_size() for p in full.values())
    even = whole / (build.mesh.tp * build.mesh.pp)
    lines = [f"parameters: {title}; rank {build.rank} (tp rank {build.coords['tp']}) holds {len(local)} of {len(full)} "
             f"tensors, {format_bytes(held)}: {held / whole:.0%} of the model's {format_bytes(whole)} (an even split "
             f"over tp x pp would be {format_bytes(even)}):"]
    rows = []
    for target, param in full.items():
        entry = plan.params.get(target) if plan is not None else None
        role, placement = (entry.role, repr(entry.placement)) if entry is not None else ("replicated", "R")
        elsewhere = build.layout(target).holder
        here = (_shape(local[target]) if target in local else f"(ep rank {elsewhere})" if elsewhere is not None
                else f"(stage {holder.get(target, '?')})")
        here += " (rows of pp)" if target in build.spread else ""
        why = _PREFIX.sub("", entry.reason) if entry is not None and entry.reason else ""
        rows.append((", ".join(captured.names.get(target, [target])), role, placement, _shape(param.shape) or
                     "scalar", here, why))
    lines += _table([("parameter", "role", "placement", "full", "local", "why"), *rows], right=())
    lines += [f"  note: {note}" for note in [*(plan.notes if plan is not None else []), *build.notes]]
    return lines


def _context_parallel(build) -> list[str]:
    plan = build.cp_plan
    if plan is None:
        return []
    lines = [f"context-parallel plan over cp={plan.size}: attention {plan.attention}"
             + (", load-balanced chunks" if plan.load_balance else "")]
    for name, dim in plan.inputs.items():
        lines.append(f"  {name}: sequence dim {dim}, {plan.seq_len} tokens -> {plan.seq_len // plan.size} per rank")
    for name, dim in plan.values.items():
        lines.append(f"  {name} (no input carries the sequence; the split starts there): dim {dim}, {plan.seq_len} "
                     f"tokens -> {plan.seq_len // plan.size} per rank")
    if plan.note:
        lines.append(f"  note: {plan.note}")
    positions = _ranges(plan.positions(build.coords["cp"]).tolist())
    lines.append(f"  cp rank {build.coords['cp']} holds token positions {positions}")
    return lines


def _experts(build) -> list[str]:
    """The expert-parallel plan, and each layer's load at the last step this rank ran: rows (tokens x top-k) per
    expert over its ep group, and the imbalance (the busiest over the mean) by expert and by ep rank."""
    plan = build.plan.ep_plan
    if plan is None:
        return []
    ep_rank = build.mesh.expert_coord(build.coords)
    carved = f"dp x cp = {build.mesh.dp} x {build.mesh.cp}" if build.mesh.cp > 1 else f"dp={build.mesh.dp}"
    capacity = (f"; capacity {plan.capacity} of an even share of each rank's rows per expert (rows beyond it "
                "dropped)" if plan.capacity is not None else "; dropless")
    lines = [f"expert-parallel plan over ep={plan.size} (carved from {carved}): {len(plan.layers)} "
             f"layer(s) of experts split; rank {build.rank} is ep rank {ep_rank}{capacity}"]
    for layer in plan.layers:
        per = layer.experts // plan.size
        stacks = ", ".join(build.captured.names.get(w, [w])[0] for w in layer.weights)
        lines.append(f"  {layer.where}: {layer.experts} experts, this rank holds {ep_rank * per}-"
                     f"{(ep_rank + 1) * per - 1} of {stacks}")
    routes = [m for program in build.programs.values() for m in program.gm.modules() if isinstance(m, ExpertRoute)]
    for i, route in enumerate(routes):
        if route.last is None:
            continue
        load = route.last.float()
        by_rank = load.view(plan.size, -1).sum(1)
        dropped = ""
        if route.dropped is not None:
            lost, rows = route.dropped.tolist()
            dropped = f"; {lost} of this rank's {rows} rows dropped beyond the capacity ({lost / max(rows, 1):.1%})"
        lines.append(f"  layer {i}, last step: rows per expert {load.long().tolist()}; imbalance "
                     f"{(load.max() / load.mean().clamp(min=1e-9)).item():.2f} by expert, "
                     f"{(by_rank.max() / by_rank.mean().clamp(min=1e-9)).item():.2f} by ep rank{dropped}")
    lines += [f"  note: {note}" for note in plan.notes]
    return lines


def _pipeline(build) -> list[str]:
    part = build.partition
    if part is None:
        return []
    p, v, m = build.mesh.pp, build.options.chunks, build.options.microbatches
    mine = sorted(build.programs)
    placement = schedules.placement_of(build.options.schedule)
    sim = schedules.simulate(build.actions, p, v, placement=placement)
    formula, bubble = schedules.bubble_formula(build.options.schedule, p, m, v)
    lines = [
        f"pipeline: {build.num_stages} stages on {p} pp ranks" + (f" ({v} chunks per rank)" if v > 1 else "")
        + f"; rank {build.rank} (pp={build.coords['pp']}) runs stage{'s' if len(mine) > 1 else ''} "
        + ", ".join(map(str, mine)),
        f"  cuts after {', '.join(part.cut_after)} (of {part.candidates} places where the fewest values cross), "
        f"sending {', '.join(format_bytes(b) for b in part.crossing_bytes)} per microbatch",
        f"  stage costs {', '.join(f'{c:.3g}' for c in part.costs)} (largest over mean: {part.balance:.2f}); "
        f"parameters per stage {', '.join(format_bytes(b) for b in part.param_bytes)} (the largest holds "
        f"{part.largest_param_share:.0%}; balanced for {build.options.pipeline_balance})",
        f"  schedule {build.options.schedule}, {m} microbatch(es): simulated bubble {sim.bubble:.1%} (formula "
        f"{formula} = {bubble:.1%}); at most {max(sim.peak_in_flight.values()):.2g} "
        "stage-equivalents of activations in flight",
    ]
    for name, ranks in build.tied.items():
        names = ", ".join(build.captured.names.get(name, [name]))
        lines.append(f"  {names} is used on pp ranks {sorted(ranks)}: its gradients are summed there")
    if build.spread:
        shown = [", ".join(build.captured.names.get(name, [name])) for name in build.spread]
        lines.append(f"  {len(shown)} weight(s) spread over the pp ranks (each stores its rows; gathered for each "
                     f"step, gradients reduce-scattered): {'; '.join(shown[:6])}{' ...' if len(shown) > 6 else ''}")
    if build.held_bytes:
        lines.append(f"  parameters stored per pp rank {', '.join(format_bytes(b) for b in build.held_bytes)} (the "
                     f"largest holds {build.largest_held_share:.0%} of the parameters the stages read)")
    drawn = schedules.simulate(build.actions, p, v, forward_cost=1.0, backward_cost=1.0, placement=placement)
    grid = schedules.render(build.actions, p, sim=drawn).splitlines()
    grid[build.coords["pp"]] += f"   <- rank {build.rank}"
    lines += [f"  timeline ({build.options.schedule}): one row per pp rank, time to the right; F3/B3 = forward/"
              "backward of microbatch 3" + (" (I3/W3: its input/weight gradients)" if placement == "v" or
                                            build.options.schedule == "zb-h1" else "")
              + (" (F3.5: of stage 5)" if v > 1 else "") + ", . = idle",
              *(f"  {row}" for row in grid)]
    return lines


def _code(build) -> list[list[str]]:
    sections = []
    for index, program in sorted(build.programs.items()):
        title = f"code of rank {build.rank}:"
        if build.stages:
            received, sent = build.local_specs[index]
            what = [f"stage {index} of {build.num_stages}"]
            if received:
                what.append(f"receives {_specs(received)} from pp rank {(index - 1) % build.mesh.pp}")
            if sent:
                what.append(f"sends {_specs(sent)} to pp rank {(index + 1) % build.mesh.pp}")
            title = f"code of rank {build.rank}, {'; '.join(what)}:"
        sections.append([title, *program.code.strip().splitlines(), *_modules(program.gm)])
    return sections


def _modules(gm) -> list[str]:
    """The communication modules the code calls, with this rank's settings (its vocab range, its positions)."""
    found = [(node.target, _collective(gm, node)) for node in gm.graph.nodes if _collective(gm, node) is not None]
    if not found:
        return []
    width = max(len(name) for name, _ in found)
    return ["  where", *(f"    self.{name:<{width}} = {module!r}" for name, module in found)]


def _collectives(build) -> list[str]:
    rows = []
    for index, program in sorted(build.programs.items()):
        stage = f"{index}" if build.stages else "-"
        for (axis, direction, kind, op), (calls, size) in collectives(program.gm).items():
            if direction == "forward" or build.training:  # an inference graph has no backward
                rows.append((stage, axis, direction, kind, op, str(calls), format_bytes(size)))
        if build.stages:
            rows += _pipeline_rows(build, index, stage)
    order = {"tp": 0, "cp": 1, "pp": 2}
    rows.sort(key=lambda r: (r[0], order.get(r[1], 3), r[2] != "forward"))
    m = build.options.microbatches
    lines = [f"collectives of rank {build.rank} per microbatch ({m} per step):"]
    lines += _table([("stage", "axis", "pass", "collective", "op", "calls", "bytes"), *rows], right=(5, 6)) \
        if rows else ["  none"]
    lines += [f"  fallback: {note}" for note in build.fallbacks]
    return lines + _per_step(build)


def _pipeline_rows(build, index: int, stage: str) -> list[tuple]:
    """Forward activations cross each cut; in training their gradients come back the other way."""
    rows, p = [], build.mesh.pp
    placement = schedules.placement_of(build.options.schedule)
    received, sent = build.local_specs[index]
    here = schedules.stage_rank(index, p, placement)
    for specs, peer, there, back in ((received, schedules.stage_rank(index - 1, p, placement) if index else 0, "recv",
                                      "send"),
                                     (sent, schedules.stage_rank(min(index + 1, build.num_stages - 1), p, placement),
                                      "send", "recv")):
        if not specs or peer == here:  # the V's tip hands over in memory
            continue
        size = format_bytes(spec_bytes(specs))
        rows.append((stage, "pp", "forward", there, f"activations {'from' if there == 'recv' else 'to'} pp rank "
                     f"{peer}", "1", size))
        if build.training:
            rows.append((stage, "pp", "backward", back, f"gradients {'to' if back == 'send' else 'from'} pp rank "
                         f"{peer}", "1", size))
    return rows


def _per_step(build) -> list[str]:
    mesh, options, lines = build.mesh, build.options, []
    data = mesh.dp * mesh.cp
    if data > 1 and build.training:
        # what the dp x cp sum moves: each gradient at its tp shard's shape (a spread weight's whole, not its rows)
        ep_plan = build.plan.ep_plan
        experts = {**ep_plan.params(), **ep_plan.holders()} if ep_plan is not None else {}
        params = {name: q for program in build.programs.values() for name, q in program.gm.named_parameters()
                  if q.requires_grad and name not in experts}
        grads = format_bytes(sum(math.prod(build.tp_local_shape(name)) * q.element_size()
                                 for name, q in params.items()))
        over = " x ".join(f"{a}={mesh.degree(a)}" for a in ("dp", "cp") if mesh.degree(a) > 1)
        if options.data_parallel == "fsdp":
            gathers = "once per step" if mesh.pp > 1 else "for each microbatch's forward and backward"
            lines.append(f"per step: FSDP2 over {data} ranks ({over}): this rank's parameters all-gathered {gathers} "
                         f"({grads}), its gradients reduce-scattered (sum, {grads}); each rank keeps 1/{data} of "
                         "them, of their gradients and of the optimizer state")
        else:
            how = ("in buckets launched during the last backward that finishes them" if mesh.pp > 1
                   else "bucketed by DistributedDataParallel during the last microbatch's backward")
            lines.append(f"per step: all-reduce (sum) of this rank's gradients over {data} ranks ({over}): "
                         f"{grads}, {how}")
        if experts:
            replicas = mesh.expert_replicas
            held = format_bytes(sum(math.prod(build.stored_shape(n)) * q.element_size() for program in
                                    build.programs.values() for n, q in program.gm.named_parameters() if n in experts))
            lines.append(f"per step: the experts' gradients ({held}) " + (
                f"all-reduced (sum) over the {replicas} ranks holding the same experts" if replicas > 1 else
                "are not summed: the all-to-alls brought every token's gradient to its expert's one rank"))
        count = " and of the token count" if options.local_batch and build.captured.token_loss is not None else ""
        lines.append(f"per step: all-reduce (sum) of the loss{count} over {data} ranks ({over}): 4 B each")
    if build.tied:
        lines.append("per step: tied parameters' gradients summed over the pp ranks that use them")
    if build.spread:
        whole = format_bytes(build.spread_bytes)
        lines.append(f"per step: the {len(build.spread)} spread weight(s) all-gathered over the {mesh.pp} pp ranks "
                     f"before the first forward ({whole} whole), their gradients reduce-scattered after the last "
                     f"backward ({whole}); each pp rank stores 1/{mesh.pp} of them, of their gradients and of the "
                     "optimizer state")
    return lines


def _lint(findings: list, mesh: Mesh) -> list[str]:
    if not findings:
        return [f"lint: no finding for {mesh} (the planner's rules)"]
    return ["lint (the planner's rules):", *(f"  {finding}" for finding in findings)]


# ------------------------------------------------------------------------------------------- counting


def communication(gm) -> dict[tuple[str, str, str], tuple[int, int]]:
    """Collectives one run of ``gm`` (forward and backward) makes: (direction, kind, op) -> (calls, bytes).

    The op name is prefixed by the mesh axis it runs on (``tp`` or ``cp``). Shapes are the local ones
    the passes recorded on each node.
    """
    found: dict[tuple[str, str, str], tuple[int, int]] = {}
    for (axis, direction, kind, op), counted in collectives(gm).items():
        found[(direction, kind, f"{axis} {op}")] = counted
    return found


def collectives(gm) -> dict[tuple[str, str, str, str], tuple[int, int]]:
    """Collectives one run of ``gm`` makes, by mesh axis: (axis, direction, kind, op) -> (calls, bytes)."""
    found: dict[tuple[str, str, str, str], tuple[int, int]] = {}
    for node in gm.graph.nodes:
        module = _collective(gm, node)
        if module is None:
            continue
        arg = meta.val(node.args[0]) if node.args and hasattr(node.args[0], "meta") else None
        shape = [dim_size(d) for d in arg.shape] if arg is not None else []  # a routed size: at its upper bound
        forward, backward = module.comm_bytes(shape, arg.element_size() if arg is not None else 4)
        axis, op = node.meta.get(meta.AXIS, "tp"), type(module).__name__
        counts = getattr(module, "calls", (1, 1))
        for direction, kind, size, count in (("forward", module.kind, forward, counts[0]),
                                             ("backward", module.backward_kind, backward, counts[1])):
            if size:
                calls, total = found.get((axis, direction, kind, op), (0, 0))
                found[(axis, direction, kind, op)] = (calls + count, total + size)
    return found


def _collective(gm, node) -> torch.nn.Module | None:
    """The communication module a ``call_module`` node runs, or None when the node does not communicate."""
    if node.op != "call_module":
        return None
    module = gm.get_submodule(node.target)
    return module if hasattr(module, "comm_bytes") and getattr(module, "size", 1) > 1 else None


# ---------------------------------------------------------------------------------------------- text


def _table(rows: list[tuple], right: tuple[int, ...]) -> list[str]:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return [("  " + "  ".join(str(c).rjust(w) if i in right else str(c).ljust(w)
                              for i, (c, w) in enumerate(zip(row, widths, strict=True)))).rstrip() for row in rows]


def _shape(shape) -> str:
    return "x".join(map(str, shape))


def _shapes(key: tuple) -> str:
    return ", ".join(_shape(s) if isinstance(s, tuple) else repr(s) for s in key)


def _specs(specs: list) -> str:
    return ", ".join(f"{_shape(s.shape)} {str(s.dtype).removeprefix('torch.')}" for s in specs)


def spec_bytes(specs: list) -> int:
    return sum(math.prod(s.shape) * torch.empty((), dtype=s.dtype).element_size() for s in specs)


def _ranges(positions: list[int]) -> str:
    spans, start = [], None
    for i, p in enumerate(positions):
        start = p if start is None else start
        if i + 1 == len(positions) or positions[i + 1] != p + 1:
            spans.append(f"{start}..{p}")
            start = None
    return ", ".join(spans)


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)
