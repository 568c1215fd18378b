"""Per-rank checks of expert parallelism driven as a training loop drives a mixture of experts.

Each function runs on every rank of a worker pool (``launcher.py``) and returns plain data. The model is a corpus
architecture (transformers' own MoE, built tiny) or ``zoo/moe`` (the zoo's torchtitan-style one, whose forward
takes the ids alone: its padded rows are ignored by the targets only); the reference is the same model trained in
one process.
"""

from __future__ import annotations

import torch
from corpus import build as build_corpus

import autoshard

from harness import models
from harness.golden import groups_for

TOL = {"rtol": 1e-4, "atol": 1e-5}


def build(name: str, *, seed: int = 0):
    zoo = name.removeprefix("zoo/")
    return models.build(zoo, seed=seed) if zoo != name else build_corpus(name, seed=seed)
# AdamW divides each gradient by the root of its running square: an element whose gradient is rounding-sized (an
# expert that few tokens reached) moves by up to lr either way, whatever its size. Parameters after AdamW steps are
# compared within 2% of lr per step (tp=2 alone, without ep, differs by 1.3e-5 after 3 steps at lr 1e-3); the
# gradients before each step are compared at the tolerance above.
LR = 1e-3


def _padded(case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The case's ids with uneven right padding, its ``attention_mask``, and targets ignored at the padding."""
    ids, target = case.inputs[0], case.target.clone()
    mask = torch.ones_like(ids)
    for row, pad in enumerate([0, 3, 0, 7, 1, 0, 5, 2]):
        if pad:
            mask[row, -pad:] = 0
            target[row, -pad:] = -100
    return ids, mask, target


def _groups(named, decay: float = 0.1) -> list[dict]:
    named = list(named)
    return [{"params": [p for n, p in named if p.dim() >= 2 and "norm" not in n], "weight_decay": decay},
            {"params": [p for n, p in named if not (p.dim() >= 2 and "norm" not in n)], "weight_decay": 0.0}]


def _differing_gradients(pm, reference) -> dict[str, float]:
    """Each gradient of ``pm`` (gathered to full shape) beyond the tolerance of the reference's: its largest
    difference."""
    grads = pm.gradients()
    return {n: (grads[n] - p.grad).abs().max().item() for n, p in reference.named_parameters()
            if not torch.allclose(grads[n], p.grad, **TOL)}


def training_loop(name: str, mesh_kwargs: dict, *, steps: int = 3, accumulate: int = 2, router_loss: bool = False,
                  **options) -> dict:
    """AdamW with weight-decay groups built from ``named_parameters()``, ``accumulate`` ``step()`` calls per optimizer
    step over padded batches with their ``attention_mask``, global-norm clipping: every call's loss and every
    parameter after ``steps`` optimizer steps, against the model trained in one process. ``router_loss``: the loss
    holds the router's load-balancing term (``with_router_loss``), over the whole batch as the model computes it."""
    case, reference = build(name), build(name).model
    if router_loss:
        case, case.loss_fn = with_router_loss(name)
        reference.config.output_router_logits = True
    ids, mask, target = _padded(case)
    masked = not name.startswith("zoo/")
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=(ids, mask)[:1 + masked], loss_fn=case.loss_fn,
                               target=target, groups=groups_for(mesh), **options)
    opt = torch.optim.AdamW(_groups(pm.named_parameters()), lr=LR)
    ref_opt = torch.optim.AdamW(_groups(reference.named_parameters()), lr=LR)
    gen = torch.Generator().manual_seed(5)
    worst_loss, bad_grads = 0.0, {}
    for _ in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        for _ in range(accumulate):
            shuffled = torch.randperm(ids.shape[0], generator=gen)
            batch = (ids[shuffled], mask[shuffled])[:1 + masked]
            loss = pm.step(*batch, target=target[shuffled], loss_scale=1 / accumulate)
            ref = case.loss_fn(reference(*batch), target[shuffled]) / accumulate
            ref.backward()
            worst_loss = max(worst_loss, abs(loss.item() - ref.item()))
        norm = pm.clip_grad_norm_(1.0)
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        bad_grads.update(_differing_gradients(pm, reference))
        opt.step()
        ref_opt.step()
    full = pm.full_parameters()
    worst = {n: (full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters()}
    bad = {n: d for n, d in worst.items() if d > 0.02 * LR * steps}
    held = sum(p.numel() for p in pm.parameters()) / sum(p.numel() for p in reference.parameters())
    experts = {n: tuple(p.shape) for n, p in pm.named_parameters() if p.dim() == 3}
    listed = {n: p.numel() for n, p in reference.named_parameters() if ".experts." in n}  # the zoo's experts
    listed_share = sum(p.numel() for n, p in pm.named_parameters() if n in listed) / max(1, sum(listed.values()))
    return {"listed_share": listed_share, "loss": worst_loss, "norm": abs(norm.item() - ref_norm.item()), "bad": bad,
            "bad_grads": bad_grads,
            "worst": max(worst.values()), "held": held, "experts": experts, "explain": pm.explain()}


def capacity(mesh_kwargs: dict, factor: float, *, steps: int = 2) -> dict:
    """The zoo's mixture at ``mesh_kwargs`` with ``expert_capacity=factor``, SGD steps: every loss, gradient and the
    parameters after the steps against the model in one process whose experts drop, on each dp rank's part of the
    batch alone, the rows beyond the same capacity (the reference: each part's cross-entropy sum over the whole
    batch's counted tokens, as the parallel loss is normalised)."""
    import torch.nn.functional as F

    case, reference = models.build("moe"), models.build("moe").model
    for module in reference.modules():
        if isinstance(module, models.GroupedExperts):
            module.capacity = factor
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, groups=groups_for(mesh), expert_capacity=factor)
    ids, target = case.inputs[0], case.target

    def reference_loss():
        sums = [F.cross_entropy(reference(i).flatten(0, 1), t.flatten(), reduction="sum")
                for i, t in zip(ids.chunk(mesh.dp), target.chunk(mesh.dp), strict=True)]
        return sum(sums) / (target != -100).sum()

    return _sgd_steps(pm, reference, lambda: pm.step(ids, target=target), reference_loss, steps,
                      torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1))


