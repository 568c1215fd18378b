"""``pm.save_pretrained`` from a mesh, loaded back by the unmodified ``from_pretrained``: runs on every rank."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from corpus.architectures import build

import autoshard

from golden import groups_for


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
