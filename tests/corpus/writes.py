"""The writes sweep: does every rank's program keep every in-place write into the values it keeps?

For one model at one mesh, in one process and without running anything: the training capture at the mesh's
microbatch, every distinct rank's build (dp ranks build alike), and for each of its programs the writes of the
capture into values the program keeps that the program lost (``passes.writes.lost_writes``). A count of the
capture's writers says how much the sweep had to look at. A write after a stage's last read of a value (the stage
sends the value, the next one writes into what it receives) is the later stage's; every write into a kept value
must be run by some stage of each pipeline (``dropped_writes``).
"""

from __future__ import annotations

import itertools
import warnings

from autoshard import batching
from autoshard.compile import capture_for_training, compile_rank
from autoshard.job_plan import plan_job
from autoshard.mesh import Mesh
from autoshard.options import CompileOptions
from autoshard.passes.writes import dropped_writes, lost_writes, written_arguments


def sweep(model, inputs: tuple, target, loss_fn, degrees: dict, options: dict) -> dict:
    """``{"writers": n, "programs": k, "lost": [...]}`` for ``model`` at ``degrees``, or ``{"error": ...}`` where
    autoshard refuses the mesh (the corpus cell says the same)."""
    mesh = Mesh(**degrees)
    compile_options = CompileOptions(**options)
    values = (*inputs, target)
    if mesh.dp > 1:
        values = batching.split(values, mesh.dp)[0]
    values = batching.split(values, compile_options.microbatches)[0]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            captured = capture_for_training(model, values[:-1], values[-1], loss_fn, training=model.training)
            writers = sum(1 for node in captured.gm.graph.nodes if written_arguments(node))
            lost, programs = [], 0
            plan = plan_job(captured, mesh, compile_options)
            for tp, cp in itertools.product(range(mesh.tp), range(mesh.cp)):
                pipeline = []  # every stage of the pipeline of these tp and cp coordinates
                for pp in range(mesh.pp):
                    build = compile_rank(captured, plan, {"pp": pp, "tp": tp, "cp": cp})
                    for stage, program in build.programs.items():
                        programs += 1
                        pipeline.append(program.gm)
                        lost += [f"pp{pp} tp{tp} cp{cp} stage {stage}: {line}"
                                 for line in lost_writes(captured.gm, program.gm)]
                lost += [f"tp{tp} cp{cp}: {line}" for line in dropped_writes(captured.gm, pipeline)]
    except Exception as e:  # noqa: BLE001 - a refusal is the corpus cell's business; the sweep records it
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
    return {"writers": writers, "programs": programs, "lost": lost}
