"""A training run as a user writes it for ``torchrun --max-restarts``: resume, train, save every 2 steps.

    torchrun --max-restarts 5 --nproc-per-node 2 tests/harness/restart_worker.py RUN_DIR STEPS [KILL_STEP ...]

Trains the zoo GPT at tp=2 for STEPS steps (each step's batch drawn from the step number), saving into
RUN_DIR/ckpt every 2 steps (the newest 2 kept). At each KILL_STEP, rank 1 kills itself with SIGKILL before the
step (once: a marker file says it did), mid-way for rank 0, which waits on it in the step's collectives; torchrun
then restarts both, and the run resumes from the newest complete checkpoint. Rank 0 writes every step's loss to
RUN_DIR/losses.json at the end.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: ``harness`` imports from there

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import autoshard  # noqa: E402

from harness.models import build, token_data  # noqa: E402


def main() -> None:
    run, steps, kills = Path(sys.argv[1]), int(sys.argv[2]), [int(k) for k in sys.argv[3:]]
    case = build("gpt")  # parallelize starts the processes' groups, as torchrun set them up
    pm = autoshard.parallelize(case.model, autoshard.Mesh(tp=2), example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    extra = pm.resume(str(run / "ckpt"), optimizer=opt) or {"step": 0, "losses": []}
    losses = list(extra["losses"])
    for step in range(extra["step"], steps):
        if step in kills and dist.get_rank() == 1 and not (run / f"killed-{step}").exists():
            (run / f"killed-{step}").touch()
            os.kill(os.getpid(), signal.SIGKILL)
        ids, target = token_data(torch.Generator().manual_seed(100 + step))
        opt.zero_grad()
        losses.append(float(pm.step(ids, target=target)))
        opt.step()
        if (step + 1) % 2 == 0:
            pm.save_checkpoint(str(run / "ckpt"), optimizer=opt, keep=2, extra={"step": step + 1, "losses": losses})
    if dist.get_rank() == 0:
        (run / "losses.json").write_text(json.dumps(losses))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
