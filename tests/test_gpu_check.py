"""The GPU check's dry run: the script ``make gpu-check`` runs on a GPU, run on the CPU at tiny sizes, so that it
still works the day a GPU is there to run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_check_runs_on_the_cpu(tmp_path):
    out = tmp_path / "results_gpu.md"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "bench/gpu_check.py", "--dry-run", "--no-compile", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.with_suffix(".json").read_text())
    assert all(r["ok"] for r in results["one_rank"].values()), results["one_rank"]
    cells = {k: v for k, v in results["two_ranks"].items() if k != "log"}
    assert len(cells) == 10 and all(r["ok"] for ranks in cells.values() for r in ranks.values()), cells
    assert results["throughput"]["autoshard"]["tokens_per_s"] > 0, results["throughput"]
    text = out.read_text()
    assert "| tp2 sp | yes, yes |" in text and "| autoshard |" in text
