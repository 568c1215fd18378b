"""Grouped-query attention written the ways codebases outside transformers write it, and its golden check.

Each attention below computes "query head ``h`` reads kv head ``h // group``" (``group`` = heads / kv heads) in
the way one codebase writes it, except ``tiled``, which reads kv head ``h % kv heads``:

- ``titan`` (torchtitan's Llama 3): heads at dim 2, complex rotary embeddings, ``repeat_kv`` as
  ``unsqueeze(3).expand(...).reshape(...)``, then ``F.scaled_dot_product_attention(..., is_causal=True)``;
- ``mistral`` (mistral-inference's reference): heads at dim 2, ``repeat_interleave(group, dim=2)``, attention
  written out (``matmul``, an additive causal mask, ``softmax`` in fp32, ``matmul``);
- ``gptfast`` (gpt-fast before ``enable_gqa``): rotary embeddings on (real, imaginary) pairs,
  ``repeat_interleave(group, dim=1)`` after the transpose, a boolean causal mask from a buffer;
- ``sdpa_gqa`` (current PyTorch): no repeat, ``F.scaled_dot_product_attention(q, k, v, enable_gqa=True)``;
- ``repeat`` : ``k[:, :, None].repeat(1, 1, group, 1, 1).flatten(1, 2)``: ``repeat`` giving the same mapping;
- ``fused`` (OLMo's ``att_proj``): q, k and v from one linear with a bias, cut apart by ``split``, then
  ``enable_gqa=True``: where tp does not divide the kv heads, the k and v blocks are held whole;
- ``tiled``: ``k.repeat(1, group, 1, 1)``, the heads tiled: query head ``h`` reads kv head ``h % kv heads``, another
  mapping, which must never be split as if it were the first.

Sizes are pairwise distinct (batch 3, sequence 12, heads 8, head dim 6, hidden 48, ffn 56, vocab 72); kv heads 2
or 4.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import autoshard

from harness.golden import groups_for
from harness.models import rotate_half

BATCH, SEQ, HEADS, HEAD_DIM, FFN, VOCAB = 3, 12, 8, 6, 56, 72
HIDDEN = HEADS * HEAD_DIM
STYLES = ("titan", "mistral", "gptfast", "sdpa_gqa", "repeat", "tiled", "fused")


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


class TitanAttention(nn.Module):
    def __init__(self, kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.n_rep = HEADS, kv_heads, HEADS // kv_heads
        self.wq = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.wk = nn.Linear(HIDDEN, kv_heads * HEAD_DIM, bias=False)
        self.wv = nn.Linear(HIDDEN, kv_heads * HEAD_DIM, bias=False)
        self.wo = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        freqs = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
        angles = torch.outer(torch.arange(2 * SEQ).float(), freqs)  # (positions, hd/2)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)

    @staticmethod
    def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
        bs, slen, n_kv_heads, head_dim = x.shape
        return (x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim)
                .reshape(bs, slen, n_kv_heads * n_rep, head_dim))  # (bs, slen, nh, hd)

    def rotary(self, x: torch.Tensor) -> torch.Tensor:
        x_ = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # (bs, slen, h, hd/2)
        freqs = self.freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, x_.shape[-1])
        return torch.view_as_real(x_ * freqs).flatten(3).type_as(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, HEAD_DIM)  # (bs, slen, nh, hd)
        xk = self.wk(x).view(bs, seqlen, -1, HEAD_DIM)  # (bs, slen, nkv, hd)
        xv = self.wv(x).view(bs, seqlen, -1, HEAD_DIM)
        xq, xk = self.rotary(xq), self.rotary(xk)
        keys, values = self.repeat_kv(xk, self.n_rep), self.repeat_kv(xv, self.n_rep)
        xq, xk, xv = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)  # (bs, nh, slen, hd)
        output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        return self.wo(output.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class MistralAttention(nn.Module):
    def __init__(self, kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.repeats = HEADS, kv_heads, HEADS // kv_heads
        self.scale = HEAD_DIM ** -0.5
        self.wq = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.wk = nn.Linear(HIDDEN, kv_heads * HEAD_DIM, bias=False)
        self.wv = nn.Linear(HIDDEN, kv_heads * HEAD_DIM, bias=False)
        self.wo = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, HEAD_DIM)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv_heads, HEAD_DIM)
        xv = self.wv(x).view(bsz, seqlen, self.n_kv_heads, HEAD_DIM)
        xq, xk = xq * cos + rotate_half(xq) * sin, xk * cos + rotate_half(xk) * sin  # cos: (slen, 1, hd)
        key = torch.repeat_interleave(xk, repeats=self.repeats, dim=2)  # (bsz, slen, nh, hd)
        value = torch.repeat_interleave(xv, repeats=self.repeats, dim=2)
        xq, key, value = xq.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # (bsz, nh, slen, hd)
        scores = torch.matmul(xq, key.transpose(2, 3)) * self.scale  # (bsz, nh, slen, slen)
        mask = torch.full((seqlen, seqlen), float("-inf"), device=x.device).triu(1)
        scores = F.softmax((scores + mask).float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, value).transpose(1, 2).reshape(bsz, seqlen, -1)
        return self.wo(output)


class GptFastAttention(nn.Module):
    def __init__(self, kv_heads: int) -> None:
        super().__init__()
        self.n_head, self.n_local_heads = HEADS, kv_heads
        self.wq = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.wk = nn.Linear(HIDDEN, kv_heads * HEAD_DIM, bias=False)
        self.wv = nn.Linear(HIDDEN, kv_heads * HEAD_DIM, bias=False)
        self.wo = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.register_buffer("causal_mask", torch.tril(torch.ones(2 * SEQ, 2 * SEQ, dtype=torch.bool)),
                             persistent=False)

    @staticmethod
    def rotary(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        xshaped = x.float().reshape(*x.shape[:-1], -1, 2)  # (bsz, slen, h, hd/2, 2)
        freqs_cis = freqs_cis.view(1, xshaped.size(1), 1, xshaped.size(3), 2)
        x_out2 = torch.stack([xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
                              xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1]], -1)
        return x_out2.flatten(3).type_as(x)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, self.n_head, HEAD_DIM)
        k = self.wk(x).view(bsz, seqlen, self.n_local_heads, HEAD_DIM)
        v = self.wv(x).view(bsz, seqlen, self.n_local_heads, HEAD_DIM)
        q, k = self.rotary(q, freqs_cis), self.rotary(k, freqs_cis)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (bsz, h, slen, hd)
        k = k.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        v = v.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        mask = self.causal_mask[None, None, :seqlen, :seqlen]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        return self.wo(y.transpose(1, 2).contiguous().view(bsz, seqlen, HIDDEN))


class HeadsFirstAttention(nn.Module):
    """q, k, v viewed (batch, heads, sequence, head dim), then kv heads matched to query heads by ``how``:
    ``sdpa_gqa`` (no repeat), ``repeat`` (each kv head's copies adjacent) or ``tiled`` (the heads tiled)."""

    def __init__(self, kv_heads: int, how: str) -> None:
        super().__init__()
        self.kv_heads, self.how = kv_heads, how
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM)
        self.k_proj = nn.Linear(HIDDEN, kv_heads * HEAD_DIM)
        self.v_proj = nn.Linear(HIDDEN, kv_heads * HEAD_DIM)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        group = HEADS // self.kv_heads
        q = self.q_proj(x).view(b, t, HEADS, HEAD_DIM).transpose(1, 2)  # (b, nh, t, hd)
        k = self.k_proj(x).view(b, t, self.kv_heads, HEAD_DIM).transpose(1, 2)  # (b, nkv, t, hd)
        v = self.v_proj(x).view(b, t, self.kv_heads, HEAD_DIM).transpose(1, 2)
        cos, sin = cos.transpose(0, 1), sin.transpose(0, 1)  # (1, t, hd)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if self.how == "sdpa_gqa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            if self.how == "repeat":  # (b, nkv, group, t, hd) -> (b, nh, t, hd): kv head i for heads i*group...
                k, v = (z[:, :, None].repeat(1, 1, group, 1, 1).flatten(1, 2) for z in (k, v))
            else:  # tiled: (b, group * nkv, t, hd), query head h reads kv head h % nkv
                k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, HIDDEN))


