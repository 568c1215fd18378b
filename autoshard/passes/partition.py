"""Pipeline partitioner: where to cut a training graph into balanced stages.

The graph's *activations* (values that depend on parameters) are taken in graph order, which is a
topological order of the dependency graph (a networkx DiGraph of the activations). A cut after
position i is *valid* when the fewest values possible cross it: in a transformer that is the
residual stream alone, between blocks and between the attention and MLP halves of a block. Among the
valid cuts the partitioner picks the ones that make the largest stage cost as small as possible
(dynamic programming, exact), preferring cuts where fewer bytes cross; a cut that moves several times the
bytes of the cheapest one (the logits between an LM head and its loss) is used only when needed. A
stage's cost is the training FLOPs of its nodes plus a term for the parameters it reads
(``autoshard.cost``), so the embedding and LM head stages are not treated as free. By default the
partition balances memory too: a stage's score is the larger of its share of that cost and its share of
the parameters (whose gradients and optimizer state are as many again), so a mixture-of-experts stage
whose routed tokens cost little cannot end up holding most of the model's bytes. A weight read on both sides
of a cut (an encoder-decoder's one embedding) is held by both stages and counts on both. Nothing here looks at
names; a user may instead name the modules that stages start at.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import networkx as nx
import numpy as np
import torch
from torch import fx

from autoshard import cost, meta
from autoshard.errors import AutoshardError
from autoshard.passes.pipeline_split import activation_readers
from autoshard.passes.propagate import reaching_output, requires_grad

# A cut sends what crosses it forward and its gradient back, every microbatch. One value crosses between
# the LM head and the loss too, but it is the logits, vocab/hidden times the residual stream: cuts that
# move more than this many times the bytes of the cheapest are left out unless the stage count needs them.
HEAVY_CUT = 4
# A stage whose score is more than this many times its even share gets cuts where more values cross tried too.
BALANCED = 1.2
EXTRA_VALUES = 6


@dataclass(frozen=True)
class Partition:
    stage_of: dict[str, int]
    costs: tuple[float, ...]
    cut_after: tuple[str, ...]  # the last activation of every stage but the last
    crossing_bytes: tuple[int, ...]
    candidates: int
    param_bytes: tuple[int, ...] = ()  # the parameter bytes each stage holds (a weight read on two: on both)
    total_param_bytes: int = 0  # the model's, each weight once

    @property
    def balance(self) -> float:
        """Largest stage cost over the mean: 1.0 is perfect balance."""
        return max(self.costs) / (sum(self.costs) / len(self.costs))

    @property
    def largest_param_share(self) -> float:
        """The largest stage's share of the model's parameter bytes."""
        return max(self.param_bytes) / self.total_param_bytes if self.total_param_bytes else 0.0


class PartitionError(AutoshardError, ValueError):
    """The graph cannot be cut as asked; the message says how many stages would work."""


def partition(
    gm: fx.GraphModule, num_stages: int, *, starts: list[str] | None = None, cut_after: tuple[str, ...] | None = None,
    balance: str = "both", v_shape: bool = False,
) -> Partition:
    """Cut ``gm`` into ``num_stages`` stages.

    ``starts`` names the module each later stage begins at; ``cut_after`` repeats an earlier partition's
    cuts (by node name) on another capture of the same model, so its stages hold the same parameters.
    ``balance`` is what the cuts even out: ``"time"`` (the cost), ``"memory"`` (the parameter bytes) or
    ``"both"`` (the larger of the two shares). With ``v_shape`` (stages placed in a V: rank r runs stages r and
    S-1-r) the cuts are then moved to even out each rank's two stages together.
    """
    order, dag = _activation_dag(gm)
    memory = _HeldBytes(gm, order)
    if num_stages == 1:
        return Partition({n.name: 0 for n in order}, (sum(_costs(gm, order)),), (), (), 0, (memory.total,),
                         memory.total)
    crossing = _crossing_sets(order, dag)
    sendable = [i for i, c in enumerate(crossing[:-1]) if all(_is_tensor(n) for n in c)]
    fewest = min((len(crossing[i]) for i in sendable), default=0)
    candidates = [i for i in sendable if len(crossing[i]) == fewest]
    if len(candidates) < num_stages - 1:
        raise PartitionError(
            f"{num_stages} stages need {num_stages - 1} cuts, but the graph has only {len(candidates)} places where "
            f"{fewest} value(s) cross: {_use_at_most(len(candidates) + 1)}"
        )
    costs = _costs(gm, order)
    nbytes = [sum(_bytes(n) for n in c) for c in crossing]
    if cut_after is not None:
        position = {n.name: i for i, n in enumerate(order)}
        cuts = [position[name] for name in cut_after]
    elif starts is not None:
        cuts = _cuts_at(order, candidates, starts, num_stages)
    else:
        weights = _weights_read(gm, order)
        cheap = [i for i in candidates if nbytes[i] <= HEAVY_CUT * min(nbytes[c] for c in candidates)]
        cuts = None
        scores = _scores(costs, memory, balance, num_stages)
        if len(cheap) >= num_stages - 1:
            cuts = _balanced_cuts(scores, cheap, nbytes, num_stages, weights)
        if cuts is None:
            cuts = _balanced_cuts(scores, candidates, nbytes, num_stages, weights)
        cuts = _with_more_values(cuts, scores, crossing, sendable, nbytes, num_stages, weights, fewest, cheap,
                                 memory_bound={"both": 1.0, "memory": BALANCED / num_stages}.get(balance))
        if cuts is None:
            raise PartitionError(
                f"no cut into {num_stages} stages gives every stage a parameter to train (a stage that only computes "
                f"the loss leaves its rank nothing to optimise): {_use_at_most(_most_stages(candidates, weights))}"
            )
        if v_shape:
            cuts = _v_balanced(cuts, sorted(set(cheap) | set(cuts)), scores, weights)
    return _result(order, costs, cuts, nbytes, len(candidates), memory)


def _v_balanced(cuts: list[int], candidates: list[int], score, weights: list[int]) -> list[int]:
    """Move cuts one at a time to the candidate that most lowers the largest rank's score, where rank r runs stages
    r and S-1-r (the V), until no move helps: the stages at both ends share a rank, so they should be lighter than
    the middle ones (the embedding and the LM head end up with fewer layers beside them)."""
    held = [0]
    for w in weights:
        held.append(held[-1] + w)

    def largest(cuts: list[int]) -> float:
        bounds = [-1, *cuts, len(weights) - 1]
        stages = [(bounds[k] + 1, bounds[k + 1] + 1) for k in range(len(bounds) - 1)]
        if any(held[hi] == held[lo] for lo, hi in stages):
            return float("inf")  # a stage without a weight to train
        return max(score(stages[r], stages[-1 - r]) for r in range(len(stages) // 2))

    best = largest(cuts)
    for _ in range(4 * len(candidates)):
        moves = [(largest(c), c) for k in range(len(cuts)) for c in
                 ([*cuts[:k], position, *cuts[k + 1:]] for position in candidates
                  if (k == 0 or position > cuts[k - 1]) and (k == len(cuts) - 1 or position < cuts[k + 1]))]
        found, moved = min(moves, default=(best, cuts))
        if found >= best:
            break
        best, cuts = found, moved
    return cuts


def _with_more_values(cuts, scores, crossing, sendable, nbytes, stages: int, weights, fewest: int, cheap,
                      memory_bound: float | None = None):
    """Cuts where a few more values cross, when the cuts of the fewest leave a stage with far more than its share.

    Some models hand every layer a value computed once (per-layer embeddings, a relative position bias, keys
    shared across layers): only a cut before the first layer or after the last then crosses as few values as
    the residual stream, and one stage gets nearly everything. Cuts where up to ``EXTRA_VALUES`` more values
    cross (each sent like the residual stream, no heavier than a cheap cut, and each contiguous: see
    ``_contiguous``) are tried then, and kept only when they lower the largest stage's score by a fifth or more.
    With ``memory_bound`` (the score above which a stage holds more than its share of the parameters, when they
    are balanced too), a stage still over it gets heavier cuts tried as well: a model of a few unlike layers (a
    linear-attention layer holding half the weights) has no light cut that splits its parameters, and fitting in
    memory comes before the bytes sent."""
    if cuts is None or _largest(cuts, scores, len(weights)) <= BALANCED * (1 / stages):
        return cuts
    limit = HEAVY_CUT * min((nbytes[i] for i in cheap), default=0) if cheap else None
    for bounded in (True, False) if memory_bound is not None else (True,):
        more = [i for i in sendable if len(crossing[i]) <= fewest + EXTRA_VALUES
                and (not bounded or limit is None or nbytes[i] <= limit) and all(_contiguous(n) for n in crossing[i])]
        other = _balanced_cuts(scores, more, nbytes, stages, weights) if len(more) > len(cheap) else None
        gain = 0.8 if bounded else 1.0  # heavier cuts are tried for memory alone: any stage nearer its share wins
        if other is not None and _largest(other, scores, len(weights)) < gain * _largest(cuts, scores, len(weights)):
            cuts = other
        if memory_bound is None or _largest(cuts, scores, len(weights)) <= memory_bound:
            break
    return cuts


def _contiguous(node: fx.Node) -> bool:
    """Whether a received copy can be laid out like the value: the copy keeps its dims' memory order (see
    ``TensorSpec``), so a transposed value is fine, but a dim broadcast by ``expand`` (stride 0) would come out
    materialised. Gaps between rows (a ``select`` of one layer's slice from a tensor of every layer's) are allowed:
    the copy only closes them, which leaves every view that worked valid."""
    val = meta.val(node)
    if not isinstance(val, torch.Tensor):
        return False
    return all(stride > 0 for size, stride in zip(val.shape, val.stride(), strict=True) if size > 1)


def _largest(cuts: list[int], scores, length: int) -> float:
    bounds = [-1, *cuts, length - 1]
    return max(scores(bounds[k] + 1, bounds[k + 1] + 1) for k in range(len(bounds) - 1))


class _HeldBytes:
    """The parameter bytes a stage of activations ``lo..hi-1`` holds: every weight one of them reads.

    A weight read on both sides of a cut (an embedding an encoder, a decoder and a head share, tied tables,
    one block's weights run as every layer) is held by both stages and counts on both. Counted by prefix sums
    of each weight's first reader, plus the weights read again later whose first reader is before ``lo``."""

    def __init__(self, gm: fx.GraphModule, order: list[fx.Node]):
        params = dict(gm.named_parameters())
        position = {node: i for i, node in enumerate(order)}
        readers: dict[str, list[int]] = {}
        through: dict[fx.Node, set[str]] = {}  # a value off the activation path: the weights it is computed from
        for node in gm.graph.nodes:  # a weight read detached, cast or transposed is read by that value's readers
            names = {node.target} if node.op == "get_attr" and node.target in params else set().union(
                *(through.get(n, set()) for n in node.all_input_nodes))
            if node in position:
                for name in names:
                    readers.setdefault(name, []).append(position[node])
            elif names:
                through[node] = names
        size = {name: params[name].numel() * params[name].element_size() for name in readers}
        first = [0] * len(order)
        for name, at in readers.items():
            first[at[0]] += size[name]
        self.prefix = [0]
        for b in first:
            self.prefix.append(self.prefix[-1] + b)
        self.total = self.prefix[-1]
        self.again = [(size[name], at) for name, at in readers.items() if at[-1] > at[0]]
        self.cache: dict[tuple[int, int], int] = {}
        self.later: dict[int, tuple[list[int], list[int]]] = {}

    def __call__(self, lo: int, hi: int) -> int:
        if (lo, hi) not in self.cache:
            nexts, sums = self._read_again_from(lo)
            self.cache[lo, hi] = self.prefix[hi] - self.prefix[lo] + sums[bisect.bisect_left(nexts, hi)]
        return self.cache[lo, hi]

    def matrix(self, bounds: list[int]) -> np.ndarray:
        """``held[a, b]``: the bytes a stage ``bounds[a]..bounds[b]-1`` holds, for every pair ``a < b`` at once."""
        at = np.asarray(bounds)
        prefix = np.asarray(self.prefix, dtype=np.int64)[at]
        held = prefix[None, :] - prefix[:, None]
        for a, lo in enumerate(bounds):
            nexts, sums = self._read_again_from(lo)
            if len(nexts):
                held[a] += np.asarray(sums, dtype=np.int64)[np.searchsorted(nexts, at, side="left")]
        return held

    def _read_again_from(self, lo: int) -> tuple[list[int], list[int]]:
        """The weights first read before ``lo`` and read again at ``lo`` or after: where each is next read, sorted,
        and the prefix sums of their bytes in that order (a stage ``lo..hi-1`` holds those read before ``hi``). Once
        per ``lo``: a recurrent model reads a few hundred weights again at every step of its loop."""
        if lo not in self.later:
            found = sorted((at[k], nbytes) for nbytes, at in self.again
                           if at[0] < lo and (k := bisect.bisect_left(at, lo)) < len(at))
            sums = [0]
            for _, nbytes in found:
                sums.append(sums[-1] + nbytes)
            self.later[lo] = ([at for at, _ in found], sums)
        return self.later[lo]


def _scores(costs: list[float], memory: _HeldBytes, balance: str, stages: int):
    """The score of a stage made of activations ``lo..hi-1`` (prefix sums), for the balance asked for; or, given
    several ``(lo, hi)`` pairs, of the rank that runs those stages.

    ``"both"`` holds each stage's parameters within ``BALANCED`` times an even share where cuts allow it (a stage
    over it scores one more than its share, so any cut within it wins), and within that minimises the larger of
    the time and memory shares: a rank's parameters, gradients and optimizer state are what decide whether a
    model fits at all, a few percent of time only how fast it runs."""
    prefix_cost = [0.0]
    for c in costs:
        prefix_cost.append(prefix_cost[-1] + c)
    total_cost, total_mem = prefix_cost[-1] or 1.0, memory.total or 1

    def score(*spans) -> float:
        spans = [spans] if isinstance(spans[0], int) else spans
        time = sum(prefix_cost[hi] - prefix_cost[lo] for lo, hi in spans) / total_cost
        mem = sum(memory(lo, hi) for lo, hi in spans) / total_mem
        if balance != "both":
            return time if balance == "time" else mem
        return max(time, mem) + (mem > BALANCED * len(spans) / stages)

    def matrix(bounds: list[int]) -> np.ndarray:
        """``score(bounds[a], bounds[b])`` for every pair ``a < b`` at once, in the same float64 operations."""
        costs = np.asarray(prefix_cost)[np.asarray(bounds)]
        time = (costs[None, :] - costs[:, None]) / total_cost
        mem = memory.matrix(bounds) / total_mem
        if balance != "both":
            return time if balance == "time" else mem
        return np.maximum(time, mem) + (mem > BALANCED * 1 / stages)

    score.matrix = matrix
    return score


def _weights_read(gm: fx.GraphModule, order: list[fx.Node]) -> list[int]:
    """For each activation node, how many parameters it reads that get a gradient (tied copies count on every
    reader; a parameter that only picks positions, a top-k indexer's, gets none and does not count)."""
    trainable = {name for name, p in gm.named_parameters() if p.requires_grad}
    reaching = reaching_output(gm)
    return [sum(1 for s in n.all_input_nodes if s.op == "get_attr" and s.target in trainable and s in reaching)
            for n in order]


def _use_at_most(stages: int) -> str:
    if stages == 1:
        return "the model cannot be pipelined; train it without pp (pp=1), with tp, cp or dp instead"
    return f"use at most {stages} stages (pipeline degree x chunks)"


def _most_stages(candidates: list[int], weights: list[int]) -> int:
    """The most stages the candidate cuts can make with parameters in every one (greedy from the front)."""
    stages, held = 1, 0
    for i, w in enumerate(weights):
        held += w
        if i in candidates and held and sum(weights[i + 1:]):
            stages, held = stages + 1, 0
    return stages


def _activation_dag(gm: fx.GraphModule) -> tuple[list[fx.Node], nx.DiGraph]:
    grad = requires_grad(gm)
    order = [n for n in gm.graph.nodes if n in grad and n.op == "call_function"]
    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(order)))
    position = {n: i for i, n in enumerate(order)}
    for i, node in enumerate(order):
        for reader in activation_readers(node, lambda n: n in position):
            dag.add_edge(i, position.get(reader, len(order)))  # the graph's output sits after every activation
    assert nx.is_directed_acyclic_graph(dag)
    return order, dag


