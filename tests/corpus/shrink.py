"""Shrink any transformers config to a tiny one, by the field names configs use for the same idea.

A corpus of about two hundred architectures cannot have a hand-written config each, so the shrink is
generic: every field name that some family uses for "layers", "hidden", "heads", ... that exists in a
config's defaults gets the tiny value, recursively into sub-configs (a text config inside a multimodal
one). Per-family fixes (``FAMILY_FIXES``) cover what the generic names do not reach.

Sizes (pairwise distinct where a compiler could confuse them; see tests/harness/models.py):

=================  =====  ===========================================================
layers                 2  per-layer lists (``layer_types``) keep one of each kind
hidden                64
heads                  4  kv heads 2 (GQA), or 1 where the family is multi-query
head dim              16
ffn                  128  experts' own widths 32
vocab                 96  divisible by 2, 4 and 8 (vocab-parallel)
experts                4  top-2, one shared expert where the family has them
max positions         40  longer than the sequence (24)
sliding window        12  shorter than the sequence, so the window shows in the mask
=================  =====  ===========================================================
"""

from __future__ import annotations

import copy
from typing import Any

N_LAYER = 2
HIDDEN = 64
N_HEAD = 4
N_KV_HEAD = 2
HEAD_DIM = 16
FFN = 128
EXPERT_FFN = 32
VOCAB = 96
N_EXPERT = 4
TOP_K = 2
MAX_POS = 40
WINDOW = 12

# Field name -> tiny value. A field is set only where the family's default config has it.
_SIZES: dict[str, Any] = {
    **dict.fromkeys(
        ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_decoder_layers", "num_encoder_layers",
         "encoder_layers", "decoder_layers", "num_text_layers"), N_LAYER),
    **dict.fromkeys(
        ("hidden_size", "n_embd", "d_model", "n_embed", "embed_dim", "model_dim", "word_embed_proj_dim",
         "embedding_size", "dim", "d_embed", "text_hidden_size", "emb_dim", "shape_embed_dim",
         "pronunciation_embed_dim"), HIDDEN),
    **dict.fromkeys(
        ("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
         "decoder_attention_heads"), N_HEAD),
    **dict.fromkeys(("head_dim", "kv_channels", "d_kv", "attention_head_dim", "qk_nope_head_dim", "v_head_dim",
                     "head_size"), HEAD_DIM),
    **dict.fromkeys(
        ("intermediate_size", "ffn_dim", "n_inner", "d_ff", "encoder_ffn_dim", "decoder_ffn_dim",
         "ffn_hidden_size", "intermediate_size_mlp", "dim_feedforward", "inner_hidden_size", "ffn_embed_dim",
         "dense_intermediate_size", "dim_ff", "dff"), FFN),
    **dict.fromkeys(
        ("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size",
         "moe_ffn_hidden_size", "shared_intermediate_size", "expert_dim"), EXPERT_FFN),
    **dict.fromkeys(("vocab_size", "decoder_vocab_size", "src_vocab_size", "tgt_vocab_size",
                     "vocab_size_per_layer_input", "unpadded_vocab_size", "shape_vocab_size",
                     "pronunciation_vocab_size"), VOCAB),
    "hidden_size_per_layer_input": HEAD_DIM,
    **dict.fromkeys(
        ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts"), N_EXPERT),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "num_selected_experts", "moe_k", "experts_per_token",
                     "num_experts_per_token", "top_k_experts"), TOP_K),
    **dict.fromkeys(
        ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length",
         "max_target_positions", "max_source_positions"), MAX_POS),
    "linear_num_heads": N_HEAD,
    "linear_head_dim": HEAD_DIM,
    "d_head": HEAD_DIM,
    "qk_rope_head_dim": 8,
    "qk_head_dim": HEAD_DIM + 8,
    "rotary_dim": 8,
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "decoder_sparse_step": 1,
    "use_cache": False,
    "output_router_logits": False,
}
_EVEN_IF_NONE = ("n_inner", "vocab_size", "head_dim")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num", "num_key_value_groups")
_FLOAT_ZERO = ("dropout", "pdrop", "drop_rate", "layerdrop", "drop_path")
# Token ids the data must not contain: they switch a model to an image/audio path needing other inputs.
MEDIA_WORDS = ("image", "video", "audio", "vision", "boi", "eoi", "boa", "eoa", "media", "speech", "vq")


