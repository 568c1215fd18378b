"""Annotate: FLOPs, activation and parameter bytes per node from the captured shapes; formulas in b and s."""

from __future__ import annotations

import resource
import sys
import time

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch import nn

import autoshard
from autoshard import cost

from harness.models import BATCH, HIDDEN, N_LAYER, SEQ, build, build_llama_model, token_loss

B, S = cost.BATCH_SYMBOL, cost.SEQ_SYMBOL


def _nodes(gm, name):
    return [n for n in gm.graph.nodes if n.op == "call_function" and cost.op_name(n.target) == name]


def _capture_zoo(name, batch=BATCH, seq=SEQ):
    case = build(name)
    inputs = tuple(t[:batch, :seq] for t in case.inputs)
    return autoshard.capture(case.model, inputs, loss_fn=case.loss_fn, example_target=case.target[:batch, :seq])


@pytest.mark.parametrize("bias", [True, False])
def test_linear_flops_and_bytes_are_exact(bias):
    gm = autoshard.capture(nn.Linear(20, 24, bias=bias), (torch.randn(8, 20),)).gm
    costs = cost.annotate(gm)
    (linear,) = _nodes(gm, "linear")
    assert costs[linear] == cost.NodeCost(
        flops=2 * 8 * 24 * 20 + (8 * 24 if bias else 0), activation_bytes=8 * 24 * 4, param_bytes=0
    )
    assert linear.meta[cost.COST] is costs[linear]
    assert cost.total_param_bytes(costs) == (24 * 20 + (24 if bias else 0)) * 4
    assert cost.training_flops(costs[linear]) == 3 * costs[linear].flops


class _Attention(nn.Module):
    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


def test_attention_flops_count_both_matmuls_and_halve_when_causal():
    q, k, v = (torch.randn(2, 3, 5, 7) for _ in range(3))  # (B, H, T, D)
    flops = {}
    for causal in (False, True):
        gm = autoshard.capture(_Attention(causal), (q, k, v)).gm
        (sdpa,) = _nodes(gm, "scaled_dot_product_attention")
        flops[causal] = cost.annotate(gm)[sdpa].flops
    assert flops[False] == 4 * 2 * 3 * 5 * 5 * 7
    assert flops[True] == flops[False] // 2


class _Einsum(nn.Module):
    def forward(self, a, b):
        return torch.einsum("bij,bjk->bik", a, b), torch.einsum("...ij,...jk", a, b), torch.bmm(a, b)


def test_einsum_flops_are_its_matmuls():
    """``aten.einsum`` had a sharding rule and was timed as a matmul, but had no FLOP rule: about one FLOP per output
    element was counted. Its FLOPs are now the batched matmul's it stands for, with or without an ellipsis."""
    gm = autoshard.capture(_Einsum(), (torch.randn(2, 3, 4), torch.randn(2, 4, 5))).gm
    costs = cost.annotate(gm)
    flops = [costs[n].flops for n in gm.graph.nodes if n.op == "call_function"
             and cost.op_name(n.target) in ("einsum", "bmm")]
    assert flops == [2 * 2 * 3 * 4 * 5] * 3, flops


def test_gpt_forward_flops_match_the_textbook_formula():
    captured = _capture_zoo("gpt")
    total = cost.total_flops(cost.annotate(captured.gm))
    # 2 FLOPs per parameter per token (the position table is a lookup, the tied token table is the LM head),
    # plus causal attention: QK^T and PV are 2 * 2 * B * T^2 * d per layer, halved by the mask.
    params = sum(p.numel() for name, p in captured.gm.named_parameters() if "wpe" not in name)
    formula = 2 * params * BATCH * SEQ + 2 * N_LAYER * BATCH * SEQ**2 * HIDDEN
    assert total == pytest.approx(formula, rel=0.02)


