"""The model zoo every golden test runs on.

Each entry is a tiny fp32 model with example inputs, a target and a loss function, built the same way
every time from a seed. A parallel program is right when it computes what these models compute
eagerly, so the zoo covers the patterns a parallelizing compiler has to get right:

- ``gpt``: nanoGPT-style decoder. Fused qkv linear split in three, learned positions from ``arange``,
  SDPA with ``is_causal=True``, LM head tied to the token embedding.
- ``llama``: Llama-style decoder. RMSNorm written as arithmetic, RoPE tables computed from positions
  inside ``forward``, SwiGLU MLP, grouped-query attention with k/v repeated by ``repeat_interleave``,
  untied LM head.
- ``bert``: BERT-style encoder. Positions and token types sliced from registered buffers, post-LayerNorm
  blocks, bidirectional attention written out as matmul -> scale -> softmax -> matmul, MLM head.
- ``moe``: torchtitan-style mixture of experts in a Llama decoder. A router (softmax, top-2 of 8 experts),
  tokens sorted by expert with ``argsort`` and counted with ``histc``, the scores applied before the experts,
  three stacks of expert matrices (experts, out, in) read transposed through a grouped matmul (an op of
  ``torch._grouped_mm``'s signature that runs in any dtype, as torchtitan falls back to on CPU), a shared
  expert, and the rows summed back with ``scatter_add``.
  ``moe_loop`` (built by ``build`` but not in every zoo matrix) is the same model whose experts run one at a time
  over the same stacks, as torchtitan's ``GroupedExperts`` runs them without a grouped matmul kernel.
  ``moe_list`` is the Llama decoder with litgpt's ``LLaMAMoE`` in place of every MLP: each expert a module of a
  ``ModuleList``, its rows picked by ``torch.where`` of the router's top-k, its output added back at them.
- ``mlp``: three linears on (batch, features), MSE loss.
- ``hf_gpt2``, ``hf_llama``: HuggingFace transformers models from tiny configs (no downloads). GPT-2's
  Conv1D stores weights (in, out) and ties its LM head; Llama uses GQA repeated by expand + reshape.
- ``megatron``: a decoder written for Megatron-core's own tensor parallelism (its local layer spec) and run at
  ``tensor_model_parallel_size=1``: column- and row-parallel linears wrapping ``F.linear`` in Megatron's region
  mappings (custom autograd Functions that are the identity at one rank), layers in (sequence, batch, hidden), a
  fused qkv holding each head's q, k and v side by side, the output layer tied to the word embeddings.

Sizes. A pass that finds a dimension by matching its size value instead of propagating it through the
graph is wrong in a way that stays hidden when two dimensions happen to be equal, so the sizes that a
compiler reasons about are pairwise distinct:

=================  =====  ===========================================================
global batch           8  divisible by data-parallel degrees 1, 2, 4 and by microbatches
sequence              16  divisible by 2 * context-parallel 4 (load-balanced chunks)
heads                  4  kv heads 2 for the GQA models (Llama, HF Llama)
head dim              12
hidden                48  = heads * head dim
vocab                 80  divisible by 2, 4 and 8 (vocab-parallel)
ffn                  128  also the MLP's first hidden width
experts                8  each expert's hidden width 40, the shared expert's 56 (multiples of 4: grouped
                          matmuls want rows of 16 bytes); top-2
max positions         32  size of position tables and buffers, longer than the sequence
=================  =====  ===========================================================

The MLP entry maps 20 input features through widths 128 and 48 to 24 outputs. Every model has 2 layers.

Targets for the token models have ``-100`` (ignored) entries spread unevenly over the batch rows and
positions (row 0 starts with 5, row 3 has 1, the last row ends with 6), so that microbatches, data-
parallel ranks and context-parallel chunks each hold a different number of counted tokens: a loss
normalised per shard instead of over the global batch shows up as a wrong loss and wrong gradients.

Freshly initialised models have all-ones norm weights and all-zero biases, which hide bugs such as a
bias added once per tensor-parallel rank or a norm weight applied to the wrong shard. ``build``
therefore adds small seeded noise to every parameter that starts out constant.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ZOO_NAMES = ("gpt", "llama", "moe", "bert", "mlp", "hf_gpt2", "hf_llama", "megatron")
DECODERS = ("gpt", "llama", "moe", "hf_gpt2", "hf_llama")
# Mixtures written otherwise, for expert parallelism's own tests (not in every zoo matrix): ``moe_loop``'s experts
# run one at a time over the same stacks, as torchtitan's ``GroupedExperts`` runs them without a grouped matmul
# kernel; ``moe_list``'s are modules of a list, as litgpt's ``LLaMAMoE`` holds them.
FORMS = ("moe_loop", "moe_list")
CONV_NAMES = ("unet", "resnet", "convnext")  # image models, built by ``build`` too (not in every zoo matrix)

# The pairwise-distinct sizes documented above.
BATCH = 8
SEQ = 16
N_HEAD = 4
N_KV_HEAD = 2
HEAD_DIM = 12
HIDDEN = N_HEAD * HEAD_DIM  # 48
VOCAB = 80
FFN = 128
MAX_POS = 32
N_LAYER = 2
MLP_IN = 20
MLP_OUT = 24
EXPERTS = 8
TOP_K = 2
EXPERT_FFN = 40
SHARED_FFN = 56

IGNORE_INDEX = -100


@dataclass
class ZooCase:
    name: str
    model: nn.Module
    inputs: tuple  # global-batch example inputs (positional args of model.forward)
    target: torch.Tensor  # global-batch target
    loss_fn: Callable  # loss_fn(model(*inputs), target) -> scalar


# --------------------------------------------------------------------------------------------------------------------
# nanoGPT-style GPT
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class GPTConfig:
    n_layer: int = N_LAYER
    n_embd: int = HIDDEN
    n_head: int = N_HEAD
    vocab: int = VOCAB
    seq: int = MAX_POS  # block size: the longest sequence the position table holds
    ffn: int = FFN
    bias: bool = True


class GPTAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0
        self.n_head = cfg.n_head
        self.n_embd = cfg.n_embd
        # One fused projection for q, k and v, as in nanoGPT: its output dim is 3 * hidden.
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()  # batch, sequence, hidden
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side again
        return self.c_proj(y)


class GPTMLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, cfg.ffn, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(cfg.ffn, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class GPTBlock(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = GPTAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = GPTMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's model.py without dropout, generation or the built-in loss: forward returns logits."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(cfg.vocab, cfg.n_embd),
                "wpe": nn.Embedding(cfg.seq, cfg.n_embd),
                "h": nn.ModuleList([GPTBlock(cfg) for _ in range(cfg.n_layer)]),
                "ln_f": nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
            }
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab, bias=False)
        # Weight tying: one parameter used by the embedding and by the LM head.
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        # GPT-2's scaled init of the residual projections.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)  # (t,)
        tok_emb = self.transformer.wte(idx)  # (b, t, n_embd)
        pos_emb = self.transformer.wpe(pos)  # (t, n_embd)
        x = tok_emb + pos_emb
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        return self.lm_head(x)  # (b, t, vocab)


def build_gpt_model(
    n_layer: int = N_LAYER,
    n_embd: int = HIDDEN,
    n_head: int = N_HEAD,
    vocab: int = VOCAB,
    seq: int = MAX_POS,
    ffn: int | None = None,
    bias: bool = True,
    device: str | torch.device = "cpu",
) -> GPT:
    """A nanoGPT-style GPT of any shape; ``ffn`` defaults to 4 * n_embd as in nanoGPT. Uses the global RNG."""
    cfg = GPTConfig(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        vocab=vocab,
        seq=seq,
        ffn=4 * n_embd if ffn is None else ffn,
        bias=bias,
    )
    with torch.device(device):
        return GPT(cfg)


# --------------------------------------------------------------------------------------------------------------------
# Llama-style decoder
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class LlamaStyleConfig:
    n_layer: int = N_LAYER
    n_embd: int = HIDDEN
    n_head: int = N_HEAD
    n_kv_head: int = N_KV_HEAD
    vocab: int = VOCAB
    seq: int = MAX_POS  # longest sequence; RoPE itself is computed for the actual length
    ffn: int = FFN
    rope_theta: float = 10000.0
    eps: float = 1e-5


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Written out rather than F.rms_norm so the graph holds the elementwise pattern.
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaStyleAttention(nn.Module):
    def __init__(self, cfg: LlamaStyleConfig) -> None:
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0 and cfg.n_head % cfg.n_kv_head == 0
        self.n_head = cfg.n_head
        self.n_kv_head = cfg.n_kv_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * self.head_dim, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # Each kv head serves n_head // n_kv_head consecutive query heads.
        n_rep = self.n_head // self.n_kv_head
        k = k.repeat_interleave(n_rep, dim=1)  # (B, nh, T, hs)
        v = v.repeat_interleave(n_rep, dim=1)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)  # (B, T, nh * hs)
        return self.o_proj(y)


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaStyleConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.ffn, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.ffn, bias=False)
        self.down_proj = nn.Linear(cfg.ffn, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaStyleBlock(nn.Module):
    def __init__(self, cfg: LlamaStyleConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.n_embd, cfg.eps)
        self.self_attn = LlamaStyleAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd, cfg.eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaStyle(nn.Module):
    """A Llama decoder in plain torch: forward returns logits."""

    def __init__(self, cfg: LlamaStyleConfig) -> None:
        super().__init__()
        self.cfg = cfg
        head_dim = cfg.n_embd // cfg.n_head
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.n_embd)
        self.layers = nn.ModuleList([LlamaStyleBlock(cfg) for _ in range(cfg.n_layer)])
        self.norm = RMSNorm(cfg.n_embd, cfg.eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab, bias=False)
        # Non-persistent like HF: derived from the config, so not part of the state dict.
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        _, T = input_ids.shape
        # RoPE tables from the positions of this call, so the graph derives them from the sequence length.
        pos = torch.arange(T, device=input_ids.device, dtype=torch.float32)  # (T,)
        freqs = torch.outer(pos, self.inv_freq)  # (T, hs/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, hs)
        cos, sin = emb.cos(), emb.sin()  # (T, hs), broadcast over (B, nh, T, hs)
        x = self.embed_tokens(input_ids)  # (B, T, C)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))  # (B, T, vocab)


# --------------------------------------------------------------------------------------------------------------------
# Mixture of experts, torchtitan-style
# --------------------------------------------------------------------------------------------------------------------


class TopKRouter(nn.Module):
    """Token-choice top-k: each token's k best experts, their softmax scores, and each expert's token count."""

    def __init__(self, dim: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts, self.top_k = experts, top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = F.softmax(self.gate(x).float(), dim=1)  # (tokens, experts)
        top_scores, selected = torch.topk(scores, k=self.top_k, dim=1)  # (tokens, k)
        counts = torch.histc(selected.view(-1).float(), bins=self.experts, min=0, max=self.experts)
        return top_scores, selected, counts


@torch.library.custom_op("zoo::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(x, w, offs=offsets)`` for any dtype on CPU (torch's own wants bf16 to be captured there),
    as torchtitan's experts fall back to a loop: rows ``offsets[e-1]:offsets[e]`` of ``x`` times ``w[e]``."""
    out = x.new_zeros(x.shape[0], w.shape[2])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        out[start:end] = x[start:end] @ w[e].to(x.dtype)
        start = end
    return out