class FusedAttention(nn.Module):
    """q, k and v from one projection with a bias (``att_proj``), cut apart by ``split``; ``enable_gqa=True``."""

    def __init__(self, kv_heads: int) -> None:
        super().__init__()
        self.kv_heads = kv_heads
        self.att_proj = nn.Linear(HIDDEN, (HEADS + 2 * kv_heads) * HEAD_DIM)
        self.attn_out = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        kv = self.kv_heads * HEAD_DIM
        q, k, v = self.att_proj(x).split((HIDDEN, kv, kv), dim=-1)
        q = q.view(b, t, HEADS, HEAD_DIM).transpose(1, 2)  # (b, nh, t, hd)
        k, v = (z.view(b, t, self.kv_heads, HEAD_DIM).transpose(1, 2) for z in (k, v))  # (b, nkv, t, hd)
        cos, sin = cos.transpose(0, 1), sin.transpose(0, 1)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.attn_out(y.transpose(1, 2).reshape(b, t, HIDDEN))


class Block(nn.Module):
    def __init__(self, style: str, kv_heads: int) -> None:
        super().__init__()
        self.style = style
        self.attention_norm, self.ffn_norm = RMSNorm(HIDDEN), RMSNorm(HIDDEN)
        self.attention = {"titan": lambda: TitanAttention(kv_heads), "mistral": lambda: MistralAttention(kv_heads),
                          "gptfast": lambda: GptFastAttention(kv_heads), "fused": lambda: FusedAttention(kv_heads)}.get(
            style, lambda: HeadsFirstAttention(kv_heads, style))()
        self.w1 = nn.Linear(HIDDEN, FFN, bias=False)
        self.w2 = nn.Linear(FFN, HIDDEN, bias=False)
        self.w3 = nn.Linear(HIDDEN, FFN, bias=False)

    def forward(self, x: torch.Tensor, *rope) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), *rope)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Decoder(nn.Module):
    """Token embedding, two blocks of ``style``'s attention and a SwiGLU MLP, a norm and an untied LM head."""

    def __init__(self, style: str, kv_heads: int) -> None:
        super().__init__()
        self.style = style
        self.tok_embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([Block(style, kv_heads) for _ in range(2)])
        self.norm = RMSNorm(HIDDEN)
        self.output = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)),
                             persistent=False)

    def rope(self, seqlen: int, device) -> tuple:
        angles = torch.outer(torch.arange(seqlen, device=device).float(), self.inv_freq)  # (t, hd/2)
        if self.style == "titan":
            return ()
        if self.style == "gptfast":
            return (torch.stack([angles.cos(), angles.sin()], dim=-1),)  # (t, hd/2, 2)
        emb = torch.cat((angles, angles), dim=-1)[:, None]  # (t, 1, hd)
        return emb.cos(), emb.sin()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)  # (b, t, hidden)
        rope = self.rope(tokens.shape[1], tokens.device)
        for layer in self.layers:
            h = layer(h, *rope)
        return self.output(self.norm(h))  # (b, t, vocab)


