"""The planner: choose dp, tp, pp and cp for a transformer on a cluster, and explain the choice.

    from autoshard.planner import Cluster, TransformerConfig, plan, best_mesh, lint
    config = TransformerConfig(layers=32, hidden=4096, heads=32, vocab=32000, seq=4096, global_batch=512)
    result = plan(config, Cluster(gpus=8, gpus_per_node=8, gpu_memory="80GB"))
    print(result.best.split.short(), result.best.step_time)
    mesh = best_mesh(config, world_size=8)             # what parallelize(mesh="auto") asks for
    findings = lint(mesh, config, microbatches=64)     # the seeds' rules, as checks

Modules, in the order data flows: ``units`` (quantities such as "80GB"), ``config`` (the model, the cluster,
a split), ``model`` (the cost model as sympy formulas), ``search`` (every split, ranked), ``lint`` (the
seeds' rules), ``report`` (text and JSON), ``command`` (``autoshard plan``).
"""

from autoshard.planner.config import PRESETS, Cluster, PlanError, Split, TransformerConfig
from autoshard.planner.lint import Finding, lint
from autoshard.planner.model import FORMULAS, Estimate, evaluate, min_microbatches, solve_for
from autoshard.planner.search import PlanResult, best_mesh, plan, rule_of_thumb
from autoshard.planner.units import UnitError
from autoshard.planner.units import parse as parse_quantity

__all__ = [
    "FORMULAS", "PRESETS", "Cluster", "Estimate", "Finding", "PlanError", "PlanResult", "Split", "TransformerConfig",
    "UnitError", "best_mesh", "evaluate", "lint", "min_microbatches", "parse_quantity", "plan", "rule_of_thumb",
    "solve_for",
]
