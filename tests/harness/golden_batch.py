"""Goldens for losses that couple the samples of a batch (``passes.batch_split``, ``passes.batch_gather``): models
and losses of their own, off the zoo's path, compared with the unsharded model on the worker pools."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import autoshard

from harness.golden import groups_for


class TwoTower(nn.Module):
    """An image tower with a conv stem and a text tower with a masked mean pooling, both normalised (CLIP-like)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 4, stride=4)
        self.image = nn.Linear(8 * 4, 12)
        self.embedding = nn.Embedding(50, 16)
        self.text = nn.Linear(16, 12)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, images, tokens, mask):
        x = F.gelu(self.conv(images)).flatten(1)
        image = F.normalize(self.image(x), dim=-1)
        h = self.embedding(tokens)
        m = mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * m).sum(1) / m.sum(1).clamp(min=1)  # (B, 16): the mean over each row's unmasked tokens
        return image, F.normalize(self.text(pooled), dim=-1), self.logit_scale.exp()


def clip_loss(output, target):
    image, text, scale = output
    logits = scale * image @ text.T  # (B, B)
    labels = torch.arange(logits.shape[0], device=logits.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def clip_scaled_last(output, target):
    """CLIP's loss with the learnt temperature applied to the similarities (open_clip's order): the term reads it
    whole, beside the split embeddings."""
    image, text, scale = output
    logits = (image @ text.T) * scale
    labels = torch.arange(logits.shape[0], device=logits.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def in_batch_negatives(output, target):
    image, text, scale = output
    scores = scale * image @ text.T  # every other row of the batch a negative
    return (torch.logsumexp(scores, dim=1) - scores.diagonal()).mean()


def per_sample_cosine(output, target):
    image, text, scale = output
    return (1 - scale * (image * text).sum(-1)).mean()  # each sample against its own pair: a mean over samples


def two_tower_batch(batch: int = 8):
    gen = torch.Generator().manual_seed(0)
    mask = torch.ones(batch, 7, dtype=torch.long)
    mask[::2, 5:] = 0
    return (torch.randn(batch, 3, 8, 8, generator=gen), torch.randint(0, 50, (batch, 7), generator=gen), mask), \
        torch.zeros(batch)


def preference_loss(output, target):
    """DPO's loss over a batch laid out as TRL's concatenated forward lays it out: chosen rows, then rejected."""
    logits = output.logits if hasattr(output, "logits") else output
    logits = logits.view(*target.shape, -1)  # (B, T, V) where a model returns its rows flattened
    logp = torch.gather(logits[:, :-1].log_softmax(-1), 2, target[:, 1:].unsqueeze(-1)).squeeze(-1).sum(-1)
    n = logp.shape[0] // 2
    return -F.logsigmoid(0.1 * (logp[:n] - logp[n:])).mean()


def summed_cosine(output, target):
    image, text, scale = output
    return (1 - scale * (image * text).sum(-1)).sum()  # a sum over samples: the parts' losses add up to it


def summed_mse(output, target):
    image, text, scale = output
    return F.mse_loss(scale * image, text, reduction="sum")


def mean_by_hand(output, target):
    image, text, scale = output
    per_row = 1 - scale * (image * text).sum(-1)
    return per_row.sum() / per_row.shape[0]  # a sum divided by the batch's size: a mean


LOSSES = {"clip": clip_loss, "clip_scaled_last": clip_scaled_last, "in_batch_negatives": in_batch_negatives,
          "per_sample": per_sample_cosine, "sum": summed_cosine, "mse_sum": summed_mse, "mean_by_hand": mean_by_hand}


def coupled_golden(loss: str, mesh_kwargs: dict, *, steps: int = 3, microbatches: int = 1, **options) -> dict:
    """``autoshard.verify`` of the two-tower model under ``loss``: losses, every gradient, parameters after steps."""
    inputs, target = two_tower_batch()
    mesh = autoshard.Mesh(**mesh_kwargs)
    torch.manual_seed(0)
    report = autoshard.verify(TwoTower(), mesh, inputs, LOSSES[loss], target=target, steps=steps,
                              microbatches=microbatches, groups=groups_for(mesh), **options)
    return {"ok": report.ok, "report": str(report), "compared": len(report.differences), "counts": report.counts(),
            "parameters": len(list(TwoTower().named_parameters())), "steps": steps, "share": report.share}


def preference_golden(mesh_kwargs: dict, *, steps: int = 3, name: str = "hf_llama", **options) -> dict:
    """``autoshard.verify`` of a zoo model (the HF Llama) under DPO's loss over a concatenated chosen/rejected
    batch."""
    from harness.models import build

    case = build(name)
    mesh = autoshard.Mesh(**mesh_kwargs)
    report = autoshard.verify(case.model, mesh, case.inputs, preference_loss, target=case.inputs[0], steps=steps,
                              groups=groups_for(mesh), **options)
    return {"ok": report.ok, "report": str(report), "compared": len(report.differences), "counts": report.counts(),
            "parameters": len(list(case.model.named_parameters())), "steps": steps, "share": report.share}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b|: a gradient's error on the scale of the gradient."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def coupled_bf16(loss: str, mesh_kwargs: dict, **options) -> dict:
    """One step of the two-tower model under ``mixed_precision="bf16"`` against eager bf16 autocast: the loss and
    each gradient's worst element relative to its largest (and the same against float32, to show autocast was on)."""
    inputs, target = two_tower_batch()
    mesh = autoshard.Mesh(**mesh_kwargs)
    torch.manual_seed(0)
    pm = autoshard.parallelize(TwoTower(), mesh, example_inputs=inputs, loss_fn=LOSSES[loss], target=target,
                               groups=groups_for(mesh), mixed_precision="bf16", **options)
    value = pm.step(*inputs, target=target).item()
    grads = pm.gradients()
    errors = {}
    for dtype in (torch.bfloat16, None):
        torch.manual_seed(0)
        eager = TwoTower()
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            expected = LOSSES[loss](eager(*inputs), target)
        expected.backward()
        errors[str(dtype)] = (abs(value - expected.item()),
                              {n: _relative(grads[n], p.grad) for n, p in eager.named_parameters()})
    return {"amp": errors["torch.bfloat16"], "fp32": errors["None"]}


def coupled_loop(loss: str, mesh_kwargs: dict, *, steps: int = 2, calls: int = 2, **options) -> dict:
    """An ordinary training loop over the two-tower model: AdamW with groups from ``named_parameters()`` (no decay on
    biases and the temperature), ``calls`` ``step()`` calls on other batches accumulated into each optimizer step
    (``loss_scale=1/calls``, as each accumulated call's loss is a mean), beside the same loop unsharded. The losses'
    and the parameters' worst differences."""
    mesh = autoshard.Mesh(**mesh_kwargs)
    torch.manual_seed(0)
    model = TwoTower()
    torch.manual_seed(0)
    reference = TwoTower()
    batches = [two_tower_batch() for _ in range(calls)]
    gen = torch.Generator().manual_seed(1)
    batches = [((images + i * torch.randn(images.shape, generator=gen), tokens, mask), target)
               for i, ((images, tokens, mask), target) in enumerate(batches)]

    def groups(m):
        named = list(m.named_parameters())
        return [{"params": [p for n, p in named if p.dim() > 1], "weight_decay": 0.1},
                {"params": [p for n, p in named if p.dim() <= 1], "weight_decay": 0.0}]

    pm = autoshard.parallelize(model, mesh, example_inputs=batches[0][0], loss_fn=LOSSES[loss], target=batches[0][1],
                               groups=groups_for(mesh), **options)
    opt = torch.optim.AdamW(groups(pm), lr=1e-2)  # the same groups, from the names the model gives
    ref_opt = torch.optim.AdamW(groups(reference), lr=1e-2)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        for inputs, target in batches:
            got = pm.step(*inputs, target=target, loss_scale=1 / calls)
            expected = LOSSES[loss](reference(*inputs), target) / calls
            expected.backward()
            losses.append(abs(got.item() - expected.item()))
        opt.step()
        ref_opt.step()
    full = pm.full_parameters()
    return {"loss": max(losses), "param": max((full[n] - p.detach()).abs().max().item()
                                               for n, p in reference.named_parameters())}
