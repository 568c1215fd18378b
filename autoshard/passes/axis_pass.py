"""An axis pass: one record per sharding axis, holding everything autoshard knows of how the axis is applied.

A rank's build rewrites its copy of the captured graph by the axis passes its ``Sharding`` asks for, in the order
of ``passes.axis_passes.AXIS_PASSES``. Each ``AxisPass`` says which passes must have run before it (``after``,
checked as data), whether a sharding asks for it, and the rewrite. An axis whose plan the job plan holds (tp, cp,
sp, ep) carries in the same record how that plan is written to JSON and read back (``PlanCodec``) and which mesh
axis's coordinate and group apply it; the dp analyses (batch statistics, batch norm) take theirs from the job
plan's flags instead.

``Sharding`` is what one rank applies: by axis pass name, the axis's plan with the rank's coordinate and process
group on it (``On``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import fx


@dataclass(frozen=True)
class On:
    """One axis of a rank's sharding: the axis's plan, this rank's coordinate on the axis and its process group."""

    plan: Any
    rank: int = 0
    group: object = None


@dataclass(frozen=True)
class BatchSync:
    """What a sum over the ``size`` dp ranks needs: a BatchNorm's statistics (``batch`` and ``sizes`` unused), or the
    loss's whole-batch statistics, with the local ``batch`` and the numbers that are sizes of the batch, by node."""

    size: int
    batch: int = 0
    sizes: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Sharding:
    """What one rank applies to a captured graph: each axis's plan, with this rank's coordinate and group on it
    (``axes``, by the name of the ``AxisPass`` that applies it), and how the graph is run."""

    axes: Mapping[str, On] = field(default_factory=dict)
    training: bool = True
    keep_outputs: bool = False  # a pipeline stage that hands its activations on
    stage: bool = False  # the graph is one pipeline stage

    def plan(self, axis: str):
        """The plan of ``axis``, or None where this sharding does not apply it."""
        on = self.axes.get(axis)
        return on.plan if on is not None else None

    def splits(self, axis: str) -> bool:
        """Whether ``axis`` splits over more than one rank."""
        plan = self.plan(axis)
        return plan is not None and plan.size > 1

    def with_plan(self, axis: str, plan) -> Sharding:
        """This sharding with ``axis``'s plan replaced (its coordinate and group kept)."""
        return dataclasses.replace(self, axes={**self.axes, axis: dataclasses.replace(self.axes[axis], plan=plan)})


@dataclass(frozen=True)
class PlanCodec:
    """How a job plan holds an axis's plan: its JSON form (under ``{name}_plan``) and its line in ``str(plan)``."""

    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]
    describe: Callable[[Any], str]


@dataclass(frozen=True)
class AxisPass:
    """One axis's rewrite of a rank's graph, and, where the job plan holds the axis's plan, how it holds it.

    ``after``: the passes that must have run first where both run (checked as data by ``check_order``, as torch.fx's
    PassManager checks its constraints). ``applies(sharding)``: whether this rank's sharding asks for the pass.
    ``apply(gm, sharding, found)``: the rewrite; ``found`` carries what a pass reads off the graph for a later one
    (sequence parallelism's region exits, read while the graph is tp's). ``codec``: how the job plan writes and
    reads the axis's plan (None: the job plan holds none under this name); ``mesh_axis``: with a codec, the mesh
    axis whose coordinate and group a rank applies the plan with (sp's is tp's)."""

    name: str
    after: tuple[str, ...]
    applies: Callable[[Sharding], bool]
    apply: Callable[[fx.GraphModule, Sharding, dict], None]
    codec: PlanCodec | None = None
    mesh_axis: str | None = None

    def __post_init__(self) -> None:
        if (self.codec is None) != (self.mesh_axis is None):
            raise ValueError(f"axis pass {self.name!r}: a plan the job plan holds (codec) is applied on a mesh axis "
                             "(mesh_axis); give both or neither")


def present(name: str) -> Callable[[Sharding], bool]:
    """``applies`` for a pass that runs wherever the sharding holds a plan under ``name``."""
    return lambda sharding: name in sharding.axes


def splitting(name: str) -> Callable[[Sharding], bool]:
    """``applies`` for a pass that runs where ``name``'s plan splits over more than one rank."""
    return lambda sharding: sharding.splits(name)


def check_order(passes: tuple[AxisPass, ...]) -> None:
    """Every pass comes after the passes it names in ``after`` (and those exist), and no name is given twice."""
    seen: set[str] = set()
    names = [p.name for p in passes]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise AssertionError(f"axis passes named twice: {twice}")
    for axis_pass in passes:
        unknown = set(axis_pass.after) - set(names)
        early = set(axis_pass.after) - seen
        if unknown or early:
            raise AssertionError(f"axis pass {axis_pass.name!r} must come after {sorted(early)}"
                                 + (f" (no such passes: {sorted(unknown)})" if unknown else ""))
        seen.add(axis_pass.name)
