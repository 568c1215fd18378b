"""Per-rank worker of ``bench/mesh3d.py``: autoshard's dp x tp x pp mesh next to PyTorch's tools by hand.

    GLOO_SOCKET_IFNAME=lo torchrun --standalone --nproc-per-node 8 bench/mesh3d_worker.py --out result.json
    .venv/bin/python bench/mesh3d_worker.py --eager --out result.json       # the unsharded model, one process

Under torchrun (8 processes) the 8-layer zoo GPT (``tests/harness/models.py``: hidden 128, 4 heads, vocab 256, sequence
64) trains on one global batch of 16 in two ways, taking turns step by step:

- ``autoshard``: ``parallelize(model, Mesh(dp=2, tp=2, pp=2), microbatches=4, schedule="1f1b")``, the model
  unmodified;
- ``autoshard_fsdp``: the same with ``data_parallel="fsdp"`` (FSDP2 over dp inside every stage);
- ``torch``: ``TorchMesh3D`` of ``bench/mesh3d_torch.py``: DTensor TP (``bench/tp_dtensor.py``'s plan) inside
  ``torch.distributed.pipelining`` stages with ``Schedule1F1B``, data parallelism by hand.

Reported from rank 0: the loss of the first two steps of each against the unsharded model (rank 0 trains a
copy of it beside them, under each runner's loss normalisation); the median step time (``zero_grad``,
forward/backward, AdamW; between barriers); and on every rank the bytes of its parameters, gradients and
AdamW state (local shards). With ``--eager`` (no torchrun) the unsharded model's step is timed instead, on
one thread and on all the machine's cores, taking turns.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time

import torch
import torch.distributed as dist
from common import summarize
from mesh3d_torch import TorchMesh3D, local, reference_loss
from pp_worker import Runner, build_case, gather, time_runners
from step_time import pin_to_core
from torch.distributed.device_mesh import init_device_mesh

import autoshard

from harness.models import token_loss

LAYERS, BATCH, VOCAB, MICROBATCHES = 8, 16, 256, 4
MESH = {"dp": 2, "tp": 2, "pp": 2}


def autoshard_runner(model, tokens, target, data_parallel: str = "ddp") -> Runner:
    pm = autoshard.parallelize(model, autoshard.Mesh(**MESH), example_inputs=(tokens,), loss_fn=token_loss,
                               target=target, microbatches=MICROBATCHES, schedule="1f1b", data_parallel=data_parallel)
    losses: list[float] = []

    def forward_backward() -> None:
        losses.append(pm.step(tokens, target=target).item())

    return Runner(list(pm.parameters()), forward_backward, pm=pm, losses=losses)


def torch_runner(model, tokens, target) -> Runner:
    mesh = init_device_mesh("cpu", (MESH["pp"], MESH["dp"], MESH["tp"]), mesh_dim_names=("pp", "dp", "tp"))
    job = TorchMesh3D(model, mesh, MICROBATCHES)
    losses: list[float | None] = []

    def forward_backward() -> None:
        job.step(tokens, target)
        losses.append(job.mean_loss())

    return Runner(job.parameters(), forward_backward, job=job, losses=losses)


def _bytes(tensors) -> int:
    return sum(local(t).numel() * local(t).element_size() for t in tensors if t is not None)


def state_bytes(runner: Runner) -> dict:
    """This rank's bytes of parameters, gradients and AdamW state (moments apart from the step counters)."""
    states = list(runner.optimizer.state.values())
    moments = [s[k] for s in states for k in ("exp_avg", "exp_avg_sq") if k in s]
    steps = [s["step"] for s in states if torch.is_tensor(s.get("step"))]
    return {"params": _bytes(runner.params), "grads": _bytes(p.grad for p in runner.params),
            "moments": _bytes(moments), "step_counters": _bytes(steps)}


def _step_losses(runner: Runner, name: str) -> float:
    """The loss of the step just taken, the same on every rank (the hand-written job: mean over its dp ranks)."""
    mine = runner.info["losses"][-1]
    if name.startswith("autoshard"):
        return mine
    values = [v for v in gather(mine) if v is not None]
    return sum(values) / len(values)


def check_losses(runners: dict[str, Runner], model, tokens, target) -> dict:
    """Two steps of each runner (its first two warm-up steps) against the unsharded model on rank 0."""
    pieces = MESH["dp"] * MICROBATCHES
    normalised = {"autoshard": lambda m: token_loss(m(tokens), target),
                  "autoshard_fsdp": lambda m: token_loss(m(tokens), target),
                  "torch": lambda m: reference_loss(m, tokens, target, pieces)}
    result = {}
    for name, runner in runners.items():
        ref = copy.deepcopy(model) if dist.get_rank() == 0 else None
        optimizer = torch.optim.AdamW(ref.parameters(), lr=runner.optimizer.defaults["lr"]) if ref else None
        pairs = []
        for _ in range(2):
            runner.step()
            loss = _step_losses(runner, name)
            if ref is not None:
                optimizer.zero_grad()
                expected = normalised[name](ref)
                expected.backward()
                optimizer.step()
                pairs.append((loss, expected.item()))
        result[name] = pairs
    return result


def run_mesh(args: argparse.Namespace) -> dict:
    dist.init_process_group("gloo")
    model, tokens, target = build_case(LAYERS, BATCH, VOCAB)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    runners = {"autoshard": autoshard_runner(copy.deepcopy(model), tokens, target),
               "autoshard_fsdp": autoshard_runner(copy.deepcopy(model), tokens, target, data_parallel="fsdp"),
               "torch": torch_runner(copy.deepcopy(model), tokens, target)}
    losses = check_losses(runners, model, tokens, target)
    times, _ = time_runners(runners, args.warmup, args.steps)
    per_rank = {name: gather(state_bytes(runner)) for name, runner in runners.items()}
    coords = gather(autoshard.Mesh(**MESH).coords(dist.get_rank()))
    pm = runners["autoshard"].info["pm"]
    return {"mesh": MESH, "microbatches": MICROBATCHES, "world": dist.get_world_size(), "full_param_bytes": full,
            "losses": losses, "step_ms": {k: summarize(v) for k, v in times.items()}, "bytes": per_rank,
            "coords": coords, "explain": pm.explain()}


def run_eager(args: argparse.Namespace) -> dict:
    model, tokens, target = build_case(LAYERS, BATCH, VOCAB)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad()
        token_loss(model(tokens), target).backward()
        optimizer.step()

    cores = os.cpu_count() or 1
    threads = {"eager, 1 thread": 1, f"eager, {cores} threads": cores}
    times: dict[str, list[float]] = {name: [] for name in threads}
    for index in range(args.warmup + args.steps):
        order = list(threads.items())
        for name, n in order[index % 2:] + order[:index % 2]:
            torch.set_num_threads(n)
            start = time.perf_counter()
            step()
            if index >= args.warmup:
                times[name].append((time.perf_counter() - start) * 1000)
    return {"step_ms": {k: summarize(v) for k, v in times.items()}, "threads": threads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eager", action="store_true", help="time the unsharded model in this one process")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps after the two that check the loss")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--pin", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.pin:
        pin_to_core(int(os.environ.get("LOCAL_RANK", "0")))
    result = run_eager(args) if args.eager else run_mesh(args)
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
