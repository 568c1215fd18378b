"""The parallel model in an ordinary training loop: accumulation, train/eval, bad data, new shapes, odd models."""

from __future__ import annotations

import pytest

import golden_loop


@pytest.mark.parametrize("mesh", [{"dp": 2}, {"cp": 2}, {"pp": 2}, {"tp": 2}], ids=["dp2", "cp2", "pp2", "tp2"])
def test_gradient_accumulation_over_steps_equals_eager(pools, mesh):
    for result in pools.get(2).run(golden_loop.accumulation, "gpt", mesh):
        assert result["compared"] > 0


@pytest.mark.parametrize("mesh,options", [({"dp": 2, "pp": 2}, {"microbatches": 2}),
                                          ({"dp": 2, "cp": 2}, {}),
                                          ({"dp": 2, "tp": 2}, {"data_parallel": "fsdp"})],
                         ids=["dp2xpp2", "dp2xcp2", "fsdp-dp2xtp2"])
def test_gradient_accumulation_on_four_ranks(pools, mesh, options):
    for result in pools.get(4).run(golden_loop.accumulation, "gpt", mesh, **options):
        assert result["compared"] > 0


@pytest.mark.parametrize("mesh", [{"dp": 2}, {"tp": 2}, {"pp": 2}], ids=["dp2", "tp2", "pp2"])
def test_eval_turns_dropout_off_and_train_turns_it_on(pools, mesh):
    for result in pools.get(2).run(golden_loop.eval_mode, "hf_gpt2", mesh):
        assert result["training"] is True
        assert result["train_mode_differs"] > 1e-3, "pm.train() did not turn dropout back on"
