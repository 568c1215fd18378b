"""``explain()``: what the compiler did to a model, as a report a person reads.

Sections: the mesh and this rank's place in it; the captured graphs (nodes, capture time); every
parameter with its placement on each mesh axis and its bytes on this rank; how the loss is
normalised; the collectives that run per training step with their bytes.
"""

from __future__ import annotations

from autoshard.passes.tensor_parallel import FALLBACKS
from autoshard.runtime import schedules


def explain(pm) -> str:
    lines = [f"autoshard: {type(pm.model).__name__} on {pm.mesh} (world size {pm.mesh.world_size}), rank {pm.rank}"]
    lines += _graphs(pm)
    lines += _parameters(pm)
    lines += _loss(pm)
    lines += _pipeline(pm)
    lines += _collectives(pm)
    return "\n".join(lines)


def _pipeline(pm) -> list[str]:
    pipe = pm.pipeline
    if pipe is None or pipe.partition is None:
        return []
    part = pipe.partition
    m = pm.microbatches
    sim = schedules.simulate(pipe.actions, pipe.p, pipe.v)
    formula = (pipe.p - 1) / (pipe.v * m + pipe.p - 1)
    lines = [
        "",
        f"pipeline: {pipe.num_stages} stages on {pipe.p} ranks, schedule {pipe.schedule_name}, {m} microbatches"
        + (f", {pipe.v} chunks per rank" if pipe.v > 1 else "")
        + f"; this rank runs stages {pipe.mine}",
        f"  cuts after {', '.join(part.cut_after)} (one of {part.candidates} places where the fewest values cross), "
        f"sending {', '.join(_bytes(b) for b in part.crossing_bytes)} per microbatch",
        f"  stage costs {', '.join(f'{c:.3g}' for c in part.costs)} (largest over mean: {part.balance:.2f})",
        f"  simulated bubble {sim.bubble:.1%} (formula (p-1)/(v*m+p-1) = {formula:.1%}); activations in flight "
        f"at most {max(sim.peak_in_flight.values()):.2g} stage-equivalents per rank",
    ]
    for name, ranks in pipe.tied.items():
        lines.append(f"  {name.removeprefix('model.')} is used on pp ranks {sorted(ranks)}: gradients summed there")
    lines.append("  " + schedules.render(pipe.actions, pipe.p, sim=schedules.simulate(
        pipe.actions, pipe.p, pipe.v, forward_cost=1.0, backward_cost=1.0)).replace("\n", "\n  "))
    return lines


def _graphs(pm) -> list[str]:
    lines = ["", "captured graphs:"]
    for program in pm._train.values():
        lines.append(_graph("training ", program.captured))
    for c, _ in pm._infer.values():
        lines.append(_graph("inference", c))
    if len(lines) == 2:
        lines.append("  none yet (the training graph is captured at the first step())")
    return lines


def _graph(kind: str, c) -> str:
    mode = "" if c.training else " (eval mode)"
    return f"  {kind} {_shapes(c.input_shapes)}{mode}: {c.num_nodes} nodes, captured in {c.seconds:.2f} s"


def _parameters(pm) -> list[str]:
    names = pm._names() if (pm._train or pm._infer) else {}
    store = pm.replica.store
    local_total = sum(p.numel() * p.element_size() for p in store.parameters())
    held = sum(1 for target in names if store._lookup(target) is not None)
    lines = ["", f"parameters: {held} of {len(names)} tensors on this rank, {_bytes(local_total)}"]
    width = max((len(", ".join(n)) for n in names.values()), default=10)
    for target, originals in names.items():
        local = store._lookup(target)
        if local is None:
            lines.append(f"  {', '.join(originals):<{width}}  on another pipeline stage")
            continue
        full = pm.plan.params[target] if pm.plan is not None else None
        role = f"tp {full.role} {full.placement!r}" if full is not None else "replicated"
        why = f" ({full.reason})" if full is not None and full.reason else ""
        shape = "x".join(map(str, local.shape))
        lines.append(f"  {', '.join(originals):<{width}}  {role:<24} local {shape:<10}{why}")
    lines += [f"  note: {note}" for note in (pm.plan.notes if pm.plan is not None else [])]
    return lines


