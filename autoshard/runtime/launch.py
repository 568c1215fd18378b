"""How this process joins the job: torch.distributed initialised from torchrun's environment (a restarted
attempt through a store prefix of its own), the mesh's process groups, and the check that each process holds its
model on its own GPU."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torch import nn

from autoshard.mesh import Mesh, MeshGroups


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def device_of(model: nn.Module) -> str:
    """Where the model's parameters live (``meta`` counts as where CUDA would be used if present)."""
    types = {p.device.type for p in model.parameters()} - {"meta"}
    if types:
        return types.pop()
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_gpu(model: nn.Module) -> None:
    """Under NCCL every process must hold its model on its own GPU, or the collectives see one GPU twice."""
    if not dist.is_initialized() or "nccl" not in str(dist.get_backend()):
        return
    mine = torch.cuda.current_device()
    elsewhere = sorted({str(p.device) for p in model.parameters()
                        if p.device.type == "cuda" and p.device.index != mine})
    if elsewhere:
        raise ValueError(
            f"rank {dist.get_rank()}: the model's parameters are on {', '.join(elsewhere)}, but this process's GPU is "
            f"cuda:{mine}: call torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before building the model "
            "(or build it on meta and call pm.materialize())"
        )


def groups_for(mesh: Mesh, timeout: datetime.timedelta, device: str = "cpu") -> MeshGroups | None:
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
        # NCCL for a model on GPUs (each process on the GPU of its LOCAL_RANK, as torchrun numbers them), gloo else
        backend = "nccl" if device == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timeout, **restarted_store(timeout))
    return mesh.create_groups(timeout=timeout)


def restarted_store(timeout) -> dict:
    """Under ``torchrun --max-restarts``, after a restart: the rendezvous store seen through a prefix of its own, so
    that the groups this attempt makes do not read the addresses the dead attempt's processes left under the same
    keys (the store outlives the workers). Nothing on the first attempt."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if not attempt:
        return {}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)  # the agent hosts it; else rank 0 does
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent and rank == 0, timeout=timeout, multi_tenant=not agent)
    return {"store": dist.PrefixStore(f"autoshard/attempt-{attempt}", store), "rank": rank, "world_size": world}
