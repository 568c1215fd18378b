"""Checks of the model zoo itself: each entry trains eagerly, builds reproducibly, builds on meta and exports."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness.models import DECODERS, IGNORE_INDEX, ZOO_NAMES, ZooCase, build, build_gpt_model, build_llama_model


class LossWrapper(nn.Module):
    """forward(*inputs, target) -> loss: the shape of program a training capture sees."""

    def __init__(self, model: nn.Module, loss_fn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *inputs_and_target: torch.Tensor) -> torch.Tensor:
        *inputs, target = inputs_and_target
        return self.loss_fn(self.model(*inputs), target)


def _params(case: ZooCase) -> dict[str, torch.Tensor]:
    # remove_duplicate=False: a tied weight shows under both of its names.
    return dict(case.model.named_parameters(remove_duplicate=False))


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_forward_backward(name: str) -> None:
    case = build(name)
    loss = case.loss_fn(case.model(*case.inputs), case.target)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    no_grad = [n for n, p in case.model.named_parameters() if p.grad is None]
    assert not no_grad, f"parameters without gradient: {no_grad}"
    for n, p in case.model.named_parameters():
        assert torch.isfinite(p.grad).all(), n
        assert p.grad.abs().sum() > 0, f"{n} has an all-zero gradient"


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_build_is_reproducible(name: str) -> None:
    a, b = build(name), build(name)
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys()
    for n in pa:
        assert torch.equal(pa[n], pb[n]), n
    for x, y in zip(a.inputs, b.inputs, strict=False):
        assert torch.equal(x, y)
    assert torch.equal(a.target, b.target)
    other = build(name, seed=1)
    assert any(not torch.equal(pa[n], p) for n, p in _params(other).items())


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_meta_build(name: str) -> None:
    case = build(name, device="meta")
    assert all(p.device.type == "meta" for p in case.model.parameters())
    assert all(b.device.type == "meta" for b in case.model.buffers())
    assert all(t.device.type == "meta" for t in case.inputs) and case.target.device.type == "meta"
    cpu = build(name)
    assert {n: p.shape for n, p in _params(case).items()} == {n: p.shape for n, p in _params(cpu).items()}


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_export_with_loss(name: str) -> None:
    case = build(name)
    if name.startswith("hf_"):
        case.model.config.use_cache = False  # export rejects the returned cache object
    wrapper = LossWrapper(case.model, case.loss_fn)
    ep = torch.export.export(wrapper, (*case.inputs, case.target), strict=False)
    got = ep.module()(*case.inputs, case.target)
    torch.testing.assert_close(got, wrapper(*case.inputs, case.target), rtol=0, atol=0)


def test_sizes_are_distinct_and_targets_uneven() -> None:
    case = build("llama")
    cfg = case.model.cfg
    batch, seq = case.inputs[0].shape
    sizes = [batch, seq, cfg.n_head, cfg.n_embd // cfg.n_head, cfg.n_embd, cfg.vocab, cfg.ffn]
    assert len(set(sizes)) == len(sizes), sizes
    counted = (case.target != IGNORE_INDEX).sum(dim=1)
    assert counted.unique().numel() >= 3, counted  # rows differ in their token counts
    assert set(DECODERS) <= set(ZOO_NAMES)


def test_tied_gpt_weight() -> None:
    model = build("gpt").model
    assert model.lm_head.weight is model.transformer.wte.weight
    hf = build("hf_gpt2").model
    assert hf.lm_head.weight is hf.transformer.wte.weight


def test_large_shapes_on_meta() -> None:
    llama = build_llama_model(
        n_layer=32, n_embd=4096, n_head=32, n_kv_head=32, vocab=32000, seq=4096, ffn=11008, device="meta"
    )
    n = sum(p.numel() for p in llama.parameters())
    assert 6.5e9 < n < 7e9 and all(p.is_meta for p in llama.parameters())
    gpt = build_gpt_model(n_layer=4, n_embd=256, n_head=8, vocab=512, seq=128, device="meta")
    assert all(p.is_meta for p in gpt.parameters())
