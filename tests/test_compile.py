"""``compile=True``: each rank's programs through ``torch.compile`` (inductor), forward and backward, exact.

Every axis's programs, compiled with autoshard's collectives inside, against the unsharded model: one step, then
two more that compile nothing (the same shapes again), and ``explain()`` saying what was compiled.
"""

from __future__ import annotations

import pytest

from harness import golden

CASES = [
    ("gpt", {"tp": 2}, {}),
    ("hf_llama", {"tp": 2}, {"sequence_parallel": True}),
    ("gpt", {"pp": 2}, {"schedule": "zbv", "microbatches": 4}),
    ("gpt", {"cp": 2}, {"cp_attention": "ring"}),
    ("gpt", {"dp": 2}, {}),
    ("gpt", {"pp": 2}, {"microbatches": 2}),
    ("gpt", {"cp": 2}, {}),
    ("gpt", {"cp": 2}, {"cp_attention": "alltoall"}),
    ("hf_llama", {"tp": 2}, {}),
    ("hf_llama", {"pp": 2}, {"microbatches": 2}),
    ("hf_llama", {"pp": 2}, {"schedule": "zbv", "microbatches": 2}),
    ("hf_llama", {"cp": 2}, {"cp_attention": "ring", "cp_load_balance": True}),
    ("gpt", {"dp": 2, "tp": 2, "pp": 2}, {"schedule": "zbv", "microbatches": 2}),  # dp sums from the whole I
]
IDS = [f"{name}-{'x'.join(f'{a}{d}' for a, d in mesh.items())}" + "".join(f"-{k}={v}" for k, v in options.items())
       for name, mesh, options in CASES]


@pytest.mark.parametrize("name,mesh,options", CASES, ids=IDS)
def test_compiled_programs_are_exact_and_compile_once(pools, name, mesh, options):
    world = 1
    for degree in mesh.values():
        world *= degree
    for rank, result in enumerate(pools.get(world).run(golden.compiled, name, mesh, **options)):
        assert result["ok"], f"rank {rank}:\n{result['report']}"
        assert result["graphs"] >= 1, f"rank {rank}: nothing was compiled"
        assert result["recompiled"] == 0, f"rank {rank}: the second and third steps compiled {result['recompiled']}"
        assert result["explained"], f"rank {rank}: explain() does not say what was compiled"


def test_an_id_outside_the_vocabulary_is_refused_inside_a_compiled_graph():
    """Compiled, the vocab-parallel lookup checks its ids on the device (no host sync, no graph break) and still
    refuses one outside the vocabulary."""
    import torch

    from autoshard.passes.collectives import VocabParallelEmbedding

    lookup = VocabParallelEmbedding(group=None, size=1, rank=0, vocab_start=0, vocab_end=10, num_embeddings=10)
    compiled = torch.compile(lookup, backend="aot_eager", fullgraph=True)
    weight = torch.randn(10, 4)
    assert torch.equal(compiled(torch.tensor([[1, 9]]), weight), weight[[1, 9]][None])
    with pytest.raises(RuntimeError, match="not in the vocabulary of 10"):
        compiled(torch.tensor([[1, 10]]), weight)
