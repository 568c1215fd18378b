"""``detect_anomaly=True`` on every rank: a model whose forward (or backward) turns non-finite at a known line."""

from __future__ import annotations

import torch
from torch import nn

import autoshard

from harness.golden import groups_for
from harness.models import build


class _LogOfNegative(nn.Module):
    """A block whose forward takes the log of a value that can be negative: NaN from there on."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.log(self.proj(x))  # the line the error names


def found(mesh_kwargs: dict, *, poison: bool = True, **options) -> dict:
    """The zoo GPT with its first block's MLP replaced by ``_LogOfNegative`` (or not, with ``poison`` off): one
    step with ``detect_anomaly=True``; the error each rank raised, and whether the optimizer was left untouched."""
    case = build("gpt")
    if poison:
        case.model.transformer.h[0].mlp = _LogOfNegative(case.model.cfg.n_embd)
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, groups=groups_for(mesh), detect_anomaly=True,
                               microbatches=2 if mesh.pp > 1 else 1, **options)
    try:
        loss = pm.step(*case.inputs, target=case.target)
    except autoshard.NonFiniteError as e:
        return {"error": str(e)}
    return {"error": None, "loss": float(loss)}
