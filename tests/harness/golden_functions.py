"""Models whose training runs custom autograd Functions (``autoshard.functions``): a straight-through estimator, a
gradient reversal with a non-tensor argument, a parallel scan that writes in place, a vocab-parallel cross-entropy
written with ``out=`` ops, and a CTC loss; goldens against the unsharded model on the worker pools."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import autoshard

from harness.golden import groups_for

CALLS = {"ste": 0}


class STE(torch.autograd.Function):
    """Quantization-aware training's straight-through estimator: ``round`` forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        CALLS["ste"] += 1
        return grad


class ScaleGrad(torch.autograd.Function):
    """A gradient reversal (DANN): identity forward, the gradient times ``-alpha`` (a float argument)."""

    @staticmethod
    def forward(ctx, x, alpha: float):
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.alpha * grad, None


class Scan(torch.autograd.Function):
    """``h[t] = a[t] * h[t-1] + x[t]`` along dim 1, written in place on its own buffer (as mambapy's parallel scan)."""

    @staticmethod
    def forward(ctx, a, x):
        h = x.clone()
        for t in range(1, h.shape[1]):
            h[:, t].add_(a[:, t] * h[:, t - 1])
        ctx.save_for_backward(a, h)
        return h

    @staticmethod
    def backward(ctx, grad):
        a, h = ctx.saved_tensors
        g = grad.clone()
        for t in range(g.shape[1] - 1, 0, -1):
            g[:, t - 1].add_(a[:, t] * g[:, t])
        ga = torch.zeros_like(a)
        ga[:, 1:] = g[:, 1:] * h[:, :-1]
        return ga, g


class VocabCrossEntropy(torch.autograd.Function):
    """Megatron's vocab-parallel cross-entropy at one rank: per token, with ``out=`` and in-place ops."""

    @staticmethod
    def forward(ctx, logits, target):
        logits = logits - logits.amax(-1, keepdim=True)
        exp = torch.empty_like(logits)
        torch.exp(logits, out=exp)
        total = exp.sum(-1)
        loss = torch.log(total) - logits.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        exp.div_(total.unsqueeze(-1))
        ctx.save_for_backward(exp, target)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, target = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, target.unsqueeze(-1), -torch.ones_like(target, dtype=g.dtype).unsqueeze(-1))
        return g * grad.unsqueeze(-1), None


class FunctionsLM(nn.Module):
    """A small causal LM whose blocks run the Functions: attention, a scan gated per token, an MLP quantized by the
    straight-through estimator; the embedding's gradient reversed and scaled."""

    def __init__(self, vocab: int = 48, dim: int = 16, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embedding = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.ModuleDict({
            "norm": nn.LayerNorm(dim), "qkv": nn.Linear(dim, 3 * dim), "proj": nn.Linear(dim, dim),
            "gate": nn.Linear(dim, dim), "inp": nn.Linear(dim, dim),
            "fc1": nn.Linear(dim, 4 * dim), "fc2": nn.Linear(4 * dim, dim)}) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        x = ScaleGrad.apply(self.embedding(ids), 0.5)
        b, s, d = x.shape
        for block in self.blocks:
            h = block["norm"](x)
            q, k, v = block["qkv"](h).view(b, s, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + block["proj"](attn.transpose(1, 2).reshape(b, s, d))
            x = x + Scan.apply(torch.sigmoid(block["gate"](x)), block["inp"](x))
            x = x + block["fc2"](STE.apply(F.gelu(block["fc1"](x))))
        return self.head(self.norm(x))


def vocab_cross_entropy(logits, target):
    return VocabCrossEntropy.apply(logits, target).mean()


class CTCModel(nn.Module):
    """Frames to per-frame log-probabilities over the labels (blank 0), as wav2vec2's head."""

    def __init__(self, features: int = 12, dim: int = 16, labels: int = 7) -> None:
        super().__init__()
        self.encoder = nn.Linear(features, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, labels)

    def forward(self, frames):
        h = F.gelu(self.encoder(frames))
        return self.head(h + self.mlp(h)).log_softmax(-1)


def ctc_loss(log_probs, labels):
    """wav2vec2's loss: padded labels (0 past each row's end), every frame an input."""
    lengths = (labels > 0).sum(-1)
    frames = torch.full((log_probs.shape[0],), log_probs.shape[1], dtype=torch.long, device=log_probs.device)
    return F.ctc_loss(log_probs.transpose(0, 1), labels, frames, lengths, blank=0, zero_infinity=True)


def lm_batch(batch: int = 4, seq: int = 8, vocab: int = 48):
    gen = torch.Generator().manual_seed(0)
    return (torch.randint(0, vocab, (batch, seq), generator=gen),), torch.randint(0, vocab, (batch, seq),
                                                                                  generator=gen)


def ctc_batch(batch: int = 4, frames: int = 12, features: int = 12, labels: int = 7):
    gen = torch.Generator().manual_seed(0)
    target = torch.randint(1, labels, (batch, 5), generator=gen)
    target[1, 3:] = 0
    target[2, 4:] = 0
    return (torch.randn(batch, frames, features, generator=gen),), target


def wav2vec2():
    """transformers' ``Wav2Vec2ForCTC`` at a tiny size (its conv feature encoder, a transformer layer, the CTC head),
    random draws off (dropout, LayerDrop, time masking) so that runs compare."""
    import transformers

    config = transformers.Wav2Vec2Config(
        vocab_size=12, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2, feat_extract_norm="group", pad_token_id=0, layerdrop=0.0, hidden_dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0, mask_time_prob=0.0)
    return transformers.Wav2Vec2ForCTC(config)


def wav2vec2_batch(batch: int = 4):
    gen = torch.Generator().manual_seed(0)
    labels = torch.randint(1, 12, (batch, 5), generator=gen)
    labels[1, 3:] = 0
    return (torch.randn(batch, 400, generator=gen),), labels


def wav2vec2_ctc_loss(output, labels):
    return ctc_loss(output.logits.log_softmax(-1), labels)


MODELS = {"lm": (FunctionsLM, lm_batch, vocab_cross_entropy), "ctc": (CTCModel, ctc_batch, ctc_loss),
          "wav2vec2": (wav2vec2, wav2vec2_batch, wav2vec2_ctc_loss)}


def functions_golden(name: str, mesh_kwargs: dict, *, steps: int = 2, **options) -> dict:
    """``autoshard.verify`` of a model that trains through Functions: losses, every gradient, parameters after
    steps; and how many times the straight-through estimator's backward ran on this rank."""
    build, batch, loss_fn = MODELS[name]
    inputs, target = batch()
    mesh = autoshard.Mesh(**mesh_kwargs)
    torch.manual_seed(0)
    CALLS["ste"] = 0
    report = autoshard.verify(build(), mesh, inputs, loss_fn, target=target, steps=steps, groups=groups_for(mesh),
                              **options)
    return {"ok": report.ok, "report": str(report), "compared": len(report.differences), "counts": report.counts(),
            "parameters": len(list(build().named_parameters())), "steps": steps, "share": report.share,
            "ste": CALLS["ste"]}