@grouped_mm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[2])


def _grouped_mm_backward(ctx, grad: torch.Tensor):
    x, w, offsets = ctx.saved_tensors
    grad_w = torch.zeros_like(w)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        grad_w[e] = (x[start:end].t() @ grad[start:end]).to(w.dtype)
        start = end
    return grouped_mm(grad.contiguous(), w.transpose(1, 2), offsets), grad_w, None


grouped_mm.register_autograd(_grouped_mm_backward,
                             setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


class GroupedExperts(nn.Module):
    """Every expert's SwiGLU at once: stacks (experts, out, in) read transposed by grouped matmuls over rows sorted
    by expert, ``offsets`` the cumulative rows per expert."""

    def __init__(self, dim: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.capacity: float | None = None  # a reference for ep's capacity: rows per expert beyond it are dropped
        self.w1 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, hidden, dim))
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, mean=0.0, std=0.02)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = F.silu(grouped_mm(x, self.w1.transpose(-2, -1), offsets))
        h = h * grouped_mm(x, self.w3.transpose(-2, -1), offsets)
        out = grouped_mm(h, self.w2.transpose(-2, -1), offsets)
        if self.capacity is not None:  # each expert keeps its first ceil(capacity x rows / experts) rows
            limit = math.ceil(self.capacity * x.shape[0] / counts.numel())
            starts = torch.cumsum(counts, 0) - counts
            expert = torch.repeat_interleave(torch.arange(counts.numel()), counts.long(), output_size=x.shape[0])
            position = torch.arange(x.shape[0]) - starts.long()[expert]
            out = out * (position < limit).unsqueeze(-1).to(out.dtype)
        return out


