"""Data parallelism: every zoo model at dp=1, 2 and 4 computes what the unsharded model computes."""

from __future__ import annotations

import pytest

import golden
from models import ZOO_NAMES

# (dp, microbatches): dp=1 runs in this process without torch.distributed; microbatches > 1 check that
# gradients are synchronised once per step, after the last microbatch.
CONFIGS = [(1, 1), (1, 2), (2, 1), (2, 2), (4, 2)]


@pytest.mark.parametrize("dp,microbatches", CONFIGS, ids=[f"dp{d}-m{m}" for d, m in CONFIGS])
@pytest.mark.parametrize("name", ZOO_NAMES)
def test_golden_data_parallel(pools, name, dp, microbatches):
    if dp == 1:
        results = [golden.golden(name, {}, microbatches=microbatches)]
    else:
        results = pools.get(dp).run(golden.golden, name, {"dp": dp}, microbatches=microbatches)
    for rank, result in enumerate(results):
        assert result["ok"], f"rank {rank}:\n{result['report']}"
        assert result["compared"] > 10


@pytest.mark.parametrize("name", ["gpt", "hf_llama"])
def test_local_batches_from_a_sharding_loader(pools, name):
    losses = {r["loss"] for r in pools.get(2).run(golden.local_batch_step, name, 2)}
    assert len(losses) == 1, "every rank returns the same global loss"
