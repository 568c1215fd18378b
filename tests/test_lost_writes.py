"""Every pass keeps every write; BatchNorm is said and handled; a plan's splits divide before any step.

A model that builds a mask row by row with slice assignments, shifts its labels by writing into a tensor of
ignored ids, or updates a buffer in place is captured as ops with no users of their own. A pass that keeps "what
the output needs" by walking inputs backwards drops them: a stage kept ``full(-inf)`` without its writes (NaN or
a loss 7e-3 off), the token count of the loss read labels that were never shifted (an infinite loss at every
mesh), and the causal-mask pass took a written triangle for the plain one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from corpus import build, cells
from corpus.writes import sweep

from harness import golden

WRITTEN_CELLS = [
    (2, {"pp": 2}, {"microbatches": 2}),
    (2, {"pp": 2}, {"microbatches": 4, "schedule": "zbv"}),
    (2, {"cp": 2}, {}),
    (2, {"cp": 2}, {"cp_attention": "ring", "cp_load_balance": True}),
    (2, {"tp": 2}, {"sequence_parallel": True}),
    (8, {"dp": 2, "tp": 2, "pp": 2}, {"microbatches": 2}),
]


@pytest.mark.parametrize("world,mesh,options", WRITTEN_CELLS,
                         ids=["pp2", "pp2zbv", "cp2", "cp2ring", "tp2sp", "dp2xtp2xpp2"])
def test_a_model_that_builds_its_mask_and_labels_by_writes_is_exact(pools, world, mesh, options):
    golden.check(pools.get(world).run(golden.written_mask_golden, mesh, **options), mesh)


def test_every_rank_program_keeps_the_writes_into_what_it_keeps():
    torch.manual_seed(0)
    idx, extra, target = golden.masked_data("window")
    for label in ("pp2", "pp2zbv", "dp2xtp2xpp2"):
        found = sweep(golden.WrittenMaskDecoder(), (idx, extra), target, golden._shifted_by_writes,
                      *cells.MESHES[label])
        assert found["writers"] >= 20 and found["programs"] >= 2 and not found["lost"], (label, found)


@pytest.mark.parametrize("name", ["xlm", "rwkv"])
def test_corpus_models_that_write_in_place_keep_their_writes_in_every_stage(name):
    case = build(name)
    found = sweep(case.model, case.inputs, case.target, case.loss_fn, *cells.MESHES["pp2zbv"])
    assert found.get("writers") and not found["lost"], found


def test_a_pipeline_split_that_loses_a_write_is_seen_by_the_sweep(monkeypatch):
    """The sweep can fail: with the split's walk back through inputs alone (no writers), it names the lost fills."""
    from autoshard.passes import pipeline_split

    def inputs_only(roots, inputs, admit=None):  # noqa: ARG001 - the writers are what it leaves out
        found, todo = set(), list(roots)
        while todo:
            node = todo.pop()
            if node not in found:
                found.add(node)
                todo.extend(inputs(node))
        return found

    monkeypatch.setattr(pipeline_split, "closure", inputs_only)
    torch.manual_seed(0)
    idx, extra, target = golden.masked_data("window")
    found = sweep(golden.WrittenMaskDecoder(), (idx, extra), target, golden._shifted_by_writes,
                  *cells.MESHES["pp2"])
    assert any("fill_" in line for line in found["lost"]), found


def _resnet_build(mesh: dict, **options):
    from autoshard.compile import compile_global_batch
    from autoshard.mesh import Mesh
    from autoshard.options import CompileOptions

    g = torch.Generator().manual_seed(5)
    pixels, target = torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 5, (8,), generator=g)
    return compile_global_batch(golden.SmallResNet(), (pixels,), Mesh(**mesh), 0, CompileOptions(**options),
                                target=target, loss_fn=F.cross_entropy)


