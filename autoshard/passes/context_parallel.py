"""Context parallelism: split the sequence over the cp ranks and keep attention exact.

Terms: the *layout* says which global token positions each cp rank holds. Contiguous: rank r holds
the r-th of c equal chunks. Load-balanced (for causal attention): the sequence is cut into 2c chunks
and rank r holds chunks r and 2c-1-r, so every rank does the same attention work.

Planning finds the sequence dim of the inputs by propagation: the dim whose split reaches attention
as a split of the queries; the target's dim is the one that makes the loss a per-rank sum. The pass
seeds those inputs as ``Shard(dim)`` and propagates with the same rule table as tensor parallelism:
token-wise ops run locally; values computed at full length from parameter-free inputs (positions,
RoPE tables, masks) are indexed with the rank's global positions; attention gathers keys and values
(or passes them around a ring) and masks by global positions, by the cp axis's own localizer of attention
(given to its ``Rewriter``; the shared table serves the other ops); the loss is a per-rank partial sum.
Gradients of parameters are summed over dp x cp by the data-parallel reduction, not in the graph.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import fx, nn

from autoshard import meta, peers
from autoshard.errors import AutoshardError
from autoshard.kinds import Attention
from autoshard.passes import localize
from autoshard.passes.axis import Axis, Outputs
from autoshard.passes.axis_pass import AxisPass, PlanCodec, Sharding, splitting
from autoshard.passes.collectives import Wire, _ParallelOp, reduce_scatter_single
from autoshard.passes.placements import Partial, Placement, Replicate, Shard
from autoshard.passes.propagate import cost, propagate
from autoshard.passes.rules import Decision, arg, rule
from autoshard.passes.sharding import shard_axis

aten = torch.ops.aten


PARTIAL_OUTPUT = meta.PARTIAL_OUTPUT  # re-exported (GraphModule.meta: the loss is this rank's partial sum)


class ContextParallelError(AutoshardError, ValueError):
    """The sequence cannot be split as asked; the message names the input and what would work."""


@dataclass(frozen=True)
class ContextParallelPlan:
    size: int
    inputs: dict[str, int] = field(default_factory=dict)  # placeholder name -> sequence dim
    seq_len: int = 0
    load_balance: bool = False
    attention: str = "gather"  # or "ring", "alltoall"
    note: str = ""  # what the split leaves whole, when no attention takes it (said as a warning)
    values: dict[str, int] = field(default_factory=dict)  # node name -> dim: a split that starts inside the graph

    @property
    def parts(self) -> int:
        """Chunks the sequence is cut into: one per rank, or two (load balance)."""
        return self.size * (2 if self.load_balance else 1)

    @property
    def even(self) -> bool:
        """Whether every rank holds as many tokens (the chunks divide the sequence)."""
        return self.seq_len % self.parts == 0

    def positions(self, rank: int) -> torch.Tensor:
        """The global token positions ``rank`` holds, in the order it holds them. A length the chunks do not divide
        is cut as evenly as it goes (chunk ``i`` is ``[i*T//n, (i+1)*T//n)``): ranks then hold 1 token apart."""
        bounds = [i * self.seq_len // self.parts for i in range(self.parts + 1)]
        chunks = [rank, 2 * self.size - 1 - rank] if self.load_balance else [rank]
        return torch.cat([torch.arange(bounds[c], bounds[c + 1]) for c in chunks])

    def axis(self, rank: int | None = None) -> Axis:
        """The cp axis this plan splits: its sequence and attention, and (given the ``rank`` that rewrites) how its
        collectives move the sequence's chunks."""
        if rank is None:
            return Axis("cp", self.size, sequence=self.seq_len, attention=Attention(self.attention))
        layout = [self.positions(r) for r in range(self.size)]
        return Axis(
            "cp", self.size, sequence=self.seq_len, attention=Attention(self.attention),
            gather=lambda dim, blocks, **a: SequenceGather(dim=dim, blocks=blocks, layout=layout, **a),
            scatter=lambda dim, blocks, **a: SequenceScatter(dim=dim, blocks=blocks, layout=layout, **a),
            check=lambda value, placement: _check_whole_sequences(self, value, placement),
            # Every rank back-propagates only its own tokens' loss: the gradient of a value all cp ranks hold
            # whole is a partial sum, summed where it matters (the gather's backward, the dp x cp reduction of
            # parameter gradients). So no f is needed on this axis.
            needs_copy=lambda value: False,
            localizers={aten.scaled_dot_product_attention.default: functools.partial(_attention, self)},
            uneven_local=None if self.even else functools.partial(self.local_shape, rank),
        )

    def local_shape(self, rank: int, shape: tuple[int, ...], placement) -> tuple[int, ...]:
        """The shape ``rank`` holds of a value of global ``shape`` split by ``placement`` along the sequence."""
        if not isinstance(placement, Shard):
            return tuple(shape)
        held = len(self.positions(rank))
        sizes = placement.blocks or (shape[placement.dim],)
        out = list(shape)
        out[placement.dim] = sum(size // self.seq_len * held for size in sizes)
        return tuple(out)


# ---------------------------------------------------------------------------------------------- planning


def plan_context_parallel(
    gm: fx.GraphModule, size: int, *, load_balance: bool = False, attention: str = "gather", tp: int = 1
) -> ContextParallelPlan:
    """Find the sequence dims of ``gm``'s inputs by propagation (``tp``: the degree that divides the heads first)."""
    if attention not in ("gather", "ring", "alltoall"):
        raise ValueError(f"attention={attention!r}: choose 'gather' (all-gather keys and values), 'ring' (pass them "
                         "around the cp ranks) or 'alltoall' (split heads instead of the sequence for attention)")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder" and _ndim(n) >= 2]
    found: dict[str, int] = {}
    for node in placeholders:
        for dim in range(1, _ndim(node)):
            if _splits_attention(gm, {node.target: Shard(dim)}, size, _shape(gm, node.target)[dim]):
                found[node.target] = dim
                break
    note = ""
    if not found:
        values = _inner_split(gm, size)
        if values:
            plan = ContextParallelPlan(size, {}, _sequence_of(gm, values), load_balance, attention, values=values)
            check_divisible(plan)
            if attention == "alltoall":
                _check_heads(gm, size, tp)
            return plan
        found, note = _token_split(gm, placeholders, size)
    seeds = {name: Shard(dim) for name, dim in found.items()}
    sequence = _shape(gm, next(iter(found)))[next(iter(found.values()))]
    base = propagate(gm, seeds, _finding(size, sequence), outputs=Outputs.PARTIAL)
    for node in placeholders:
        if node.target in found:
            continue
        for dim in range(1, _ndim(node)):
            if _shape(gm, node.target)[dim] != sequence:
                continue
            trial = propagate(gm, {**seeds, node.target: Shard(dim)}, _finding(size, sequence),
                              outputs=Outputs.PARTIAL)
            if cost(trial)[:2] < cost(base)[:2]:
                found[node.target], base = dim, trial
                break
    lengths = {_shape(gm, name)[dim] for name, dim in found.items()}
    if len(lengths) != 1:
        raise ContextParallelError(f"inputs {found} have different sequence lengths {sorted(lengths)}")
    plan = ContextParallelPlan(size, found, lengths.pop(), load_balance, attention, note)
    check_divisible(plan)
    if attention == "alltoall":
        _check_heads(gm, size, tp)
    return plan


def split_sequence(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Where context parallelism starts splitting a sequence that no input carries (the patch tokens of an image):
    the identity, whose rule on the cp axis asks for ``x`` split along ``dim`` (a scatter of this rank's
    positions). Inserted by ``insert_splits``; on every other axis it is only the identity."""
    return x


@rule(split_sequence)
def _split_sequence_rule(node: fx.Node, ctx) -> Decision:
    x, dim = node.args
    if not ctx.axis.sequence or not isinstance(ctx.of(x), Replicate):
        return Decision(ctx.of(x), {})
    return Decision(Shard(dim), {x: Shard(dim)})


def insert_splits(gm: fx.GraphModule, values: dict[str, int]) -> list[fx.Node]:
    """Put a ``split_sequence`` after each node of ``values`` that ``gm`` has (once); the markers inserted."""
    nodes = {n.name: n for n in gm.graph.nodes}
    inserted = []
    for name, dim in values.items():
        node = nodes.get(name)
        if node is None or any(u.target is split_sequence for u in node.users):
            continue
        with gm.graph.inserting_after(node):
            marker = gm.graph.call_function(split_sequence, (node, dim))
        marker.meta.update(meta.standing_for(node))
        node.replace_all_uses_with(marker, delete_user_cb=lambda user, marker=marker: user is not marker)
        inserted.append(marker)
    if inserted:
        gm.graph.lint()
        gm.recompile()
    return inserted


def remove_splits(gm: fx.GraphModule, markers: list[fx.Node]) -> None:
    for node in markers:
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
    gm.recompile()


def _sequence_of(gm: fx.GraphModule, values: dict[str, int]) -> int:
    nodes = {n.name: n for n in gm.graph.nodes}
    name, dim = next(iter(values.items()))
    return meta.val(nodes[name]).shape[dim]


def _inner_split(gm: fx.GraphModule, size: int, tries: int = 12) -> dict[str, int]:
    """No input carries the sequence attention sees (an image's patches): the earliest value before the first
    attention's queries whose split reaches that attention as a split of the queries, or {}."""
    attention = next((n for n in gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default), None)
    if attention is None:
        return {}
    from autoshard.passes.loss import ancestors

    q = attention.args[0]
    length = meta.val(q).shape[-2]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    found = []
    for node in ancestors(q):
        val = meta.val(node)
        if (node.op == "call_function" and node.target is not split_sequence and isinstance(val, torch.Tensor)
                and val.is_floating_point() and val.dim() >= 3):
            found += [(order[node], node, d) for d in range(1, val.dim()) if val.shape[d] == length]
    for _, node, dim in sorted(found, key=lambda item: item[0])[:tries]:
        markers = insert_splits(gm, {node.name: dim})
        try:
            if _splits_attention(gm, {}, size, length):
                return {node.name: dim}
        finally:
            remove_splits(gm, markers)
    return {}


def _check_heads(gm: fx.GraphModule, size: int, tp: int) -> None:
    """All-to-all attention gives each cp rank ``1/cp`` of the heads a tp rank holds: refuse, before any collective,
    a head count ``tp x cp`` does not divide, naming the degrees that work."""
    for node in gm.graph.nodes:
        if node.target is not aten.scaled_dot_product_attention.default:
            continue
        # grouped-query attention (enable_gqa=True) reads its kv heads as they are: the all-to-all repeats each as
        # often as the split of the query heads needs (see _grouped_kv_heads), so only those must divide
        split = node.args[:1] if arg(node, "enable_gqa") else node.args[:3]
        counts = {meta.val(t).shape[-3] for t in split if meta.val(t).dim() >= 3}
        bad = [c for c in counts if c % (tp * size)]
        if bad:
            works = [c for c in range(1, min(counts) + 1) if all(h % (tp * c) == 0 for h in counts)]
            where = meta.source_line(node) or node.name
            held = f" (each of tp={tp} ranks holds 1/{tp} of them)" if tp > 1 else ""
            raise ContextParallelError(
                f"cp attention 'alltoall' splits the heads of attention over the cp ranks, but attention at {where} "
                f"has {sorted(counts)} query/key/value heads{held}, which cp={size} does not divide: use cp in "
                f"{works}, or cp attention 'gather' or 'ring'")


def _finding(size: int, sequence: int) -> Axis:
    """The cp axis as planning sees it, before the plan (and its attention) is made."""
    return Axis("cp", size, sequence=sequence)


def _splits_attention(gm: fx.GraphModule, seeds: dict[str, Placement], size: int, sequence: int) -> bool:
    prop = propagate(gm, seeds, _finding(size, sequence), outputs=Outputs.PARTIAL)
    for node in gm.graph.nodes:
        if node.target is aten.scaled_dot_product_attention.default:
            q = node.args[0]
            if prop.of(q) == Shard(_ndim(q) - 2):
                return True
        if node.target in (aten.softmax.int, aten._softmax.default) and isinstance(node.args[0], fx.Node):
            x = node.args[0]
            if prop.of(x) == Shard(_ndim(x) - 2) and node.args[1] in (-1, _ndim(x) - 1):
                return True
    return False


def _token_split(gm: fx.GraphModule, placeholders: list[fx.Node], size: int) -> tuple[dict[str, int], str]:
    """No attention takes a split sequence (a recurrent or convolutional mixer, or attention the split cannot
    reach): split the token ids' sequence dim when the split reaches the graph's output (a loss summed per rank,
    or per-token outputs). Token-wise layers run on each rank's tokens; every op that mixes tokens runs on the
    whole, gathered sequence on every rank: exact, and the note says what stays whole."""
    stops = ""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for node in placeholders:
        if meta.val(node).is_floating_point():
            continue
        prop = propagate(gm, {node.target: Shard(1)}, _finding(size, meta.val(node).shape[1]),
                         outputs=Outputs.PARTIAL)
        whole = [n for n, d in prop.decisions.items() if d.fallback and n.op == "call_function"
                 and not n.name.startswith("_guards")]
        named = "; ".join(f"{n.target} ({(meta.source_line(n) or n.name).strip()})" for n in whole[:3])
        named += f" and {len(whole) - 3} more" if len(whole) > 3 else ""
        if not any(isinstance(prop.of(n), (Partial, Shard)) for n in output.all_input_nodes):
            stops = stops or f"; the split of {node.target}'s dim 1 stops at: {named}"
            continue
        return {node.target: 1}, (
            f"context parallelism found no attention over the split sequence of {node.target}: it splits the "
            f"token-wise layers over the cp ranks, and the {len(whole)} op(s) that mix tokens run on the whole "
            f"sequence on every rank ({named}), which saves less memory and time than split attention")
    raise ContextParallelError(
        "context parallelism found no input whose split reaches attention as a split of the queries, nor token "
        "ids whose split reaches the loss: the model's sequence dim could not be found (inputs of shape (batch, "
        f"sequence, ...) are expected){stops}; train it without cp (with tp, pp or dp)"
    )


def check_divisible(plan: ContextParallelPlan) -> None:
    """Raise what would work when ``plan``'s sequence length does not split into its cp ranks (and chunks) as its
    attention needs: gathered keys and the ring take ranks holding a token more or less; the all-to-all does not."""
    parts = plan.parts
    if plan.seq_len < parts:
        raise ContextParallelError(f"a sequence of {plan.seq_len} tokens cannot be cut into {parts} chunks: use fewer "
                                   "cp ranks or a longer sequence")
    if plan.seq_len % parts and plan.attention == "alltoall":
        works = [c for c in range(1, plan.seq_len + 1) if plan.seq_len % (c * (2 if plan.load_balance else 1)) == 0]
        what = f"2 x cp = {parts} chunks (load balance)" if plan.load_balance else f"cp = {parts} ranks"
        names = ", ".join(f"{n} (dim {d})" for n, d in {**plan.inputs, **plan.values}.items())
        use = (f"use cp in {works}{' or turn load balance off' if plan.load_balance else ''}" if works
               else "turn load balance off (its 2 x cp chunks need an even length)")
        inside = (" (the tokens attention sees are made inside the model there, such as image patches joined with a "
                  "class token)" if plan.values else "")
        raise ContextParallelError(
            f"the sequence of {names} has length {plan.seq_len}{inside}, which does not split into {what} evenly, "
            f"as cp attention {plan.attention!r} needs: use cp attention 'gather' or 'ring' (ranks may hold a token "
            f"more or less), {use}, or {'change the input size' if plan.values else 'pad the sequence'} so that it "
            f"is a multiple of {parts}"
        )


def _ndim(node: fx.Node) -> int:
    val = meta.val(node)
    return val.dim() if isinstance(val, torch.Tensor) else 0


def _shape(gm: fx.GraphModule, name: str) -> tuple[int, ...]:
    node = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.target == name)
    return tuple(meta.val(node).shape)


# ---------------------------------------------------------------------------------------------- applying


def context_parallel_pass(
    gm: fx.GraphModule, plan: ContextParallelPlan, *, rank: int, group=None, training: bool = True,
    keep_outputs: bool = False,
) -> fx.GraphModule:
    """Rewrite ``gm`` into what cp rank ``rank`` runs on its tokens.

    ``keep_outputs``: the outputs are a pipeline stage's activations, handed on split as they are.
    """
    if plan.size == 1:
        return gm
    seeds = {name: Shard(dim) for name, dim in plan.inputs.items()}
    outputs = Outputs.KEPT if keep_outputs else Outputs.PARTIAL if training else Outputs.WHOLE
    returned = next(n for n in gm.graph.nodes if n.op == "output").all_input_nodes
    prop = shard_axis(gm, plan.axis(rank), seeds, rank=rank, group=group, outputs=outputs)
    gm.meta[PARTIAL_OUTPUT] = any(isinstance(prop.of(n), Partial) for n in returned)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm


def _apply(gm: fx.GraphModule, sharding: Sharding, found: dict) -> None:
    on = sharding.axes["cp"]
    context_parallel_pass(gm, on.plan, rank=on.rank, group=on.group, training=sharding.training,
                          keep_outputs=sharding.keep_outputs)


def _describe(plan: ContextParallelPlan) -> str:
    return (f"the sequence of {plan.seq_len} over {plan.size} ranks, {plan.attention} attention"
            f"{', load-balanced' if plan.load_balance else ''}")


CONTEXT_PARALLEL = AxisPass(
    "cp", after=("tp", "sp regions"), applies=splitting("cp"), apply=_apply, mesh_axis="cp",
    codec=PlanCodec(encode=dataclasses.asdict, decode=lambda data: ContextParallelPlan(**data), describe=_describe))


def _attention(plan: ContextParallelPlan, node: fx.Node, rw: localize.Rewriter) -> None:
    """Queries of this rank against all keys: ``is_causal`` would align the mask top-left; use positions.

    The cp axis's own localizer of attention (the shared table has none: on tp, attention over local heads needs
    no rewrite but grouped-query attention's kv heads cut to its query heads'); with ring attention, the ring
    module replaces the op.
    """
    q = node.args[0]
    if rw.placement(q) != Shard(len(meta.val(q).shape) - 2):
        return
    causal = arg(node, "is_causal")
    if plan.attention == "ring":
        _ring(node, rw, plan, causal)
        return
    if plan.attention == "alltoall":
        _all_to_all(node, rw, plan)
        return
    gathered_attention(node, rw, plan.positions(rw.rank), plan.seq_len)


def gathered_attention(node: fx.Node, rw: localize.Rewriter, positions: torch.Tensor, seq_len: int) -> None:
    """This rank's queries (at global ``positions`` of a sequence of ``seq_len``) against the gathered keys: causal
    by those positions, piece by piece (no T/c x T mask); without a causal flag, as the model wrote it."""
    if not arg(node, "is_causal"):
        _attention_layout(node, rw)
        return
    from autoshard.passes.ring_attention import GatheredCausalAttention

    module = GatheredCausalAttention(positions=positions, seq_len=seq_len, scale=arg(node, "scale"),
                                     dropout_p=arg(node, "dropout_p"), enable_gqa=arg(node, "enable_gqa"))
    rw.replace(node, rw.module(module, tuple(node.args[:3]), before=node, like=node))


def attention_laid_out(*args, **kwargs) -> torch.Tensor:
    """``scaled_dot_product_attention`` whose output is laid out as the whole sequence's was, (B, T, H, D) in memory:
    CPU attention picks its kernel by shapes and mask, and the one for T/c queries against T keys may return
    (B, H, T, D) in memory, which a model's ``view`` after ``transpose(1, 2)`` (baked into the graph) cannot take."""
    out = aten.scaled_dot_product_attention.default(*args, **kwargs)
    return out.transpose(1, 2).contiguous().transpose(1, 2) if out.dim() == 4 else out


def _attention_layout(node: fx.Node, rw: localize.Rewriter) -> None:
    """The attention node computes this rank's queries in the whole sequence's output layout (one node still)."""
    node.target = attention_laid_out


def _ring(node: fx.Node, rw: localize.Rewriter, plan: ContextParallelPlan, causal: bool) -> None:
    from autoshard.passes.ring_attention import RingAttention

    q, k, v = node.args[:3]
    mask, scale = arg(node, "attn_mask"), arg(node, "scale")
    module = RingAttention(causal=bool(causal), scale=scale, layout=[plan.positions(r) for r in range(plan.size)],
                           **rw.collective_args)
    inputs = (q, k, v) if mask is None else (q, k, v, mask)
    rw.replace(node, rw.module(module, inputs, before=node, like=node))


def _all_to_all(node: fx.Node, rw: localize.Rewriter, plan: ContextParallelPlan) -> None:
    """Ulysses: all-to-all q, k and v from this rank's positions of every head to this rank's heads over the whole
    sequence, attend as the model wrote it (its causal flag and scale hold: the sequence is whole and in order),
    and all-to-all the output back. A mask's query rows are gathered and its heads (if it has its own) cut to this
    rank's."""
    q, k, v = node.args[:3]
    seq = meta.val(q).dim() - 2
    layout = [plan.positions(r) for r in range(plan.size)]
    exchange = {"heads": seq - 1, "seq": seq, "layout": layout, **rw.collective_args}
    args = list(node.args)
    for i, t in enumerate((q, k, v)):
        if i and arg(node, "enable_gqa"):
            t = _grouped_kv_heads(node, t, seq - 1, plan.size)
        args[i] = rw.module(SequenceToHeads(**exchange), (t,), before=node, like=t)
    mask = arg(node, "attn_mask")
    if isinstance(mask, fx.Node):
        shift = seq + 2 - meta.val(mask).dim()  # broadcast: the mask lines up with q's trailing dims
        if seq - shift >= 0 and meta.val(mask).shape[seq - shift] != 1:
            # the attention rule gave it this rank's query rows (see _mask_rows): the whole sequence's, in order
            mask = rw.module(SequenceGather(dim=seq - shift, blocks=None, layout=layout, **rw.collective_args),
                             (mask,), before=node, like=mask)
        if seq - 1 - shift >= 0 and meta.val(mask).shape[seq - 1 - shift] != 1:
            mask = rw.module(_HeadPart(dim=seq - 1 - shift, **rw.collective_args), (mask,), before=node, like=mask)
        if len(args) > 3:
            args[3] = mask
        else:
            node.kwargs = {**node.kwargs, "attn_mask": mask}
    node.args = tuple(args)
    out = rw.module(HeadsToSequence(**exchange), (node,), before=node.next, like=node)
    rw.follow(node, out)


def _grouped_kv_heads(node: fx.Node, kv: fx.Node, heads: int, size: int) -> fx.Node:
    """The kv heads of grouped-query attention (query head ``h`` reads kv head ``h // group``), each repeated so
    that ``size`` ranks can take equal parts of them: ``repeat_interleave`` by ``f`` keeps the mapping (query head
    ``h`` reads copy ``h // (group / f)``, of kv head ``h // group``), and once the kv heads divide by ``size``, the
    rank that takes query heads ``j/size`` takes the copies they read. ``f`` divides ``group`` where ``size`` divides
    the query heads (``_check_heads``)."""
    count = meta.val(kv).shape[heads]  # the kv heads this tp rank holds
    repeats = size // math.gcd(count, size)
    if repeats == 1:
        return kv
    with node.graph.inserting_before(node):
        repeated = node.graph.call_function(aten.repeat_interleave.self_int, (kv, repeats, heads))
    repeated.meta.update(meta.standing_for(kv))
    for key in meta.SHAPES:  # the whole and what this rank holds, each with its heads repeated
        if key in repeated.meta:
            val = repeated.meta[key]
            shape = (*val.shape[:heads], val.shape[heads] * repeats, *val.shape[heads + 1:])
            repeated.meta[key] = torch.empty(shape, dtype=val.dtype, device="meta")
    return repeated


class _HeadPart(nn.Module):
    """This cp rank's heads of a mask that has its own per head (ALiBi's biases): its chunk along ``dim``."""

    def __init__(self, *, dim: int, group, size: int, rank: int) -> None:
        super().__init__()
        self.dim, self.size, self.rank = dim, size, rank

    def forward(self, mask: torch.Tensor) -> torch.Tensor:
        return mask.chunk(self.size, dim=self.dim)[self.rank]


def _check_whole_sequences(plan: ContextParallelPlan, node: fx.Node, placement: Shard) -> None:
    """A value gathered or scattered on the cp axis holds whole sequences along its split dim (in each block, the
    sequence outermost: a reshape of (tokens, heads) into one dim); else the split is refused here, at compile
    time, naming the model's line (at run time it would fail inside the collective)."""
    val = meta.val(node)
    sizes = list(placement.blocks) if placement.blocks is not None else (
        [val.shape[placement.dim]] if isinstance(val, torch.Tensor) else [plan.seq_len])
    if any(size % plan.seq_len for size in sizes):
        where = meta.source_line(node) or meta.module_path(node) or node.name
        raise ContextParallelError(
            f"context parallelism cannot split the sequence through {node.name} ({where}): its dim {placement.dim} "
            f"in parts of {sizes} would have to hold whole sequences of length {plan.seq_len}; the model merges "
            "part of the sequence with another dim there, which the split cannot follow yet: train it without cp "
            "(with tp, pp or dp)"
        )


# ------------------------------------------------------------------------------------ sequence collectives


def _rank_index(layout: list[torch.Tensor], rank: int, n: int, blocks) -> torch.Tensor:
    """Indices along a dim of ``n`` that ``rank`` holds: in every block, its positions of the sequence, each with the
    inner elements a block merges with it (a block of ``k * seq`` holds ``(seq, k)``, the sequence outermost)."""
    seq = sum(len(p) for p in layout)
    sizes = [n] if blocks is None else list(blocks)
    if sum(sizes) != n or any(size % seq for size in sizes):
        raise ValueError(f"a sequence-split dim of {n} in blocks {sizes} is not whole sequences of length {seq}")
    parts, start = [], 0
    for size in sizes:
        inner = size // seq
        parts.append(start + (layout[rank][:, None] * inner + torch.arange(inner)).flatten())
        start += size
    return torch.cat(parts)


class _Scatter(torch.autograd.Function):
    """Forward: this rank's positions. Backward: its gradient placed at those positions, zeros elsewhere.

    On the cp axis every rank back-propagates only its own tokens' loss, so the gradient of a value
    every rank holds whole is a partial sum; parameter gradients are summed over dp x cp afterwards,
    and a gathered value's gradient is summed by the f after its gather. No communication here.
    """

    @staticmethod
    def forward(ctx, x, dim, index, op):
        ctx.dim, ctx.index, ctx.n = dim, index.to(x.device), x.shape[dim]
        return x.index_select(dim, ctx.index)

    @staticmethod
    def backward(ctx, grad):
        shape = list(grad.shape)
        shape[ctx.dim] = ctx.n
        return grad.new_zeros(shape).index_copy_(ctx.dim, ctx.index, grad), None, None, None


class _Gather(torch.autograd.Function):
    """Forward: every rank's tokens in natural order. Backward: sum the partial gradients, keep this rank's.

    Each rank uses the gathered value with its own tokens (its queries, its positions), so the
    gradients that come back differ per rank: a reduce-scatter sums them and leaves each rank the sum
    over its own tokens (half the bytes of an all-reduce of the whole gradient).
    """

    @staticmethod
    def forward(ctx, x, dim, n, op):
        ctx.dim, ctx.op = dim, op
        return op.gather_parts(x.contiguous(), dim, n)

    @staticmethod
    def backward(ctx, grad):
        op, n = ctx.op, grad.shape[ctx.dim]
        pieces = [grad.index_select(ctx.dim, op.index(n, rank=r).to(grad.device)) for r in range(op.size)]
        most = max(p.shape[ctx.dim] for p in pieces)
        mine = pieces[op.rank].shape[ctx.dim]
        pieces = [p if p.shape[ctx.dim] == most else  # ranks holding a token less: padded, the padding dropped
                  torch.cat([p, p.new_zeros((*p.shape[:ctx.dim], most - p.shape[ctx.dim], *p.shape[ctx.dim + 1:]))],
                            dim=ctx.dim) for p in pieces]
        parts = torch.stack(pieces)
        out = parts.new_empty(parts.shape[1:])
        reduce_scatter_single(out.view(-1), parts.view(-1), group=op.group)
        return out.narrow(ctx.dim, 0, mine), None, None, None


class _SequenceOp(nn.Module):
    kind = backward_kind = ""

    def __init__(self, *, dim: int, blocks, layout: list[torch.Tensor], group, size: int, rank: int) -> None:
        super().__init__()
        self.dim, self.blocks, self.layout = dim, None if blocks is None else tuple(blocks), layout
        self.group, self.size, self.rank = group, size, rank

    def index(self, n: int, rank: int) -> torch.Tensor:
        return _rank_index(self.layout, rank, n, self.blocks)

    def full(self, local: int) -> int:
        """The length of the split dim whose part this rank holds as ``local`` elements."""
        seq, held = sum(len(p) for p in self.layout), len(self.layout[self.rank])
        return sum(self.blocks) if self.blocks is not None else local // held * seq

    def gather_parts(self, local: torch.Tensor, dim: int, n: int) -> torch.Tensor:
        if self.group is None:
            raise RuntimeError(f"{type(self).__name__}: this graph was built for inspection and has no process group")
        counts = [len(self.index(n, r)) for r in range(self.size)]
        most = max(counts)
        if local.shape[dim] < most:  # ranks holding a token less send a padded part; the padding is dropped below
            pad = list(local.shape)
            pad[dim] = most - local.shape[dim]
            local = torch.cat([local, local.new_zeros(pad)], dim=dim)
        parts = [torch.empty_like(local) for _ in range(self.size)]
        peers.run(dist.all_gather, parts, local, group=self.group)
        shape = list(local.shape)
        shape[dim] = n
        out = local.new_empty(shape)
        for r, part in enumerate(parts):
            out.index_copy_(dim, self.index(n, r).to(local.device), part.narrow(dim, 0, counts[r]))
        return out

    def extra_repr(self) -> str:
        return f"dim={self.dim}, size={self.size}, rank={self.rank}"

    def comm_bytes(self, input_shape, elem_size: int) -> tuple[int, int]:
        numel = int(torch.Size(input_shape).numel())
        if self.kind == "all_gather":  # forward gathers, backward reduce-scatters the gathered gradient
            return numel * elem_size * self.size, numel * elem_size * self.size
        return 0, 0

    def wires(self, x, *others):
        """A gather sends this rank's part padded to the most any rank holds; its backward reduce-scatters every
        rank's part, so padded. A scatter sends nothing either way."""
        if self.kind != "all_gather":
            return (), ()
        n = self.full(x.shape[self.dim])
        most = max(len(self.index(n, r)) for r in range(self.size))
        part = x.numel() // x.shape[self.dim] * most
        return (Wire("all_gather", part, x.dtype),), (Wire("reduce_scatter", part * self.size, x.dtype),)


class SequenceScatter(_SequenceOp):
    """Keeps this rank's token positions of a full-length value; its gradient stays a partial sum."""

    kind, backward_kind = "split", "local"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Scatter.apply(x, self.dim, self.index(x.shape[self.dim], self.rank), self)


class SequenceGather(_SequenceOp):
    """All-gathers every rank's tokens into the full sequence in natural order; backward sums, keeps this rank's."""

    kind, backward_kind = "all_gather", "reduce_scatter"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Gather.apply(x, self.dim, self.full(x.shape[self.dim]), self)


# ------------------------------------------------------------------------------- all-to-all (Ulysses) attention


class _AllToAll(torch.autograd.Function):
    """Sequence split <-> head split over the cp ranks; the backward is the other direction."""

    @staticmethod
    def forward(ctx, x, op, to_heads: bool):
        ctx.op, ctx.to_heads = op, to_heads
        return op.to_heads(x) if to_heads else op.to_sequence(x)

    @staticmethod
    def backward(ctx, grad):
        op = ctx.op
        return (op.to_sequence(grad) if ctx.to_heads else op.to_heads(grad)), None, None


class _HeadExchange(_ParallelOp):
    """All-to-all between a split sequence (this rank's positions ``layout[rank]`` of dim ``seq``, every head of
    dim ``heads``) and split heads (this rank's ``1/c`` of the heads, the whole sequence in natural order)."""

    calls = (1, 1)

    def __init__(self, *, heads: int, seq: int, layout: list[torch.Tensor], group, size: int, rank: int) -> None:
        super().__init__(group=group, size=size, rank=rank)
        self.heads, self.seq = heads, seq
        self.order = torch.cat([torch.as_tensor(p, dtype=torch.long) for p in layout])  # positions as received
        self.natural = torch.argsort(self.order)

    def _exchange(self, parts: torch.Tensor) -> torch.Tensor:
        """``parts[j]`` goes to rank ``j``; returns what every rank sent this one, in rank order."""
        group = self._run_group()
        if group is None:
            return parts
        out = torch.empty_like(parts)
        peers.run(dist.all_to_all_single, out, parts.contiguous(), group=group)
        return out

    def _check(self, x: torch.Tensor) -> None:
        if x.shape[self.heads] % self.size:
            works = [c for c in range(1, x.shape[self.heads] + 1) if x.shape[self.heads] % c == 0]
            raise ValueError(f"{type(self).__name__}: {x.shape[self.heads]} heads (dim {self.heads} of "
                             f"{tuple(x.shape)}) do not split over cp={self.size}: all-to-all attention needs the "
                             f"heads each rank holds to divide by cp; use cp in {works}, or cp attention 'gather' "
                             "or 'ring'")

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(.., H, T/c, ..) of this rank's positions -> (.., H/c, T, ..) of this rank's heads, positions in order."""
        self._check(x)
        parts = torch.stack(x.chunk(self.size, dim=self.heads))  # part j: the heads rank j will hold
        got = self._exchange(parts)  # got[r]: rank r's positions of this rank's heads
        whole = torch.cat(got.unbind(0), dim=self.seq)
        return whole.index_select(self.seq, self.natural.to(x.device))

    def to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse: (.., H/c, T, ..) of this rank's heads -> (.., H, T/c, ..) of this rank's positions."""
        ordered = x.index_select(self.seq, self.order.to(x.device))
        parts = torch.stack(ordered.chunk(self.size, dim=self.seq))  # part j: rank j's positions
        got = self._exchange(parts)  # got[r]: this rank's positions of rank r's heads
        return torch.cat(got.unbind(0), dim=self.heads)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, seq={self.seq}, size={self.size}, rank={self.rank}"

    def comm_bytes(self, input_shape, elem_size: int) -> tuple[int, int]:
        moved = int(torch.Size(input_shape).numel()) * elem_size * (self.size - 1) // self.size
        return moved, moved

    def wires(self, x, *others):
        return (Wire("all_to_all", x.numel(), x.dtype),), (Wire("all_to_all", x.numel(), x.dtype),)


class SequenceToHeads(_HeadExchange):
    """Before attention: every head's queries (keys, values) of this rank's positions become this rank's heads
    over the whole sequence (Ulysses); backward, the inverse all-to-all."""

    kind, backward_kind = "all_to_all", "all_to_all"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _AllToAll.apply(x, self, True)


class HeadsToSequence(_HeadExchange):
    """After attention: this rank's heads over the whole sequence become every head of this rank's positions."""

    kind, backward_kind = "all_to_all", "all_to_all"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _AllToAll.apply(x, self, False)
        # laid out like attention's output, heads inside the sequence in memory, which models view after a transpose
        return out.transpose(self.heads, self.seq).contiguous().transpose(self.heads, self.seq)
