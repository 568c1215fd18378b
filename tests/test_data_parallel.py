"""Data parallelism: every zoo model at dp=1, 2 and 4 computes what the unsharded model computes."""

from __future__ import annotations

import pytest

from harness import golden
from harness.models import ZOO_NAMES

# (dp, microbatches): dp=1 runs in this process without torch.distributed; microbatches > 1 check that
# gradients are synchronised once per step, after the last microbatch.
CONFIGS = [(1, 1), (1, 2), (2, 1), (2, 2), (4, 2)]


@pytest.mark.parametrize("dp,microbatches", CONFIGS, ids=[f"dp{d}-m{m}" for d, m in CONFIGS])
@pytest.mark.parametrize("name", ZOO_NAMES)
def test_golden_data_parallel(pools, name, dp, microbatches):
    if dp == 1:
        results = [golden.golden(name, {}, microbatches=microbatches)]
    else:
        results = pools.get(dp).run(golden.golden, name, {"dp": dp}, microbatches=microbatches)
    golden.check(results)


LOCAL_BATCH_MESHES = [("gpt", {"dp": 2}, {}), ("hf_llama", {"dp": 2}, {}), ("gpt", {"cp": 2}, {}),
                      ("llama", {"dp": 2, "cp": 2}, {"cp_load_balance": True})]


@pytest.mark.parametrize("name,mesh,options", LOCAL_BATCH_MESHES, ids=["gpt-dp2", "hf_llama-dp2", "gpt-cp2",
                                                                        "llama-dp2xcp2-balanced"])
def test_local_batches_from_a_sharding_loader(pools, name, mesh, options):
    """Under cp every rank of a dp rank gets the same slice, at the whole sequence; the loss is normalised once."""
    results = pools.get(2 if len(mesh) == 1 else 4).run(golden.local_batch_step, name, mesh, **options)
    assert len({r["loss"] for r in results}) == 1, "every rank returns the same global loss"
    assert all(r["compared"] > 10 for r in results), results


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_inference_under_dp_computes_each_ranks_slice_of_the_batch(pools, name):
    """pm(x) at dp=2: each rank runs its half of the batch and the outputs are gathered, when every output
    carries the batch (found by propagation); a model whose graph mixes in batch-sized values it builds itself
    (HuggingFace's attention masks, BERT's token types) computes the whole batch on every rank instead."""
    for result in pools.get(2).run(golden.inference_slices, name, {"dp": 2}):
        assert result["worst"] < 1e-5 and all(result["shapes_equal"]), result
        if name in ("gpt", "llama", "mlp"):
            assert result["batches"] == [4], "the inference graph was captured at the local batch only"


SCALED = [("scaled", {"dp": 4}, 1), ("accumulated", {"dp": 2, "pp": 2}, 4), ("scaled", {"dp": 2, "cp": 2}, 1),
          ("accumulated", {"cp": 4}, 1), ("scaled", {"tp": 2, "dp": 2}, 2)]


@pytest.mark.parametrize("loss,mesh,microbatches", SCALED, ids=["dp4", "dp2xpp2-m4", "dp2xcp2", "cp4", "dp2xtp2-m2"])
def test_a_token_loss_scaled_by_a_number_is_divided_by_the_whole_batchs_count(pools, loss, mesh, microbatches):
    """``2.0 * cross_entropy(...)`` and ``cross_entropy(...) / 4``: still the mean over the whole batch's counted
    tokens (scaled), where the parts (dp ranks of 2 rows, microbatches of 1) hold unequal counts of ignored targets;
    before, the parts' own means were averaged (7e-3 off in the gradients at dp=4)."""
    world = 1
    for degree in mesh.values():
        world *= degree
    golden.check(pools.get(world).run(golden.golden, "gpt", mesh, loss=loss, microbatches=microbatches), mesh)