@pytest.mark.parametrize("mesh,options,why", [
    ({"pp": 2}, {"microbatches": 2}, "microbatches=2 normalise each microbatch alone"),
    ({"dp": 2, "pp": 2}, {"microbatches": 2}, "microbatches=2 normalise each microbatch alone"),
    ({"dp": 2}, {"microbatches": 2}, "microbatches=2 normalise each microbatch alone"),
], ids=["pp2-m2", "dp2xpp2-m2", "dp2-m2"])
def test_batch_norm_in_training_is_refused_where_a_microbatch_sees_part_of_the_batch(mesh, options, why):
    with pytest.raises(ValueError, match=rf"BatchNorm in training mode \(blocks.0.1, blocks.0.4, .*\).*{why}.*"
                                         r"batch_norm='local'"):
        _resnet_build(mesh, **options)


def test_batch_norm_local_keeps_each_ranks_statistics_and_says_so():
    build = _resnet_build({"dp": 2}, batch_norm="local")
    assert any("keeps each rank's and each microbatch's own statistics" in note for note in build.notes), build.notes
    assert not _synced(build)


def _synced(build) -> list[str]:
    from autoshard.passes.batch_norm import BatchNormOverGroup

    return [n.target for p in build.programs.values() for n in p.gm.graph.nodes
            if n.op == "call_module" and isinstance(p.gm.get_submodule(n.target), BatchNormOverGroup)]


def test_batch_norm_under_dp_sums_its_statistics_over_the_dp_ranks_and_says_so():
    build = _resnet_build({"dp": 2})
    assert len(_synced(build)) == 5, build.programs[0].gm.graph
    assert any("statistics over the 2 dp ranks" in note for note in build.notes), build.notes
    from autoshard.explain import collectives

    counted = collectives(build.programs[0].gm)
    assert counted[("dp", "forward", "all_gather", "BatchNormOverGroup")][0] == 5, counted
    assert counted[("dp", "backward", "all_reduce", "BatchNormOverGroup")][0] == 5, counted


@pytest.mark.parametrize("shape,affine,dtype", [((6, 4, 3, 3), True, torch.float32), ((6, 4, 5), False, torch.float32),
                                                ((6, 4), True, torch.float64)], ids=["2d", "1d-no-affine", "0d-f64"])
def test_batch_norm_over_a_group_of_one_is_torchs_batch_norm(shape, affine, dtype):
    """Chan's combination of one rank's statistics is ``F.batch_norm``'s: outputs, every gradient, running stats."""
    from autoshard.passes.batch_norm import BatchNormOverGroup

    g = torch.Generator().manual_seed(0)
    c = shape[1]
    x = (torch.randn(shape, generator=g, dtype=dtype) * 3 + 1).requires_grad_()
    weight = torch.randn(c, generator=g, dtype=dtype).requires_grad_() if affine else None
    bias = torch.randn(c, generator=g, dtype=dtype).requires_grad_() if affine else None
    stats = [torch.randn(c, generator=g, dtype=dtype), torch.rand(c, generator=g, dtype=dtype) + 0.5]
    theirs = [s.clone() for s in stats]
    grad = torch.randn(shape, generator=g, dtype=dtype)
    ours = BatchNormOverGroup(group=None, size=1, rank=0)(x, weight, bias, *stats, 0.1, 1e-5)
    expected = F.batch_norm(x, *theirs, weight, bias, training=True, momentum=0.1, eps=1e-5)
    leaves = [t for t in (x, weight, bias) if t is not None]
    mine, reference = torch.autograd.grad(ours, leaves, grad), torch.autograd.grad(expected, leaves, grad)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ours, expected, **tol)
    for a, b in zip([*mine, *stats], [*reference, *theirs], strict=True):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("world,mesh,options", [
    (2, {"pp": 2}, {}), (2, {"tp": 2}, {}), (2, {"dp": 2}, {}), (4, {"dp": 2, "pp": 2}, {}),
    (2, {"dp": 2}, {"activation_checkpointing": True}), (2, {"pp": 2}, {"activation_checkpointing": True}),
    (2, {"dp": 2}, {"data_parallel": "fsdp"}),
], ids=["pp2", "tp2", "dp2", "dp2xpp2", "dp2-checkpointed", "pp2-checkpointed", "dp2-fsdp"])
def test_batch_norm_trains_exactly_with_the_whole_batchs_statistics(pools, world, mesh, options):
    """Checkpointed: the recomputation in backward ran the forward's in-place updates again (running statistics
    updated twice, num_batches_tracked 2 ahead after 2 steps)."""
    results = pools.get(world).run(golden.resnet_golden, mesh, **options)
    # dp combines each rank's statistics, and tp sums each convolution's products over its split input channels:
    # equal to rounding
    exact = "dp" not in mesh and "tp" not in mesh
    for result in results:
        assert result["ok"], result["report"]
        assert result["running_stats"] == 15, result
        assert result["stats_off"] == 0.0 if exact else result["stats_off"] < 1e-6, result  # as unsharded