def _sgd_steps(pm, reference, step, reference_loss, steps: int, opt, ref_opt) -> dict:
    """``steps`` optimizer steps of ``pm`` (``step()``) and of ``reference`` (``reference_loss()``): the worst loss
    difference, the gradients beyond the tolerance, and the parameters after the steps beyond it."""
    worst_loss, bad_grads = 0.0, {}
    for _ in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = step()
        ref = reference_loss()
        ref.backward()
        worst_loss = max(worst_loss, abs(loss.item() - ref.item()))
        bad_grads.update(_differing_gradients(pm, reference))
        opt.step()
        ref_opt.step()
    full = pm.full_parameters()
    bad = {n: (full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters()
           if not torch.allclose(full[n], p.detach(), **TOL)}
    return {"loss": worst_loss, "bad_grads": bad_grads, "bad": bad, "explain": pm.explain()}


def router_loss_local(name: str, mesh_kwargs: dict, *, steps: int = 2, **options) -> dict:
    """The router's load-balancing loss with ``batch_statistics="local"``, driven as a loop drives it: a padded batch
    with its ``attention_mask``, weight-decay groups from ``named_parameters()``, SGD steps. The reference is the model
    in one process computing the loss on each part (each dp rank's slice, each microbatch of it) and averaging them,
    as DDP with gradient accumulation does: every loss, every gradient and the parameters after the steps."""
    case, loss_fn = with_router_loss(name)
    reference, reference.config.output_router_logits = build(name).model, True
    ids, mask, target = _padded(case)
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=(ids, mask), loss_fn=loss_fn, target=target,
                               groups=groups_for(mesh), batch_statistics="local", **options)
    parts = mesh.dp * options.get("microbatches", 1)

    def reference_loss():
        return sum(loss_fn(reference(i, m), t) for i, m, t in zip(ids.chunk(parts), mask.chunk(parts),
                                                                   target.chunk(parts), strict=True)) / parts

    return _sgd_steps(pm, reference, lambda: pm.step(ids, mask, target=target), reference_loss, steps,
                      torch.optim.SGD(_groups(pm.named_parameters()), lr=0.1),
                      torch.optim.SGD(_groups(reference.named_parameters()), lr=0.1))


def inference(name: str, mesh_kwargs: dict, **options) -> dict:
    """The trained parallel model called for its logits, as ``model(ids)`` is: equal to the model's own."""
    case = build(name)
    mesh = autoshard.Mesh(**mesh_kwargs)
    expected = case.model(*case.inputs)
    expected = getattr(expected, "logits", expected)  # a zoo model returns its logits
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, groups=groups_for(mesh), **options)
    pm.eval()
    logits = pm(*case.inputs)
    logits = getattr(logits, "logits", logits)
    return {"worst": (logits - expected).abs().max().item()}


def pretrained_between_splits(name: str, save_mesh: dict, load_mesh: dict, directory: str) -> dict:
    """Trained one step at ``save_mesh``, written by ``pm.save_pretrained``; a model built with another seed at
    ``load_mesh`` reads it with ``pm.load_pretrained`` (each rank its experts' rows only): the same state dict."""
    case = build(name)
    mesh = autoshard.Mesh(**save_mesh)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, groups=groups_for(mesh))
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    pm.step(*case.inputs, target=case.target)
    opt.step()
    pm.save_pretrained(directory)
    saved = pm.state_dict()
    other = build(name, seed=1)
    mesh = autoshard.Mesh(**load_mesh)
    pm = autoshard.parallelize(other.model, mesh, example_inputs=other.inputs, loss_fn=other.loss_fn,
                               target=other.target, groups=groups_for(mesh))
    read = pm.load_pretrained(directory)
    loaded = pm.state_dict()
    total = sum(v.numel() * v.element_size() for v in saved.values())
    return {"differ": [k for k in saved if not torch.equal(saved[k], loaded[k])], "read": read, "total": total}


