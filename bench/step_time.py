"""Per-rank worker: time training steps of the benchmark GPT with several runners side by side.

    python bench/step_time.py --runners eager,autoshard --out result.json
    torchrun --standalone --nproc-per-node 2 bench/step_time.py --runners autoshard,ddp --microbatches 2 \\
        --out result.json

A *runner* is one way of training the same model on the same global batch:

- ``eager``: the unsharded model in this one process (``loss.backward()`` on the whole batch).
- ``autoshard``: ``autoshard.parallelize`` over ``Mesh(dp=world size)``, trained with ``pm.step``.
- ``ddp``: the hand-written way, PyTorch's DistributedDataParallel wrapped directly around the eager
  model; each rank takes its slice of the global batch and cuts it into the same microbatches, with
  gradient synchronisation skipped (``no_sync``) on all but the last microbatch.

Each runner owns its own copy of the model (same seed) and an AdamW optimizer; a step is
``zero_grad`` + forward/backward + ``optimizer.step()``. The runners take turns step by step (their
order rotates), so slow drifts of the machine affect them alike. With more than one process every
step is timed between two barriers, and rank 0 writes the medians to ``--out`` as JSON. ``--pin``
binds each rank to one core (rank mod cores).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from common import GPT_SHAPE, build_gpt_case, summarize

Step = Callable[[], None]


def eager_runner(microbatches: int) -> Step:
    """The unsharded model trained on the whole global batch in this process."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError("the eager runner is the one-process baseline: run it without torchrun")
    model, tokens, target, loss_fn = build_gpt_case()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad()
        for x, y in zip(tokens.chunk(microbatches), target.chunk(microbatches), strict=True):
            (loss_fn(model(x), y) / microbatches).backward()
        optimizer.step()

    return step


def autoshard_runner(microbatches: int) -> Step:
    """``autoshard.parallelize`` over ``Mesh(dp=world size)``; ``pm.step`` takes the global batch."""
    import autoshard

    world = dist.get_world_size() if dist.is_initialized() else 1
    model, tokens, target, loss_fn = build_gpt_case()
    mesh = autoshard.Mesh(dp=world) if world > 1 else autoshard.Mesh()
    pm = autoshard.parallelize(model, mesh, example_inputs=(tokens,), loss_fn=loss_fn, target=target,
                               microbatches=microbatches)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad()
        pm.step(tokens, target=target)
        optimizer.step()

    return step


def ddp_runner(microbatches: int) -> Step:
    """DistributedDataParallel around the eager model, on this rank's slice of the global batch."""
    from torch.nn.parallel import DistributedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    model, tokens, target, loss_fn = build_gpt_case()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    x_local, y_local = tokens.chunk(world)[rank], target.chunk(world)[rank]
    pieces = list(zip(x_local.chunk(microbatches), y_local.chunk(microbatches), strict=True))

    def step() -> None:
        optimizer.zero_grad()
        for index, (x, y) in enumerate(pieces):
            last = index == len(pieces) - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                (loss_fn(ddp(x), y) / microbatches).backward()
        optimizer.step()

    return step


RUNNERS = {"eager": eager_runner, "autoshard": autoshard_runner, "ddp": ddp_runner}


def pin_to_core(local_rank: int) -> None:
    """Bind this process to one core. Without it the scheduler of some virtual machines leaves the ranks of
    a torchrun job sharing one core while the other idles, which times the scheduler rather than the step."""
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[local_rank % len(cores)]})


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def time_runners(steps: dict[str, Step], warmup: int, repeats: int) -> dict[str, list[float]]:
    """Run every runner ``warmup + repeats`` times in rotating order; the last ``repeats`` are timed (ms)."""
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for index in range(warmup + repeats):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            _barrier()
            start = time.perf_counter()
            steps[name]()
            _barrier()
            if index >= warmup:
                times[name].append((time.perf_counter() - start) * 1000)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runners", default="eager,autoshard", help="comma-separated: " + ", ".join(RUNNERS))
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in each process")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per runner")
    parser.add_argument("--pin", action="store_true", help="pin this process to core LOCAL_RANK mod cores")
    parser.add_argument("--out", required=True, help="JSON file rank 0 writes")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.pin:
        pin_to_core(int(os.environ.get("LOCAL_RANK", "0")))
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        dist.init_process_group("gloo")
    world = dist.get_world_size() if dist.is_initialized() else 1

    names = [name.strip() for name in args.runners.split(",") if name.strip()]
    setup_s, steps = {}, {}
    for name in names:
        start = time.perf_counter()
        steps[name] = RUNNERS[name](args.microbatches)
        setup_s[name] = time.perf_counter() - start
    times = time_runners(steps, args.warmup, args.steps)

    if not dist.is_initialized() or dist.get_rank() == 0:
        result = {
            "world": world,
            "microbatches": args.microbatches,
            "threads": torch.get_num_threads(),
            "global_batch": GPT_SHAPE.batch,
            "runners": {name: {**summarize(times[name]), "setup_s": setup_s[name]} for name in names},
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
