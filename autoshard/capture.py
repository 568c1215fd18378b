"""Capture: an unmodified model (and its loss) as one FX graph with shapes and module provenance.

torch.export in non-strict mode is the route: it runs the model's own Python, so HuggingFace models
and models built on the ``meta`` device capture exactly, and its training IR keeps the ops the
passes look for (``aten.linear``, ``aten.embedding``, ``aten.scaled_dot_product_attention``,
``aten.cross_entropy_loss``). Every node of the result carries ``meta["val"]`` (``meta.VAL``) (a fake tensor with
shape and dtype) and ``meta["nn_module_stack"]`` (the modules it came from); parameters keep their
fully qualified names, prefixed by ``model.`` (the attribute of the capture wrapper).

Terms: the *training graph* maps (inputs..., target) to the loss; the *inference graph* maps inputs to
the model's outputs. Both are captures of their own, at fixed shapes (export bakes sizes into views).
"""

from __future__ import annotations

import contextlib
import operator
import os
import sysconfig
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from autoshard import meta
from autoshard.errors import AutoshardError
from autoshard.functions import KeptFunctionError, identity_pass, kept_whole
from autoshard.passes.causal_mask import causal_attention_pass
from autoshard.passes.grouped_experts import grouped_experts_pass

MODEL_PREFIX = "model."


class CaptureError(AutoshardError, RuntimeError):
    """The model could not be captured as a graph; the message names the model's source line."""


@dataclass
class Captured:
    """A captured graph and what is known about it.

    ``gm`` is runnable (``gm(*inputs, target)`` or ``gm(*inputs)``) and shares its parameter tensors
    with the model. ``names`` maps each parameter of ``gm`` (by its name in ``gm``) to every name the
    original model gives that tensor (more than one when weights are tied).
    """

    gm: fx.GraphModule
    with_loss: bool
    input_shapes: tuple
    names: dict[str, list[str]] = field(default_factory=dict)
    seconds: float = 0.0
    training: bool = True  # the model's mode during the capture: dropout and batch norm ops depend on it
    token_loss: object = None  # a training capture's token loss (``passes.loss.TokenLoss``), rewritten to a sum
    count_gm: fx.GraphModule | None = None  # with a token loss: counts the tokens it averaged over
    # a training capture: the same capture at ``factor`` times the batch (sizes the capture bakes in at the batch are
    # told apart from the model's own by comparing the two; ``passes.batch_statistics``)
    recapture: Callable[[int], Captured] | None = field(default=None, compare=False, repr=False)
    # a training capture taken with ``outputs=True``: the inference graph at the same shapes, split off the same export
    inference: Captured | None = field(default=None, compare=False, repr=False)
    first_pass: bool = False  # the first of two passes (``job_plan.two_passes``): runs under the training autocast
    second_pass: bool = False  # the second of two passes: its loss is a sum over the parts by construction

    @property
    def key(self) -> tuple:
        """What tells captures of one model apart: the input shapes and the mode."""
        return self.input_shapes, self.training

    @property
    def num_nodes(self) -> int:
        return len(self.gm.graph.nodes)


class _WithLoss(nn.Module):
    """``forward(*inputs, target) -> loss_fn(model(*inputs), target)``: model and loss as one graph."""

    def __init__(self, model: nn.Module, loss_fn: Callable) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *args):
        *inputs, target = args
        return self.loss_fn(self.model(*inputs), target)


class _WithLossAndOutputs(_WithLoss):
    """``forward(*inputs, target) -> (loss, outputs)``: one export holding both the training and the inference graph.

    The outputs are returned as copies taken before the loss runs, so a loss that writes into them in place cannot
    change what the inference graph returns; the inference graph reads the values themselves (``_split``).
    """

    def forward(self, *args):
        *inputs, target = args
        outputs = self.model(*inputs)
        kept = pytree.tree_map_only(torch.Tensor, torch.ops.aten.alias_copy.default, outputs)
        return self.loss_fn(outputs, target), kept


class _Plain(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *inputs):
        return self.model(*inputs)


