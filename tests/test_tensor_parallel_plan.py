"""Tensor-parallel planning and rewriting without processes: patterns from structure, counts, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autoshard
from autoshard import codegen
from autoshard.capture import capture
from autoshard.explain import communication
from autoshard.passes.placements import R, Shard
from autoshard.passes.tensor_parallel import TensorParallelError, plan_tensor_parallel
from autoshard.plan import TensorParallelPlan

from harness.models import build, build_gpt_model, build_llama_model, token_loss


def _captured(name: str, batch: int = 2):
    case = build(name)
    inputs = tuple(x[:batch] for x in case.inputs)
    return capture(case.model, inputs, loss_fn=case.loss_fn, example_target=case.target[:batch])


def _roles(plan: TensorParallelPlan) -> dict[str, str]:
    return {name.removeprefix("model."): p.role for name, p in plan.params.items()}


def test_gpt_fused_qkv_gets_whole_heads_and_megatron_roles():
    plan = plan_tensor_parallel(_captured("gpt").gm, 2)
    roles = _roles(plan)
    assert roles["transformer.h.0.attn.c_attn.weight"] == "column"
    assert plan.params["model.transformer.h.0.attn.c_attn.weight"].placement == Shard(0, (48, 48, 48))
    assert roles["transformer.h.0.attn.c_proj.weight"] == "row"
    assert roles["transformer.h.0.mlp.c_fc.weight"] == "column"
    assert roles["transformer.h.0.mlp.c_proj.weight"] == "row"
    assert roles["transformer.h.0.attn.c_proj.bias"] == "replicated"
    assert roles["transformer.wte.weight"] == "vocab", "the tied embedding and LM head share one vocab shard"
    assert roles["transformer.wpe.weight"] == "vocab", "the position table is split by rows too"
    assert roles["transformer.ln_f.weight"] == "replicated"


def test_hf_gpt2_conv1d_weights_stored_in_out_are_sharded_on_the_right_dim():
    plan = plan_tensor_parallel(_captured("hf_gpt2").gm, 2)
    assert plan.params["model.transformer.h.0.attn.c_attn.weight"].placement == Shard(1, (48, 48, 48))
    assert plan.params["model.transformer.h.0.mlp.c_proj.weight"].placement == Shard(0)


@pytest.mark.parametrize("tp,kv_role", [(2, "column"), (4, "replicated")])
def test_grouped_query_kv_heads_shard_when_divisible_else_duplicate(tp, kv_role):
    plan = plan_tensor_parallel(_captured("llama").gm, tp)
    roles = _roles(plan)
    assert roles["layers.0.self_attn.q_proj.weight"] == "column"
    assert roles["layers.0.self_attn.k_proj.weight"] == kv_role
    assert roles["layers.0.mlp.gate_proj.weight"] == roles["layers.0.mlp.up_proj.weight"] == "column"
    assert roles["layers.0.mlp.down_proj.weight"] == "row"
    assert roles["lm_head.weight"] == "column", "logits stay sharded into the vocab-parallel cross-entropy"
    if tp == 4:
        why = "2 heads (a dim of 24 viewed as (2, 12)) do not divide over 4"
        assert any("k_proj kept replicated" in note and why in note for note in plan.notes)


@pytest.mark.parametrize("style", ["titan", "mistral", "gptfast", "sdpa_gqa", "repeat", "tiled"])
def test_kv_heads_repeated_any_way_that_keeps_their_mapping_are_duplicated_or_split(style):
    """However the model gives query head h kv head h // group (torchtitan's expand + reshape over dim 2,
    ``repeat_interleave`` over dim 2 or 1, ``enable_gqa=True``, ``repeat`` of a new dim), q is split by heads at tp 4
    and 8, k and v split where tp divides the kv heads and duplicated (held whole) where the kv heads divide tp.
    Heads tiled by ``repeat`` (query head h reads kv head h % kv heads) are split so only when k and v are whole."""
    import warnings

    from harness import golden_gqa

    for kv in (2, 4):
        model, tokens, target = golden_gqa.build(style, kv)
        gm = capture(model, (tokens,), loss_fn=golden_gqa.token_loss, example_target=target).gm
        for tp in (4, 8):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plan = plan_tensor_parallel(gm, tp)
            roles = [p.role for name, p in plan.params.items() if ".layers.0.attention." in name
                     and name.endswith("weight")]  # q, k, v, o
            duplicated = kv % tp != 0
            if style == "tiled" and not duplicated:
                assert roles[0] != "column", "q split by heads against kv heads split otherwise"
                continue
            assert roles == ["column", "replicated" if duplicated else "column",
                             "replicated" if duplicated else "column", "row"], (kv, tp, roles)
            if duplicated:
                assert any("kept replicated" in note for note in plan.notes), plan.notes


@pytest.mark.parametrize("kv,tp", [(2, 4), (2, 8), (4, 8), (4, 4)])
def test_a_fused_qkv_holds_k_and_v_whole_where_the_degree_does_not_divide_the_kv_heads(kv, tp):
    """One projection for q, k and v (``split`` apart): q is split by heads; k and v are split too where tp divides
    the kv heads, else every rank holds those two blocks whole, as a separate k_proj and v_proj would be. The
    placement says so, and round-trips through the plan's JSON."""
    from autoshard.passes.placements import Shard

    from harness import golden_gqa

    model, tokens, target = golden_gqa.build("fused", kv)
    gm = capture(model, (tokens,), loss_fn=golden_gqa.token_loss, example_target=target).gm
    plan = plan_tensor_parallel(gm, tp)
    width = kv * golden_gqa.HEAD_DIM
    blocks = (golden_gqa.HIDDEN, width, width)
    whole = () if kv % tp == 0 else (1, 2)
    for name in ("model.layers.0.attention.att_proj.weight", "model.layers.0.attention.att_proj.bias"):
        assert plan.params[name].placement == Shard(0, blocks, whole), (name, plan.params[name])
    assert plan.params["model.layers.0.attention.attn_out.weight"].role == "row"
    assert TensorParallelPlan.from_json(plan.to_json()) == plan
    if whole:
        assert "blocks 1, 2 whole on every rank" in plan.params["model.layers.0.attention.att_proj.weight"].reason


