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
from autoshard.peers import PeerFailed

# What gloo's and NCCL's RuntimeErrors say when a peer stalled or went away (they raise no type of their own).
_PEER_FAILURE = ("timed out", "timeout", "gloo", "nccl", "connection", "peer")


_CALLED = 0  # how deep this thread is in methods of the parallel model that exchange with every rank


class StepError(AutoshardError, RuntimeError):
    """A training step failed or stalled on one rank; the message names the rank, step and microbatch."""


def is_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective's own failure (a peer stalled or died), not a peer's announced error."""
    if isinstance(error, PeerFailed):
        return False
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


@contextlib.contextmanager
def collective_guard(mesh: Mesh, groups: MeshGroups | None, what: str):
    """``what`` (a method of the parallel model) exchanges with every rank: a peer failure while in it is most often
    a rank that never called it, as HuggingFace's ``if rank == 0: model.save_pretrained(...)`` idiom writes it."""
    global _CALLED
    _CALLED += 1  # the method the user called names the failure, not the ones it calls
    try:
        yield
    except RuntimeError as e:
        if not is_peer_failure(e) or isinstance(e, StepError) or _CALLED > 1:
            raise
        rank = groups.rank if groups is not None else 0
        raise StepError(
            f"rank {rank} waited in pm.{what}, which every rank must call (it exchanges with {peers(mesh, groups)}), "
            f"and its peers did not join: call it on every rank, not under `if rank == 0:` (what it writes, rank 0 "
            f"writes alone), or one of them stalled or died. {str(e).splitlines()[0]}") from e
    finally:
        _CALLED -= 1


def peers(mesh: Mesh, groups: MeshGroups | None) -> str:
    """The other ranks this rank exchanges with, by group (the candidates for a stalled peer)."""
    if groups is None:
        return "none"
    parts = [f"{a} {groups.ranks(a)}" for a in ("tp", "pp", "cp") if mesh.degree(a) > 1]
    if mesh.dp * mesh.cp > 1:
        parts.append(f"dp x cp {groups.ranks('data')}")
    return ", ".join(parts)