@pytest.mark.parametrize("mesh,microbatches", [({"dp": 2}, 4)], ids=["dp2-m4"])
def test_a_token_mean_inside_a_larger_loss_is_refused_where_the_parts_run_apart(mesh, microbatches):
    """``ce + 1e-3 * z_loss`` over parts of one sample: each part would average the cross-entropy over its own
    counted tokens, and no pass can read them (two passes need two samples a part to tell the rows apart). Refused
    before any collective, naming the line and what works; with batch_statistics='local' it is said."""
    import autoshard
    from autoshard.compile import compile_global_batch
    from autoshard.options import CompileOptions

    from harness.models import build

    case = build("gpt")
    loss_fn, target = golden.with_z_loss(case.target)
    with pytest.raises(ValueError, match=r"a cross-entropy averaged over its counted tokens inside a larger loss.*"
                                         r"cross_entropy_loss in the loss_fn.*dp alone.*batch_statistics='local'"):
        compile_global_batch(case.model, case.inputs, autoshard.Mesh(**mesh), 0,
                             CompileOptions(microbatches=microbatches), target=target, loss_fn=loss_fn)
    build_ = compile_global_batch(case.model, case.inputs, autoshard.Mesh(**mesh), 0,
                                  CompileOptions(microbatches=microbatches, batch_statistics="local"), target=target,
                                  loss_fn=loss_fn)
    assert any("batch_statistics='local'" in note and "counted tokens" in note for note in build_.plan.notes)


@pytest.mark.parametrize("mesh", [{"dp": 4}, {"cp": 2}, {"dp": 2, "tp": 2}], ids=["dp4", "cp2", "dp2xtp2"])
def test_a_token_mean_inside_a_larger_loss_is_exact_under_dp_and_cp(pools, mesh):
    """``ce + 1e-3 * z_loss``: under dp each rank's cross-entropy sum, its count of counted tokens and its z-loss's
    sum are summed over the dp ranks before the loss reads them (the parts hold unequal counts of ignored targets);
    cp splits the sequence and takes the mean over the whole batch's tokens itself."""
    world = 1
    for degree in mesh.values():
        world *= degree
    golden.check(pools.get(world).run(golden.golden, "gpt", mesh, loss="z_loss"), mesh)


@pytest.mark.parametrize("mesh,microbatches", [({}, 2), ({"pp": 2}, 2), ({"dp": 2}, 2),
                                               ({"dp": 2, "tp": 2, "pp": 2}, 2)],
                         ids=["m2", "pp2-m2", "dp2-m2", "dp2xtp2xpp2-m2"])
def test_a_token_mean_inside_a_larger_loss_is_exact_in_two_passes(pools, mesh, microbatches):
    """``ce + 1e-3 * z_loss`` over microbatches, labels unevenly ignored: the first pass forwards every microbatch to
    its cross-entropy summed over its counted tokens, its count and its z-loss's sum (each microbatch's share,
    added over the microbatches and the dp ranks); the term divides the whole batch's sums by its counts, and the
    second pass feeds each microbatch the term's gradient with respect to its shares."""
    world = 1
    for degree in mesh.values():
        world *= degree
    run = (lambda: pools.get(world).run(golden.golden, "gpt", mesh, loss="z_loss", microbatches=microbatches)) \
        if world > 1 else (lambda: [golden.golden("gpt", mesh, loss="z_loss", microbatches=microbatches)])
    golden.check(run(), mesh)


def test_a_loss_term_of_the_whole_batch_that_is_no_sum_is_gathered_under_dp(pools):
    """``ce + logits.amax()``: the largest logit of the whole batch is no sum of the ranks' parts. Under dp alone the
    logits it reads are gathered from every dp rank (``passes.batch_gather``): exact; under microbatches of one
    sample, refused before any collective, naming the op."""
    import autoshard
    from autoshard.compile import compile_global_batch
    from autoshard.options import CompileOptions

    from harness.models import build

    golden.check(pools.get(2).run(golden.golden, "gpt", {"dp": 2}, loss="amax"))
    case = build("gpt")
    loss_fn, target = golden.LOSSES["amax"](case.target)
    with pytest.raises(ValueError, match=r"amax.*reads the rows of the whole batch"):
        compile_global_batch(case.model, case.inputs, autoshard.Mesh(dp=2), 0, CompileOptions(microbatches=4),
                             target=target, loss_fn=loss_fn)


