"""Per-rank worker of ``bench/tp.py``: autoshard's tensor parallelism next to DTensor's, in the same processes.

    GLOO_SOCKET_IFNAME=lo torchrun --standalone --nproc-per-node 2 bench/tp_worker.py --models gpt,llama \\
        --out result.json

For each decoder of the test zoo (``tests/harness/models.py``, at the shape of ``bench/tp_dtensor.py``), built once from
one seed, four runners train the same batch:

- ``eager``: the unsharded model, on each rank (the reference for exactness and time);
- ``autoshard``: ``autoshard.parallelize(model, Mesh(tp=world size))``, trained with ``pm.step``;
- ``dtensor``: ``parallelize_module`` with the hand-written Megatron plans of ``bench/tp_dtensor.py``
  (vocab-parallel embedding and LM head, ``loss_parallel``);
- ``dtensor_shared``: the same plans plus ``PrepareModuleInput`` on each attention and MLP module, so that the
  input gradients of linears reading one input are summed before one all-reduce (as torchtitan's plans do).

Collectives of one training step (forward with loss, backward, optimizer step) are counted for all of them by
one ``TorchDispatchMode`` (``CollectiveCounter``) that sees both the c10d ops autoshard issues
(``dist.all_reduce``) and the functional collectives DTensor issues; a collective runs in the backward when the
autograd engine is executing a graph task. For DTensor the count is cross-checked against PyTorch's
``CommDebugMode``. autoshard's analytic count (``autoshard.explain.communication`` of its graph module) is
reported too. Rank 0 writes one JSON document.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from collections import defaultdict

import torch
import torch.distributed as dist
from common import summarize, wait_until_quiet
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug._comm_mode import NATIVE_TO_PY_MAPPING, c10d_collective_ops
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from tp_dtensor import (
    LR,
    MODEL_EDITS,
    PLANS,
    TPShape,
    build_case,
    check_exactness,
    count_collectives,
    forward_loss,
    loss_context,
    param_bytes,
    ring_bytes,
    time_steps,
)

import autoshard
from autoshard.explain import communication

from harness.models import token_loss

_COLLECTIVE_PACKETS = (set(NATIVE_TO_PY_MAPPING) | set(NATIVE_TO_PY_MAPPING.values()) | c10d_collective_ops
                       | {torch.ops._dtensor.shard_dim_alltoall})


def canonical(op_name: str) -> str:
    """One name per kind of collective, whichever API issued it (``allreduce_`` and ``all_reduce`` alike)."""
    name = op_name.replace("_", "")
    for kind in ("reducescatter", "allreduce", "allgather", "alltoall", "broadcast"):
        if kind in name:
            return {"reducescatter": "reduce_scatter", "allreduce": "all_reduce", "allgather": "all_gather",
                    "alltoall": "all_to_all", "broadcast": "broadcast"}[kind]
    return op_name.strip("_")


def _nbytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives that reach the dispatcher, by phase and kind, with the bytes of the whole tensor
    (the reduced tensor of an all-reduce, the gathered output of an all-gather, the input of a reduce-scatter)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[tuple[str, str], int] = defaultdict(int)
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.phase = "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor lower itself to plain collectives first
        out = func(*args, **(kwargs or {}))
        packet = getattr(func, "_overloadpacket", None)
        if packet in _COLLECTIVE_PACKETS:
            kind = canonical(packet.__name__)
            size = (max(_nbytes(args[0]), _nbytes(args[1])) if kind == "reduce_scatter"
                    else max(_nbytes(args[0]), _nbytes(out)))
            phase = "backward" if torch._C._current_graph_task_id() != -1 else self.phase
            self.counts[(phase, kind)] += 1
            self.bytes[(phase, kind)] += size
        return out

    def summary(self, n: int) -> dict:
        phases: dict[str, dict] = {}
        for (phase, kind), calls in sorted(self.counts.items()):
            entry = phases.setdefault(phase, {"counts": {}, "bytes": {}})
            entry["counts"][kind] = calls
            entry["bytes"][kind] = self.bytes[(phase, kind)]
        total_calls = sum(self.counts.values())
        total_bytes = sum(self.bytes.values())
        ring = sum(ring_bytes(kind, b, n) for (_, kind), b in self.bytes.items())
        return {"phases": phases, "total": total_calls, "total_bytes": total_bytes, "ring_bytes_sent_per_rank": ring}


def count_step(zero_grad, forward_backward, optimizer_step, n: int) -> dict:
    """Collectives of one step; the optimizer step is counted as its own phase."""
    counter = CollectiveCounter()
    zero_grad()
    with counter:
        forward_backward()
        counter.phase = "optimizer"
        optimizer_step()
    return counter.summary(n)


# --------------------------------------------------------------------------------------------------------------------
# Runners: (zero_grad, forward_backward, optimizer step) of one way of training the model
# --------------------------------------------------------------------------------------------------------------------


class Runner:
    """One way of training the model on (tokens, target): its parameters and the three parts of a step."""

    def __init__(self, module, params, forward_backward) -> None:
        self.module = module
        self.optimizer = torch.optim.AdamW(params, lr=LR)
        self.forward_backward = forward_backward

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def optimizer_step(self) -> None:
        self.optimizer.step()

    def step(self) -> None:
        self.zero_grad()
        self.forward_backward()
        self.optimizer_step()


def eager_runner(model, tokens, target) -> Runner:
    return Runner(model, model.parameters(), lambda: forward_loss(model, tokens, target).backward())


def autoshard_runner(model, tokens, target, tp: int) -> Runner:
    pm = autoshard.parallelize(model, autoshard.Mesh(tp=tp), example_inputs=(tokens,), loss_fn=token_loss,
                               target=target)
    return Runner(pm, pm.parameters(), lambda: pm.step(tokens, target=target))


def dtensor_runner(model_name: str, model, tokens, target, mesh, shared: bool) -> Runner:
    sharded = PLANS[model_name](model, mesh, vocab_parallel=True, shared_input_grad=shared)

    def forward_backward() -> None:
        with loss_context(True):
            forward_loss(sharded, tokens, target).backward()

    return Runner(sharded, sharded.parameters(), forward_backward)


def autoshard_exactness(eager, tokens, target, tp: int) -> dict:
    """Loss and every gradient of one autoshard step against the unsharded model (fresh copies of both)."""
    ref = copy.deepcopy(eager)
    loss_ref = forward_loss(ref, tokens, target)
    loss_ref.backward()
    pm = autoshard_runner(copy.deepcopy(eager), tokens, target, tp).module
    loss = pm.step(tokens, target=target)
    grads = pm.gradients()
    worst, worst_name = 0.0, ""
    for name, p in ref.named_parameters(remove_duplicate=False):
        diff = (grads[name] - p.grad).abs().max().item()
        if diff >= worst:
            worst, worst_name = diff, name
    return {"loss": loss_ref.item(), "loss_diff": abs(loss.item() - loss_ref.item()), "grad_max_diff": worst,
            "grad_worst_param": worst_name}


def analytic(pm) -> dict:
    """autoshard's own count of its collectives per step (``explain.communication`` of this rank's graph)."""
    gm = pm.builds[0].program.gm
    found = communication(gm)
    rows = [{"direction": d, "kind": k, "op": op, "calls": c, "bytes": b} for (d, k, op), (c, b) in found.items()]
    return {"rows": rows, "calls": sum(r["calls"] for r in rows), "bytes": sum(r["bytes"] for r in rows)}


# --------------------------------------------------------------------------------------------------------------------
# One model
# --------------------------------------------------------------------------------------------------------------------

TP_RUNNERS = ("autoshard", "dtensor", "dtensor_shared")


def build_runners(model_name: str, eager, tokens, target, mesh) -> dict[str, Runner]:
    tp = mesh.size()
    return {
        "eager": eager_runner(copy.deepcopy(eager), tokens, target),
        "autoshard": autoshard_runner(copy.deepcopy(eager), tokens, target, tp),
        "dtensor": dtensor_runner(model_name, copy.deepcopy(eager), tokens, target, mesh, shared=False),
        "dtensor_shared": dtensor_runner(model_name, copy.deepcopy(eager), tokens, target, mesh, shared=True),
    }


def per_rank(value) -> list:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def exactness(model_name: str, eager, tokens, target, mesh, shape: TPShape) -> dict:
    return {
        "autoshard": autoshard_exactness(eager, tokens, target, mesh.size()),
        "dtensor": check_exactness(model_name, mesh, shape, vocab_parallel=True, shared_input_grad=False),
        "dtensor_shared": check_exactness(model_name, mesh, shape, vocab_parallel=True, shared_input_grad=True),
    }


def run_model(model_name: str, mesh, shape: TPShape, warmup: int, steps: int) -> dict:
    """Everything for one decoder on this rank."""
    tp = mesh.size()
    eager, tokens, target = build_case(model_name, shape)
    exact = exactness(model_name, eager, tokens, target, mesh, shape)
    runners = build_runners(model_name, eager, tokens, target, mesh)
    counted = {name: count_step(r.zero_grad, r.forward_backward, r.optimizer_step, tp) for name, r in runners.items()
               if name in TP_RUNNERS}
    debug_mode = count_collectives(PLANS[model_name](copy.deepcopy(eager), mesh), tokens, target, True, tp)["step"]
    busy = wait_until_quiet()
    times = time_steps({name: r.step for name, r in runners.items()}, warmup, steps)
    return {
        "model": model_name,
        "tp": tp,
        "shape": {k: v for k, v in vars(shape).items()},
        "threads": torch.get_num_threads(),
        "exact": exact,
        "collectives": counted,
        "dtensor_comm_debug_mode": debug_mode,
        "autoshard_analytic": analytic(runners["autoshard"].module),
        "step_ms": {name: {k: v for k, v in summarize(t).items() if k != "times_ms"} for name, t in times.items()},
        "param_bytes_per_rank": {name: per_rank(param_bytes(r.module)) for name, r in runners.items()},
        "param_bytes_full": param_bytes(eager),
        "others_cpu_share_before_timing": busy,
        "model_edits": MODEL_EDITS[model_name],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt,llama")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
        results = [run_model(name, mesh, TPShape(), args.warmup, args.steps) for name in args.models.split(",")]
        if dist.get_rank() == 0:
            with open(args.out, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
