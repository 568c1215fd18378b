"""Context parallelism: the sequence split over cp ranks computes what the unsharded model computes."""

from __future__ import annotations

import re

import pytest
import torch
from torch import fx

from autoshard.passes.context_parallel import ContextParallelError, ContextParallelPlan, _check_whole_sequences
from autoshard.passes.placements import Shard

from harness import golden
from harness.models import DECODERS

CP_MODELS = (*DECODERS, "bert")


@pytest.mark.parametrize("load_balance", [False, True], ids=["contiguous", "balanced"])
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("name", CP_MODELS)
def test_golden_context_parallel_gather(pools, name, cp, load_balance):
    golden.check(pools.get(cp).run(golden.golden, name, {"cp": cp}, cp_load_balance=load_balance))


@pytest.mark.parametrize("load_balance", [False, True], ids=["contiguous", "balanced"])
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("name", CP_MODELS)
def test_golden_context_parallel_ring(pools, name, cp, load_balance):
    results = pools.get(cp).run(golden.golden, name, {"cp": cp}, cp_attention="ring", cp_load_balance=load_balance)
    golden.check(results)


@pytest.mark.parametrize("cp,load_balance", [(2, False), (4, True)], ids=["2", "4-balanced"])
@pytest.mark.parametrize("name", CP_MODELS)
def test_golden_context_parallel_all_to_all(pools, name, cp, load_balance):
    results = pools.get(cp).run(golden.golden, name, {"cp": cp}, cp_attention="alltoall",
                                cp_load_balance=load_balance)
    golden.check(results)


STRATEGY_MODULE = {"gather": "SequenceGather", "ring": "RingAttention", "alltoall": "SequenceToHeads"}


MASK_CASES = [(kind, attention, 2, True) for kind in golden.MaskedDecoder.KINDS for attention in STRATEGY_MODULE] + [
    (kind, "ring", 4, True) for kind in golden.MaskedDecoder.KINDS] + [
    ("documents", attention, 2, False) for attention in STRATEGY_MODULE]


@pytest.mark.parametrize("kind,attention,cp,load_balance", MASK_CASES,
                         ids=[f"{k}-{a}-{c}{'-balanced' if b else ''}" for k, a, c, b in MASK_CASES])
def test_every_mask_kind_is_exact_under_every_strategy(pools, kind, attention, cp, load_balance):
    """Masks built in the graph from the inputs (padding, a window, packed documents of uneven lengths), the causal
    flag and none: exact under every strategy, the attention split as asked (not gathered around)."""
    results = pools.get(cp).run(golden.masked_golden, kind, {"cp": cp}, cp_attention=attention,
                                cp_load_balance=load_balance)
    golden.check(results)
    assert STRATEGY_MODULE[attention] in results[0]["modules"], results[0]["modules"]


@pytest.mark.parametrize("attention,cp,load_balance", [("gather", 2, False), ("ring", 2, True), ("alltoall", 4, True)],
                         ids=["gather-2", "ring-2-balanced", "alltoall-4-balanced"])
def test_a_vision_transformer_splits_its_patch_tokens(pools, attention, cp, load_balance):
    """No input carries the sequence: the split starts after the patch projection (a scatter of each rank's
    patches) and the mean over all tokens before the classifier gathers them; exact under every strategy."""
    results = pools.get(cp).run(golden.vision_golden, {"cp": cp}, cp_attention=attention,
                                cp_load_balance=load_balance)
    golden.check(results)
    assert {"SequenceScatter", STRATEGY_MODULE[attention]} <= set(results[0]["modules"]), results[0]["modules"]


@pytest.mark.parametrize("mesh,options", [({"pp": 2, "cp": 2}, {"microbatches": 2}), ({"tp": 2, "cp": 2}, {})],
                         ids=["pp2xcp2", "tp2xcp2"])
def test_a_vision_transformer_composes(pools, mesh, options):
    """Its loss is whole on every cp rank (a mean over the gathered tokens): counted once, on the pipeline's last
    stage too."""
    golden.check(pools.get(4).run(golden.vision_golden, mesh, cp_attention="alltoall", **options), mesh)


UNEVEN_CASES = [("causal", "gather", cp, b) for cp in (2, 4) for b in (False, True)] + [
    ("causal", "ring", cp, True) for cp in (2, 4)] + [
    (kind, attention, 2, True) for kind in ("padding", "documents") for attention in ("gather", "ring")]


@pytest.mark.parametrize("kind,attention,cp,load_balance", UNEVEN_CASES,
                         ids=[f"{k}-{a}-{c}{'-balanced' if b else ''}" for k, a, c, b in UNEVEN_CASES])