def test_a_batch_sum_divided_by_the_batchs_size_held_as_a_tensor_is_refused_under_dp():
    """``x.sum((0, 1)) / torch.tensor(float(B * T))``: the capture holds the local batch's size as a tensor constant,
    whose whole batch's value is not known (a number is: it doubles with the batch). Refused, not divided by the
    local size."""
    import torch

    import autoshard
    from autoshard.compile import compile_global_batch
    from autoshard.options import CompileOptions

    from harness.models import build

    case = build("gpt")

    def loss_fn(output, target):
        pooled = output.float().sum(dim=(0, 1)) / torch.tensor(float(output.shape[0] * output.shape[1]))
        return golden._cross_entropy()(output, target) + 1e-3 * pooled.pow(2).sum()

    with pytest.raises(ValueError, match=r"reads a value that changes with the batch's size.*held as a tensor"):
        compile_global_batch(case.model, case.inputs, autoshard.Mesh(dp=2), 0, CompileOptions(), target=case.target,
                             loss_fn=loss_fn)


COMPOSED = [({"dp": 2, "tp": 2}, 4, {}), ({"dp": 2, "pp": 2}, 4, {"microbatches": 2}), ({"dp": 2, "cp": 2}, 4, {}),
            ({"dp": 4}, 4, {})]


@pytest.mark.parametrize("mesh,world,options", COMPOSED, ids=["dp2xtp2", "dp2xpp2", "dp2xcp2", "dp4"])
def test_inference_slices_compose_with_the_other_axes(pools, mesh, world, options):
    for result in pools.get(world).run(golden.inference_slices, "llama", mesh, **options):
        assert result["worst"] < 1e-5 and all(result["shapes_equal"]), result
        assert result["batches"] == [8 // mesh["dp"]], result


QUIET = [("gpt", {"dp": 2}, {}), ("megatron", {"dp": 2, "tp": 2}, {"accumulate": 2, "eval_first": True}),
         ("gpt", {"dp": 2}, {"unused_layer": True, "microbatches": 2}),
         ("hf_llama", {"dp": 2, "tp": 2}, {"unused_layer": True, "target_first": False})]


@pytest.mark.parametrize("name,mesh,options", QUIET, ids=["gpt-dp2", "megatron-dp2xtp2-accumulated-after-eval",
                                                          "gpt-dp2-m2-unused", "hf_llama-dp2xtp2-unused-first-step"])
def test_ddp_looks_for_unused_parameters_only_where_the_graph_leaves_some_and_pytorch_says_nothing(pools, name, mesh,
                                                                                                   options):
    """DDP is told to look for unused parameters only where a program leaves some without a gradient (here a layer
    the forward never calls), also when the training graph is captured at the first step, after an evaluation, or
    under accumulation: no warning of PyTorch's on any rank, in Python or on stderr (told when there were none,
    DDP's reducer warned that it walked the autograd graph every step for nothing; not told when there were some, it
    waited for their gradients: a wrapper made before the first step's capture was never told). Losses and the
    parameters after three steps are the unsharded model's."""
    world = 1
    for degree in mesh.values():
        world *= degree
    for rank, result in enumerate(pools.get(world).run(golden.what_pytorch_says, name, mesh, **options)):
        said = [w for w in result["warnings"] if "autoshard" not in w]
        assert not said and "arning" not in result["stderr"], (rank, said, result["stderr"])
        assert result["losses"] == pytest.approx(result["expected"], rel=1e-5), rank
        assert result["worst"] < 1e-5, (rank, result["worst"])


def test_pytorchs_warning_is_seen_where_ddp_is_told_of_unused_parameters_that_are_not(pools):
    """The recording above catches DDP's warning: told to look for unused parameters where every one is used, its
    reducer says so on every rank."""
    for result in pools.get(2).run(golden.what_pytorch_says, "gpt", {"dp": 2}, look_for_unused=True):
        said = " ".join(result["warnings"]) + result["stderr"]
        assert "find_unused_parameters=True was specified in DDP constructor" in said, said
