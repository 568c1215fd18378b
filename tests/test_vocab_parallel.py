"""The vocab-parallel embedding on real process groups: a ``padding_idx`` (HF ``pad_token_id``) is carried.

Dropping it gives the padding row a gradient it must not have: the loss of the first step is still exact,
the parameters after an optimizer step are not. The per-argument differential tests are in
``test_rules_embedding_loss.py``; this is the golden check on whole models, over three optimizer steps.
"""

from __future__ import annotations

import pytest

from harness import golden_amp


@pytest.mark.parametrize("name,tp", [("gpt", 2), ("hf_llama", 2), ("gpt", 4)])
def test_an_embedding_with_a_padding_row_trains_exactly(pools, name, tp):
    for rank, result in enumerate(pools.get(tp).run(golden_amp.padding_embedding, name, {"tp": tp})):
        assert "VocabParallelEmbedding" in result["sharded"], f"rank {rank}: the embedding was not vocab-parallel"
        assert result["compared"] > 0 and result["ok"], f"rank {rank}:\n{result['report']}"
