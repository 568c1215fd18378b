"""A backward split into input gradients (I) and weight gradients (W) equals one backward, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint

from autoshard.runtime.split_backward import input_gradients


class Block(torch.nn.Module):
    """A linear, a norm and a GELU; then the second linear's weight read again (transposed), a bias computed from
    a weight alone (its gradient never meets the input path), and a weight the graph does not read."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.norm, self.lin2 = torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 8)
        self.extra = torch.nn.Parameter(torch.randn(8))
        self.unused = torch.nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.lin2(torch.nn.functional.gelu(self.norm(self.lin1(x))))
        h = h + (self.extra * 2).tanh()
        h = torch.nn.functional.linear(h, self.lin2.weight.t())
        return h, h.sum(-1)


def _run(split: bool, checkpointed: bool = False, input_grad: bool = True):
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1)).requires_grad_(input_grad)
    out, aux = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if checkpointed else block(x)
    grads = [torch.full_like(out, 0.5), torch.ones_like(aux)]
    fired = []
    for p in block.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    if not split:
        torch.autograd.backward([out, aux], grads)
        return x.grad, {n: p.grad for n, p in block.named_parameters()}, len(fired)
    (dx,), weights = input_gradients([out, aux], grads, [x])
    assert all(p.grad is None for p in block.parameters()), "I leaves the parameters' gradients alone"
    assert not fired
    weights.run()
    return dx, {n: p.grad for n, p in block.named_parameters()}, len(fired)


def _same(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "activation-checkpointed"])
@pytest.mark.parametrize("input_grad", [True, False], ids=["middle-stage", "first-stage"])
def test_input_then_weight_gradients_equal_one_backward(checkpointed, input_grad):
    """On a first stage (inputs without gradients) every weight's gradient starts from the outputs in W."""
    whole = _run(False, checkpointed, input_grad)
    parts = _run(True, checkpointed, input_grad)
    assert _same(whole[0], parts[0])
    assert all(_same(whole[1][n], parts[1][n]) for n in whole[1])
    assert whole[1]["unused"] is None, "the unread weight has no gradient either way"
    assert parts[2] == whole[2] == 7, "every read weight's post-accumulate hook fires once, in W"


def test_an_output_that_is_a_weight_itself_gets_its_gradient_in_w():
    """A stage may hand on a weight as it is (FalconMamba's ``D.float()`` of a float ``D`` is ``D``): the output
    has no autograd node, and its gradient is the weight's, accumulated in W."""
    weight = torch.nn.Parameter(torch.randn(4))
    x = torch.randn(4, requires_grad=True)
    out = x * 2
    (dx,), weights = input_gradients([out, weight.float()], [torch.ones(4), torch.full((4,), 3.0)], [x])
    assert torch.equal(dx, torch.full((4,), 2.0)) and weight.grad is None
    weights.run()
    assert torch.equal(weight.grad, torch.full((4,), 3.0))
