"""The batch split (dp, microbatches): a loss that couples the samples of a batch is refused, never trained apart.

Each case is a model of its own off the golden path: a two-tower contrastive model (a conv stem, a masked mean
pooling) with CLIP's loss, in-batch negatives with a ``logsumexp`` over rows, a preference loss over a concatenated
chosen/rejected batch on an HF decoder, and per-sample losses that must still pass. The analysis is then checked
against execution: the captured graph run on a whole batch and on its halves, every value it calls split by rows
equal to the matching rows of the whole run, every pending sum to the sum of the halves'.
"""

from __future__ import annotations

import pytest
import torch

import autoshard
from autoshard.compile import compile_global_batch
from autoshard.options import CompileOptions

from harness.golden_batch import (
    TwoTower,
    clip_loss,
    in_batch_negatives,
    per_sample_cosine,
    preference_loss,
    two_tower_batch,
)

aten = torch.ops.aten

# where the parts run apart: microbatches, a pipeline (dp with one microbatch gathers, beside tp too: exact, below)
MESHES = [({}, 2), ({"dp": 2, "tp": 2, "pp": 2}, 2)]
MESH_IDS = ["m2", "dp2xtp2xpp2-m2"]


def _compile(model, inputs, target, loss_fn, mesh, microbatches, **options):
    return compile_global_batch(model, inputs, autoshard.Mesh(**mesh), 0,
                                CompileOptions(microbatches=microbatches, **options), target=target, loss_fn=loss_fn)


@pytest.mark.parametrize("mesh,microbatches", MESHES, ids=MESH_IDS)
@pytest.mark.parametrize("loss_fn", [clip_loss, in_batch_negatives], ids=["clip", "in-batch-negatives"])
def test_a_contrastive_loss_is_taken_in_two_passes_where_the_parts_run_apart(loss_fn, mesh, microbatches):
    """Each part would train its own contrastive loss over its own rows (open_clip's loss read 0.7874 for 1.7906, the
    in-batch negatives 0.0 at one sample a part). Where the parts run apart (microbatches, pp) the step takes it in
    two passes: the build is the second pass's, fed the gradients of the two embeddings the term reads (rows first),
    its loss a sum over the samples; the notes say so, naming the term."""
    inputs, target = two_tower_batch()
    build = _compile(TwoTower(), inputs, target, loss_fn, mesh, microbatches)
    fed = [n for n in build.captured.gm.graph.nodes if n.op == "placeholder" and n.name.startswith("two_passes_grad")]
    rows = 8 // (mesh.get("dp", 1) * microbatches)  # a part's rows of the batch of 8
    assert [tuple(n.meta["val"].shape) for n in fed] == [(rows, 12), (rows, 12)]
    assert build.plan.loss_sum
    assert any("two passes" in note and "matmul" in note and "mul_1, numpy_t" in note for note in build.plan.notes)


def test_a_pipeline_over_the_whole_batch_takes_no_second_pass():
    """pp with one microbatch and no dp runs the whole batch through its stages: the term reads every row already,
    and the step is the ordinary one (with dp beside it, the ranks' parts run apart: two passes)."""
    inputs, target = two_tower_batch()
    alone = _compile(TwoTower(), inputs, target, clip_loss, {"pp": 2}, 1)
    assert not any("two passes" in note for note in alone.plan.notes)
    beside = _compile(TwoTower(), inputs, target, clip_loss, {"dp": 2, "pp": 2}, 1)
    assert any("two passes" in note for note in beside.plan.notes)


@pytest.mark.parametrize("loss_fn,what", [(clip_loss, r"matmul at matmul in the loss_fn reads the rows of the whole "
                                                      r"batch"),
                                          (in_batch_negatives, r"matmul at matmul in the loss_fn reads the rows")],
                         ids=["clip", "in-batch-negatives"])
