"""A failure on one rank ends the step on every rank within a second or two, with that rank's error.

A rank that fails inside a step (a shape its data breaks, an out-of-memory, a bug in a model's line) used to leave
the ranks it exchanges with waiting in their next collective until the group's timeout (120 s), which then named
no one. Now the failing rank writes its error into the job's store under the step's key (no collective, no
wait), and every collective autoshard issues in a step is waited on in slices of ``POLL``, reading that key
between slices: a peer's failure ends the wait with the peer's error. DDP's buckets are watched the same way by
one thread. gloo only: a NCCL collective's wait returns at once (it orders the stream), and a program compiled by
``torch.compile`` waits inside its graph.

A step that failed can leave a group out of step: a rank that gave up a collective its peers never joined still
has it in flight, and a rank that failed before a collective its peers completed would pair its next step's
collective with it (both would "succeed" on the wrong data). So every rank counts the collectives it issues in a
step, per group, and after a step in which a failure was announced each rank writes its counts to the store; the
next step of that model first compares every rank's counts, and where a group's members issued different numbers
it is refused on every rank, before any collective, for good. The only cost when nothing fails is one read of the
store per step.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
import os
import threading
import time
import traceback
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from autoshard.errors import AutoshardError

POLL = datetime.timedelta(seconds=1)


class PeerFailed(AutoshardError, RuntimeError):
    """Another rank failed in this step, or a failed step left this model's groups out of step; the message says
    which rank failed and with what."""


class Sent(NamedTuple):
    """A collective this rank issued while ``recording``: what for (``phase``), its kind, its group's ranks (a
    point-to-point message: ``to R`` or ``from R``), the dtype and elements of what this rank handed it (as
    ``passes.collectives.Wire`` counts them), and the lines that issued it."""

    phase: str
    kind: str
    group: str
    dtype: torch.dtype
    numel: int
    where: tuple[str, ...] = ()


class _Step:
    """The exchange this process runs: its store key, its model's name and the collectives it issued, by group."""

    def __init__(self, model: str, index: int) -> None:
        self.model, self.index, self.key = model, index, f"{model}/{index}"
        self.issued: collections.Counter[str] = collections.Counter()


_step: _Step | None = None
_lock = threading.Lock()
_watched: list[torch.futures.Future] = []  # DDP buckets' futures not yet done in this step
_watcher: threading.Thread | None = None
_names: dict[int, str] = {}  # a group's name (its ranks), by id
_finished: dict[str, _Step] = {}  # each parallel model's last exchange that ended without an error here
_sent: list[list[Sent]] = []  # while recording: the lists what this rank puts on the wire goes into
_phase: str | None = None  # what the collectives issued now are for, where the caller says (a gradient sync)


def store():
    return dist.distributed_c10d._get_default_store() if dist.is_initialized() else None


def announce(message: str, key: str | None = None) -> None:
    """Tell every rank that this one failed in the step ``key`` (this step's by default) names; the first failure
    announced is the one said (a peer that then fails on what it was given does not overwrite it)."""
    key = key or (_step.key if _step is not None else None)
    found = store()
    if key is not None and found is not None:
        found.compare_set(key, "", message)


def announced(key: str | None = None) -> str | None:
    """What a rank announced it failed with in the step ``key`` (this step's by default), or None."""
    key = key or (_step.key if _step is not None else None)
    found = store()
    if key is None or found is None or not found.check([key]):
        return None
    return found.get(key).decode()


