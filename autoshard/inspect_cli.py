"""``autoshard inspect``: what one rank of a mesh would run, built without any process group.

    autoshard inspect MODULE:FACTORY --mesh tp=2,pp=2 [--rank N] [--microbatches M] [--chunks V]
                      [--schedule [NAME]] [--dot DIR]

The command imports MODULE (a dotted module on the Python path, or a file such as ``examples/model.py``),
calls FACTORY and compiles what it returns for rank N of the mesh exactly as ``parallelize`` would, but
with no processes: it prints the mesh and the rank's coordinates, the tensor-parallel plan (every
parameter's role, placement and local shape), the context-parallel plan (the sequence dim of every
input), the pipeline partition (cuts, stage costs, balance, schedule and bubble), the code of each of
the rank's stages, the collectives per microbatch and per step, and the planner's lint of the mesh.

The factory contract. ``FACTORY()`` (or ``FACTORY(args)`` with literal arguments, e.g.
``tests/models.py:build("gpt")``) returns one of

- ``(model, example_inputs, target, loss_fn)`` or ``(model, example_inputs)``: a tuple or list;
- a dict with the keys ``model``, ``example_inputs`` (or ``inputs``), and optionally ``target``, ``loss_fn``;
- an object with those attributes (``.model``, ``.inputs`` or ``.example_inputs``, ``.target``, ``.loss_fn``),
  such as the test zoo's ``ZooCase``;
- a bare ``nn.Module``: its example inputs are made up from its first layer (token ids of shape
  ``--batch`` x ``--seq`` for an ``nn.Embedding``, ``--batch`` x in_features values for an ``nn.Linear``).

``example_inputs`` is the global batch (a tuple of the model's positional inputs; a single tensor is
taken as a tuple of one). With ``loss_fn`` and ``target`` the training graph (forward, loss and
backward) is inspected; without them, the inference graph.

``--schedule [NAME]`` draws the pipeline timeline as a grid of pipeline ranks by time (every forward and
backward of a chunk one column, ``.`` idle); NAME (gpipe, 1f1b, interleaved; default 1f1b, or interleaved
with ``--chunks`` > 1) is also the schedule whose bubble the pipeline section reports. ``--dot DIR`` writes
one Graphviz file per rewritten graph of the rank (``rank1.dot``, or ``rank1_stage3.dot`` per pipeline stage).

Errors in the input (the MODULE:FACTORY, a factory that raises or returns something else, the mesh, the
rank, a model the compiler cannot split that way) are one line on stderr, with the fix, and exit code 2.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import os
import re
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoshard.explain import _bytes
from autoshard.mesh import AXES, Mesh

NAME = "inspect"
HELP = "print the plan, the code and the collectives of one rank, without any process group"
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved")

_EPILOG = """\
FACTORY returns (model, example_inputs, target, loss_fn), (model, example_inputs), a dict with those keys,
an object with those attributes (.inputs also works), or a bare model (inputs made from its first layer and
--batch/--seq). Literal arguments may follow the name: 'tests/models.py:build("gpt")'.

examples:
  autoshard inspect 'tests/models.py:build("gpt")' --mesh tp=2,pp=2 --rank 1 --microbatches 4 --schedule
  autoshard inspect tests/models.py:build_gpt_model --mesh cp=2 --dot graphs/
