"""The cost model: per-GPU memory and step time of a split, as sympy formulas.

Every quantity is a named formula (``FORMULAS``) over the symbols in ``SYMBOLS`` and the quantities
defined before it, so a report prints each one as it is used and :func:`solve_for` solves any of
them for a bound, e.g. the microbatches that keep the bubble at 5%::

    solve_for("bubble", sympy.Rational(1, 20), "m", pp=16)      # -> 285 (m >= 19*pp - 19 when v = 1)

:func:`evaluate` gives the numbers for one split; it compiles the formulas once, with
``sympy.lambdify``, so a search can evaluate tens of thousands of splits in about a second.

Assumptions, each a term of a formula below:

- **Memory** on the fullest pipeline stage (the first: it holds the embedding and, under 1F1B, the
  most microbatches in flight). Mixed-precision Adam: weights and gradients in the training dtype
  (``beta`` bytes each), and ``o`` = 12 optimizer bytes per parameter (fp32 master weights, momentum,
  variance; 8 when the weights are fp32 already), divided over dp when the optimizer is sharded
  (ZeRO-1, ``z = 1``). Tensor parallelism shards the attention and MLP weights and the vocabulary;
  norms are replicated; kv heads are duplicated when ``tp`` exceeds them.
- **Activations** per layer and microbatch follow Korthikanti et al., "Reducing Activation
  Recomputation in Large Transformer Models": ``10 sbh`` bytes that tensor parallelism replicates
  (norm and block inputs, dropout masks; divided by tp too with sequence parallelism, ``q = 1``, which
  moves the same bytes: its reduce-scatters and all-gathers are the all-reduces' two halves) and
  ``(4 + 4 kv/a + 2 g f/h) sbh`` it shards (``34 sbh`` for a plain ``f = 4h`` MLP), with attention
  scores never stored (flash attention). Full recomputation
  keeps only each layer's input (``beta sbh``) and runs the forward again in backward. The schedule
  sets how many microbatches the first stage holds: ``min(m, pp)`` for 1F1B and the zero-bubble ZB-H1
  and ZBV, ``min(m, pp + (pp-1)/v)`` stage-equivalents for interleaved 1F1B with m a multiple of pp (all
  checked against ``autoshard.schedules.simulate``; the search only interleaves such m).
  Plus one layer's working set and the last stage's fp32 logits.
- **Compute**: a training step is three forwards (four with full recomputation); a layer's forward is
  ``2 s N_layer + 2 s^2 h`` FLOPs (matmuls, then causal attention); GPUs reach ``eta`` of their peak.
  The LM head's cost is spread over the stages (the partitioner balances cost).
- **Communication** is not overlapped with compute, and a ring collective over ``n`` ranks costs
  ``2 (n-1) (latency + bytes / (n bandwidth))`` for an all-reduce. Each axis uses the slowest link
  its group crosses (``bw_tp``, ``lat_tp``, ...; NVLink inside a node, the network across nodes).
  TP: two all-reduces of the activation per layer forward, two backward (Megatron), two more to
  recompute. CP: ring attention passes each K/V chunk ``cp - 1`` times per pass. PP: each chunk
  sends its activation forward and its gradient back, per microbatch. DP: one all-reduce of the
  gradients per step (a reduce-scatter and all-gather of the same volume with ZeRO-1).
- **Step**: ``(m + (pp-1)/v) t_mb + t_dp``, so the pipeline's idle fraction is the seed's bubble
  ``(pp-1)/(m + pp-1)``, divided by ``v`` with interleaving. A zero-bubble schedule (``w = 1``: ZB-H1 at
  ``v = 1``, ZBV at ``v = 2``) splits each backward into input and weight gradients and fills the bubble with
  the weight part: with forward, input and weight gradients of one cost each the idle time is a third,
  ``(pp-1)/(3 v m + pp-1)``. The split's own cost (more, smaller kernels) is not modelled.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import sympy
from sympy import Eq, Max, Min, Piecewise, ceiling

from autoshard.planner.config import Cluster, Split, TransformerConfig

_S = sympy.Symbol


def _sym(name: str) -> sympy.Symbol:
    return _S(name, positive=True)


# The symbols formulas are written in, with what each one means.
SYMBOLS: dict[str, str] = {
    "L": "layers", "h": "hidden size", "a": "attention heads", "kv": "kv heads", "f": "ffn size",
    "g": "MLP matrices (2, or 3 when gated)", "E": "experts per layer (1: a dense MLP)",
    "x": "experts each token is routed to", "V": "vocabulary", "s": "sequence length",
    "beta": "bytes per weight and activation element", "o": "optimizer bytes per parameter",
    "tied": "1 when the embedding and LM head share weights",
    "dp": "data-parallel degree", "tp": "tensor-parallel degree", "pp": "pipeline stages",
    "cp": "context-parallel degree", "ep": "expert-parallel degree (carved from dp: each rank holds E/ep experts)",
    "m": "microbatches per step", "v": "chunks per pipeline rank (interleave)", "b": "sequences per microbatch",
    "r": "1 with full activation recomputation", "z": "1 when the optimizer state is sharded over dp",
    "w": "1 with a zero-bubble schedule (each backward split into input and weight gradients)",
    "q": "1 with sequence parallelism (what tp replicates split over tp along the sequence)",
    "F": "peak FLOP/s per GPU", "eta": "fraction of peak reached",
    **{f"bw_{axis}": f"bandwidth of the {axis} link (bytes/s)" for axis in ("tp", "cp", "pp", "dp", "ep")},
    **{f"lat_{axis}": f"latency of the {axis} link (s)" for axis in ("tp", "cp", "pp", "dp", "ep")},
}
SYM = {name: _sym(name) for name in SYMBOLS}
for _name in ("tied", "r", "z", "w", "q"):  # flags may be 0
    SYM[_name] = _S(_name, nonnegative=True, integer=True)


def _define() -> dict[str, tuple[sympy.Expr, str]]:
    """Each quantity's formula, in the symbols and the quantities defined before it, and what it is."""
    L, h, a, kv, f, g, V, s, beta, o, tied = (SYM[k] for k in ("L", "h", "a", "kv", "f", "g", "V", "s", "beta", "o",
                                                                 "tied"))
    E, x = SYM["E"], SYM["x"]
    dp, tp, pp, cp, m, v, b, r, z, w, q, F, eta = (SYM[k] for k in ("dp", "tp", "pp", "cp", "m", "v", "b", "r", "z",
                                                                     "w", "q", "F", "eta"))
    ep = SYM["ep"]
    Q = {name: _sym(name) for name in _ORDER}
    d, n, s_l, N_layer, N_gpu, A_keep, A_layer, k_in, t_comp, t_tp, t_cp, t_pp, t_mb, F_layer, F_head = (
        Q[k] for k in ("d", "n", "s_l", "N_layer", "N_gpu", "A_keep", "A_layer", "in_flight", "t_compute", "t_tp",
                       "t_cp", "t_pp", "t_microbatch", "F_layer", "F_head"))
    N_exp, t_ep = Q["N_experts"], Q["t_ep"]
    kv_local = Max(kv / tp, 1)
    ring = {axis: (SYM[f"lat_{axis}"], SYM[f"bw_{axis}"]) for axis in ("tp", "cp", "pp", "dp", "ep")}
    defs = {
        "d": (h / a, "head dim"),
        "n": (v * ceiling(L / (pp * v)), "layers on the fullest stage"),
        "s_l": (s / cp, "tokens of a sequence on one GPU"),
        "N_layer": ((2 * h**2 + g * h * f * E / ep) / tp + 2 * h * d * kv_local + 2 * h
                    + Piecewise((0, Eq(E, 1)), (h * E, True)),
                    "parameters of a layer on one GPU (its E/ep experts' MLPs split over tp, the router whole)"),
        "N_gpu": (n * N_layer + Piecewise((2 - tied, Eq(pp, 1)), (1, True)) * V * h / tp,
                  "parameters on the GPU: the fullest stage's layers and its embedding table(s)"),
        "N_experts": (Piecewise((0, Eq(E, 1)), (n * g * h * f * E / (ep * tp), True)),
                      "of those, the experts' (summed over the dp/ep ranks holding the same, not over dp)"),
        "M_weights": (beta * N_gpu, "weight bytes"),
        "M_grads": (beta * N_gpu, "gradient bytes"),
        "M_optimizer": (o * N_gpu / (1 + z * (dp - 1)), "optimizer-state bytes"),
        "A_keep": (b * s_l * h * (10 * (1 - q + q / tp) + (4 + 4 * kv / a + 2 * g * f * x / h) / tp) * beta / 2,
                   "activation bytes a layer keeps for backward, per microbatch"),
        "A_layer": ((1 - r) * A_keep + r * b * s_l * h * beta, "activation bytes kept per layer and microbatch"),
        "in_flight": (Piecewise((Min(m, pp), sympy.Or(Eq(v, 1), Eq(w, 1))), (Min(m, pp + (pp - 1) / v), True)),
                      "microbatches the first stage holds at once (stage-equivalents)"),
        "M_activations": (Max(k_in * n * A_layer, n * A_layer + 4 * b * s_l * V / tp) + A_keep,
                          "activation bytes: in-flight microbatches (or the last stage's fp32 logits), "
                          "plus one layer's working set"),
        "memory": (Q["M_weights"] + Q["M_grads"] + Q["M_optimizer"] + Q["M_activations"], "bytes per GPU"),
        "F_layer": (2 * s * (2 * h**2 + 2 * h * kv * d + g * h * f * x) + 2 * s**2 * h,
                    "forward FLOPs of a layer per sequence (each token through its x experts)"),
        "F_head": (2 * s * h * V, "forward FLOPs of the LM head per sequence"),
        "t_compute": (b * (n * (3 + r) * F_layer + 3 * F_head / pp) / (tp * cp) / (F * eta),
                      "compute time of a microbatch on a stage (forward and backward)"),
        "t_tp": (n * (4 + 2 * r) * 2 * (tp - 1) * (ring["tp"][0] + b * s_l * h * beta / (tp * ring["tp"][1])),
                 "TP all-reduce time of a microbatch on a stage"),
        "t_cp": (n * (3 + r) * (cp - 1) * (ring["cp"][0] + 2 * b * s_l * d * kv_local * beta / ring["cp"][1]),
                 "CP ring-attention time of a microbatch on a stage"),
        "t_pp": (2 * v * Min(pp - 1, 1) * (ring["pp"][0] + b * s_l * h * beta / ring["pp"][1]),
                 "PP send time of a microbatch on a stage"),
        "t_ep": (n * (4 + 2 * r) * Min(ep - 1, 1) * (ring["ep"][0] + b * s_l * x * h * beta * (ep - 1)
                                                      / (ep * ring["ep"][1])),
                 "EP all-to-all time of a microbatch on a stage (each token's x rows to their experts and back)"),
        "t_microbatch": (t_comp + t_tp + t_cp + t_pp + t_ep, "time of a microbatch on a stage"),
        "bubble": ((pp - 1) / ((1 + 2 * w) * v * m + pp - 1), "idle fraction of the pipeline"),
        "t_bubble": ((pp - 1) / ((1 + 2 * w) * v) * t_mb, "idle time while the pipeline fills and drains"),
        "t_dp": (2 * (dp - 1) * (ring["dp"][0] + beta * (N_gpu - N_exp) / (dp * ring["dp"][1]))
                 + 2 * (dp / ep - 1) * (ring["dp"][0] + beta * N_exp * ep / (dp * ring["dp"][1])),
                 "DP gradient all-reduce time (the experts' over their dp/ep replicas)"),
        "t_step": (m * t_mb + Q["t_bubble"] + Q["t_dp"], "time of a training step"),
        "mfu": (b * m * dp * 3 * (L * F_layer + F_head) / (dp * tp * pp * cp * F * Q["t_step"]),
                "model FLOPs utilisation: useful FLOPs / (GPUs * peak * step time)"),
    }
    assert list(defs) == list(_ORDER), "FORMULAS must be defined in _ORDER"
    return defs