@contextlib.contextmanager
def running(model: str, index: int, ranks: list[int], rank: int, who: str, timeout: datetime.timedelta):
    """Run exchange ``index`` (a step, an inference call) of the parallel model named ``model`` (both alike on every
    rank) over the job's ``ranks``; ``rank``: this one; ``who``: this rank and what it runs, for messages.

    This rank's own failure is announced in the store as it propagates; a wait that gives up on a peer raises
    ``PeerFailed`` with the peer's error. A model whose groups a failed step left out of step is refused here."""
    global _step
    if store() is not None and len(ranks) > 1 and index > 1:
        _check_in_step(model, index - 1, ranks, rank, who, timeout)
    step, outer = _Step(model, index), _step  # an exchange inside another (a call a step makes) restores it after
    _step = step
    try:
        yield
    except PeerFailed:
        _report(step, rank)
        raise
    except BaseException as e:
        _report(step, rank)
        peer = announced(step.key)
        if peer is not None and peer in str(e):  # a peer's failure that reached here wrapped (DDP casts it)
            raise PeerFailed(peer) from e
        first = str(e).splitlines()[0] if str(e) else ""
        announce(f"{who} failed: {type(e).__name__}: {first}")
        raise
    finally:
        _step = outer
        if outer is None:
            with _lock:
                _watched.clear()
    _finished[model] = step


def run(collective, *args, group=None, **kwargs):
    """``collective(*args, group=group, **kwargs)`` (a ``torch.distributed`` collective, in place), recorded
    (``recording``), counted and waited on as ``wait`` does."""
    if torch.compiler.is_compiling():
        return collective(*args, group=group, **kwargs)
    if fake(args):  # a program run on fake tensors for its shapes (``autoshard.certificate``): nothing to send
        return None
    if _sent:
        kind, position = _KINDS.get(collective.__name__, (collective.__name__, 0))
        sent(kind, args[position] if len(args) > position else kwargs.get("input", kwargs.get("tensor")), group)
    if _step is None:
        return collective(*args, group=group, **kwargs)
    issued(group)
    if not _on_cpu(args):
        return collective(*args, group=group, **kwargs)
    wait(collective(*args, group=group, async_op=True, **kwargs))
    return None


# a torch.distributed collective's name -> (its kind, the position of the tensor this rank hands it)
_KINDS = {"all_reduce": ("all_reduce", 0), "all_gather": ("all_gather", 1), "all_gather_single": ("all_gather", 1),
          "all_gather_into_tensor": ("all_gather", 1), "reduce_scatter_single": ("reduce_scatter", 1),
          "reduce_scatter_tensor": ("reduce_scatter", 1), "all_to_all_single": ("all_to_all", 1),
          "broadcast": ("broadcast", 0)}
_HERE = os.path.abspath(__file__)
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


@contextlib.contextmanager
def recording():
    """Record every collective this rank issues through ``run`` and ``sent`` inside; yields the list they are
    appended to (``Sent``). Recordings nest: each records all that is issued inside it."""
    found: list[Sent] = []
    _sent.append(found)
    try:
        yield found
    finally:
        _sent.remove(found)


@contextlib.contextmanager
def phase(name: str):
    """The collectives issued inside are for ``name`` (a gradient sync, the loss's sum), not the forward or
    backward they would otherwise be counted in."""
    global _phase
    outer, _phase = _phase, name
    try:
        yield
    finally:
        _phase = outer


def sent(kind: str, tensor: torch.Tensor, group, *, peer: str | None = None, phase: str | None = None) -> None:
    """While recording: this rank hands ``tensor`` to a collective of ``kind`` on ``group`` (or a message to or
    from ``peer``, ``to R`` / ``from R``), for ``phase`` (by default the one ``phase()`` set, else the forward or
    the backward it runs in)."""
    if not _sent or torch.compiler.is_compiling():
        return
    now = phase or _phase or ("backward" if torch._C._current_graph_task_id() != -1 else "forward")
    frames = [f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}" for f in traceback.extract_stack(limit=16)
              if not f.filename.startswith((_HERE, _TORCH, "<"))]
    record = Sent(now, kind, peer or _name(group), tensor.dtype, tensor.numel(), tuple(frames[-3:]))
    for found in _sent:
        found.append(record)


def fake(args) -> bool:
    """Whether the tensors handed to a collective are fake (shapes and dtypes only, no data)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(t, FakeTensor) for t in pytree.tree_leaves(args))


def issued(group) -> None:
    """Count a collective this rank issues on ``group`` in this step."""
    if _step is not None:
        _step.issued[_name(group)] += 1


def wait(work) -> None:
    """Wait for ``work``; in a step, give up with the peer's error as soon as a peer announces one."""
    if _step is None:
        work.wait()
        return
    while True:
        try:
            work.wait(POLL)
            return
        except RuntimeError:
            if work.is_completed():  # the collective's own failure (its group's timeout, a peer gone)
                raise
            message = announced()
            if message is not None:
                raise PeerFailed(message) from None


