"""bf16 mixed precision: the parallel model keeps eager autocast's dtype policy on every rewritten op.

The reference is the unsharded model under eager ``torch.autocast("cpu", dtype=torch.bfloat16)``, not the
float32 model under a loose bound: eager autocast computes the cross-entropy in float32 and returns a
float32 loss, and so must the vocab-parallel loss. A run with autocast silently off fails: the loss would
receive float32 logits, and the gradients would equal the float32 model's.
"""

from __future__ import annotations

import pytest

from harness import golden_amp

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


@pytest.mark.parametrize("world,mesh", [(2, {"pp": 2}), (2, {"dp": 2})], ids=["pp2", "dp2"])
def test_bf16_activations_cross_a_pipeline_cut_as_bf16(pools, world, mesh):
    """A conv's output is bf16 under autocast and float32 in the capture: the stage that received it into a
    float32 buffer read two bf16 values as one float (loss 1.617 for 1.721, then NaN). Nothing here rounds
    otherwise than eager autocast (no partial sums), so the loss is eager's to float32 rounding: a cut that
    carried float32 values would give the next stage's non-autocast ops float32 inputs (5e-4 off)."""
    for rank, r in enumerate(pools.get(world).run(golden_amp.resnet_bf16, mesh)):
        assert abs(r["loss"] - r["amp_loss"]) <= 1e-5, f"rank {rank}: {r}"
        worst = max(r["grad_error"], key=r["grad_error"].get)
        assert r["grad_error"][worst] <= GRAD_RTOL, f"rank {rank}: {worst}: {r}"


def test_a_pipeline_cut_carries_what_autocast_computes_at_half_the_bytes():
    import torch
    import torch.nn.functional as F

    from autoshard.compile import compile_global_batch
    from autoshard.mesh import Mesh
    from autoshard.options import CompileOptions

    from harness.golden import SmallResNet

    pixels, target = torch.randn(8, 3, 8, 8), torch.randint(0, 5, (8,))
    build = compile_global_batch(SmallResNet(), (pixels,), Mesh(pp=2), 0, CompileOptions(mixed_precision="bf16"),
                                 target=target, loss_fn=F.cross_entropy)
    received, sent = build.local_specs[0]
    assert sent and {spec.dtype for spec in sent} == {torch.bfloat16}, sent
    whole = compile_global_batch(SmallResNet(), (pixels,), Mesh(pp=2), 0, CompileOptions(),
                                 target=target, loss_fn=F.cross_entropy)
    assert {spec.dtype for spec in whole.local_specs[0][1]} == {torch.float32}


def test_a_write_into_a_tensor_made_in_float32_takes_what_autocast_computes():
    """``torch.zeros(..., dtype=h.dtype)`` is float32 in the capture and bfloat16 under eager autocast (``h`` comes out
    of a matmul); ``index_add`` of a matmul's bf16 rows into it refused the mismatch (JetMoE's experts, at every
    mesh). Each such write now casts what it writes to the tensor it writes into; the loss is eager autocast's to
    bf16's rounding (the sum kept in float32 where eager keeps it in bf16)."""
    import torch
    import torch.nn.functional as F

    import autoshard

    class Scatter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.up = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            h = self.proj(x)
            rows = torch.arange(x.shape[0]).flip(0)
            out = torch.zeros(x.shape[0], 8, dtype=h.dtype).index_add(0, rows, self.up(h))
            return out.float().pow(2).mean(-1)

    torch.manual_seed(0)
    model, x, target = Scatter(), torch.randn(6, 8), torch.randn(6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.mse_loss(model(x), target)
    pm = autoshard.parallelize(model, None, example_inputs=(x,), loss_fn=F.mse_loss, target=target,
                               mixed_precision="bf16")
    got = pm.step(x, target=target)
    assert abs(float(got) - float(want)) <= 1e-2 * abs(float(want)), (float(got), float(want))