def token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), ignore_index=-100)


def build(style: str, kv_heads: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The decoder of ``style`` from a fixed seed, its tokens and its targets (a few ignored)."""
    torch.manual_seed(0)
    model = Decoder(style, kv_heads)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    target = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    target[0, :3] = target[2, -2:] = -100
    return model, tokens, target


def expected_share(model: nn.Module, tp: int, kv_heads: int) -> float:
    """The share of the parameter bytes a rank holds when kv heads are duplicated as HuggingFace's layout has
    them: ``1/tp`` of every matrix, plus the norms, biases and (where tp does not divide the kv heads) the k and v
    projections held whole."""
    kv_whole = kv_heads % tp != 0
    total = held = 0
    for name, p in model.named_parameters():
        whole = p.dim() == 1 and not name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias", "att_proj.bias"))
        if kv_whole and any(k in name for k in ("wk.", "wv.", "k_proj.", "v_proj.")):
            whole = True
        total += p.numel()
        if "att_proj." in name and kv_whole:  # the fused k and v blocks held whole, the q block split
            kv_rows = 2 * kv_heads * HEAD_DIM
            held += p.numel() * (kv_rows + HIDDEN / tp) / (kv_rows + HIDDEN)
        else:
            held += p.numel() if whole else p.numel() / tp
    return held / total


def gqa_golden(style: str, kv_heads: int, mesh_kwargs: dict, **options) -> dict:
    """``autoshard.verify`` of the decoder of ``style`` on ``mesh_kwargs``: whether it is exact, the share of the
    parameter bytes a rank holds, and the share duplicated kv heads reach (``expected_share``)."""
    model, tokens, target = build(style, kv_heads)
    mesh = autoshard.Mesh(**mesh_kwargs)
    share = expected_share(model, mesh.tp, kv_heads)
    report = autoshard.verify(model, mesh, (tokens,), token_loss, target=target, steps=3, groups=groups_for(mesh),
                              **options)
    return {"ok": report.ok, "report": str(report), "share": report.share, "expected_share": share,
            "compared": len(report.differences)}
