"""Resuming exactly under any mesh: parameters, AdamW's state, the LR schedule and the step move between meshes."""

from __future__ import annotations

import golden_resume
import pytest

FSDP = {"data_parallel": "fsdp"}
PP = {"microbatches": 2}

# (id, save mesh, its options, load mesh, its options)
PAIRS = [
    ("dp2xtp2-to-tp2xpp2", {"dp": 2, "tp": 2}, {}, {"tp": 2, "pp": 2}, PP),
    ("fsdp-dp2-to-ddp-dp2", {"dp": 2}, FSDP, {"dp": 2}, {}),
    ("pp2-to-tp4", {"pp": 2}, PP, {"tp": 4}, {}),
    ("tp2xcp2-to-dp4", {"tp": 2, "cp": 2}, {}, {"dp": 4}, {}),
]


def _world(mesh: dict) -> int:
    out = 1
    for degree in mesh.values():
        out *= degree
    return out


def _check(results: list[dict], first: list[float]) -> None:
    for rank, result in enumerate(results):
        losses = first + result["losses"]
        assert len(losses) == len(result["reference"]) == 2 * golden_resume.HALF
        for got, expected in zip(losses, result["reference"], strict=True):
            assert abs(got - expected) <= 1e-5 * max(1.0, abs(expected)), (rank, losses, result["reference"])
        assert result["param"] < 1e-5, (rank, result["param"])
        assert result["state"] < 1e-5, (rank, result["state"])
        assert result["hyper_equal"], rank


@pytest.mark.parametrize("pair", PAIRS, ids=[p[0] for p in PAIRS])
@pytest.mark.parametrize("name", ["gpt", "hf_llama"])
def test_a_run_resumes_under_another_mesh_as_if_it_had_not_stopped(pools, tmp_path, name, pair):
    _, save, save_options, load, load_options = pair
    path = str(tmp_path / "ckpt")
    first = pools.get(_world(save)).run(golden_resume.first_half, name, save, path, save_options)[0]
    results = pools.get(_world(load)).run(golden_resume.second_half, name, load, path, load_options)
    assert all(r["step"] == golden_resume.HALF for r in results)
    _check(results, first)
