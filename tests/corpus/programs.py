"""Every rank's program of one model at one mesh, reduced to a fingerprint (one process, nothing run).

Two versions of autoshard that give a model the same fingerprint at a mesh build the same programs for it: the same
graph code on every rank and stage (its nodes named by position), the same parameter and buffer shards, and the
same pipeline actions. A change meant to move no behaviour (a refactor) is checked on the whole corpus this way in
minutes, where running every cell takes hours; a cell whose fingerprint moves is the one to run again
(``bench/corpus.py --programs``, which fixes the hash seed: two runs compare only under the same one).
"""

from __future__ import annotations

import hashlib
import itertools
import re
import warnings

from autoshard import batching
from autoshard.compile import capture_for_training, compile_rank
from autoshard.job_plan import plan_job
from autoshard.mesh import Mesh
from autoshard.options import CompileOptions


def fingerprint(model, inputs: tuple, target, loss_fn, degrees: dict, options: dict) -> dict:
    """``{"ranks": {coords: sha}, "programs": n}`` for ``model`` at ``degrees``, or ``{"error": ...}`` where
    autoshard refuses the mesh; dp ranks build alike, so one dp coordinate stands for them all."""
    mesh = Mesh(**degrees)
    compile_options = CompileOptions(**options)
    values = (*inputs, target)
    if mesh.dp > 1:
        values = batching.split(values, mesh.dp)[0]
    values = batching.split(values, compile_options.microbatches)[0]
    ranks, programs = {}, 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            captured = capture_for_training(model, values[:-1], values[-1], loss_fn, training=model.training)
            plan = plan_job(captured, mesh, compile_options)
            for pp, tp, cp in itertools.product(range(mesh.pp), range(mesh.tp), range(mesh.cp)):
                build = compile_rank(captured, plan, {"pp": pp, "tp": tp, "cp": cp})
                digest = hashlib.sha256()
                for stage, program in sorted(build.programs.items()):
                    programs += 1
                    digest.update(f"stage {stage}\n{canonical_code(program.gm)}\n".encode())
                    for name, value in itertools.chain(program.gm.named_parameters(), program.gm.named_buffers()):
                        digest.update(f"{name} {tuple(value.shape)} {value.dtype}\n".encode())
                digest.update(repr(build.actions).encode())
                ranks[f"pp{pp} tp{tp} cp{cp}"] = digest.hexdigest()[:16]
    except Exception as e:  # noqa: BLE001 - a refusal is a fingerprint too: the same refusal, word for word
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
    return {"ranks": ranks, "programs": programs}


_NAME = re.compile(r"(?<![.\w])[A-Za-z_]\w*")


def canonical_code(gm) -> str:
    """``gm.code`` with every node named by its position: fx numbers a name (``arange_6``) from a counter that the
    models captured earlier in the same process move, so the same program could print differently in a full sweep
    than alone."""
    names = {node.name: f"v{i}" for i, node in enumerate(gm.graph.nodes)}
    return _NAME.sub(lambda m: names.get(m.group(0), m.group(0)), gm.code)