class LoopedExperts(nn.Module):
    """Experts looped over pieces of rows split by counts read back (JetMoE's form): ``linear(x_e, w[e])`` per expert,
    joined by ``cat``, added back at the tokens' rows. ``reads_counts``: the model reads a count itself too;
    ``swapped``: two pieces meet each other's expert."""

    def __init__(self, *, reads_counts: bool = False, swapped: bool = False) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4, bias=False)
        self.w = nn.Parameter(torch.randn(4, 6, 8))
        self.reads_counts, self.swapped = reads_counts, swapped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = self.gate(x).argmax(-1)
        order = ids.argsort()
        sizes = F.one_hot(ids, 4).sum(0).tolist()
        experts = [1, 0, 2, 3] if self.swapped else range(4)
        y = torch.cat([F.linear(piece, self.w[e]) for piece, e in zip(x[order].split(sizes), experts, strict=True)])
        out = torch.zeros(x.shape[0], 6).index_add(0, order, y)
        return out * sizes[0] if self.reads_counts else out


class LoopedGroupedExperts(GroupedExperts):
    """The same stacks run as torchtitan's experts run without a grouped matmul kernel: the counts read back, the
    sorted rows split by them, each expert's SwiGLU on its piece (``matmul`` with ``w[e]`` transposed), the pieces
    concatenated."""

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        pieces = torch.split(x, counts.long().tolist(), dim=0)
        out = []
        for e, piece in enumerate(pieces):
            h = F.silu(torch.matmul(piece, self.w1[e].transpose(-2, -1)))
            h = h * torch.matmul(piece, self.w3[e].transpose(-2, -1))
            out.append(torch.matmul(h, self.w2[e].transpose(-2, -1)))
        return torch.cat(out, dim=0)


