"""parallelize(): the single-rank program equals eager execution; inspection; every input error's message."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

import autoshard

from harness import golden
from harness.models import build

GPT = f'{Path(__file__).resolve().parent / "harness" / "models.py"}:build("gpt")'


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
    assert "training graph (forward, loss, backward) 8x16, 8x16:" in report and "nodes" in report
    assert re.search(r"transformer\.h\.0\.attn\.c_attn\.weight\s+replicated\s+R\s+144x48\s+144x48", report)
    assert "transformer.wte.weight, lm_head.weight" in report, "a tied weight lists all its names"
    assert "token loss" in report and "ignore_index=-100" in report
    assert "aten.linear" in pm.code(0) or "torch.ops.aten.linear" in pm.code(0)
    with pytest.raises(ValueError, match=r"rank 3 is not in Mesh\(dp=1.*ranks are 0\.\.0"):
        pm.code(3)


def test_explain_lists_data_parallel_collectives(pools):
    report = pools.get(2).run(_explain_dp)[0]
    assert "all-reduce (sum) of this rank's gradients over 2 ranks (dp=2): 193.8 KiB" in report
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
    assert "training graph (forward, loss, backward) 2x20, 2x24:" in pm.explain(), "captured at the microbatch shape"


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


@pytest.mark.parametrize("mesh", ["tp=2", "pp=2", "dp=2", "dp=2,pp=2"])
def test_explain_and_inspect_print_the_same_report(pools, capsys, mesh):
    """One renderer over one compile: ``pm.explain(code=True)`` on each rank is ``autoshard inspect --rank``; also
    where a spread weight (GPT's tied embedding at pp=2) stores its rows between steps but is summed whole over dp.
    After a step, ``explain()`` adds what the step was checked against (its communication certificate), which no
    compile without processes has run."""
    from autoshard import cli

    degrees = {axis: int(degree) for axis, degree in (part.split("=") for part in mesh.split(","))}
    explained = pools.get(math.prod(degrees.values())).run(golden.explain, "gpt", degrees, microbatches=2, code=True)
    for rank, text in enumerate(explained):
        text, checked = text.split("\n\ncommunication certificate of rank", 1)
        assert "sent exactly this" in checked
        assert cli.main(["inspect", GPT, "--mesh", mesh, "--rank", str(rank), "--microbatches", "2"]) == 0
        inspected = capsys.readouterr().out.split("\n\n", 1)[1]  # after the factory's line
        assert _untimed(inspected).strip() == _untimed(text).strip(), f"rank {rank}"
        assert "code of rank" in text and "collectives of rank" in text


def _untimed(report: str) -> str:
    return re.sub(r"captured in [\d.]+ s", "captured in _ s", report)


@pytest.mark.parametrize(("option", "says"), [
    ({"tp_indivisible": "eror"}, "tp_indivisible='eror' is not an option: use 'error'"),
    ({"data_parallel": "zero"}, "data_parallel='zero' is not an option: use 'ddp'"),
    ({"cp_attention": "ulysses"}, "cp_attention='ulysses' is not an option: use 'gather'"),
    ({"schedule": "1F1B"}, "schedule='1F1B' is not an option: use 'gpipe', '1f1b', 'interleaved' (with chunks > 1), "
                           "'zb-h1'"),
    ({"mixed_precision": "fp16"}, "mixed_precision='fp16' is not an option: use None (fp32) or 'bf16'"),
    ({"microbatches": 0}, "microbatches=0 is not valid: it must be an integer >= 1"),
    ({"pipeline_starts": "layers.2"}, "pass a list of module names"),
])
def test_a_misspelt_option_is_refused_naming_the_valid_values(option, says):
    case = build("mlp")
    with pytest.raises(ValueError, match=re.escape(says)):
        autoshard.parallelize(case.model, None, example_inputs=case.inputs, loss_fn=case.loss_fn, **option)
    with pytest.raises(ValueError, match=re.escape(says)):
        autoshard.CompileOptions(**option)


def test_a_misspelt_option_name_is_refused_naming_the_nearest_and_every_option():
    """``parallelize``'s options are ``CompileOptions``' fields, forwarded by name: a name that is none of them is
    refused before anything is captured, with the nearest option and all of them named."""
    case = build("mlp")
    with pytest.raises(TypeError, match=r"'schedul', which is not an option \(did you mean schedule\?\): the options "
                                        r"are microbatches, .*batch_norm"):
        autoshard.parallelize(case.model, None, example_inputs=case.inputs, loss_fn=case.loss_fn, schedul="zbv")
    with pytest.raises(TypeError, match="'colour', which is not an option: the options are"):
        autoshard.CompileOptions.of({"colour": 1})


def test_options_come_as_one_object_or_as_keywords_not_both():
    case = build("mlp")
    options = autoshard.CompileOptions(microbatches=4)
    pm = autoshard.parallelize(case.model, None, example_inputs=case.inputs, loss_fn=case.loss_fn, options=options)
    assert pm.options is options
    pm.step(*case.inputs, target=case.target)
    assert [b.captured.input_shapes[0] for b in pm.builds] == [(2, 20)], "4 microbatches of the batch of 8"
    with pytest.raises(ValueError, match="not both.*microbatches="):
        autoshard.parallelize(case.model, None, example_inputs=case.inputs, options=options, microbatches=2)
    report = autoshard.verify(build("mlp").model, None, case.inputs, case.loss_fn, target=case.target, steps=1,
                              options=options)
    assert report.ok, str(report)


def test_token_ids_given_as_floats_after_integers_are_refused_naming_the_input():
    from harness.models import build

    case = build("gpt")
    pm = autoshard.parallelize(case.model, autoshard.Mesh(), example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target)
    with pytest.raises(TypeError, match=r"input 0 holds floats \(torch.float32\), but the example passed integers"):
        pm.step(case.inputs[0].float(), target=case.target)
    with pytest.raises(TypeError, match=r"the target holds floats"):
        pm.step(*case.inputs, target=case.target.to(torch.float32))


def test_a_loss_fn_that_cannot_take_output_and_target_is_refused_naming_the_call():
    """It had been reported as a graph torch.export could not capture."""
    model, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    with pytest.raises(TypeError, match=r"loss_fn is called as loss_fn\(output, target\).*<lambda>\(out\)"):
        autoshard.parallelize(model, autoshard.Mesh(), example_inputs=(x,), loss_fn=lambda out: out.sum(), target=x)


def test_a_step_without_its_target_by_name_says_how_to_pass_it():
    """``pm.step(x, y)`` passed ``y`` as a second input, and Python's TypeError named no fix."""
    model, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    pm = autoshard.parallelize(model, autoshard.Mesh(), example_inputs=(x,), loss_fn=lambda o, t: (o - t).pow(2).mean(),
                               target=x)
    with pytest.raises(TypeError, match=r"takes the target by name.*pm.step\(x, target=y\)"):
        pm.step(x, x)

