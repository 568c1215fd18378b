"""parallelize(): the single-rank program equals eager execution; inspection; every input error's message."""

from __future__ import annotations

import pytest
import torch

import autoshard

import golden
from models import build


def test_one_rank_equals_eager_bit_for_bit():
    case, reference = build("hf_llama"), build("hf_llama").model
    pm = autoshard.parallelize(case.model, autoshard.Mesh(), example_inputs=case.inputs, loss_fn=case.loss_fn)
    loss = pm.step(*case.inputs, target=case.target)
    expected = case.loss_fn(reference(*case.inputs), case.target)
    expected.backward()
    assert torch.equal(loss, expected.detach())
    grads = pm.gradients()
    for name, p in reference.named_parameters():
        assert torch.equal(grads[name], p.grad), name
    assert torch.equal(pm(*case.inputs).logits, reference(*case.inputs).logits)


def test_explain_and_code_describe_the_program():
    case = build("gpt")
    pm = autoshard.parallelize(case.model, None, example_inputs=case.inputs, loss_fn=case.loss_fn, target=case.target)
    report = pm.explain()
    assert "training  8x16, 8x16:" in report and "nodes" in report
    assert "transformer.h.0.attn.c_attn.weight" in report and "local 144x48" in report
    assert "transformer.wte.weight, lm_head.weight" in report, "a tied weight lists all its names"
    assert "token loss" in report and "ignore_index=-100" in report
    assert "aten.linear" in pm.code(0) or "torch.ops.aten.linear" in pm.code(0)
    with pytest.raises(ValueError, match=r"rank 3 is not in Mesh\(dp=1.*ranks are 0\.\.0"):
        pm.code(3)


def test_explain_lists_data_parallel_collectives(pools):
    report = pools.get(2).run(_explain_dp)[0]
    assert "dp x cp all-reduce (sum) of gradients over 2 ranks: 193.8 KiB" in report
    assert "Mesh(dp=2" in report


def _explain_dp() -> str:
    case = build("gpt")
    mesh = autoshard.Mesh(dp=2)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, groups=golden.groups_for(mesh))
    return pm.explain()


def test_training_graph_is_captured_at_the_first_step_without_example_target():
    case = build("mlp")
    pm = autoshard.parallelize(case.model, None, example_inputs=case.inputs, loss_fn=case.loss_fn, microbatches=4)
    assert "none yet" in pm.explain()
    with pytest.raises(ValueError, match="pass an example target=... to autoshard.parallelize"):
        torch.optim.SGD(pm.parameters(), lr=0.1)
    pm.step(*case.inputs, target=case.target)
    assert len(list(pm.parameters())) == 6
    assert "training  2x20, 2x24:" in pm.explain(), "captured at the microbatch shape"


# --- bad input -------------------------------------------------------------------------------------


def test_mesh_needing_processes_without_torchrun(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    case = build("mlp")
    with pytest.raises(RuntimeError, match=r"needs 2 processes.*torchrun --nproc-per-node 2"):
        autoshard.parallelize(case.model, autoshard.Mesh(dp=2), example_inputs=case.inputs, loss_fn=case.loss_fn)


def _wrong_world_size() -> str:
    case = build("mlp")
    try:
        autoshard.parallelize(case.model, autoshard.Mesh(dp=4), example_inputs=case.inputs, loss_fn=case.loss_fn)
    except ValueError as e:
        return str(e)
    return "no error"


def test_mesh_that_does_not_match_the_world_fails_on_every_rank_before_any_collective(pools):
    for message in pools.get(2).run(_wrong_world_size, timeout=30):
        assert "dp=4 x tp=1 x pp=1 x cp=1 = 4 ranks, but the world has 2" in message
        assert "dp=2" in message


def test_batch_that_microbatches_do_not_divide():
    case = build("mlp")
    with pytest.raises(ValueError, match=r"global batch of 8 cannot be cut into 3 microbatches.*\[1, 2, 4, 8\]"):
        autoshard.parallelize(case.model, None, example_inputs=case.inputs, loss_fn=case.loss_fn, microbatches=3)


def test_example_inputs_must_be_a_tuple():
    case = build("mlp")
    with pytest.raises(TypeError, match=r"example_inputs=\(tokens,\)"):
        autoshard.parallelize(case.model, None, example_inputs=case.inputs[0], loss_fn=case.loss_fn)


def test_step_without_a_loss():
    case = build("mlp")
    pm = autoshard.parallelize(case.model, None, example_inputs=case.inputs)
    with pytest.raises(ValueError, match="pass loss_fn=..."):
        pm.step(*case.inputs, target=case.target)
