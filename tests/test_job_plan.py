"""The job plan: the decisions of a whole job made once, every rank's build a pure function of (capture, plan,
coordinates). One process, nothing run."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from autoshard.compile import RankBuild, capture_for_training, compile_rank
from autoshard.job_plan import JobPlan, plan_job
from autoshard.mesh import Mesh
from autoshard.options import CompileOptions
from autoshard.passes.sequence_parallel import ReduceScatterToSequence, SequenceParallelError

from harness.golden import PatchViT
from harness.models import build


def _vit(class_token: bool = False):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(4)
    pixels, target = torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 5, (4,), generator=g)
    return PatchViT(class_token=class_token), (pixels,), target, F.cross_entropy


def _zoo(name: str):
    case = build(name)
    return case.model, case.inputs, case.target, case.loss_fn


def _capture(make, microbatches: int = 1):
    model, inputs, target, loss_fn = make()
    rows = target.shape[0] // microbatches
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return capture_for_training(model, tuple(x[:rows] for x in inputs), target[:rows], loss_fn)


def _every_rank(captured, plan: JobPlan) -> list[RankBuild]:
    mesh = plan.mesh
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [compile_rank(captured, plan, mesh.coords(rank)) for rank in range(mesh.world_size)]


def _graph(captured) -> list[tuple]:
    """What a pass could change of a captured graph: its code, and every node's name, op, arguments, metadata keys
    and shape."""
    return [captured.gm.code] + [(n.name, n.op, str(n.target), str(n.args), str(n.kwargs), sorted(n.meta),
                                  tuple(v.shape) if isinstance(v := n.meta.get("val"), torch.Tensor) else None)
                                 for n in captured.gm.graph.nodes]


CASES = {  # a split that starts inside the graph (the patches), every axis of the plan, a ring, a V schedule
    "vit-cp2": (lambda: _vit(), {"cp": 2}, {}),
    "gpt-pp2xtp2-sp": (lambda: _zoo("gpt"), {"pp": 2, "tp": 2}, {"microbatches": 2, "sequence_parallel": True}),
    "llama-cp2ring-tp2": (lambda: _zoo("llama"), {"cp": 2, "tp": 2}, {"cp_attention": "ring",
                                                                      "cp_load_balance": True}),
    "gpt-pp2zbv-dp2": (lambda: _zoo("gpt"), {"pp": 2, "dp": 2}, {"microbatches": 2, "schedule": "zbv"}),
}


@pytest.mark.parametrize("case", CASES)
def test_compile_rank_leaves_the_capture_as_it_was(case):
    make, degrees, options = CASES[case]
    options = CompileOptions(**options)
    captured = _capture(make, options.microbatches * degrees.get("dp", 1))
    before = _graph(captured)
    plan = plan_job(captured, Mesh(**degrees), options)
    assert _graph(captured) == before, "planning edited the capture"
    _every_rank(captured, plan)
    assert _graph(captured) == before, "a rank's build edited the capture"


@pytest.mark.parametrize("case", CASES)
def test_a_plan_round_trips_through_json_and_builds_the_same_programs(case):
    make, degrees, options = CASES[case]
    options = CompileOptions(**options)
    captured = _capture(make, options.microbatches * degrees.get("dp", 1))
    plan = plan_job(captured, Mesh(**degrees), options)
    text = plan.to_json()
    again = JobPlan.from_json(text)
    assert again.to_json() == text and again == plan
    assert again.partition is None and (plan.partition is not None) == (plan.mesh.pp > 1)
    for built, rebuilt in zip(_every_rank(captured, plan), _every_rank(captured, again), strict=True):
        assert {s: p.gm.code for s, p in built.programs.items()} == {s: p.gm.code for s, p in rebuilt.programs.items()}
        assert built.actions == rebuilt.actions and built.spread == rebuilt.spread and built.tied == rebuilt.tied
    shown = str(plan)
    assert shown.startswith(f"job plan for {plan.mesh}:")
    assert ("tp:" in shown) == (plan.mesh.tp > 1) and ("cuts after" in shown) == (plan.mesh.pp > 1)


def test_a_later_capture_is_planned_like_the_first():
    """Another microbatch size under pp and tp: the same tp plan, the same cuts, the same spread weights."""
    options = CompileOptions(microbatches=2)
    first = _capture(lambda: _zoo("gpt"), 2)
    later = _capture(lambda: _zoo("gpt"), 4)
    mesh = Mesh(pp=2, tp=2)
    plan = plan_job(first, mesh, options)
    like = plan_job(later, mesh, options, earlier=plan)
    assert like.tp_plan is plan.tp_plan and like.cut_after == plan.cut_after and like.spread == plan.spread
    assert like.notes == []


def test_auto_sequence_parallelism_is_settled_once_in_the_plan():
    """17 tokens (16 patches and a class token) do not split over tp=2; the sharded graph shows it, so "auto" turns
    sequence parallelism off in the plan, with a note, and every rank builds without it; True refuses."""
    captured = _capture(lambda: _vit(class_token=True))
    plan = plan_job(captured, Mesh(tp=2), CompileOptions(sequence_parallel="auto"))
    assert plan.sp_plan is None
    assert any("leaves sequence parallelism off" in note and "17 tokens" in note for note in plan.notes), plan.notes
    for built in _every_rank(captured, plan):
        gm = built.program.gm
        assert not any(isinstance(m, ReduceScatterToSequence) for m in gm.modules())
    on = plan_job(_capture(lambda: _zoo("gpt")), Mesh(tp=2), CompileOptions(sequence_parallel="auto"))
    assert on.sp_plan is not None and not on.notes
    with pytest.raises(SequenceParallelError, match="17 tokens"):
        plan = plan_job(captured, Mesh(tp=2), CompileOptions(sequence_parallel=True))
        _every_rank(captured, plan)


def test_the_parallel_model_shows_its_job_plan():
    import autoshard

    case = build("gpt")
    pm = autoshard.parallelize(case.model, None, example_inputs=case.inputs, loss_fn=case.loss_fn, target=case.target)
    plan = pm.job_plan
    assert plan is pm.builds[0].plan and plan.mesh == Mesh() and JobPlan.from_json(plan.to_json()) == plan
