"""How one rank holds a parameter: one record per parameter of a build, which every consumer reads.

A parameter is split, in this order: a stack of experts over the ep ranks (each holds its experts, rows of dim 0;
an expert held as a module of a list is held whole by one ep rank, ``holder``, and by no other),
its tp part (a ``Shard`` placement: a dim, and the blocks it cuts alike where a fused projection is split block by
block; a dim the degree does not divide is padded up), and, where the weight is spread over the pipeline's ranks,
this pp rank's rows of that; FSDP2 then shards what is left over dp x cp at run time (a DTensor). The build makes
each record once (``RankBuild.layout``); the stored shape, the gathers, the state dict, checkpoints, the optimizer's
state, ``save_pretrained``, the gradient norm and the gradient sync read it (a rank's part of a whole tensor is
``part``) instead of asking the tp plan, the ep plan and the spread each for their part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autoshard.mesh import Mesh
from autoshard.passes.collectives import local_part
from autoshard.passes.expert_parallel import expert_part
from autoshard.passes.placements import Shard, local_shape


@dataclass(frozen=True)
class ParamLayout:
    """The splits of parameter ``name`` (its name in the captured graphs), of global ``shape``."""

    name: str
    shape: tuple[int, ...]
    tp: Shard | None  # None: every tp rank holds it whole
    tp_size: int
    experts: int  # the stack's experts where they are split over ep, else 0
    ep_size: int
    spread: bool  # stored in rows over the pp ranks, gathered for each step
    pp_size: int
    holder: int | None = None  # an expert held as a module of a list: the one ep rank that holds it (others: nothing)

    @classmethod
    def of(cls, name: str, shape: tuple[int, ...], mesh: Mesh, placement, experts: int, spread: bool,
           holder: int | None = None) -> ParamLayout:
        tp = placement if isinstance(placement, Shard) and mesh.tp > 1 else None
        return cls(name, tuple(shape), tp, mesh.tp, experts, mesh.ep, spread, mesh.pp, holder)

    @property
    def split_over_ep(self) -> bool:
        """Whether ep ranks hold different parts of it (a stack's experts, or an expert one ep rank holds alone):
        its gradient is summed over the ranks holding the same part, not over dp x cp, and FSDP2 leaves it whole."""
        return bool(self.experts) or self.holder is not None

    @property
    def padded(self) -> bool:
        """Whether the tp shards are padded: the degree does not divide the split dim (a vocabulary of 50,257)."""
        return self.tp is not None and self.tp.blocks is None and self.shape[self.tp.dim] % self.tp_size != 0

    def tp_shape(self) -> tuple[int, ...]:
        """The shape of one tp part (padded up where the degree does not divide)."""
        return local_shape(self.shape, self.tp, self.tp_size) if self.tp is not None else self.shape

    def local_shape(self) -> tuple[int, ...]:
        """The shape this rank stores between steps: its tp part, of that its ep rank's experts or its pp rank's
        rows (before FSDP2's shard)."""
        shape = self.tp_shape()
        if self.spread:
            return (shape[0] // self.pp_size, *shape[1:])
        if self.experts:
            return (shape[0] // self.ep_size, *shape[1:])
        return shape

    def part(self, full: torch.Tensor, tp_rank: int, ep_rank: int) -> torch.Tensor:
        """The part of ``full`` (the whole parameter, or a tensor laid out as it: its optimizer state) that tp rank
        ``tp_rank`` and ep rank ``ep_rank`` hold: the tp part (padded up), then of that the ep rank's experts
        (before a pp rank's rows and FSDP2's shard, which the store makes)."""
        local = local_part(full, self.tp, tp_rank, self.tp_size) if self.tp is not None else full
        return expert_part(local, ep_rank, self.ep_size) if self.experts else local

    @property
    def tp_direct(self) -> bool:
        """Whether each tp rank's part is one plain slice of the whole (or the whole): not cut in blocks, not
        padded; FSDP2's shards of such a part are written and read as they are."""
        return self.tp is None or (self.tp.blocks is None and not self.padded)

    def check_whole_save(self) -> None:
        """Refuse what no one rank can assemble whole from its parts for HuggingFace's format yet."""
        if self.padded and self.experts and self.ep_size > 1:
            raise NotImplementedError(f"save_pretrained: {self.name}'s tp shards are padded and its experts split "
                                      "over ep: save with pm.save_checkpoint, or at a tp degree that divides it")
