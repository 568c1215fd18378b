"""A mesh axis as the passes see it: what its rules may do, and how its collectives are written.

Every axis that splits values (tp, cp, sp; next ep) is an ``Axis``. Propagation and the rules read its
capabilities, never its name: whether a sum over a split dim may stay pending, whether a split may be blocked,
how attention over a split sequence runs, the sequence length a split must keep whole. Applying placements reads
its style: how a sharded value is gathered and a replicated one split, which replicated inputs of a sharded
computation need Megatron's f, and the axis's own localizers.

``Outputs`` says what the graph may return: values gathered whole, a pending sum (a loss summed over the axis
later), or its values as placed (a pipeline stage hands split activations on).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import fx

from autoshard.kinds import Attention
from autoshard.passes.collectives import GatherFromParallel, ScatterToParallel


class Outputs(enum.Enum):
    WHOLE = "whole"  # every output is gathered (replicated) before the graph returns it
    PARTIAL = "partial"  # an output may be a pending sum, reduced by whoever reads it (a loss summed over the axis)
    KEPT = "kept"  # a pipeline stage hands its activations on split where split plainly along a dim, else whole


@dataclass(frozen=True, eq=False)
class Axis:
    """One mesh axis of ``size`` ranks, as the rules read it (capabilities) and the rewrite writes it (style)."""

    name: str  # what refusals, warnings and explain call it: "tp", "cp", "sp"
    size: int
    # A sum over the split dim may stay pending (Partial), reduced where a consumer needs it whole by an all-reduce
    # whose backward is the identity: right where every rank back-propagates the same loss (tp, sp).
    pending_sums: bool = False
    # A split may be blocked (consecutive blocks split separately: a fused q, k, v): a head split may, a sequence
    # split in contiguous chunks (cp) may not.
    blocked_splits: bool = False
    # The split is of the batch's samples (dp's analyses): a call kept whole (a custom autograd Function) may run
    # on each rank's rows where proven per-sample (``autoshard.functions.per_sample``)
    samples: bool = False
    attention: Attention = Attention.GATHER  # how attention over a split sequence runs (cp's choice)
    sequence: int = 0  # the length of the sequence the axis splits, when it splits one (a split dim holds whole ones)
    # how the axis moves data
    gather: Callable[..., torch.nn.Module] = GatherFromParallel
    scatter: Callable[..., torch.nn.Module] = ScatterToParallel
    needs_copy: Callable[[fx.Node], bool] = lambda value: True
    # Megatron's f also where no gradient flows (a no_grad region, a detached value): sequence parallelism reads
    # the f's as the tp regions' entries, where it gathers the sequence
    copy_without_grad: bool = False
    check: Callable[[fx.Node, object], None] = lambda value, placement: None  # raises where the axis cannot move it
    localizers: Mapping[object, Callable] = field(default_factory=dict)  # op -> this axis's own localizer
    # the shape a rank holds of (global shape, placement) where ranks hold unequal parts (cp's uneven split)
    uneven_local: Callable[[tuple[int, ...], object], tuple[int, ...]] | None = None

    @property
    def keeps_keys_split(self) -> bool:
        """Attention over the split sequence reads the keys and values split (ring, all-to-all), not gathered."""
        return self.attention != Attention.GATHER
