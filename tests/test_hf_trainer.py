"""``autoshard.hf.Trainer``: HuggingFace's Trainer loop under a mesh, against the plain Trainer in one process.

Every step's loss (unrounded), the parameters after 20 steps and an evaluation's loss then, within 1e-5:
gradient accumulation over 2 batches, AdamW with weight decay by the Trainer's rule over ``named_parameters()``,
a linear schedule with warmup, ``max_grad_norm`` and padded rows; bf16 against the Trainer's autocast. Then a
run saved at step 10 under one mesh and resumed under another.
"""

from __future__ import annotations

import functools

import golden_hf
import pytest

STEPS = 20
CELLS = [
    ("llama", {"tp": 2}, {}),
    ("llama", {"pp": 2}, {"microbatches": 2}),
    ("llama", {"dp": 2}, {}),
    ("llama", {"cp": 2}, {}),
    ("bert", {"tp": 2}, {}),
    ("bert_cls", {"dp": 2}, {}),
    ("llama", {"dp": 2, "tp": 2, "pp": 2}, {"microbatches": 2}),
    ("bert", {"dp": 2, "tp": 2, "pp": 2}, {"microbatches": 2}),
]


@functools.cache
def _reference(kind: str, directory: str, bf16: bool = False) -> dict:
    return golden_hf.reference(kind, directory, STEPS, **({"bf16": True} if bf16 else {}))


def _world(mesh: dict) -> int:
    world = 1
    for degree in mesh.values():
        world *= degree
    return world


@pytest.mark.parametrize("kind,mesh,options", CELLS,
                         ids=[f"{k}-{'x'.join(f'{a}{d}' for a, d in m.items())}" for k, m, _ in CELLS])
def test_the_trainer_under_a_mesh_trains_as_the_plain_trainer(pools, tmp_path_factory, kind, mesh, options):
    expected = _reference(kind, str(tmp_path_factory.mktemp("reference")))
    results = pools.get(_world(mesh)).run(golden_hf.trained, kind, mesh, str(tmp_path_factory.mktemp("run")),
                                          STEPS, **options)
    golden_hf.check(expected, results)
    if mesh.get("tp", 1) > 1 or mesh.get("pp", 1) > 1:  # the Trainer trained the shards, not a whole copy
        assert all(r["share"] < 0.8 for r in results), [r["share"] for r in results]


def test_mesh_auto_trains_as_the_plain_trainer(pools, tmp_path_factory):
    """``mesh="auto"``: the planner's mesh for 2 processes, whichever it is, trains as the plain Trainer."""
    expected = _reference("llama", str(tmp_path_factory.mktemp("reference")))
    results = pools.get(2).run(golden_hf.trained, "llama", "auto", str(tmp_path_factory.mktemp("run")), STEPS)
    golden_hf.check(expected, results)
    assert all("Mesh(" in r["mesh"] for r in results), results[0]["mesh"]


def test_bf16_trains_as_the_plain_trainers_autocast(pools, tmp_path_factory):
    """``args.bf16``: autoshard's bf16 autocast against the Trainer's (accelerate's autocast) in one process."""
    expected = _reference("llama", str(tmp_path_factory.mktemp("reference")), bf16=True)
    results = pools.get(2).run(golden_hf.trained, "llama", {"tp": 2}, str(tmp_path_factory.mktemp("run")), STEPS,
                               arguments={"bf16": True})
    golden_hf.check(expected, results, tolerance=2e-2)


def test_a_run_saved_under_tp_resumes_under_pp_with_the_same_losses(pools, tmp_path_factory):
    expected = _reference("llama", str(tmp_path_factory.mktemp("reference")))
    results = pools.get(2).run(golden_hf.trained, "llama", {"tp": 2}, str(tmp_path_factory.mktemp("run")), STEPS,
                               resume_mesh={"pp": 2}, microbatches=2)
    golden_hf.check(expected, results)


@functools.cache
def _accelerate_reference(kind: str) -> dict:
    return golden_hf.accelerate_loop(kind, None, STEPS // 2)


@pytest.mark.parametrize("mesh,options", [({"tp": 2}, {}), ({"pp": 2}, {"microbatches": 2})], ids=["tp2", "pp2"])
def test_an_accelerate_loop_changed_by_one_line_trains_as_in_one_process(pools, mesh, options):
    """``autoshard.accelerate.prepare`` in place of ``accelerator.prepare``; the loop unchanged."""
    expected = _accelerate_reference("llama")
    results = pools.get(_world(mesh)).run(golden_hf.accelerate_loop, "llama", mesh, STEPS // 2, **options)
    golden_hf.check(expected, results)
