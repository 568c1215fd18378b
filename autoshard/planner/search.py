"""Search every split of a cluster for a model, and rank the ones that fit by predicted step time.

A split's mesh is one factorisation ``gpus = dp * tp * pp * cp``; for each valid mesh the search tries
every microbatch size ``b`` that divides the per-replica batch (so ``m = global_batch / (dp * b)``),
every interleave ``v`` the schedule allows, and full recomputation when nothing fits without it.
A mesh is valid when the model can be cut that way (:func:`mesh_problems`); a split fits when its
predicted memory is within the usable memory of a GPU.

:func:`plan` returns a :class:`PlanResult`: the best split of every mesh that has one, fastest
first, with counts of what was rejected and why. :func:`best_mesh` is the one-line form
``parallelize(mesh="auto")`` uses. :func:`rule_of_thumb` is the seed's recipe (tp = node size, pp
from memory, dp the rest), for comparison.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from autoshard.mesh import Mesh
from autoshard.planner import units
from autoshard.planner.config import Cluster, PlanError, Split, TransformerConfig
from autoshard.planner.model import Estimate, evaluate

MAX_INTERLEAVE = 8


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def factorisations(gpus: int) -> list[Mesh]:
    """Every mesh of ``gpus`` ranks: each ordered way to write gpus = dp * tp * pp * cp."""
    out = []
    for tp in divisors(gpus):
        for pp in divisors(gpus // tp):
            for cp in divisors(gpus // (tp * pp)):
                out.append(Mesh(dp=gpus // (tp * pp * cp), tp=tp, pp=pp, cp=cp))
    return out


def mesh_problems(config: TransformerConfig, mesh: Mesh) -> list[str]:
    """Why the model cannot be cut along ``mesh`` (empty when it can)."""
    problems = []
    if config.heads % mesh.tp or config.ffn % mesh.tp:
        problems.append(f"tp={mesh.tp} does not divide the {config.heads} heads and the ffn size {config.ffn}")
    elif config.kv_heads % mesh.tp and mesh.tp % config.kv_heads:
        problems.append(f"tp={mesh.tp} neither divides nor is a multiple of the {config.kv_heads} kv heads")
    if mesh.pp > config.layers:
        problems.append(f"pp={mesh.pp} is more stages than the {config.layers} layers")
    if config.seq % mesh.cp:
        problems.append(f"cp={mesh.cp} does not divide the sequence length {config.seq}")
    if config.global_batch % mesh.dp:
        problems.append(f"dp={mesh.dp} does not divide the global batch of {config.global_batch} sequences")
    if config.experts % mesh.ep:
        problems.append(f"ep={mesh.ep} does not divide the {config.experts} experts")
    return problems


def interleaves(config: TransformerConfig, pp: int, microbatches: int) -> list[int]:
    """The interleave degrees v the schedules allow: v = 1, or v > 1 with m a multiple of pp and a layer per chunk."""
    if pp == 1 or microbatches % pp:
        return [1]
    return [v for v in range(1, MAX_INTERLEAVE + 1) if pp * v <= config.layers]


def splits_of(config: TransformerConfig, mesh: Mesh, *, shard_optimizer: bool = False,
              zero_bubble: bool = True, sequence_parallel: bool = True) -> list[Split]:
    """Every split of one mesh, without recomputation: each microbatch size and interleave, and (unless
    ``zero_bubble`` is off) the zero-bubble schedule of each interleave that has one; with sequence parallelism
    at tp > 1 unless ``sequence_parallel`` is off."""
    per_replica = config.global_batch // mesh.dp
    out = []
    for b in divisors(per_replica):
        m = per_replica // b
        for v in interleaves(config, mesh.pp, m):
            # zero-bubble: ZB-H1 (v = 1) and, with the 2pp - 1 microbatches that fill its V, ZBV (v = 2)
            zero = (False, True) if zero_bubble and mesh.pp > 1 and (v == 1 or (v == 2 and m >= 2 * mesh.pp - 1)) \
                else (False,)
            # sequence parallelism moves what tp's all-reduces move and stores less: on wherever tp > 1
            out += [Split(dp=mesh.dp, tp=mesh.tp, pp=mesh.pp, cp=mesh.cp, ep=ep, microbatches=m, interleave=v,
                          microbatch_size=b, shard_optimizer=shard_optimizer, zero_bubble=zb,
                          sequence_parallel=sequence_parallel and mesh.tp > 1) for zb in zero
                    for ep in expert_degrees(config, mesh)]
    return out


def expert_degrees(config: TransformerConfig, mesh: Mesh) -> list[int]:
    """The ep degrees a mixture of experts can take on ``mesh``: those dividing both dp and the experts (1 alone for
    a dense model, or where ``mesh`` fixes its own ep)."""
    if mesh.ep > 1 or config.experts == 1:
        return [mesh.ep]
    return [ep for ep in divisors(mesh.dp) if config.experts % ep == 0]


@dataclass
class PlanResult:
    """The outcome of a search. ``ranked``: the best fitting split of each mesh, fastest first."""

    config: TransformerConfig
    cluster: Cluster
    ranked: list[Estimate]
    evaluated: int = 0
    rejected: dict[str, int] = field(default_factory=dict)  # reason -> how many splits or meshes
    closest: Estimate | None = None  # the smallest footprint among splits that do not fit
    shard_optimizer: bool = False
    zero_bubble: bool = True
    sequence_parallel: bool = True

    @property
    def best(self) -> Estimate:
        return self.ranked[0]

    def find(self, **degrees: int) -> Estimate | None:
        """The ranked estimate of the mesh with these degrees (absent axes: any), or None."""
        for est in self.ranked:
            if all(getattr(est.split, k) == v for k, v in degrees.items()):
                return est
        return None

    def position_of(self, est: Estimate) -> int:
        """1-based position of ``est``'s mesh in the ranking."""
        return 1 + [e.split.mesh for e in self.ranked].index(est.split.mesh)