"""


class InspectError(ValueError):
    """Bad input to ``autoshard inspect``: the message says what is wrong and how to fix it."""


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(NAME, help=HELP, description=HELP, epilog=_EPILOG,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("factory", metavar="MODULE:FACTORY",
                        help="a dotted module or a .py file, and the function in it that builds the model")
    parser.add_argument("--mesh", default="", help="degrees of the parallel axes, e.g. tp=2,pp=2 (default: one rank)")
    parser.add_argument("--rank", type=int, default=0, help="the rank to show (0)")
    parser.add_argument("--microbatches", type=int, default=1, help="microbatches per dp rank's batch (1)")
    parser.add_argument("--chunks", type=int, default=1, help="pipeline stages per pp rank (interleaving) (1)")
    parser.add_argument("--schedule", nargs="?", const="", default=None, metavar="NAME",
                        help="draw the pipeline timeline of schedule NAME: gpipe, 1f1b (default) or interleaved "
                             "(the default with --chunks > 1)")
    parser.add_argument("--dot", metavar="DIR", help="write a Graphviz .dot file of each rewritten graph into DIR")
    c = parser.add_argument_group("compiler options, as in parallelize()")
    c.add_argument("--tp-indivisible", choices=("error", "replicate"), default="error",
                   help="a block tp does not divide: error (default) or keep it replicated")
    c.add_argument("--cp-attention", choices=("gather", "ring"), default="gather", help="attention over cp (gather)")
    c.add_argument("--cp-load-balance", action="store_true", help="give cp rank r chunks r and 2c-1-r")
    c.add_argument("--data-parallel", choices=("ddp", "fsdp"), default="ddp",
                   help="replicas summed over dp x cp (ddp), or FSDP2 sharding over them (fsdp)")
    c.add_argument("--pipeline-starts", metavar="MODULES",
                   help="comma-separated modules at which the stages after the first begin (default: balanced)")
    b = parser.add_argument_group("made-up inputs, for a factory that returns a bare model")
    b.add_argument("--batch", type=int, default=8, help="global batch (8)")
    b.add_argument("--seq", type=int, default=16, help="sequence length of token inputs (16)")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Inspect and print; bad input becomes one line on stderr and exit code 2."""
    from autoshard.capture import CaptureError

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning)  # torch's own deprecation notices
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            options = _options(args)
            case = load_case(args.factory, batch=args.batch, seq=args.seq)
            inspection = inspect_rank(case, **options)
            print(format_report(inspection, timeline=args.schedule is not None), flush=True)
            if args.dot:
                for path in write_graphs(inspection, args.dot):
                    print(f"wrote {path}")
    except (InspectError, CaptureError, ValueError) as e:
        message = _one_line(str(e)).replace("pass tp_indivisible='replicate'", "pass --tp-indivisible replicate")
        print(f"autoshard inspect: error: {message}", file=sys.stderr)
        return 2
    return 0


def _options(args: argparse.Namespace) -> dict[str, Any]:
    try:
        mesh = Mesh.parse(args.mesh)
    except ValueError as e:
        raise InspectError(f"--mesh {args.mesh}: {e}") from e
    if not 0 <= args.rank < mesh.world_size:
        raise InspectError(f"--rank {args.rank} is not in {mesh}: ranks are 0 .. {mesh.world_size - 1}")
    for flag in ("microbatches", "chunks", "batch", "seq"):
        if getattr(args, flag) < 1:
            raise InspectError(f"--{flag} {getattr(args, flag)}: it must be at least 1")
    if args.chunks > 1 and mesh.pp == 1:
        raise InspectError(f"--chunks {args.chunks} needs a pipeline: add pp=2 or more to --mesh")
    schedule = args.schedule or ("interleaved" if args.chunks > 1 else "1f1b")
    if schedule not in SCHEDULE_NAMES:
        raise InspectError(f"--schedule {schedule!r} is not a schedule: use one of {', '.join(SCHEDULE_NAMES)} "
                           "(and put MODULE:FACTORY before --schedule)")
    starts = [s.strip() for s in args.pipeline_starts.split(",") if s.strip()] if args.pipeline_starts else None
    return dict(mesh=mesh, rank=args.rank, microbatches=args.microbatches, chunks=args.chunks, schedule=schedule,
                tp_indivisible=args.tp_indivisible, cp_attention=args.cp_attention,
                cp_load_balance=args.cp_load_balance, pipeline_starts=starts, data_parallel=args.data_parallel)


def _one_line(text: str) -> str:
    return "; ".join(line.strip() for line in text.strip().splitlines() if line.strip())


# --------------------------------------------------------------------------------------------- the factory


@dataclass
class Case:
    """What a factory gave: the model, a global batch of example inputs, and optionally target and loss."""

    model: Any
    inputs: tuple
    target: Any = None
    loss_fn: Callable | None = None
    source: str = ""
    made_up_inputs: bool = False


_PREFIX = re.compile(r"(?<![\w.])model\.")  # the capture's prefix of parameter names, in a plan's reasons
_SPEC = re.compile(r"^(?P<module>[^:]+):(?P<name>[A-Za-z_][\w.]*)\s*(?:\((?P<args>.*)\))?\s*$", re.DOTALL)


