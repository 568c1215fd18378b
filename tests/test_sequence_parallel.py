"""Sequence parallelism: between the tensor-parallel regions the sequence is split over the tp ranks, exactly."""

from __future__ import annotations

import warnings

import pytest
import torch

import autoshard
from autoshard import meta

from harness import golden, golden_loop
from harness.launcher import WorkerError
from harness.models import build

SP_MODELS = ["gpt", "llama", "bert", "hf_gpt2", "hf_llama", "megatron"]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", SP_MODELS)
def test_golden_sequence_parallel(pools, name, tp):
    golden.check(pools.get(tp).run(golden.golden, name, {"tp": tp}, sequence_parallel=True), {"tp": tp})


@pytest.mark.parametrize("tp", [2, 4])
def test_golden_sequence_parallel_where_a_block_also_runs_without_gradients(pools, tp):
    """HRM's cycles: a block run under torch.no_grad() has no gradient for Megatron's f to sum, yet its entry must
    gather the sequence as the same block's entry with gradients does. Without it each rank joined its heads of its
    own tokens with the other ranks' heads of theirs, and the outputs differed by 1e-2."""
    for rank, (report, share) in enumerate(pools.get(tp).run(golden.cycles_without_grad, tp, sequence_parallel=True)):
        assert not report, f"rank {rank}:\n{report}"
        assert share < 1 / tp + 0.2, share


def test_golden_sequence_parallel_where_a_whole_summary_gates_split_tokens(pools):
    """A block's output averaged over the sequence stays all-reduced (whole on every rank) and gates the tokens
    sequence parallelism splits: each rank's gradient of it is its own tokens' part, summed over the ranks by an f.
    The f was missing where the summary came from a collective through parameter-free ops only: the gradients of
    the block's weights were each rank's half (5e-3 off)."""
    for rank, report in enumerate(pools.get(2).run(golden.sequence_summary, 2, sequence_parallel=True)):
        assert not report, f"rank {rank}:\n{report}"


@pytest.mark.parametrize("data_parallel", ["ddp", "fsdp"])
@pytest.mark.parametrize("name", ["gpt", "hf_llama"])
def test_golden_sequence_parallel_with_data_parallel(pools, name, data_parallel):
    mesh = {"dp": 2, "tp": 2}
    golden.check(pools.get(4).run(golden.golden, name, mesh, microbatches=2, sequence_parallel=True,
                                  data_parallel=data_parallel), mesh)


def _compiled(name: str, sequence_parallel: bool, mesh: dict | None = None):
    from autoshard.compile import compile_global_batch
    from autoshard.mesh import Mesh
    from autoshard.options import CompileOptions

    case = build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return compile_global_batch(case.model, case.inputs, Mesh(**(mesh or {"tp": 2})), 0,
                                    CompileOptions(sequence_parallel=sequence_parallel), target=case.target,
                                    loss_fn=case.loss_fn).programs[0].gm


RING = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}  # ring cost, in (n-1)/n of the whole tensor's bytes


def _collectives(gm) -> tuple[dict[str, int], float, float]:
    """The collectives of one step (kind/backward kind -> count) and their ring cost forward and backward: an
    all-reduce moves twice what a reduce-scatter or an all-gather of the same tensor does (it is the two)."""
    from autoshard.passes import collectives

    kinds: dict[str, int] = {}
    forward = backward = 0.0
    for node in gm.graph.nodes:
        module = gm.get_submodule(node.target) if node.op == "call_module" else None
        if not isinstance(module, collectives._ParallelOp) or module.size == 1:
            continue
        value = meta.val(node.all_input_nodes[0])
        f, b = collectives.comm_bytes(module, tuple(value.shape), value.element_size())
        if f or b:
            key = f"{module.kind}/{module.backward_kind}"
            kinds[key] = kinds.get(key, 0) + 1
        forward += f * RING.get(module.kind, 0) / 2
        backward += b * RING.get(module.backward_kind, 0) / 2
    return kinds, forward, backward


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_a_region_s_all_reduce_becomes_a_reduce_scatter_and_its_f_an_all_gather_with_the_same_bytes(name):
    """Megatron's accounting: per layer 2 all-gathers and 2 reduce-scatters forward and the same backward, which
    move what plain TP's 2 all-reduces move (an all-reduce is a reduce-scatter and an all-gather); norms and
    residual adds run on this rank's half of the tokens."""
    plain, sp = _compiled(name, False), _compiled(name, True)
    kinds, forward, backward = _collectives(sp)
    _, tp_forward, tp_backward = _collectives(plain)
    assert kinds["all_gather/reduce_scatter"] == kinds["reduce_scatter/all_gather"] == 4 + 1, kinds  # + the head's
    assert forward <= tp_forward * 1.05 and backward <= tp_backward * 1.05, (forward, tp_forward, backward,
                                                                             tp_backward)
    norms = {tuple(meta.val(n).shape) for n in sp.graph.nodes if n.target is torch.ops.aten.layer_norm.default}
    assert not norms or norms == {(8, 8, 48)}, f"every layer norm runs on this rank's 8 of 16 tokens: {norms}"


