"""``autoshard inspect``: what one rank of a mesh would run, built without any process group.
    autoshard inspect MODULE:FACTORY --mesh tp=2,pp=2 [--rank N] [--microbatches M] [--chunks V]
                      [--schedule [NAME]] [--dot DIR]

The command imports MODULE (a dotted module on the Python path, or a file such as ``examples/model.py``),
calls FACTORY, compiles what it returns for rank N of the mesh with ``compile.compile_rank`` exactly as
``parallelize`` does but with no processes, and prints the report ``pm.explain(code=True)`` prints on that
rank (``autoshard.explain``): the plans, the pipeline and its timeline, the code of each of the rank's
stages, the collectives per microbatch and per step, and the planner's lint. This module only parses the
arguments and loads the factory.

The factory contract. ``FACTORY()`` (or ``FACTORY(args)`` with literal arguments, e.g.
``tests/harness/models.py:build("gpt")``) returns ``(model, example_inputs[, target, loss_fn])``, a dict or an object
with those (``inputs`` also works), or a bare ``nn.Module`` whose global batch is made up from its first layer
(``--batch`` x ``--seq`` token ids, or ``--batch`` x in_features values). With ``loss_fn`` and ``target`` the
training graph is inspected, else the inference graph. ``--schedule NAME`` picks the pipeline schedule.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoshard import schedules
from autoshard.errors import AutoshardError
from autoshard.mesh import Mesh
from autoshard.options import CHOICES, CompileOptions

NAME = "inspect"
HELP = "print the plan, the code and the collectives of one rank, without any process group"

_EPILOG = """\
FACTORY returns (model, example_inputs[, target, loss_fn]), a dict with those keys, an object with those
attributes, or a bare model (inputs made from its first layer and --batch/--seq). examples:
  autoshard inspect 'tests/harness/models.py:build("gpt")' --mesh tp=2,pp=2 --rank 1 --microbatches 4 --schedule
  autoshard inspect tests/harness/models.py:build_gpt_model --mesh cp=2 --dot graphs/
