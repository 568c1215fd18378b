"""A training run for elastic ``torchrun`` (``--nnodes 1:2``): its mesh follows the world size it is given.

    torchrun --nnodes 1:2 --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \
        tests/harness/elastic_worker.py RUN_DIR STEPS [PAUSE_STEP]

The zoo GPT at dp = world / 2 x tp = 2, each step's global batch drawn from the step number (the same whatever the
world), saving into RUN_DIR/ckpt every 2 steps. It resumes from the newest complete checkpoint whatever mesh saved
it. At PAUSE_STEP, under a world of 4, the ranks given it write RUN_DIR/paused-<agent's pid>-<pid> and wait
(PAUSE_STEP is given to that node alone): the test kills that agent and its ranks, and the first node's ranks,
failing in the step's collectives, are restarted by their agent in a world of 2. ``parallelize`` initialises the
process group, so a restarted attempt reads the store under its own prefix: torch reuses the agent's store across
restarts, and a group initialised from it without one can read the address a dead rank left there and wait on it.
Rank 0 writes every step's loss and each world size it ran under to RUN_DIR/losses.json at the end.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: ``harness`` imports from there

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import autoshard  # noqa: E402

from harness.models import build, token_data  # noqa: E402


def main() -> None:
    run, steps = Path(sys.argv[1]), int(sys.argv[2])
    pause = int(sys.argv[3]) if len(sys.argv) > 3 else None
    case = build("gpt")
    world = int(os.environ["WORLD_SIZE"])  # parallelize initialises the process group: its store is this attempt's
    pm = autoshard.parallelize(case.model, autoshard.Mesh(dp=world // 2, tp=2), example_inputs=case.inputs,
                               loss_fn=case.loss_fn, target=case.target)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    extra = pm.resume(str(run / "ckpt"), optimizer=opt) or {"step": 0, "losses": [], "worlds": []}
    losses, worlds = list(extra["losses"]), [*extra["worlds"], world]
    for step in range(extra["step"], steps):
        if step == pause and world == 4:  # given to the second node's ranks only
            (run / f"paused-{os.getppid()}-{os.getpid()}").touch()  # the test kills this node's agent and ranks
            time.sleep(600)
        ids, target = token_data(torch.Generator().manual_seed(100 + step))
        opt.zero_grad()
        losses.append(float(pm.step(ids, target=target)))
        opt.step()
        if (step + 1) % 2 == 0:
            pm.save_checkpoint(str(run / "ckpt"), optimizer=opt, keep=2,
                               extra={"step": step + 1, "losses": losses, "worlds": worlds})
    if dist.get_rank() == 0:
        (run / "losses.json").write_text(json.dumps({"losses": losses, "worlds": worlds}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
