"""Pipeline split: cut a training graph into stage graphs at the partitioner's cuts.

Terms: a *stage* is a contiguous piece of the model, numbered 0..S-1 in model order; the stage's
*activations* are the values it computes that depend on parameters. Every node that depends on a
parameter belongs to exactly one stage (``stage_of``). Parameter-free values (attention masks,
position ids, RoPE tables, reshaped targets) are recomputed on every stage that reads them instead
of being sent, since they are cheap and often not contiguous (a mask expanded over the batch).

Each stage graph takes the model's flat inputs (every rank has the whole batch) followed by the
activations received from the previous stage (placeholders ``recv_<name>``, marked ``meta.RECEIVED = <name>``:
readers go by the mark, not the name), and returns the activations later stages need, or,
on the last stage, the loss. An activation read two stages later passes through the stage between.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from autoshard import meta
from autoshard.passes.propagate import requires_grad
from autoshard.passes.writes import base_of, closure, writers, written_arguments


@dataclass(frozen=True)
class TensorSpec:
    """Shape, dtype and memory order of a value crossing a cut: what the receiver allocates.

    ``order`` lists the dims from outermost in memory when that is not row-major (a value transposed before the
    cut): it is sent in that order and received into a buffer laid out alike, so a ``view`` after the cut that
    worked on the original works on the copy."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    order: tuple[int, ...] | None = None

    @staticmethod
    def of(val: torch.Tensor) -> TensorSpec:
        order = tuple(sorted(range(val.dim()), key=lambda d: (-val.stride(d), d)))
        return TensorSpec(tuple(val.shape), val.dtype, None if order == tuple(range(val.dim())) else order)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sender's tensor in the order and dtype the receiver's buffer has (a dtype the sender did not predict
        is cast, never sent as bytes of another width)."""
        return (tensor if self.order is None else tensor.permute(self.order)).to(self.dtype).contiguous()

    def allocate(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A buffer to receive into, and the value it holds in the sender's dims."""
        if self.order is None:
            buffer = torch.empty(self.shape, dtype=self.dtype, device=device)
            return buffer, buffer
        buffer = torch.empty([self.shape[d] for d in self.order], dtype=self.dtype, device=device)
        return buffer, buffer.permute([self.order.index(d) for d in range(len(self.order))])


@dataclass
class Stage:
    index: int
    gm: fx.GraphModule
    receives: list[str]  # names (in the whole graph) of the activations this stage gets from the previous one
    sends: list[str]  # names of the activations it hands to the next stage (empty on the last)
    receive_specs: list[TensorSpec]
    send_specs: list[TensorSpec]

    @property
    def parameters(self) -> list[str]:
        return [name for name, _ in self.gm.named_parameters()]


def split_pipeline(gm: fx.GraphModule, stage_of: dict[str, int], num_stages: int) -> list[Stage]:
    """Cut ``gm`` into ``num_stages`` stage graphs; ``stage_of`` maps every activation's node name to its stage."""
    grad = requires_grad(gm)
    nodes = list(gm.graph.nodes)
    activations = [n for n in nodes if n in grad and n.op == "call_function"]
    missing = [n.name for n in activations if n.name not in stage_of]
    if missing:
        raise ValueError(f"no stage given for nodes {missing[:5]}: every activation needs one")
    crossing = _crossing(activations, stage_of, num_stages)
    state_writes = _state_writes(nodes, grad, stage_of)
    stages = []
    for index in range(num_stages):
        receives = crossing[index - 1] if index > 0 else []
        sends = crossing[index] if index < num_stages - 1 else []
        writes = [w for w, stage in state_writes.items() if stage == index]
        stage_gm = _stage_graph(gm, nodes, grad, stage_of, index, receives, sends, writes)
        by_name = {n.name: n for n in nodes}
        stages.append(Stage(index, stage_gm, receives, sends, _specs(by_name, receives), _specs(by_name, sends)))
    return stages


def _state_writes(nodes: list[fx.Node], grad: set[fx.Node], stage_of: dict[str, int]) -> dict[fx.Node, int]:
    """The stage of each write into the model's state (a buffer) that no gradient flows through: BatchNorm's
    ``num_batches_tracked += 1``, which nothing in the graph may read. It runs on one stage, the first that holds an
    activation of the module it came from (else the first stage), once per step as in the model run whole."""
    stages_of_module: dict[str, int] = {}
    for node in nodes:
        if node.name in stage_of:
            stages_of_module.setdefault(meta.module_path(node), stage_of[node.name])
    found = {}
    for node in nodes:
        written = written_arguments(node)
        if node not in grad and written and all(base_of(w).op == "get_attr" for w in written):
            found[node] = stages_of_module.get(meta.module_path(node), 0)
    return found