"""


class InspectError(AutoshardError, ValueError):
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
                        help="draw the pipeline timeline of schedule NAME: gpipe, 1f1b (default), interleaved "
                             "(the default with --chunks > 1), zb-h1 or zbv (zero-bubble)")
    parser.add_argument("--dot", metavar="DIR", help="write a Graphviz .dot file of each rewritten graph into DIR")
    parser.add_argument("--certificate", action="store_true",
                        help="print, as JSON, the collectives the rank's programs issue in a training step (kind, "
                             "group, dtype, elements, node and model line): its communication certificate")
    parser.add_argument("--job-plan", action="store_true",
                        help="print only the job's plan as JSON (what a running job's pm.job_plan.to_json() gives)")
    c = parser.add_argument_group("compiler options, as in parallelize()")
    c.add_argument("--tp-indivisible", choices=CHOICES["tp_indivisible"], default="error",
                   help="a block tp does not divide: error (default) or keep it replicated")
    c.add_argument("--cp-attention", choices=CHOICES["cp_attention"], default="gather", help="attention over cp")
    c.add_argument("--cp-load-balance", action="store_true", help="give cp rank r chunks r and 2c-1-r")
    c.add_argument("--sequence-parallel", nargs="?", const="on", choices=("on", "auto"), default=None,
                   help="split the sequence over tp between the tensor-parallel regions ('auto': where it applies)")
    c.add_argument("--data-parallel", choices=CHOICES["data_parallel"], default="ddp",
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
            mesh, rank, options = _options(args)
            case = load_case(args.factory, batch=args.batch, seq=args.seq)
            build = inspect_rank(case, mesh=mesh, rank=rank, options=options)
            if args.job_plan:
                print(build.plan.to_json(), flush=True)
                return 0
            if args.certificate:
                print(build.certificate.to_json(), flush=True)
                return 0
            print(report(case, build, timeline=args.schedule is not None), flush=True)
            if args.dot:
                for path in write_graphs(case, build, args.dot):
                    print(f"wrote {path}")
    except (InspectError, CaptureError, ValueError) as e:
        message = _one_line(_for_the_command_line(e))
        print(f"autoshard inspect: error: {message}", file=sys.stderr)
        return 2
    return 0


def _options(args: argparse.Namespace) -> tuple[Mesh, int, CompileOptions]:
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
    schedule = args.schedule or str(schedules.named(args.chunks))
    if schedule not in CHOICES["schedule"]:
        raise InspectError(f"--schedule {schedule!r} is not a schedule: use one of {', '.join(CHOICES['schedule'])} "
                           "(and put MODULE:FACTORY before --schedule)")
    starts = [s.strip() for s in args.pipeline_starts.split(",") if s.strip()] if args.pipeline_starts else None
    return mesh, args.rank, CompileOptions(
        microbatches=args.microbatches, chunks=args.chunks, schedule=schedule, tp_indivisible=args.tp_indivisible,
        cp_attention=args.cp_attention, cp_load_balance=args.cp_load_balance, pipeline_starts=starts,
        data_parallel=args.data_parallel,
        sequence_parallel={None: False, "on": True, "auto": "auto"}[args.sequence_parallel])


def _for_the_command_line(error: Exception) -> str:
    """The error's text, with an option it suggests spelt as this command's flag."""
    option = getattr(error, "option", None)
    flag = f"--{option[0].replace('_', '-')} {option[1]}" if option else ""
    return f"{error.reason}; or pass {flag} to keep such layers replicated" if option else str(error)


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
                           "may be passed, e.g. 'tests/harness/models.py:build(\"gpt\", seed=1)'") from e
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


# ------------------------------------------------------------------------------------------ build and report


def inspect_rank(case: Case, *, mesh: Mesh, rank: int = 0, options: CompileOptions | None = None):
    """Compile ``case`` for ``rank`` of ``mesh`` as ``parallelize`` does, without processes: a ``RankBuild``."""
    from autoshard.compile import compile_global_batch

    return compile_global_batch(case.model, case.inputs, mesh, rank, options or CompileOptions(),
                                target=case.target if case.loss_fn is not None else None, loss_fn=case.loss_fn)


def report(case: Case, build, *, timeline: bool = False) -> str:
    """What ``autoshard inspect`` prints: the case's global batch, then the report ``pm.explain(code=True)`` gives."""
    from autoshard.explain import render
    from autoshard.planner.auto import lint_findings

    made_up = " (made up from the first layer: the factory returned a bare model)" if case.made_up_inputs else ""
    target = f", target {_shapes((case.target,))}" if build.training else ""
    lines = [f"autoshard inspect {case.source}: global batch {_shapes(case.inputs)}{target}{made_up}"]
    if timeline and build.mesh.pp == 1:
        lines.append(f"pipeline: none (pp=1 in {build.mesh}): no timeline to draw; add pp=2 or more to --mesh")
    mesh = build.mesh
    lint = lint_findings(mesh, case.model, case.inputs, build.options) if mesh.world_size > 1 else None
    text = render([build], model=case.model, mesh=mesh, rank=build.rank, options=build.options, lint=lint, code=True)
    return "\n".join(lines) + "\n\n" + text


def write_graphs(case: Case, build, folder: str | Path) -> list[Path]:
    """One Graphviz file per rewritten graph of the rank: ``rank{R}.dot`` or ``rank{R}_stage{S}.dot``."""
    from autoshard.dot import write_build

    try:
        return write_build(build, folder, title=f"{type(case.model).__name__} on {build.mesh}, rank {build.rank}")
    except OSError as e:
        raise InspectError(f"cannot write {folder}: {e.strerror or e}: give a folder you can write to") from e


def _shapes(values: tuple) -> str:
    import torch

    return ", ".join("x".join(map(str, v.shape)) if isinstance(v, torch.Tensor) else repr(v) for v in values)
