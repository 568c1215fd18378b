"""A fuzz of the public API (``golden_fuzz``): every case raises alike on every rank, or trains exactly.

50 random cases here, 500 in the full tier: random models (one whose forward raises), meshes (two that do not fit
the world of 2), options and inputs that differ from the example. None may be wrong, none may leave a rank
waiting on its peers (a hang, or an error raised on one rank only), and a refusal is the same on both ranks.
"""

from __future__ import annotations

import re

import pytest

from harness import golden_fuzz


def _same(error: str) -> str:
    return re.sub(r"\d+", "#", error)  # ranks and sizes named in an error may differ by rank


@pytest.mark.parametrize("count", [50, 500], ids=["50", "500"])
def test_random_uses_of_the_api_are_refused_alike_or_exact(pools, count):
    seeds = list(range(1000, 1000 + count))
    by_rank = pools.get(2).run(golden_fuzz.run_cases, seeds)
    outcomes = {"exact": 0, "refused": 0}
    for seed, (first, second) in zip(seeds, zip(*by_rank, strict=True), strict=True):
        case = first["case"]
        assert first["outcome"] == second["outcome"], (seed, case, first, second)
        assert first["outcome"] != "wrong", (seed, case, first["error"])
        if first["outcome"] == "refused":
            assert _same(first["error"]) == _same(second["error"]), (seed, case, first["error"], second["error"])
            assert "waiting on its peers" not in first["error"] and "imed out" not in first["error"], (
                seed, case, first["error"])
        outcomes[first["outcome"]] += 1
    assert outcomes["exact"] > count // 10, outcomes  # the fuzz reaches training, not only refusals