class MoE(nn.Module):
    def __init__(self, dim: int = HIDDEN, hidden: int = EXPERT_FFN, experts: int = EXPERTS, top_k: int = TOP_K,
                 shared: int = SHARED_FFN, looped: bool = False) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = TopKRouter(dim, experts, top_k)
        self.experts = (LoopedGroupedExperts if looped else GroupedExperts)(dim, hidden, experts)
        self.shared_expert = SwiGLU(LlamaStyleConfig(n_embd=dim, ffn=shared))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.view(-1, dim)  # (tokens, dim)
        top_scores, selected, counts = self.router(x)
        order = torch.argsort(selected.view(-1), stable=True)  # the (token, choice) pairs grouped by expert
        scores = top_scores.view(-1)[order]
        token = order // self.top_k
        routed = (x[token].float() * scores.reshape(-1, 1)).to(x.dtype)  # the scores before the experts
        routed = self.experts(routed, counts)
        out = self.shared_expert(x).scatter_add(0, token.reshape(-1, 1).expand(-1, dim), routed)
        return out.view(bs, slen, dim)


class ModuleListMoE(nn.Module):
    """litgpt's ``LLaMAMoE``: each expert a module of its own in a ``ModuleList``, its tokens found by a mask of the
    router's top-k choices (``torch.where``), its output added at their rows (``y[token_idx] += ...``)."""

    def __init__(self, dim: int = HIDDEN, hidden: int = EXPERT_FFN, experts: int = EXPERTS, top_k: int = TOP_K) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(LlamaStyleConfig(n_embd=dim, ffn=hidden)) for _ in range(experts))
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.view(-1, dim)  # (tokens, dim)
        probs, indices = torch.topk(self.gate(x), self.top_k)  # (tokens, k)
        probs = probs.softmax(dim=1, dtype=torch.float).to(dtype=x.dtype)
        masks = indices.unsqueeze(-1) == torch.arange(len(self.experts), device=x.device)  # (tokens, k, experts)
        masks = masks.permute(2, 0, 1)  # (experts, tokens, k)
        y = torch.zeros_like(x)
        for mask, expert in zip(masks, self.experts, strict=True):
            token_idx, expert_idx = torch.where(mask)
            y[token_idx] += probs[token_idx, expert_idx, None] * expert(x[token_idx])
        return y.view(bs, slen, dim)


class MoEBlock(LlamaStyleBlock):
    def __init__(self, cfg: LlamaStyleConfig, looped: bool = False, listed: bool = False) -> None:
        super().__init__(cfg)
        self.mlp = ModuleListMoE(cfg.n_embd) if listed else MoE(cfg.n_embd, looped=looped)


class MoEStyle(LlamaStyle):
    """The Llama decoder with a mixture of experts in place of every MLP (``looped``: its experts run one at a time,
    as ``LoopedGroupedExperts`` runs them)."""

    def __init__(self, cfg: LlamaStyleConfig, looped: bool = False, listed: bool = False) -> None:
        super().__init__(cfg)
        self.layers = nn.ModuleList([MoEBlock(cfg, looped, listed) for _ in range(cfg.n_layer)])
        for module in self.layers.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)


def build_llama_model(
    n_layer: int = N_LAYER,
    n_embd: int = HIDDEN,
    n_head: int = N_HEAD,
    n_kv_head: int = N_KV_HEAD,
    vocab: int = VOCAB,
    seq: int = MAX_POS,
    ffn: int = FFN,
    device: str | torch.device = "cpu",
) -> LlamaStyle:
    """A Llama-style decoder of any shape (Llama-7B: 32 layers, 4096 hidden, 32 heads, ffn 11008, vocab 32000)."""
    cfg = LlamaStyleConfig(
        n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_kv_head=n_kv_head, vocab=vocab, seq=seq, ffn=ffn
    )
    with torch.device(device):
        return LlamaStyle(cfg)