def test_heads_the_degree_does_not_divide_name_the_layer_and_the_degrees_that_work():
    message = r"layers\.0\.self_attn\.o_proj: 4 heads.*degrees that divide 4: \[1, 2, 4\]"
    with pytest.raises(TensorParallelError, match=message):
        plan_tensor_parallel(_captured("llama").gm, 8)


def test_indivisible_layers_can_be_kept_replicated_on_request():
    with pytest.warns(UserWarning, match="stays replicated"):
        plan = plan_tensor_parallel(_captured("llama").gm, 8, indivisible="replicate")
    assert _roles(plan)["layers.0.self_attn.q_proj.weight"] == "replicated"
    assert _roles(plan)["layers.0.mlp.gate_proj.weight"] == "column", "the MLP (ffn 128) still splits 8 ways"


def test_plan_round_trips_through_json():
    plan = plan_tensor_parallel(_captured("gpt").gm, 2)
    again = TensorParallelPlan.from_json(plan.to_json())
    assert again == plan
    assert "S(0, blocks=(48, 48, 48))" in str(again)


class _LoneLinear(nn.Module):
    """Norm -> linear -> norm: no column feeds a row."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(12)
        self.proj = nn.Linear(12, 12)
        self.out = nn.LayerNorm(12)

    def forward(self, x):
        return self.out(self.proj(self.norm(x)))


def test_a_linear_outside_any_block_is_split_alone_by_rows():
    captured = capture(_LoneLinear(), (torch.randn(3, 12),), loss_fn=lambda y, t: (y - t).square().mean(),
                       example_target=torch.randn(3, 12))
    params = {name.removeprefix("model."): p for name, p in plan_tensor_parallel(captured.gm, 2).params.items()}
    assert params["proj.weight"].placement == Shard(1), params
    assert "row alone" in params["proj.weight"].reason
    assert params["proj.bias"].placement == R, "the bias is added once, after the all-reduce"
    assert {params[n].placement for n in ("norm.weight", "out.weight")} == {R}


def _per_rank_counts(name: str, tp: int) -> dict:
    captured = _captured(name)
    plan = plan_tensor_parallel(captured.gm, tp)
    gm = codegen.build(captured, codegen.Sharding({"tp": codegen.On(plan, 0)})).gm
    counts: dict[tuple[str, str], int] = {}
    for (direction, _kind, op), (calls, _) in communication(gm).items():
        name = op.removeprefix("tp ")
        counts[(direction, name)] = counts.get((direction, name), 0) + calls
    return counts


@pytest.mark.parametrize("name", ["gpt", "llama", "hf_gpt2", "hf_llama"])
def test_collectives_per_layer_are_megatrons_minimum(name):
    counts = _per_rank_counts(name, 2)
    layers = 2
    tables = 1 + ("gpt" in name)  # the token embedding; gpt's learned position table is split by rows too
    # Forward: one all-reduce after attention and one after the MLP per layer, one per vocab-parallel lookup.
    # Backward: one all-reduce of the input gradient of each block, and one for the LM head.
    assert counts[("forward", "ReduceFromParallel")] == 2 * layers + tables
    assert counts[("backward", "CopyToParallel")] == 2 * layers + 1
    assert counts[("forward", "VocabParallelCrossEntropy")] == 2  # the row maxima, then the stacked sums
    assert set(counts) == {("forward", "ReduceFromParallel"), ("backward", "CopyToParallel"),
                           ("forward", "VocabParallelCrossEntropy")}


def test_sharded_parameters_hold_one_tpth_of_the_matrices():
    captured = _captured("llama")
    plan = plan_tensor_parallel(captured.gm, 2)
    gm = codegen.build(captured, codegen.Sharding({"tp": codegen.On(plan, 1)})).gm
    local = dict(gm.named_parameters())
    assert local["model.layers.0.mlp.gate_proj.weight"].shape == (64, 48)
    assert local["model.layers.0.mlp.down_proj.weight"].shape == (48, 64)
    assert local["model.layers.0.self_attn.k_proj.weight"].shape == (12, 48)
    full = dict(captured.gm.named_parameters())
    torch.testing.assert_close(local["model.layers.0.mlp.down_proj.weight"],
                               full["model.layers.0.mlp.down_proj.weight"][:, 64:], rtol=0, atol=0)


def test_code_of_a_rank_has_local_sizes():
    case = build("gpt")
    pm = autoshard.parallelize(case.model, None, example_inputs=case.inputs, loss_fn=case.loss_fn, target=case.target)
    assert "[8, 16, 4, 12]" in pm.code(0), "one rank runs all 4 heads"


def test_seven_billion_shape_plans_on_meta_quickly():
    model = build_llama_model(
        n_layer=2, n_embd=4096, n_head=32, n_kv_head=8, ffn=11008, vocab=32000, seq=64, device="meta"
    )
    tokens = torch.zeros(1, 64, dtype=torch.long, device="meta")
    captured = capture(model, (tokens,), loss_fn=token_loss, example_target=tokens)
    plan = plan_tensor_parallel(captured.gm, 8)
    assert _roles(plan)["layers.1.self_attn.k_proj.weight"] == "column", "8 kv heads shard 8 ways"
    gm = codegen.build(captured, codegen.Sharding({"tp": codegen.On(plan, 3)})).gm
    assert dict(gm.named_parameters())["model.layers.0.mlp.up_proj.weight"].shape == (11008 // 8, 4096)


def test_a_vocabulary_the_degree_does_not_divide_is_padded_not_replicated():
    model = build_gpt_model(vocab=81)
    tokens = torch.zeros(2, 16, dtype=torch.long)
    captured = capture(model, (tokens,), loss_fn=token_loss, example_target=tokens)
    plan = plan_tensor_parallel(captured.gm, 2)
    wte = plan.params["model.transformer.wte.weight"]
    assert wte.role == "vocab" and "padded from 81 to 82 rows" in wte.reason
    local = dict(codegen.build(captured, codegen.Sharding({"tp": codegen.On(plan, 1)})).gm.named_parameters())
    assert local["model.transformer.wte.weight"].shape == (41, 48)
    assert torch.equal(local["model.transformer.wte.weight"][-1], torch.zeros(48)), "the last row is padding"


class _RoutedMLP(nn.Module):
    """An MLP whose input also feeds a router of a computed weight (an fp32 cast, as MoE routers do)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Parameter(torch.randn(4, 16))
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.nn.functional.linear(x.float(), self.router.float()).softmax(-1).amax(-1, keepdim=True)
        return self.down(torch.relu(self.up(x)) * gate)


