"""What the planner reasons about: a transformer, a cluster, and a split of the cluster's GPUs.

Terms (see also ``autoshard.mesh``):

- A **split** is a mesh (the degrees ``dp, tp, pp, cp``) plus how a step runs on it: ``microbatches``
  (m) per pipeline, ``interleave`` (v, chunks per pipeline rank), ``microbatch_size`` (b, sequences per
  microbatch) and ``recompute`` (``"none"`` or ``"full"`` activation recomputation). Every training step
  consumes ``global_batch = b * m * dp`` sequences.
- The **global batch** is counted in sequences of ``seq`` tokens.
- A **node** is a group of ``gpus_per_node`` GPUs sharing the fast link (NVLink); nodes talk over the
  network. Bandwidths are per GPU and per direction: on a node with one network card per GPU the
  network bandwidth of a GPU is its card's.

All three are frozen dataclasses with keyword-only fields; memory, bandwidth, compute rate and latency
fields also accept text with units (``"80GB"``), read by :func:`autoshard.planner.units.parse`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from autoshard import schedules
from autoshard.errors import AutoshardError
from autoshard.mesh import Mesh
from autoshard.planner import units

RECOMPUTE = ("none", "full")


class PlanError(AutoshardError, ValueError):
    """The request cannot be planned: says what is short, by how much, and what would work."""


# ------------------------------------------------------------------------------------------------- the model


@dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    """A decoder-only transformer: ``layers`` blocks of attention and MLP between an embedding and an LM head.

    ``kv_heads`` defaults to ``heads`` (multi-head attention; fewer is grouped-query attention), ``ffn`` to
    ``4 * hidden``. ``gated`` MLPs (SwiGLU) have three ``hidden x ffn`` matrices instead of two. A mixture of experts
    has ``experts`` MLPs of ``ffn`` per layer (each split over tp as a dense one is) and a router, and sends each
    token to ``experts_per_token`` of them. ``dtype_bytes`` is the size of a weight and an activation element: 2 for
    bf16/fp16, 4 for fp32. ``from_hf`` reads the model's part from a HuggingFace ``config.json``.
    """

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    global_batch: int
    kv_heads: int | None = None
    ffn: int | None = None
    gated: bool = False
    tied_embeddings: bool = False
    dtype_bytes: int = 2
    experts: int = 1
    experts_per_token: int = 1

    def __post_init__(self) -> None:
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.ffn is None:
            object.__setattr__(self, "ffn", 4 * self.hidden)
        for name in ("layers", "hidden", "heads", "vocab", "seq", "global_batch", "kv_heads", "ffn", "experts",
                     "experts_per_token"):
            _check_positive_int(name, getattr(self, name))
        if self.experts_per_token > self.experts:
            raise PlanError(f"experts_per_token={self.experts_per_token} is more than the {self.experts} experts: a "
                            f"token is routed to at most every expert")
        if self.dtype_bytes not in (1, 2, 4, 8):
            raise PlanError(f"dtype_bytes={self.dtype_bytes!r}: use 2 for bf16/fp16 or 4 for fp32")
        if self.hidden % self.heads:
            raise PlanError(f"hidden={self.hidden} is not divisible by heads={self.heads}: every head needs "
                            f"hidden/heads dims; use a head count that divides {self.hidden}")
        if self.heads % self.kv_heads:
            raise PlanError(f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}: grouped-query "
                            f"attention shares each kv head among heads/kv_heads query heads")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def parameters(self) -> int:
        """Every parameter: attention, MLP and two norms per layer, embedding, LM head (unless tied), final norm."""
        h, kv_dim = self.hidden, self.kv_heads * self.head_dim
        mlp = (3 if self.gated else 2) * h * self.ffn * self.experts + (h * self.experts if self.experts > 1 else 0)
        per_layer = 2 * h * h + 2 * h * kv_dim + mlp + 2 * h
        return self.layers * per_layer + (1 if self.tied_embeddings else 2) * self.vocab * h + h

    @classmethod
    def from_hf(cls, config: dict, **given) -> TransformerConfig:
        """The model of a HuggingFace ``config.json`` (its dict): layers, hidden, heads, kv heads, ffn (the experts'
        where they have their own), vocabulary, a gated MLP (a SiLU or gated activation), tied embeddings and the
        experts; ``given`` (``seq``, ``global_batch``, and any field to override) wins over what the file says."""
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        read = {
            "layers": _first(text, "num_hidden_layers", "n_layer", "num_layers"),
            "hidden": _first(text, "hidden_size", "n_embd", "d_model"),
            "heads": _first(text, "num_attention_heads", "n_head", "num_heads"),
            "kv_heads": _first(text, "num_key_value_heads", "num_kv_heads", "multi_query_group_num"),
            "vocab": _first(text, "vocab_size"),
            "experts": _first(text, "num_local_experts", "num_experts", "n_routed_experts"),
            "experts_per_token": _first(text, "num_experts_per_tok", "moe_top_k"),
        }
        moe = (read["experts"] or 1) > 1
        read["ffn"] = (_first(text, "moe_intermediate_size") if moe else None) or _first(
            text, "intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size")
        act = str(_first(text, "hidden_act", "hidden_activation", "activation_function") or "")
        read["gated"] = act in _GATED_ACTIVATIONS or text.get("model_type") in _GATED_FAMILIES
        read["tied_embeddings"] = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", True)))
        missing = [k for k in ("layers", "hidden", "heads", "vocab") if read[k] is None and k not in given]
        if missing:
            raise PlanError(f"the config gives no {', '.join(missing)} (model_type {text.get('model_type')!r}): "
                            f"pass {' '.join('--' + k for k in missing)}")
        fields = {k: v for k, v in read.items() if v is not None}
        return cls(**{**fields, **{k: v for k, v in given.items() if v is not None}})


# A SiLU MLP in HuggingFace's families is SwiGLU's (three matrices); these activations and families are gated.
_GATED_ACTIVATIONS = {"silu", "swish", "swiglu", "geglu", "gelu_pytorch_tanh"}
_GATED_FAMILIES = {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
                   "gemma3_text", "olmo", "olmo2", "olmoe", "deepseek_v3", "granite", "phi3", "cohere"}


def _first(config: dict, *keys: str):
    return next((config[k] for k in keys if config.get(k) is not None), None)


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"{name}={value!r} is not a whole number: give {name} as a positive integer")
    if value < 1:
        raise PlanError(f"{name}={value} is not positive: {name} must be at least 1")


# ----------------------------------------------------------------------------------------------- the cluster

_UNIT_FIELDS = {
    "gpu_memory": "bytes",
    "intra_bandwidth": "bandwidth",
    "inter_bandwidth": "bandwidth",
    "intra_latency": "time",
    "inter_latency": "time",
    "peak_flops": "flops",
}

PRESETS: dict[str, dict[str, str | float]] = {
    # H100 SXM (DGX/HGX H100): NVLink 4 at 450 GB/s per direction (the 900 GB/s on the data sheet counts both),
    # one 400 Gb/s NDR InfiniBand card per GPU, 989 TFLOP/s dense bf16.
    "h100": dict(gpu_memory="80GB", intra_bandwidth="450GB/s", inter_bandwidth="400Gb/s", intra_latency="1us",
                 inter_latency="5us", peak_flops="989TFLOPS"),
    # A100 SXM 80 GB (DGX A100): NVLink 3 at 300 GB/s per direction, one 200 Gb/s HDR card per GPU, 312 TFLOP/s bf16.
    "a100": dict(gpu_memory="80GB", intra_bandwidth="300GB/s", inter_bandwidth="200Gb/s", intra_latency="1us",
                 inter_latency="5us", peak_flops="312TFLOPS"),
    # H200 SXM (HGX H200): an H100 with 141 GB of HBM3e; NVLink 4 and the 400 Gb/s card as H100's, 989 TFLOP/s bf16.
    "h200": dict(gpu_memory="141GB", intra_bandwidth="450GB/s", inter_bandwidth="400Gb/s", intra_latency="1us",
                 inter_latency="5us", peak_flops="989TFLOPS"),
    # B200 (HGX B200): 180 GB of HBM3e, NVLink 5 at 900 GB/s per direction, a 400 Gb/s card per GPU, 2.25 PFLOP/s
    # dense bf16.
    "b200": dict(gpu_memory="180GB", intra_bandwidth="900GB/s", inter_bandwidth="400Gb/s", intra_latency="1us",
                 inter_latency="5us", peak_flops="2250TFLOPS"),
}
DEFAULT_PRESET = "h100"


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """GPUs, how they are grouped into nodes, and what each one can do. Defaults: the ``h100`` preset.

    ``efficiency`` is the fraction of ``peak_flops`` a GPU's matmuls reach in practice (0.5 is typical of
    large-model training). ``usable_memory`` is the fraction of ``gpu_memory`` the plan may fill; the
    rest is left for the CUDA context, communication buffers and the allocator's fragmentation.
    """

    gpus: int
    gpus_per_node: int = 8
    gpu_memory: float | str = PRESETS[DEFAULT_PRESET]["gpu_memory"]
    intra_bandwidth: float | str = PRESETS[DEFAULT_PRESET]["intra_bandwidth"]
    inter_bandwidth: float | str = PRESETS[DEFAULT_PRESET]["inter_bandwidth"]
    intra_latency: float | str = PRESETS[DEFAULT_PRESET]["intra_latency"]
    inter_latency: float | str = PRESETS[DEFAULT_PRESET]["inter_latency"]
    peak_flops: float | str = PRESETS[DEFAULT_PRESET]["peak_flops"]
    efficiency: float = 0.5
    usable_memory: float = 0.9
    gpu: str = DEFAULT_PRESET  # the preset the GPU's fields come from (``preset``), named where estimates are shown

    def __post_init__(self) -> None:
        _check_positive_int("gpus", self.gpus)
        _check_positive_int("gpus_per_node", self.gpus_per_node)
        for name, kind in _UNIT_FIELDS.items():
            try:
                object.__setattr__(self, name, units.parse(getattr(self, name), kind))
            except units.UnitError as e:
                raise PlanError(f"{name}: {e}") from e
        for name in ("gpu_memory", "intra_bandwidth", "inter_bandwidth", "peak_flops"):
            if getattr(self, name) <= 0:
                raise PlanError(f"{name} is 0: a GPU needs some {name.replace('_', ' ')}")
        for name in ("efficiency", "usable_memory"):
            if not 0 < getattr(self, name) <= 1:
                raise PlanError(f"{name}={getattr(self, name)!r} must be a fraction in (0, 1], e.g. 0.5")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            below = self.gpus // self.gpus_per_node * self.gpus_per_node
            raise PlanError(f"{self.gpus} GPUs do not fill whole nodes of {self.gpus_per_node}: use {below} or "
                            f"{below + self.gpus_per_node} GPUs, or give the real --gpus-per-node")

    @classmethod
    def preset(cls, name: str, **overrides: object) -> Cluster:
        """A cluster of the named GPU (``PRESETS``), with any field overridden."""
        if name not in PRESETS:
            raise PlanError(f"unknown GPU preset {name!r}: the presets are {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides, "gpu": name})  # type: ignore[arg-type]

    @property
    def device(self) -> str:
        """The GPU the estimates model, as reports name it beside them: its preset, and the fields given in place of
        the preset's own (``the H100 preset``, ``the H100 preset with peak_flops, gpu_memory given``)."""
        preset = PRESETS.get(self.gpu)
        if preset is None:
            return self.gpu
        given = [name for name, kind in _UNIT_FIELDS.items() if getattr(self, name) != units.parse(preset[name], kind)]
        return f"the {self.gpu.upper()} preset" + (f" with {', '.join(given)} given" if given else "")

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.gpus_per_node)

    def with_gpus(self, gpus: int) -> Cluster:
        return replace(self, gpus=gpus)

    def spans_nodes(self, span: int) -> bool:
        """Whether an aligned block of ``span`` consecutive ranks can straddle two nodes."""
        return span > self.gpus_per_node or self.gpus_per_node % span != 0

    def link(self, span: int) -> tuple[float, float, str]:
        """(bandwidth, latency, name) of the slowest link inside an aligned block of ``span`` ranks."""
        if self.spans_nodes(span):
            return self.inter_bandwidth, self.inter_latency, "network"
        return self.intra_bandwidth, self.intra_latency, "NVLink"


