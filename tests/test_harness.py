"""The golden harness itself: it must fail when the parallel program is wrong, and never hang."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import autoshard
from autoshard.passes.placements import R
from autoshard.plan import ParamPlan, TensorParallelPlan
from autoshard.verify import VerifyReport, _replicas_identical, compare

from harness import golden
from harness.launcher import WorkerError, WorkerTimeout
from harness.models import build


def _perturbed_gradient_report(name: str, dp: int) -> str:
    case, reference = build(name), build(name).model
    pm = autoshard.parallelize(case.model, autoshard.Mesh(dp=dp) if dp > 1 else None, example_inputs=case.inputs,
                               loss_fn=case.loss_fn, target=case.target)
    victim = dict(case.model.named_parameters())["transformer.h.1.mlp.c_fc.weight"]
    victim.register_hook(lambda g: g * (1 + 1e-3))  # a gradient off by 0.1%
    report = compare(reference, pm, case.inputs, case.target, loss_fn=case.loss_fn)
    return str(report), report.ok


def test_a_perturbed_gradient_is_caught():
    text, ok = _perturbed_gradient_report("gpt", 1)
    assert not ok
    assert "grad transformer.h.1.mlp.c_fc.weight" in text
    assert "grad transformer.h.0" not in text, "only the perturbed gradient differs"
    # The forward is right: the search from the initial parameters finds no diverging node.
    assert "first diverging node" not in text


def test_a_corrupted_graph_names_the_first_diverging_node():
    case, reference = build("llama"), build("llama").model
    pm = autoshard.parallelize(case.model, None, example_inputs=case.inputs, loss_fn=case.loss_fn, target=case.target)
    gm = pm.latest.program.gm
    victim = next(n for n in gm.graph.nodes if n.op == "call_function" and "silu" in str(n.target))
    with gm.graph.inserting_after(victim):
        wrong = gm.graph.call_function(torch.ops.aten.mul.Tensor, (victim, 1.01))
    victim.replace_all_uses_with(wrong, delete_user_cb=lambda user: user is not wrong)
    gm.recompile()
    report = compare(reference, pm, case.inputs, case.target, loss_fn=case.loss_fn)
    assert not report.ok
    # The inserted node has no counterpart in the reference graph: its consumer is the first to differ.
    consumer = next(iter(wrong.users))
    assert report.divergence.startswith(f"{consumer.name} "), report.divergence
    assert "in model.layers.0.mlp" in report.divergence and "models.py" in report.divergence


def _raise_on_rank_one() -> int:
    if dist.get_rank() == 1:
        raise ValueError("rank one is broken")
    return dist.get_rank()


def test_a_failing_rank_shows_its_traceback(pools):
    with pytest.raises(WorkerError, match=r"rank\(s\) \[1\](.|\n)*ValueError: rank one is broken"):
        pools.get(2).run(_raise_on_rank_one)


def _stall_on_rank_one() -> None:
    if dist.get_rank() == 1:
        dist.all_reduce(torch.ones(1))  # rank 0 never joins: a hang


def test_a_stalled_rank_is_named_with_its_line(pools):
    before = pools.get(2).run(os.getpid)
    with pytest.raises(WorkerTimeout) as info:
        pools.get(2).run(_stall_on_rank_one, timeout=3)
    message = str(info.value)
    assert "rank(s) [1]" in message and "finished: [0]" in message
    assert "_stall_on_rank_one" in message, "the stalled rank's stack shows where it waits"
    after = pools.get(2).run(os.getpid)
    assert len(set(after)) == 2 and os.getpid() not in after, f"one process per rank, not this one: {after}"
    assert not set(after) & set(before), f"a fresh pool replaces the broken one: {before} then {after}"


def _killed_on_rank_one() -> int:
    if dist.get_rank() == 1:
        os.kill(os.getpid(), 9)  # as the kernel does to a process that runs out of memory
    time.sleep(60)  # rank 0 would wait for its peer
    return dist.get_rank()


def test_a_worker_that_dies_fails_the_task_at_once(pools):
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank\(s\) \[1\](.|\n)*died \(exit code -9; killed, out of memory\?\)"):
        pools.get(2).run(_killed_on_rank_one, timeout=120)
    assert time.monotonic() - start < 30, "a dead worker is noticed within seconds, not at the task's timeout"


def _replicas_after_drift() -> tuple[bool, bool]:
    case = build("mlp")
    mesh = autoshard.Mesh(dp=2)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, groups=golden.groups_for(mesh))
    before = _replicas_identical(pm)
    if dist.get_rank() == 1:
        with torch.no_grad():
            next(pm.parameters()).view(-1)[0] += 1e-7  # the smallest drift still shows
    return before, _replicas_identical(pm)


def test_replicas_that_drift_apart_are_caught(pools):
    assert pools.get(2).run(_replicas_after_drift) == [(True, False), (True, False)]


def _unpicklable_result():
    return lambda: None  # cannot cross the process boundary


def test_a_result_that_cannot_be_sent_back_fails_instead_of_hanging(pools):
    with pytest.raises(WorkerError, match="pickle"):
        pools.get(2).run(_unpicklable_result, timeout=30)


def test_a_peer_that_never_joins_stops_the_step_with_an_error_naming_the_group(pools):
    message = pools.get(2).run(golden.one_rank_skips_a_step, 3.0, timeout=60)[0]
    assert message.startswith("StepError: rank 0"), message
    assert "step 1" in message and "dp x cp [0, 1]" in message and "stalled or died" in message


def test_a_collective_called_on_rank_zero_alone_says_every_rank_calls_it(pools):
    """``if rank == 0: torch.save(pm.state_dict(), ...)``, as HuggingFace scripts save, had left rank 0 in gloo's
    timeout with gloo's words: it now says which call every rank must make."""
    message = pools.get(2).run(golden.only_rank_zero_gathers, 3.0, timeout=60)[0]
    assert message.startswith("StepError: rank 0 waited in pm.state_dict()"), message
    assert "not under `if rank == 0:`" in message and "tp [0, 1]" in message, message


