"""``pm.generate``: new tokens from a causal language model, greedy or sampled, on every rank alike.

Each new token is one forward of the parallel model (``pm(ids)``, which returns the same logits on every rank), at a
length padded up to a multiple of ``bucket``: a causal model's logits at a position read no later position, so the
padding changes nothing, and a sequence of new tokens captures once per bucket, not once per length. Whether the
model is causal is checked at the first call, against a forward at the exact length: where the logits differ (the
model reads the padding), generation runs at exact lengths, with a warning. No KV cache: each token runs the whole
sequence (the parallel program is the training one's forward).

Sampling (``do_sample=True``) draws with torch's generator on every rank from the same logits, so every rank
draws the same tokens; the unsharded model under the same seed draws the same where its probabilities are the same
(they differ in the last bits under tp, which can, rarely, change a draw).
"""

from __future__ import annotations

import warnings

import torch


def generate(pm, input_ids: torch.Tensor, *, max_new_tokens: int, attention_mask: torch.Tensor | None = None,
             do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
             eos_token_id: int | None = None, pad_token_id: int | None = None, bucket: int = 32,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """``input_ids`` (batch, prompt) followed by up to ``max_new_tokens`` new tokens each (``pad_token_id`` after a
    row's ``eos_token_id``), as HuggingFace's ``generate`` returns them for prompts of one length."""
    if input_ids.dim() != 2 or input_ids.is_floating_point():
        raise ValueError(f"generate takes token ids of shape (batch, prompt length); got {input_ids.dtype} of shape "
                         f"{tuple(input_ids.shape)}")
    if max_new_tokens < 1 or bucket < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} and bucket={bucket} must be at least 1")
    config = getattr(pm.model, "config", None)
    eos = eos_token_id if eos_token_id is not None else getattr(config, "eos_token_id", None)
    eos = eos[0] if isinstance(eos, (list, tuple)) else eos
    pad = pad_token_id if pad_token_id is not None else getattr(config, "pad_token_id", None)
    pad = pad if pad is not None else (eos if eos is not None else 0)
    longest = _max_positions(config)
    ids, mask = input_ids, attention_mask
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    for _ in range(max_new_tokens):
        logits = _last_logits(pm, ids, mask, bucket, longest)
        if do_sample:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[..., -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            chosen = torch.multinomial(torch.softmax(logits.float(), dim=-1), 1, generator=generator).squeeze(1)
        else:
            chosen = logits.argmax(dim=-1)
        chosen = torch.where(done, torch.full_like(chosen, pad), chosen)
        ids = torch.cat([ids, chosen[:, None]], dim=1)
        if mask is not None:
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        if eos is not None:
            done |= chosen == eos
            if bool(done.all()):
                break
    return ids


def _last_logits(pm, ids: torch.Tensor, mask, bucket: int, longest: int | None) -> torch.Tensor:
    """The logits of the next token of each row, from a forward padded up to a multiple of ``bucket`` (with id 0:
    in every vocabulary, and never read)."""
    n = ids.shape[1]
    length = -(-n // bucket) * bucket
    if longest is not None:
        length = min(length, max(longest, n))
    if pm.padding_is_read:  # the model reads the padding: exact lengths
        length = n
    logits = _logits(pm, _padded(ids, length, 0), None if mask is None else _padded(mask, length, 0))[:, n - 1]
    if length > n and pm.padding_is_read is None:
        exact = _logits(pm, ids, mask)[:, n - 1]
        agree = torch.allclose(logits.float(), exact.float(), rtol=1e-4, atol=1e-4 * float(exact.abs().max()))
        pm.padding_is_read = not agree
        if not agree:
            warnings.warn(f"autoshard: generate padded {type(pm.model).__name__}'s input from {n} to {length} tokens "
                          "and its logits at the last real token changed (the model is not causal, or reads the "
                          "padding): it generates at exact lengths instead, one capture per length", stacklevel=3)
            return exact
    return logits


def _logits(pm, ids: torch.Tensor, mask) -> torch.Tensor:
    output = pm(ids) if mask is None else pm(ids, mask)
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, (tuple, list)):
        logits = output[0]
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise ValueError(f"generate reads next-token logits of shape (batch, length, vocab) from the model's output, "
                         f"and {type(pm.model).__name__} returned {type(output).__name__}: generate needs a causal LM")
    return logits


def _padded(t: torch.Tensor, length: int, value: int) -> torch.Tensor:
    if t.shape[1] >= length:
        return t
    return torch.cat([t, torch.full((t.shape[0], length - t.shape[1]), value, dtype=t.dtype, device=t.device)], 1)


def _max_positions(config) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "block_size"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
