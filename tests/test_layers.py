"""autoshard's modules import one way: foundations <- passes <- compile <- runtime <- api.

A model goes from ``parallelize`` (api) through the runtime's ``ParallelModel``, which asks ``compile`` for each
rank's build, which runs the ``passes`` over the captured graph. No lower layer may reach up (compile into the
runtime, a pass into compile), also not by an import inside a function: each layer is then testable, and
replaceable, without the ones above it.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# module (as installed) -> layer; a package's modules take the package's layer unless named
LAYERS = {
    "foundation": ("meta", "kinds", "mesh", "options", "cost", "schedules", "batching", "spread_choice", "errors",
                   "peers"),
    "passes": ("passes", "plan", "functions"),  # plan: the tp plan, made by passes.tensor_parallel; functions: the
    # kept calls, whose rule (passes.rules_nn) proves them per-sample on their trace
    "compile": ("capture", "codegen", "job_plan", "compile", "explain", "dot", "layout", "certificate"),
    "runtime": ("runtime",),
    "api": ("api", "verify", "inspect_cli", "cli", "planner", "hf", "accelerate", "__init__"),
}
ORDER = list(LAYERS)


def _layer(module: str) -> str:
    parts = module.split(".")[1:] or ["__init__"]
    for layer, names in LAYERS.items():
        if parts[0] in names:
            return layer
    raise AssertionError(f"{module} is in no layer: add it to tests/test_layers.py's LAYERS")


def _modules() -> dict[str, Path]:
    found = {}
    for path in (REPO / "autoshard").rglob("*.py"):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        found[name.removesuffix(".__init__") if name != "autoshard.__init__" else "autoshard.__init__"] = path
    return found


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("autoshard"):
            if node.module == "autoshard":
                found |= {f"autoshard.{a.name}" for a in node.names}
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("autoshard")}
    return found


def test_every_import_goes_to_the_same_layer_or_one_below():
    modules = _modules()
    upward = []
    for name, path in sorted(modules.items()):
        here = ORDER.index(_layer(name))
        for target in sorted(_imports(path)):
            if target in ("autoshard", "autoshard.__init__") and name == "autoshard.__init__":
                continue
            there = ORDER.index(_layer(target))
            if there > here:
                upward.append(f"{name} ({ORDER[here]}) imports {target} ({ORDER[there]})")
    assert not upward, "imports that reach up a layer:\n" + "\n".join(upward)


def test_the_layers_name_every_module():
    for name in _modules():
        _layer(name)


def test_every_exception_class_of_autoshard_has_one_root():
    """``except autoshard.AutoshardError`` catches every refusal and failure autoshard raises by a class of its own;
    each keeps its builtin base too."""
    import importlib
    import inspect

    from autoshard import AutoshardError

    loose = []
    for name in sorted(_modules()):
        module = importlib.import_module(name.removesuffix(".__init__"))
        for value in vars(module).values():
            if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == module.__name__ \
                    and not issubclass(value, AutoshardError):
                loose.append(f"{module.__name__}.{value.__name__}")
    assert not loose, loose



def test_the_axis_passes_run_in_an_order_their_constraints_allow(monkeypatch):
    """Each axis pass names the passes that must run before it; the order is checked as data (a pass named after
    one that comes later, or after one that does not exist, is refused), and a failure inside a pass says which
    pass it was and which ran before it."""
    import pytest
    import torch
    from torch import fx

    from autoshard import codegen
    from autoshard.passes.axis_pass import AxisPass, Sharding, check_order
    from autoshard.passes.axis_passes import AXIS_PASSES

    check_order(AXIS_PASSES)
    swapped = (AXIS_PASSES[1], AXIS_PASSES[0], *AXIS_PASSES[2:])
    with pytest.raises(AssertionError, match=r"'tp' must come after \['batch statistics'\]"):
        check_order(swapped)
    stray = AxisPass("stray", after=("nowhere",), applies=lambda s: True, apply=lambda gm, s, found: None)
    with pytest.raises(AssertionError, match=r"'stray' must come after .*no such passes: \['nowhere'\]"):
        check_order((*AXIS_PASSES, stray))
    with pytest.raises(AssertionError, match=r"named twice: \['tp'\]"):
        check_order((*AXIS_PASSES, AXIS_PASSES[1]))

    def fails(gm, sharding, found):
        raise RuntimeError("a rewrite failed")

    passes = (AxisPass("first", (), lambda s: True, lambda gm, s, found: None),
              AxisPass("second", ("first",), lambda s: True, fails))
    gm = fx.symbolic_trace(torch.nn.Linear(2, 2))
    monkeypatch.setattr(codegen, "AXIS_PASSES", passes)
    with pytest.raises(RuntimeError, match="a rewrite failed") as raised:
        codegen._shard(gm, Sharding(), None)
    assert "in the second pass, after first" in "\n".join(getattr(raised.value, "__notes__", [])), raised.value


def test_each_axis_is_one_record_beside_its_pass_with_its_plan():
    """An axis is one ``AxisPass``, defined in its own pass module: its rewrite and, where the job plan holds its
    plan, that plan's JSON form, its line in ``str(plan)`` and the mesh axis it is applied on. The registry lists
    every record defined anywhere in the passes; the job plan's JSON keys are the records' names (the keys plans
    written before hold)."""
    import importlib
    import json

    import pytest

    from autoshard import mesh
    from autoshard.job_plan import JobPlan
    from autoshard.options import CompileOptions
    from autoshard.passes.axis_pass import AxisPass, PlanCodec
    from autoshard.passes.axis_passes import AXIS_PASSES, PLANNED

    defined = {}
    for name in sorted(n for n in _modules() if n.startswith("autoshard.passes.")):
        module = importlib.import_module(name)
        defined |= {id(v): (name, v) for v in vars(module).values() if isinstance(v, AxisPass)}
    assert {id(p) for p in AXIS_PASSES} == set(defined), "an AxisPass defined in the passes is not in AXIS_PASSES"
    for axis_pass in AXIS_PASSES:
        home, _ = defined[id(axis_pass)]
        assert home not in ("autoshard.passes.axis_pass", "autoshard.passes.axis_passes"), axis_pass.name
        parts = [axis_pass.apply] + ([axis_pass.codec.describe] if axis_pass.codec is not None else [])
        assert all(part.__module__ == home for part in parts), f"{axis_pass.name}'s record is not beside its pass"
    assert list(PLANNED) == ["tp", "cp", "sp", "ep"]  # the JSON keys tp_plan, ... that plans written before hold
    written = json.loads(JobPlan(mesh.Mesh(), CompileOptions()).to_json())
    assert [key for key in written if key.endswith("_plan")] == [f"{name}_plan" for name in PLANNED]
    assert all(p.mesh_axis in (*mesh.AXES, "ep") for p in PLANNED.values())
    with pytest.raises(ValueError, match="give both or neither"):
        AxisPass("half", (), lambda s: True, lambda gm, s, found: None, codec=PlanCodec(str, str, str))


def test_what_autoshard_knows_of_an_op_is_one_record_whatever_was_imported():
    """Every sharding rule, localizer and signature matcher came through ``rules.op``, which refuses a second,
    different record for an op; an op's rule does not depend on which modules were imported (topk's rule had
    been set by ``batch_statistics`` at its import, with ``setdefault``); every op ``cost`` counts FLOPs for came
    through it too, with how the planner times it."""
    import subprocess
    import sys

    import pytest
    import torch

    import autoshard.codegen  # noqa: F401 - every pass module, each recording what it knows of its ops
    from autoshard import cost
    from autoshard.passes import rules

    aten = torch.ops.aten
    assert all(("rule", target) in rules.RECORDED for target in rules.RULES)
    assert all(("localizer", target) in rules.RECORDED for target in rules.LOCALIZERS)
    assert all(("matcher", matches) in rules.RECORDED for matches, _ in rules.MATCHERS)
    with pytest.raises(AssertionError, match="one record per op"):
        rules.op(aten.topk.default, rule=rules._pointwise)
    rules.op(aten.topk.default, rule=rules.RULES[aten.topk.default])  # the same record again changes nothing
    alone = subprocess.run([sys.executable, "-c", "import torch; from autoshard.passes import rules; "
                            "print(torch.ops.aten.topk.default in rules.RULES)"], capture_output=True, text=True)
    assert alone.stdout.strip() == "True", alone.stderr
    assert all(("flops", packet) in rules.RECORDED for packet in cost.FLOPS)
    assert set(cost.FLOPS) == set(cost.TIMING) and set(cost.TIMING.values()) <= {cost.MATMUL, cost.ATTENTION}
    assert {aten.linear, aten.mm, aten.einsum, aten.convolution, aten.scaled_dot_product_attention} <= set(cost.FLOPS)
    with pytest.raises(AssertionError, match="one record per op"):
        rules.op(aten.einsum.default, flops=cost.mm_flops)
    counted = subprocess.run([sys.executable, "-c", "import torch; from autoshard import cost; "
                              "print(torch.ops.aten.einsum in cost.FLOPS)"], capture_output=True, text=True)
    assert counted.stdout.strip() == "True", counted.stderr