def _loss(pm) -> list[str]:
    programs = list(pm._train.values())
    if not programs:
        return []
    token = programs[-1].token_loss
    if token is not None:
        how = (f"token loss {token.node} (ignore_index={token.ignore_index}) summed per microbatch and divided by "
               "the number of counted tokens of the global batch")
    else:
        how = (f"loss kept as captured and divided by the {pm.microbatches * pm.mesh.dp} microbatches of the "
               "global batch (exact for a mean over equal-sized microbatches)")
    return ["", f"loss: {how}"]


def _collectives(pm) -> list[str]:
    lines = ["", "collectives per training step:"]
    if pm._train:
        program = next(reversed(pm._train.values()))
        for (direction, kind, op), (calls, size) in communication(program.gm).items():
            total = calls * pm.microbatches
            axis, name = op.split(" ", 1)
            amount = _bytes(size * pm.microbatches)
            lines.append(f"  {axis} {direction:<8} {kind:<10} x{total:<3} {amount:>10}  ({name})")
        for note in program.gm.meta.get(FALLBACKS, []):
            lines.append(f"  fallback: {note}")
    data = pm.mesh.dp * pm.mesh.cp
    if data > 1 and pm.replica.sharded_data:
        # FSDP2 parameters are DTensors: their shape is the whole (tp-local) tensor
        grad_bytes = sum(p.numel() * p.element_size() for p in pm.replica.store.parameters() if p.requires_grad)
        gathers = "once per step" if pm.pipeline is not None else "for each microbatch's forward and backward"
        lines.append(f"  FSDP2 over dp x cp ({data} ranks): parameters all-gathered {gathers}, {_bytes(grad_bytes)}; "
                     f"gradients reduce-scattered (sum), {_bytes(grad_bytes)}")
    elif data > 1:
        grad_bytes = sum(p.numel() * p.element_size() for p in pm.replica.store.parameters() if p.requires_grad)
        how = ("bucketed, each bucket launched during the last backward that finishes its gradients"
               if pm.pipeline is not None
               else "bucketed by DistributedDataParallel, overlapped with the last microbatch's backward")
        lines.append(f"  dp x cp all-reduce (sum) of gradients over {data} ranks: {_bytes(grad_bytes)} ({how})")
        count = " and of the token count: 4 B" if pm.local_batch else ""
        lines.append(f"  dp x cp all-reduce (sum) of the loss: 4 B{count}")
    if len(lines) == 2:
        lines.append("  none")
    return lines


def communication(gm) -> dict[tuple[str, str, str], tuple[int, int]]:
    """Collectives one run of ``gm`` (forward and backward) makes: (direction, kind, op) -> (calls, bytes).

    The op name is prefixed by the mesh axis it runs on (``tp`` or ``cp``). Shapes are the local ones
    the passes recorded on each node.
    """
    found: dict[tuple[str, str, str], tuple[int, int]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = gm.get_submodule(node.target)
        if not hasattr(module, "comm_bytes") or getattr(module, "size", 1) == 1:
            continue
        arg = node.args[0].meta.get("val") if node.args and hasattr(node.args[0], "meta") else None
        shape = list(arg.shape) if arg is not None else []
        forward, backward = module.comm_bytes(shape, arg.element_size() if arg is not None else 4)
        op = f"{str(node.target).split('_')[0]} {type(module).__name__}"
        counts = getattr(module, "calls", (1, 1))
        passes = (("forward", module.kind, forward, counts[0]), ("backward", module.backward_kind, backward, counts[1]))
        for direction, kind, size, count in passes:
            if size:
                calls, total = found.get((direction, kind, op), (0, 0))
                found[(direction, kind, op)] = (calls + count, total + size)
    return found


def _shapes(key: tuple) -> str:
    return ", ".join("x".join(map(str, s)) if isinstance(s, tuple) else repr(s) for s in key)


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
