"""Resuming a training run under another mesh: 6 steps straight against 3 steps, save, load elsewhere, 3 more.

The run is what training scripts do: AdamW over two groups built from ``named_parameters()`` (weight decay
on matrices only), global-norm clipping, and a step LR schedule whose state travels in ``extra``. The
reference is the unsharded model trained 6 steps straight; the second half starts from a model built with
another seed, so everything it ends with came from the checkpoint.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

import autoshard

from golden import groups_for
from models import build as build_zoo

HALF = 3
CLIP = 0.05


def build(name: str, seed: int = 0):
    """A zoo model, or an architecture of the corpus as ``corpus/<name>``."""
    if name.startswith("corpus/"):
        from corpus.architectures import build as build_corpus

        return build_corpus(name.removeprefix("corpus/"), seed=seed)
    return build_zoo(name, seed=seed)


def _groups(named) -> list[dict]:
    named = list(named)
    return [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}]


def _optimizer(named):
    opt = torch.optim.AdamW(_groups(named), lr=3e-3, betas=(0.9, 0.95), eps=1e-6)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _train(step, clip, opt, scheduler, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        losses.append(float(step()))
        clip()
        opt.step()
        scheduler.step()
    return losses


def _parallel(case, mesh_kwargs: dict, options: dict):
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, groups=groups_for(mesh), **options)
    opt, scheduler = _optimizer(pm.named_parameters())
    return pm, opt, scheduler


def _train_parallel(pm, case, opt, scheduler, steps: int) -> list[float]:
    return _train(lambda: pm.step(*case.inputs, target=case.target), lambda: pm.clip_grad_norm_(CLIP), opt,
                  scheduler, steps)


def _reference_losses(name: str, steps: int = 2 * HALF):
    """The unsharded model trained ``steps`` steps straight: its losses, the model and its optimizer."""
    case = build(name)
    model = case.model
    opt, scheduler = _optimizer(model.named_parameters())

    def step():
        loss = case.loss_fn(model(*case.inputs), case.target)
        loss.backward()
        return loss.item()

    losses = _train(step, lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP), opt, scheduler, steps)
    return losses, model, opt


def first_half(name: str, mesh_kwargs: dict, path: str, options: dict | None = None, *, full: bool = False):
    """3 steps under ``mesh_kwargs``, then a checkpoint at ``path`` (or, with ``full``, the full state dicts that an
    unsharded run loads, written by rank 0 with torch.save). Returns the losses."""
    case = build(name)
    pm, opt, scheduler = _parallel(case, mesh_kwargs, options or {})
    losses = _train_parallel(pm, case, opt, scheduler, HALF)
    extra = {"step": HALF, "scheduler": scheduler.state_dict()}
    if full:
        state = {"model": pm.state_dict(), "optimizer": pm.optimizer_state_dict(opt), "extra": extra}
        if pm.rank == 0:
            torch.save(state, path)
    else:
        pm.save_checkpoint(path, optimizer=opt, extra=extra)
    return losses


def second_half(name: str, mesh_kwargs: dict, path: str, options: dict | None = None, *, full: bool = False) -> dict:
    """A model of another seed under ``mesh_kwargs`` resumes from ``path``, trains 3 steps; compared with the
    unsharded model trained 6 steps straight: losses, parameters and the optimizer's whole state."""
    case = build(name, seed=7)
    data = build(name)
    pm, opt, scheduler = _parallel(case, mesh_kwargs, options or {})
    if full:
        state = torch.load(path, weights_only=False)
        pm.load_state_dict(state["model"])
        pm.load_optimizer_state_dict(opt, state["optimizer"])
        extra = state["extra"]
    else:
        extra = pm.load_checkpoint(path, optimizer=opt)
    scheduler.load_state_dict(extra["scheduler"])
    losses = _train_parallel(pm, data, opt, scheduler, HALF)
    ref_losses, model, ref_opt = _reference_losses(name)
    return {"losses": losses, "reference": ref_losses, "step": extra["step"],
            **_differences(pm.full_parameters(), pm.optimizer_state_dict(opt), model, ref_opt)}


def _differences(params: dict, optimizer_state: dict, model, ref_opt) -> dict:
    expected = get_optimizer_state_dict(model, ref_opt)
    worst_param = max((params[n] - p.detach()).abs().max().item() for n, p in model.named_parameters())
    worst_state = 0.0
    assert set(optimizer_state["state"]) == set(expected["state"]), (
        sorted(set(optimizer_state["state"]) ^ set(expected["state"])))
    for name, values in expected["state"].items():
        assert set(values) == set(optimizer_state["state"][name]), (name, values.keys())
        for key, value in values.items():
            got = optimizer_state["state"][name][key]
            worst_state = max(worst_state, (torch.as_tensor(got) - value).abs().max().item())
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer_state["param_groups"]]
    expected_hyper = [{k: v for k, v in g.items() if k != "params"} for g in expected["param_groups"]]
    return {"param": worst_param, "state": worst_state, "hyper_equal": hyper == expected_hyper}


def single_first_half(name: str, path: str) -> list[float]:
    """3 steps of the unsharded model in one process; its state dicts saved as a single-process run saves them."""
    case = build(name)
    model = case.model
    opt, scheduler = _optimizer(model.named_parameters())

    def step():
        loss = case.loss_fn(model(*case.inputs), case.target)
        loss.backward()
        return loss.item()

    losses = _train(step, lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP), opt, scheduler, HALF)
    torch.save({"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, opt),
                "extra": {"step": HALF, "scheduler": scheduler.state_dict()}}, path)
    return losses


def single_second_half(name: str, path: str) -> dict:
    """The unsharded model of another seed resumes in one process from full state dicts a parallel run wrote."""
    model = build(name, seed=7).model
    data = build(name)
    opt, scheduler = _optimizer(model.named_parameters())
    state = torch.load(path, weights_only=False)
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, opt, state["optimizer"])
    scheduler.load_state_dict(state["extra"]["scheduler"])

    def step():
        loss = data.loss_fn(model(*data.inputs), data.target)
        loss.backward()
        return loss.item()

    losses = _train(step, lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP), opt, scheduler, HALF)
    ref_losses, ref_model, ref_opt = _reference_losses(name)
    params = dict(model.named_parameters())
    return {"losses": losses, "reference": ref_losses,
            **_differences(params, get_optimizer_state_dict(model, opt), ref_model, ref_opt)}
