"""The demo under torchrun itself: the way users launch autoshard."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(processes: int, *flags: str) -> str:
    """Run examples/train_gpt.py under torchrun as a user would; returns its output (it must exit 0)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    command = [str(torchrun), "--standalone", "--nproc-per-node", str(processes), "examples/train_gpt.py", *flags]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_demo_under_torchrun_matches_the_unsharded_model():
    # What `make demo` runs: a 2 x 2 x 2 mesh of 8 processes.
    out = _torchrun(8, "--dp", "2", "--tp", "2", "--pp", "2", "--steps", "3")
    assert len(re.findall(r"^step \d: loss", out, re.M)) == 3
    worst = float(re.search(r"unsharded model's loss over 3 steps: (\S+)", out).group(1))
    assert worst < 1e-5
    assert "dp x cp all-reduce (sum) of gradients over 2 ranks" in out
    assert "tp forward  all_reduce" in out and "pipeline: 2 stages on 2 ranks" in out


def test_the_example_with_fsdp_over_a_pipeline():
    out = _torchrun(4, "--dp", "2", "--pp", "2", "--data-parallel", "fsdp", "--steps", "2")
    worst = float(re.search(r"unsharded model's loss over 2 steps: (\S+)", out).group(1))
    assert worst < 1e-5
    assert "FSDP2 over dp x cp (2 ranks): parameters all-gathered once per step" in out, out