def capture(
    model: nn.Module,
    example_inputs: tuple,
    *,
    loss_fn: Callable | None = None,
    example_target: torch.Tensor | None = None,
    training: bool = True,
    outputs: bool = False,
) -> Captured:
    """Capture ``model`` (and ``loss_fn`` when given) at the shapes of the example inputs.

    With ``loss_fn`` the graph takes ``(*inputs, target)`` and returns the scalar loss. The model's
    train/eval mode is set to ``training`` during the capture and restored afterwards; a HuggingFace
    model's key-value cache is turned off during the capture (training needs none, and export
    rejects the cache object it returns).

    With ``loss_fn`` and ``outputs=True``, one export also yields the inference graph at the same shapes
    (``Captured.inference``): a model trained and then evaluated at one batch shape is traced once, not twice.
    Where the model's outputs cannot be returned from the export, the training graph is captured alone.
    """
    if not isinstance(example_inputs, tuple):
        raise TypeError(f"example_inputs must be a tuple of the model's positional inputs, got {type(example_inputs)}")
    if loss_fn is not None and example_target is None:
        raise ValueError("a loss_fn needs an example target: pass target=... with the example inputs")
    args = (*example_inputs, example_target) if loss_fn is not None else example_inputs
    if _on_meta(model):  # a model built on meta traces its inputs as meta too: only their shapes and kinds count
        args = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)
    start = time.perf_counter()
    exported = None
    if loss_fn is not None and outputs:
        with contextlib.suppress(Exception):  # the training graph alone is still tried, and its failure explained
            exported = _export(model, _WithLossAndOutputs(model, loss_fn), args, training)
    if exported is None:
        exported = _export(model, _WithLoss(model, loss_fn) if loss_fn is not None else _Plain(model), args, training)
        return _finish(exported.module(), model, args, training, start, with_loss=loss_fn is not None)
    captured = _finish(exported.module(), model, args, training, start, with_loss=True)
    split = time.perf_counter()
    inference = _split(captured.gm, n_target=len(pytree.tree_leaves(example_target)))
    if inference is not None:
        captured.inference = Captured(gm=inference, with_loss=False, input_shapes=shapes_of(example_inputs),
                                      names=_original_names(inference, model), seconds=time.perf_counter() - split,
                                      training=training)
    return captured


def _on_meta(model: nn.Module) -> bool:
    params = list(model.parameters())
    return bool(params) and all(p.device.type == "meta" for p in params)


def _export(model: nn.Module, wrapper: nn.Module, args: tuple, training: bool):
    with _no_kv_cache(model), _mode(model, training), kept_whole():
        try:
            return torch.export.export(wrapper, args, strict=False)
        except Exception as e:  # noqa: BLE001 - every export failure is re-raised with the model's line
            refused = next((c for c in _chain(e) if isinstance(c, KeptFunctionError)), None)
            if refused is not None:
                raise CaptureError(str(refused)) from e
            raise CaptureError(_explain_failure(model, e)) from e


def _chain(error: BaseException) -> Iterator[BaseException]:
    while error is not None:
        yield error
        error = error.__cause__ or error.__context__


def _finish(gm: fx.GraphModule, model: nn.Module, args: tuple, training: bool, start: float, *,
            with_loss: bool) -> Captured:
    """The exported graph as the passes take it: one name per parameter, no-grad regions inlined, Functions that are
    the identity seen through, masks read."""
    with _one_recompile(gm):
        _canonical_parameter_names(gm)
        _inline_no_grad(gm)
        identity_pass(gm)
        causal_attention_pass(gm)
        grouped_experts_pass(gm)
    return Captured(gm=gm, with_loss=with_loss, input_shapes=shapes_of(args), names=_original_names(gm, model),
                    seconds=time.perf_counter() - start, training=training)


@contextlib.contextmanager
def _one_recompile(gm: fx.GraphModule) -> Iterator[None]:
    """The passes inside edit the graph and each would regenerate its code: it is generated once, at the end."""
    gm.recompile = lambda: None  # an attribute of this instance, over the class's method
    try:
        yield
    finally:
        del gm.recompile
        gm.recompile()


