"""Capture: every zoo model as one graph with its loss, on CPU and on the meta device; clear failures."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autoshard
from autoshard import meta

from harness.models import ZOO_NAMES, build


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_capture_with_loss_matches_eager(name):
    case = build(name)
    captured = autoshard.capture(case.model, case.inputs, loss_fn=case.loss_fn, example_target=case.target)
    expected = case.loss_fn(case.model(*case.inputs), case.target)
    torch.testing.assert_close(captured.gm(*case.inputs, case.target), expected, rtol=0, atol=0)
    calls = [n for n in captured.gm.graph.nodes if n.op == "call_function"]
    assert all(meta.VAL in n.meta for n in calls if n.target.__module__ != "_operator")
    assert any(meta.module_path(n) for n in calls), "nodes know the module they came from"


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_capture_on_meta_allocates_nothing(name):
    case = build(name, device="meta")
    captured = autoshard.capture(case.model, case.inputs, loss_fn=case.loss_fn, example_target=case.target)
    assert all(p.is_meta for p in captured.gm.parameters())
    assert captured.num_nodes > 5


def test_parameters_keep_their_names_and_ties():
    case = build("gpt")
    captured = autoshard.capture(case.model, case.inputs, loss_fn=case.loss_fn, example_target=case.target)
    names = [n for names in captured.names.values() for n in names]
    assert set(names) == {n for n, _ in case.model.named_parameters(remove_duplicate=False)}
    tied = [names for names in captured.names.values() if len(names) > 1]
    assert tied == [["transformer.wte.weight", "lm_head.weight"]]


class _ScoredUnderNoGrad(nn.Module):
    """A scorer run under ``torch.no_grad()`` (a sparse-attention indexer's shape): its weights get no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.scorer = nn.Linear(8, 8)
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        with torch.no_grad():
            scores = self.scorer(x).softmax(-1)
        return self.proj(x) * scores


def test_a_no_grad_region_is_inlined_with_its_inputs_detached():
    torch.manual_seed(0)
    model, x, t = _ScoredUnderNoGrad(), torch.randn(3, 8), torch.randn(3, 8)
    loss_fn = nn.functional.mse_loss
    captured = autoshard.capture(model, (x,), loss_fn=loss_fn, example_target=t)
    targets = [getattr(n.target, "__name__", "") for n in captured.gm.graph.nodes]
    assert "wrap_with_set_grad_enabled" not in targets, "the region's ops are in the graph itself"
    captured.gm(x, t).backward()
    loss_fn(model(x), t).backward()
    got = dict(captured.gm.named_parameters())
    for name, p in model.named_parameters():
        mine = got["model." + name]
        if name.startswith("scorer"):
            assert p.grad is None and mine.grad is None, name
        else:
            torch.testing.assert_close(mine.grad, p.grad, rtol=0, atol=0)
    from autoshard.passes.propagate import requires_grad

    grad = requires_grad(captured.gm)
    scored = [n for n in captured.gm.graph.nodes if n.target is torch.ops.aten.softmax.int]
    assert scored and not any(n in grad for n in scored), "no gradient flows through the region"


def test_huggingface_cache_is_turned_off_only_during_capture():
    case = build("hf_gpt2")
    assert case.model.config.use_cache
    captured = autoshard.capture(case.model, case.inputs)
    assert case.model.config.use_cache, "the user's config is restored"
    torch.testing.assert_close(captured.gm(*case.inputs).logits, case.model(*case.inputs).logits, rtol=0, atol=0)


class _BranchesOnValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        y = self.proj(x)
        if y.sum() > 0:  # a Python branch on a tensor's value: not capturable
            y = y * 2
        return y


def test_capture_failure_names_the_models_source_line():
    with pytest.raises(autoshard.CaptureError) as info:
        autoshard.capture(_BranchesOnValues(), (torch.randn(2, 4),))
    message = str(info.value)
    assert "_BranchesOnValues" in message
    assert f"{__file__}:" in message and "if y.sum() > 0:" in message
    assert "torch.where" in message  # the fix


def test_capture_rejects_a_loss_without_target():
    case = build("mlp")
    with pytest.raises(ValueError, match="needs an example target"):
        autoshard.capture(case.model, case.inputs, loss_fn=case.loss_fn)


class _MaskedAttention(nn.Module):
    """Attention under a mask built in the graph: ``kind`` "causal" (the triangle, boolean or additive with the
    dtype's lowest value), "window" (causal within 4 tokens), "padding" (read from an input) or "prefix" (the
    triangle, then its first 3 keys opened to every query by an in-place write: a prefix LM)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.proj = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        q, k, v = self.proj(x).view(x.shape[0], x.shape[1], 3, 2, 4).permute(2, 0, 3, 1, 4)
        t = x.shape[1]
        pos = torch.arange(t, device=x.device)
        mask = pos[None, :] <= pos[:, None]
        if self.kind == "window":
            mask = mask & (pos[:, None] - pos[None, :] < 4)
        elif self.kind == "padding":
            mask = mask & keep[:, None, None, :].bool()
        elif self.kind == "additive":
            mask = torch.zeros(t, t).masked_fill(~mask, torch.finfo(torch.float32).min)
        elif self.kind == "prefix":
            mask[:, :3] = True  # the triangle alone is what its op computes; the write makes it another mask
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(x.shape[0], t, 8)


@pytest.mark.parametrize("kind,causal", [("causal", True), ("additive", True), ("window", False),
                                         ("padding", False), ("prefix", False)])
def test_a_constant_causal_mask_becomes_is_causal_and_any_other_mask_stays(kind, causal):
    """Traced, a model builds the causal mask its eager run never makes; attention kernels then convert and save it
    per layer (L x S floats each). A mask that reads no input value and is the triangle becomes ``is_causal``;
    a sliding window or a padding mask stays as it is. Outputs and gradients equal the model run whole."""
    from autoshard.capture import capture

    torch.manual_seed(0)
    model = _MaskedAttention(kind)
    x, keep = torch.randn(2, 12, 8), torch.ones(2, 12)
    keep[1, 9:] = 0
    captured = capture(model, (x, keep))
    attention = [n for n in captured.gm.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert len(attention) == 1
    node = attention[0]
    assert (node.kwargs.get("is_causal", False) and len(node.args) == 3) == causal, (node.args, node.kwargs)
    expected = model(x, keep)
    expected.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    got = captured.gm(x, keep)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    got.sum().backward()
    for g, p in zip(grads, captured.gm.parameters(), strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)


def test_hf_llama_attention_takes_no_mask_once_captured():
    case = build("hf_llama")
    captured = autoshard.capture(case.model, case.inputs)
    attention = [n for n in captured.gm.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert attention and all(n.kwargs.get("is_causal") and len(n.args) == 3 for n in attention)


def _ops(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("name", ["hf_llama", "moe", "bert"])
def test_one_export_gives_the_training_and_the_inference_graph_each_as_its_own_export_would(name):
    case = build(name)
    both = autoshard.capture(case.model, case.inputs, loss_fn=case.loss_fn, example_target=case.target, outputs=True)
    alone = autoshard.capture(case.model, case.inputs, loss_fn=case.loss_fn, example_target=case.target)
    plain = autoshard.capture(case.model, case.inputs)
    assert both.inference is not None and not both.inference.with_loss
    assert _ops(both.gm) == _ops(alone.gm) and _ops(both.inference.gm) == _ops(plain.gm)
    assert both.inference.gm._out_spec == plain.gm._out_spec
    assert both.inference.input_shapes == plain.input_shapes
    torch.testing.assert_close(both.gm(*case.inputs, case.target), alone.gm(*case.inputs, case.target), rtol=0, atol=0)
    got, expected = both.inference.gm(*case.inputs), plain.gm(*case.inputs)  # no key-value cache in either
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_loss_that_writes_into_the_outputs_leaves_the_inference_graphs_outputs_as_the_model_returns_them():
    def loss_fn(out, target):
        out.mul_(3)  # in place, into what the model returned
        return (out - target).pow(2).mean()

    model, x, t = nn.Linear(4, 4), torch.randn(2, 4), torch.randn(2, 4)
    both = autoshard.capture(model, (x,), loss_fn=loss_fn, example_target=t, outputs=True)
    with torch.no_grad():
        torch.testing.assert_close(both.inference.gm(x), model(x), rtol=0, atol=0)
        torch.testing.assert_close(both.gm(x, t), loss_fn(model(x), t), rtol=0, atol=0)


def test_training_then_inference_at_the_same_shapes_traces_the_model_once(monkeypatch):
    exports = []
    export = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: exports.append(1) or export(*a, **k))
    case = build("hf_gpt2")
    pm = autoshard.parallelize(case.model, autoshard.Mesh(), example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target)
    pm.step(*case.inputs, target=case.target)
    with torch.no_grad():
        pm(*case.inputs)
    assert len(exports) == 1
    pm(case.inputs[0][:2])  # another batch shape: traced for inference alone
    assert len(exports) == 2