def test_a_model_without_a_sequence_is_told_sequence_parallelism_does_not_apply(pools):
    with pytest.raises(WorkerError, match="sequence parallelism splits the sequence over tp and could not find it"):
        pools.get(2).run(golden.golden, "mlp", {"tp": 2}, sequence_parallel=True)


def test_golden_sequence_parallel_on_an_image_model_whose_sequence_starts_at_its_patches(pools):
    """The tokens are made inside the model (a strided conv's patches), not an input's dim: the regions whose
    sums carry them are found from there, as context parallelism finds its split."""
    results = pools.get(2).run(golden.vision_golden, {"tp": 2}, sequence_parallel=True)
    golden.check(results, {"tp": 2})
    assert "ReduceScatterToSequence" in results[0]["modules"], results[0]["modules"]


def test_a_class_token_sequence_tp_does_not_divide_is_refused():
    """ViT's 16 patches and its class token make 17 tokens, which 2 ranks cannot split evenly."""
    from corpus import build as build_architecture

    from autoshard.compile import compile_global_batch
    from autoshard.options import CompileOptions
    from autoshard.passes.sequence_parallel import SequenceParallelError

    case = build_architecture("vision/vit")
    refused = pytest.raises(SequenceParallelError, match=r"sequence of 17 tokens .* does not divide it")
    with refused, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compile_global_batch(case.model, case.inputs, autoshard.Mesh(tp=2), 0, CompileOptions(sequence_parallel=True),
                             target=case.target, loss_fn=case.loss_fn)


@pytest.mark.parametrize("name,schedule", [("gpt", "1f1b"), ("hf_llama", "1f1b"), ("llama", "zbv")])
def test_golden_sequence_parallel_with_a_pipeline(pools, name, schedule):
    """Each stage splits the sequence between its regions; a stage hands its activations on whole along the
    sequence (gathered at its end, split again by the next stage, as a model's inputs are)."""
    mesh = {"tp": 2, "pp": 2}
    golden.check(pools.get(4).run(golden.golden, name, mesh, microbatches=4, sequence_parallel=True,
                                  schedule=schedule), mesh)


def test_golden_sequence_parallel_with_data_tensor_and_pipeline_parallelism(pools):
    mesh = {"dp": 2, "tp": 2, "pp": 2}
    golden.check(pools.get(8).run(golden.golden, "gpt", mesh, microbatches=2, sequence_parallel=True), mesh)


def test_every_stage_splits_the_sequence_between_its_regions():
    from autoshard.compile import compile_global_batch
    from autoshard.mesh import Mesh
    from autoshard.options import CompileOptions
    from autoshard.passes.sequence_parallel import ReduceScatterToSequence

    case = build("llama")
    mesh = Mesh(tp=2, pp=2)
    for rank in (0, 2):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            programs = compile_global_batch(case.model, case.inputs, mesh, rank,
                                            CompileOptions(sequence_parallel=True, microbatches=2),
                                            target=case.target, loss_fn=case.loss_fn).programs
        for index, program in programs.items():
            exits = [n for n in program.gm.graph.nodes if n.op == "call_module"
                     and isinstance(program.gm.get_submodule(n.target), ReduceScatterToSequence)]
            assert len(exits) >= 2, f"stage {index}: {len(exits)} region exits reduce-scatter"


@pytest.mark.parametrize("name,options", [("gpt", {}), ("hf_llama", {"cp_attention": "ring", "cp_load_balance": True}),
                                          ("hf_llama", {"cp_attention": "alltoall"})])
def test_golden_sequence_parallel_with_context_parallelism(pools, name, options):
    """cp splits the sequence over its ranks, then tp splits each cp rank's tokens between the regions (cp's
    attention is inside them, where the sequence is whole over tp)."""
    mesh = {"cp": 2, "tp": 2}
    golden.check(pools.get(4).run(golden.golden, name, mesh, sequence_parallel=True, **options), mesh)


