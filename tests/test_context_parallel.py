"""Context parallelism: the sequence split over cp ranks computes what the unsharded model computes."""

from __future__ import annotations

import pytest

import golden
from models import DECODERS

CP_MODELS = (*DECODERS, "bert")


@pytest.mark.parametrize("load_balance", [False, True], ids=["contiguous", "balanced"])
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("name", CP_MODELS)
def test_golden_context_parallel_gather(pools, name, cp, load_balance):
    results = pools.get(cp).run(golden.golden, name, {"cp": cp}, cp_load_balance=load_balance)
    for rank, result in enumerate(results):
        assert result["ok"], f"rank {rank}:\n{result['report']}"
