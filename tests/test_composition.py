"""Axes composed: dp, tp, pp and cp together compute what the unsharded model computes."""

from __future__ import annotations

import pytest

import golden

# (mesh, options): the combinations of the seeds' 3D parallelism, on the zoo decoders.
MESHES = [
    ({"dp": 2, "pp": 2}, {"microbatches": 2}),
    ({"tp": 2, "pp": 2}, {"microbatches": 2}),
    ({"tp": 2, "cp": 2}, {}),
    ({"pp": 2, "cp": 2}, {"microbatches": 2, "cp_load_balance": True}),
    ({"dp": 2, "cp": 2}, {}),
]


@pytest.mark.parametrize("mesh,options", MESHES, ids=["x".join(f"{k}{v}" for k, v in m.items()) for m, _ in MESHES])
@pytest.mark.parametrize("name", ["gpt", "hf_llama"])
def test_golden_composed(pools, name, mesh, options):
    for rank, result in enumerate(pools.get(4).run(golden.golden, name, mesh, **options)):
        assert result["ok"], f"rank {rank}:\n{result['report']}"


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_golden_dp2_tp2_pp2_on_eight_processes(pools, name):
    results = pools.get(8).run(golden.golden, name, {"dp": 2, "tp": 2, "pp": 2}, microbatches=2)
    for rank, result in enumerate(results):
        assert result["ok"], f"rank {rank}:\n{result['report']}"