def test_a_linear_of_a_computed_weight_is_not_taken_for_a_column():
    x = torch.randn(2, 16)
    captured = capture(_RoutedMLP(), (x,), loss_fn=lambda y, t: (y - t).pow(2).mean(), example_target=x)
    roles = _roles(plan_tensor_parallel(captured.gm, 2))
    assert roles["up.weight"] == "column" and roles["down.weight"] == "row", roles
    assert roles["router"] in ("replicated", "row"), "never a column: its few outputs are read whole"


class _TopKRouter(nn.Module):
    """An MLP scaled by a router's top-2 weights (no experts: the router alone is the point)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(16, 4, bias=False)
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, _ = self.router(x).softmax(-1).topk(2, dim=-1)
        return self.down(torch.relu(self.up(x))) * weights.sum(-1, keepdim=True)


def test_a_router_stays_replicated():
    """Split alone, a router's logits would be sums of per-rank parts, rounded otherwise than the whole product: a near
    tie could pick another expert. It is held whole, as Megatron holds it; the MLP is split."""
    x = torch.randn(2, 16)
    captured = capture(_TopKRouter(), (x,), loss_fn=lambda y, t: (y - t).pow(2).mean(), example_target=x)
    plan = plan_tensor_parallel(captured.gm, 2)
    roles = _roles(plan)
    assert roles["up.weight"] == "column" and roles["down.weight"] == "row", roles
    assert roles["router.weight"] == "replicated" and "router" in plan.params["model.router.weight"].reason


class _DataDependentRows(nn.Module):
    """An MLP over the rows a mask picks (as a mixture of experts picks each expert's tokens): sizes known only
    when the graph runs."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        picked = x[x[:, 0] > 0]  # (rows chosen by the data, 16)
        return self.down(torch.relu(self.up(picked))).sum(0)


def test_a_size_that_depends_on_the_data_keeps_the_other_dims_splittable():
    """The rows are known only when the graph runs, the features are not: the MLP is split by its features. A rule
    that reads such a size itself (the rows' count) refuses, and its op stays replicated: here the boolean mask's
    pick."""
    x = torch.randn(6, 16)
    captured = capture(_DataDependentRows(), (x,), loss_fn=lambda y, t: (y - t).pow(2).mean(), example_target=x[0])
    plan = plan_tensor_parallel(captured.gm, 2)
    for rank in range(2):
        codegen.build(captured, codegen.Sharding({"tp": codegen.On(plan, rank)}))
    roles = _roles(plan)
    assert roles["up.weight"] == "column" and roles["down.weight"] == "row", roles


def test_a_rule_reading_a_size_that_depends_on_the_data_refuses():
    from autoshard.passes.rules import Context, DataDependentShape

    picked = next(n for n in capture(_DataDependentRows(), (torch.randn(6, 16),), loss_fn=lambda y, t: y.sum(),
                                     example_target=torch.randn(16)).gm.graph.nodes
                  if n.target is torch.ops.aten.index.Tensor)
    rows, features = Context.shape(picked)
    assert features == 16
    for use in (lambda: rows == 3, lambda: rows * 2, lambda: int(rows), lambda: 4 % rows, lambda: range(rows)):
        with pytest.raises(DataDependentShape, match="depends on the data"):
            use()


class _FusedQKVViewedWhole(nn.Module):
    """ModernBERT-style attention: one q/k/v projection viewed as (batch, seq, 3, heads, head dim)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(32, 96, bias=False), nn.Linear(32, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 4, 8).permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, heads, T, head dim)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, t, 32))


def test_a_fused_qkv_viewed_whole_is_not_refused_for_its_three_parts():
    x = torch.randn(2, 5, 32)
    captured = capture(_FusedQKVViewedWhole(), (x,), loss_fn=lambda y, t: (y - t).pow(2).mean(), example_target=x)
    plan = plan_tensor_parallel(captured.gm, 2)  # 3 parts of 4 heads: the parts are not heads that 2 cannot split
    codegen.build(captured, codegen.Sharding({"tp": codegen.On(plan, 0)}))


# corpus architectures whose attention or experts once stayed replicated at tp=2, and why
SHARDED_NOW = {
    "qwen3": "per-head QK-norm computed in fp32 (export's dtype check on a split value)",
    "olmo2": "QK-norm over the whole q/k width (a mean over the split dim)",
    "bloom": "ALiBi added to the scores with baddbmm",
    "gptj": "interleaved rotary (stack, flatten)",
    "torch/multihead_attention": "torch's packed in_proj (unflatten, (tokens, batch * heads) views)",
    "mixtral": "experts stacked as 3-D weights, multiplied by a grouped matmul",
    "qwen2_moe": "experts plus a shared expert",
    "apertus": "xIELU activation in the MLP (min, expm1)",
    "granite_swa": "attention sinks merged by a log-sum-exp over the keys",
    "xlm": "a mask expanded to the scores (expand_as) and filled in place",
    "phi3": "fused qkv cut apart by slices",
    "xglm": "scores clamped from below by max(scores, finfo.min)",
    "gpt_oss": "attention sinks (a max over the keys), experts with interleaved gate/up and biases added in place",
    "llama4_text": "rotary as complex numbers (view_as_complex), experts as bmm over gathered tokens",
    "qwen3_next": "gated delta rule linear attention: q/k/v joined, a depthwise conv, rows of (tokens x heads)",
    "olmo_hybrid": "linear attention from separate q/k/v projections joined by cat",
    "bert": "an MLM head's transform (a row alone) and a learned position table (split by rows)",
    "roformer": "rotary applied with reshape_as",
    "falcon": "x @ W.T linears round a fused q/k/v of 4 query and 2 kv heads (each a row alone)",
    "mamba": "a state-space mixer: x_proj a row inside the block, dt_proj as W @ x, the decay per channel sliced",
    "deepseek_v32": "a sparse-attention indexer computed under torch.no_grad()",
    "jetmoe": "experts looped as linear(x, W[i]) over a stack (captured as grouped matmuls); attention experts "
              "whose keys are tiled per routed slot (repeat), their rows put back by index_add",
}


@pytest.mark.parametrize("name", SHARDED_NOW)
def test_attention_and_experts_of_current_architectures_are_sharded(name):
    """Planned without processes: a tp=2 rank holds at most 0.55 of the parameter bytes (replicated norms and
    biases above one half), and every stack of expert weights is split."""
    import warnings

    from corpus.architectures import build as build_corpus

    from autoshard.compile import compile_global_batch
    from autoshard.mesh import Mesh
    from autoshard.options import CompileOptions
    from autoshard.passes.placements import Shard

    case = build_corpus(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = compile_global_batch(case.model, case.inputs, Mesh(tp=2), 0, CompileOptions(), target=case.target,
                                     loss_fn=case.loss_fn)
    full = dict(built.captured.gm.named_parameters())
    local = {n: p for program in built.programs.values() for n, p in program.gm.named_parameters()}
    share = sum(p.numel() * p.element_size() for p in local.values()) / sum(
        p.numel() * p.element_size() for p in full.values())
    assert share <= 0.55, f"{name} ({SHARDED_NOW[name]}): rank 0 holds {share:.2f} of the parameters"
    experts = [n for n, p in full.items() if p.dim() == 3 and p.shape[1] != 1]  # not a depthwise conv's filters
    assert all(isinstance(built.tp_plan.params[n].placement, Shard) for n in experts), experts


def test_a_scan_cut_along_the_sequence_with_an_unused_initial_state_is_split_as_megatron_splits_it():
    """transformers 5.25's Mamba: the scan's inputs cut along the sequence by ``tensor_split``, and an initial state
    made from the decay by ``A.new_zeros`` that nothing reads. Neither reads the split channels, so the mixer is
    split as before; without rules for the two ops in_proj was a row alone and every channel weight whole."""
    from harness.golden import _SelectiveScan

    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 16))
    captured = capture(_SelectiveScan(), (ids,), loss_fn=token_loss, example_target=ids)
    roles = _roles(plan_tensor_parallel(captured.gm, 2))
    assert roles == {
        "emb.weight": "vocab", "in_proj.weight": "column", "in_proj.bias": "column", "conv.weight": "sliced",
        "conv.bias": "sliced", "x_proj.weight": "row", "dt_proj.weight": "column", "dt_proj.bias": "sliced",
        "A_log": "sliced", "D": "sliced", "out_proj.weight": "row", "head.weight": "column",
    }, roles


def test_a_state_space_mixer_is_split_as_megatron_splits_it():
    """Mamba's mixer: in_proj's channels split (x and the gate z, each blocked), x_proj reading them as a row inside
    the block (its small output summed), dt_proj splitting them again as ``W @ dt``, out_proj closing the block;
    the per-channel decay, skip, kernels and bias held split, as every reader takes its channels."""
    from corpus.architectures import build as build_corpus

    case = build_corpus("mamba")
    captured = capture(case.model, case.inputs, loss_fn=case.loss_fn, example_target=case.target)
    plan = plan_tensor_parallel(captured.gm, 2)
    mixer = {name.split("mixer.")[1]: p for name, p in plan.params.items() if "layers.0.mixer." in name}
    assert {k: p.role for k, p in mixer.items()} == {
        "in_proj.weight": "column", "x_proj.weight": "row", "dt_proj.weight": "column", "out_proj.weight": "row",
        "A_log": "sliced", "D": "sliced", "conv1d.weight": "sliced", "conv1d.bias": "sliced", "dt_proj.bias": "sliced",
    }, mixer


def test_a_mamba2_mixer_is_split_by_heads_and_groups():
    """Mamba2's in_proj makes z, then x, B and C together (cut apart again after the depthwise conv), then dt: one
    column blocked at every cut, so each rank takes its heads of z, x and dt and its groups of B and C; the conv,
    the per-head decay, skip and dt bias and the gated norm held split; out_proj the row."""
    from corpus.architectures import build as build_corpus

    case = build_corpus("mamba2")
    captured = capture(case.model, case.inputs, loss_fn=case.loss_fn, example_target=case.target)
    plan = plan_tensor_parallel(captured.gm, 2)
    mixer = {name.split("mixer.")[1]: (p.role, p.placement) for name, p in plan.params.items()
             if "layers.0.mixer." in name}
    xbc = (128, 1024, 1024)  # x of 8 heads of 16, B and C of 8 groups of a state of 128
    assert mixer == {
        "in_proj.weight": ("column", Shard(0, (128, *xbc, 8))), "conv1d.weight": ("sliced", Shard(0, xbc)),
        "conv1d.bias": ("sliced", Shard(0, xbc)), "dt_bias": ("sliced", Shard(0)), "A_log": ("sliced", Shard(0)),
        "D": ("sliced", Shard(0)), "norm.weight": ("sliced", Shard(0)), "out_proj.weight": ("row", Shard(1)),
    }, mixer


def test_experts_joined_by_cat_are_all_reduced_once_per_layer():
    """JetMoE's experts (``F.linear(x_i, weight[i])`` per expert joined by ``cat``, captured as grouped matmuls,
    scaled by the routing weights, added into zeros at the tokens' rows): one all-reduce per mixture, of the tokens'
    rows, not one per expert of the tokens x top-k rows."""
    from corpus.architectures import build as build_corpus

    from autoshard.passes.collectives import ReduceFromParallel

    case = build_corpus("jetmoe")
    captured = capture(case.model, case.inputs, loss_fn=case.loss_fn, example_target=case.target)
    gm = codegen.build(captured, codegen.Sharding({"tp": codegen.On(plan_tensor_parallel(captured.gm, 2), 0)})).gm
    reduced = [node.args[0] for node in gm.graph.nodes
               if node.op == "call_module" and isinstance(gm.get_submodule(node.target), ReduceFromParallel)]
    mixtures = [n for n in captured.gm.graph.nodes if n.target is torch.ops.aten.index_add.default
                and n.meta["val"].shape[0] == case.inputs[0].numel()]
    assert len(mixtures) == 4, mixtures  # two layers, each with a mixture of attention heads and of MLPs
    combines = [a for a in reduced if a.target is torch.ops.aten.index_add.default]
    assert len(combines) == 4 and len(reduced) == 5, reduced  # and the vocab-parallel embedding's


def test_experts_looped_over_a_stack_that_stays_a_loop_split_each_experts_features():
    """``linear(x_e, W[e])`` per expert, left a loop (the model reads its counts too, so it is no grouped matmul):
    the stack (experts, out, in) is split on each expert's features (a row alone here: its input features, dim 2),
    never on the experts, and the experts' pending sums are all-reduced once, after their join."""
    from autoshard.passes.collectives import ReduceFromParallel
    from autoshard.passes.placements import Shard

    from harness.models import LoopedExperts

    x = torch.randn(12, 8)
    captured = capture(LoopedExperts(reads_counts=True), (x,), loss_fn=lambda y, t: (y - t).pow(2).mean(),
                       example_target=torch.zeros(12, 6))
    assert not any("grouped_mm" in str(n.target) for n in captured.gm.graph.nodes)
    plan = plan_tensor_parallel(captured.gm, 2)
    assert (plan.params["model.w"].role, plan.params["model.w"].placement) == ("row", Shard(2)), plan.params["model.w"]
    gm = codegen.build(captured, codegen.Sharding({"tp": codegen.On(plan, 0)})).gm  # the experts' pending sums joined
    reduced = [node.args[0] for node in gm.graph.nodes  # by cat and added at the tokens' rows: one all-reduce
               if node.op == "call_module" and isinstance(gm.get_submodule(node.target), ReduceFromParallel)]
    assert [a.target for a in reduced] == [torch.ops.aten.index_add.default], reduced


def test_einsum_attention_is_split_by_heads():
    """XLNet's attention, einsums over (hidden, heads, head dim) weights: q, k, v and the relative-position
    projection are columns split by heads (``ibh,hnd->ibnd``), the output projection a row (``ibnd,hnd->ibh``, the
    heads summed), and the per-head biases added to q held split, at tp=2 and at tp=4 (one head per rank)."""
    from corpus.architectures import build as build_corpus

    case = build_corpus("xlnet")
    captured = capture(case.model, case.inputs, loss_fn=case.loss_fn, example_target=case.target)
    for size in (2, 4):
        plan = plan_tensor_parallel(captured.gm, size)
        attention = {name.split("rel_attn.")[1]: p for name, p in plan.params.items() if "layer.0.rel_attn." in name}
        assert {k: (p.role, p.placement) for k, p in attention.items() if p.role != "replicated"} == {
            "q": ("column", Shard(1)), "k": ("column", Shard(1)), "v": ("column", Shard(1)),
            "r": ("column", Shard(1)), "o": ("row", Shard(1)),
            "r_r_bias": ("sliced", Shard(0)), "r_w_bias": ("sliced", Shard(0)),
        }, attention


class _GroupedProjection(nn.Module):
    """Attention's output projected per group of heads (``bmm`` over a weight viewed (groups, rank, in)), then mixed
    by one linear; beside it, streams mixed by a weight read cast (``fn.float()``) and a position table read as
    ``table[positions]``."""

    def __init__(self) -> None:
        super().__init__()
        self.grouped = nn.Parameter(torch.randn(4 * 6, 4))  # (groups * rank, in per group)
        self.mix = nn.Linear(4 * 6, 16, bias=False)
        self.fn = nn.Parameter(torch.randn(2, 16))
        self.positions = nn.Parameter(torch.randn(10, 16))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = x + self.positions[ids]
        groups = h.reshape(b * s, 4, 4).transpose(0, 1)
        y = torch.bmm(groups, self.grouped.view(4, 6, 4).transpose(1, 2)).transpose(0, 1).reshape(b, s, 24)
        gates = torch.sigmoid(torch.nn.functional.linear(h.float(), self.fn.float()))
        return self.mix(y) * gates.sum(-1, keepdim=True)


def test_grouped_projections_cast_weights_and_indexed_tables_are_split():
    """The grouped projection is a column (whole groups to a rank) closed by the mixing linear as a row; the linear
    of a cast weight is split alone; the table read by ``table[ids]`` is split by rows (a vocab-parallel lookup)."""
    x, ids = torch.randn(2, 5, 16), torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]])
    captured = capture(_GroupedProjection(), (x, ids), loss_fn=lambda y, t: (y - t).pow(2).mean(),
                       example_target=x)
    params = {name.removeprefix("model."): p for name, p in plan_tensor_parallel(captured.gm, 2).params.items()}
    assert {n: (p.role, p.placement) for n, p in params.items()} == {
        "grouped": ("column", Shard(0)), "mix.weight": ("row", Shard(1)), "fn": ("column", Shard(0)),
        "positions": ("vocab", Shard(0)),
    }, params