def compiled(name: str, mesh_kwargs: dict, *, steps: int = 3, **options) -> dict:
    """``compile=True`` over experts split by ep: exact over one step, then ``steps - 1`` more; the graphs the later
    steps compile (the rows each expert receives change from step to step)."""
    from autoshard.verify import compare

    case, reference = build(name), build(name).model
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, groups=groups_for(mesh), compile=True, **options)
    first = compare(reference, pm, case.inputs, case.target, loss_fn=case.loss_fn, steps=1)
    graphs = pm.compiler.graphs
    later = compare(reference, pm, case.inputs, case.target, loss_fn=case.loss_fn, steps=steps - 1)
    return {"ok": first.ok and later.ok, "report": f"{first}\n{later}", "graphs": graphs,
            "recompiled": pm.compiler.graphs - graphs}


def with_router_loss(name: str):
    """The case with its router's load-balancing loss in the loss, as transformers adds it to the cross-entropy."""
    import torch.nn.functional as F

    case = build(name)
    case.model.config.output_router_logits = True

    def loss_fn(output, target):
        ce = F.cross_entropy(output.logits.flatten(0, 1).float(), target.flatten(), ignore_index=-100)
        return ce + 0.02 * output.aux_loss

    return case, loss_fn


def router_loss(name: str, mesh_kwargs: dict, **options) -> dict:
    case, loss_fn = with_router_loss(name)
    mesh = autoshard.Mesh(**mesh_kwargs)
    report = autoshard.verify(case.model, mesh, case.inputs, loss_fn, target=case.target, groups=groups_for(mesh),
                              **options)
    return {"ok": report.ok, "report": str(report)}


def saved_whole(name: str, mesh_kwargs: dict, directory: str) -> dict:
    """One SGD step at ``mesh_kwargs``, then ``pm.save_pretrained`` (a zoo model gets an empty HuggingFace config to
    be written beside it): each tensor of the files against the unsharded model trained alike, and each rank's
    share of every stack of experts (3-D parameters) it holds."""
    from safetensors.torch import load_file
    from transformers import PretrainedConfig

    case, reference = build(name), build(name).model
    for model in (case.model, reference):
        model.config = getattr(model, "config", None) or PretrainedConfig()
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, groups=groups_for(mesh))
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    pm.step(*case.inputs, target=case.target)
    case.loss_fn(reference(*case.inputs), case.target).backward()
    opt.step()
    ref_opt.step()
    pm.save_pretrained(directory)
    saved = load_file(f"{directory}/model.safetensors")
    expected = dict(reference.named_parameters())
    stacks = {n: p for n, p in expected.items() if p.dim() == 3}
    held = {n: p.shape[0] / stacks[n].shape[0] for n, p in pm.named_parameters() if n in stacks}
    return {"differ": sorted(n for n, p in expected.items()
                             if n not in saved or not torch.allclose(saved[n], p.detach(), **TOL)),
            "stacks": {n: tuple(saved[n].shape) for n in stacks}, "held": held}


def frozen_below(name: str, mesh_kwargs: dict, frozen: tuple[str, ...], *, steps: int = 2) -> dict:
    """The parameters whose names start with one of ``frozen`` frozen (``requires_grad=False``) before
    ``parallelize``, as a fine-tuning run freezes them; SGD steps over the others: every loss, every trained gradient
    and every parameter after the steps against the model in one process."""
    case, reference = build(name), build(name).model
    for model in (case.model, reference):
        for n, p in model.named_parameters():
            p.requires_grad_(not n.startswith(frozen))
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, groups=groups_for(mesh))
    opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.1)
    ref_opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1)
    worst_loss, bad_grads = 0.0, {}
    for _ in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = pm.step(*case.inputs, target=case.target)
        ref = case.loss_fn(reference(*case.inputs), case.target)
        ref.backward()
        worst_loss = max(worst_loss, abs(loss.item() - ref.item()))
        grads = pm.gradients()
        bad_grads.update({n: (grads[n] - p.grad).abs().max().item() for n, p in reference.named_parameters()
                          if p.grad is not None and not torch.allclose(grads[n], p.grad, **TOL)})
        opt.step()
        ref_opt.step()
    full = pm.full_parameters()
    bad = {n: (full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters()
           if not torch.allclose(full[n], p.detach(), **TOL)}
    return {"loss": worst_loss, "bad_grads": bad_grads, "bad": bad}
