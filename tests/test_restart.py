"""``torchrun --max-restarts``: a run whose rank is killed (SIGKILL) mid-step restarts and resumes by itself.

``harness/restart_worker.py`` is a user's loop: ``pm.resume(root)`` before it, ``save_checkpoint(root, keep=2)`` every 2
steps. Killed at random steps (a rank dies before the step while its peer waits on it inside the step), twice (a
restarted run killed again) or 5 times (both in the full tier), it finishes with the loss curve of the run that was
never killed, bit for bit.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "harness" / "restart_worker.py"
STEPS = 10


def _torchrun(run: Path, *kills: int, restarts: int = 0) -> list[float]:
    run.mkdir()
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    command = [str(torchrun), "--standalone", "--max-restarts", str(restarts), "--nproc-per-node", "2", str(WORKER),
               str(run), str(STEPS), *map(str, kills)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads((run / "losses.json").read_text())


@pytest.mark.parametrize("times", [2, 5])
def test_a_run_killed_again_and_again_resumes_by_itself_with_the_same_losses(tmp_path, times):
    kills = sorted(random.Random(len(str(tmp_path))).sample(range(1, STEPS), times))
    straight = _torchrun(tmp_path / "straight")
    killed = _torchrun(tmp_path / "killed", *kills, restarts=times)
    assert all((tmp_path / "killed" / f"killed-{step}").exists() for step in kills), "a kill did not happen"
    assert killed == straight, f"killed at steps {kills}: the loss curve differs"
    assert sorted(os.listdir(tmp_path / "killed" / "ckpt")) == [f"step-{STEPS - 2:08d}", f"step-{STEPS:08d}"]