def load_case(spec: str, *, batch: int = 8, seq: int = 16) -> Case:
    """Import MODULE, call FACTORY (with its literal arguments) and read the result as a :class:`Case`."""
    match = _SPEC.match(spec)
    if match is None:
        raise InspectError(f"{spec!r} is not MODULE:FACTORY: write e.g. examples/model.py:build or "
                           "mypackage.models:make_model (a dotted module or a .py file, a colon, a function)")
    module = _import(match["module"])
    factory = _attribute(module, match["name"], match["module"])
    args, kwargs = _arguments(match["args"], spec)
    try:
        result = factory(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - any failure of the user's factory is reported as bad input
        raise InspectError(f"{match['name']}() raised {type(e).__name__}: {_one_line(str(e)) or '(no message)'}"
                           f"{_where(e)}: fix the factory, or give it arguments as in "
                           f"'{match['module']}:{match['name']}(\"gpt\", seed=0)'") from e
    return _as_case(result, spec, batch=batch, seq=seq)


def _import(name: str):
    if name.endswith(".py") or os.sep in name or "/" in name:
        return _import_file(Path(name))
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: modules of the current folder import
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            raise InspectError(f"no module named {name!r}: give a dotted module on the Python path (run from the "
                               "folder that holds it) or the path of a .py file") from e
        raise InspectError(f"importing {name!r} failed: {e}: install {e.name!r} or fix the import") from e
    except Exception as e:  # noqa: BLE001 - the user's module failed at import time
        raise InspectError(f"importing {name!r} raised {type(e).__name__}: {_one_line(str(e))}{_where(e)}") from e


def _import_file(path: Path):
    if not path.is_file():
        raise InspectError(f"no file {str(path)!r}: give the path of a .py file (relative to {os.getcwd()}) or a "
                           "dotted module name")
    path = path.resolve()
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # its sibling modules import, as when it is run as a script
    name = path.stem
    existing = sys.modules.get(name)
    if existing is not None and getattr(existing, "__file__", None) and Path(existing.__file__).resolve() == path:
        return existing
    if existing is not None:
        name = f"autoshard_inspect_{abs(hash(str(path)))}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise InspectError(f"cannot import {str(path)!r}: it is not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the user's file failed at import time
        del sys.modules[name]
        raise InspectError(f"importing {str(path)!r} raised {type(e).__name__}: {_one_line(str(e))}"
                           f"{_where(e)}") from e
    return module


def _attribute(module, name: str, where: str):
    value = module
    for part in name.split("."):
        if not hasattr(value, part):
            callables = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                               and getattr(v, "__module__", None) == module.__name__)
            found = f"; it defines {', '.join(callables[:8])}" if callables else ""
            raise InspectError(f"{where} has no {name!r}{found}")
        value = getattr(value, part)
    if not callable(value):
        raise InspectError(f"{where}:{name} is a {type(value).__name__}, not a function: name a function that "
                           "builds the model")
    return value


def _arguments(text: str | None, spec: str) -> tuple[tuple, dict]:
    if text is None or not text.strip():
        return (), {}
    try:
        call = ast.parse(f"f({text})", mode="eval").body
        assert isinstance(call, ast.Call)
        args = tuple(ast.literal_eval(a) for a in call.args)
        kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg is not None}
    except (SyntaxError, ValueError, AssertionError) as e:
        raise InspectError(f"cannot read the arguments of {spec!r}: only literals (strings, numbers, lists, ...) "
                           "may be passed, e.g. 'tests/models.py:build(\"gpt\", seed=1)'") from e
    return args, kwargs


def _where(error: BaseException) -> str:
    from autoshard.capture import user_frame

    frame = user_frame(error)
    return f" (at {frame.filename}:{frame.lineno})" if frame else ""