def test_a_table_the_degree_does_not_divide_is_not_split_by_it():
    """A relative-position bias of 2 heads shared by 8 attention heads: at tp=4 its 2 columns cannot split 4 ways
    (the first step raised 'blocks [2] of (2,) do not divide by the degree 4'); it is split by its rows instead."""
    from autoshard.compile import capture_for_training
    from autoshard.passes.tensor_parallel import plan_tensor_parallel

    torch.manual_seed(0)
    idx, extra, target = golden.masked_data("full")
    captured = capture_for_training(golden.SharedBiasDecoder(), (idx, extra), target,
                                    golden._cross_entropy(ignore_index=-100))
    plan = plan_tensor_parallel(captured.gm, 4)
    table = plan.params["model.bias.weight"]
    assert table.placement.dim == 0 and table.role == "vocab", table


def test_a_table_the_degree_does_not_divide_trains_exactly_at_tp4(pools):
    golden.check(pools.get(4).run(golden.shared_bias_golden, {"tp": 4}), {"tp": 4})


def _graph_without(gm, names: set[str]):
    """A copy of ``gm`` without the nodes ``names`` (a stand-in for a stage program: nodes keep their names)."""
    import copy

    from torch import fx

    graph = copy.deepcopy(gm.graph)
    for node in reversed(list(graph.nodes)):
        if node.name in names:
            node.replace_all_uses_with(next(iter(node.all_input_nodes))) if node.users else None
            graph.erase_node(node)
    return fx.GraphModule(gm, graph)


def test_a_write_after_a_stages_last_read_belongs_to_the_next_stage_and_some_stage_must_run_it():
    """olmo_hybrid at pp2: stage 0 computes a zeros_like and sends it; stage 1 writes its last row into what it
    receives and reads it. Stage 0 lost nothing; a pipeline where no stage runs the write did."""
    from torch import fx

    from autoshard.passes.writes import dropped_writes, lost_writes

    aten = torch.ops.aten

    def f(x):
        buf = aten.zeros_like.default(x)
        aten.copy_.default(aten.select.int(buf, 0, 0), aten.mul.Tensor(x[0], 2))
        return aten.reshape.default(buf, [-1])

    gm = fx.symbolic_trace(f)
    names = [n.name for n in gm.graph.nodes]
    write = next(n for n in names if n.startswith("copy_"))
    select = next(n for n in names if n.startswith("select"))
    read = next(n for n in names if n.startswith("reshape"))
    sender = _graph_without(gm, {write, select, read})  # keeps buf, returns it: the write comes after
    assert lost_writes(gm, sender) == []
    assert dropped_writes(gm, [sender]) and write in dropped_writes(gm, [sender])[0]
    assert dropped_writes(gm, [sender, gm]) == []
    reader = _graph_without(gm, {write})  # reads buf after the write without running it
    assert lost_writes(gm, reader) and write in lost_writes(gm, reader)[0]
