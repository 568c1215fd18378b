"""Elastic ``torchrun``: a node dies, the other restarts alone, and the run goes on at the smaller world size.

Two agents (``--nnodes 1:2``, 2 processes each, c10d rendezvous on the loopback) train ``harness/elastic_worker.py`` at
dp=2 x tp=2, saving every 2 steps. At step 5 the second agent is killed with its processes (SIGKILL); the first
agent (which hosts the rendezvous store, as the first node of a job does) sees its processes fail in the step's
collectives and, once the rendezvous has dropped the dead node, restarts them in a world of 2, at tp=2, where they
resume from the newest complete checkpoint, saved at 4 ranks. The losses equal those of a run that was never
interrupted within the tolerance of a resume across meshes (the gradient sums over dp add in another order).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "harness" / "elastic_worker.py"
STEPS, PAUSE = 10, 5


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(run: Path, port: int, *extra: str, nnodes: str = "1:2") -> subprocess.Popen:
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    command = [str(torchrun), "--nnodes", nnodes, "--nproc-per-node", "2", "--max-restarts", "3",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run.name,
               "--rdzv-conf", "last_call_timeout=2,join_timeout=60", "--monitor-interval", "0.5",
               str(WORKER), str(run), str(STEPS), *extra]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _finish(agent: subprocess.Popen, deadline: float) -> str:
    try:
        out, _ = agent.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(agent.pid, signal.SIGKILL)
        out, _ = agent.communicate()
        pytest.fail(f"the agent did not finish in time:\n{out[-6000:]}")
    assert agent.returncode == 0, out[-6000:]
    return out


def _run(run: Path, kill: bool) -> dict:
    run.mkdir()
    port = _port()
    first = _agent(run, port)
    time.sleep(1.0)  # the first agent hosts the rendezvous store: it must survive, so only the second one pauses
    second = _agent(run, port, *([str(PAUSE)] if kill else []))
    deadline = time.monotonic() + 300
    if kill:
        while len(list(run.glob("paused-*"))) < 2:  # both ranks of one node
            assert time.monotonic() < deadline and first.poll() is None, "the run never reached the kill"
            time.sleep(0.2)
        paused = [tuple(map(int, f.name.split("-")[1:])) for f in run.glob("paused-*")]
        assert {node for node, _ in paused} == {second.pid}, "a rank of the store's host paused"
        os.killpg(second.pid, signal.SIGKILL)  # the agent and its ranks (they run in sessions of their own)
        for _, rank in paused:
            os.kill(rank, signal.SIGKILL)
        second.communicate()
        _finish(first, deadline)
    else:
        _finish(first, deadline)
        _finish(second, deadline)
    return json.loads((run / "losses.json").read_text())


def test_a_run_that_loses_a_node_goes_on_at_the_smaller_world_size(tmp_path):
    straight = _run(tmp_path / "straight", kill=False)
    elastic = _run(tmp_path / "elastic", kill=True)
    assert straight["worlds"] == [4]
    assert elastic["worlds"] == [4, 2], f"ran under worlds {elastic['worlds']}"
    assert len(elastic["losses"]) == len(straight["losses"]) == STEPS
    worst = max(abs(a - b) for a, b in zip(elastic["losses"], straight["losses"], strict=True))
    assert elastic["losses"][:PAUSE - 1] == straight["losses"][:PAUSE - 1], "the steps before the loss differ"
    assert worst < 1e-5, f"after resuming at 2 ranks the losses differ by {worst:.2e}"
