"""A fuzz of the public API on every rank of a pool: random options, meshes, inputs and models.

Each case is drawn from a seed (the same on every rank): a zoo model (or one whose forward raises), a mesh of the
world's size (or one that does not fit it), options of ``parallelize`` drawn at random, and inputs that may
differ from the example (another batch or sequence length, float ids, a target of another shape). A case either
raises on every rank (the pool's deadline catches a rank left waiting on a collective: a hang) or is compared with
the unsharded model by ``autoshard.verify`` and must be exact.
"""

from __future__ import annotations

import copy
import random

import torch
import torch.distributed as dist
from torch import nn

import autoshard
from autoshard.verify import compare

from harness.golden import groups_for
from harness.models import build


class _Raises(nn.Module):
    """A model whose forward raises on its input's values (the capture sees it first)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the model's own forward refuses this input")


MESHES = [{"dp": 2}, {"tp": 2}, {"pp": 2}, {"cp": 2}, {"tp": 4}, {"dp": 3}]  # the last two do not fit 2 ranks
OPTIONS = {
    "microbatches": [1, 2, 3],
    "schedule": ["1f1b", "gpipe", "zb-h1", "zbv"],
    "cp_attention": ["gather", "ring", "alltoall"],
    "cp_load_balance": [False, True],
    "sequence_parallel": [False, True, "auto"],
    "activation_checkpointing": [False, True],
    "data_parallel": ["ddp", "fsdp"],
    "tp_indivisible": ["error", "replicate"],
}
INPUTS = ["same", "other batch", "other length", "float ids", "target shape"]


def draw(seed: int) -> dict:
    rng = random.Random(seed)
    case = {"model": rng.choice(["gpt", "llama", "mlp", "gpt", "llama", "raises"]), "mesh": rng.choice(MESHES),
            "inputs": rng.choice(INPUTS), "options": {}}
    for name, values in OPTIONS.items():
        if rng.random() < 0.3:
            case["options"][name] = rng.choice(values)
    return case


def run_case(seed: int) -> dict:
    """One case on this rank: ``{"case", "outcome": "exact" | "wrong" | "refused", "error"}``."""
    case = draw(seed)
    try:
        if case["model"] == "raises":
            model, inputs, target = _Raises(), (torch.randn(4, 8),), torch.randn(4, 8)
            loss_fn = torch.nn.functional.mse_loss
        else:
            zoo = build(case["model"])
            model, inputs, target, loss_fn = zoo.model, zoo.inputs, zoo.target, zoo.loss_fn
        mesh = autoshard.Mesh(**case["mesh"])
        if case["inputs"] == "same":
            report = autoshard.verify(model, mesh, inputs, loss_fn, target=target, steps=2, groups=_groups(mesh),
                                      **case["options"])
        else:  # the example as given, then a step on inputs that differ from it
            reference = copy.deepcopy(model)
            pm = autoshard.parallelize(model, mesh, example_inputs=inputs, loss_fn=loss_fn, target=target,
                                       groups=_groups(mesh), **case["options"])
            other, other_target = _other(inputs, target, case["inputs"])
            report = compare(reference, pm, other, other_target, loss_fn=loss_fn, steps=1)
        outcome = "exact" if report.ok else "wrong"
        return {"case": case, "outcome": outcome, "error": None if report.ok else str(report)[:2000]}
    except Exception as e:  # noqa: BLE001 - a refusal is an outcome; the test checks every rank gave the same
        return {"case": case, "outcome": "refused", "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}


def _groups(mesh: autoshard.Mesh):
    if mesh.world_size != dist.get_world_size():
        return None  # parallelize itself must refuse the mesh, naming the world size
    return groups_for(mesh)


def _other(inputs: tuple, target: torch.Tensor, how: str) -> tuple[tuple, torch.Tensor]:
    """Inputs that differ from the example: half the batch, half the sequence, float ids, a target of one column."""
    first = inputs[0]
    if how == "other batch":
        half = max(1, first.shape[0] // 2)
        return (first[:half], *inputs[1:]), target[:half]
    if how == "other length" and first.dim() == 2 and target.dim() == 2:
        half = max(1, first.shape[1] // 2)
        return (first[:, :half], *inputs[1:]), target[:, :half]
    if how == "float ids":
        return (first.float(), *inputs[1:]), target
    if how == "target shape":
        return inputs, target[..., :1]
    return inputs, target


def run_cases(seeds: list[int]) -> list[dict]:
    return [run_case(seed) for seed in seeds]