_ORDER = ("d", "n", "s_l", "N_layer", "N_gpu", "N_experts", "M_weights", "M_grads", "M_optimizer", "A_keep",
          "A_layer", "in_flight", "M_activations", "memory", "F_layer", "F_head", "t_compute", "t_tp", "t_cp", "t_pp",
          "t_ep", "t_microbatch", "bubble", "t_bubble", "t_dp", "t_step", "mfu")
FORMULAS: dict[str, tuple[sympy.Expr, str]] = _define()
"""name -> (formula, meaning). A formula uses ``SYMBOLS`` and the names defined before it."""


def formula(name: str) -> sympy.Expr:
    """The formula of ``name`` as defined, in terms of earlier quantities (for printing)."""
    if name not in FORMULAS:
        raise KeyError(f"no formula named {name!r}; the formulas are {', '.join(FORMULAS)}")
    return FORMULAS[name][0]


@functools.cache
def expanded(name: str) -> sympy.Expr:
    """The formula of ``name`` in ``SYMBOLS`` only."""
    expr = formula(name)
    earlier = {_sym(q): expanded(q) for q in _ORDER[: _ORDER.index(name)] if _sym(q) in expr.free_symbols}
    return expr.subs(earlier) if earlier else expr


def solve_for(name: str, limit: float | sympy.Expr, symbol: str, **given: float) -> sympy.Expr:
    """The value of ``symbol`` at which quantity ``name`` equals ``limit``, with the ``given`` symbols substituted.

    ``solve_for("bubble", Rational(1, 20), "m")`` is ``19*(pp - 1)/v``: the bubble is at most 5% for m at
    least that. A number when every other symbol is given, else a formula.
    """
    expr = expanded(name).subs({SYM[k]: v for k, v in given.items()})
    solutions = sympy.solve(Eq(expr, limit), SYM[symbol])
    if not solutions:
        raise ValueError(f"{name} = {limit} has no solution for {symbol} (given {given})")
    return sympy.simplify(solutions[0])


