"""Cutting the inputs (a batch over dp ranks and microbatches, a sequence over cp ranks): what the error says
when they cannot be cut evenly. It names what would work, and never offers an empty list of choices."""

from __future__ import annotations

import re

import pytest

from autoshard import batching
from autoshard.passes.context_parallel import ContextParallelPlan, check_divisible


def _refusal(batch: int, **kwargs) -> str:
    with pytest.raises(ValueError) as caught:
        batching.check(batch, **kwargs)
    return str(caught.value)


def test_a_batch_that_splits_over_dp_offers_the_microbatch_counts_that_fit():
    message = _refusal(6, microbatches=4, dp=1, local=False)
    assert "microbatches in [1, 2, 3, 6]" in message, message


def test_a_batch_the_dp_ranks_cannot_share_offers_no_empty_list_but_what_to_change():
    """Seed: "use microbatches in []": no number of microbatches splits 3 sequences over dp=2 ranks."""
    message = _refusal(3, microbatches=1, dp=2, local=False)
    assert not re.search(r"\[\s*\]", message), message
    assert "global batch divisible by 2" in message and "local_batch=True" in message, message


@pytest.mark.parametrize("batch,microbatches,dp,local", [(3, 1, 2, False), (5, 2, 4, False), (7, 3, 1, False),
                                                          (7, 3, 4, True), (1, 2, 1, True)])
def test_no_refusal_offers_an_empty_list(batch, microbatches, dp, local):
    message = _refusal(batch, microbatches=microbatches, dp=dp, local=local)
    assert not re.search(r"\[\s*\]", message), message


def test_an_odd_sequence_under_load_balance_offers_no_empty_list_of_cp_degrees():
    """Seed: "use cp in [] or turn load balance off": no cp degree cuts 7 tokens into 2 x cp chunks."""
    plan = ContextParallelPlan(size=2, inputs={"input_ids": 1}, seq_len=7, load_balance=True, attention="alltoall")
    with pytest.raises(ValueError) as caught:
        check_divisible(plan)
    message = str(caught.value)
    assert not re.search(r"\[\s*\]", message), message
    assert "turn load balance off" in message and "multiple of 4" in message, message
