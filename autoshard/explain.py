"""``explain()``: what the compiler did to a model, as a report a person reads.

Sections: the mesh and this rank's place in it; the captured graphs (nodes, capture time); every
parameter with its placement on each mesh axis and its bytes on this rank; how the loss is
normalised; the collectives that run per training step with their bytes.
"""

from __future__ import annotations

from autoshard.mesh import AXES


def explain(pm) -> str:
    lines = [f"autoshard: {type(pm.model).__name__} on {pm.mesh} (world size {pm.mesh.world_size}), rank {pm.rank}"]
    lines += _graphs(pm)
    lines += _parameters(pm)
    lines += _loss(pm)
    lines += _collectives(pm)
    return "\n".join(lines)


def _graphs(pm) -> list[str]:
    lines = ["", "captured graphs:"]
    for key, program in pm._train.items():
        c = program.captured
        lines.append(f"  training  {_shapes(key)}: {c.num_nodes} nodes, captured in {c.seconds:.2f} s")
    for key, c in pm._infer.items():
        lines.append(f"  inference {_shapes(key)}: {c.num_nodes} nodes, captured in {c.seconds:.2f} s")
    if len(lines) == 2:
        lines.append("  none yet (the training graph is captured at the first step())")
    return lines


def _parameters(pm) -> list[str]:
    params = list(pm.model.named_parameters())
    tied = _tied_names(pm.model)
    total = sum(p.numel() * p.element_size() for _, p in params)
    lines = ["", f"parameters: {len(params)} tensors, {_bytes(total)} on this rank"]
    placement = ", ".join(f"{axis}=Replicate" for axis in AXES if pm.mesh.degree(axis) > 1) or "single rank"
    width = max((len(n) for n, _ in params), default=10)
    for name, p in params:
        extra = f"  tied with {', '.join(tied[name])}" if name in tied else ""
        shape = str(tuple(p.shape))
        lines.append(f"  {name:<{width}}  {shape:<14} {placement}: whole tensor (no pattern applies){extra}")
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
    if pm.mesh.dp > 1:
        grad_bytes = sum(p.numel() * p.element_size() for p in pm.model.parameters() if p.requires_grad)
        lines.append(f"  dp all-reduce (sum) of gradients over {pm.mesh.dp} ranks: {_bytes(grad_bytes)} "
                     "(bucketed by DistributedDataParallel, overlapped with backward)")
        count = " and of the token count: 4 B" if pm.local_batch else ""
        lines.append(f"  dp all-reduce (sum) of the loss: 4 B{count}")
    if len(lines) == 2:
        lines.append("  none")
    return lines


def _tied_names(model) -> dict[str, list[str]]:
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {names[0]: names[1:] for names in by_id.values() if len(names) > 1}


def _shapes(key: tuple) -> str:
    return ", ".join("x".join(map(str, s)) if isinstance(s, tuple) else repr(s) for s in key)


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
