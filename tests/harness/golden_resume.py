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

from harness.golden import groups_for
from harness.models import build as build_zoo

HALF = 3
CLIP = 0.05


def build(name: str, seed: int = 0):
    """A zoo model; an architecture of the corpus as ``corpus/<name>``; ``gpt_vocab101`` (a vocabulary no tp
    degree divides: padded shards); ``hf_gpt2_dropout`` (GPT-2 with dropout 0.1 everywhere)."""
    if name.startswith("corpus/"):
        from corpus.architectures import build as build_corpus

        return build_corpus(name.removeprefix("corpus/"), seed=seed)
    if name == "gpt_vocab101":
        from harness.models import ZooCase, build_gpt_model, token_data, token_loss

        torch.manual_seed(seed)
        model = build_gpt_model(vocab=101)
        tokens, target = token_data(torch.Generator().manual_seed(seed + 2), vocab=101)
        return ZooCase(name, model, (tokens,), target, token_loss)
    if name == "hf_gpt2_dropout":
        from harness.golden_loop import _dropout_gpt2

        case = build_zoo("hf_gpt2", seed=seed)
        torch.manual_seed(seed)
        return _with_model(case, _dropout_gpt2())
    return build_zoo(name, seed=seed)


def _with_model(case, model):
    """``case`` with another model (the same data and loss)."""
    from harness.models import ZooCase

    return ZooCase(case.name, model, case.inputs, case.target, case.loss_fn)


def _groups(named) -> list[dict]:
    named = list(named)
    return [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}]


OPTIMIZERS = {
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), eps=1e-6),
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True),
    "adam": lambda groups: torch.optim.Adam(groups, lr=3e-3, amsgrad=True),
    # eps well above the rounding of a gradient: with the default one, Adagrad's first step is lr * sign(g) and a
    # gradient of 1e-9 that another summation order makes -1e-9 moves its parameter by 2 lr (resuming itself is
    # bit-exact under the same mesh for every kind: tests/test_resume.py)
    "adagrad": lambda groups: torch.optim.Adagrad(groups, lr=0.05, eps=1e-3),
    "rmsprop": lambda groups: torch.optim.RMSprop(groups, lr=1e-3, momentum=0.5, centered=True, eps=1e-3),
}
KIND = "adamw"  # the optimizer every function here builds (the tests of other kinds set it on each rank)


