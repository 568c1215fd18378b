"""Codegen: from a captured graph and a plan to the graph module one rank runs.

A ``RankProgram`` is a ``torch.fx.GraphModule`` that takes the flat inputs (and target) and returns
the flat outputs, with readable code (``.code``) whose node names lead back to the model, and holding
only this rank's parameter shards. Every program of a rank (the training graph, the inference graph,
captures at other shapes) reads its parameters from one ``ParamStore``, so an optimizer built on the
store's parameters trains all of them. Replicated parameters are the model's own tensors; sharded
ones are new tensors holding this rank's part.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from autoshard import meta
from autoshard.capture import Captured
from autoshard.passes.axis import Outputs
from autoshard.passes.axis_pass import BatchSync, On, Sharding  # noqa: F401 - On, BatchSync re-exported
from autoshard.passes.axis_passes import AXIS_PASSES
from autoshard.passes.context_parallel import insert_splits
from autoshard.passes.pipeline_split import Stage, TensorSpec, split_pipeline
from autoshard.passes.placements import Shard
from autoshard.passes.propagate import handed_on, propagate

aten = torch.ops.aten


class ParamStore(nn.Module):
    """This rank's parameters, under their names in the captured graphs (``model.<original name>``)."""

    def adopt(self, gm: fx.GraphModule) -> None:
        """Make ``gm`` read the store's parameters; parameters the store lacks are taken from ``gm``."""
        for name, param in list(gm.named_parameters()):
            owner, _, attr = name.rpartition(".")
            mine = self.find(name)
            if mine is None:
                self._register(name, param)
            elif mine is not param:
                setattr(gm.get_submodule(owner) if owner else gm, attr, mine)

    def find(self, name: str) -> nn.Parameter | None:
        try:
            return self.get_parameter(name)
        except AttributeError:
            return None

    def _register(self, name: str, param: nn.Parameter) -> None:
        module: nn.Module = self
        *path, attr = name.split(".")
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_parameter(attr, param)


@dataclass
class RankProgram:
    """The graph module a rank runs, and how its flat outputs fold back into the model's output."""

    gm: fx.GraphModule
    out_spec: pytree.TreeSpec | None

    def __call__(self, *args):
        flat = self.gm(*pytree.tree_leaves(args))
        return pytree.tree_unflatten(list(flat), self.out_spec) if self.out_spec is not None else flat

    @property
    def code(self) -> str:
        return self.gm.code


def build(captured: Captured, sharding: Sharding, *, store: ParamStore | None = None,
          autocast: torch.dtype | None = None) -> RankProgram:
    """The program of one rank: a copy of the captured graph, sharded for its tp and cp coordinates (and, where it
    runs under ``autocast``, its writes cast to what they write into: ``writes_take_their_dtype``)."""
    gm = prepare(captured, _splits(sharding))
    _shard(gm, sharding, store)
    if autocast is not None:
        writes_take_their_dtype(gm)
    return RankProgram(gm, getattr(captured.gm, "_out_spec", None))


def prepare(captured: Captured, splits: dict[str, int] | None = None) -> fx.GraphModule:
    """A copy of the captured graph with flat inputs and outputs, sharing the captured parameters; with ``splits``
    (node name -> dim), cp's split marked after each of those nodes (a sequence that starts inside the graph).
    The captured graph itself is never edited."""
    with warnings.catch_warnings():  # copying export's pytree specs warns about a deprecated check in torch
        warnings.simplefilter("ignore", FutureWarning)
        graph = copy.deepcopy(captured.gm.graph)
    gm = fx.GraphModule(captured.gm, graph)
    if splits:
        insert_splits(gm, splits)
    _strip_export_wrappers(gm)
    return gm


def _splits(sharding: Sharding) -> dict[str, int] | None:
    plan = sharding.plan("cp")
    return plan.values if plan is not None else None