def test_a_sequence_the_ranks_do_not_divide_is_split_unevenly(pools, kind, attention, cp, load_balance):
    """15 tokens: ranks hold a token more or less (cp=4 balanced: 8 chunks of 1 or 2); gathers pad the shorter
    parts and drop the padding, ring blocks travel padded and their pieces never read it; exact."""
    results = pools.get(cp).run(golden.masked_golden, kind, {"cp": cp}, seq=15, cp_attention=attention,
                                cp_load_balance=load_balance)
    golden.check(results)
    assert STRATEGY_MODULE[attention] in results[0]["modules"], results[0]["modules"]


@pytest.mark.parametrize("mesh", [{"cp": 2}, {"cp": 4}, {"tp": 2, "cp": 2}], ids=["cp2", "cp4", "tp2xcp2"])
def test_a_vision_transformer_with_a_class_token_is_exact(pools, mesh):
    """16 patches and a class token: 17 tokens, split 9 and 8 (cp=2) or 4, 4, 4, 5 (cp=4)."""
    world = mesh.get("tp", 1) * mesh["cp"]
    results = pools.get(world).run(golden.vision_golden, mesh, class_token=True)
    golden.check(results, mesh)
    assert {"SequenceScatter", "SequenceGather"} <= set(results[0]["modules"]), results[0]["modules"]


def test_uneven_positions_and_what_refuses_them():
    from autoshard.passes.context_parallel import check_divisible

    plan = ContextParallelPlan(size=2, seq_len=17)
    assert [p.tolist() for p in map(plan.positions, range(2))] == [list(range(8)), list(range(8, 17))]
    assert plan.local_shape(1, (4, 17 * 3, 8), Shard(1)) == (4, 27, 8)  # 9 tokens x 3 inner elements
    balanced = ContextParallelPlan(size=2, seq_len=17, load_balance=True)
    assert [len(balanced.positions(r)) for r in range(2)] == [9, 8]  # chunks of 4, 4, 4, 5
    assert sorted(torch.cat([balanced.positions(r) for r in range(2)]).tolist()) == list(range(17))
    check_divisible(plan)  # gathered keys take it
    check_divisible(ContextParallelPlan(size=2, seq_len=17, attention="ring"))  # and so does the ring
    with pytest.raises(ContextParallelError, match=r"evenly, as cp attention 'alltoall' needs: use cp attention "
                                                   r"'gather' or 'ring'"):
        check_divisible(ContextParallelPlan(size=2, seq_len=17, attention="alltoall"))


def test_the_patch_split_starts_at_the_projection_and_a_class_token_is_split_unevenly():
    import torch.nn.functional as F
    from transformers import ViTConfig, ViTForImageClassification

    from autoshard.capture import capture
    from autoshard.passes.context_parallel import plan_context_parallel

    pixels, target = torch.randn(4, 3, 16, 16), torch.randint(0, 5, (4,))
    captured = capture(golden.PatchViT(), (pixels,), loss_fn=F.cross_entropy, example_target=target)
    plan = plan_context_parallel(captured.gm, 2)
    ((name, dim),) = plan.values.items()
    node = next(n for n in captured.gm.graph.nodes if n.name == name)
    assert (node.target, dim, plan.seq_len, plan.inputs) == (torch.ops.aten.flatten.using_ints, 2, 16, {})
    config = ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64, num_labels=5)
    captured = capture(ViTForImageClassification(config), (pixels,), loss_fn=lambda o, t: F.cross_entropy(o.logits, t),
                       example_target=target)
    plan = plan_context_parallel(captured.gm, 2)  # 16 patches and a class token: 9 and 8 under gathered keys
    assert (plan.seq_len, plan.even, len(plan.values)) == (17, False, 1)
    made = r"length 17 \(the tokens attention sees are made inside .*class token.*does not split into cp = 2"
    with pytest.raises(ContextParallelError, match=made):
        plan_context_parallel(captured.gm, 2, attention="alltoall")


def test_cp_with_tp_and_all_to_all(pools):
    results = pools.get(4).run(golden.golden, "llama", {"tp": 2, "cp": 2}, cp_attention="alltoall",
                               cp_load_balance=True)
    golden.check(results, {"tp": 2, "cp": 2})


