"""Pipeline parallelism: every schedule, at pp=2 and pp=4, computes what the unsharded model computes."""

from __future__ import annotations

import pytest

from harness import golden
from harness.launcher import WorkerError
from harness.models import ZOO_NAMES

# (pp, microbatches, schedule, chunks)
CONFIGS = [
    (2, 1, "1f1b", 1),
    (2, 4, "gpipe", 1),
    (2, 4, "1f1b", 1),
    (2, 8, "1f1b", 1),
    (2, 4, "interleaved", 2),
    (4, 4, "1f1b", 1),
    (4, 8, "gpipe", 1),
    (4, 8, "interleaved", 2),
    (2, 2, "zb-h1", 1),
    (4, 8, "zb-h1", 1),
    (2, 2, "zbv", 2),  # fewer than the 2p - 1 microbatches that fill the V
    (2, 4, "zbv", 2),
    (4, 8, "zbv", 2),
    (2, 4, "dualpipev", 2),
]


@pytest.mark.parametrize("pp,microbatches,schedule,chunks", CONFIGS, ids=[f"pp{c[0]}-m{c[1]}-{c[2]}" for c in CONFIGS])
@pytest.mark.parametrize("name", ZOO_NAMES)
def test_golden_pipeline(pools, name, pp, microbatches, schedule, chunks):
    run = pools.get(pp).run
    # Stages that would hold no parameter (only the loss) are refused: the MLP has 3 linears, the untied Llamas 7
    # pieces with weights (embedding, 2 x (attention, MLP or experts), final norm, head).
    most = {"mlp": 3, "llama": 7, "moe": 7, "hf_llama": 7}.get(name)
    if most is not None and pp * chunks > most:
        with pytest.raises(WorkerError, match=rf"(parameter to train.*use at most {most}|7 cuts.*at most 6) stages"):
            run(golden.golden, name, {"pp": pp}, microbatches=microbatches, schedule=schedule, chunks=chunks)
        return
    results = run(golden.golden, name, {"pp": pp}, microbatches=microbatches, schedule=schedule, chunks=chunks)
    golden.check(results, {"pp": pp})


def test_explain_shows_stages_cuts_bubble_and_the_schedule(pools):
    report = pools.get(2).run(golden.explain, "gpt", {"pp": 2}, microbatches=4, schedule="1f1b")[0]
    assert "pipeline: 2 stages on 2 pp ranks; rank 0 (pp=0) runs stage 0" in report
    assert "schedule 1f1b, 4 microbatch(es)" in report
    assert "simulated bubble 20.0% (formula (p-1)/(m+p-1) = 20.0%)" in report
    assert ("1 weight(s) spread over the pp ranks (each stores its rows; gathered for each step, gradients "
            "reduce-scattered): transformer.wte.weight, lm_head.weight") in report
    assert "the largest holds 5" in report  # of the parameters: the embedding is stored once, in halves
    assert "rank 0: F0 F1" in report


def test_explain_shows_a_zero_bubble_schedule_in_its_v(pools):
    report = pools.get(2).run(golden.explain, "gpt", {"pp": 2}, microbatches=4, schedule="zbv")[0]
    assert "pipeline: 4 stages on 2 pp ranks (2 chunks per rank); rank 0 (pp=0) runs stages 0, 3" in report
    assert "simulated bubble 4.0% (formula (p-1)/(6m+p-1) = 4.0%)" in report
    assert "(I3/W3: its input/weight gradients)" in report and "I0.3" in report


def test_too_few_microbatches_warn_about_the_bubble(pools):
    messages = pools.get(2).run(golden.warnings_of, "gpt", {"pp": 2}, microbatches=1)[0]
    assert any("m=1 < pp=2: the pipeline never fills, the bubble is 50.0%" in m for m in messages), messages


def test_the_last_steps_timeline_is_recorded(pools):
    lines = pools.get(2).run(golden.timeline, "gpt", {"pp": 2}, microbatches=4, schedule="1f1b")
    assert lines[0].startswith("pp rank 0: ") and "(the schedule alone: 20%)" in lines[0]
    assert "0F0@" in lines[0] and "0B3@" in lines[0]
    assert "1F0@" in lines[1], "rank 1 runs stage 1"


def test_ranks_whose_stages_do_not_fit_together_are_refused_before_a_step(pools):
    """Rank 1 compiles stage 1 to receive the residual stream as (seq, batch, hidden), the same bytes as the
    (batch, seq, hidden) stage 0 sends. Unchecked, rank 1 failed inside its stage and rank 0 waited 120 s in a
    receive before failing; now both ranks are refused before the step, told which stages disagree."""
    for message in pools.get(2).run(_mismatched_handoff):
        assert "pipeline stage 0 (pp rank 0) sends [((4, 16, 48), 'torch.float32')]" in message, message
        assert "stage 1 (pp rank 1) receives [((16, 4, 48), 'torch.float32')]" in message, message
        assert "the ranks compiled different programs" in message


def _mismatched_handoff() -> str:
    import dataclasses

    import torch.distributed as dist

    import autoshard
    import autoshard.runtime.parallel_model as parallel_model

    from harness.models import build

    compile_rank = parallel_model.compile_rank

    def another_program(*args, **kwargs):
        built = compile_rank(*args, **kwargs)
        if dist.get_rank() == 1:
            received, sent = built.local_specs[1]
            shape = received[0].shape
            built.local_specs[1] = ([dataclasses.replace(received[0], shape=(shape[1], shape[0], *shape[2:])),
                                     *received[1:]], sent)
        return built

    case, mesh = build("gpt"), autoshard.Mesh(pp=2)
    parallel_model.compile_rank = another_program
    try:
        pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                                   target=case.target, microbatches=2, groups=golden.groups_for(mesh))
        pm.step(*case.inputs, target=case.target)
    except RuntimeError as e:
        return str(e)
    finally:
        parallel_model.compile_rank = compile_rank
    return "no error"
