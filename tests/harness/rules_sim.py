"""An in-process tensor-parallel simulator: one op, sharded as its rule decides, run on every rank at once.

``simulate(op, args, kwargs, shard={i: placement}, size=t)`` builds a one-op graph (floating-point tensors
become parameters, so gradients flow as in a model; integer and bool tensors become inputs), propagates the
given placements of the tensors (numbered in the order they appear in ``args``), rewrites the graph for each
rank with the real pass (``apply_placements``: collectives inserted, localizers run), gives each rank its
shard of every tensor, and runs all ranks' graphs in lockstep threads. The collectives of
``passes.collectives`` are simulated in process: an all-reduce sums (or maxes) the ranks' values in rank
order, an all-gather concatenates them. The same graph run unsharded is the reference: the outputs, and
the gradients for one random cotangent, gathered back to full shape.
"""

from __future__ import annotations

import contextlib
import copy
import operator
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.utils import _pytree as pytree

from autoshard import meta
from autoshard.passes import collectives, localize
from autoshard.passes.placements import Placement, R, Shard
from autoshard.passes.propagate import propagate, requires_grad
from autoshard.passes.sharding import FALLBACKS, apply_placements
from autoshard.passes.tensor_parallel import tensor_axis  # as the tp planner propagates (pending sums)

USER_LINE = 'File "/home/user/model.py", line 42, in forward\n    y = the_op(x)'


class _World:
    """The ranks' meeting point: each collective is an exchange of every rank's value, in lockstep."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=20)
        self.slots: list = [None] * size
        self.calls = [0] * size

    def exchange(self, rank: int, x):
        """Every rank's ``x`` (a tensor or a list of tensors), in rank order."""
        self.slots[rank] = pytree.tree_map(lambda t: t.detach().clone(), x)
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()  # nobody writes the next exchange before everyone has read this one
        self.calls[rank] += 1
        return values


@dataclass(frozen=True)
class SimGroup:
    world: _World
    rank: int


def _all_reduce(x, group, op=dist.ReduceOp.SUM):
    if group is None:
        return x
    values = torch.stack(group.world.exchange(group.rank, x))
    return values.amax(0) if op == dist.ReduceOp.MAX else values.sum(0)


def _all_gather(x, dim, size, blocks, group, whole=()):
    if group is None:
        return x
    return collectives.unshard(group.world.exchange(group.rank, x), dim, blocks, whole)


@contextlib.contextmanager
def simulated_collectives():
    saved = collectives._all_reduce, collectives._all_gather, collectives._ParallelOp._run_group
    collectives._all_reduce, collectives._all_gather = _all_reduce, _all_gather
    collectives._ParallelOp._run_group = lambda self: None if self.size == 1 else self.group
    try:
        yield
    finally:
        collectives._all_reduce, collectives._all_gather, collectives._ParallelOp._run_group = saved


@dataclass
class Outcome:
    """What one simulation found: reference and per-rank values, and what the pass decided."""

    expected: list[torch.Tensor]  # the unsharded graph's outputs
    expected_grads: dict[str, torch.Tensor]
    outputs: list[list[torch.Tensor]]  # per rank
    grads: list[dict[str, torch.Tensor]]  # per rank, gathered to full shape
    placement: object  # the op's output placement
    reason: str | None  # why the rule refused to shard, if it did
    fallbacks: list[str]  # the pass's fallback messages (with warnings)
    modules: list[str]  # class names of the modules the rewrite inserted on rank 0
    code: str  # rank 0's code
    errors: list[BaseException | None] = field(default_factory=list)
    collectives_before_error: list[int] = field(default_factory=list)

    def assert_exact(self, rtol: float = 1e-5, atol: float = 1e-6) -> None:
        if isinstance(self.expected[0], BaseException):
            raise AssertionError(f"the unsharded op raised: {self.expected[0]!r}")
        failed = {rank: e for rank, e in enumerate(self.errors) if e is not None}
        if failed:
            first = next(iter(failed.values()))
            raise AssertionError(f"ranks {sorted(failed)} raised: {failed}\n{self.code}") from first
        assert len(self.outputs) == len(self.grads) == len(self.errors) > 0, "nothing was compared"
        for rank, (outs, grads) in enumerate(zip(self.outputs, self.grads, strict=True)):
            for i, (got, want) in enumerate(zip(outs, self.expected, strict=True)):
                torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True,
                                           msg=lambda m, r=rank, i=i: f"rank {r}, output {i}: {m}\n{self.code}")
            assert set(grads) == set(self.expected_grads), (rank, set(grads), set(self.expected_grads))
            for name, want in self.expected_grads.items():
                torch.testing.assert_close(grads[name], want, rtol=rtol, atol=atol, equal_nan=True,
                                           msg=lambda m, r=rank, n=name: f"rank {r}, grad of {n}: {m}\n{self.code}")

    @property
    def sharded(self) -> bool:
        return self.placement != R or any(m.startswith("Vocab") or m == "ReduceFromParallel" for m in self.modules)


