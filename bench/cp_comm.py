"""Bytes a rank moves: counted at the ``torch.distributed`` calls, and the analytic amounts of context parallelism.

``CommCounter`` is a context manager that wraps the Python entry points of ``torch.distributed`` that
autoshard's runtime and passes call (``all_reduce``, ``all_gather``, ``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``broadcast``, ``batch_isend_irecv``, ``send``, ``recv``) and records, per call,
the payload and the bytes this rank *sends* under the algorithm gloo uses on CPU for two or more ranks (ring
all-reduce: ``2 (n-1)/n`` of the tensor; ring all-gather: ``(n-1)`` local blocks; point-to-point: exactly what
is sent). Each call is filed under the phase it ran in (``forward``: outside autograd's backward,
``backward``: inside it) and under who made it: ``attention`` when the call comes from the graph's
context-parallel collectives (``autoshard/passes/context_parallel.py``, ``autoshard/passes/ring_attention.py``,
``autoshard/passes/collectives.py``), ``data`` otherwise (the gradient all-reduce of DistributedDataParallel over
dp x cp, the loss and token-count sums of ``pm.step``).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

GRAPH_FILES = {"context_parallel.py", "ring_attention.py", "collectives.py"}
WRAPPED = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
           "batch_isend_irecv", "send", "recv", "all_to_all_single")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _group_size(kwargs: dict) -> int:
    return dist.get_world_size(kwargs.get("group"))


def sent_bytes(name: str, args: tuple, kwargs: dict) -> tuple[int, float]:
    """(payload bytes, bytes this rank sends) of one call of ``torch.distributed.<name>``."""
    if name == "batch_isend_irecv":
        ops = args[0] if args else kwargs["p2p_op_list"]
        sent = sum(_nbytes(op.tensor) for op in ops if op.op in (dist.isend, dist.send))
        return sent, float(sent)
    if name in ("send", "recv"):
        tensor = args[0] if args else kwargs["tensor"]
        return _nbytes(tensor), float(_nbytes(tensor)) if name == "send" else 0.0
    n = _group_size(kwargs)
    if name == "all_gather":
        tensor = args[1] if len(args) > 1 else kwargs["tensor"]
        return _nbytes(tensor), float((n - 1) * _nbytes(tensor))
    if name == "all_gather_into_tensor":
        tensor = args[1] if len(args) > 1 else kwargs["input_tensor"]
        return _nbytes(tensor), float((n - 1) * _nbytes(tensor))
    tensor = args[0] if args else kwargs.get("tensor", kwargs.get("input"))
    if name == "all_reduce":
        return _nbytes(tensor), 2 * (n - 1) / n * _nbytes(tensor)
    if name == "reduce_scatter_tensor":
        tensor = args[1] if len(args) > 1 else kwargs["input"]
        return _nbytes(tensor), (n - 1) / n * _nbytes(tensor)
    return _nbytes(tensor), (n - 1) / n * _nbytes(tensor)  # broadcast, pipelined; all-to-all keeps 1/n


def _caller_category() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        if Path(frame.f_code.co_filename).name in GRAPH_FILES:
            return "attention"
        frame = frame.f_back
    return "data"


class CommCounter:
    """Counts the bytes of ``torch.distributed`` calls made inside the ``with`` block (see the module docstring)."""

    def __init__(self) -> None:
        self.records: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0, 0, 0.0])
        self._saved: dict[str, object] = {}

    def _wrap(self, name: str, fn):
        def counted(*args, **kwargs):
            payload, sent = sent_bytes(name, args, kwargs)
            phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            entry = self.records[(_caller_category(), phase, name)]
            entry[0] += 1
            entry[1] += payload
            entry[2] += sent
            return fn(*args, **kwargs)

        return counted

    def __enter__(self) -> CommCounter:
        for name in WRAPPED:
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name, self._saved[name]))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)

    def summary(self) -> dict:
        """{"category phase": {"calls", "payload", "sent", "ops": {op: calls}}}, JSON-ready."""
        out: dict[str, dict] = {}
        for (category, phase, name), (calls, payload, sent) in sorted(self.records.items()):
            entry = out.setdefault(f"{category} {phase}", {"calls": 0, "payload": 0, "sent": 0.0, "ops": {}})
            entry["calls"] += calls
            entry["payload"] += payload
            entry["sent"] += sent
            entry["ops"][name] = entry["ops"].get(name, 0) + calls
        return out


def explain_sent(communication: dict, c: int) -> dict[str, float]:
    """``autoshard.explain.communication(gm)`` converted to bytes this rank sends, per phase.

    Its byte column follows each op's own convention: the gathered output of an all-gather, the reduced
    tensor of an all-reduce, the bytes sent for ring attention; converted here with the ring algorithms'
    factors so that it compares with ``CommCounter``.
    """
    sent = {"forward": 0.0, "backward": 0.0}
    for (direction, kind, _op), (_calls, nbytes) in communication.items():
        factor = {"all_gather": (c - 1) / c, "reduce_scatter": (c - 1) / c, "all_reduce": 2 * (c - 1) / c,
                  "ring": 1.0, "all_to_all": 1.0}.get(kind, 0.0)
        sent[direction] += factor * nbytes
    return sent


def analytic_sent(attention: str, c: int, layers: int, batch: int, seq: int, hidden: int, elem: int = 4) -> dict:
    """Bytes one cp rank sends per step for attention, from the shapes alone (K and V of every layer).

    ``gather``: forward all-gathers K and V (``(c-1)/c`` of the full-length tensors sent); backward
    reduce-scatters their full-length gradients (``(c-1)/c``, the least a sum of them needs). ``ring``:
    forward ``c-1`` K/V blocks of ``seq/c`` tokens; backward the ``c-1`` K/V blocks
    again plus ``c`` dK/dV accumulators (fp32). ``alltoall``: forward q, k, v and the output of every layer,
    ``seq/c`` tokens each, keep ``1/c`` and send the rest; backward their gradients the same way.
    """
    full = 2 * layers * batch * seq * hidden * elem  # K and V of every layer at full length
    if c == 1:
        return {"forward": 0.0, "backward": 0.0, "backward_min": 0.0}
    if attention == "gather":
        return {"forward": full * (c - 1) / c, "backward": full * (c - 1) / c, "backward_min": full * (c - 1) / c}
    if attention == "alltoall":
        moved = 2 * full / c * (c - 1) / c  # four (seq/c x hidden) tensors a layer; full counts two at seq
        return {"forward": moved, "backward": moved, "backward_min": moved}
    block = full / c
    backward = block * (c - 1) + block * c * max(elem, 4) / elem
    return {"forward": block * (c - 1), "backward": backward, "backward_min": backward}