def min_microbatches(pp: int, *, interleave: int = 1, bubble: float = 0.05, zero_bubble: bool = False) -> int:
    """The fewest microbatches that keep the pipeline bubble at or below ``bubble``."""
    if pp == 1:
        return 1
    exact = solve_for("bubble", sympy.nsimplify(bubble), "m", pp=pp, v=interleave, w=int(zero_bubble))
    return max(1, math.ceil(float(exact) - 1e-9))


# ------------------------------------------------------------------------------------------------ evaluation

_INPUTS = tuple(SYM)
_OUTPUTS = ("N_gpu", "n", "in_flight", "M_weights", "M_grads", "M_optimizer", "M_activations", "memory", "t_compute",
            "t_tp", "t_cp", "t_pp", "t_ep", "t_microbatch", "bubble", "t_bubble", "t_dp", "t_step", "mfu")


@functools.cache
def _compiled() -> Callable[..., list[float]]:
    return sympy.lambdify([SYM[k] for k in _INPUTS], [expanded(q) for q in _OUTPUTS], modules="math", cse=True)


@dataclass(frozen=True)
class Estimate:
    """What the model predicts for one split, per GPU of the fullest stage. Bytes, seconds, fractions."""

    split: Split
    values: dict[str, float]
    links: dict[str, str]  # axis -> "NVLink" or "network", for axes of degree > 1
    memory_limit: float

    def __getitem__(self, name: str) -> float:
        return self.values[name]

    @property
    def memory(self) -> float:
        return self.values["memory"]

    @property
    def step_time(self) -> float:
        return self.values["t_step"]

    @property
    def bubble(self) -> float:
        return self.values["bubble"]

    @property
    def fits(self) -> bool:
        return self.memory <= self.memory_limit

    def breakdown(self) -> dict[str, float]:
        """The step time as a sum: compute, TP, CP, PP, bubble, DP (seconds)."""
        m = self.split.microbatches
        return {"compute": m * self["t_compute"], "tp": m * self["t_tp"], "cp": m * self["t_cp"],
                "pp": m * self["t_pp"], "ep": m * self["t_ep"], "bubble": self["t_bubble"], "dp": self["t_dp"]}


