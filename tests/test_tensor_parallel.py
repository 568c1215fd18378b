"""Tensor parallelism: every zoo model at tp=2 and tp=4 computes what the unsharded model computes."""

from __future__ import annotations

import pytest

import golden
from models import ZOO_NAMES


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ZOO_NAMES)
def test_golden_tensor_parallel(pools, name, tp):
    for rank, result in enumerate(pools.get(tp).run(golden.golden, name, {"tp": tp})):
        assert result["ok"], f"rank {rank}:\n{result['report']}"