def _crossing_sets(order: list[fx.Node], dag: nx.DiGraph) -> list[list[fx.Node]]:
    """For each position i, the activations at or before i that are read after i."""
    last_read = [max(dag.successors(i), default=i) for i in range(len(order))]
    crossing: list[list[fx.Node]] = []
    alive: set[int] = set()
    for i in range(len(order)):
        alive.add(i)
        alive = {j for j in alive if last_read[j] > i}
        crossing.append([order[j] for j in sorted(alive)])
    return crossing


def _costs(gm: fx.GraphModule, order: list[fx.Node]) -> list[float]:
    """Training cost of each activation node, with each parameter charged to its first reader."""
    costs = cost.annotate(gm)
    charged: set[str] = set()
    result = []
    for node in order:
        total = float(cost.training_flops(costs[node]))
        for source in node.all_input_nodes:
            if source.op == "get_attr" and source.target not in charged:
                charged.add(source.target)
                total += cost.PARAM_BYTE_COST * costs[source].param_bytes
        result.append(total)
    return result


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(meta.val(node), torch.Tensor)


def _bytes(node: fx.Node) -> int:
    val = meta.val(node)
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _balanced_cuts(stage_score, candidates: list[int], nbytes: list[int], stages: int,
                   weights: list[int]) -> list[int] | None:
    """Choose ``stages - 1`` candidate cuts minimising the largest stage score, then the bytes crossing, such that
    every stage reads a parameter (None when no choice does): a stage without one leaves its rank no weights to
    train, whatever the cost model says.

    Dynamic programming over the candidates, every stage's score computed at once (``stage_score.matrix``): a
    recurrent model has thousands of places to cut."""
    held = np.cumsum([0, *weights])
    points = [-1, *candidates]  # position -1: before the first activation
    end = len(weights) - 1
    bounds = [p + 1 for p in points] + [end + 1]  # stage (points[i], points[j]]: bounds[i]..bounds[j]-1
    score = stage_score.matrix(bounds)
    reads = held[np.asarray(bounds)]
    crossing = np.asarray([nbytes[p] if p >= 0 else 0 for p in points], dtype=np.int64)
    # best k stages ending at points[j]: the largest stage score, the bytes crossing, the point before (-1: none)
    best, size = np.full(len(points), np.inf), np.zeros(len(points), dtype=np.int64)
    best[0] = 0.0
    parents = []
    for _ in range(1, stages):
        layer_best, layer_size = np.full(len(points), np.inf), np.zeros(len(points), dtype=np.int64)
        parent = np.full(len(points), -1)
        for j in range(1, len(points)):
            i = _best_before(best[:j], size[:j], score[:j, j], reads[:j] < reads[j])
            if i is not None:
                layer_best[j] = max(best[i], score[i, j])
                layer_size[j], parent[j] = size[i] + crossing[j], i
        best, size = layer_best, layer_size
        parents.append(parent)
    i = _best_before(best, size, score[:len(points), -1], reads[:len(points)] < reads[-1])
    if i is None:
        return None
    cuts = []
    for parent in reversed(parents):
        cuts.append(points[i])
        i = parent[i]
    return cuts[::-1]


