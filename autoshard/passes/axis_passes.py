"""Every axis pass, in the order a rank's build runs them, listed here and nowhere else.

Each record is defined beside its pass (``passes.axis_pass.AxisPass``); this module imports them by name, so the
order never depends on which modules were imported first, and checks it against their ``after`` at import.
``codegen`` runs them in this order; ``job_plan`` writes, reads and prints the plans of those with a codec
(``PLANNED``), and ``compile.sharding_of`` gives each its rank's coordinate and group.
"""

from __future__ import annotations

from autoshard.passes.axis_pass import AxisPass, check_order
from autoshard.passes.batch_norm import BATCH_NORM
from autoshard.passes.batch_statistics import BATCH_STATISTICS
from autoshard.passes.context_parallel import CONTEXT_PARALLEL
from autoshard.passes.expert_parallel import EXPERT_PARALLEL
from autoshard.passes.sequence_parallel import SEQUENCE_PARALLEL, SP_REGIONS
from autoshard.passes.tensor_parallel import TENSOR_PARALLEL

AXIS_PASSES: tuple[AxisPass, ...] = (
    BATCH_STATISTICS, TENSOR_PARALLEL, SP_REGIONS, CONTEXT_PARALLEL, SEQUENCE_PARALLEL, BATCH_NORM, EXPERT_PARALLEL)
check_order(AXIS_PASSES)

# the axes whose plan the job plan holds, by name, in the order above (its JSON keys and str() lines follow it)
PLANNED: dict[str, AxisPass] = {p.name: p for p in AXIS_PASSES if p.codec is not None}