def _as_case(result: Any, spec: str, *, batch: int, seq: int) -> Case:
    from torch import nn

    fields = {}
    if isinstance(result, nn.Module):
        fields["model"] = result
    elif isinstance(result, dict):
        fields = {"model": result.get("model"), "inputs": result.get("example_inputs", result.get("inputs")),
                  "target": result.get("target"), "loss_fn": result.get("loss_fn")}
    elif isinstance(result, (tuple, list)) and 1 <= len(result) <= 4:
        fields = dict(zip(("model", "inputs", "target", "loss_fn"), result, strict=False))
    elif hasattr(result, "model"):
        fields = {"model": result.model, "inputs": getattr(result, "example_inputs", getattr(result, "inputs", None)),
                  "target": getattr(result, "target", None), "loss_fn": getattr(result, "loss_fn", None)}
    model = fields.get("model")
    if not isinstance(model, nn.Module):
        raise InspectError(f"{spec} returned {_describe(result)}: return a model, (model, example_inputs[, target, "
                           "loss_fn]), a dict with those keys or an object with those attributes")
    case = Case(model=model, inputs=fields.get("inputs"), target=fields.get("target"), loss_fn=fields.get("loss_fn"),
                source=spec)
    if case.inputs is None:
        case.inputs, case.made_up_inputs = _made_up_inputs(model, spec, batch, seq), True
    elif not isinstance(case.inputs, tuple):
        case.inputs = tuple(case.inputs) if isinstance(case.inputs, list) else (case.inputs,)
    if case.loss_fn is not None and case.target is None:
        raise InspectError(f"{spec} returned a loss_fn but no target: return (model, example_inputs, target, "
                           "loss_fn) with an example target, or no loss_fn for the inference graph")
    if case.loss_fn is not None and not callable(case.loss_fn):
        raise InspectError(f"{spec}: loss_fn is a {type(case.loss_fn).__name__}, not a function")
    return case


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} ({', '.join(type(v).__name__ for v in value[:5])})"
    return f"a {type(value).__name__}"


def _made_up_inputs(model, spec: str, batch: int, seq: int) -> tuple:
    import torch
    from torch import nn

    for module in model.modules():
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        if isinstance(module, nn.Embedding):
            generator = torch.Generator().manual_seed(0)
            return (torch.randint(0, module.num_embeddings, (batch, seq), generator=generator).to(device),)
        if isinstance(module, nn.Linear):
            return (torch.randn(batch, module.in_features, generator=torch.Generator().manual_seed(0)).to(device),)
    raise InspectError(f"{spec} returned a bare {type(model).__name__} whose first layer is neither an Embedding nor "
                       "a Linear, so no example inputs can be made up: return (model, example_inputs)")


# ------------------------------------------------------------------------------------------------- building


@dataclass
class Inspection:
    """Everything ``autoshard inspect`` shows about one rank, built without process groups."""

    case: Case
    mesh: Mesh
    rank: int
    microbatches: int
    chunks: int
    schedule: str
    captured: Any
    microbatch_inputs: tuple
    token_loss: Any = None
    tp_plan: Any = None
    cp_plan: Any = None
    partition: Any = None
    stages: list = field(default_factory=list)  # every pipeline stage (empty without pp)
    programs: dict[int, Any] = field(default_factory=dict)  # this rank's programs, by stage (0 without pp)
    actions: dict | None = None
    notes: list[str] = field(default_factory=list)
    lint: list = field(default_factory=list)
    data_parallel: str = "ddp"

    @property
    def coords(self) -> dict[str, int]:
        return self.mesh.coords(self.rank)

    @property
    def num_stages(self) -> int:
        return self.mesh.pp * self.chunks