def _split(gm: fx.GraphModule, *, n_target: int) -> fx.GraphModule | None:
    """Cut a ``_WithLossAndOutputs`` capture in two: ``gm`` keeps the loss alone (the training graph), and the
    inference graph returned, a copy sharing the model's tensors, the model's outputs without the target. None where
    the outputs cannot be cut off.

    The trace records the model, then the outputs' copies, then the loss: the inference graph is every node before
    the last copy (nothing of the loss, whatever it writes in place), returning the values the copies read. Each
    graph loses what only the other one's part read, and nothing else: it is the graph its own export would give.
    """
    info = gm.graph._codegen.pytree_info
    loss_spec, out_spec = _children(info.out_spec)
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))

    out = _output(gm.graph)
    flat = list(out.args[0])
    out.args = (tuple(flat[:loss_spec.num_leaves]),)
    _erase(gm.graph, [v for v in flat[loss_spec.num_leaves:] if isinstance(v, fx.Node)])
    _set_specs(gm, info.orig_args, info.in_spec, loss_spec)

    out = _output(graph)
    flat = list(out.args[0])[loss_spec.num_leaves:]
    copies = [v for v in flat if isinstance(v, fx.Node)]
    if not copies or any(c.target is not torch.ops.aten.alias_copy.default for c in copies):
        return None
    nodes = list(graph.nodes)
    last = max(nodes.index(c) for c in copies)
    out.args = (tuple(v.args[0] if isinstance(v, fx.Node) else v for v in flat),)
    _erase(graph, [*reversed(nodes[last + 1:-1]), *copies])  # the loss, then the copies
    _erase(graph, [n for n in graph.nodes if n.op == "call_module" and n.target == "_guards_fn"])  # checks the target
    places = [n for n in graph.nodes if n.op == "placeholder"]
    targets = places[len(places) - n_target:]
    if any(t.users for t in targets):
        return None
    for t in targets:
        graph.erase_node(t)
    args_spec, kwargs_spec = _children(info.in_spec)
    in_spec = pytree.TreeSpec(tuple, None, [pytree.TreeSpec(tuple, None, _children(args_spec)[:-1]), kwargs_spec])
    inference = fx.GraphModule(gm, graph)
    _set_specs(inference, info.orig_args[:-1], in_spec, out_spec)
    return inference


def _children(spec) -> list:
    children = getattr(spec, "children", None)  # a method in newer torch, an attribute alone in older
    return list(children()) if callable(children) else list(spec.children_specs)


def _output(graph: fx.Graph) -> fx.Node:
    return next(n for n in reversed(graph.nodes) if n.op == "output")