def test_all_to_all_names_the_cp_degrees_its_heads_allow():
    from autoshard.capture import capture
    from autoshard.passes.context_parallel import plan_context_parallel

    from harness.models import build

    case = build("gpt")
    captured = capture(case.model, case.inputs, loss_fn=case.loss_fn, example_target=case.target)
    heads = next(n for n in captured.gm.graph.nodes
                 if n.target is torch.ops.aten.scaled_dot_product_attention.default).args[0].meta["val"].shape[1]
    with pytest.raises(ContextParallelError, match=rf"\[{heads}\] query/key/value heads.*cp={heads * 2} does not"):
        plan_context_parallel(captured.gm, heads * 2, attention="alltoall")
    with pytest.raises(ContextParallelError, match=r"each of tp=2 ranks holds 1/2"):
        plan_context_parallel(captured.gm, heads, attention="alltoall", tp=2)


def test_cp_with_tp_and_ring(pools):
    results = pools.get(4).run(golden.golden, "llama", {"tp": 2, "cp": 2}, cp_attention="ring", cp_load_balance=True)
    golden.check(results, {"tp": 2, "cp": 2})


def test_explain_counts_the_key_value_gathers(pools):
    report = pools.get(2).run(golden.explain, "gpt", {"cp": 2})[0]
    assert re.search(r"cp\s+forward\s+all_gather\s+SequenceGather\s+4\s", report), report  # keys and values, 2 layers
    assert re.search(r"cp\s+backward\s+reduce_scatter\s+SequenceGather\s+4\s", report), "their gradients summed"


def test_an_op_that_mixes_tokens_is_gathered_with_a_warning(pools):
    (ok0, said), (ok1, quiet) = pools.get(2).run(golden.token_mixing_op, 2)
    assert ok0 and ok1
    assert any("aten.cumsum" in m and "gathered" in m for m in said), said
    assert not quiet, "a warning is said once per job, by rank 0"


@pytest.mark.parametrize("load_balance", [False, True], ids=["contiguous", "balanced"])
def test_a_model_without_attention_splits_its_token_wise_layers(pools, load_balance):
    """A mixer no cp rule splits (a causal convolution, a recurrence) runs on the whole sequence; the rest splits."""
    (ok0, said), (ok1, quiet) = pools.get(2).run(golden.attention_free_model, 2, load_balance)
    assert ok0 and ok1
    assert any("aten.conv1d" in m and "token-wise layers" in m for m in said), said
    assert not quiet, "a warning is said once per job, by rank 0"


def test_a_sequence_the_ranks_do_not_divide_names_the_input_and_what_works():
    from autoshard.capture import capture
    from autoshard.passes.context_parallel import ContextParallelError, plan_context_parallel

    from harness.models import build

    case = build("gpt")
    captured = capture(case.model, case.inputs, loss_fn=case.loss_fn, example_target=case.target)
    message = (r"length 16, which does not split into 2 x cp = 6 chunks \(load balance\) evenly, as cp attention "
               r"'alltoall' ")
    with pytest.raises(ContextParallelError, match=message + r".*\[1, 2, 4, 8\]"):
        plan_context_parallel(captured.gm, 3, load_balance=True, attention="alltoall")
    assert not plan_context_parallel(captured.gm, 3, load_balance=True).even  # gathered keys: 6 chunks of 2 or 3


def test_a_model_without_a_sequence_says_so():
    from autoshard.capture import capture
    from autoshard.passes.context_parallel import ContextParallelError, plan_context_parallel

    from harness.models import build

    case = build("mlp")
    captured = capture(case.model, case.inputs, loss_fn=case.loss_fn, example_target=case.target)
    with pytest.raises(ContextParallelError, match="sequence dim could not be found"):
        plan_context_parallel(captured.gm, 2)


def test_gathered_causal_attention_needs_no_mask_and_computes_no_key_after_its_queries():
    """Gathered keys under the causal flag: each run of the rank's query positions attends the keys before it whole
    and its own run causally, with the fused kernel; no (T/c x T) mask, no key after the run computed."""
    from autoshard import codegen
    from autoshard.capture import capture
    from autoshard.passes.context_parallel import plan_context_parallel
    from autoshard.passes.loss import find_token_loss, sum_loss_pass
    from autoshard.passes.ring_attention import GatheredCausalAttention

    from harness.models import build

    case = build("gpt")
    captured = capture(case.model, case.inputs, loss_fn=case.loss_fn, example_target=case.target)
    sum_loss_pass(captured.gm, find_token_loss(captured.gm))  # as parallelize does: a per-token sum
    plan = plan_context_parallel(captured.gm, 2, load_balance=True)
    gm = codegen.build(captured, codegen.Sharding({"cp": codegen.On(plan, 0)})).gm
    modules = [m for m in gm.modules() if isinstance(m, GatheredCausalAttention)]
    assert len(modules) == 2 and not list(gm.buffers()), "two layers, no mask buffer"
    # rank 0 of 16 tokens, load balanced: positions 0-3 and 12-15
    assert list(modules[0].pieces()) == [(slice(0, 4), slice(0, 4), True), (slice(4, 8), slice(0, 12), False),
                                         (slice(4, 8), slice(12, 16), True)]
    q, k, v = (torch.randn(2, 4, 16, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    mine = leaves[0][..., plan.positions(0), :]
    out = modules[0](mine, leaves[1], leaves[2])
    out.square().sum().backward()
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*ref_leaves, is_causal=True)[..., plan.positions(0), :]
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref)
    for got, want in zip(leaves, ref_leaves, strict=True):
        torch.testing.assert_close(got.grad, want.grad)


