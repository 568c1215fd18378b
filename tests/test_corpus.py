"""A sample of the architecture corpus, one architecture per family a compiler has to get right.

The whole corpus (``make corpus``, bench/corpus.md) takes long; this sample keeps every distinct family
in ``make test-full``: each architecture golden at tp=2, a few also at dp=2, pp=2 or cp=2 (``make test``, the CI
tier, runs the cells that bring a mesh, and those a seeded bug or a note names: tests/harness/tiers.py). A cell must be
exact or a clear refusal; never wrong, never an internal crash.
"""

from __future__ import annotations

import pytest
import torch
from corpus import build, cells, names, shrink

# architecture -> what it brings that the others do not
SAMPLE = {
    "llama": "grouped-query attention, RoPE, SwiGLU, untied head",
    "mistral": "GQA with a sliding window",
    "qwen2": "GQA with q/k/v biases",
    "qwen3": "QK-norm (RMSNorm per head on q and k)",
    "olmo2": "QK-norm over the whole projection, post-norm blocks",
    "gemma2": "logit softcapping, alternating sliding/full layers, tied head, scaled embedding",
    "falcon": "multi-query attention, parallel attention and MLP, fused qkv",
    "gpt_bigcode": "multi-query attention, fused qkv, tied head",
    "gpt_neox": "fused qkv per head, parallel residual, partial rotary",
    "phi": "partial rotary, parallel block, dense bias",
    "gptj": "parallel block, interleaved rotary",
    "gpt2": "Conv1D weights stored (in, out), tied head",
    "bloom": "ALiBi, fused qkv",
    "mpt": "ALiBi without biases",
    "mixtral": "mixture of experts, top-2 routing",
    "qwen2_moe": "mixture of experts with a shared expert",
    "opt": "learned positions with an offset, ReLU MLP",
    "mvp": "attention written out as bmm over a merged (batch * heads) dim, masks added in between",
    "deepseek_v3": "multi-head latent attention (low-rank q and kv, a separate rope part), shared experts",
    "s2s/t5": "encoder-decoder, relative position buckets, tied head",
    "s2s/bart": "encoder-decoder, one embedding for encoder, decoder and head",
    "mlm/bert": "masked LM: bidirectional encoder, MLM head",
    "torch/transformer_encoder": "torch's nn.TransformerEncoder",
    "torch/multihead_attention": "torch's nn.MultiheadAttention, tied head",
    "phi3": "fused qkv and gate/up projections cut apart by slices",
    "xlm": "a mask expanded to the scores and filled in place, a key/value cache's empty start",
    "apertus": "xIELU activation (min, expm1) with learned scalars",
    "gpt_oss": "attention sinks, experts with interleaved gate/up, biases and a clamped GLU",
    "qwen3_next": "gated delta rule linear attention (causal conv, chunked recurrence) beside full attention",
    "vision/vit": "an image classifier: patches from a strided conv, a class token, no token ids",
}

