"""The corpus's architectures: every causal LM of the installed transformers, a few encoder-decoder, masked-LM
and image-classifier families, and torch's own transformer modules; each built tiny, seeded, with its data.

Names: a causal LM is named by its ``model_type`` (``llama``); a masked LM ``mlm/<type>``; an
encoder-decoder ``s2s/<type>``; an image classifier ``vision/<type>``; torch's modules ``torch/<name>``.
``build(name)`` returns a ``ZooCase`` (tests/harness/models.py) exactly as the zoo does, so the golden harness runs it
unchanged.

Data as the zoo's: token ids and targets with ignored targets spread unevenly, batch 8, and a
sequence of 24 (not the zoo's 16: a head dim of 64 / 4 = 16 would equal it). Encoder-decoders get
decoder ids of their own. Image classifiers get 16 x 16 images (16 patches of 4 x 4) and one of 5 classes
each. Constant parameters get seeded noise (``_perturb_constant_params``).
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from corpus import shrink
from corpus.torch_models import TORCH_MODELS

from harness.models import ZooCase, _perturb_constant_params, hf_token_loss, token_data

BATCH = 8
SEQ = 24

MASKED_LM = ("bert", "roberta", "distilbert", "albert", "electra", "deberta-v2", "modernbert", "mpnet", "esm")
SEQ2SEQ = ("t5", "bart", "mbart", "marian", "pegasus", "m2m_100", "switch_transformers", "umt5", "t5gemma")
VISION = ("vit", "deit", "beit", "dinov2", "siglip", "ijepa", "data2vec-vision", "vit_msn", "clip")
IMAGE, PATCH, CLASSES = 16, 4, 5
VISION_SIZES = {"image_size": IMAGE, "patch_size": PATCH, "num_channels": 3}

# Per-family config fixes the generic shrink cannot infer (field values, not code).
FAMILY_FIXES: dict[str, dict] = {
    "falcon": {"new_decoder_architecture": False, "multi_query": True, "parallel_attn": True},
    "gpt_bigcode": {"multi_query": True},
    "mpt": {"attn_config": {"alibi": True}},
    "zaya": {"num_experts_per_tok": 1},
    "deepseek_v2": {"num_experts_per_tok": 2},
    "mamba2": {"num_heads": 8},
    "jamba": {"attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 1, "expert_layer_period": 2},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    "reformer": {"axial_pos_shape": [4, 6], "axial_pos_embds_dim": [32, 32], "attn_layers": ["local", "lsh"],
                 "local_attn_chunk_length": 8, "lsh_attn_chunk_length": 8, "is_decoder": True},
    "gemma2": {"final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
}


def _mapping(kind: str) -> dict[str, str]:
    from transformers.models.auto import modeling_auto as auto

    return {
        "clm": auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        "mlm": auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        "s2s": auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        "vision": auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
    }[kind]


def names() -> list[str]:
    """Every architecture of the corpus, causal LMs first (sorted), then the other families."""
    causal = sorted(_mapping("clm"))
    return (causal + [f"mlm/{t}" for t in MASKED_LM if t in _mapping("mlm")]
            + [f"s2s/{t}" for t in SEQ2SEQ if t in _mapping("s2s")]
            + [f"vision/{t}" for t in VISION if t in _mapping("vision")] + [f"torch/{n}" for n in TORCH_MODELS])


def _kind_and_type(name: str) -> tuple[str, str]:
    kind, _, model_type = name.rpartition("/")
    return kind or "clm", model_type


def tiny_config(name: str):
    """The shrunk transformers config of a corpus architecture (no downloads)."""
    from transformers import CONFIG_MAPPING

    kind, model_type = _kind_and_type(name)
    config_class = CONFIG_MAPPING[model_type]
    tiny = shrink.shrink_dict(config_class().to_dict(), FAMILY_FIXES.get(model_type))
    if kind == "clm" and "is_decoder" in tiny and model_type in _mapping("mlm"):
        tiny["is_decoder"] = True  # BERT-like encoders as causal LMs
    if kind == "vision":
        for sub in [tiny, *(v for v in tiny.values() if isinstance(v, dict) and "image_size" in v)]:
            sub.update({k: v for k, v in VISION_SIZES.items() if k in sub})
        tiny.update(num_labels=CLASSES, id2label={i: str(i) for i in range(CLASSES)},
                    label2id={str(i): i for i in range(CLASSES)})
        if "out_features" in tiny:  # backbone outputs named after the default depth: the last of the tiny one
            tiny.update(out_features=[f"stage{shrink.N_LAYER}"], out_indices=[shrink.N_LAYER])
    config = config_class.from_dict(tiny)
    config.use_cache = False  # export rejects a returned cache object
    with contextlib.suppress(ValueError):  # several text configs (musicgen): the model class picks one later
        config.get_text_config().use_cache = False
    return config


def _hf_model(name: str) -> tuple[nn.Module, set[int]]:
    import transformers

    kind, model_type = _kind_and_type(name)
    config = tiny_config(name)
    class_name = _mapping(kind)[model_type]
    model_class = getattr(transformers, class_name if isinstance(class_name, str) else class_name[0])
    if not isinstance(config, model_class.config_class):
        config = _sub_config(config, model_class.config_class)  # a text-only LM class of a multimodal family
    model = model_class._from_config(config)
    return model, shrink.media_token_ids(config.to_dict())


def _sub_config(config, wanted: type):
    """The sub-config of ``config`` that ``wanted`` (a model class's config class) builds from."""
    for key in ("text_config", "decoder", "text_encoder"):
        sub = getattr(config, key, None)
        if isinstance(sub, wanted):
            return sub
    return config.get_text_config()


class Seq2Seq(nn.Module):
    """An encoder-decoder called as users call it: ``model(input_ids=..., decoder_input_ids=...)``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor):
        return self.model(input_ids=input_ids, decoder_input_ids=decoder_input_ids, use_cache=False)


def _avoid(ids: torch.Tensor, banned: set[int], vocab: int) -> torch.Tensor:
    """Replace banned ids by the smallest allowed one (media placeholders need other inputs)."""
    allowed = next(i for i in range(vocab) if i not in banned)
    for b in banned:
        ids = torch.where(ids == b, torch.full_like(ids, allowed), ids)
    return ids


def build(name: str, *, seed: int = 0) -> ZooCase:
    """Build corpus architecture ``name``: the same seed gives bit-identical parameters and data."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    kind, model_type = _kind_and_type(name)
    torch.manual_seed(seed)
    if kind == "torch":
        model, banned, loss_fn = TORCH_MODELS[model_type](), set(), _plain_loss
    else:
        model, banned = _hf_model(name)
        loss_fn = hf_token_loss
    model.train()
    _perturb_constant_params(model, torch.Generator().manual_seed(seed + 1))
    gen = torch.Generator().manual_seed(seed + 2)
    input_ids, target = token_data(gen, batch=BATCH, seq=SEQ, vocab=shrink.VOCAB)
    inputs: tuple = (_avoid(input_ids, banned, shrink.VOCAB),)
    if kind == "vision":
        inputs = (torch.randn(BATCH, 3, IMAGE, IMAGE, generator=gen),)
        target, loss_fn = torch.randint(0, CLASSES, (BATCH,), generator=gen), _class_loss
    if kind == "s2s":
        model = Seq2Seq(model)
        decoder_ids = torch.randint(0, shrink.VOCAB, (BATCH, SEQ), generator=gen)
        inputs = (*inputs, _avoid(decoder_ids, banned, shrink.VOCAB))
    return ZooCase(name=name, model=model, inputs=inputs, target=target, loss_fn=loss_fn)


def _class_loss(output, target: torch.Tensor) -> torch.Tensor:
    logits = output.logits if hasattr(output, "logits") else output["logits"]
    return torch.nn.functional.cross_entropy(logits, target)


def _plain_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    from harness.models import token_loss

    return token_loss(logits, target)


def check_eager(name: str) -> str | None:
    """Why ``name`` cannot be built or trained eagerly at tiny size, or None when it can."""
    try:
        case = build(name)
        loss = case.loss_fn(case.model(*case.inputs), case.target)
        if loss.dim() != 0 or not torch.isfinite(loss):
            return f"loss is {loss.detach()} (not a finite scalar)"
        loss.backward()
        again = case.loss_fn(case.model(*case.inputs), case.target)
    except Exception as e:  # noqa: BLE001 - the reason is the whole point
        return f"{type(e).__name__}: {_first_line(e)}"
    if not torch.equal(loss.detach(), again.detach()):
        # Random in training mode (stochastic routing, dropout no config field reaches): no parallel program
        # can draw the same random numbers as the eager model, so a golden comparison means nothing.
        return "random in training mode: two forwards of the same batch give different losses"
    return None


def _first_line(e: BaseException) -> str:
    """The error's first line, and the next one where the first only says which validator failed."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    text = " ".join(lines[:2]) if lines and lines[0].endswith(":") else (lines[0] if lines else "")
    return text[:200]