def _build(op, args, kwargs, frozen=(), params: bool = True) -> tuple[fx.GraphModule, list[str], fx.Node]:
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    root, graph, names, nodes = nn.Module(), fx.Graph(), [], {}
    for i, t in enumerate(tensors):
        if t.is_floating_point() and params:
            name = f"p{i}"
            root.register_parameter(name, nn.Parameter(t.detach().clone(), requires_grad=i not in frozen))
            node = graph.get_attr(name)
        else:
            name = f"x{i}"
            node = graph.placeholder(name)
        node.meta[meta.VAL] = torch.empty_like(t, device="meta")
        names.append(name)
        nodes[id(t)] = node
    swap = lambda v: nodes[id(v)] if isinstance(v, torch.Tensor) else v  # noqa: E731
    node = graph.call_function(op, pytree.tree_map(swap, args), pytree.tree_map(swap, kwargs))
    on_meta = lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v  # noqa: E731
    value = op(*pytree.tree_map(on_meta, args), **pytree.tree_map(on_meta, kwargs))
    node.meta[meta.VAL] = pytree.tree_map(lambda v: torch.empty_like(v, device="meta"), value)
    node.meta[meta.STACK_TRACE] = USER_LINE
    if isinstance(value, (list, tuple)):
        outs = []
        for i, v in enumerate(value):
            item = graph.call_function(operator.getitem, (node, i))
            item.meta[meta.VAL] = torch.empty_like(v, device="meta")
            outs.append(item)
        graph.output(tuple(outs))
    else:
        graph.output((node,))
    return fx.GraphModule(root, graph), names, node


def _local(t: torch.Tensor, placement: Placement, rank: int, size: int) -> torch.Tensor:
    if not isinstance(placement, Shard):
        return t
    return collectives.local_part(t, placement, rank, size).contiguous()  # padded where the degree does not divide


def _full(parts: list[torch.Tensor], placement: Placement, n: int) -> torch.Tensor:
    if not isinstance(placement, Shard):
        return parts[0]
    return collectives.unshard(parts, placement.dim, placement.blocks, placement.whole).narrow(placement.dim, 0, n)


def _run(gm: fx.GraphModule, inputs: list, cotangents, autocast: torch.dtype | None):
    context = torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()
    with context:
        outs = list(gm(*inputs))
    pairs = [(o, c) for o, c in zip(outs, cotangents, strict=True) if o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [c.to(o.dtype) for o, c in pairs])
    return [o.detach() for o in outs], {n: p.grad for n, p in gm.named_parameters() if p.grad is not None}