def build_stages(
    captured: Captured,
    sharding: Sharding,
    stage_of: dict[str, int],
    num_stages: int,
    mine: list[int],
    *,
    store: ParamStore | None = None,
    autocast: torch.dtype | None = None,
) -> tuple[list[Stage], dict[int, RankProgram], dict[int, tuple[list[TensorSpec], list[TensorSpec]]]]:
    """Every stage of the pipeline (to know what crosses each cut, at global shapes), the programs of this
    rank's stages, and what each of them receives and sends at the shapes this rank holds. Under ``autocast``
    (the programs run under autocast to that dtype) what crosses a cut has the dtype autocast gives it."""
    whole = prepare(captured, _splits(sharding))
    stages = split_pipeline(whole, stage_of, num_stages)
    dtypes = autocast_dtypes(whole, autocast) if autocast is not None else {}
    for stage in stages:
        stage.receive_specs = _with_dtypes(stage.receive_specs, stage.receives, dtypes)
        stage.send_specs = _with_dtypes(stage.send_specs, stage.sends, dtypes)
    programs, local = {}, {}
    for index in mine:
        stage = stages[index]
        _shard(stage.gm, _for_stage(sharding, whole, stage), store)
        if autocast is not None:
            writes_take_their_dtype(stage.gm)
        placeholders = {n.meta[meta.RECEIVED]: n for n in stage.gm.graph.nodes
                        if n.op == "placeholder" and meta.RECEIVED in n.meta}
        received = _specs([placeholders[name] for name in stage.receives], stage.receive_specs)
        output = next(n for n in stage.gm.graph.nodes if n.op == "output")
        sent = _specs(list(output.args[0]), stage.send_specs) if stage.sends else []
        local[index] = (_with_dtypes(received, stage.receives, dtypes), _with_dtypes(sent, stage.sends, dtypes))
        out_spec = getattr(captured.gm, "_out_spec", None) if index == num_stages - 1 else None
        programs[index] = RankProgram(stage.gm, out_spec)
    return stages, programs, local


