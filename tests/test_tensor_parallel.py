"""Tensor parallelism: every zoo model at tp=2 and tp=4 computes what the unsharded model computes."""

from __future__ import annotations

import pytest

from harness import golden
from harness.models import ZOO_NAMES


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ZOO_NAMES)
def test_golden_tensor_parallel(pools, name, tp):
    golden.check(pools.get(tp).run(golden.golden, name, {"tp": tp}), {"tp": tp})


@pytest.mark.parametrize("name", ["gpt", "hf_llama", "megatron"])
def test_golden_data_and_tensor_parallel(pools, name):
    mesh = {"dp": 2, "tp": 2}
    golden.check(pools.get(4).run(golden.golden, name, mesh, microbatches=2), mesh)


def test_state_dict_has_the_original_keys_and_full_shapes(pools):
    for state_keys, shapes_match in pools.get(2).run(golden.state_dict_round_trip, "gpt", {"tp": 2}):
        assert state_keys and shapes_match


def test_a_model_without_blocks_runs_replicated_with_a_warning(pools):
    (said, ok0), (quiet, ok1) = pools.get(2).run(golden.no_blocks, 2)
    assert ok0 and ok1
    assert any("in _NoBlocks: no block to split over tp=2 was found" in m for m in said), said
    assert not quiet, "a warning is said once per job, by rank 0"


def test_a_linear_outside_any_block_is_split_alone_and_stays_exact(pools):
    (said, ok0), (_, ok1) = pools.get(2).run(golden.no_blocks, 2, True)
    assert ok0 and ok1
    assert not any("no block to split" in m for m in said), said


def test_an_op_without_a_rule_is_gathered_with_a_warning_and_stays_exact(pools):
    (ok0, said, report0), (ok1, quiet, report1) = pools.get(2).run(golden.forced_tp_plan, 2)
    assert ok0 and ok1, report0 + report1
    assert any("no tp sharding rule for aten.cumsum.default" in m and "golden.py" in m for m in said), said
    assert not any("no tp sharding rule" in m for m in quiet), "said once per job, by rank 0"


@pytest.mark.parametrize("name,vocab,tp", [("gpt", 81, 2), ("gpt", 81, 4), ("hf_gpt2", 50257, 2)],
                         ids=["gpt-vocab81-tp2", "gpt-vocab81-tp4", "hf_gpt2-vocab50257-tp2"])
def test_a_vocabulary_the_degree_does_not_divide_is_padded_exactly(pools, name, vocab, tp):
    for rank, result in enumerate(pools.get(tp).run(golden.odd_vocab, name, vocab, {"tp": tp})):
        assert result["ok"], f"rank {rank}:\n{result['report']}"


LOSS_CASES = [("gpt", "ignore_minus_one"), ("gpt", "ignore_zero"), ("gpt", "label_smoothing"),
              ("llama", "smoothing_ignore_zero")]


@pytest.mark.parametrize("name,loss", LOSS_CASES, ids=[f"{n}-{loss}" for n, loss in LOSS_CASES])
def test_the_vocab_parallel_loss_keeps_the_cross_entropy_arguments(pools, name, loss):
    """A non-default ``ignore_index`` (its targets present) and ``label_smoothing``: exact at tp=2."""
    golden.check(pools.get(2).run(golden.golden, name, {"tp": 2}, loss=loss), {"tp": 2})


@pytest.mark.parametrize("tp", [2, 4])
def test_packed_in_projections_cut_apart_are_split_by_heads_and_exact(pools, tp):
    """torch's MultiheadAttention with a query that is not the key (a cross attention, a pooling probe) slices its
    packed in_proj into pieces; every piece is split by heads and the model stays exact."""
    for failed, share in pools.get(tp).run(golden.packed_attention, tp):
        assert not failed, failed
        assert share < 1 / tp + 0.1, share


def test_a_scan_cut_along_the_sequence_with_an_unused_state_keeps_its_channels_split(pools):
    """A state-space mixer whose scan cuts its inputs along the sequence (``tensor_split``) and makes an initial
    state it never reads from the decay (``A.new_zeros``), as transformers 5.25's Mamba does: exact with every
    channel weight held split (the plan: test_tensor_parallel_plan.py), 0.52 of the parameters on a rank."""
    (report, share), _ = pools.get(2).run(golden.selective_scan, 2)
    assert not report, report
    assert share < 0.53, share
