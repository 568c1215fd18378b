"""Expert parallelism: whole experts per ep rank, the tokens sent to them, found from the graph alone.

The layers are found on transformers' own mixtures of experts (grouped matmuls over stacks of expert matrices);
every cell trains exactly against the unsharded model (loss, every gradient, parameters after steps) with each
rank holding ``1/ep`` of every stack; a layer that mixes rows between the experts' matmuls keeps its experts whole.
"""

from __future__ import annotations

import dataclasses
import json
import operator
import re

import pytest
import torch
from corpus import build, cells

import autoshard
from autoshard.capture import capture
from autoshard.compile import compile_global_batch
from autoshard.options import CompileOptions
from autoshard.passes.expert_parallel import ExpertParallelError, plan_expert_parallel

from harness import golden, golden_moe, models

MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "granitemoe", "gpt_oss", "jetmoe")
MESHES = ("ep2", "ep2xtp2", "dp2xep2xpp2")


def _captured(name: str):
    case = build(name)
    return case, capture(case.model, case.inputs, loss_fn=case.loss_fn, example_target=case.target)


# ----------------------------------------------------------------------------------------------- finding the layers


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss", "deepseek_v3"])
def test_every_layer_of_experts_is_found_with_its_stacks(name):
    case, captured = _captured(name)
    plan = plan_expert_parallel(captured.gm, 2)
    stacks = {n for n, p in captured.gm.named_parameters() if p.dim() == 3}
    assert {w for layer in plan.layers for w in layer.weights} == stacks
    layers = sum(1 for m in case.model.modules() if type(m).__name__.endswith("Experts"))
    assert len(plan.layers) == layers and all(layer.experts == 4 for layer in plan.layers)
    assert not plan.notes


def test_experts_looped_over_a_stack_become_grouped_matmuls_and_split_over_ep():
    """JetMoE runs its experts one at a time (rows split by counts read back, ``linear(x_i, W[i])``, ``cat``): the
    capture holds one grouped matmul per loop instead, no read-back of the counts, and the same loss. Its MLP
    experts are one layer (a dispatch before the two matmuls, a combine after); its attention experts share a
    routing with attention between their two projections, so each projection runs between a dispatch and a
    combine of its own, from one route."""
    case, captured = _captured("jetmoe")
    gm = captured.gm
    targets = [n.target for n in gm.graph.nodes]
    assert targets.count(torch.ops.autoshard.grouped_mm.default) == 8
    assert torch.ops.aten.item.default not in targets and torch.ops.aten._assert_scalar.default not in targets
    assert not any(n.target is torch.ops.aten.select.int and n.args[0].op == "get_attr" for n in gm.graph.nodes)
    torch.testing.assert_close(gm(*case.inputs, case.target), case.loss_fn(case.model(*case.inputs), case.target),
                               rtol=0, atol=1e-6)
    plan = plan_expert_parallel(gm, 2)
    assert len(plan.layers) == 4 and not plan.notes
    assert {w for layer in plan.layers for w in layer.weights} == {n for n, p in gm.named_parameters() if p.dim() == 3}
    program = compile_global_batch(case.model, case.inputs, autoshard.Mesh(dp=2, ep=2), 1, CompileOptions(),
                                   target=case.target, loss_fn=case.loss_fn).program
    assert program.code.count("= self.expert_route_") == 4
    assert program.code.count("= self.expert_dispatch_") == 6 and program.code.count("= self.expert_combine_") == 6


def test_torchtitans_loop_over_experts_becomes_the_grouped_matmuls_of_its_stacks():
    """torchtitan's experts without a grouped matmul kernel: the counts read back, the rows split by them, each
    expert's SwiGLU on its piece (``matmul`` with ``w1[e]``, ``w3[e]``, ``w2[e]`` transposed), ``cat``. The capture
    holds the SwiGLU once over all rows, its three products grouped matmuls over the stacks (no read-back, no
    per-expert node), and computes the same loss; both layers are found with their three stacks."""
    case = models.build("moe_loop")
    captured = capture(case.model, case.inputs, loss_fn=case.loss_fn, example_target=case.target)
    gm = captured.gm
    targets = [n.target for n in gm.graph.nodes]
    assert targets.count(torch.ops.autoshard.grouped_mm.default) == 6
    assert torch.ops.aten.item.default not in targets and torch.ops.aten.select.int not in targets
    assert targets.count(torch.ops.aten.silu.default) == 4  # per layer: the experts, once, and the shared expert
    torch.testing.assert_close(gm(*case.inputs, case.target), case.loss_fn(case.model(*case.inputs), case.target),
                               rtol=0, atol=1e-6)
    plan = plan_expert_parallel(gm, 2)
    assert len(plan.layers) == 2 and not plan.notes
    assert {w for layer in plan.layers for w in layer.weights} == {n for n, p in gm.named_parameters() if p.dim() == 3}


