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
    "compile": ("capture", "codegen", "job_plan", "compile", "explain", "dot", "layout"),
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
    """Each axis pass names the passes that must run before it; the order is checked as data, and a failure inside
    a pass says which pass it was and which ran before it."""
    import pytest
    import torch
    from torch import fx

    from autoshard import codegen

    codegen.check_order(codegen.AXIS_PASSES)
    swapped = (codegen.AXIS_PASSES[1], codegen.AXIS_PASSES[0], *codegen.AXIS_PASSES[2:])
    with pytest.raises(AssertionError, match=r"'tp' must come after \['batch statistics'\]"):
        codegen.check_order(swapped)

    def fails(gm, sharding, found):
        raise RuntimeError("a rewrite failed")

    passes = (codegen.AxisPass("first", (), lambda s: True, lambda gm, s, found: None),
              codegen.AxisPass("second", ("first",), lambda s: True, fails))
    gm = fx.symbolic_trace(torch.nn.Linear(2, 2))
    monkeypatch.setattr(codegen, "AXIS_PASSES", passes)
    with pytest.raises(RuntimeError, match="a rewrite failed") as raised:
        codegen._shard(gm, codegen.Sharding(), None)
    assert "in the second pass, after first" in "\n".join(getattr(raised.value, "__notes__", [])), raised.value


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