def test_an_empty_comparison_is_not_a_pass():
    report = VerifyReport()
    assert not report.ok and "NOTHING COMPARED" in str(report)
    case = build("mlp")
    pm = autoshard.parallelize(case.model, None, example_inputs=case.inputs, loss_fn=case.loss_fn, target=case.target)
    with pytest.raises(ValueError, match="steps >= 1"):
        compare(build("mlp").model, pm, case.inputs, case.target, loss_fn=case.loss_fn, steps=0)


def test_a_gradient_the_parallel_model_does_not_report_is_a_failure(monkeypatch):
    case, reference = build("mlp"), build("mlp").model
    pm = autoshard.parallelize(case.model, None, example_inputs=case.inputs, loss_fn=case.loss_fn, target=case.target)
    full = pm.gradients
    monkeypatch.setattr(pm, "gradients", lambda: {n: g for n, g in full().items() if n != "fc3.bias"})
    report = compare(reference, pm, case.inputs, case.target, loss_fn=case.loss_fn, steps=1)
    assert not report.ok and "grad fc3.bias: max |diff| inf (not reported)" in str(report), str(report)
    assert report.counts() == {"output": 1, "loss": 1, "grad": 6, "param": 6}


def test_the_golden_check_wants_every_parameter_compared():
    result = {"ok": True, "report": "", "counts": {"output": 1, "loss": 3, "grad": 5, "param": 6},
              "parameters": 6, "steps": 3, "share": 0.5}
    with pytest.raises(AssertionError, match="5, 'param': 6}, 6 parameters"):
        golden.check([result])
    golden.check([{**result, "counts": {**result["counts"], "grad": 6}}], {"tp": 2})


def test_a_mesh_that_shards_nothing_fails_the_golden_check(pools):
    """Every parameter replicated at tp=2 is exact, so only the per-rank share shows that nothing was sharded."""
    names = [f"model.{n}" for n, _ in build("mlp").model.named_parameters()]
    plan = TensorParallelPlan(2, {n: ParamPlan(R, "replicated", "by hand") for n in names})
    results = pools.get(2).run(golden.golden, "mlp", {"tp": 2}, tp_plan=plan)
    assert all(r["ok"] for r in results), results[0]["report"]
    with pytest.raises(AssertionError, match="holds 100% of the parameter bytes"):
        golden.check(results, {"tp": 2})
