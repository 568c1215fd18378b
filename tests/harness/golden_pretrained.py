"""``pm.save_pretrained`` from a mesh, loaded back by the unmodified ``from_pretrained``: runs on every rank."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from corpus.architectures import build

import autoshard

from harness.golden import groups_for


def saved_and_loaded(name: str, mesh_kwargs: dict, directory: str, **options) -> dict:
    """Two training steps of corpus model ``name`` on the mesh, then ``save_pretrained`` (small files, so several
    with an index); rank 0 loads the directory with ``type(model).from_pretrained`` and compares every tensor of
    its state dict with ``pm.state_dict()`` bit for bit."""
    case = build(name)
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, groups=groups_for(mesh), microbatches=2 if mesh.pp > 1 else 1,
                               **options)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    for _ in range(2):
        optimizer.zero_grad()
        pm.step(*case.inputs, target=case.target)
        optimizer.step()
    expected = pm.state_dict()
    pm.save_pretrained(directory, max_shard_size="20KB")
    if dist.get_rank() != 0:
        return {"rank": dist.get_rank()}
    loaded = type(case.model).from_pretrained(directory).state_dict()
    differ = sorted(k for k, v in expected.items() if k in loaded and not torch.equal(loaded[k], v))
    return {"rank": 0, "missing": sorted(set(expected) - set(loaded)), "differ": differ,
            "files": sorted(f for f in os.listdir(directory) if f.endswith(".safetensors")),
            "index": os.path.exists(os.path.join(directory, "model.safetensors.index.json")),
            "config": os.path.exists(os.path.join(directory, "config.json"))}


def user_loop(name: str, mesh_kwargs: dict, *, bf16: bool = False, **options) -> dict:
    """Corpus model ``name`` trained as a user's loop trains it, beside the unsharded model doing the same: a padded
    batch with an ``attention_mask`` (the padding's targets ignored), two ``step()`` calls accumulated per optimizer
    step, SGD with momentum whose groups (weight decay on matrices only) are built from ``named_parameters()``,
    global-norm clipping, and with ``bf16`` both under bfloat16 autocast. Returns both sides' losses and the worst
    parameter difference after three optimizer steps."""
    import copy

    from harness.models import token_data

    case = build(name)
    reference = copy.deepcopy(case.model)
    batches = []
    for seed in (5, 6):
        ids, target = token_data(torch.Generator().manual_seed(seed), batch=case.inputs[0].shape[0],
                                 seq=case.inputs[0].shape[1], vocab=case.model.config.vocab_size)
        mask = torch.ones_like(ids)
        mask[0, -5:] = mask[3, -2:] = 0  # two rows padded at their end
        batches.append(((ids, mask), target.masked_fill(mask == 0, -100)))
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=batches[0][0], loss_fn=case.loss_fn,
                               target=batches[0][1], groups=groups_for(mesh),
                               mixed_precision="bf16" if bf16 else None, **options)

    def optimizer(named):
        named = list(named)
        return torch.optim.SGD([{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.01},
                                {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}],
                               lr=0.05, momentum=0.9)

    opt, ref_opt = optimizer(pm.named_parameters()), optimizer(reference.named_parameters())
    losses, ref_losses = [], []
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    for _ in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        for inputs, target in batches:
            losses.append(float(pm.step(*inputs, target=target)))
            with autocast:
                loss = case.loss_fn(reference(*inputs), target)
            loss.backward()
            ref_losses.append(float(loss))
        pm.clip_grad_norm_(1.0)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        opt.step()
        ref_opt.step()
    trained, expected = pm.state_dict(), reference.state_dict()
    worst = max((trained[k].float() - v.float()).abs().max().item() for k, v in expected.items()
                if v.is_floating_point())
    return {"losses": losses, "reference": ref_losses, "worst": worst}


def loaded_from_pretrained(name: str, mesh_kwargs: dict, directory: str, **options) -> dict:
    """Rank 0 writes corpus model ``name`` (its weights moved off their initial values) with HuggingFace's own
    ``save_pretrained`` in small files; every rank builds the model on ``meta``, parallelizes it, allocates its
    shards (``materialize``) and fills them with ``load_pretrained``. The gathered ``pm.state_dict()`` against the
    written one, bit for bit, and the bytes each rank read against the files' whole."""
    case = build(name)
    with torch.no_grad():
        for param in case.model.parameters():
            param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel())) * 0.01)
    if dist.get_rank() == 0:
        case.model.save_pretrained(directory, max_shard_size="20KB")
    dist.barrier()
    with torch.device("meta"):
        model = type(case.model)(case.model.config)
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(model, mesh, example_inputs=tuple(x.to("meta") for x in case.inputs),
                               loss_fn=case.loss_fn, target=case.target.to("meta"), groups=groups_for(mesh),
                               microbatches=2 if mesh.pp > 1 else 1, **options)
    pm.materialize("cpu")
    read = pm.load_pretrained(directory)
    got, expected = pm.state_dict(), case.model.state_dict()
    total = sum(v.numel() * v.element_size() for v in expected.values())
    return {"read": read, "total": total, "missing": sorted(set(expected) - set(got)),
            "differ": sorted(k for k, v in expected.items() if k in got and not torch.equal(got[k], v))}