def plan(config: TransformerConfig, cluster: Cluster, *, shard_optimizer: bool = False,
         mesh: Mesh | None = None, zero_bubble: bool = True, sequence_parallel: bool = True) -> PlanResult:
    """Search every split of ``cluster.gpus`` (or only those of ``mesh``); raise PlanError when none fits.
    ``zero_bubble=False`` leaves out the zero-bubble schedules (1F1B and interleaved 1F1B only);
    ``sequence_parallel=False`` plain tensor parallelism (the seeds' memory model)."""
    meshes = [mesh] if mesh is not None else factorisations(cluster.gpus)
    if mesh is not None:
        mesh.check_world_size(cluster.gpus)
    result = PlanResult(config=config, cluster=cluster, ranked=[], shard_optimizer=shard_optimizer,
                        zero_bubble=zero_bubble, sequence_parallel=sequence_parallel)
    valid = []
    for candidate in meshes:
        problems = mesh_problems(config, candidate)
        if problems:
            key = "the model cannot be cut that way" if mesh is None else "; ".join(problems)
            result.rejected[key] = result.rejected.get(key, 0) + 1
        else:
            valid.append(candidate)
    if not valid:
        raise PlanError(_no_valid_mesh(config, cluster, mesh))
    for candidate in valid:
        best = _best_of_mesh(config, cluster, candidate, shard_optimizer, result)
        if best is not None:
            result.ranked.append(best)
    if not result.ranked:
        raise PlanError(_nothing_fits(config, cluster, result, shard_optimizer))
    result.ranked.sort(key=lambda e: (e.step_time, e.memory))
    return result


def _best_of_mesh(config: TransformerConfig, cluster: Cluster, mesh: Mesh, shard_optimizer: bool,
                  result: PlanResult) -> Estimate | None:
    best = None
    for split in splits_of(config, mesh, shard_optimizer=shard_optimizer, zero_bubble=result.zero_bubble,
                           sequence_parallel=result.sequence_parallel):
        est = evaluate(config, cluster, split)
        result.evaluated += 1
        if not est.fits:  # full recomputation trades a forward for memory: tried only where it is needed
            est = evaluate(config, cluster, replace(split, recompute="full"))
            result.evaluated += 1
        if not est.fits:
            result.rejected["out of memory"] = result.rejected.get("out of memory", 0) + 1
            if result.closest is None or est.memory < result.closest.memory:
                result.closest = est
        elif best is None or (est.step_time, est.memory) < (best.step_time, best.memory):
            best = est
    return best


def best_mesh(config: TransformerConfig, cluster: Cluster | None = None, world_size: int | None = None, *,
              shard_optimizer: bool = False) -> Mesh:
    """The mesh of the fastest split of ``world_size`` GPUs (default: ``cluster.gpus``) that fits.

    ``cluster`` defaults to the h100 preset with 8 GPUs per node. Raises PlanError when none fits.
    """
    if cluster is None:
        if world_size is None:
            raise PlanError("best_mesh needs a world size or a cluster: pass world_size=<number of ranks>")
        cluster = Cluster(gpus=world_size, gpus_per_node=min(8, world_size))
    elif world_size is not None and world_size != cluster.gpus:
        cluster = cluster.with_gpus(world_size)
    return plan(config, cluster, shard_optimizer=shard_optimizer).best.split.mesh


