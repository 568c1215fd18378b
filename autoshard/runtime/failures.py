"""A training step that fails or stalls on one rank says which rank, step, phase and peers.

gloo and NCCL report a peer that stalled or died as a ``RuntimeError`` (``torch.distributed.DistError`` where
torch knows it is one); ``stall_guard`` turns such an error, raised while a step waits on its peers, into a
``StepError`` that names the rank, its coordinates, the step, the microbatch and the groups it waits on.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

from autoshard.errors import AutoshardError
from autoshard.mesh import Mesh, MeshGroups

# What gloo's and NCCL's RuntimeErrors say when a peer stalled or went away (they raise no type of their own).
_PEER_FAILURE = ("timed out", "timeout", "gloo", "nccl", "connection", "peer")


class StepError(AutoshardError, RuntimeError):
    """A training step failed or stalled on one rank; the message names the rank, step and microbatch."""


def is_peer_failure(error: BaseException) -> bool:
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and any(word in str(error).lower() for word in _PEER_FAILURE)


@contextlib.contextmanager
def stall_guard(mesh: Mesh, groups: MeshGroups | None, step: int, phase: str, microbatch: int | None = None):
    try:
        yield
    except RuntimeError as e:
        if not is_peer_failure(e):
            raise
        where = f"microbatch {microbatch} " if microbatch is not None else ""
        rank, coords = (groups.rank, dict(groups.coords)) if groups is not None else (0, {})
        raise StepError(
            f"rank {rank} ({coords}) failed in step {step}, {where}{phase}, waiting on its peers "
            f"({peers(mesh, groups)}): one of them stalled or died. {str(e).splitlines()[0]}"
        ) from e


def peers(mesh: Mesh, groups: MeshGroups | None) -> str:
    """The other ranks this rank exchanges with, by group (the candidates for a stalled peer)."""
    if groups is None:
        return "none"
    parts = [f"{a} {groups.ranks(a)}" for a in ("tp", "pp", "cp") if mesh.degree(a) > 1]
    if mesh.dp * mesh.cp > 1:
        parts.append(f"dp x cp {groups.ranks('data')}")
    return ", ".join(parts)