def _crossing(activations: list[fx.Node], stage_of: dict[str, int], num_stages: int) -> list[list[str]]:
    """For each cut k (between stage k and k+1), the activations computed at or before k and read after."""
    last_use: dict[str, int] = {}
    for node in activations:
        readers = [stage_of[u.name] if u.name in stage_of else num_stages - 1
                   for u in activation_readers(node, lambda n: n.name in stage_of)]
        last_use[node.name] = max(readers, default=stage_of[node.name])
        if any(r < stage_of[node.name] for r in readers):
            raise ValueError(f"{node.name} is read by an earlier stage: stages must follow the graph's order")
    return [
        [n.name for n in activations if stage_of[n.name] <= cut < last_use[n.name]]
        for cut in range(num_stages - 1)
    ]


def activation_readers(node: fx.Node, is_activation) -> list[fx.Node]:
    """The activations (and the graph's output) that read ``node``, looking through the values that belong to no
    stage: an integer index computed from it (a top-k's indices) is recomputed by whichever stage reads it."""
    found: list[fx.Node] = []
    seen: set[fx.Node] = set()
    todo = list(node.users)
    while todo:
        user = todo.pop()
        if user in seen:
            continue
        seen.add(user)
        if user.op == "output" or is_activation(user):
            found.append(user)
        else:
            todo.extend(user.users)
    return found


def _stage_graph(gm, nodes, grad, stage_of, index, receives, sends, writes) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        if node.op == "placeholder":
            env[node] = graph.node_copy(node)
    by_name = {n.name: n for n in nodes}
    for name in receives:
        source = by_name[name]
        env[source] = graph.placeholder(f"recv_{name}")
        env[source].meta = {**source.meta, meta.RECEIVED: name}
        if writers(source):
            # the model updates it, or a view of it, in place (``hidden *= scale``, ``x[..., :k].copy_(y)``),
            # which a received leaf that requires grad refuses: the stage works on a copy, whose gradient still
            # reaches the received value
            received = env[source]
            env[source] = graph.call_function(torch.ops.aten.clone.default, (received,))
            env[source].meta = {**source.meta}
    wanted = _needed(nodes, grad, stage_of, index, sends, by_name, writes)
    for node in nodes:
        if node in env or node.op in ("placeholder", "output") or node not in wanted:
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
    if sends:
        graph.output(tuple(env[by_name[name]] for name in sends))
    else:
        output = next(n for n in nodes if n.op == "output")
        graph.output(fx.node.map_arg(output.args[0], lambda n: env[n]))
    graph.eliminate_dead_code()
    stage = fx.GraphModule(gm, graph)
    stage.graph.lint()
    return stage


def _needed(nodes, grad, stage_of, index, sends, by_name, writes) -> set[fx.Node]:
    """This stage's activations and writes into the model's state, plus the parameters and parameter-free values they
    read, and every write into those (a mask built by slice assignments: its ``fill_``s have no users, and a walk
    back from the readers misses them)."""
    own = {n for n in nodes if n.name in stage_of and stage_of[n.name] == index}
    roots = list(own) + list(writes) + [by_name[s] for s in sends]
    if not sends:
        roots += [n for n in nodes if n.op == "output"]

    def elsewhere(node: fx.Node) -> bool:  # an activation of another stage: received, not recomputed
        return node in grad and node.op == "call_function" and stage_of.get(node.name) != index

    def admit(writer: fx.Node) -> bool:  # another stage's update of its own activation (``h *= scale``) is its own
        return not (elsewhere(writer) and all(base_of(v) in grad for v in written_arguments(writer)))

    needed = closure(roots, lambda node: [s for s in node.all_input_nodes if not elsewhere(s)], admit)
    passed_on = {by_name[s] for s in sends}  # received from the stage before and handed on as they are
    foreign = [n for n in nodes if n in needed and elsewhere(n) and n not in passed_on]
    if foreign:
        node = foreign[0]
        line = meta.source_line(node)
        raise ValueError(
            f"pipeline stage {index} reads a value that {node.name} ({node.target}{', ' + line if line else ''}) "
            f"writes in place, and that write is computed from stage {stage_of.get(node.name)}'s activations: a "
            "stage recomputes the values it reads but cannot recompute another stage's write. Cut the pipeline "
            "elsewhere (pp=1 runs it), or write the value without an in-place op")
    return needed


def _specs(by_name: dict[str, fx.Node], names: list[str]) -> list[TensorSpec]:
    specs = []
    for name in names:
        val = meta.val(by_name[name])
        if not isinstance(val, torch.Tensor):
            raise ValueError(f"{name} crosses a pipeline cut but is not a tensor; cut elsewhere")
        specs.append(TensorSpec.of(val))
    return specs
