"""Pipeline parallelism: every schedule, at pp=2 and pp=4, computes what the unsharded model computes."""

from __future__ import annotations

import pytest

import golden
from launcher import WorkerError
from models import ZOO_NAMES

# (pp, microbatches, schedule, chunks)
CONFIGS = [
    (2, 1, "1f1b", 1),
    (2, 4, "gpipe", 1),
    (2, 4, "1f1b", 1),
    (2, 8, "1f1b", 1),
    (2, 4, "interleaved", 2),
    (4, 4, "1f1b", 1),
    (4, 8, "gpipe", 1),
    (4, 8, "interleaved", 2),
]


@pytest.mark.parametrize("pp,microbatches,schedule,chunks", CONFIGS, ids=[f"pp{c[0]}-m{c[1]}-{c[2]}" for c in CONFIGS])
@pytest.mark.parametrize("name", ZOO_NAMES)
def test_golden_pipeline(pools, name, pp, microbatches, schedule, chunks):
    run = pools.get(pp).run
    if name == "mlp" and pp * chunks > 6:  # three linears and a loss: at most 6 places to cut
        with pytest.raises(WorkerError, match=r"8 stages need 7 cuts.*use at most 6 stages"):
            run(golden.golden, name, {"pp": pp}, microbatches=microbatches, schedule=schedule, chunks=chunks)
        return
    results = run(golden.golden, name, {"pp": pp}, microbatches=microbatches, schedule=schedule, chunks=chunks)
    for rank, result in enumerate(results):
        assert result["ok"], f"rank {rank}:\n{result['report']}"