# --------------------------------------------------------------------------------------------------------------------
# BERT-style encoder
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class BertConfig:
    n_layer: int = N_LAYER
    n_embd: int = HIDDEN
    n_head: int = N_HEAD
    vocab: int = VOCAB
    seq: int = MAX_POS
    ffn: int = FFN
    type_vocab: int = 2
    eps: float = 1e-12


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.query = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.key = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.value = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dense = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.LayerNorm = nn.LayerNorm(cfg.n_embd, eps=cfg.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q = self.query(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = self.key(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        v = self.value(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        # Explicit attention (no SDPA) so the zoo has the matmul/softmax pattern; bidirectional, no mask.
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)  # (B, nh, T, T)
        probs = torch.softmax(scores, dim=-1)  # (B, nh, T, T)
        y = torch.matmul(probs, v)  # (B, nh, T, hs)
        y = y.permute(0, 2, 1, 3).contiguous().view(B, T, C)  # (B, T, C)
        return self.LayerNorm(self.dense(y) + x)  # post-LN


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.attention = BertSelfAttention(cfg)
        self.intermediate = nn.Linear(cfg.n_embd, cfg.ffn)
        self.output = nn.Linear(cfg.ffn, cfg.n_embd)
        self.LayerNorm = nn.LayerNorm(cfg.n_embd, eps=cfg.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attention(x)
        return self.LayerNorm(self.output(F.gelu(self.intermediate(x))) + x)  # post-LN


class Bert(nn.Module):
    """A BERT encoder with its masked-language-model head: forward returns logits (B, T, vocab)."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.word_embeddings = nn.Embedding(cfg.vocab, cfg.n_embd)
        self.position_embeddings = nn.Embedding(cfg.seq, cfg.n_embd)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab, cfg.n_embd)
        self.emb_LayerNorm = nn.LayerNorm(cfg.n_embd, eps=cfg.eps)
        # As in HF BERT: positions and default token types are slices of buffers, not arange.
        self.register_buffer("position_ids", torch.arange(cfg.seq).expand((1, -1)), persistent=False)
        self.register_buffer("token_type_ids", torch.zeros((1, cfg.seq), dtype=torch.long), persistent=False)
        self.layers = nn.ModuleList([BertLayer(cfg) for _ in range(cfg.n_layer)])
        # MLM head: transform (dense, GELU, LayerNorm) then decoder to the vocabulary.
        self.head_dense = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.head_LayerNorm = nn.LayerNorm(cfg.n_embd, eps=cfg.eps)
        self.decoder = nn.Linear(cfg.n_embd, cfg.vocab)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        B, T = input_ids.shape
        position_ids = self.position_ids[:, :T]  # (1, T)
        if token_type_ids is None:
            token_type_ids = self.token_type_ids[:, :T].expand(B, T)  # (B, T)
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(position_ids)
            + self.token_type_embeddings(token_type_ids)
        )  # (B, T, C)
        x = self.emb_LayerNorm(x)
        for layer in self.layers:
            x = layer(x)
        x = self.head_LayerNorm(F.gelu(self.head_dense(x)))
        return self.decoder(x)  # (B, T, vocab)


# --------------------------------------------------------------------------------------------------------------------
# Plain MLP
# --------------------------------------------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, d_in: int = MLP_IN, d_hidden: int = FFN, d_hidden2: int = HIDDEN, d_out: int = MLP_OUT) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_hidden2)
        self.fc3 = nn.Linear(d_hidden2, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.gelu(self.fc2(F.relu(self.fc1(x)))))  # (batch, d_out)


# --------------------------------------------------------------------------------------------------------------------
# A decoder written for Megatron-core's own tensor parallelism, run at tensor_model_parallel_size=1
# --------------------------------------------------------------------------------------------------------------------


class OneRankGroup:
    """Megatron's tensor-parallel process group in a run at ``tensor_model_parallel_size=1``: one rank."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group.size() == 1:  # Megatron: "bypass the function if we are using only 1 GPU"
        return x
    torch.distributed.all_reduce(x.contiguous(), group=group)
    return x


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    if group.size() == 1:
        return x
    return x.chunk(group.size(), dim=-1)[group.rank()].contiguous()


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    if group.size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(group.size())]
    torch.distributed.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1).contiguous()


class CopyToRegion(torch.autograd.Function):
    """Megatron's ``_CopyToModelParallelRegion``: forward the identity, backward all-reduced."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce(grad_output, ctx.group), None


class ReduceFromRegion(torch.autograd.Function):
    """Megatron's ``_ReduceFromModelParallelRegion``: forward all-reduced, backward the identity."""

    @staticmethod
    def forward(ctx, input_, group):
        return _reduce(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


class ScatterToRegion(torch.autograd.Function):
    """Megatron's ``_ScatterToModelParallelRegion``: forward this rank's part of the last dim, backward gathered."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _split_last(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_last(grad_output, ctx.group), None


class GatherFromRegion(torch.autograd.Function):
    """Megatron's ``_GatherFromModelParallelRegion``: forward gathered along the last dim, backward split."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _gather_last(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _split_last(grad_output, ctx.group), None


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab: int, dim: int, group) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, dim) * 0.02)
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return ReduceFromRegion.apply(F.embedding(ids, self.weight), self.group)


class ColumnParallelLinear(nn.Module):
    """Megatron's: the input copied to the region, ``F.linear``, the output gathered when asked; a tied output layer
    holds no weight of its own and is passed the word embeddings' (``skip_weight_param_allocation``)."""

    def __init__(self, d_in: int, d_out: int, group, *, bias: bool = True, gather_output: bool = False,
                 skip_weight_param_allocation: bool = False) -> None:
        super().__init__()
        self.weight = None if skip_weight_param_allocation else nn.Parameter(torch.randn(d_out, d_in) * 0.02)
        self.bias = nn.Parameter(torch.zeros(d_out)) if bias else None
        self.group, self.gather_output = group, gather_output

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        output = F.linear(CopyToRegion.apply(x, self.group), self.weight if weight is None else weight, self.bias)
        return GatherFromRegion.apply(output, self.group) if self.gather_output else output