def spans(split: Split) -> dict[str, int]:
    """How many consecutive ranks one group along each axis covers, in ``autoshard.mesh``'s rank layout."""
    return {"tp": split.tp, "cp": split.tp * split.cp, "dp": split.tp * split.cp * split.dp, "pp": split.gpus,
            "ep": split.tp * split.cp * split.ep}


def inputs(config: TransformerConfig, cluster: Cluster, split: Split) -> dict[str, float]:
    """The value of every symbol for this model, cluster and split."""
    values: dict[str, float] = {
        "L": config.layers, "h": config.hidden, "a": config.heads, "kv": config.kv_heads, "f": config.ffn,
        "g": 3 if config.gated else 2, "E": config.experts, "x": config.experts_per_token, "V": config.vocab,
        "s": config.seq, "beta": config.dtype_bytes,
        "o": 8 if config.dtype_bytes >= 4 else 12, "tied": int(config.tied_embeddings),
        "dp": split.dp, "tp": split.tp, "pp": split.pp, "cp": split.cp, "ep": split.ep, "m": split.microbatches,
        "v": split.interleave, "b": split.microbatch_size, "r": int(split.recompute == "full"),
        "z": int(split.shard_optimizer), "w": int(split.zero_bubble), "q": int(split.sequence_parallel),
        "F": cluster.peak_flops,
        "eta": cluster.efficiency,
    }
    for axis, span in spans(split).items():
        values[f"bw_{axis}"], values[f"lat_{axis}"], _ = cluster.link(span)
    return values


def evaluate(config: TransformerConfig, cluster: Cluster, split: Split) -> Estimate:
    """Predict memory and time per GPU for ``split``. Does not check that the split is valid (see ``search``)."""
    values = inputs(config, cluster, split)
    out = _compiled()(*(values[k] for k in _INPUTS))
    links = {axis: cluster.link(span)[2] for axis, span in spans(split).items() if getattr(split, axis) > 1}
    return Estimate(split=split, values=dict(zip(_OUTPUTS, map(float, out), strict=True)), links=links,
                    memory_limit=cluster.gpu_memory * cluster.usable_memory)