def test_a_contrastive_loss_over_one_sample_a_part_is_refused(loss_fn, what):
    """One sample a part: the analysis tells the rows apart on the capture at two, and the parts would each train a
    loss over one row (0.0 for in-batch negatives). Refused before any collective, naming the op, its line and what
    works. The conv stem and the masked mean pooling keep samples apart (their rules say so): the refusal is the
    loss's, not theirs."""
    inputs, target = two_tower_batch(4)
    with pytest.raises(ValueError, match=rf"not a sum over the batch's samples: {what}.*tp, cp, and pp with one "
                                         r"microbatch are exact.*dp with one microbatch and no pp or cp.*"
                                         r"gathered over dp.*batch_statistics='local'"
                       ) as e:
        _compile(TwoTower(), inputs, target, loss_fn, {"dp": 2}, 2)
    assert "conv" not in str(e.value) and "normalize" not in str(e.value)


def test_a_coupled_loss_over_a_model_that_draws_dropout_is_refused_under_microbatches():
    """The two passes forward each part twice: dropout would draw other masks the second time. Refused, naming it."""
    inputs, target = two_tower_batch()

    class Dropped(TwoTower):
        def forward(self, images, tokens, mask):
            image, text, scale = super().forward(images, tokens, mask)
            return torch.nn.functional.dropout(image, 0.1), text, scale

    with pytest.raises(ValueError, match=r"two passes over the batch, which cannot run it: .*dropout.*draws random"):
        _compile(Dropped(), inputs, target, clip_loss, {}, 2)


def test_a_contrastive_loss_computed_per_part_is_said_with_local_statistics():
    inputs, target = two_tower_batch()
    build = _compile(TwoTower(), inputs, target, clip_loss, {}, 2, batch_statistics="local")
    assert any("couples the samples" in note and "batch_statistics='local'" in note for note in build.plan.notes)


@pytest.mark.parametrize("mesh,microbatches", [*MESHES, ({"dp": 2, "tp": 2}, 1)], ids=[*MESH_IDS, "dp2xtp2"])
def test_a_per_sample_loss_through_convolutions_and_pooling_passes(mesh, microbatches):
    """Every sample against its own pair, through a conv stem, a masked mean and ``F.normalize``: a mean over
    samples, which the parts add up exactly."""
    inputs, target = two_tower_batch()
    _compile(TwoTower(), inputs, target, per_sample_cosine, mesh, microbatches)


def test_preference_pairs_at_one_sample_a_part_are_refused():
    """Pair ``i`` is rows ``i`` and ``i + n``: a part of one row holds a chosen row without its rejected one (0.7968
    for 0.9225 before). Refused naming the slice that pairs them."""
    from harness.models import build

    case = build("hf_llama")
    inputs = tuple(v[:2] for v in case.inputs)
    with pytest.raises(ValueError, match=r"not a sum over the batch's samples: slice.*reads the rows of the whole"):
        _compile(case.model, inputs, inputs[0], preference_loss, {}, 2)


def test_a_batch_weighted_by_a_softmax_over_its_rows_is_found():
    """``(ce * softmax(-ce, dim=0)).sum()``: each row weighed against the whole batch. In the loss nothing is taken
    back as rows of the batch, though the weights are multiplied row by row: taken in two passes, naming the
    softmax."""
    inputs, target = two_tower_batch()

    def weighted(output, t):
        image, text, _ = output
        per_row = 1 - (image * text).sum(-1)
        return (per_row * torch.softmax(-per_row.detach(), dim=0)).sum()

    build = _compile(TwoTower(), inputs, target, weighted, {}, 2)
    assert any("softmax at softmax in the loss_fn reads the rows of the whole batch" in note and "two passes" in note
               for note in build.plan.notes), build.plan.notes