class RowParallelLinear(nn.Module):
    """Megatron's: the input scattered unless it is parallel already, ``F.linear``, the sum reduced, then the bias."""

    def __init__(self, d_in: int, d_out: int, group, *, input_is_parallel: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) * 0.02)
        self.bias = nn.Parameter(torch.zeros(d_out))
        self.group, self.input_is_parallel = group, input_is_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x if self.input_is_parallel else ScatterToRegion.apply(x, self.group)
        return ReduceFromRegion.apply(F.linear(x, self.weight), self.group) + self.bias


class MegatronAttention(nn.Module):
    def __init__(self, group) -> None:
        super().__init__()
        self.linear_qkv = ColumnParallelLinear(HIDDEN, 3 * HIDDEN, group)
        self.linear_proj = RowParallelLinear(HIDDEN, HIDDEN, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, _ = x.shape  # (s, b, h): Megatron's sequence-first layout
        # Megatron's fused qkv holds each head's q, k and v side by side: (s, b, np, 3 * hn)
        mixed = self.linear_qkv(x).view(s, b, N_HEAD, 3 * HEAD_DIM)
        q, k, v = (t.permute(1, 2, 0, 3) for t in torch.split(mixed, HEAD_DIM, dim=3))  # (b, np, s, hn)
        context = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, np, s, hn)
        return self.linear_proj(context.permute(2, 0, 1, 3).reshape(s, b, HIDDEN))  # (s, b, h)


