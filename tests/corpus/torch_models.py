"""Decoders built from torch's own transformer modules, at the corpus's tiny sizes.

- ``transformer_encoder``: ``nn.TransformerEncoder`` of ``nn.TransformerEncoderLayer`` (pre-LN, GELU,
  batch first) with a causal mask, token and learned position embeddings, an untied LM head.
- ``multihead_attention``: blocks written around ``nn.MultiheadAttention`` (one packed in-projection,
  a causal ``attn_mask``) and a ReLU MLP, post-LN, with the LM head tied to the token embedding.
"""

from __future__ import annotations

import torch
from torch import nn

from corpus.shrink import FFN, HIDDEN, MAX_POS, N_HEAD, N_LAYER, VOCAB


class TorchEncoderLM(nn.Module):
    """Embeddings -> nn.TransformerEncoder (causal) -> LayerNorm -> LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, HIDDEN)
        self.positions = nn.Embedding(MAX_POS, HIDDEN)
        layer = nn.TransformerEncoderLayer(HIDDEN, N_HEAD, FFN, dropout=0.0, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, N_LAYER, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        pos = torch.arange(t, device=input_ids.device)  # (T,)
        x = self.tokens(input_ids) + self.positions(pos)  # (B, T, C)
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=input_ids.device)  # (T, T) float -inf
        x = self.encoder(x, mask=mask, is_causal=True)
        return self.head(self.norm(x))  # (B, T, vocab)


class MHABlock(nn.Module):
    """Post-LN block: x + attention, norm, x + MLP, norm."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(HIDDEN, N_HEAD, dropout=0.0, batch_first=True)
        self.ln1 = nn.LayerNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, FFN)
        self.fc2 = nn.Linear(FFN, HIDDEN)
        self.ln2 = nn.LayerNorm(HIDDEN)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        y, _ = self.attn(x, x, x, attn_mask=mask, need_weights=False)
        x = self.ln1(x + y)
        return self.ln2(x + self.fc2(torch.relu(self.fc1(x))))


class TorchMHALM(nn.Module):
    """Token embedding -> MHA blocks (causal boolean mask) -> tied LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList([MHABlock() for _ in range(N_LAYER)])
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        # True where attention is not allowed: the future.
        mask = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).triu(1)  # (T, T)
        x = self.tokens(input_ids)  # (B, T, C)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)  # (B, T, vocab)


TORCH_MODELS = {"transformer_encoder": TorchEncoderLM, "multihead_attention": TorchMHALM}
