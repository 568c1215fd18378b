"""Ranks started as interpreters of their own, as torchrun starts them, hash strings under different seeds, and
transformers builds some graphs by iterating a set of strings (Gemma 4's rotary embedding per layer type): each
rank captures the same model with its nodes in another order. Every rank's program must still agree with the others'
on what crosses between them. The worker pools fork every rank from one server, under one seed, and cannot show it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from harness.launcher import free_port

WORKER = Path(__file__).resolve().parent / "harness" / "hash_seed_worker.py"
NAME = "gemma4_text"


def _run(args: list[str], seed: int, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(WORKER), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONHASHSEED": str(seed), "OMP_NUM_THREADS": "1",
                                            "GLOO_SOCKET_IFNAME": "lo", **env})


def _finish(process: subprocess.Popen) -> str:
    try:
        out, err = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    assert process.returncode == 0, err[-3000:]
    return out


def test_pipeline_ranks_whose_hash_seeds_order_the_capture_differently_train_exactly():
    digests = [_run(["digest", NAME], seed) for seed in (0, 1)]
    first, second = (_finish(p).strip().splitlines()[-1] for p in digests)
    assert first != second, f"{NAME}'s capture no longer depends on the hash seed: pick a model whose does"
    port = str(free_port())
    ranks = [_run(["cell", NAME, "pp2"], seed=rank, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=port) for rank in range(2)]
    outs = [_finish(p) for p in ranks]
    outcome = json.loads(outs[0].strip().splitlines()[-1])
    assert outcome["status"] == "exact", outcome