def rule_of_thumb(config: TransformerConfig, cluster: Cluster, *, shard_optimizer: bool = False) -> Estimate | None:
    """The seed's recipe: tp = the largest valid degree within a node; pp = the fewest stages whose memory
    fits (recomputing only if no pp fits without); dp = the rest; one sequence per microbatch, so
    m = global_batch / dp. None when the recipe finds nothing that fits."""
    tps = [t for t in divisors(min(cluster.gpus, cluster.gpus_per_node)) if not mesh_problems(
        config, Mesh(tp=t, dp=1)) and cluster.gpus % t == 0]
    tp = max(tps)
    for recompute in ("none", "full"):
        for pp in divisors(cluster.gpus // tp):
            mesh = Mesh(dp=cluster.gpus // (tp * pp), tp=tp, pp=pp)
            if mesh_problems(config, mesh):
                continue
            split = Split(dp=mesh.dp, tp=tp, pp=pp, microbatches=config.global_batch // mesh.dp,
                          recompute=recompute, shard_optimizer=shard_optimizer)
            est = evaluate(config, cluster, split)
            if est.fits:
                return est
    return None


# -------------------------------------------------------------------------------------------- error messages


def _no_valid_mesh(config: TransformerConfig, cluster: Cluster, mesh: Mesh | None) -> str:
    if mesh is not None:
        return f"{mesh} cannot cut this model: {'; '.join(mesh_problems(config, mesh))}"
    g = cluster.gpus
    nearby = [n for n in _nearby_counts(cluster) if any(not mesh_problems(config, m) for m in factorisations(n))]
    suggest = f"; GPU counts that work nearby: {', '.join(map(str, nearby[:4]))}" if nearby else ""
    return (f"no split of {g} GPUs suits this model: every factorisation dp*tp*pp*cp = {g} breaks a rule "
            f"(dp must divide the global batch {config.global_batch}, tp the {config.heads} heads, cp the sequence "
            f"{config.seq}, and pp is at most the {config.layers} layers){suggest}")


def _nearby_counts(cluster: Cluster) -> list[int]:
    step = cluster.gpus_per_node if cluster.gpus > cluster.gpus_per_node else 1
    candidates = {n for k in range(1, 9) for n in (cluster.gpus - k * step, cluster.gpus + k * step) if n > 0}
    return sorted(candidates, key=lambda n: (abs(n - cluster.gpus), n))


def _nothing_fits(config: TransformerConfig, cluster: Cluster, result: PlanResult, shard_optimizer: bool) -> str:
    closest = result.closest
    assert closest is not None, "no split was rejected for memory, yet none fits"
    limit = closest.memory_limit
    short = closest.memory - limit
    size = units.format_si_bytes
    text = (f"nothing fits in {size(cluster.gpu_memory)} per GPU ({size(limit)} usable): the smallest footprint, "
            f"{closest.split.short()}, needs {size(closest.memory)}, {size(short)} short")
    fixes = []
    more = _fitting_gpu_count(config, cluster, shard_optimizer)
    if more is not None:
        fixes.append(f"use {more} GPUs")
    needed = math.ceil(closest.memory / cluster.usable_memory / 1e9) * 1e9
    fixes.append(f"GPUs with at least {units.format_si_bytes(needed)}")
    if not shard_optimizer and closest.split.dp > 1:
        fixes.append("--shard-optimizer (ZeRO-1)")
    return f"{text}; to fit, {' or '.join(fixes)}"


def _fitting_gpu_count(config: TransformerConfig, cluster: Cluster, shard_optimizer: bool) -> int | None:
    """The smallest power-of-two multiple of the GPU count (up to 64x) with a split that fits, if any.

    Tries only each mesh's smallest footprint: one sequence per microbatch, no interleave (more chunks only add
    layers and in-flight microbatches to the first stage) and full recomputation.
    """
    for factor in (2, 4, 8, 16, 32, 64):
        bigger = cluster.with_gpus(cluster.gpus * factor)
        for mesh in factorisations(bigger.gpus):
            if mesh_problems(config, mesh):
                continue
            split = Split(dp=mesh.dp, tp=mesh.tp, pp=mesh.pp, cp=mesh.cp, recompute="full",
                          microbatches=config.global_batch // mesh.dp, shard_optimizer=shard_optimizer)
            if evaluate(config, bigger, split).fits:
                return bigger.gpus
    return None