def inspect_rank(case: Case, *, mesh: Mesh, rank: int = 0, microbatches: int = 1, chunks: int = 1,
                 schedule: str = "1f1b", tp_indivisible: str = "error", cp_attention: str = "gather",
                 cp_load_balance: bool = False, pipeline_starts: list[str] | None = None,
                 data_parallel: str = "ddp") -> Inspection:
    """Compile ``case`` for ``rank`` of ``mesh`` as ``parallelize`` does, without processes."""
    from autoshard import codegen
    from autoshard.capture import capture
    from autoshard.passes.context_parallel import plan_context_parallel
    from autoshard.passes.loss import find_token_loss, sum_loss_pass
    from autoshard.passes.partition import partition
    from autoshard.passes.placements import Shard
    from autoshard.passes.tensor_parallel import plan_tensor_parallel
    from autoshard.runtime import batching, schedules

    coords = mesh.coords(rank)
    training = case.loss_fn is not None
    values = (*case.inputs, case.target) if training else case.inputs
    batching.check(batching.batch_size(case.inputs), microbatches=microbatches, dp=mesh.dp, local=False)
    if mesh.dp > 1:
        values = batching.split(values, mesh.dp)[coords["dp"]]
    values = batching.split(values, microbatches)[0]
    inputs, target = (values[:-1], values[-1]) if training else (values, None)
    if training:
        captured = capture(case.model, inputs, loss_fn=case.loss_fn, example_target=target)
    else:
        captured = capture(case.model, inputs, training=case.model.training)
    if data_parallel not in ("ddp", "fsdp"):
        raise InspectError(f"--data-parallel {data_parallel!r}: use ddp or fsdp")
    out = Inspection(case=case, mesh=mesh, rank=rank, microbatches=microbatches, chunks=chunks, schedule=schedule,
                     captured=captured, microbatch_inputs=values, data_parallel=data_parallel)
    if training:
        out.token_loss = find_token_loss(captured.gm)
        if out.token_loss is not None:
            sum_loss_pass(captured.gm, out.token_loss)
    if mesh.tp > 1:
        out.tp_plan = plan_tensor_parallel(captured.gm, mesh.tp, indivisible=tp_indivisible)
        if all(not isinstance(p.placement, Shard) for p in out.tp_plan.params.values()):
            out.notes.append(f"no block to split over tp={mesh.tp} was found: the tp ranks run the model replicated")
    if mesh.cp > 1:
        out.cp_plan = plan_context_parallel(captured.gm, mesh.cp, load_balance=cp_load_balance,
                                            attention=cp_attention)
    sharding = codegen.Sharding(tp_plan=out.tp_plan, tp_rank=coords["tp"], cp_plan=out.cp_plan,
                                cp_rank=coords["cp"], training=captured.with_loss)
    if mesh.pp == 1:
        out.programs = {0: codegen.build(captured, sharding)}
    else:
        out.partition = partition(codegen.prepare(captured), out.num_stages, starts=pipeline_starts)
        mine = [s for s in range(out.num_stages) if s % mesh.pp == coords["pp"]]
        out.stages, out.programs = codegen.build_stages(captured, sharding, out.partition.stage_of,
                                                        out.num_stages, mine)
        out.actions = schedules.schedule(schedule, mesh.pp, microbatches, chunks)
        schedules.validate(out.actions, mesh.pp, chunks)
    out.lint = _lint(case, mesh, microbatches, chunks)
    return out


def _lint(case: Case, mesh: Mesh, microbatches: int, chunks: int) -> list:
    from autoshard.api import transformer_config
    from autoshard.planner import lint
    from autoshard.runtime.batching import batch_size

    config = transformer_config(case.model, case.inputs, batch_size(case.inputs) or 1)
    return lint(mesh, config, microbatches=microbatches, interleave=chunks)


# ------------------------------------------------------------------------------------------------- the report


def format_report(x: Inspection, *, timeline: bool = False) -> str:
    sections = [_header(x), _parameters(x), _context_parallel(x), _pipeline(x, timeline), _code(x),
                _collectives(x), _lint_lines(x)]
    return "\n\n".join("\n".join(lines) for lines in sections if lines)


def _header(x: Inspection) -> list[str]:
    model = x.case.model
    params = {id(p): p.numel() for p in model.parameters()}
    coords = ", ".join(f"{axis}={x.coords[axis]}" for axis in AXES)
    lines = [f"autoshard inspect {x.case.source}: {type(model).__name__}, {_count(sum(params.values()))} parameters",
             f"mesh: {x.mesh}, world size {x.mesh.world_size}; rank {x.rank} at {coords}"]
    groups = [f"{axis} {x.mesh.group_of(axis, x.rank)}" for axis in ("tp", "cp", "dp", "pp") if x.mesh.degree(axis) > 1]
    if groups:
        lines.append(f"  groups of rank {x.rank}: {'; '.join(groups)}")
    made_up = " (made up from the first layer: the factory returned a bare model)" if x.case.made_up_inputs else ""
    n = len(x.case.inputs)
    target = f" (target {_shapes((x.case.target,))})" if x.captured.with_loss else ""
    local = f" (target {_shapes(x.microbatch_inputs[n:])})" if x.captured.with_loss else ""
    lines.append(f"  batch: global {_shapes(x.case.inputs)}{target}{made_up} -> {x.microbatches} microbatch(es) per "
                 f"dp rank of {_shapes(x.microbatch_inputs[:n])}{local}")
    what = "training graph (forward, loss, backward)" if x.captured.with_loss else (
        "inference graph (no loss_fn and target: return (model, example_inputs, target, loss_fn) for training)")
    lines.append(f"  captured the {what}: {x.captured.num_nodes} nodes in {x.captured.seconds:.2f} s")
    if x.token_loss is not None:
        lines.append(f"  loss: token loss {x.token_loss.node} (ignore_index={x.token_loss.ignore_index}) summed per "
                     "microbatch, divided by the global batch's counted tokens")
    return lines