def test_a_loop_whose_experts_compute_differently_stays_a_loop():
    """One expert of the loop computing otherwise (a ``gelu`` where the others have ``silu``) is no grouped matmul:
    the loop stays as export gave it (exact, its experts whole)."""

    class Odd(models.LoopedGroupedExperts):
        def forward(self, x, counts):
            out = []
            for e, piece in enumerate(torch.split(x, counts.long().tolist())):
                act = torch.nn.functional.gelu if e == 1 else torch.nn.functional.silu
                h = act(piece @ self.w1[e].transpose(-2, -1)) * (piece @ self.w3[e].transpose(-2, -1))
                out.append(h @ self.w2[e].transpose(-2, -1))
            return torch.cat(out)

    torch.manual_seed(0)
    model, x, counts = Odd(8, 12, 4), torch.randn(10, 8), torch.tensor([3, 0, 5, 2])
    captured = capture(model, (x, counts), loss_fn=lambda y, t: (y - t).pow(2).mean(), example_target=x)
    targets = [n.target for n in captured.gm.graph.nodes]
    assert torch.ops.autoshard.grouped_mm.default not in targets and torch.ops.aten.gelu.default in targets
    torch.testing.assert_close(captured.gm(x, counts, x), (model(x, counts) - x).pow(2).mean(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("kwargs,rewritten", [({}, True), ({"reads_counts": True}, False), ({"swapped": True}, False)],
                         ids=["loop", "counts-read-elsewhere", "experts-out-of-order"])
def test_a_loop_of_experts_is_rewritten_only_where_it_is_one_grouped_matmul(kwargs, rewritten):
    """Where the sizes are read by anything else, or the pieces meet other experts than their own, the loop is
    left as export gave it (each expert a linear: exact, its experts whole under ep)."""
    torch.manual_seed(0)
    model, x = models.LoopedExperts(**kwargs), torch.randn(12, 8)
    captured = capture(model, (x,), loss_fn=lambda y, t: (y - t).pow(2).mean(), example_target=torch.zeros(12, 6))
    grouped = [n for n in captured.gm.graph.nodes if n.target is torch.ops.autoshard.grouped_mm.default]
    assert len(grouped) == (1 if rewritten else 0)
    torch.testing.assert_close(captured.gm(x, torch.zeros(12, 6)), model(x).pow(2).mean(), rtol=0, atol=1e-6)


def test_the_grouped_matmul_is_each_experts_product_forward_and_backward():
    """autoshard's grouped matmul (any dtype, any device): rows per expert times the expert's matrix, empty experts
    included; its gradients are the per-expert products' (float64, against a loop of linears)."""
    x = torch.randn(10, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 7, 5, dtype=torch.float64, requires_grad=True)  # (experts, out, in), as linear reads it
    sizes = [3, 0, 6, 1]
    offsets = torch.tensor(sizes).cumsum(0)
    got = torch.ops.autoshard.grouped_mm(x, w.transpose(1, 2), offsets)
    want = torch.cat([torch.nn.functional.linear(p, w[e]) for e, p in enumerate(x.split(sizes))])
    torch.testing.assert_close(got, want)
    grad = torch.randn_like(got)
    torch.testing.assert_close(torch.autograd.grad(got, (x, w), grad), torch.autograd.grad(want, (x, w), grad))
    torch.library.opcheck(torch.ops.autoshard.grouped_mm.default, (x, w.transpose(1, 2), offsets))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # cast as autocast casts the linears it stands for
        x32, w32 = x.float(), w.float()
        got = torch.ops.autoshard.grouped_mm(x32, w32.transpose(1, 2), offsets)
        want = torch.cat([torch.nn.functional.linear(p, w32[e]) for e, p in enumerate(x32.split(sizes))])
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_dense_experts_in_a_module_list_stay_whole_and_say_so():
    """Every expert of a ModuleList run on every token, weighted by the router (no rows routed): nothing for ep to
    send, and the plan says so."""

    class Dense(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(8, 4, bias=False)
            self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

        def forward(self, x):
            weights = torch.softmax(self.gate(x), -1)
            return sum(weights[:, e:e + 1] * expert(x) for e, expert in enumerate(self.experts))

    x = torch.randn(12, 8)
    captured = capture(Dense(), (x,), loss_fn=lambda y, t: (y - t).pow(2).mean(), example_target=x)
    plan = plan_expert_parallel(captured.gm, 2)
    assert not plan.layers and "no mixture of experts found" in plan.notes[0]


def test_experts_held_as_separate_modules_are_found_with_the_ep_rank_holding_each():
    """litgpt's form (``moe_list``): each expert a module of a ModuleList, its rows picked by ``torch.where`` of the
    router's top-k, its output added back at them. Each layer is found with its 8 experts and their own parameters;
    at ep=2 experts 0-3 are ep rank 0's, 4-7 ep rank 1's; under tp or pp they stay whole, and the plan says so."""
    from autoshard.passes.expert_parallel import _from_json as _ep_from_json
    from autoshard.passes.listed_experts import find_list_layers

    case = models.build("moe_list")
    captured = capture(case.model, case.inputs, loss_fn=case.loss_fn, example_target=case.target)
    layers = find_list_layers(captured.gm)
    assert [len(layer.experts) for layer in layers] == [8, 8]
    held = [p for layer in layers for expert in layer.experts for p in expert]
    assert sorted(held) == sorted(n for n in captured.gm.state_dict() if ".experts." in n)
    assert all(len(expert) == 3 for layer in layers for expert in layer.experts)
    plan = plan_expert_parallel(captured.gm, 2)
    assert not plan.layers and plan.lists == layers and not plan.notes
    assert plan.holders()[layers[0].experts[3][0]] == 0 and plan.holders()[layers[1].experts[4][2]] == 1
    kept = plan_expert_parallel(captured.gm, 2, lists=False)  # under tp or pp
    assert not kept.lists and len(kept.notes) == 2
    assert all("8 experts" in note and "separate modules" in note and "stay whole" in note for note in kept.notes)
    assert _ep_from_json(json.loads(json.dumps(dataclasses.asdict(plan)))) == plan  # the job plan's JSON form


def test_a_capacity_over_experts_held_as_separate_modules_is_refused():
    """A capacity drops rows of stacked experts at their dispatch; listed experts receive every row: refused."""
    case = models.build("moe_list")
    with pytest.raises(ValueError, match=r"experts at model.layers.0.mlp are modules of a list.*leave expert_capacity"):
        compile_global_batch(case.model, case.inputs, autoshard.Mesh(dp=2, ep=2), 1,
                             CompileOptions(expert_capacity=1.0), target=case.target, loss_fn=case.loss_fn)


def test_a_layer_that_mixes_rows_between_its_matmuls_runs_each_between_its_own_dispatch_and_combine():
    """A cumulative sum over the routed rows between the two projections reads other experts' rows: it runs on the
    rows combined back (as the model run whole computes it), and each projection between a dispatch and a combine
    of its own; both layers are still split."""
    from autoshard.passes.expert_parallel import _by_offsets, _groups, _sorts

    _, captured = _captured("mixtral")
    gm = captured.gm
    first = next(n for n in gm.graph.nodes if "grouped_mm" in str(n.target))
    user = next(iter(first.users))
    with gm.graph.inserting_after(first):
        mixed = gm.graph.call_function(torch.ops.aten.cumsum.default, (first, 0))
    mixed.meta["val"] = first.meta["val"]
    user.replace_input_with(first, mixed)
    plan = plan_expert_parallel(gm, 2)
    assert len(plan.layers) == 2 and not plan.notes
    offsets, matmuls = next((o, m) for o, m in _by_offsets(gm).items() if first in m)
    assert _groups(offsets, matmuls, _sorts(offsets, matmuls))[0] == [[m] for m in matmuls]


def test_a_stack_of_experts_read_outside_its_matmuls_keeps_them_whole_and_says_so():
    """A stack also read by another op (its norm added to the loss) must stay whole on every rank: that layer is left
    data parallel, named, and the other layer is still split."""
    _, captured = _captured("mixtral")
    gm = captured.gm
    first = next(n for n in gm.graph.nodes if "grouped_mm" in str(n.target))
    stack = first.args[1]
    while stack.op != "get_attr":
        stack = stack.args[0]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    loss = output.args[0][0]
    with gm.graph.inserting_before(output):
        norm = gm.graph.call_function(torch.ops.aten.sum.default, (stack,))
        total = gm.graph.call_function(torch.ops.aten.add.Tensor, (loss, norm))
    norm.meta["val"], total.meta["val"] = loss.meta["val"], loss.meta["val"]
    output.replace_input_with(loss, total)
    plan = plan_expert_parallel(gm, 2)
    assert len(plan.layers) == 1 and "stay whole" in plan.notes[0] and "read outside" in plan.notes[0]


def test_an_ep_degree_that_does_not_divide_the_experts_is_refused_with_those_that_do():
    _, captured = _captured("mixtral")
    with pytest.raises(ExpertParallelError, match=r"ep=3 does not divide the 4 experts.*ep in \[1, 2, 4\]"):
        plan_expert_parallel(captured.gm, 3)


def test_ep_is_carved_from_dp_then_cp():
    with pytest.raises(ValueError, match=r"ep=4 does not divide dp x cp = 2 x 1.*use ep in \[1, 2\]"):
        autoshard.Mesh(dp=2, ep=4)
    mesh = autoshard.Mesh(dp=4, tp=2, ep=2)
    assert mesh.world_size == 8 and str(mesh) == "Mesh(dp=4, tp=2, pp=1, cp=1, ep=2)"
    assert mesh.expert_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]  # consecutive dp coordinates, one tp rank
    assert mesh.expert_replica_groups() == [[0, 4], [2, 6], [1, 5], [3, 7]]  # the same experts
    assert autoshard.Mesh.parse("dp=2,ep=2") == autoshard.Mesh(dp=2, ep=2)
    mesh = autoshard.Mesh(dp=2, cp=2, ep=2)  # ep divides dp: the cp ranks hold the same experts
    assert mesh.expert_groups() == [[0, 2], [1, 3]] and mesh.expert_replica_groups() == [[0, 1], [2, 3]]
    mesh = autoshard.Mesh(dp=2, cp=2, ep=4)  # ep takes the cp ranks too; each group is ordered as its process group
    assert mesh.expert_groups() == [[0, 1, 2, 3]]
    assert [mesh.expert_coord(mesh.coords(r)) for r in range(4)] == [0, 1, 2, 3]
    assert autoshard.Mesh(cp=2, ep=2).expert_groups() == [[0, 1]]
    with pytest.raises(ValueError, match=r"ep=4 does not divide dp x cp = 1 x 2.*use ep in \[1, 2\]"):
        autoshard.Mesh(cp=2, ep=4)


def test_a_rank_program_routes_its_tokens_and_holds_half_of_every_stack():
    case = build("mixtral")
    build_ = compile_global_batch(case.model, case.inputs, autoshard.Mesh(dp=2, ep=2), 1, CompileOptions(),
                                  target=case.target, loss_fn=case.loss_fn)
    code = build_.program.code
    assert code.count("= self.expert_route_") == 2  # one route per layer
    assert code.count("= self.expert_dispatch_") == 2 and code.count("= self.expert_combine_") == 2  # x in, y out
    gm = build_.program.gm
    for name, full in build_.captured.gm.named_parameters():
        mine = gm.get_parameter(name)
        if full.dim() == 3:  # rank 1 holds experts 2 and 3
            assert torch.equal(mine, full[2:4])
        else:
            assert mine.shape == full.shape
    assert "ep: 2 expert layers split over 2 ranks" in str(build_.plan)
    getitems = [n for n in gm.graph.nodes if n.target is operator.getitem and "expert_route" in str(n.args[0])]
    assert len(getitems) == 4  # each route gives the local offsets and the route itself


# ----------------------------------------------------------------------------------------------- goldens


CELLS = [(name, mesh) for mesh in MESHES for name in MOE]


@pytest.mark.parametrize("name,mesh", CELLS, ids=[f"{n}-{m}" for n, m in CELLS])
def test_experts_split_over_ep_train_exactly(pools, name, mesh):
    degrees, options = cells.MESHES[mesh]
    found = cells.outcome(pools.get(cells.world_size(mesh)).run(cells.run_cell, name, degrees, **options))
    assert found.status == "exact", found.text()


@pytest.mark.parametrize("name,mesh", CELLS, ids=[f"{n}-{m}" for n, m in CELLS])
def test_experts_split_over_ep_train_as_adamw_trains_them_in_one_process(pools, name, mesh):
    """The same cells driven by a training loop (AdamW over weight-decay groups, two step() calls per optimizer
    step, a padded batch, clipping): every loss and gradient within 1e-5, the parameters after AdamW steps too
    (within its tolerance: golden_moe.LR)."""
    degrees, options = cells.MESHES[mesh]
    for rank, result in enumerate(pools.get(cells.world_size(mesh)).run(golden_moe.training_loop, name, degrees,
                                                                        steps=2, **options)):
        assert result["loss"] < 1e-5 and result["norm"] < 1e-5, f"rank {rank}: {result['loss']}, {result['norm']}"
        assert not result["bad_grads"] and not result["bad"], f"rank {rank}: {result['bad_grads']}, {result['bad']}"


ZOO_MESHES = [({"dp": 2, "ep": 2}, 1), ({"dp": 2, "ep": 2, "tp": 2}, 1), ({"dp": 2, "ep": 2, "pp": 2}, 2),
              ({"dp": 4, "ep": 4}, 1), ({"cp": 2, "ep": 2}, 1)]


@pytest.mark.parametrize("mesh,microbatches", ZOO_MESHES, ids=["ep2", "ep2xtp2", "dp2xep2xpp2", "ep4", "cp2xep2"])
def test_the_zoos_torchtitan_style_experts_split_over_ep_train_exactly(pools, mesh, microbatches):
    """The zoo's mixture, written as torchtitan writes it (tokens sorted by expert with argsort, counted with histc,
    the scores applied before the experts, a shared expert, the rows summed back by scatter_add): every layer found,
    every rank holding 1/ep of each stack, loss, gradients and parameters after SGD steps exact."""
    world = mesh.get("dp", 1) * mesh.get("tp", 1) * mesh.get("pp", 1) * mesh.get("cp", 1)
    golden.check(pools.get(world).run(golden.golden, "moe", mesh, microbatches=microbatches), mesh)


@pytest.mark.parametrize("mesh", [{"dp": 2, "ep": 2}, {"dp": 2, "ep": 2, "tp": 2}], ids=["ep2", "ep2xtp2"])
def test_the_zoos_experts_split_over_ep_train_as_adamw_trains_them(pools, mesh):
    world = mesh["dp"] * mesh.get("tp", 1)
    for rank, result in enumerate(pools.get(world).run(golden_moe.training_loop, "zoo/moe", mesh, steps=2)):
        assert result["loss"] < 1e-5 and result["norm"] < 1e-5, f"rank {rank}: {result['loss']}, {result['norm']}"
        assert not result["bad_grads"] and not result["bad"], f"rank {rank}: {result['bad_grads']}, {result['bad']}"
        assert all(shape[0] == models.EXPERTS // mesh["ep"] for shape in result["experts"].values()), result["experts"]
        assert "2 layer(s) of experts split" in result["explain"]


def test_torchtitans_loop_over_experts_splits_over_ep_and_trains_as_adamw_trains_it(pools, tmp_path):
    """The zoo's mixture with its experts looped one at a time (``moe_loop``) at dp2 x ep2: each rank holds half of
    every stack; the losses, gradients and parameters after AdamW steps are the model's in one process, and
    ``save_pretrained`` writes every stack whole."""
    mesh = {"dp": 2, "ep": 2}
    for rank, result in enumerate(pools.get(2).run(golden_moe.training_loop, "zoo/moe_loop", mesh, steps=2)):
        assert result["loss"] < 1e-5 and result["norm"] < 1e-5, f"rank {rank}: {result['loss']}, {result['norm']}"
        assert not result["bad_grads"] and not result["bad"], f"rank {rank}: {result['bad_grads']}, {result['bad']}"
        assert len(result["experts"]) == 6, result["experts"]
        assert all(shape[0] == models.EXPERTS // 2 for shape in result["experts"].values()), result["experts"]
    for rank, result in enumerate(pools.get(2).run(golden_moe.saved_whole, "zoo/moe_loop", mesh, str(tmp_path))):
        assert not result["differ"], f"rank {rank}: {result['differ']}"
        assert len(result["held"]) == 6 and set(result["held"].values()) == {0.5}, (rank, result["held"])
        assert all(shape[0] == models.EXPERTS for shape in result["stacks"].values()), result["stacks"]


def test_experts_held_as_separate_modules_split_over_ep_and_train_as_adamw_trains_them(pools, tmp_path):
    """``moe_list`` at dp2 x ep2: each rank holds its half of the experts (modules of the list) and nothing of the
    other half; the losses, gradients and parameters after AdamW steps with clipping are the model's in one process,
    and ``save_pretrained`` writes every expert."""
    mesh = {"dp": 2, "ep": 2}
    for rank, result in enumerate(pools.get(2).run(golden_moe.training_loop, "zoo/moe_list", mesh, steps=2)):
        assert result["loss"] < 1e-5 and result["norm"] < 1e-5, f"rank {rank}: {result['loss']}, {result['norm']}"
        assert not result["bad_grads"] and not result["bad"], f"rank {rank}: {result['bad_grads']}, {result['bad']}"
        assert result["listed_share"] == 0.5, (rank, result["listed_share"])
        assert f"(ep rank {1 - rank})" in result["explain"], result["explain"]
    for rank, result in enumerate(pools.get(2).run(golden_moe.saved_whole, "zoo/moe_list", mesh, str(tmp_path))):
        assert not result["differ"], f"rank {rank}: {result['differ']}"


@pytest.mark.parametrize("frozen", [("embed_tokens", "layers.0.input", "layers.0.self_attn", "layers.0.post"),
                                    ("embed_tokens", "layers.0.input", "layers.0.self_attn", "layers.0.post",
                                     "layers.0.mlp.experts.")], ids=["rows-frozen", "rows-and-experts-frozen"])
def test_experts_held_by_one_ep_rank_train_below_frozen_layers(pools, frozen):
    """``moe_list`` at dp2 x ep2 with everything below the first layer's experts frozen (their rows need no gradient),
    then their parameters too: the ranks holding an expert and those not holding it run the combine's backward
    alike (or not at all), and the trained parameters are the model's in one process."""
    for rank, result in enumerate(pools.get(2).run(golden_moe.frozen_below, "zoo/moe_list", {"dp": 2, "ep": 2},
                                                   frozen)):
        assert result["loss"] < 1e-5 and not result["bad_grads"] and not result["bad"], (rank, result)


@pytest.mark.parametrize("mesh", [{"dp": 2, "ep": 2}, {"dp": 2, "ep": 2, "tp": 2}], ids=["ep2", "ep2xtp2"])
def test_a_capacity_drops_the_rows_beyond_it_as_the_model_would(pools, mesh):
    """``expert_capacity=1.0``: each rank sends each expert at most an even share of its rows (16 of 128 at top-2 of
    8), the first ones; the rows beyond are dropped (their experts add nothing). Loss, gradients and parameters
    after SGD steps equal the zoo model's whose experts drop the same rows of each rank's part of the batch, and
    ``explain()`` counts the rows dropped."""
    world = mesh["dp"] * mesh.get("tp", 1)
    for rank, result in enumerate(pools.get(world).run(golden_moe.capacity, mesh, 1.0)):
        assert result["loss"] < 1e-5 and not result["bad_grads"] and not result["bad"], (rank, result)
        dropped = [int(d) for d in re.findall(r"(\d+) of this rank's \d+ rows dropped", result["explain"])]
        assert len(dropped) == 2 and sum(dropped) > 0, result["explain"]
        assert "capacity 1.0 of an even share" in result["explain"]


def test_a_capacity_is_refused_without_ep_or_below_zero():
    with pytest.raises(ValueError, match=r"expert_capacity=0 is not valid: pass a factor > 0"):
        CompileOptions(expert_capacity=0)
    with pytest.raises(ValueError, match=r"splits no experts over ep: use a mesh with ep > 1"):
        CompileOptions(expert_capacity=1.25).check_mesh(autoshard.Mesh(dp=2))


def test_experts_summed_over_the_ranks_that_hold_them_alike(pools):
    """dp=4, ep=2: each pair of ranks holding the same experts sums their gradients (and only those)."""
    found = cells.outcome(pools.get(4).run(cells.run_cell, "mixtral", {"dp": 4, "ep": 2}))
    assert found.status == "exact", found.text()


EP_WITH_CP = [("qwen3_moe", {"dp": 2, "ep": 2, "cp": 2}), ("mixtral", {"cp": 2, "ep": 2}),
              ("mixtral", {"dp": 2, "cp": 2, "ep": 4})]


@pytest.mark.parametrize("name,mesh", EP_WITH_CP, ids=["dp2xcp2xep2", "cp2xep2", "dp2xcp2xep4"])
def test_ep_with_context_parallelism(pools, name, mesh):
    """ep within dp (the cp ranks hold the same experts), and ep carved from cp (the sequence's parts send their
    tokens to each other's experts)."""
    world = mesh.get("dp", 1) * mesh.get("cp", 1)
    found = cells.outcome(pools.get(world).run(cells.run_cell, name, mesh))
    assert found.status == "exact", found.text()


@pytest.mark.parametrize("mesh", [{"dp": 2, "ep": 2}, {"dp": 2, "ep": 2, "tp": 2}], ids=["ep2", "ep2xtp2"])
def test_an_ordinary_training_loop_over_experts_split_by_ep(pools, mesh):
    """Accumulation over two step() calls, AdamW groups from named_parameters(), padded rows with their mask,
    global-norm clipping: the same losses and parameters as the model trained in one process."""
    world = 4 if mesh.get("tp") else 2
    for rank, result in enumerate(pools.get(world).run(golden_moe.training_loop, "mixtral", mesh)):
        assert result["loss"] < 1e-5 and result["norm"] < 1e-5, f"rank {rank}: {result}"
        assert not result["bad_grads"] and not result["bad"], f"rank {rank}: {result['bad_grads']}, {result['bad']}"
        assert all(shape[0] == 2 for shape in result["experts"].values())  # 2 of 4 experts per rank
        report = result["explain"]  # the load the last step routed, by expert and by ep rank
        assert "expert-parallel plan over ep=2" in report and report.count("by expert") == 2, report
        assert "all_to_all  ExpertDispatch" in report


def test_bf16_autocast_over_experts_split_by_ep(pools):
    for rank, result in enumerate(pools.get(2).run(golden_moe.training_loop, "mixtral", {"dp": 2, "ep": 2},
                                                   steps=2, mixed_precision="bf16")):
        assert result["loss"] < 2e-2 and result["worst"] < 2e-2, f"rank {rank}: {result['loss']}, {result['worst']}"


def test_inference_over_experts_split_by_ep(pools):
    for result in pools.get(2).run(golden_moe.inference, "mixtral", {"dp": 2, "ep": 2}):
        assert result["worst"] < 1e-5


def test_inference_over_experts_held_by_one_ep_rank(pools):
    """``pm(ids)`` of ``moe_list`` at dp2 x ep2 (its inference capture routes each expert's rows to its holder):
    the model's own logits."""
    for result in pools.get(2).run(golden_moe.inference, "zoo/moe_list", {"dp": 2, "ep": 2}):
        assert result["worst"] < 1e-5


@pytest.mark.parametrize("mesh", [{"dp": 2, "ep": 2}, {"dp": 4, "ep": 2}], ids=["dp2xep2", "dp4xep2"])
def test_fsdp_with_experts_split_by_ep(pools, mesh):
    """FSDP2 shards every other parameter over dp x cp; the experts stay whole on their ep rank and their gradients
    are summed over the ranks holding the same ones (at dp4 x ep2, pairs): the SGD golden and the AdamW loop with
    clipping (the global norm counts each expert once and each shard once)."""
    world = mesh["dp"]
    found = cells.outcome(pools.get(world).run(cells.run_cell, "mixtral", mesh, data_parallel="fsdp"))
    assert found.status == "exact", found.text()
    for rank, result in enumerate(pools.get(world).run(golden_moe.training_loop, "mixtral", mesh, steps=2,
                                                       data_parallel="fsdp")):
        assert result["loss"] < 1e-5 and result["norm"] < 1e-5, f"rank {rank}: {result['loss']}, {result['norm']}"
        assert not result["bad_grads"] and not result["bad"], f"rank {rank}: {result['bad_grads']}, {result['bad']}"


@pytest.mark.parametrize("name", ["moe_loop", "moe_list"])
def test_fsdp_with_experts_looped_or_listed_split_by_ep(pools, name):
    """FSDP2 at dp2 x ep2 beside the zoo's looped experts (stacks) and listed ones (modules of a list): the experts
    are their ep rank's half, every other parameter FSDP2's shard; loss, gradients and parameters after SGD steps
    exact."""
    mesh = {"dp": 2, "ep": 2}
    golden.check(pools.get(2).run(golden.golden, name, mesh, data_parallel="fsdp"), mesh)


def test_experts_held_as_separate_modules_with_ep_carved_from_cp(pools):
    """cp2 x ep2: the sequence's halves send each expert's rows to its holder."""
    mesh = {"cp": 2, "ep": 2}
    golden.check(pools.get(2).run(golden.golden, "moe_list", mesh), mesh)


def test_save_pretrained_under_ep_loads_under_another_split_reading_each_ranks_experts(pools, tmp_path):
    path = str(tmp_path / "hf")
    results = pools.get(4).run(golden_moe.pretrained_between_splits, "mixtral", {"dp": 2, "ep": 2, "tp": 2},
                               {"dp": 4, "ep": 4}, path)
    for rank, result in enumerate(results):
        assert not result["differ"], f"rank {rank}: {result['differ'][:5]}"
        assert result["read"] < 0.8 * result["total"], (rank, result["read"], result["total"])


def test_compiled_programs_over_experts_split_by_ep(pools):
    """``compile=True``: exact over 6 steps; the rows each expert receives change every step, and after the first
    change the compiler takes that size as dynamic (2 graphs recompiled, then none)."""
    for rank, result in enumerate(pools.get(2).run(golden_moe.compiled, "mixtral", {"dp": 2, "ep": 2}, steps=6,
                                                   timeout=900)):
        assert result["ok"], f"rank {rank}:\n{result['report']}"
        assert result["recompiled"] <= 2, (rank, result["recompiled"])


@pytest.mark.parametrize("mesh,options", [({"dp": 2, "cp": 2}, {}), ({"dp": 2}, {"microbatches": 4})],
                         ids=["dp2xcp2", "dp2-m4"])
def test_a_router_loss_over_the_whole_batch_is_refused_where_its_parts_run_apart(mesh, options):
    """The load-balancing loss multiplies two statistics of the batch's tokens: beside cp, or over parts of one
    sample, no pass can read the whole batch's. Refused before any collective, naming the model's line and what
    works (dp alone takes them over its ranks; microbatches and pp of two samples or more, in two passes)."""
    case, loss_fn = golden_moe.with_router_loss("mixtral")
    with pytest.raises(ValueError, match=r"not a sum over the batch's samples.*load_balancing_loss_func.*dp alone"):
        compile_global_batch(case.model, case.inputs, autoshard.Mesh(**mesh), 0, CompileOptions(**options),
                             target=case.target, loss_fn=loss_fn)


@pytest.mark.parametrize("mesh", [{}, {"dp": 2, "ep": 2}, {"dp": 2, "pp": 2}], ids=["m2", "ep2-m2", "dp2xpp2-m2"])
def test_a_router_loss_over_the_whole_batch_is_exact_in_two_passes(pools, mesh):
    """Microbatches and pipelines run the parts of the batch one after another: the first pass forwards every
    microbatch to its shares of the statistics (tokens per expert, router probabilities and the cross-entropy
    summed, tokens counted), added over the microbatches and the dp ranks; the term computes the loss from the whole
    batch's, and the second pass feeds each microbatch the term's gradient with respect to its shares."""
    world = mesh.get("dp", 1) * mesh.get("pp", 1)
    results = pools.get(world).run(golden_moe.router_loss, "mixtral", mesh, microbatches=2) if world > 1 else \
        [golden_moe.router_loss("mixtral", mesh, microbatches=2)]
    for result in results:
        assert result["ok"], result["report"]


ROUTER_LOSS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "gpt_oss", "jetmoe")  # DeepSeek-V3 has none


@pytest.mark.parametrize("name", ROUTER_LOSS)
def test_a_router_loss_over_the_whole_batch_is_exact_under_ep(pools, name):
    """Each dp rank's counts of tokens per expert (histc), its sums of router probabilities and of the cross-entropy
    and its count of counted tokens are summed over the dp ranks before the loss reads them, and the rows the capture
    counted at the local batch (transformers' ``total_rows``) are the whole batch's: the loss, every gradient and the
    parameters after SGD steps are the unsharded model's (2.5e-3 off at dp=2 computed per rank)."""
    for result in pools.get(2).run(golden_moe.router_loss, name, {"dp": 2, "ep": 2}):
        assert result["ok"], result["report"]


@pytest.mark.parametrize("name,mesh", [("mixtral", {"dp": 2, "ep": 2}), ("qwen3_moe", {"dp": 2, "ep": 2, "tp": 2}),
                                       ("mixtral", {"dp": 4, "ep": 2})], ids=["mixtral-ep2", "qwen3_moe-ep2xtp2",
                                                                              "mixtral-dp4xep2"])
def test_a_router_loss_over_the_whole_batch_in_an_ordinary_training_loop(pools, name, mesh):
    """Padded rows with their attention_mask (transformers then counts the rows as a sum of the mask, and scatters the
    tokens per expert into zeros), two step() calls per AdamW step, clipping: exact against the model in one
    process."""
    world = mesh["dp"] * mesh.get("tp", 1)
    for rank, result in enumerate(pools.get(world).run(golden_moe.training_loop, name, mesh, steps=2,
                                                       router_loss=True)):
        assert result["loss"] < 1e-5 and result["norm"] < 1e-5, f"rank {rank}: {result['loss']}, {result['norm']}"
        assert not result["bad_grads"] and not result["bad"], f"rank {rank}: {result['bad_grads']}, {result['bad']}"
        assert "sums its part of each such statistic over the" in result["explain"]


@pytest.mark.parametrize("mesh,options", [({"dp": 2, "ep": 2}, {}), ({"dp": 2}, {"microbatches": 2})],
                         ids=["ep2", "dp2-m2"])
def test_a_router_loss_computed_on_each_part_with_local_batch_statistics(pools, mesh, options):
    """``batch_statistics="local"``: each rank's and microbatch's part computes the load-balancing loss from its own
    tokens, and the parts' losses are averaged, as DDP with gradient accumulation does; said in ``explain()``."""
    for rank, result in enumerate(pools.get(2).run(golden_moe.router_loss_local, "mixtral", mesh, **options)):
        assert result["loss"] < 1e-5 and not result["bad_grads"] and not result["bad"], (rank, result)
        assert "batch_statistics='local'" in result["explain"]


@pytest.mark.parametrize("mesh", [{"tp": 2}, {"cp": 2}], ids=["tp2", "cp2"])
def test_a_router_loss_is_exact_where_the_batch_stays_whole(pools, mesh):
    for result in pools.get(2).run(golden_moe.router_loss, "mixtral", mesh):
        assert result["ok"], result["report"]