def test_an_op_without_a_batch_rule_that_reads_the_loss_is_refused_not_guessed():
    """``torch.cdist`` has no rule: the propagation once modelled it as a gather no rank performs and approved the
    loss. Unknown now: what reads it runs on the whole batch (two passes under microbatches, said naming it), and
    where no pass can (one sample a part) it is refused, naming it."""
    inputs, target = two_tower_batch()

    def distances(output, t):
        image, text, _ = output
        return torch.cdist(image, text).diagonal().mean()

    build = _compile(TwoTower(), inputs, target, distances, {}, 2)
    assert any("cdist" in note and "has no rule for a split batch" in note and "two passes" in note
               for note in build.plan.notes), build.plan.notes
    with pytest.raises(ValueError, match=r"cdist.*has no rule for a split batch"):
        _compile(TwoTower(), *two_tower_batch(4), distances, {"dp": 2}, 2)


# ----------------------------------------------------------------------------- exact under dp, and under tp

GOLDEN_MESHES = [({"dp": 2}, "clip"), ({"dp": 2}, "in_batch_negatives"), ({"dp": 2}, "per_sample"),
                 ({"tp": 2}, "clip"), ({"dp": 4}, "clip"), ({"dp": 2, "tp": 2}, "in_batch_negatives")]


@pytest.mark.parametrize("mesh,loss", GOLDEN_MESHES, ids=[f"{'x'.join(f'{k}{v}' for k, v in m.items())}-{loss}"
                                                          for m, loss in GOLDEN_MESHES])
def test_a_contrastive_loss_is_exact_under_dp_and_tp(pools, mesh, loss):
    """Under dp alone the rows the loss reads (the scaled image embeddings and the text embeddings) are gathered from
    every dp rank, with a backward that sums their gradient and keeps each rank's rows: the loss, every gradient and
    the parameters after three steps are the unsharded model's. tp keeps the batch whole; beside dp it splits the
    towers' linears while the gathered rows are the whole batch's."""
    from harness.golden import check
    from harness.golden_batch import coupled_golden

    world = 1
    for degree in mesh.values():
        world *= degree
    check(pools.get(world).run(coupled_golden, loss, mesh))


PREFERENCE_MESHES = [("hf_llama", {"dp": 2}), ("hf_llama", {"tp": 2}), ("hf_llama", {"cp": 2}),
                     ("hf_llama", {"dp": 2, "tp": 2}), ("moe", {"dp": 2, "ep": 2})]


@pytest.mark.parametrize("name,mesh", PREFERENCE_MESHES,
                         ids=[f"{name}-{'x'.join(f'{k}{v}' for k, v in m.items())}" for name, m in PREFERENCE_MESHES])
