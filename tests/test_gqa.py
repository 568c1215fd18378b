"""Grouped-query attention at any tp degree, however the model matches kv heads to query heads.

Each model of ``golden_gqa`` (torchtitan's ``repeat_kv``, mistral-inference's ``repeat_interleave`` over dim 2,
gpt-fast's over dim 1, PyTorch's ``enable_gqa=True``, ``repeat`` of the same mapping, and heads tiled by ``repeat``,
another mapping) trains exactly at tp=4 and tp=8 with 2 and 4 kv heads, each rank holding what HuggingFace's
layout holds: ``1/tp`` of the matrices, the k and v projections whole where tp does not divide the kv heads.
"""

from __future__ import annotations

import pytest

from harness import golden_gqa

# tp=4 first: the CI tier takes the cells that add a degree, and those a seeded bug or a note names
# (tests/harness/tiers.py).
# Heads tiled with kv heads tp splits have a test of their own (below): attention is not split by heads there.
CELLS = [(style, tp, kv) for tp in (4, 8) for kv in (2, 4) for style in golden_gqa.STYLES
         if not (style == "tiled" and kv % tp == 0)]


def _check(results: list[dict], *, slack: float = 0.01) -> None:
    for rank, result in enumerate(results):
        assert result["ok"], f"rank {rank}:\n{result['report']}"
        assert result["compared"] > 0
        assert result["share"] <= result["expected_share"] + slack, (
            f"rank {rank} holds {result['share']:.3f} of the parameter bytes, above the {result['expected_share']:.3f} "
            "of duplicated kv heads")


@pytest.mark.parametrize("style,tp,kv", CELLS, ids=[f"{s}-tp{tp}-kv{kv}" for s, tp, kv in CELLS])
def test_grouped_query_attention_is_exact_at_the_share_of_duplicated_kv_heads(pools, style, tp, kv):
    _check(pools.get(tp).run(golden_gqa.gqa_golden, style, kv, {"tp": tp}))


def test_heads_tiled_by_repeat_are_never_split_as_if_grouped(pools):
    """``k.repeat(1, group, 1, 1)``: query head ``h`` reads kv head ``h % kv heads``. Where tp splits the kv heads,
    a rank's query heads do not read its kv heads: attention is not split by heads, and the model stays exact."""
    for rank, result in enumerate(pools.get(4).run(golden_gqa.gqa_golden, "tiled", 4, {"tp": 4})):
        assert result["ok"], f"rank {rank}:\n{result['report']}"


@pytest.mark.parametrize("style", ["sdpa_gqa", "titan", "fused"])
def test_grouped_query_attention_over_tp_and_all_to_all_cp(pools, style):
    """tp=4 x cp=2 with all-to-all attention: each cp rank takes half of a tp rank's query heads, and the kv heads
    they read (one kv head per tp rank, with 2 kv heads)."""
    _check(pools.get(8).run(golden_gqa.gqa_golden, style, 2, {"tp": 4, "cp": 2}, cp_attention="alltoall"))


@pytest.mark.parametrize("style", ["sdpa_gqa", "fused"])
def test_grouped_query_attention_with_sequence_parallelism(pools, style):
    """tp=4 with sequence parallelism, 2 kv heads: the duplicated k and v read the gathered sequence."""
    _check(pools.get(4).run(golden_gqa.gqa_golden, style, 2, {"tp": 4}, sequence_parallel=True))
