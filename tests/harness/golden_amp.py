"""Golden checks of mixed precision and of the vocab-parallel rewrites, run on every rank of a worker pool.

``bf16_against_eager_autocast``: one training step under ``mixed_precision="bf16"`` against the unsharded
model under eager ``torch.autocast("cpu", dtype=torch.bfloat16)`` (the same dtype policy), and against the
unsharded model in float32 (to show that autocast was on). ``padding_embedding``: a token embedding with
a ``padding_idx`` (HF models built with a ``pad_token_id``) trained for three steps. Return plain data; the
tests assert.
"""

from __future__ import annotations

import contextlib

import torch

import autoshard
from autoshard.passes import collectives

from harness.golden import groups_for
from harness.models import build


@contextlib.contextmanager
def _loss_dtypes():
    """Record (logits dtype, loss dtype) of every vocab-parallel loss computed inside: ``step()`` returns a
    float32 sum whatever the program's loss was, and bf16 logits show that autocast was on."""
    seen: list[tuple[str, str]] = []
    original = collectives.VocabParallelCrossEntropy.forward

    def spy(self, logits, target):
        out = original(self, logits, target)
        seen.append((str(logits.dtype), str(out.dtype)))
        return out

    collectives.VocabParallelCrossEntropy.forward = spy
    try:
        yield seen
    finally:
        collectives.VocabParallelCrossEntropy.forward = original


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b|: a gradient's error on the scale of the gradient."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def bf16_against_eager_autocast(name: str, mesh_kwargs: dict, **options) -> dict:
    case = build(name)
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, groups=groups_for(mesh), mixed_precision="bf16", **options)
    with _loss_dtypes() as dtypes:
        loss = pm.step(*case.inputs, target=case.target)
    grads = pm.gradients()

    amp = build(name).model
    with torch.autocast("cpu", dtype=torch.bfloat16):
        amp_loss = case.loss_fn(amp(*case.inputs), case.target)
    amp_loss.backward()
    fp32 = build(name).model
    fp32_loss = case.loss_fn(fp32(*case.inputs), case.target)
    fp32_loss.backward()

    amp_grads = dict(amp.named_parameters(remove_duplicate=False))
    fp32_grads = dict(fp32.named_parameters(remove_duplicate=False))
    return {
        "loss": loss.item(),
        "amp_loss": amp_loss.item(),
        "fp32_loss": fp32_loss.item(),
        "amp_loss_dtype": str(amp_loss.dtype),
        "loss_dtypes": dtypes,
        "grad_error": {n: _relative(grads[n], p.grad) for n, p in amp_grads.items()},
        "fp32_grad_error": {n: _relative(grads[n], p.grad) for n, p in fp32_grads.items()},
        "sharded": sorted(m.__name__ for m in _modules(pm)),
    }


def _modules(pm) -> list[type]:
    """The collectives of this rank's training program (what the mesh actually sharded)."""
    code = pm.code()
    return [m for m in (collectives.VocabParallelEmbedding, collectives.VocabParallelCrossEntropy,
                        collectives.ReduceFromParallel) if m.__name__.lower() in code.lower()]


def _with_padding(name: str):
    """The zoo model with its token embedding's ``padding_idx`` set to a token the batch holds."""
    case = build(name)
    embedding = case.model.get_input_embeddings() if name.startswith("hf_") else case.model.transformer.wte
    embedding.padding_idx = int(case.inputs[0][0, 0])  # the padding row gets no gradient from the lookup
    return case


def padding_embedding(name: str, mesh_kwargs: dict) -> dict:
    case = _with_padding(name)
    mesh = autoshard.Mesh(**mesh_kwargs)
    report = autoshard.verify(case.model, mesh, case.inputs, case.loss_fn, target=case.target, groups=groups_for(mesh))
    fresh = _with_padding(name)
    pm = autoshard.parallelize(fresh.model, mesh, example_inputs=fresh.inputs, loss_fn=fresh.loss_fn,
                               target=fresh.target, groups=groups_for(mesh))
    return {"ok": report.ok, "report": str(report), "compared": len(report.differences),
            "sharded": sorted(m.__name__ for m in _modules(pm))}


def resnet_bf16(mesh_kwargs: dict) -> dict:
    """A ResNet (its BatchNorm in training) in bf16: every activation a pipeline cut carries is bf16 under
    autocast (a conv's output), where the capture, made without autocast, records float32."""
    import torch.nn.functional as F

    from harness.golden import SmallResNet

    g = torch.Generator().manual_seed(5)
    pixels, target = torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 5, (8,), generator=g)
    mesh = autoshard.Mesh(**mesh_kwargs)
    torch.manual_seed(0)
    model, amp = SmallResNet(), SmallResNet()
    amp.load_state_dict(model.state_dict())
    pm = autoshard.parallelize(model, mesh, example_inputs=(pixels,), loss_fn=F.cross_entropy, target=target,
                               groups=groups_for(mesh), mixed_precision="bf16")
    loss = pm.step(pixels, target=target)
    grads = pm.gradients()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        amp_loss = F.cross_entropy(amp(pixels), target)
    amp_loss.backward()
    return {"loss": loss.item(), "amp_loss": amp_loss.item(),
            "grad_error": {n: _relative(grads[n], p.grad) for n, p in amp.named_parameters()}}
