"""Pipeline executor: runs one rank's list of schedule actions over the pp process group.

Actions (see ``schedules``): ``F``/``B`` run a stage's forward/backward on a microbatch; ``SEND_F``,
``RECV_F``, ``SEND_B``, ``RECV_B`` move activations forward and their gradients back between the
ranks of neighbouring stages, with batched ``isend``/``irecv``. Sends never block (they are waited
for at the end of the step); receives block. Receives follow the schedule's order, which the
validator checked against the senders' order per pair of ranks (gloo matches messages in send order).

Stage s runs on pp rank ``s % p``. The last stage divides its loss by the global divisor, so the
gradients accumulated over microbatches are plain sums. Every action is recorded with its start and
end time, from which the real timeline and bubble are measured.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from autoshard.codegen import RankProgram
from autoshard.passes.pipeline_split import TensorSpec
from autoshard.runtime.schedules import Action


class PipelineStall(RuntimeError):
    """A pipeline action failed or timed out; the message names the rank, step and action."""


@dataclass
class StageRunner:
    """What the executor needs of one stage it runs."""

    index: int
    program: RankProgram
    receive_specs: list[TensorSpec]  # the activations it receives (local shapes)
    send_specs: list[TensorSpec]


@dataclass
class _MicrobatchState:
    inputs: list[torch.Tensor] = field(default_factory=list)
    outputs: tuple = ()
    loss: torch.Tensor | None = None
    output_grads: list[torch.Tensor] = field(default_factory=list)


@dataclass
class Record:
    action: Action
    start: float
    end: float


class PipelineExecutor:
    """Runs this rank's actions for one training step (or one forward-only pass)."""

    def __init__(
        self, runners: dict[int, StageRunner], *, num_stages: int, p: int, pp_ranks: list[int], group,
        rank: int, timeout: datetime.timedelta, device: torch.device | None = None,
    ) -> None:
        self.runners = runners
        self.num_stages = num_stages
        self.p = p
        self.pp_ranks = pp_ranks
        self.group = group
        self.rank = rank
        self.timeout = timeout
        self.device = device or torch.device("cpu")  # where received activations and the loss live
        self.records: list[Record] = []

    def run(self, actions: list[Action], microbatches: list[tuple[tuple, torch.Tensor]], divisor, step: int,
            call=None, reducer=None):
        """Run ``actions``; returns the sum of this rank's last-stage loss terms (0 elsewhere).

        ``call(fn, *args)`` runs a stage's forward (precision and activation checkpointing options);
        ``reducer`` (a ``GradientReducer``) is told of every backward, to sum finished gradients over dp.
        """
        self._call = call or (lambda fn, *args: fn(*args))
        self._reducer = reducer
        state: dict[tuple[int, int], _MicrobatchState] = {}
        pending: list = []
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        self.records = []
        for index, action in enumerate(actions):
            start = time.perf_counter()
            try:
                total = total + self._do(action, state, microbatches, divisor, pending)
            except RuntimeError as e:
                peer = f", exchanging with rank {self.pp_ranks[action.peer(self.p)]}" if not action.is_compute else ""
                raise PipelineStall(
                    f"pp rank {self.rank} failed in step {step} at action {index} ({action}{peer}): "
                    f"{str(e).splitlines()[0]}"
                ) from e
            self.records.append(Record(action, start, time.perf_counter()))
        for work in pending:
            work.wait()
        return total

    def _do(self, action: Action, state, microbatches, divisor, pending) -> torch.Tensor:
        key = (action.microbatch, action.stage)
        mb = state.setdefault(key, _MicrobatchState())
        runner = self.runners.get(action.stage)
        inputs, target = microbatches[action.microbatch]
        if action.kind == "F":
            out = self._call(runner.program.gm, *inputs, target, *mb.inputs)
            if action.stage == self.num_stages - 1:
                mb.loss = out[0] / divisor
                return mb.loss.detach().float()
            mb.outputs = tuple(out)
        elif action.kind == "B":
            if self._reducer is not None:
                self._reducer.before_backward(action.stage, action.microbatch)
            self._backward(mb)
            if self._reducer is not None:
                self._reducer.after_backward(action.stage, action.microbatch)
        elif action.kind == "SEND_F":
            pending += self._send([o.detach() for o in mb.outputs], action.stage + 1)
        elif action.kind == "RECV_F":
            received = self._receive(runner.receive_specs, action.stage - 1)
            mb.inputs = [t.requires_grad_() if t.is_floating_point() else t for t in received]
        elif action.kind == "SEND_B":
            grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in mb.inputs]
            pending += self._send(grads, action.stage - 1)
            state.pop(key)
        elif action.kind == "RECV_B":
            mb.output_grads = self._receive(runner.send_specs, action.stage + 1)
        else:
            raise ValueError(f"unknown action kind {action.kind!r} in {action}")
        return torch.zeros((), dtype=torch.float32, device=self.device)

    @staticmethod
    def _backward(mb: _MicrobatchState) -> None:
        if mb.loss is not None:
            mb.loss.backward()
            mb.loss = None
            return
        pairs = [(o, g) for o, g in zip(mb.outputs, mb.output_grads, strict=True) if o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        mb.outputs, mb.output_grads = (), []

    def _peer(self, stage: int) -> int:
        return self.pp_ranks[stage % self.p]

    def _send(self, tensors: list[torch.Tensor], to_stage: int) -> list:
        peer = self._peer(to_stage)
        ops = [dist.P2POp(dist.isend, t.contiguous(), peer, group=self.group) for t in tensors]
        return dist.batch_isend_irecv(ops) if ops else []

    def _receive(self, specs: list[TensorSpec], from_stage: int) -> list[torch.Tensor]:
        peer = self._peer(from_stage)
        buffers = [torch.empty(spec.shape, dtype=spec.dtype, device=self.device) for spec in specs]
        ops = [dist.P2POp(dist.irecv, b, peer, group=self.group) for b in buffers]
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait(self.timeout)
        return buffers