CELLS = [(name, "tp2") for name in SAMPLE] + [
    ("gpt_neox", "dp2"),
    ("mixtral", "dp2"),
    ("llama", "pp2"),
    ("s2s/bart", "pp2"),
    ("qwen3", "cp2"),
    ("mistral", "cp2"),
    ("jetmoe", "cp2"),  # attention whose cp kernel lays its output out otherwise than the whole sequence's
    ("rwkv", "cp2"),  # no attention: a recurrence writing out[:, t] = state, run on the gathered sequence
    ("qwen3_next", "cp2"),  # linear attention's sequence merged with heads into one dim
    ("vision/vit", "cp2"),  # the split starts at the patches; 16 patches and a class token split 9 and 8
    ("deepseek_v3", "cp2ring"),  # values narrower than keys: ring pieces off the fused kernel
    ("llama", "cp2alltoall"),
    ("jetmoe", "tp2"),  # experts looped over W[i] of a stack, captured as grouped matmuls; attention experts
    ("mixtral", "tp4"),  # experts split four ways
    ("qwen2_moe", "tp4"),
    ("gpt_oss", "tp4"),
    ("xlnet", "tp4"),  # attention as einsums over (hidden, heads, head dim) weights: one head per rank
    ("whisper", "tp4"),  # positions read as table[ids]: a vocab-parallel lookup
    ("hy_v4", "tp4"),  # hyper-connections mixing their streams with weights read cast: rows alone
    ("deepseek_v4", "tp2"),  # a grouped output projection (bmm over weight.view(groups, rank, in)) and its mix
    ("mamba2", "tp4"),  # in_proj's x, B and C cut apart after the conv: one column blocked at every cut
    ("vision/siglip", "tp2"),  # a pooling head's nn.MultiheadAttention cutting its packed in_proj into pieces
    ("llama4_text", "tp4"),
    ("roc_bert", "pp2"),  # stages held within 1.2x an even share of the parameters
    ("recurrent_gemma", "pp2"),  # a balanced cut where transposed values cross
    ("hy_v4", "pp2"),  # an indexer's weights on both stages, read only without gradients: they get none
    ("mixtral", "pp2zbv"),  # experts' weight gradients deferred; a V of four stages
    ("s2s/t5", "pp2zbv"),  # an encoder-decoder's shared embedding on three stages
    ("falcon_mamba", "pp2zbv"),  # a stage hands on a weight as it is (D.float() of a float D)
    ("falcon", "tp2sp"),  # keys and values one row-parallel product makes whole stay all-reduced
    ("deepseek_v3", "tp2sp"),  # low-rank attention projections and routed experts on split tokens
    ("zaya", "tp2sp"),  # a router's probabilities detached on split tokens
]


@pytest.mark.parametrize("name,mesh", [pytest.param(n, m, id=f"{n}-{m}") for n, m in CELLS])
def test_corpus_cell_is_exact_or_refused(pools, name, mesh):
    degrees, options = cells.MESHES[mesh]
    pool = pools.get(cells.world_size(mesh))
    found = cells.outcome(pool.run(cells.run_cell, name, degrees, **options))
    if found.message.startswith("ranks disagree"):
        pool.broken = True  # some groups may be mid-collective: the next test gets a fresh pool
        pool.close()
    assert found.status in ("exact", "refused"), found.text()


def test_the_corpus_holds_every_causal_lm_and_the_other_families():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    every = names()
    assert set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) <= set(every)
    assert set(SAMPLE) <= set(every)
    assert any(n.startswith("s2s/") for n in every) and any(n.startswith("mlm/") for n in every)


@pytest.mark.parametrize("name", ["llama", "falcon", "mixtral", "gemma2", "s2s/t5"])
def test_a_shrunk_architecture_is_tiny_seeded_and_keeps_its_family(name):
    case, again = build(name), build(name)
    config = getattr(case.model, "model", case.model).config
    assert config.vocab_size == shrink.VOCAB and not config.use_cache
    assert sum(p.numel() for p in case.model.parameters()) < 500_000
    for (n, p), (_, q) in zip(case.model.named_parameters(), again.model.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    assert all(torch.equal(a, b) for a, b in zip(case.inputs, again.inputs, strict=True))
    assert int(case.inputs[0].max()) < shrink.VOCAB and (case.target == -100).any()
    if name == "falcon":
        assert config.multi_query  # multi-query stays multi-query
    if name == "llama":
        assert (config.num_attention_heads, config.num_key_value_heads) == (shrink.N_HEAD, shrink.N_KV_HEAD)
    if name == "mixtral":
        assert (config.num_local_experts, config.num_experts_per_tok) == (shrink.N_EXPERT, shrink.TOP_K)
    if name == "gemma2":
        assert set(config.layer_types) == {"sliding_attention", "full_attention"}
        assert config.sliding_window < case.inputs[0].shape[1]  # the window shows in the mask