def _parameters(x: Inspection) -> list[str]:
    from autoshard.passes.placements import Replicate

    local: dict[str, tuple] = {}
    for program in x.programs.values():
        local.update({name: tuple(p.shape) for name, p in program.gm.named_parameters()})
    holder = {name: s.index for s in x.stages for name in s.parameters}
    full = {name: tuple(p.shape) for name, p in x.captured.gm.named_parameters()}
    title = f"tensor-parallel plan over tp={x.mesh.tp}" if x.tp_plan is not None else (
        "parameters (tp=1: every parameter whole)")
    lines = [f"{title}; local shapes on rank {x.rank} (tp rank {x.coords['tp']}):"]
    rows = []
    for target, shape in full.items():
        plan = x.tp_plan.params.get(target) if x.tp_plan is not None else None
        role, placement = (plan.role, repr(plan.placement)) if plan is not None else ("replicated", repr(Replicate()))
        here = "x".join(map(str, local[target])) if target in local else f"(stage {holder.get(target, '?')})"
        names = ", ".join(x.captured.names.get(target, [target]))
        why = _PREFIX.sub("", plan.reason) if plan else ""
        rows.append((names, role, placement, "x".join(map(str, shape)) or "scalar", here, why))
    header = ("parameter", "role", "placement", "full", "local", "why")
    lines += _table([header, *rows], right=())
    lines += [f"  note: {note}" for note in (x.tp_plan.notes if x.tp_plan is not None else [])]
    lines += [f"  note: {note}" for note in x.notes]
    return lines


def _context_parallel(x: Inspection) -> list[str]:
    plan = x.cp_plan
    if plan is None:
        return []
    positions = plan.positions(x.coords["cp"]).tolist()
    ranges = _ranges(positions)
    lines = [f"context-parallel plan over cp={plan.size}: attention {plan.attention}"
             + (", load-balanced chunks" if plan.load_balance else "")]
    for name, dim in plan.inputs.items():
        lines.append(f"  {name}: sequence dim {dim}, {plan.seq_len} tokens -> {plan.seq_len // plan.size} per rank")
    lines.append(f"  cp rank {x.coords['cp']} holds token positions {ranges}")
    return lines