def test_a_split_value_that_is_not_whole_sequences_is_refused_at_compile_time():
    """A split dim whose blocks are not whole sequences (a reshape cut the sequence into chunks) cannot be gathered
    or scattered: refused while building, before any collective. (batch, seq, heads) merged into one dim, the
    sequence outermost in each block (Qwen3.5's ``z.reshape(-1, head_dim)``), moves."""
    value = fx.Graph().placeholder("z")
    value.meta["val"] = torch.empty(2 * 12 * 4, 8, device="meta")
    plan = ContextParallelPlan(size=2, seq_len=12)
    with pytest.raises(ContextParallelError, match=r"in parts of \[18, 78\] would have to hold whole sequences"):
        _check_whole_sequences(plan, value, Shard(0, blocks=(18, 78)))
    _check_whole_sequences(plan, value, Shard(0, blocks=(48, 48)))  # two sequences of (12 tokens x 4 heads)
    _check_whole_sequences(plan, value, Shard(0, blocks=(12,) * 8))  # eight whole sequences


@pytest.mark.parametrize("load_balance", [False, True])
def test_a_sequence_merged_with_heads_is_indexed_by_its_tokens(load_balance):
    """A rank's part of ``x.reshape(B * T * H)`` is its tokens' rows of ``x``, flattened: each block holds
    (T, H), the sequence outermost, and every position carries its H inner elements."""
    from autoshard.passes.context_parallel import _rank_index

    plan = ContextParallelPlan(size=2, seq_len=8, load_balance=load_balance)
    layout = [plan.positions(r) for r in range(2)]
    x = torch.arange(3 * 8 * 4).reshape(3, 8, 4)
    for rank in range(2):
        mine = x.index_select(1, layout[rank]).reshape(-1)
        assert torch.equal(x.reshape(-1)[_rank_index(layout, rank, 96, (32,) * 3)], mine)
        assert torch.equal(x[0].reshape(-1)[_rank_index(layout, rank, 32, None)], x[0, layout[rank]].reshape(-1))


@pytest.mark.parametrize("attention", ["gather", "ring", "alltoall"])
def test_every_collective_says_its_axis_and_tp_keeps_the_shared_localizers(attention):
    """The axis of a collective is data (its node's ``meta.AXIS``, its module's ``axis``), whatever its name says;
    cp's attention localizer is cp's own: the shared table tp uses does not hold it."""
    from autoshard import codegen, meta
    from autoshard.capture import capture
    from autoshard.dot import axis_of, collective
    from autoshard.passes.context_parallel import plan_context_parallel
    from autoshard.passes.loss import find_token_loss, sum_loss_pass
    from autoshard.passes.rules import LOCALIZERS
    from autoshard.passes.tensor_parallel import plan_tensor_parallel

    from harness.models import build

    case = build("llama")
    captured = capture(case.model, case.inputs, loss_fn=case.loss_fn, example_target=case.target)
    sum_loss_pass(captured.gm, find_token_loss(captured.gm))
    sharding = codegen.Sharding({"tp": codegen.On(plan_tensor_parallel(captured.gm, 2), 1),
                                 "cp": codegen.On(plan_context_parallel(captured.gm, 2, attention=attention), 1)})
    gm = codegen.build(captured, sharding).gm
    found = {}
    for node in gm.graph.nodes:
        module = collective(gm, node)
        if module is not None:
            assert node.meta[meta.AXIS] == module.axis == axis_of(node), node.name
            found.setdefault(module.axis, set()).add(type(module).__name__)
    assert "ReduceFromParallel" in found["tp"], found
    expected = {"gather": {"SequenceGather"}, "ring": {"RingAttention"},
                "alltoall": {"SequenceToHeads", "HeadsToSequence"}}
    assert expected[attention] <= found["cp"], found
    attention_op = torch.ops.aten.scaled_dot_product_attention
    assert attention_op.default not in LOCALIZERS and attention_op not in LOCALIZERS