def test_stage_cost_counts_parameters_so_the_embedding_is_not_free():
    gm = _capture_zoo("gpt").gm
    costs = cost.annotate(gm)
    lookup = _nodes(gm, "embedding")[0]
    table = lookup.args[0]
    assert costs[lookup].flops == 0
    assert cost.stage_cost([table, lookup], costs) == cost.PARAM_BYTE_COST * 80 * 48 * 4
    nodes = list(gm.graph.nodes)
    halves = cost.stage_cost(nodes[: len(nodes) // 2], costs) + cost.stage_cost(nodes[len(nodes) // 2 :], costs)
    assert cost.stage_cost(nodes, costs) == pytest.approx(halves)


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def test_llama_7b_shape_is_annotated_on_meta_without_allocating():
    before = _peak_rss_bytes()
    model = build_llama_model(
        n_layer=32, n_embd=4096, n_head=32, n_kv_head=32, ffn=11008, vocab=32000, seq=128, device="meta"
    )
    tokens = torch.zeros(1, 128, dtype=torch.long, device="meta")
    captured = autoshard.capture(model, (tokens,), loss_fn=token_loss, example_target=tokens)
    start = time.perf_counter()
    costs = cost.annotate(captured.gm)
    seconds = time.perf_counter() - start
    assert all(p.is_meta for p in captured.gm.parameters())
    assert _peak_rss_bytes() - before < 4 * 2**30, "27 GB of fp32 parameters were never allocated"
    assert seconds < 5

    param_bytes = cost.total_param_bytes(costs)
    assert param_bytes == pytest.approx(6.7e9 * 4, rel=0.01)
    assert param_bytes == 4 * sum(p.numel() for p in model.parameters())
    # Every parameter but the token table (a lookup) does 2 FLOPs per token; causal attention adds
    # 2 * T^2 * d per layer at batch 1.
    tokens_params = param_bytes // 4 - 32000 * 4096
    formula = 2 * tokens_params * 128 + 32 * 2 * 128**2 * 4096
    assert cost.total_flops(costs) == pytest.approx(formula, rel=0.01)
    assert cost.symbolic_flops(captured.gm, 1, 128).subs(S, 128) == cost.total_flops(costs)
    assert "6.74 G" in cost.summary(captured.gm)


def test_symbolic_flops_evaluate_back_and_predict_another_shape():
    gm = _capture_zoo("gpt").gm
    expr = cost.symbolic_flops(gm, BATCH, SEQ)
    assert expr.subs({B: BATCH, S: SEQ}) == cost.total_flops(cost.annotate(gm))
    assert sympy.degree(expr, B) == 1 and sympy.degree(expr, S) == 2, "linear in tokens, quadratic attention"
    other = _capture_zoo("gpt", batch=2, seq=8).gm
    assert expr.subs({B: 2, S: 8}) == cost.total_flops(cost.annotate(other))
    with pytest.raises(ValueError, match="cannot tell them apart"):
        cost.symbolic_flops(gm, 16, 16)


def test_summary_names_parameters_flops_and_largest_activations():
    gm = _capture_zoo("gpt").gm
    text = cost.summary(gm)
    assert "parameters: 49.60 k (193.8 KiB)" in text
    assert "forward: 12.75 MFLOP" in text
    assert "8x16x144" in text and "model.transformer.h.0.attn.c_attn" in text
    assert "split" not in text, "views are not activations of their own"


class _PickedRows(nn.Module):
    """An MLP over the rows a mask picks, as a mixture of experts picks each expert's tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x[x[:, 0] > 0]))).sum(0)


def test_a_size_that_depends_on_the_data_counts_at_its_upper_bound():
    gm = autoshard.capture(_PickedRows(), (torch.randn(6, 16),)).gm
    costs = cost.annotate(gm)  # a pipeline balances with these: a data-dependent size must not crash it
    (up, _) = _nodes(gm, "linear")
    assert costs[up].flops == 2 * 6 * 32 * 16 + 6 * 32, "at most all 6 rows are picked"