def shrink_dict(defaults: dict[str, Any], fixes: dict[str, Any] | None = None) -> dict[str, Any]:
    """The tiny version of one config's ``to_dict()``: tiny sizes, no dropout, ids inside the vocabulary."""
    out = copy.deepcopy(defaults)
    n_layers = next((defaults[k] for k in ("num_hidden_layers", "n_layer", "num_layers") if
                     isinstance(defaults.get(k), int)), None)
    for key, value in defaults.items():
        if isinstance(value, dict) and "model_type" in value:
            out[key] = shrink_dict(value)  # a sub-config (text, vision, encoder, decoder)
        elif key in _SIZES and (value is not None or key in _EVEN_IF_NONE) and not isinstance(value, bool | list):
            out[key] = _SIZES[key]
        elif key in _KV_HEADS and (isinstance(value, int) or value is None):
            out[key] = _kv_heads(value, defaults)
        elif key == "sliding_window" and isinstance(value, int) and not isinstance(value, bool):
            out[key] = WINDOW
        elif isinstance(value, float) and any(w in key for w in _FLOAT_ZERO):
            out[key] = 0.0
        elif isinstance(value, list) and n_layers and len(value) == n_layers and n_layers > N_LAYER:
            out[key] = _one_of_each(value)
    if isinstance(out.get("per_layer_config"), dict):
        out["per_layer_config"] = _first_layers(out["per_layer_config"])
    if "qk_rope_head_dim" in out and "head_dim" in out:
        out["head_dim"] = out["qk_rope_head_dim"]  # multi-head latent attention: RoPE covers the rope part only
    if isinstance(out.get("mamba_d_head"), int):  # SSM heads * head dim must equal expand * hidden
        out.update(mamba_d_head=HEAD_DIM, mamba_n_heads=out.get("mamba_expand", 2) * HIDDEN // HEAD_DIM)
        if "mamba_d_ssm" in out:
            out["mamba_d_ssm"] = out["mamba_n_heads"] * HEAD_DIM
    if isinstance(out.get("n_shared_experts"), int) and out["n_shared_experts"] > 1:
        out["n_shared_experts"] = 1
    for key, value in (fixes or {}).items():
        out[key] = {**out[key], **value} if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    _ids_inside_vocab(out)
    return out


def _kv_heads(value: int | None, defaults: dict[str, Any]) -> int:
    """Multi-query stays multi-query, latent attention (MLA) keeps one kv head per head, the rest GQA."""
    if value == 1:
        return 1
    return N_HEAD if "kv_lora_rank" in defaults else N_KV_HEAD


def _one_of_each(per_layer: list) -> list:
    """Two layers' entries: the first layer's, and the first that differs from it (if any)."""
    first = per_layer[0]
    other = next((v for v in per_layer[1:] if v != first), per_layer[1])
    return [first, other]


def _first_layers(per_layer: dict) -> dict:
    """Overrides keyed by layer index: those of the first two layers, else the first one moved to layer 1."""
    kept = {k: v for k, v in per_layer.items() if int(k) < N_LAYER}
    if kept or not per_layer:
        return kept
    first = min(per_layer, key=int)
    return {type(first)(1) if isinstance(first, int) else "1": per_layer[first]}


def _ids_inside_vocab(cfg: dict[str, Any]) -> None:
    """Move every special token id at or past the vocabulary to a distinct id near its end."""
    vocab = cfg.get("vocab_size")
    if not isinstance(vocab, int):
        return
    spare = iter(range(vocab - 1, vocab // 2, -1))
    taken: dict[int, int] = {}
    for key in sorted(cfg):
        if not (key.endswith("token_id") or key.endswith("token_ids") or key.endswith("token_index")):
            continue
        value = cfg[key]
        if isinstance(value, int) and not isinstance(value, bool) and value >= vocab:
            cfg[key] = taken.setdefault(value, next(spare))
        elif isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            cfg[key] = [taken.setdefault(v, next(spare)) if v >= vocab else v for v in value]


def media_token_ids(cfg: dict[str, Any]) -> set[int]:
    """Ids of image/audio placeholder tokens: random data must avoid them (they need pixel or audio inputs)."""
    ids: set[int] = set()
    for key, value in cfg.items():
        if isinstance(value, dict) and "model_type" in value:
            ids |= media_token_ids(value)
        elif ("token" in key or key.endswith("_index")) and any(w in key for w in MEDIA_WORDS):
            if isinstance(value, int) and not isinstance(value, bool):
                ids.add(value)
            elif isinstance(value, list):
                ids |= {v for v in value if isinstance(v, int)}
    return ids