def _pipeline(x: Inspection, timeline: bool) -> list[str]:
    from autoshard.runtime import schedules

    if x.partition is None:
        if timeline:
            return [f"pipeline: none (pp=1 in {x.mesh}): no timeline to draw; add pp=2 or more to --mesh"]
        return []
    part, p, v, m = x.partition, x.mesh.pp, x.chunks, x.microbatches
    pp_index = x.coords["pp"]
    mine = sorted(x.programs)
    sim = schedules.simulate(x.actions, p, v)
    formula = (p - 1) / (v * m + p - 1)
    lines = [
        f"pipeline: {x.num_stages} stages on {p} pp ranks" + (f" ({v} chunks per rank)" if v > 1 else "")
        + f"; rank {x.rank} (pp={pp_index}) runs stage{'s' if len(mine) > 1 else ''} {', '.join(map(str, mine))}",
        f"  cuts after {', '.join(part.cut_after)} (of {part.candidates} places where the fewest values cross), "
        f"sending {', '.join(_bytes(b) for b in part.crossing_bytes)} per microbatch",
        f"  stage costs {', '.join(f'{c:.3g}' for c in part.costs)} (largest over mean: {part.balance:.2f})",
        f"  schedule {x.schedule}, {m} microbatch(es): simulated bubble {sim.bubble:.1%} (formula (p-1)/(v*m+p-1) "
        f"= {formula:.1%}); at most {max(sim.peak_in_flight.values()):.2g} stage-equivalents of activations in flight",
    ]
    holders: dict[str, set[int]] = {}
    for stage in x.stages:
        for name in stage.parameters:
            holders.setdefault(name, set()).add(stage.index % p)
    for name, ranks in sorted(holders.items()):
        if len(ranks) > 1:
            names = ", ".join(x.captured.names.get(name, [name]))
            lines.append(f"  {names} is used on pp ranks {sorted(ranks)}: its gradients are summed there")
    if timeline:
        drawn = schedules.simulate(x.actions, p, v, forward_cost=1.0, backward_cost=1.0)
        grid = schedules.render(x.actions, p, sim=drawn).splitlines()
        grid[pp_index] += f"   <- rank {x.rank}"
        lines += ["", f"timeline ({x.schedule}): one row per pp rank, time to the right; F3/B3 = forward/backward of "
                  "microbatch 3" + (" (F3.5: of stage 5)" if v > 1 else "") + ", . = idle", *grid]
    return lines


def _code(x: Inspection) -> list[str]:
    lines: list[str] = []
    for index, program in sorted(x.programs.items()):
        if x.stages:
            stage = x.stages[index]
            what = [f"stage {index} of {x.num_stages}"]
            if stage.receives:
                what.append(f"receives {_specs(stage.receive_specs)} from pp rank {(index - 1) % x.mesh.pp}")
            if stage.sends:
                what.append(f"sends {_specs(stage.send_specs)} to pp rank {(index + 1) % x.mesh.pp}")
            title = f"code of rank {x.rank}, {'; '.join(what)}:"
        else:
            title = f"code of rank {x.rank}:"
        if lines:
            lines.append("")
        lines.append(title)
        lines += program.code.strip().splitlines()
        lines += _modules(program.gm)
    return lines


def _modules(gm) -> list[str]:
    """The communication modules the code calls, with this rank's settings (its vocab range, its positions)."""
    from autoshard.dot import collective

    found = [(node.target, collective(gm, node)) for node in gm.graph.nodes if collective(gm, node) is not None]
    if not found:
        return []
    width = max(len(name) for name, _ in found)
    return ["  where", *(f"    self.{name:<{width}} = {module!r}" for name, module in found)]


def collectives(gm) -> dict[tuple[str, str, str, str], tuple[int, int]]:
    """Collectives one run of ``gm`` makes, by mesh axis: (axis, direction, kind, op) -> (calls, bytes).

    :func:`autoshard.explain.communication` counts them; its op names start with the axis (``tp ReduceFromParallel``).
    """
    from autoshard.explain import communication

    found: dict[tuple[str, str, str, str], tuple[int, int]] = {}
    for (direction, kind, op), (calls, size) in communication(gm).items():
        axis, _, name = op.rpartition(" ")
        key = (axis or "tp", direction, kind, name)
        old = found.get(key, (0, 0))
        found[key] = (old[0] + calls, old[1] + size)
    return found