def test_preference_pairs_are_exact_under_dp_tp_cp_and_ep(pools, name, mesh):
    """DPO's pairs over a concatenated batch on the zoo's HF Llama: under dp each rank's per-row log-probabilities
    are gathered (pair ``i`` is rows ``i`` and ``i + n`` of the whole batch), and ``logp[:n]`` cuts at the whole
    batch's ``n``; tp and cp keep the batch whole (cp's sequence split summed in each row's log-probability). Beside
    tp (its vocab-parallel logits) and ep (the zoo's mixture of experts, its experts split over the dp ranks) the
    gathered rows are the same."""
    from harness.golden import check
    from harness.golden_batch import preference_golden

    world = 1
    for degree in mesh.values():
        world *= degree
    check(pools.get(world // mesh.get("ep", 1)).run(preference_golden, mesh, name=name), mesh)


def test_what_dp_gathers_for_a_coupled_term_is_said_and_counted():
    """``explain()``'s notes name the term and the values gathered; its collectives table counts the all-gathers
    (forward) and reduce-scatters (backward) on dp: the two (B/2, 12) embeddings of each rank, fp32."""
    from autoshard.explain import collectives

    inputs, target = two_tower_batch()
    build = _compile(TwoTower(), inputs, target, clip_loss, {"dp": 2}, 1)
    assert any("couples the samples" in note and "matmul" in note and "gathers mul_1, numpy_t" in note
               for note in build.plan.notes), build.plan.notes
    counted = collectives(build.programs[0].gm)
    assert counted[("dp", "forward", "all_gather", "DataAllGather")] == (2, 2 * 4 * 12 * 4)
    assert counted[("dp", "backward", "reduce_scatter", "DataAllGather")] == (2, 2 * 4 * 12 * 4)


TWO_PASSES = [({}, "clip", 2), ({"pp": 2}, "clip", 2), ({"dp": 2}, "in_batch_negatives", 2),
              ({"dp": 2}, "clip_scaled_last", 2), ({"pp": 2}, "in_batch_negatives", 4),
              ({"dp": 2, "pp": 2}, "clip", 1), ({"dp": 2, "tp": 2, "pp": 2}, "clip", 2)]


@pytest.mark.parametrize("mesh,loss,microbatches", TWO_PASSES,
                         ids=[f"{'x'.join(f'{k}{v}' for k, v in m.items()) or 'one'}-{loss}-m{mb}"
                              for m, loss, mb in TWO_PASSES])
def test_a_contrastive_loss_is_exact_in_two_passes_under_microbatches_and_pp(pools, mesh, loss, microbatches):
    """Where the parts of the batch run apart, the step takes the loss in two passes (as GradCache does): the first
    forwards every microbatch to the embeddings, gathered over dp; the term and its gradient are computed on the
    whole batch; the second forwards and backwards each microbatch fed its rows of that gradient. Where the term
    reads the learnt temperature itself (``clip_scaled_last``), its gradient is fed as rows of ``1/B`` of it. The
    loss, every gradient and the parameters after three steps are the unsharded model's."""
    from harness.golden import check
    from harness.golden_batch import coupled_golden

    world = 1
    for degree in mesh.values():
        world *= degree
    check(pools.get(world).run(coupled_golden, loss, mesh, microbatches=microbatches) if world > 1 else
          [coupled_golden(loss, mesh, microbatches=microbatches)])


@pytest.mark.parametrize("loss,mesh", [("clip", {"pp": 2}), ("clip_scaled_last", {"dp": 2})], ids=["clip-pp2",
                                                                                                "scaled-last-dp2"])
def test_an_ordinary_training_loop_in_two_passes(pools, loss, mesh):
    """AdamW with groups from ``named_parameters()`` and two ``step()`` calls on other batches accumulated into each
    optimizer step, each in two passes over two microbatches: the losses and the parameters after two optimizer
    steps are the unsharded loop's."""
    from harness.golden_batch import coupled_loop

    for rank, result in enumerate(pools.get(2).run(coupled_loop, loss, mesh, microbatches=2)):
        assert result["loss"] < 1e-5 and result["param"] < 1e-5, f"rank {rank}: {result}"


def test_a_whole_value_the_term_reads_is_fed_its_gradient_as_rows():
    """The temperature read by the term itself is a whole boundary value: the second pass is fed its gradient as
    one row per sample (summed over the part's rows), beside the two embeddings' rows."""
    from harness.golden_batch import clip_scaled_last

    inputs, target = two_tower_batch()
    build = _compile(TwoTower(), inputs, target, clip_scaled_last, {"dp": 2}, 2)
    fed = [tuple(n.meta["val"].shape) for n in build.captured.gm.graph.nodes
           if n.op == "placeholder" and n.name.startswith("two_passes_grad")]
    assert sorted(fed) == [(2,), (2, 12), (2, 12)], fed


PREFERENCE_TWO_PASSES = [{"pp": 2}, {"dp": 2, "tp": 2, "pp": 2}]


@pytest.mark.parametrize("mesh", PREFERENCE_TWO_PASSES,
                         ids=["x".join(f"{k}{v}" for k, v in m.items()) for m in PREFERENCE_TWO_PASSES])
def test_preference_pairs_are_exact_in_two_passes_under_microbatches(pools, mesh):
    """DPO's pairs on the zoo's HF Llama with two microbatches: the first pass forwards each microbatch to its rows'
    log-probabilities (the per-token log-softmax and gather stay in the passes, summed per row: the term reads one
    number a row), the term pairs row ``i`` with row ``i + n`` of the whole batch."""
    from harness.golden import check
    from harness.golden_batch import preference_golden

    world = 1
    for degree in mesh.values():
        world *= degree
    check(pools.get(world).run(preference_golden, mesh, microbatches=2), mesh)


@pytest.mark.parametrize("loss,mesh,microbatches", [("clip", {"dp": 2}, 1), ("in_batch_negatives", {"dp": 2}, 1),
                                                     ("clip", {"pp": 2}, 2)], ids=["clip", "in_batch_negatives",
                                                                                   "clip-pp2-m2"])
def test_a_contrastive_loss_under_dp_matches_eager_bf16_autocast(pools, loss, mesh, microbatches):
    """Under ``mixed_precision="bf16"`` the gathered embeddings are bf16 and the term is computed as eager autocast
    computes it: the loss within 1e-5 and every gradient within the bf16 bound of the mixed-precision goldens
    (``test_mixed_precision.GRAD_RTOL``), and farther from float32's (autocast was on). In two passes (pp2 with two
    microbatches) the first pass runs under the same autocast as the second."""
    from test_mixed_precision import GRAD_RTOL

    from harness.golden_batch import coupled_bf16

    for rank, result in enumerate(pools.get(2).run(coupled_bf16, loss, mesh, microbatches=microbatches)):
        loss_off, errors = result["amp"]
        assert loss_off <= 1e-5 and max(errors.values()) <= GRAD_RTOL, f"rank {rank}: {result}"
        assert max(result["fp32"][1].values()) > 1e-3, f"rank {rank}: autocast was off? {result}"


SUMS = [("sum", {"dp": 2}, 1), ("mse_sum", {"dp": 2}, 2), ("sum", {"pp": 2}, 2), ("mean_by_hand", {"dp": 2}, 2)]


@pytest.mark.parametrize("loss,mesh,microbatches", SUMS, ids=["sum-dp2", "mse-sum-dp2-m2", "sum-pp2-m2",
                                                                "mean-by-hand-dp2-m2"])
def test_a_loss_summed_over_the_samples_adds_the_parts(pools, loss, mesh, microbatches):
    """``loss.sum()`` and ``mse_loss(reduction='sum')``: the parts' losses are added, not averaged as a mean's are
    (it trained at 1/dp of the gradient before, and the loss read 6.2 off at dp2); ``sum() / x.shape[0]`` is a mean
    (its divisor doubles with the batch) and stays averaged."""
    from harness.golden import check
    from harness.golden_batch import coupled_golden

    world = 1
    for degree in mesh.values():
        world *= degree
    check(pools.get(world).run(coupled_golden, loss, mesh, microbatches=microbatches))


def test_a_sum_beside_a_mean_over_the_samples_is_taken_in_two_passes_or_refused():
    """Neither the parts' sum nor their average is such a loss: in two passes the term reads the whole batch's sums
    (where each part holds two samples or more); at one sample a part it is refused."""
    inputs, target = two_tower_batch()

    def mixed(output, t):
        image, text, scale = output
        per_row = 1 - scale * (image * text).sum(-1)
        return per_row.sum() + per_row.detach().mean() * per_row.mean()

    build = _compile(TwoTower(), inputs, target, mixed, {}, 2)
    assert any("two passes" in note for note in build.plan.notes), build.plan.notes
    with pytest.raises(ValueError, match=r"not a sum over the batch's samples|adds a sum over the batch's samples"):
        _compile(TwoTower(), *two_tower_batch(4), mixed, {"dp": 2}, 2)


# ------------------------------------------------------------------------- the analysis against execution


def _run(gm, values):
    """Every node's value when ``gm`` runs on ``values`` (its placeholders in order)."""
    from torch.fx.interpreter import Interpreter

    seen = {}

    class Recorder(Interpreter):
        def run_node(self, n):
            seen[n.name] = super().run_node(n)
            return seen[n.name]

    with torch.no_grad():
        Recorder(gm).run(*values)
    return seen


def differential_check(model, inputs: tuple, target, loss_fn) -> int:
    """Capture ``model`` at ``b`` and ``2b`` samples; where the analysis of the ``b`` graph calls a value split by
    rows (``Shard``) or pending (``Partial``) and no finding reaches it, the ``2b`` graph run on two batches must
    give the rows of each (or their sum). Returns how many values were compared."""
    from autoshard import codegen
    from autoshard.compile import capture_for_training
    from autoshard.job_plan import _batch_propagation
    from autoshard.passes import batch_split
    from autoshard.passes.placements import Partial, Shard

    half = tuple(v[: v.shape[0] // 2] for v in inputs)
    captured = capture_for_training(model, half, target[: target.shape[0] // 2], loss_fn)
    small = codegen.prepare(captured.recapture(1), None)  # as captured, like the larger one (no loss rewrite)
    large = codegen.prepare(captured.recapture(2), None)
    prop, _ = _batch_propagation(small, half[0].shape[0])  # rewrites small's full reductions by dims: so large's
    batch_split.reductions_by_dims(large)
    first, second = (tuple(v[i * v.shape[0] // 2:(i + 1) * v.shape[0] // 2] for v in (*inputs, target))
                     for i in range(2))
    runs = [_run(small, first), _run(small, second), _run(large, (*inputs, target))]
    compared = 0
    for a, b in zip(small.graph.nodes, large.graph.nodes, strict=True):
        placement, value = prop.of(a), runs[2].get(b.name)
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            continue
        parts = [runs[0].get(a.name), runs[1].get(a.name)]
        if isinstance(placement, Shard) and placement.blocks is None:
            torch.testing.assert_close(torch.cat(parts, placement.dim), value, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, n=a: f"{n.name} ({n.target}), split by rows: {m}")
            compared += 1
        elif isinstance(placement, Partial) and a.target in (aten.sum.dim_IntList, aten.mean.dim):
            whole = parts[0] + parts[1] if a.target is aten.sum.dim_IntList else (parts[0] + parts[1]) / 2
            torch.testing.assert_close(whole, value, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, n=a: f"{n.name} ({n.target}), a pending sum: {m}")
            compared += 1
    return compared


def test_the_batch_rules_agree_with_execution_on_a_two_tower_model():
    inputs, target = two_tower_batch()
    assert differential_check(TwoTower(), inputs, target, per_sample_cosine) > 20


@pytest.mark.parametrize("name", ["gpt", "llama", "moe", "bert", "mlp", "hf_gpt2", "hf_llama"])
def test_the_batch_rules_agree_with_execution_on_the_zoo(name):
    from harness.models import build

    case = build(name)
    assert differential_check(case.model, case.inputs, case.target, case.loss_fn) > 10


def _corpus_sample() -> list:
    """Every fourth architecture of the corpus (about 50); three of them left to the CI tier's covering (which runs
    one: tests/harness/tiers.py), the rest in the full tier."""
    from corpus.architectures import names

    sample = names()[::4]
    ci = {"mixtral", "falcon_mamba", "gpt2"} & set(sample) or set(sample[:3])
    return [pytest.param(n, marks=() if n in ci else pytest.mark.full) for n in sample]


@pytest.mark.parametrize("name", _corpus_sample())
def test_the_batch_rules_agree_with_execution_on_the_corpus(name):
    """As on the zoo, on architectures nobody here wrote: a mixture's dispatch sorted and scattered back, a scan's
    convolution, a vision model's pooling."""
    from corpus.architectures import build, check_eager

    if (reason := check_eager(name)) is not None:
        # the corpus itself lists these apart, uncounted (bench/corpus.md): no unsharded run to compare with
        pytest.skip(f"{name} does not train unsharded at tiny size, as in the corpus: {reason}")
    case = build(name)
    differential_check(case.model, case.inputs, case.target, case.loss_fn)  # (musicgen's codebooks: none split)
