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
    golden.check(results)


LOCAL_BATCH_MESHES = [("gpt", {"dp": 2}, {}), ("hf_llama", {"dp": 2}, {}), ("gpt", {"cp": 2}, {}),
                      ("llama", {"dp": 2, "cp": 2}, {"cp_load_balance": True})]


@pytest.mark.parametrize("name,mesh,options", LOCAL_BATCH_MESHES, ids=["gpt-dp2", "hf_llama-dp2", "gpt-cp2",
                                                                        "llama-dp2xcp2-balanced"])
def test_local_batches_from_a_sharding_loader(pools, name, mesh, options):
    """Under cp every rank of a dp rank gets the same slice, at the whole sequence; the loss is normalised once."""
    results = pools.get(2 if len(mesh) == 1 else 4).run(golden.local_batch_step, name, mesh, **options)
    assert len({r["loss"] for r in results}) == 1, "every rank returns the same global loss"
    assert all(r["compared"] > 10 for r in results), results


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_inference_under_dp_computes_each_ranks_slice_of_the_batch(pools, name):
    """pm(x) at dp=2: each rank runs its half of the batch and the outputs are gathered, when every output
    carries the batch (found by propagation); a model whose graph mixes in batch-sized values it builds itself
    (HuggingFace's attention masks, BERT's token types) computes the whole batch on every rank instead."""
    for result in pools.get(2).run(golden.inference_slices, name, {"dp": 2}):
        assert result["worst"] < 1e-5 and all(result["shapes_equal"]), result
        if name in ("gpt", "llama", "mlp"):
            assert result["batches"] == [4], "the inference graph was captured at the local batch only"


COMPOSED = [({"dp": 2, "tp": 2}, 4, {}), ({"dp": 2, "pp": 2}, 4, {"microbatches": 2}), ({"dp": 2, "cp": 2}, 4, {}),
            ({"dp": 4}, 4, {})]


@pytest.mark.parametrize("mesh,world,options", COMPOSED, ids=["dp2xtp2", "dp2xpp2", "dp2xcp2", "dp4"])
def test_inference_slices_compose_with_the_other_axes(pools, mesh, world, options):
    for result in pools.get(world).run(golden.inference_slices, "llama", mesh, **options):
        assert result["worst"] < 1e-5 and all(result["shapes_equal"]), result
        assert result["batches"] == [8 // mesh["dp"]], result