def _erase(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase ``nodes`` (in an order where each has no users left when reached), then every op that only they read,
    transitively; never an op that writes."""
    chosen, gone = set(nodes), set()
    work = list(nodes)
    while work:
        node = work.pop(0)
        if node in gone or node.users:
            continue
        if node not in chosen and (node.op not in ("call_function", "get_attr") or node.is_impure()):
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        gone.add(node)
        work.extend(inputs)


def _set_specs(gm: fx.GraphModule, orig_args: list, in_spec, out_spec) -> None:
    gm.graph._codegen = fx.graph._PyTreeCodeGen(fx.graph._PyTreeInfo(orig_args, in_spec, out_spec))
    gm.graph.lint()
    gm.recompile()


def shapes_of(values) -> tuple:
    """The shapes (or the values, for non-tensors) of a flat tuple: the key of a capture cache."""
    return tuple(tuple(v.shape) if isinstance(v, torch.Tensor) else v for v in values)


def _canonical_parameter_names(gm: fx.GraphModule) -> None:
    """Make every ``get_attr`` of a parameter use the name ``named_parameters()`` gives it.

    A tied weight has several names; export may read it under any of them. With one name per tensor,
    plans and placements keyed by name see every use.
    """
    canonical = {id(p): name for name, p in gm.named_parameters()}
    for node in list(gm.graph.nodes):
        if node.op != "get_attr":
            continue
        try:
            value = gm.get_parameter(node.target)
        except AttributeError:
            continue
        name = canonical.get(id(value), node.target)
        if not node.users:
            gm.graph.erase_node(node)
        elif name != node.target:
            node.target = name
    gm.graph.lint()
    gm.recompile()


def _inline_no_grad(gm: fx.GraphModule) -> None:
    """Put the ops of every ``torch.no_grad()`` region (captured as a call of a submodule,
    ``wrap_with_set_grad_enabled(False, ...)``) into the graph itself, each input detached.

    Detached inputs keep what the region meant: no gradient flows into it, and a parameter it alone reads gets
    none. Inline, its ops are planned as any others: a sparse-attention indexer's projections, a recurrent
    model's cycles run without gradients, are split instead of held whole on every rank.
    """
    for node in list(gm.graph.nodes):
        if not (node.op == "call_function" and getattr(node.target, "__name__", "") == "wrap_with_set_grad_enabled"
                and node.args[:1] == (False,) and isinstance(node.args[1], fx.Node)):
            continue
        body = getattr(gm, node.args[1].target)
        if any(n.op in ("get_attr", "call_module") for n in body.graph.nodes):
            continue  # nested regions or constants of its own: left as the region it is
        places = [n for n in body.graph.nodes if n.op == "placeholder"]
        env: dict[fx.Node, object] = {}
        with gm.graph.inserting_before(node):
            for place, value in zip(places, node.args[2:], strict=True):
                if isinstance(value, fx.Node) and isinstance(meta.val(value), torch.Tensor):
                    detached = gm.graph.call_function(torch.ops.aten.detach.default, (value,))
                    detached.meta.update(value.meta)
                    value = detached
                env[place] = value
            for inner in body.graph.nodes:
                if inner.op == "placeholder":
                    continue
                if inner.op == "output":
                    results = inner.args[0]
                    break
                env[inner] = gm.graph.node_copy(inner, env.__getitem__)
        if isinstance(results, (tuple, list)):
            for user in list(node.users):
                if user.target is operator.getitem:
                    user.replace_all_uses_with(_mapped(env, results[user.args[1]]))
                    gm.graph.erase_node(user)
        else:
            node.replace_all_uses_with(_mapped(env, results))
        if not node.users:
            owner = node.args[1]
            gm.graph.erase_node(node)
            if not owner.users:
                gm.graph.erase_node(owner)
                delattr(gm, owner.target)
    gm.graph.lint()
    gm.recompile()


def _mapped(env: dict, result):
    return env[result] if isinstance(result, fx.Node) else result


def _original_names(gm: fx.GraphModule, model: nn.Module) -> dict[str, list[str]]:
    """Map each parameter of the graph to all of its names in the model, by tensor identity.

    Tied weights have one tensor and several names; eager ``named_parameters()`` reports only one of
    them, so the map is built with ``remove_duplicate=False``.
    """
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    names = {}
    for name, p in gm.named_parameters():
        fallback = [name.removeprefix(MODEL_PREFIX)]
        names[name] = by_id.get(id(p), fallback)
    return names


@contextlib.contextmanager
def _no_kv_cache(model: nn.Module) -> Iterator[None]:
    config = getattr(model, "config", None)
    if config is None or not getattr(config, "use_cache", False):
        yield
        return
    config.use_cache = False
    try:
        yield
    finally:
        config.use_cache = True


@contextlib.contextmanager
def _mode(model: nn.Module, training: bool) -> Iterator[None]:
    modes = {m: m.training for m in model.modules()}
    model.train(training)
    try:
        yield
    finally:
        for m, was_training in modes.items():
            m.training = was_training


_LIBRARY_DIRS = tuple(
    os.path.dirname(p) + os.sep
    for p in (torch.__file__, __file__)
) + tuple(sysconfig.get_paths()[k] + os.sep for k in ("stdlib", "platstdlib"))

_HINTS = (
    ("data-dependent", "the model branches (if/while) or indexes on a tensor's value; use torch.where or "
     "torch.cond, or compute the condition from shapes"),
    ("Unsupported", "an operation export cannot trace; replace it with a torch operation or move it out of forward"),
    ("DynamicCache", "a key-value cache object; pass use_cache=False to the model's config"),
)


def _explain_failure(model: nn.Module, error: Exception) -> str:
    frame = user_frame(error)
    where = f"\n  at {frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}" if frame else ""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = str(error)
    hint = next((h for key, h in _HINTS if key in text), "make this line traceable by torch.export (strict=False)")
    return (
        f"autoshard could not capture {type(model).__name__} as a graph: {type(error).__name__}: {first_line}"
        f"{where}\n  fix: {hint}."
    )


def user_frame(error: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of the traceback that belongs to the user's code, not torch's or ours."""
    frames = traceback.extract_tb(error.__traceback__)
    for frame in reversed(frames):
        filename = os.path.abspath(frame.filename) if not frame.filename.startswith("<") else frame.filename
        if filename.startswith("<") or filename.startswith(_LIBRARY_DIRS):
            continue
        return frame
    return None