def _optimizer(named):
    opt = OPTIMIZERS[KIND](_groups(named))
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def with_optimizer(kind: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with every optimizer built as ``kind``."""
    global KIND
    KIND = kind
    try:
        return fn(*args, **kwargs)
    finally:
        KIND = "adamw"


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


def _train_unsharded(model, data, opt, scheduler, steps: int) -> list[float]:
    def step():
        loss = data.loss_fn(model(*data.inputs), data.target)
        loss.backward()
        return loss.item()

    return _train(step, lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP), opt, scheduler, steps)


def _reference_losses(name: str, steps: int = 2 * HALF):
    """The unsharded model trained ``steps`` steps straight: its losses, the model and its optimizer."""
    case = build(name)
    opt, scheduler = _optimizer(case.model.named_parameters())
    return _train_unsharded(case.model, case, opt, scheduler, steps), case.model, opt


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
    losses = _train_unsharded(model, case, opt, scheduler, HALF)
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
    losses = _train_unsharded(model, data, opt, scheduler, HALF)
    ref_losses, ref_model, ref_opt = _reference_losses(name)
    params = dict(model.named_parameters())
    return {"losses": losses, "reference": ref_losses,
            **_differences(params, get_optimizer_state_dict(model, opt), ref_model, ref_opt)}


def _full_params(pm) -> dict:
    return {n: t.clone() for n, t in pm.full_parameters().items()}


def same_mesh(name: str, mesh_kwargs: dict, path: str, options: dict | None = None) -> dict:
    """6 steps straight against 3, save, load into a model of another seed under the same mesh, 3 more: with the
    reduction order unchanged, the parameters and losses are bit-identical (dropout too: the random streams are
    restored). Each run starts from the same random state on each rank."""
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    case = build(name)
    pm, opt, scheduler = _parallel(case, mesh_kwargs, options or {})
    straight = _train_parallel(pm, case, opt, scheduler, 2 * HALF)
    expected = _full_params(pm)
    torch.manual_seed(100 + rank)
    case = build(name)
    pm, opt, scheduler = _parallel(case, mesh_kwargs, options or {})
    first = _train_parallel(pm, case, opt, scheduler, HALF)
    pm.save_checkpoint(path, optimizer=opt, extra={"scheduler": scheduler.state_dict()})
    torch.manual_seed(12345)  # what the resumed process would have: anything
    other = build(name, seed=7)
    pm, opt, scheduler = _parallel(other, mesh_kwargs, options or {})
    extra = pm.load_checkpoint(path, optimizer=opt)
    scheduler.load_state_dict(extra["scheduler"])
    second = _train_parallel(pm, case, opt, scheduler, HALF)
    got = _full_params(pm)
    return {"straight": straight, "resumed": first + second, "steps": pm.steps,
            "bitwise": all(torch.equal(got[n], expected[n]) for n in expected),
            "worst": max((got[n] - expected[n]).abs().max().item() for n in expected)}


def rng_under_another_mesh(name: str, save_mesh: dict, load_mesh: dict, path: str) -> dict:
    """Under another mesh the random streams are seeded from the checkpoint: the same on two loads, and not
    the same on two ranks."""
    import torch.distributed as dist

    case = build(name)
    torch.manual_seed(3)
    pm, opt, _ = _parallel(case, save_mesh, {})
    pm.save_checkpoint(path, optimizer=opt)
    draws = []
    for _ in range(2):
        torch.manual_seed(dist.get_rank() * 1000 + len(draws))
        pm2, opt2, _ = _parallel(build(name, seed=7), load_mesh, {})
        pm2.load_checkpoint(path, optimizer=opt2)
        draws.append(torch.rand(4))
    return {"repeatable": torch.equal(draws[0], draws[1]), "draw": draws[0].tolist()}


def refusals(path: str) -> dict:
    """Each bad input of resuming, with the error it gets (before any collective: every rank raises it)."""
    import os
    import shutil

    case = build("gpt")
    mesh = {"tp": 2}
    pm, opt, scheduler = _parallel(case, mesh, {})
    _train_parallel(pm, case, opt, scheduler, 1)
    out = {}

    def attempt(what, fn):
        try:
            fn()
            out[what] = "no error"
        except (ValueError, FileNotFoundError) as e:
            out[what] = f"{type(e).__name__}: {e}"

    pm.save_checkpoint(f"{path}/params", extra={"step": 1})
    pm.save_checkpoint(f"{path}/adamw", optimizer=opt)
    sgd = torch.optim.SGD(pm.parameters(), lr=0.1, momentum=0.9)
    attempt("no optimizer state", lambda: pm.load_checkpoint(f"{path}/params", optimizer=opt))
    attempt("another optimizer", lambda: pm.load_checkpoint(f"{path}/adamw", optimizer=sgd))
    lbfgs = torch.optim.LBFGS(pm.parameters())
    pm.step(*case.inputs, target=case.target)
    lbfgs.step(lambda: pm.step(*case.inputs, target=case.target))
    attempt("LBFGS", lambda: pm.save_checkpoint(f"{path}/lbfgs", optimizer=lbfgs))
    one_group = torch.optim.AdamW(pm.parameters())
    attempt("other groups", lambda: pm.load_checkpoint(f"{path}/adamw", optimizer=one_group))
    attempt("positions", lambda: pm.load_optimizer_state_dict(opt, opt.state_dict()))
    foreign = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
    attempt("foreign optimizer", lambda: pm.save_checkpoint(f"{path}/foreign", optimizer=foreign))
    llama = build("llama")
    other, other_opt, _ = _parallel(llama, mesh, {})
    attempt("another model", lambda: other.load_checkpoint(f"{path}/adamw", optimizer=other_opt))
    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 0:
        shutil.copytree(f"{path}/adamw", f"{path}/incomplete")
        os.remove(f"{path}/incomplete/__1_0.distcp")
    dist.barrier()
    attempt("missing file", lambda: pm.load_checkpoint(f"{path}/incomplete", optimizer=opt))
    attempt("missing directory", lambda: pm.load_checkpoint(f"{path}/nowhere"))
    pm.step(*case.inputs, target=case.target)  # the pool still works: nobody waits in a collective
    return out


def asynchronous_save(name: str, mesh_kwargs: dict, path: str) -> dict:
    """A checkpoint written in the background holds the state at the call, though training goes on meanwhile."""
    case = build(name)
    pm, opt, scheduler = _parallel(case, mesh_kwargs, {})
    _train_parallel(pm, case, opt, scheduler, 1)
    saved = _full_params(pm)
    saved_state = pm.optimizer_state_dict(opt)
    future = pm.save_checkpoint(path, optimizer=opt, asynchronous=True)
    _train_parallel(pm, case, opt, scheduler, 2)  # changes every parameter and moment while the write runs
    future.result()
    pm2, opt2, _ = _parallel(build(name, seed=7), mesh_kwargs, {})
    pm2.load_checkpoint(path, optimizer=opt2)
    loaded, state = _full_params(pm2), pm2.optimizer_state_dict(opt2)
    moments = [(state["state"][n][k] - v).abs().max().item() for n, values in saved_state["state"].items()
               for k, v in values.items() if k != "step"]
    return {"param": max((loaded[n] - saved[n]).abs().max().item() for n in saved), "state": max(moments),
            "step": [float(v["step"]) for v in state["state"].values()][0]}