def test_a_patch_embedding_is_split_by_the_rows_of_its_kernel():
    """ViT's patch embedding (a conv whose stride is its kernel: a linear over each patch's pixels) is split alone
    by the kernel's rows, its bias added once after the sum; a rank holds about 1/tp of the model."""
    from corpus.architectures import build as build_corpus

    case = build_corpus("vision/vit")
    captured = capture(case.model, case.inputs, loss_fn=case.loss_fn, example_target=case.target)
    plan = plan_tensor_parallel(captured.gm, 4)
    stem = {n.rsplit(".", 1)[1]: p for n, p in plan.params.items() if "patch_embeddings.projection" in n}
    assert {k: (p.role, p.placement) for k, p in stem.items()} == {
        "weight": ("row", Shard(2)), "bias": ("replicated", R)}


def test_pieces_of_a_packed_in_projection_are_columns_of_one_blocked_weight():
    """q from ``W[:E]`` and k, v from ``W[E:]`` unflattened into two parts (a pooling probe), or q, k, v from
    ``W.chunk(3)`` (a cross attention): one column weight blocked (E, E, E), so each rank takes its heads of q, k
    and v; the output projection is the row."""
    from harness.golden import _PackedAttention

    x, memory = torch.randn(2, 6, 16), torch.randn(2, 5, 16)
    captured = capture(_PackedAttention(), (x, memory), loss_fn=lambda y, t: (y - t).pow(2).mean(),
                       example_target=torch.randn(2, 3))
    params = plan_tensor_parallel(captured.gm, 2).params
    for attention in ("cross", "pool"):
        roles = {n.split(f"{attention}.")[1]: (p.role, p.placement) for n, p in params.items() if f".{attention}." in n}
        assert roles == {
            "in_proj_weight": ("column", Shard(0, (16, 16, 16))), "in_proj_bias": ("column", Shard(0, (16, 16, 16))),
            "out_proj.weight": ("row", Shard(1)), "out_proj.bias": ("replicated", R)}, roles