def _collectives(x: Inspection) -> list[str]:
    m = x.microbatches
    rows = []
    for index, program in sorted(x.programs.items()):
        stage = f"{index}" if x.stages else "-"
        for (axis, direction, kind, op), (calls, size) in collectives(program.gm).items():
            if direction == "backward" and not x.captured.with_loss:
                continue  # an inference graph has no backward
            rows.append((stage, axis, direction, kind, op, str(calls), _bytes(size)))
        if x.stages:
            st, p = x.stages[index], x.mesh.pp
            # forward activations cross each cut; in training their gradients come back the other way
            for specs, peer, there, back in ((st.receive_specs, (index - 1) % p, "recv", "send"),
                                             (st.send_specs, (index + 1) % p, "send", "recv")):
                if not specs:
                    continue
                size = _bytes(_spec_bytes(specs))
                word = "from" if there == "recv" else "to"
                rows.append((stage, "pp", "forward", there, f"activations {word} pp rank {peer}", "1", size))
                if x.captured.with_loss:
                    word = "to" if back == "send" else "from"
                    rows.append((stage, "pp", "backward", back, f"gradients {word} pp rank {peer}", "1", size))
    order = {"tp": 0, "cp": 1, "pp": 2}
    rows.sort(key=lambda r: (r[0], order.get(r[1], 3), r[2] != "forward"))
    lines = [f"collectives of rank {x.rank} per microbatch ({m} per step), without process groups:"]
    if rows:
        lines += _table([("stage", "axis", "pass", "collective", "op", "calls", "bytes"), *rows], right=(5, 6))
    else:
        lines.append("  none")
    data = x.mesh.dp * x.mesh.cp
    if data > 1:
        params = {id(q): q for program in x.programs.values() for q in program.gm.parameters() if q.requires_grad}
        grads = sum(q.numel() * q.element_size() for q in params.values())
        over = " x ".join(f"{a}={x.mesh.degree(a)}" for a in ("dp", "cp") if x.mesh.degree(a) > 1)
        if x.data_parallel == "fsdp":
            gathers = "once per step" if x.mesh.pp > 1 else "for each microbatch's forward and backward"
            lines.append(f"per step: FSDP2 over {data} ranks ({over}): this rank's parameters all-gathered {gathers} "
                         f"({_bytes(grads)}), its gradients reduce-scattered (sum, {_bytes(grads)}); each rank keeps "
                         f"1/{data} of them, of their gradients and of the optimizer state")
        else:
            how = ("in buckets launched during the last backward that finishes them" if x.mesh.pp > 1
                   else "bucketed by DistributedDataParallel during the last microbatch's backward")
            lines.append(f"per step: all-reduce (sum) of this rank's gradients over {data} ranks ({over}): "
                         f"{_bytes(grads)}, {how}")
    tied = [line for line in _pipeline(x, False) if "is used on pp ranks" in line]
    if tied:
        lines.append("per step: tied parameters' gradients summed over the pp ranks that use them")
    return lines


def _lint_lines(x: Inspection) -> list[str]:
    if not x.lint:
        return [f"lint: no finding for {x.mesh} (the planner's rules)"]
    return ["lint (the planner's rules):", *(f"  {finding}" for finding in x.lint)]


def write_graphs(x: Inspection, folder: str | Path) -> list[Path]:
    """One Graphviz file per rewritten graph of the rank: ``rank{R}.dot`` or ``rank{R}_stage{S}.dot``."""
    from autoshard.dot import write_dot

    written = []
    for index, program in sorted(x.programs.items()):
        name = f"rank{x.rank}_stage{index}" if x.stages else f"rank{x.rank}"
        sends = bool(x.stages and x.stages[index].sends)
        title = f"{type(x.case.model).__name__} on {x.mesh}, rank {x.rank}" + (f", stage {index}" if x.stages else "")
        try:
            written.append(write_dot(program.gm, Path(folder) / f"{name}.dot", title=title, sends=sends))
        except OSError as e:
            raise InspectError(f"cannot write {folder}: {e.strerror or e}: give a folder you can write to") from e
    return written


# ---------------------------------------------------------------------------------------------------- helpers


def _table(rows: list[tuple], right: tuple[int, ...]) -> list[str]:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    out = []
    for row in rows:
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths,
                                                                                                 strict=True))]
        out.append(("  " + "  ".join(cells)).rstrip())
    return out


def _shapes(values: tuple) -> str:
    import torch

    return ", ".join("x".join(map(str, v.shape)) if isinstance(v, torch.Tensor) else repr(v) for v in values)


def _specs(specs: list) -> str:
    return ", ".join(f"{'x'.join(map(str, s.shape))} {str(s.dtype).removeprefix('torch.')}" for s in specs)


def _spec_bytes(specs: list) -> int:
    import math

    import torch

    return sum(math.prod(s.shape) * torch.empty((), dtype=s.dtype).element_size() for s in specs)


def _ranges(positions: list[int]) -> str:
    spans, start = [], None
    for i, p in enumerate(positions):
        if start is None:
            start = p
        if i + 1 == len(positions) or positions[i + 1] != p + 1:
            spans.append(f"{start}..{p}")
            start = None
    return ", ".join(spans)


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)

