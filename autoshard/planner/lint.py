"""The seeds' rules for choosing a split, as checks: ``lint(mesh, config, cluster, microbatches)``.

Each rule is a function registered in ``RULES`` by ``@rule``; it reads a :class:`LintInput` and yields
:class:`Finding` objects (severity, rule name, message, fix). Rules that need the model or the cluster
skip themselves when it is not given, so ``parallelize()`` can lint a bare mesh.

==================  ========  ============================================================================
rule                severity  finding
==================  ========  ============================================================================
world-size          error     the mesh has a different number of ranks than the cluster has GPUs
model-cut           error     tp does not divide the heads, pp exceeds the layers, cp does not divide seq
batch               error     the global batch cannot be cut into dp replicas of m microbatches
tp-spans-nodes      warning   a tp group crosses nodes, so its per-layer all-reduces leave NVLink
microbatches        warning   m < pp (the pipeline never fills) or the bubble exceeds ``max_bubble``
stage-memory        error     the first stage's weights, optimizer state and in-flight activations
                              exceed the GPU's usable memory
deep-pipeline       warning   more than ``max_stages`` (32) stages
==================  ========  ============================================================================
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from autoshard import schedules
from autoshard.mesh import Mesh
from autoshard.planner import units
from autoshard.planner.config import Cluster, Split, TransformerConfig
from autoshard.planner.model import Estimate, evaluate, min_microbatches
from autoshard.planner.search import divisors, mesh_problems

SEVERITIES = ("error", "warning", "info")
DEFAULT_GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Finding:
    severity: str
    rule: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.severity}: {self.message}. Fix: {self.fix}"

    def to_dict(self) -> dict[str, str]:
        return {"severity": self.severity, "rule": self.rule, "message": self.message, "fix": self.fix}


@dataclass(frozen=True)
class LintInput:
    mesh: Mesh
    config: TransformerConfig | None
    cluster: Cluster | None
    microbatches: int | None
    interleave: int
    recompute: str
    shard_optimizer: bool
    max_bubble: float
    max_stages: int
    schedule: str = "1f1b"

    @property
    def zero_bubble(self) -> bool:
        """Whether the schedule splits each backward into input and weight gradients (ZB-H1, ZBV, DualPipeV)."""
        return self.schedule in schedules.SCHEDULES and schedules.spec(self.schedule).splits_backward

    @property
    def gpus_per_node(self) -> int:
        return self.cluster.gpus_per_node if self.cluster is not None else DEFAULT_GPUS_PER_NODE

    def split(self) -> Split | None:
        """The split this input describes, when the batch allows one (b = global_batch / (dp * m))."""
        if self.config is None or self.microbatches is None:
            return None
        per_replica, rest = divmod(self.config.global_batch, self.mesh.dp * self.microbatches)
        if rest or per_replica < 1:
            return None
        return Split(dp=self.mesh.dp, tp=self.mesh.tp, pp=self.mesh.pp, cp=self.mesh.cp,
                     microbatches=self.microbatches, interleave=self.interleave, microbatch_size=per_replica,
                     recompute=self.recompute, shard_optimizer=self.shard_optimizer, zero_bubble=self.zero_bubble)


Rule = Callable[[LintInput], Iterator[Finding]]
RULES: dict[str, Rule] = {}


def rule(name: str) -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        RULES[name] = fn
        return fn

    return register


def lint(mesh: Mesh, config: TransformerConfig | None = None, cluster: Cluster | None = None,
         microbatches: int | None = None, *, interleave: int = 1, recompute: str = "none",
         shard_optimizer: bool = False, max_bubble: float = 0.05, max_stages: int = 32,
         schedule: str | None = None) -> list[Finding]:
    """Check ``mesh`` against the seeds' rules; findings come errors first. Rules needing what is not given skip.

    ``microbatches`` is m per step; with the model's global batch it sets the microbatch size. ``schedule`` is
    the pipeline schedule's name (by default 1F1B, or interleaved 1F1B with ``interleave`` > 1).
    """
    schedule = schedule or schedules.named(interleave)
    given = LintInput(mesh=mesh, config=config, cluster=cluster, microbatches=microbatches, interleave=interleave,
                      recompute=recompute, shard_optimizer=shard_optimizer, max_bubble=max_bubble,
                      max_stages=max_stages, schedule=schedule)
    findings = [finding for check in RULES.values() for finding in check(given)]
    return sorted(findings, key=lambda f: SEVERITIES.index(f.severity))


# ---------------------------------------------------------------------------------------------------- rules


@rule("world-size")
def _world_size(x: LintInput) -> Iterator[Finding]:
    if x.cluster is not None and x.mesh.world_size != x.cluster.gpus:
        yield Finding("error", "world-size", f"{x.mesh} has {x.mesh.world_size} ranks but the cluster has "
                      f"{x.cluster.gpus} GPUs", f"make dp*tp*pp*cp = {x.cluster.gpus}")


@rule("model-cut")
def _model_cut(x: LintInput) -> Iterator[Finding]:
    if x.config is None:
        return
    for problem in mesh_problems(x.config, replace(x.mesh, dp=1, ep=1)):  # the batch rule says more about dp
        yield Finding("error", "model-cut", problem, "choose degrees that divide the model's sizes")


@rule("batch")
def _batch(x: LintInput) -> Iterator[Finding]:
    if x.config is None:
        return
    batch, dp, m = x.config.global_batch, x.mesh.dp, x.microbatches or 1
    if batch % (dp * m) == 0:
        return
    fits_dp = [d for d in divisors(batch) if d <= dp and batch % (d * m) == 0]
    fits_m = [k for k in divisors(batch // dp) if k <= m] if batch % dp == 0 else []
    fix = (f"global_batch = b * m * dp needs dp * m to divide {batch}: use dp={max(fits_dp) if fits_dp else 1} "
           f"(move the other GPUs to tp or pp)")
    if fits_m:
        fix += f" or m={max(fits_m)}"
    too_big = dp * m > batch
    message = (f"dp={dp} x m={m} = {dp * m} microbatches of at least one sequence exceed the global batch of {batch}"
               if too_big else f"the global batch of {batch} sequences does not split into dp={dp} x m={m} equal "
               "microbatches")
    yield Finding("error", "batch", message, fix)


@rule("tp-spans-nodes")
def _tp_spans_nodes(x: LintInput) -> Iterator[Finding]:
    node, tp = x.gpus_per_node, x.mesh.tp
    if tp == 1 or not (tp > node or node % tp):
        return
    inside = max(d for d in divisors(node) if tp % d == 0)
    better = replace(x.mesh, tp=inside, pp=x.mesh.pp * tp // inside)
    assumed = "" if x.cluster is not None else f" (assuming {node} GPUs per node)"
    link = ""
    if x.cluster is not None:
        link = (f" at {units.format_rate(x.cluster.inter_bandwidth, 'B/s')} instead of NVLink's "
                f"{units.format_rate(x.cluster.intra_bandwidth, 'B/s')}")
    yield Finding("warning", "tp-spans-nodes",
                  f"tp={tp} spans nodes of {node} GPUs{assumed}: its all-reduces, four per layer, cross the network"
                  f"{link}", f"keep tp within a node (tp={inside}) and give the rest to pp or dp, e.g. {better}")


@rule("microbatches")
def _microbatches(x: LintInput) -> Iterator[Finding]:
    pp, v, m = x.mesh.pp, x.interleave, x.microbatches
    if pp == 1:
        return
    need = min_microbatches(pp, interleave=v, bubble=x.max_bubble, zero_bubble=x.zero_bubble)
    if m is None:
        yield Finding("info", "microbatches", f"pp={pp} and no microbatch count given",
                      f"pass microbatches >= {need} to keep the bubble under {x.max_bubble:.0%}")
        return
    k = 3 if x.zero_bubble else 1  # a zero-bubble schedule idles a third as long
    bubble = (pp - 1) / (k * v * m + pp - 1)
    if m >= pp and bubble <= x.max_bubble:
        return
    what = f"m={m} < pp={pp}: the pipeline never fills" if m < pp else f"m={m} microbatches for pp={pp}"
    ratio = (1 - x.max_bubble) / x.max_bubble  # bubble <= max_bubble  <=>  k*v*m >= ratio * (pp - 1)
    formula = "(pp-1)/(3*v*m + pp-1)" if x.zero_bubble else "(pp-1)/(v*m + pp-1)"
    fixes = [f"m >= {need} (bubble = {formula} <= {x.max_bubble:.0%} when m >= {ratio / k:.3g}*(pp-1)/v)"]
    if x.config is not None and need * x.mesh.dp > x.config.global_batch:
        most = x.config.global_batch // x.mesh.dp
        deepest = 1 + int(k * v * most / ratio)
        fixes = [f"at most m={most} fit the global batch at dp={x.mesh.dp}; "
                 + (f"pp <= {deepest} keeps the bubble under {x.max_bubble:.0%} with m={most}" if deepest > 1 else
                    f"no pipeline keeps the bubble under {x.max_bubble:.0%} with m={most}: give the pp ranks to dp "
                    "or tp, or accept the bubble")]
    layers = x.config.layers if x.config is not None else None
    v_need = math.ceil(ratio * (pp - 1) / m - 1e-9)
    if v_need > v and (layers is None or pp * v_need <= layers) and not x.zero_bubble:
        fixes.append(f"interleave v={v_need} at the same m")
    if not x.zero_bubble and v <= 2:
        zb = str(schedules.named(v, zero_bubble=True))
        fixes.append(f"schedule={zb!r} (each backward split into input and weight gradients; the weight part fills "
                     f"the bubble: {(pp - 1) / (3 * v * m + pp - 1):.1%} at the same m and activation memory)")
    yield Finding("warning", "microbatches", f"{what}, the bubble is {bubble:.1%} of the step (over "
                  f"{x.max_bubble:.0%})", "; or ".join(fixes))


@rule("stage-memory")
def _stage_memory(x: LintInput) -> Iterator[Finding]:
    split = x.split()
    if split is None or x.cluster is None or mesh_problems(x.config, x.mesh):
        return
    est = evaluate(x.config, x.cluster, split)
    if est.fits:
        return
    over = est.memory - est.memory_limit
    size = units.format_si_bytes
    message = (f"the first stage needs {size(est.memory)}, {size(over)} over the {size(est.memory_limit)} usable: "
               f"{_memory_parts(est)}")
    yield Finding("error", "stage-memory", message, _memory_fix(x, est))


def _memory_parts(est: Estimate) -> str:
    state = est["M_weights"] + est["M_grads"] + est["M_optimizer"]
    return (f"weights, gradients and optimizer state {units.format_si_bytes(state)}; activations "
            f"{units.format_si_bytes(est['M_activations'])} ({est['in_flight']:.4g} microbatches in flight "
            f"x {est['n']:.0f} layers)")


def _memory_fix(x: LintInput, est: Estimate) -> str:
    tries: list[tuple[str, Split]] = []
    if est.split.recompute == "none":
        tries.append(("recompute='full'", replace(est.split, recompute="full")))
    if not est.split.shard_optimizer and est.split.dp > 1:
        tries.append(("shard the optimizer state over dp (ZeRO-1)", replace(est.split, shard_optimizer=True)))
    fits = [f"{what} ({units.format_si_bytes(evaluate(x.config, x.cluster, s).memory)})" for what, s in tries
            if evaluate(x.config, x.cluster, s).fits]
    if fits:
        return " or ".join(fits)
    return "more tp, pp or cp per replica (fewer dp), recompute='full', or a sharded optimizer; `autoshard plan` "\
           "searches them all"


@rule("deep-pipeline")
def _deep_pipeline(x: LintInput) -> Iterator[Finding]:
    if x.mesh.pp > x.max_stages:
        yield Finding("warning", "deep-pipeline", f"pp={x.mesh.pp} stages: past about {x.max_stages} the bubble "
                      "and the stage imbalance rarely pay", f"use at most {x.max_stages} stages and fit the memory "
                      "with tp, cp, recomputation or a sharded optimizer")