def _best_before(best: np.ndarray, size: np.ndarray, stage: np.ndarray, valid: np.ndarray) -> int | None:
    """The first ``i`` (a reachable, ``valid`` start) with the least ``max(best[i], stage[i])``, then least
    ``size[i]``."""
    scores = np.where(valid & np.isfinite(best), np.maximum(best, stage), np.inf)
    least = scores.min(initial=np.inf)
    if least == np.inf:
        return None
    tied = np.flatnonzero(scores == least)
    return int(tied[np.argmin(size[tied])])


def _cuts_at(order: list[fx.Node], candidates: list[int], starts: list[str], stages: int) -> list[int]:
    if len(starts) != stages - 1:
        raise PartitionError(f"{stages} stages start at {stages - 1} modules after the first, got {len(starts)}")
    cuts = []
    for name in starts:
        # the model's own qualified names; the capture wrapper adds "model." in front of them
        wanted = (name, f"model.{name}")
        first = next((i for i, n in enumerate(order) if meta.module_path(n).startswith(wanted)), None)
        before = [c for c in candidates if first is not None and c < first]
        if not before:
            raise PartitionError(
                f"no valid cut before module {name!r}: name a module whose input is the residual stream"
            )
        cuts.append(before[-1])
    if cuts != sorted(set(cuts)):
        raise PartitionError(f"the modules {starts} do not give {stages} non-empty stages in model order")
    return cuts


def _result(order, costs, cuts, nbytes, candidates, memory) -> Partition:
    stage_of, stage_costs, stage_bytes = {}, [], []
    bounds = [-1, *cuts, len(order) - 1]
    for stage in range(len(bounds) - 1):
        members = range(bounds[stage] + 1, bounds[stage + 1] + 1)
        for i in members:
            stage_of[order[i].name] = stage
        stage_costs.append(sum(costs[i] for i in members))
        stage_bytes.append(memory(members.start, members.stop))
    return Partition(
        stage_of, tuple(stage_costs), tuple(order[c].name for c in cuts), tuple(nbytes[c] for c in cuts), candidates,
        tuple(stage_bytes), memory.total,
    )