def simulate(op, args: tuple, kwargs: dict | None = None, *, shard: dict[int, Placement], size: int = 2,
             autocast: torch.dtype | None = None, seed: int = 0, frozen: tuple[int, ...] = ()) -> Outcome:
    """Run ``op(*args, **kwargs)`` unsharded and sharded over ``size`` simulated ranks (see the module doc).

    ``frozen``: the tensors (by number) that are parameters without gradient (a loss's class weights).
    """
    kwargs = kwargs or {}
    gm, names, op_node = _build(op, args, kwargs, frozen)
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    seeds = {names[i]: p for i, p in shard.items()}
    gen = torch.Generator().manual_seed(seed)
    vals = op_node.meta[meta.VAL]
    cotangents = [torch.randn(v.shape, generator=gen) for v in (vals if isinstance(vals, (list, tuple)) else [vals])]
    try:
        expected, expected_grads = _run(copy.deepcopy(gm), [t for t, n in zip(tensors, names, strict=True)
                                                            if n.startswith("x")], cotangents, autocast)
    except (IndexError, RuntimeError) as e:  # bad data: the sharded program must fail the same way
        expected, expected_grads = [e], {}

    world = _World(size)
    programs, fallbacks, decision = _tp_programs(gm, seeds, world, op_node.name)
    local_inputs = [[_local(t, seeds.get(n, R), r, size) for t, n in zip(tensors, names, strict=True)
                     if n.startswith("x")] for r in range(size)]
    results, errors, calls = _in_lockstep(
        world, lambda rank: _run(programs[rank], local_inputs[rank], cotangents, autocast), simulated_collectives())
    modules = [type(m).__name__ for _, m in programs[0].named_children()]
    outcome = Outcome(expected, expected_grads, [], [], decision.out, decision.reason, fallbacks, modules,
                      programs[0].code, errors, calls)
    if all(e is None for e in errors):
        outcome.outputs = [r[0] for r in results]
        outcome.grads = [_gathered(results, rank, expected_grads, seeds) for rank in range(size)]
    return outcome


def _tp_programs(gm: fx.GraphModule, seeds: dict, world: _World, op_name: str):
    """Every rank's program (the real pass, with simulated groups), the pass's warnings, and the op's decision."""
    programs, fallbacks, decision = [], [], None
    for rank in range(world.size):
        local = copy.deepcopy(gm)
        prop = propagate(local, seeds, tensor_axis(world.size))
        decision = decision or prop.decisions[next(n for n in local.graph.nodes if n.name == op_name)]
        rw = localize.Rewriter(local, prop, rank=rank, group=SimGroup(world, rank), grad=requires_grad(local))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            apply_placements(local, prop, rw)
        if rank == 0:
            fallbacks = [str(w.message) for w in caught] + local.meta.get(FALLBACKS, [])
        local.graph.eliminate_dead_code()
        local.recompile()
        for name, p in list(local.named_parameters()):
            shard = _local(p.detach(), seeds.get(name, R), rank, world.size)
            setattr(local, name, nn.Parameter(shard, p.requires_grad))
        programs.append(local)
    return programs, fallbacks, decision


