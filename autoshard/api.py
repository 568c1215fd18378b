"""``parallelize``: from an unmodified model and a mesh to the program this rank runs.

Terms: the *global batch* is what ``step()`` receives, the same tensors on every rank; each
data-parallel rank takes its *local batch* (a slice along dim 0), which is cut into
``microbatches`` equal *microbatches*, each run forward and backward through the captured graph.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from autoshard.mesh import Mesh, MeshGroups

DEFAULT_TIMEOUT = datetime.timedelta(seconds=120)


def parallelize(
    model: nn.Module,
    mesh: Mesh | None = None,
    *,
    example_inputs: tuple,
    loss_fn: Callable | None = None,
    target: torch.Tensor | None = None,
    microbatches: int = 1,
    local_batch: bool = False,
    groups: MeshGroups | None = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    tp_indivisible: str = "error",
    schedule: str = "1f1b",
    chunks: int = 1,
    pipeline_starts: list[str] | None = None,
    cp_attention: str = "gather",
    cp_load_balance: bool = False,
):
    """Compile ``model`` for ``mesh`` and return the parallel model this rank runs.

    Args:
        model: the unmodified model (on CPU, GPU or the ``meta`` device).
        mesh: degrees of the parallel axes; ``None`` is one rank (the result equals eager execution).
        example_inputs: a global batch of the model's positional inputs (tuple), as ``step()`` will get.
        loss_fn: ``loss_fn(model(*inputs), target) -> scalar``; captured with the model in one graph.
        target: an example global-batch target; with it the training graph is captured now,
            otherwise at the first ``step()``.
        microbatches: how many microbatches each rank's local batch is cut into.
        local_batch: ``step()`` gets each rank's own slice of the batch (a data loader that shards by
            rank) instead of the global batch.
        groups: process groups already created by ``mesh.create_groups()``; created here when absent,
            initialising torch.distributed from torchrun's environment if nothing is initialised yet.
        timeout: how long any collective may wait before the step fails, naming the rank and step.
        tp_indivisible: what to do with a block whose heads or width the tp degree does not divide:
            ``"error"`` (the default: an error naming the layer and the degrees that work) or
            ``"replicate"`` (keep that block replicated, with a warning).
        schedule: the pipeline schedule, ``"gpipe"``, ``"1f1b"`` or ``"interleaved"`` (with ``chunks`` > 1).
        chunks: virtual stages per pipeline rank (interleaving); the model is cut into ``pp * chunks`` stages.
        pipeline_starts: instead of the balanced partition, the modules (by qualified name) at which each
            stage after the first begins.
        cp_attention: how attention sees the keys of a split sequence: ``"gather"`` (all-gather keys and
            values) or ``"ring"`` (pass key/value blocks around the cp ranks; no rank holds all of them).
        cp_load_balance: give cp rank r sequence chunks r and 2c-1-r of 2c, so causal attention work is even.
    """
    from autoshard.runtime.parallel_model import ParallelModel

    mesh = mesh if mesh is not None else Mesh()
    if not isinstance(example_inputs, tuple):
        raise TypeError(
            f"example_inputs must be a tuple of the model's positional inputs, got {type(example_inputs).__name__}; "
            "for one input write example_inputs=(tokens,)"
        )
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches={microbatches!r} is not valid: it must be an integer >= 1")
    _check_supported(mesh)
    if groups is None:
        groups = _groups_for(mesh, timeout)
    elif groups.mesh != mesh:
        raise ValueError(f"the process groups were created for {groups.mesh}, not for {mesh}: pass groups of this mesh")
    return ParallelModel(
        model,
        mesh,
        groups,
        example_inputs=example_inputs,
        loss_fn=loss_fn,
        target=target,
        microbatches=microbatches,
        local_batch=local_batch,
        tp_indivisible=tp_indivisible,
        schedule=schedule,
        chunks=chunks,
        pipeline_starts=pipeline_starts,
        cp_attention=cp_attention,
        cp_load_balance=cp_load_balance,
        timeout=timeout,
    )


def _groups_for(mesh: Mesh, timeout: datetime.timedelta) -> MeshGroups | None:
    """The process groups of ``mesh``: none for one rank outside torch.distributed, else created."""
    if not dist.is_initialized():
        if mesh.world_size == 1:
            return None
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise RuntimeError(
                f"{mesh} needs {mesh.world_size} processes, but torch.distributed is not initialised and this "
                f"process was not started by torchrun: launch with `torchrun --nproc-per-node {mesh.world_size} "
                "script.py`, or call torch.distributed.init_process_group first"
            )
        mesh.check_world_size(int(os.environ["WORLD_SIZE"]))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=timeout)
    return mesh.create_groups(timeout=timeout)


def _check_supported(mesh: Mesh) -> None:
    """Every combination of the four axes is supported; kept as the one place to refuse one."""