# ------------------------------------------------------------------------------------------------- the split


@dataclass(frozen=True, kw_only=True)
class Split:
    """A mesh and how a training step runs on it. See the module docstring for the terms."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1  # expert parallelism, carved from dp
    microbatches: int = 1
    interleave: int = 1
    microbatch_size: int = 1
    recompute: str = "none"
    shard_optimizer: bool = False
    zero_bubble: bool = False  # ZB-H1 at interleave 1, ZBV at interleave 2
    sequence_parallel: bool = False  # what tp replicates split over tp along the sequence

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name not in ("recompute", "shard_optimizer", "zero_bubble", "sequence_parallel"):
                _check_positive_int(f.name, getattr(self, f.name))
        if self.recompute not in RECOMPUTE:
            raise PlanError(f"recompute={self.recompute!r}: use one of {', '.join(map(repr, RECOMPUTE))}")
        if self.zero_bubble and self.interleave > 2:
            raise PlanError(f"zero-bubble schedules run 1 (ZB-H1) or 2 (ZBV) chunks per rank, not {self.interleave}")

    @property
    def mesh(self) -> Mesh:
        return Mesh(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep)

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def schedule(self) -> str:
        """The pipeline schedule's name in ``autoshard.schedules``."""
        return str(schedules.named(self.interleave, self.zero_bubble))

    def short(self) -> str:
        """``dp=32 tp=8 pp=16 cp=1 m=64 b=1 v=4``, plus ``recompute`` when on."""
        text = (f"dp={self.dp} tp={self.tp} pp={self.pp} cp={self.cp} m={self.microbatches} "
                f"b={self.microbatch_size} v={self.interleave}")
        return (text + (" recompute=full" if self.recompute == "full" else "") + (" zb" if self.zero_bubble else "")
                + (" sp" if self.sequence_parallel else "") + (f" ep={self.ep}" if self.ep > 1 else ""))