def _in_lockstep(world: _World, run: Callable[[int], object], context) -> tuple[list, list, list]:
    """``run(rank)`` on every rank in its own thread, the collectives simulated by ``context``: the results, the
    errors, and how many collectives each failing rank had joined before it failed."""
    size = world.size
    results, errors, calls = [None] * size, [None] * size, [0] * size

    def work(rank: int) -> None:
        try:
            results[rank] = run(rank)
        except BaseException as e:  # noqa: BLE001 - every rank's failure is reported to the test
            errors[rank], calls[rank] = e, world.calls[rank]
            world.barrier.abort()

    with context:
        threads = [threading.Thread(target=work, args=(r,)) for r in range(size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    return results, errors, calls


def _gathered(results: list, rank: int, expected_grads: dict, seeds: dict) -> dict[str, torch.Tensor]:
    """``rank``'s view of every gradient at full shape: a split parameter's shards gathered, a whole one as is."""
    grads = {}
    for n, g in expected_grads.items():
        p = seeds.get(n, R)
        if isinstance(p, Shard):
            parts = [results[r][1].get(n) for r in range(len(results))]
            if all(part is not None for part in parts):
                grads[n] = _full(parts, p, g.shape[p.dim])
        elif n in results[rank][1]:  # a replicated parameter's gradient must be whole on every rank
            grads[n] = results[rank][1][n]
    return grads


# ------------------------------------------------------------------------------- context parallelism


@contextlib.contextmanager
def simulated_sequence_collectives():
    """The cp axis's all-gather, reduce-scatter, all-to-all and ring exchange, in process (with
    ``simulated_collectives``)."""
    from autoshard.passes import ring_attention

    def all_gather(parts, x, group=None, async_op=False):
        for part, value in zip(parts, group.world.exchange(group.rank, x), strict=True):
            part.copy_(value)

    def reduce_scatter_tensor(out, x, group=None, op=dist.ReduceOp.SUM, async_op=False):
        total, n = torch.stack(group.world.exchange(group.rank, x)).sum(0), out.numel()
        out.copy_(total[group.rank * n:(group.rank + 1) * n].view_as(out))

    def shift(self, tensors, tag):
        values = self.group.world.exchange(self.group.rank, [t.contiguous() for t in tensors])
        return [], values[self.prev]

    def all_to_all_single(out, x, group=None, async_op=False):  # part j of dim 0 goes to rank j
        values = group.world.exchange(group.rank, x)
        out.copy_(torch.cat([v.chunk(len(values))[group.rank] for v in values]))

    names = ("all_gather", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all_single")
    saved = [getattr(dist, n, None) for n in names], ring_attention._Ring.shift
    for name, fn in zip(names, (all_gather, reduce_scatter_tensor, reduce_scatter_tensor, all_to_all_single),
                        strict=True):
        setattr(dist, name, fn)
    ring_attention._Ring.shift = shift
    try:
        with simulated_collectives():
            yield
    finally:
        for name, fn in zip(names, saved[0], strict=True):
            if fn is None:
                delattr(dist, name)
            else:
                setattr(dist, name, fn)
        ring_attention._Ring.shift = saved[1]


def _run_inputs(gm: fx.GraphModule, inputs: list, cotangent: torch.Tensor, autocast: torch.dtype | None = None):
    inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    with torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext():
        (out,) = gm(*inputs)
    out.backward(cotangent.to(out.dtype))
    return out.detach(), [t.grad for t in inputs]


def simulate_cp(op, args: tuple, kwargs: dict | None = None, *, seq: dict[int, int], out_dim: int, size: int = 2,
                load_balance: bool = False, attention: str = "gather", seed: int = 0,
                autocast: torch.dtype | None = None) -> Outcome:
    """Run ``op`` with the tensors ``seq`` (number -> sequence dim) split over ``size`` cp ranks, as the cp pass
    rewrites it, against the unsharded op. Every tensor is a model input; each rank back-propagates only its own
    tokens' part of the cotangent (what its loss holds), so the input gradients are the sum over ranks."""
    from autoshard.passes.context_parallel import ContextParallelPlan, context_parallel_pass

    gm, names, op_node = _build(op, args, kwargs or {}, params=False)
    tensors = [t for t in pytree.tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)]
    seq_len = {tensors[i].shape[d] for i, d in seq.items()}.pop()
    plan = ContextParallelPlan(size, {names[i]: d for i, d in seq.items()}, seq_len, load_balance, attention)
    val = op_node.meta[meta.VAL]
    cotangent = torch.randn(val.shape, generator=torch.Generator().manual_seed(seed))
    expected, expected_grads = _run_inputs(copy.deepcopy(gm), tensors, cotangent, autocast)

    world, programs, fallbacks = _World(size), [], []
    for rank in range(size):
        local = copy.deepcopy(gm)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            context_parallel_pass(local, plan, rank=rank, group=SimGroup(world, rank))
        fallbacks += [str(w.message) for w in caught]
        programs.append(local)
    def run(rank: int):
        index = plan.positions(rank)
        inputs = [t.index_select(seq[i], index) if i in seq else t for i, t in enumerate(tensors)]
        mine = torch.zeros_like(cotangent).index_copy(out_dim, index, cotangent.index_select(out_dim, index))
        return _run_inputs(programs[rank], inputs, mine, autocast)

    results, errors, _ = _in_lockstep(world, run, simulated_sequence_collectives())
    modules = [type(m).__name__ for _, m in programs[0].named_children()]
    outcome = Outcome([expected], {}, [], [], None, None, fallbacks, modules, programs[0].code, errors)
    if any(e is not None for e in errors):
        return outcome
    grads = {}
    for i, want in enumerate(expected_grads):
        if want is None:
            continue
        full = torch.zeros_like(want)
        for rank in range(size):
            got = results[rank][1][i]
            full += full.new_zeros(want.shape).index_copy(seq[i], plan.positions(rank), got) if i in seq else got
        grads[names[i]], outcome.expected_grads[names[i]] = full, want
    outcome.outputs = [[r[0]] for r in results]
    outcome.grads = [grads] * size
    return outcome
