"""A pool of gloo worker processes on loopback, shared by the distributed tests of one session.

Starting a process that imports torch and transformers costs seconds, so each world size gets one
pool of single-threaded workers for the whole test session, initialised the way torchrun initialises
its workers (RANK, WORLD_SIZE, MASTER_ADDR on 127.0.0.1, a free port). ``pool.run(fn, *args)`` runs
``fn`` on every rank and returns the per-rank results.

Nothing here can hang a test run: every ``run`` has a deadline. When a rank raises, the test fails
with that rank's traceback; when a rank stalls, the pool dumps the stalled ranks' Python stacks
(faulthandler) into the failure message, so it names the rank and the line it is stuck on. A pool
that failed is torn down and the next ``run`` starts a fresh one.
"""

from __future__ import annotations

import contextlib
import faulthandler
import itertools
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

GROUP_TIMEOUT = timedelta(seconds=60)


class WorkerError(RuntimeError):
    """A rank raised; the message holds its traceback."""


class WorkerTimeout(RuntimeError):
    """A rank did not finish before the deadline; the message holds where it was stuck."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerPool:
    """``world_size`` worker processes in one gloo world; ``run`` executes a function on all of them."""

    def __init__(self, world_size: int, *, start_timeout: float = 180.0) -> None:
        self.world_size = world_size
        self.logs = Path(tempfile.mkdtemp(prefix=f"autoshard-pool{world_size}-"))
        self._ids = itertools.count()
        ctx = _context()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(rank, world_size, port, list(sys.path), self._tasks[rank], self._results, str(self.logs)),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.broken = False
        ready = self._collect("ready", start_timeout, "start")
        if len(ready) != world_size:
            self.close()
            raise WorkerTimeout(f"only ranks {sorted(ready)} of {world_size} started within {start_timeout} s")

    def run(self, fn: Callable, *args, timeout: float = 240.0, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results ordered by rank."""
        if self.broken:
            raise RuntimeError("this pool failed earlier; create a new one")
        task_id = next(self._ids)
        for q in self._tasks:
            q.put((task_id, fn, args, kwargs))
        results = self._collect(task_id, timeout, getattr(fn, "__qualname__", repr(fn)))
        return [results[rank] for rank in range(self.world_size)]

    def _collect(self, task_id, timeout: float, what: str) -> dict[int, object]:
        deadline = time.monotonic() + timeout
        done: dict[int, object] = {}
        errors: dict[int, str] = {}
        end = deadline
        while len(done) + len(errors) < self.world_size and time.monotonic() < end:
            try:  # polled each second, so that a worker that died (killed for memory) fails the task at once
                tid, rank, ok, value = self._results.get(timeout=min(1.0, max(end - time.monotonic(), 0.01)))
            except queue.Empty:
                dead = {r: p.exitcode for r, p in enumerate(self._procs)
                        if p.exitcode is not None and r not in done and r not in errors}
                for r, code in dead.items():
                    errors[r] = f"its worker process died (exit code {code}{'; killed, out of memory?' * (code == -9)})"
                if dead:
                    break
                continue
            if tid != task_id:
                continue
            (done if ok else errors)[rank] = value
            if errors:  # give the other ranks a moment to report, then fail with what is known
                end = min(end, time.monotonic() + 5.0)
        if errors:
            self._fail()
            details = "\n".join(f"--- rank {r} raised:\n{tb}" for r, tb in sorted(errors.items()))
            raise WorkerError(f"{what} failed on rank(s) {sorted(errors)} of {self.world_size}:\n{details}")
        if len(done) < self.world_size and task_id != "ready":
            stalled = sorted(set(range(self.world_size)) - set(done))
            stacks = self._stacks(stalled)
            self._fail()
            raise WorkerTimeout(
                f"{what} did not finish within {timeout:.0f} s on rank(s) {stalled} of {self.world_size} "
                f"(finished: {sorted(done)}). Where the stalled ranks were:\n{stacks}"
            )
        return done

    def _stacks(self, ranks: list[int]) -> str:
        for rank in ranks:
            pid = self._procs[rank].pid
            if pid is not None and self._procs[rank].is_alive():
                os.kill(pid, signal.SIGUSR1)
        time.sleep(1.0)
        parts = []
        for rank in ranks:
            text = (self.logs / f"stack{rank}.txt").read_text(errors="replace") if self._has(rank) else "(no dump)"
            parts.append(f"--- rank {rank}:\n{_user_lines(text)}")
        return "\n".join(parts)

    def _has(self, rank: int) -> bool:
        return (self.logs / f"stack{rank}.txt").exists()

    def _fail(self) -> None:
        self.broken = True
        self.close()

    def close(self) -> None:
        for q in self._tasks:
            with contextlib.suppress(OSError, ValueError):
                q.put(None)
        deadline = time.monotonic() + 3
        for p in self._procs:
            p.join(timeout=max(deadline - time.monotonic(), 0.01))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def _user_lines(stack_dump: str) -> str:
    """The frames of a faulthandler dump, innermost first, without the worker loop's own frames."""
    lines = [line for line in stack_dump.splitlines() if line.strip()]
    return "\n".join(lines[-40:])


def _context():
    """Fork each worker from a server that imported torch, autoshard and transformers once (``pool_preload``);
    spawn where the platform has no fork server."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["harness.pool_preload"])
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).parent.parent), before) if p)
    try:  # the server imports ``harness`` from tests/ (Python 3.11's fork server ignores the parent's sys.path)
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    return ctx


def _worker(rank, world_size, port, path, tasks, results, logs) -> None:
    sys.path[:] = path
    log = open(Path(logs) / f"rank{rank}.log", "w")  # noqa: SIM115 - open for the worker's lifetime
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    stack_file = open(Path(logs) / f"stack{rank}.txt", "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
    )
    from multiprocessing.reduction import ForkingPickler

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT
    )
    results.put(("ready", rank, True, None))
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, fn, args, kwargs = task
        try:
            value = fn(*args, **kwargs)
            ForkingPickler.dumps(value)  # the queue pickles in a thread that drops its errors: fail here instead
            results.put((task_id, rank, True, value))
        except BaseException:  # noqa: BLE001 - every failure goes back to the test with its traceback
            results.put((task_id, rank, False, traceback.format_exc()))
    dist.destroy_process_group()