def watched(future: torch.futures.Future, group) -> torch.futures.Future:
    """``future`` (a collective's on ``group``, as a DDP communication hook returns it), counted, and ended with the
    peer's error as soon as a peer announces one in this step."""
    if _step is None:
        return future
    issued(group)
    ours = torch.futures.Future()

    def settle(done: torch.futures.Future) -> None:
        with _lock:
            if ours.done():
                return
            try:
                ours.set_result(done.value())
            except RuntimeError as e:
                ours.set_exception(e)

    with _lock:
        _watched.append(ours)
        _start_watcher()
    future.add_done_callback(settle)
    return ours


def _check_in_step(model: str, index: int, ranks: list[int], rank: int, who: str, timeout) -> None:
    """Before exchange ``index + 1``: if exchange ``index`` failed anywhere, every rank's counts of it agree per
    group, or this model is refused for good (on every rank: each compares the same counts)."""
    found = store()
    failure = announced(f"{model}/{index}")
    if failure is None:
        return
    refused = announced(f"{model}/out of step")
    if refused is None:
        key = f"{model}/{index}/issued"
        if not found.check([f"{key}/{rank}"]):  # this rank ended that step without an error
            last = _finished.get(model)
            _report(last if last is not None and last.index == index else _Step(model, index), rank)
        found.wait([f"{key}/{r}" for r in ranks], timeout)
        counts = {r: json.loads(found.get(f"{key}/{r}")) for r in ranks}
        differ = _differing(counts)
        if differ is None:
            return
        announce(f"in the step that failed ({failure}), {differ}", f"{model}/out of step")
        refused = announced(f"{model}/out of step")
    raise PeerFailed(f"{who} cannot run: {refused}, so the process groups are out of step and no later step of this "
                     f"model can run: end the job and start it again (torchrun --max-restarts restarts it)")


def _differing(counts: dict[int, dict[str, int]]) -> str | None:
    """Where the ranks of a group issued different numbers of collectives on it, which; else None."""
    for name in sorted({n for issued in counts.values() for n in issued}):
        members = [int(r) for r in name.split(",")]
        seen = {r: counts[r].get(name, 0) for r in members if r in counts}
        if len(set(seen.values())) > 1:
            return f"the ranks of group [{name}] issued {seen} collectives on it"
    return None


def _report(step: _Step, rank: int) -> None:
    """Write this rank's counts of the step's collectives, by group, for the next step's check."""
    found = store()
    if found is not None:
        found.set(f"{step.key}/issued/{rank}", json.dumps(dict(step.issued)))


def _name(group) -> str:
    if id(group) not in _names:
        _names[id(group)] = ",".join(map(str, dist.get_process_group_ranks(group or dist.group.WORLD)))
    return _names[id(group)]


def _on_cpu(args) -> bool:
    for arg in args:
        for value in arg if isinstance(arg, (list, tuple)) else (arg,):
            if isinstance(value, torch.Tensor):
                return value.device.type == "cpu"
    return False


def _start_watcher() -> None:
    global _watcher
    if _watcher is None or not _watcher.is_alive():
        _watcher = threading.Thread(target=_watch, name="autoshard-peers", daemon=True)
        _watcher.start()


def _watch() -> None:
    """Every ``POLL``, while DDP buckets are in flight, end them with a peer's announced failure."""
    while True:
        time.sleep(POLL.total_seconds())
        with _lock:
            pending = [f for f in _watched if not f.done()]
            _watched[:] = pending
            key = _step.key if _step is not None else None
        if not pending or key is None:
            continue
        message = announced(key)
        if message is None:
            continue
        with _lock:
            for future in pending:
                if not future.done():
                    future.set_exception(PeerFailed(message))
