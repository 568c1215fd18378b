"""Inference on a parallel model: the model's outputs for a batch, on every rank.

Under data parallelism with a global batch, each dp rank computes its own slice of the batch and the
outputs are all-gathered over dp, when every output carries the batch along dim 0 (found by propagating
the batch dim through the inference graph: ``RankBuild.batched_outputs``); otherwise, for example for an
output reduced over the batch, every dp rank computes the whole batch. Under pipeline parallelism the
stages run in order and the last one's outputs are broadcast to every pp rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from autoshard import batching


def forward(pm, inputs: tuple):
    """``pm(*inputs)``: what the model returns (the same output type), on every rank.

    Inference: it runs without autograd, and where gradients are on, a ``backward()`` from its outputs raises,
    saying that ``pm.step`` trains (under dp, pp and cp the outputs come from programs apart from training's, and
    no gradient would reach the parameters right)."""
    if not torch.is_grad_enabled():
        return _forward(pm, inputs)
    with torch.no_grad():
        output = _forward(pm, inputs)
    anchor = torch.zeros((), requires_grad=True, device=pm.device)
    return pytree.tree_map_only(torch.Tensor, lambda t: _Inference.apply(t, anchor) if t.is_floating_point() else t,
                                output)


class _Inference(torch.autograd.Function):
    """An output of ``pm(...)``: its backward says how to train."""

    @staticmethod
    def forward(ctx, output, anchor):
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(
            "backward() from the outputs of pm(...): that call is inference, and its outputs carry no gradient to "
            "this rank's parameters. Train with loss = pm.step(*inputs, target=target), which runs the forward and "
            "the backward at once (the loss_fn given to autoshard.parallelize), leaving the gradients in "
            "pm.parameters() as loss.backward() would; then optimizer.step()")


def _forward(pm, inputs: tuple):
    batch, dp = batching.batch_size(inputs), pm.mesh.dp
    if dp > 1 and not pm.options.local_batch and batch is not None and batch % dp == 0:
        local = batching.split(inputs, dp)[pm.coord("dp")]
        build = pm.inference_build(local)
        build.check_data(inputs)
        if build.batched_outputs is not None:
            flat = run(pm, build, local)
            flat = [_gather_batch(pm, t) if split else t for t, split in zip(flat, build.batched_outputs, strict=True)]
            return pytree.tree_unflatten(flat, build.captured.gm._out_spec)
    build = pm.inference_build(inputs)
    build.check_data(inputs)
    return pytree.tree_unflatten(run(pm, build, inputs), build.captured.gm._out_spec)


def run(pm, build, inputs: tuple) -> list:
    """This rank's flat outputs for ``inputs``."""
    if pm.pipeline is None:
        args = pytree.tree_leaves(build.local_inputs(inputs))
        if pm.sync.sharded:  # through FSDP2's module, which gathers the parameters
            return list(pm.sync.module()(build.program.gm, *args))
        return list(build.program.gm(*args))
    if not pm.sync.sharded:
        with pm.pipeline.spread.whole(pm.store):
            return pm.pipeline.forward_only(build, inputs, device=pm.device)
    pm.replica.unshard()  # FSDP2: this rank's stages read their whole (tp-local) parameters
    try:
        for program in build.programs.values():
            pm.store.adopt(program.gm)
        return pm.pipeline.forward_only(build, inputs, device=pm.device)
    finally:
        pm.replica.reshard()


def _gather_batch(pm, local: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(local) for _ in range(pm.mesh.dp)]
    dist.all_gather(parts, local.contiguous(), group=pm.groups.group("dp"))
    return torch.cat(parts, dim=0)
