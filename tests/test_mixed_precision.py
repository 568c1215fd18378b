"""bf16 mixed precision: the parallel model keeps eager autocast's dtype policy on every rewritten op.

The reference is the unsharded model under eager ``torch.autocast("cpu", dtype=torch.bfloat16)``, not the
float32 model under a loose bound: eager autocast computes the cross-entropy in float32 and returns a
float32 loss, and so must the vocab-parallel loss. A run with autocast silently off fails: the loss would
receive float32 logits, and the gradients would equal the float32 model's.
"""

from __future__ import annotations

import golden_amp
import pytest

# What bf16 justifies. bf16 keeps 8 significant bits (relative rounding 2**-9 ~ 2e-3 per op). The tp
# program rounds each rank's partial sum of a row-parallel matmul to bf16 and then the sum, where the one
# matmul of the unsharded op rounds once, so activations differ from eager autocast's by a few bf16 ulps.
# The loss is a float32 mean over 120 tokens that averages that out (measured: 5e-5); a loss rounded to
# bf16 (the bug: 4.53125 where eager autocast gives 4.542677) is off by up to 2**-6 ~ 1.6e-2 at this size.
LOSS_ATOL = 1e-3
# A gradient's worst element relative to the gradient's largest: a few bf16 roundings of 2**-9 each
# (measured: at most 1.1e-2, about as far as eager autocast's own gradients are from float32's).
GRAD_RTOL = 2e-2


CASES = [
    pytest.param("gpt", {"tp": 2}, id="gpt-tp2"),
    pytest.param("hf_llama", {"tp": 2}, id="hf_llama-tp2"),
    pytest.param("gpt", {"dp": 2}, id="gpt-dp2"),
    pytest.param("gpt", {"pp": 2}, id="gpt-pp2"),
    *(pytest.param("hf_llama", {"cp": 2}, {"cp_attention": a, "cp_load_balance": True}, id=f"hf_llama-cp2-{a}")
      for a in ("gather", "ring", "alltoall")),
    pytest.param("gpt", {"cp": 2}, {"cp_attention": "gather"}, id="gpt-cp2-gather"),  # the causal flag
]


@pytest.mark.parametrize("name,mesh,options", [c if len(c.values) == 3 else pytest.param(*c.values, {}, id=c.id)
                                               for c in CASES])
def test_bf16_matches_eager_autocast(pools, name, mesh, options):
    world = 1
    for degree in mesh.values():
        world *= degree
    for rank, r in enumerate(pools.get(world).run(golden_amp.bf16_against_eager_autocast, name, mesh, **options)):
        where = f"rank {rank}: {r}"
        if "tp" in mesh:
            assert {"VocabParallelEmbedding", "VocabParallelCrossEntropy"} <= set(r["sharded"]), where
            # autocast was on: the vocab-parallel loss received bf16 logits, and returned float32 as eager does
            assert r["loss_dtypes"] and set(r["loss_dtypes"]) == {("torch.bfloat16", "torch.float32")}, where
        assert r["amp_loss_dtype"] == "torch.float32", where
        assert abs(r["loss"] - r["amp_loss"]) <= LOSS_ATOL, where
        assert r["grad_error"] and r["fp32_grad_error"], where
        worst = max(r["grad_error"], key=r["grad_error"].get)
        assert r["grad_error"][worst] <= GRAD_RTOL, f"{worst}: {where}"
        # and it made a difference: the parallel gradients are not the float32 ones
        assert max(r["fp32_grad_error"].values()) > 1e-3, where