def test_golden_sequence_parallel_with_context_tensor_and_pipeline_parallelism(pools):
    mesh = {"pp": 2, "cp": 2, "tp": 2}
    golden.check(pools.get(8).run(golden.golden, "gpt", mesh, microbatches=2, sequence_parallel=True), mesh)


def test_under_context_parallelism_norms_run_on_a_tp_rank_s_part_of_a_cp_rank_s_tokens():
    gm = _compiled("gpt", True, {"cp": 2, "tp": 2})
    norms = {tuple(meta.val(n).shape) for n in gm.graph.nodes if n.target is torch.ops.aten.layer_norm.default}
    assert norms == {(8, 4, 48)}, f"16 tokens over cp=2 then tp=2: 4 per rank, not {norms}"


def test_a_sequence_cp_x_tp_does_not_divide_is_refused_before_any_collective():
    from autoshard.compile import compile_global_batch
    from autoshard.mesh import Mesh
    from autoshard.options import CompileOptions
    from autoshard.passes.sequence_parallel import SequenceParallelError

    case = build("gpt")
    inputs = tuple(x[:, :14] for x in case.inputs)
    with pytest.raises(SequenceParallelError, match="must divide by cp x tp = 4"):
        compile_global_batch(case.model, inputs, Mesh(cp=2, tp=2), 0, CompileOptions(sequence_parallel=True),
                             target=case.target[:, :14], loss_fn=case.loss_fn)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_dropout_on_draws_the_model_s_own_masks_and_keeps_the_replicas_identical(pools, sequence_parallel):
    """Dropout 0.1 on BERT's hidden states and attention probabilities: a dropout of a split value (heads, or this
    rank's tokens) keeps its part of the whole value's mask, drawn from the stream the tp ranks share; losses,
    gradients and parameters equal the model run whole from the same seed, and the replicated parameters stay
    bit-identical on every rank."""
    results = pools.get(2).run(golden_loop.dropout_masks, {"tp": 2}, sequence_parallel=sequence_parallel)
    assert all(r["replicas_identical"] for r in results), results
    assert results[0]["losses"] == results[1]["losses"]


def test_auto_turns_it_on_where_it_applies_and_off_with_a_note_where_not():
    from autoshard.compile import compile_global_batch
    from autoshard.mesh import Mesh
    from autoshard.options import CompileOptions
    from autoshard.passes.sequence_parallel import ReduceScatterToSequence

    builds = {}
    for name in ("gpt", "mlp"):
        case = build(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            builds[name] = compile_global_batch(case.model, case.inputs, Mesh(tp=2), 0,
                                                CompileOptions(sequence_parallel="auto"), target=case.target,
                                                loss_fn=case.loss_fn)
    gm = builds["gpt"].programs[0].gm
    assert any(isinstance(gm.get_submodule(n.target), ReduceScatterToSequence) for n in gm.graph.nodes
               if n.op == "call_module")
    assert any("sequence_parallel='auto' leaves sequence parallelism off" in note and "could not find it" in note
               for note in builds["mlp"].notes), builds["mlp"].notes
    with pytest.raises(ValueError, match='sequence_parallel=.yes. is not valid: pass True or False \\(or "auto"\\)'):
        CompileOptions(sequence_parallel="yes")


def test_sums_that_feed_attention_stay_all_reduced_and_only_the_residual_streams_are_scattered():
    """Falcon at tp2sp: its keys and values, which one row-parallel product makes whole, are read by attention,
    not added to the residual stream. Reduce-scattered and gathered back they would be the same sums at six more
    collectives (7 reduce-scatters where one, the block's exit, is needed)."""
    import warnings

    from corpus import cells
    from corpus.architectures import build

    from autoshard.compile import capture_for_training, compile_rank
    from autoshard.job_plan import plan_job
    from autoshard.mesh import Mesh
    from autoshard.options import CompileOptions
    from autoshard.passes.sequence_parallel import ReduceScatterToSequence

    degrees, options = cells.MESHES["tp2sp"]
    case = build("falcon")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture_for_training(case.model, case.inputs, case.target, case.loss_fn)
        gm = compile_rank(captured, plan_job(captured, Mesh(**degrees), CompileOptions(**options)), {"tp": 0}
                          ).programs[0].gm
    scatters = [n for n in gm.graph.nodes if n.op == "call_module"
                and isinstance(gm.get_submodule(n.target), ReduceScatterToSequence)]
    assert len(scatters) == 1, gm.code