def autocast_dtypes(gm: fx.GraphModule, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The dtype of each of ``gm``'s values when it runs under autocast to ``dtype`` (the capture records them
    without autocast: a conv's output is float32 there and bf16 at run time), by fake tensors, on a copy."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    copied = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    writes_take_their_dtype(copied)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    inputs = [mode.from_tensor(meta.val(n)) for n in copied.graph.nodes if n.op == "placeholder"]
    device = next((v.device.type for v in (meta.val(n) for n in gm.graph.nodes)
                   if isinstance(v, torch.Tensor)), "cpu")
    with torch.autocast(device, dtype=dtype):
        FakeTensorProp(copied, mode).propagate(*inputs)
    return {n.name: meta.val(n).dtype for n in copied.graph.nodes if isinstance(meta.val(n), torch.Tensor)}


# ops that write values into a tensor and want both in one dtype -> the position of the values written
_WRITES_INTO = {aten.index_add.default: 3, aten.index_add_.default: 3, aten.index_copy.default: 3,
                aten.index_copy_.default: 3, aten.index_put.default: 2, aten.index_put_.default: 2,
                aten.scatter.src: 3, aten.scatter_.src: 3, aten.scatter_add.default: 3, aten.scatter_add_.default: 3,
                aten.scatter_reduce.two: 3, aten.scatter_reduce_.two: 3, aten.masked_scatter.default: 2,
                aten.masked_scatter_.default: 2}


def writes_take_their_dtype(gm: fx.GraphModule) -> int:
    """Under autocast, values written into a tensor the graph made (``index_add`` into ``zeros``, ``scatter_add``,
    ``index_put``) are cast to that tensor's dtype as the program runs (``type_as``). The capture recorded the
    tensor's dtype without autocast (``torch.zeros(..., dtype=x.dtype)`` with ``x`` float32 there, bfloat16 under
    autocast), so the written values, bfloat16 from an autocast matmul, would no longer match it; the write then
    keeps float32 where the model run under autocast would have written bfloat16 (more precise, never refused).
    Returns how many writes were cast."""
    cast = 0
    for node in list(gm.graph.nodes):
        position = _WRITES_INTO.get(node.target) if node.op == "call_function" else None
        if position is None or len(node.args) <= position:
            continue
        into, values = node.args[0], node.args[position]
        if not (isinstance(into, fx.Node) and isinstance(values, fx.Node)):
            continue
        with gm.graph.inserting_before(node):
            typed = gm.graph.call_function(aten.type_as.default, (values, into))
        typed.meta.update(meta.standing_for(values))
        node.update_arg(position, typed)
        cast += 1
    if cast:
        gm.recompile()
    return cast


def _with_dtypes(specs: list[TensorSpec], names: list[str], dtypes: dict[str, torch.dtype]) -> list[TensorSpec]:
    return [dataclasses.replace(spec, dtype=dtypes.get(name, spec.dtype))
            for spec, name in zip(specs, names, strict=True)]


def _for_stage(sharding: Sharding, whole: fx.GraphModule, stage: Stage) -> Sharding:
    """A stage receives activations the whole graph's cp propagation split: seed its inputs the same way. Under
    sequence parallelism a stage receives its activations whole along the sequence (each stage's sends are
    gathered, as a model's outputs are) and splits them as it splits its inputs."""
    sharding = dataclasses.replace(sharding, stage=True)
    if sharding.plan("sp") is not None and stage.receives:
        sharding = sharding.with_plan("sp", _with_received(sharding.plan("sp"), whole, stage))
    if not sharding.splits("cp"):
        return sharding
    sharding = dataclasses.replace(sharding, keep_outputs=bool(stage.sends))
    if not stage.receives:
        return sharding
    return sharding.with_plan("cp", _with_received(sharding.plan("cp"), whole, stage))


def _with_received(plan, whole: fx.GraphModule, stage: Stage):
    """``plan`` (cp's or sp's) for a stage: its received activations that carry the sequence are inputs split along
    it too."""
    seeds = {name: Shard(dim) for name, dim in plan.inputs.items()}
    prop = propagate(whole, seeds, plan.axis(), outputs=Outputs.PARTIAL)
    by_name = {n.name: n for n in whole.graph.nodes}
    received = {n.target: prop.of(by_name[n.meta[meta.RECEIVED]]) for n in stage.gm.graph.nodes
                if n.op == "placeholder" and meta.RECEIVED in n.meta}
    inputs = {**plan.inputs, **{k: p.dim for k, p in received.items() if isinstance(p, Shard) and handed_on(p)}}
    return dataclasses.replace(plan, inputs=inputs)


def _specs(nodes: list[fx.Node], whole: list[TensorSpec]) -> list[TensorSpec]:
    """Local shapes, in the memory order the whole graph's values have (the same on sender and receiver)."""
    return [TensorSpec(tuple(meta.val(n).shape), meta.val(n).dtype, spec.order)
            for n, spec in zip(nodes, whole, strict=True)]


def _shard(gm: fx.GraphModule, sharding: Sharding, store: ParamStore | None) -> None:
    """Each axis pass this rank's sharding asks for, in order; a failure says which pass ran after which."""
    found: dict = {}
    done: list[str] = []
    for axis_pass in AXIS_PASSES:
        if not axis_pass.applies(sharding):
            continue
        try:
            axis_pass.apply(gm, sharding, found)
        except Exception as e:
            if hasattr(e, "add_note"):
                e.add_note(f"autoshard: in the {axis_pass.name} pass, after {', '.join(done) or 'no other pass'}")
            raise
        done.append(axis_pass.name)
    if store is not None:
        store.adopt(gm)


def _strip_export_wrappers(gm: fx.GraphModule) -> None:
    """Flat inputs and outputs, no shape guards or metadata asserts (the runtime keys captures by shape)."""
    graph = gm.graph
    for node in list(graph.nodes):
        guard = node.op == "call_module" and node.target == "_guards_fn"
        if guard or node.target is aten._assert_tensor_metadata.default:
            graph.erase_node(node)
    graph._codegen = fx.graph.CodeGen()
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    graph.lint()
    gm.recompile()
