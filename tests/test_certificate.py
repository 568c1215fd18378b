"""The communication certificate: each build lists what its rank sends in a step, and the first step is checked
against it (``autoshard.certificate``, ``autoshard.runtime.communication``).

Every golden on the worker pools checks its first step (``verify_communication="first"`` is the default), so a
certificate that missed a collective, or counted one wrong, fails those. Here: the certificate per axis with every
step checked, its JSON, what it says without processes, and a step that sends something else refused on every rank.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import warnings

import pytest

import autoshard
from autoshard import explain
from autoshard.certificate import Certificate, Collective, program_collectives
from autoshard.compile import capture_for_training, compile_rank
from autoshard.job_plan import plan_job
from autoshard.options import CompileOptions
from autoshard.passes.collectives import _ParallelOp

from harness import golden_certificate
from harness.models import ZOO_NAMES, build


def _communicating_classes() -> list[type]:
    import autoshard.passes as passes

    for info in pkgutil.iter_modules(passes.__path__):
        importlib.import_module(f"autoshard.passes.{info.name}")
    found = set()
    for name in list(importlib.sys.modules):
        if name.startswith("autoshard."):
            for _, cls in inspect.getmembers(importlib.sys.modules[name], inspect.isclass):
                if cls.__module__.startswith("autoshard.") and hasattr(cls, "comm_bytes") and not cls.__subclasses__():
                    found.add(cls)  # the modules the passes insert (not their bases)
    return sorted(found, key=lambda c: (c.__module__, c.__name__))


def test_every_module_that_communicates_says_what_it_sends():
    """A module that counts its bytes for ``explain()`` also lists its collectives for the certificate: one that
    did not would make every step that runs it fail its check."""
    classes = _communicating_classes()
    assert len(classes) >= 20, [c.__name__ for c in classes]
    silent = [c.__name__ for c in classes if getattr(c, "wires", _ParallelOp.wires) is _ParallelOp.wires]
    assert not silent, f"modules with comm_bytes but no wires(): {silent}"


def _program(name: str, mesh: dict, **options):
    case = build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture_for_training(case.model, case.inputs, case.target, case.loss_fn)
        mesh = autoshard.Mesh(**mesh)
        plan = plan_job(captured, mesh, CompileOptions(**options))
        return compile_rank(captured, plan, mesh.coords(0)), mesh


@pytest.mark.parametrize("mesh, options", [({"tp": 2}, {}), ({"tp": 2}, {"sequence_parallel": True}),
                                           ({"cp": 2}, {"cp_attention": "alltoall"})],
                         ids=["tp2", "tp2-sp", "cp2-alltoall"])
def test_a_programs_certificate_calls_what_explain_counts(mesh, options):
    """Without processes: the certificate of a rank's program makes the calls ``explain()`` counts, per pass and
    collective, forward and backward (two independent readings of the same modules)."""
    build_, mesh = _program("gpt", mesh, **options)
    gm = build_.program.gm
    sent, unknown = program_collectives(gm, mesh, 0, runs=1, training=True)
    assert not unknown
    certified: dict[tuple[str, str], int] = {}
    for c in sent:
        certified[(c.phase, c.kind)] = certified.get((c.phase, c.kind), 0) + c.count
    counted: dict[tuple[str, str], int] = {}
    for (_, direction, kind, _), (calls, _) in explain.collectives(gm).items():
        if kind not in ("split", "local", "identity"):
            counted[(direction, kind)] = counted.get((direction, kind), 0) + calls
    assert certified == counted


def test_a_certificate_reads_back_from_its_json_and_prints_per_phase():
    certificate = Certificate(1, [Collective("forward", "all_reduce", "tp 0,1", "float32", 1024, 2, "tp_reduce_1",
                                             "model.py:12"),
                                  Collective("gradient sync", "all_reduce", "data 1,3", "float32", 4096, None,
                                             "DDP's buckets")], ["nothing"])
    assert Certificate.from_json(certificate.to_json()) == certificate
    text = str(certificate)
    assert "forward (4.0 KiB)" in text and "gradient sync (16.0 KiB)" in text and "not certified: nothing" in text
    assert certificate.totals()[("gradient sync", "all_reduce", "1,3", "float32")] == (None, 4096, False)


def test_verify_communication_takes_first_every_or_never():
    with pytest.raises(ValueError, match="verify_communication='sometimes' is not an option: use 'first'"):
        CompileOptions(verify_communication="sometimes")


@pytest.mark.parametrize("name, mesh, options", [
    ("gpt", {"tp": 2}, {"sequence_parallel": True}),
    ("hf_llama", {"cp": 2}, {"cp_attention": "ring"}),
    ("gpt", {"pp": 2}, {"microbatches": 4, "schedule": "zbv"}),
    ("moe", {"dp": 2, "ep": 2}, {}),
    ("gpt", {"dp": 2}, {"data_parallel": "fsdp", "microbatches": 2}),
    ("gpt", {"dp": 2, "tp": 2, "pp": 2}, {"microbatches": 2}),
], ids=["tp2-sp", "cp2-ring", "pp2-zbv", "dp2xep2", "dp2-fsdp", "dp2xtp2xpp2"])
def test_every_step_sends_what_its_certificate_lists(pools, name, mesh, options):
    world = autoshard.Mesh(**mesh).world_size
    for result in pools.get(world).run(golden_certificate.certified, name, mesh, **options):
        assert result["differences"] == [] and result["round trip"], result
        assert {"forward", "pipeline", "gradient sync"} & set(result["phases"]), result["text"]
        assert not result["unchecked"], result["unchecked"]


ZOO_MESHES = {
    "tp2": ({"tp": 2}, {}), "tp2-sp": ({"tp": 2}, {"sequence_parallel": True}),
    "cp2-gather": ({"cp": 2}, {}), "cp2-ring": ({"cp": 2}, {"cp_attention": "ring"}),
    "cp2-alltoall": ({"cp": 2}, {"cp_attention": "alltoall"}),
    "pp2-1f1b": ({"pp": 2}, {"microbatches": 2}), "pp2-zbv": ({"pp": 2}, {"microbatches": 4, "schedule": "zbv"}),
    "dp2-ddp": ({"dp": 2}, {}), "dp2-fsdp": ({"dp": 2}, {"data_parallel": "fsdp"}),
    "dp2xep2": ({"dp": 2, "ep": 2}, {}), "dp2xtp2xpp2": ({"dp": 2, "tp": 2, "pp": 2}, {"microbatches": 2}),
}


@pytest.mark.parametrize("name, mesh", [  # the first cell in CI, the matrix in the full tier
    pytest.param(name, mesh, marks=() if (name, mesh) == ("gpt", "tp2") else pytest.mark.full, id=f"{name}-{mesh}")
    for name in ZOO_NAMES for mesh in ZOO_MESHES if "ep" not in ZOO_MESHES[mesh][0] or name == "moe"])
def test_every_zoo_model_at_every_mesh_sends_what_its_certificate_lists(pools, name, mesh):
    """The zoo at every axis (ep on its mixture of experts): three steps, each recorded and equal to its
    certificate on every rank. The plain MLP has no sequence for cp or sp to split and too few layers for four
    stages: those cells are refused, and must be refused for that reason, not another."""
    degrees, options = ZOO_MESHES[mesh]
    results = pools.get(autoshard.Mesh(**degrees).world_size).run(golden_certificate.certified_or_refused, name,
                                                                  degrees, **options)
    if "refused" in results[0]:
        assert name == "mlp", results[0]["refused"]
        pytest.skip(f"the MLP cannot run at {mesh}: {results[0]['refused']}")
    for result in results:
        assert result["differences"] == [] and result["round trip"] and not result["unchecked"], result


def test_a_collective_sent_in_another_dtype_is_refused_on_every_rank(pools):
    """Megatron's all-reduces sent in float64: the same sums at twice the bytes (an all-gather silently sent in
    bf16 where fp8 was planned is this bug)."""
    for message in pools.get(2).run(golden_certificate.tampered, "gpt", {"tp": 2}, "dtype"):
        assert "forward all_reduce on [0,1] in float64: certified 0 call(s)" in message, message
        assert "certified: forward: all_reduce on tp 0,1" in message and "tp_reducefromparallel" in message


def test_an_extra_all_reduce_is_refused_on_every_rank(pools):
    for message in pools.get(2).run(golden_certificate.tampered, "gpt", {"tp": 2}, "extra"):
        assert "forward all_reduce on [0,1] in float32: certified" in message, message
        assert "sent 2 x from" in message or "sent " in message


def test_a_pipeline_message_of_another_shape_is_refused_on_every_rank(pools):
    for message in pools.get(2).run(golden_certificate.tampered, "gpt", {"pp": 2}, "shape", microbatches=2):
        assert "pipeline send on [to " in message or "pipeline recv on [from " in message, message
        assert "activations of stage" in message or "gradients of stage" in message


def test_explain_prints_the_certificate_checked_and_each_axis_against_the_least_it_needs(pools):
    for text in pools.get(2).run(golden_certificate.explained, "hf_llama", {"cp": 2}, cp_attention="ring"):
        assert "communication certificate of rank" in text and "step 1 sent exactly this" in text, text
        assert "cp: 1.00x:" in text and "keys and values passed c-1 hops" in text, text
        assert "data: 1.00x:" in text and "one all-reduce of the gradients" in text, text
    for text in pools.get(2).run(golden_certificate.explained, "gpt", {"tp": 2}):
        line = next(line for line in text.splitlines() if line.startswith("  tp: "))
        ratio = float(line.split(":")[1].strip().rstrip("x"))
        assert 1.0 <= ratio < 1.5, line  # Megatron's four all-reduces per block, and the vocab-parallel embedding's