class MegatronMLP(nn.Module):
    def __init__(self, group) -> None:
        super().__init__()
        self.linear_fc1 = ColumnParallelLinear(HIDDEN, FFN, group)
        self.linear_fc2 = RowParallelLinear(FFN, HIDDEN, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class MegatronLayer(nn.Module):
    def __init__(self, group) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(HIDDEN)
        self.self_attention = MegatronAttention(group)
        self.pre_mlp_layernorm = nn.LayerNorm(HIDDEN)
        self.mlp = MegatronMLP(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.pre_mlp_layernorm(x))


class MegatronGPT(nn.Module):
    """Megatron-core's ``GPTModel`` with its local layer spec, in miniature: vocab- and position embeddings, layers in
    (s, b, h), the output layer tied to the word embeddings and gathered; every tensor-parallel layer wraps
    ``F.linear`` or ``F.embedding`` in Megatron's region mappings, which at one rank are the identity."""

    def __init__(self, group=None) -> None:
        super().__init__()
        group = OneRankGroup() if group is None else group
        self.word_embeddings = VocabParallelEmbedding(VOCAB, HIDDEN, group)
        self.position_embeddings = nn.Embedding(MAX_POS, HIDDEN)
        self.layers = nn.ModuleList([MegatronLayer(group) for _ in range(N_LAYER)])
        self.final_layernorm = nn.LayerNorm(HIDDEN)
        self.output_layer = ColumnParallelLinear(HIDDEN, VOCAB, group, bias=False, gather_output=True,
                                                 skip_weight_param_allocation=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = (self.word_embeddings(ids) + self.position_embeddings(positions)).transpose(0, 1).contiguous()  # (s, b, h)
        for layer in self.layers:
            x = layer(x)
        logits = self.output_layer(self.final_layernorm(x), weight=self.word_embeddings.weight)  # (s, b, vocab)
        return logits.transpose(0, 1).contiguous()  # (b, s, vocab)


# --------------------------------------------------------------------------------------------------------------------
# Convolutional models over 8x8 images: what tp splits as Megatron splits linears (``CONV_NAMES``)
# --------------------------------------------------------------------------------------------------------------------

IMAGE = 8  # height and width
CLASSES = 5
TIME_FEATURES = 12  # the sinusoidal embedding of a diffusion step


class TimeResBlock(nn.Module):
    """A diffusers-style ResNet block: GroupNorm, SiLU, conv, plus a projection of the time embedding broadcast over
    the image, GroupNorm, SiLU, conv, added to the input."""

    def __init__(self, channels: int, time_width: int, groups: int = 4) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.GroupNorm(groups, channels), nn.GroupNorm(groups, channels)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.time = nn.Linear(time_width, channels)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.time(F.silu(temb))[:, :, None, None]  # (B, C) -> (B, C, 1, 1)
        return x + self.conv2(F.silu(self.norm2(h)))


class TinyUNet(nn.Module):
    """A small diffusion UNet: a sinusoidal time embedding through an MLP, ResNet blocks at 8x8 and 4x4 joined by a
    strided convolution down and a transposed one up, a skip connection, and a GroupNorm, SiLU, conv head."""

    def __init__(self, width: int = 16, inner: int = 32, time_width: int = 40) -> None:
        super().__init__()
        self.time_mlp = nn.Sequential(nn.Linear(TIME_FEATURES, time_width), nn.SiLU(),
                                      nn.Linear(time_width, time_width))
        self.conv_in = nn.Conv2d(3, width, 3, padding=1)
        self.block1 = TimeResBlock(width, time_width)
        self.down = nn.Conv2d(width, inner, 3, stride=2, padding=1)
        self.block2 = TimeResBlock(inner, time_width)
        self.up = nn.ConvTranspose2d(inner, width, 4, stride=2, padding=1)
        self.block3 = TimeResBlock(width, time_width)
        self.norm_out = nn.GroupNorm(4, width)
        self.conv_out = nn.Conv2d(width, 3, 3, padding=1)

    def forward(self, x: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        half = TIME_FEATURES // 2
        freqs = torch.exp(-math.log(1000.0) * torch.arange(half, device=steps.device) / half)
        angles = steps[:, None].float() * freqs[None]
        temb = self.time_mlp(torch.cat([angles.sin(), angles.cos()], dim=-1))  # (B, time_width)
        skip = self.block1(self.conv_in(x), temb)
        h = self.block2(self.down(skip), temb)
        h = self.block3(self.up(h) + skip, temb)
        return self.conv_out(F.silu(self.norm_out(h)))


class BasicBlock(nn.Module):
    """torchvision's ResNet basic block: conv, BatchNorm, ReLU, conv, BatchNorm, plus the input (through a strided
    1x1 conv and a BatchNorm where the block downsamples)."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))) + self.shortcut(x))


class SqueezeExcite(nn.Module):
    """A squeeze-and-excitation gate: each channel scaled by a sigmoid of the pooled channels through two 1x1 convs."""

    def __init__(self, channels: int, reduced: int) -> None:
        super().__init__()
        self.reduce, self.expand = nn.Conv2d(channels, reduced, 1), nn.Conv2d(reduced, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.expand(F.silu(self.reduce(x.mean(dim=(2, 3), keepdim=True)))))


class InvertedResidual(nn.Module):
    """EfficientNet's MBConv (MobileNet V2's block with a gate): a 1x1 conv expands, a depthwise 3x3 conv filters each
    channel, a squeeze-and-excitation gate scales them, a 1x1 conv projects."""

    def __init__(self, channels: int, expand: int = 2) -> None:
        super().__init__()
        hidden = channels * expand
        self.layers = nn.Sequential(
            nn.Conv2d(channels, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(),
            nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(),
            SqueezeExcite(hidden, channels // 4),
            nn.Conv2d(hidden, channels, 1, bias=False), nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.layers(x)


class TinyResNet(nn.Module):
    """A ResNet: a conv stem with BatchNorm and max pooling, a basic block, a downsampling block, an inverted
    residual block with a squeeze-and-excitation gate, average pooling and a linear classifier."""

    def __init__(self, width: int = 16, inner: int = 32) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                                  nn.MaxPool2d(2))
        self.blocks = nn.Sequential(BasicBlock(width, width), BasicBlock(width, inner, stride=2),
                                    InvertedResidual(inner))
        self.fc = nn.Linear(inner, CLASSES)
        for norm in self.modules():  # running statistics of a trained model (zeros and ones hide a misplaced slice)
            if isinstance(norm, nn.BatchNorm2d):
                norm.running_mean.normal_(0.0, 0.3)
                norm.running_var.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.blocks(self.stem(x)).mean(dim=(2, 3)))


class LayerNorm2d(nn.LayerNorm):
    """A LayerNorm over the channels of an NCHW image (timm's): the channels moved last and back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    """ConvNeXt's block: a depthwise conv, a LayerNorm over the channels, an MLP of 4x the channels, a layer scale,
    plus the input. The MLP is two linears over the channels moved last, or (``conv_mlp``) two 1x1 convs."""

    def __init__(self, channels: int, conv_mlp: bool) -> None:
        super().__init__()
        self.conv_mlp = conv_mlp
        self.dwconv = nn.Conv2d(channels, channels, 3, padding=1, groups=channels)
        self.norm = LayerNorm2d(channels) if conv_mlp else nn.LayerNorm(channels)
        make = (lambda a, b: nn.Conv2d(a, b, 1)) if conv_mlp else nn.Linear
        self.fc1, self.fc2 = make(channels, 4 * channels), make(4 * channels, channels)
        self.gamma = nn.Parameter(torch.full((channels,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dwconv(x)
        if self.conv_mlp:
            h = self.fc2(F.gelu(self.fc1(self.norm(h)))) * self.gamma[:, None, None]
        else:
            h = h.permute(0, 2, 3, 1)  # (B, H, W, C)
            h = (self.fc2(F.gelu(self.fc1(self.norm(h)))) * self.gamma).permute(0, 3, 1, 2)
        return x + h


class TinyConvNeXt(nn.Module):
    """A ConvNeXt: a patch stem (2x2, stride 2) with a channel LayerNorm, three blocks (channels-last linears, then
    1x1 convs), a mean over the image, a LayerNorm and a linear classifier."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 2, stride=2), LayerNorm2d(width))
        self.blocks = nn.Sequential(*(ConvNeXtBlock(width, conv_mlp=i > 0) for i in range(3)))
        self.head = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


def image_data(name: str, gen: torch.Generator) -> tuple[tuple, torch.Tensor, Callable]:
    """Inputs, target and loss of a convolutional model: noise to predict (MSE) for the UNet, classes else."""
    images = torch.randn(BATCH, 3, IMAGE, IMAGE, generator=gen)
    if name == "unet":
        steps = torch.randint(0, 1000, (BATCH,), generator=gen)
        return (images, steps), torch.randn(BATCH, 3, IMAGE, IMAGE, generator=gen), mse_loss
    return (images,), torch.randint(0, CLASSES, (BATCH,), generator=gen), F.cross_entropy


# --------------------------------------------------------------------------------------------------------------------
# HuggingFace models (imported lazily: transformers costs seconds to import)
# --------------------------------------------------------------------------------------------------------------------


def _hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=MAX_POS,
        n_embd=HIDDEN,
        n_layer=N_LAYER,
        n_head=N_HEAD,
        n_inner=FFN,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg)


def _hf_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=N_LAYER,
        num_attention_heads=N_HEAD,
        num_key_value_heads=N_KV_HEAD,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POS,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
    )
    return LlamaForCausalLM(cfg)


# --------------------------------------------------------------------------------------------------------------------
# Losses and data
# --------------------------------------------------------------------------------------------------------------------


def token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over (B*T, V), mean over the non-ignored tokens of the whole batch."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1), ignore_index=IGNORE_INDEX)


def hf_token_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Token loss on a transformers ModelOutput (its ``logits``)."""
    return token_loss(output.logits, target)


def mse_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def token_data(
    generator: torch.Generator, batch: int = BATCH, seq: int = SEQ, vocab: int = VOCAB
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and targets with ignored entries spread unevenly over rows and positions."""
    input_ids = torch.randint(0, vocab, (batch, seq), generator=generator)
    target = torch.randint(0, vocab, (batch, seq), generator=generator)
    target[0, :5] = IGNORE_INDEX  # a prompt-like prefix in the first row
    if batch > 3:
        target[3, seq // 2] = IGNORE_INDEX  # one in the middle of row 3
    target[batch - 1, seq - 6 :] = IGNORE_INDEX  # padding-like tail in the last row
    return input_ids, target


def _perturb_constant_params(model: nn.Module, generator: torch.Generator) -> None:
    """Add small noise to parameters that start constant (norm weights of ones, biases of zeros)."""
    with torch.no_grad():
        for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if p.numel() > 1 and bool(p.min() == p.max()):
                p.add_(0.05 * torch.randn(p.shape, generator=generator, dtype=p.dtype).to(p.device))


def build(name: str, *, seed: int = 0, device: str | torch.device = "cpu") -> ZooCase:
    """Build zoo entry ``name``: the same seed gives bit-identical parameters, inputs and target."""
    if name not in ZOO_NAMES + FORMS + CONV_NAMES:
        raise ValueError(f"unknown zoo model {name!r}; choose from {ZOO_NAMES + FORMS + CONV_NAMES}")
    device = torch.device(device)
    constructors: dict[str, Callable[[], nn.Module]] = {
        "gpt": lambda: GPT(GPTConfig()),
        "llama": lambda: LlamaStyle(LlamaStyleConfig()),
        "moe": lambda: MoEStyle(LlamaStyleConfig()),
        "moe_loop": lambda: MoEStyle(LlamaStyleConfig(), looped=True),
        "moe_list": lambda: MoEStyle(LlamaStyleConfig(), listed=True),
        "bert": lambda: Bert(BertConfig()),
        "mlp": MLP,
        "hf_gpt2": _hf_gpt2,
        "hf_llama": _hf_llama,
        "megatron": MegatronGPT,
        "unet": TinyUNet,
        "resnet": TinyResNet,
        "convnext": TinyConvNeXt,
    }
    torch.manual_seed(seed)
    with torch.device(device):
        model = constructors[name]()
    # Data and perturbation draw from generators of their own, so the data does not depend on how much of
    # the global RNG a constructor consumed, and a meta build gets the same data as a CPU build.
    if device.type != "meta":
        _perturb_constant_params(model, torch.Generator().manual_seed(seed + 1))
    gen = torch.Generator().manual_seed(seed + 2)
    if name in CONV_NAMES:
        inputs, target, loss_fn = image_data(name, gen)
    elif name == "mlp":
        x = torch.randn(BATCH, MLP_IN, generator=gen)
        target = torch.randn(BATCH, MLP_OUT, generator=gen)
        inputs: tuple = (x,)
        loss_fn: Callable = mse_loss
    else:
        input_ids, target = token_data(gen)
        inputs = (input_ids,)
        loss_fn = hf_token_loss if name.startswith("hf_") else token_loss
    inputs = tuple(t.to(device) for t in inputs)
    return ZooCase(name=name, model=model, inputs=inputs, target=target.to(device), loss_fn=loss_fn)
