"""Pipeline executor: runs one rank's list of schedule actions over the pp process group.

Actions (see ``schedules``): ``F``/``B`` run a stage's forward/backward on a microbatch, or ``I`` and later
``W`` its backward in two parts (``split_backward``); ``SEND_F``,
``RECV_F``, ``SEND_B``, ``RECV_B`` move activations forward and their gradients back between the
ranks of neighbouring stages, with batched ``isend``/``irecv``. Sends never block (they are waited
for at the end of the step); receives block. Receives follow the schedule's order, which the
validator checked against the senders' order per pair of ranks (gloo and NCCL match messages in send order).
Messages to a higher pp rank go over one group and those to a lower one over a second (``back_group``): under
NCCL a send waits for its receive, in order with every other message between the two ranks on that group,
and with both directions on one group, 1F1B's steady state (rank 0 sends an activation while rank 1 sends it a
gradient) waits forever. ``schedules.validate`` runs every schedule this way.

Stage s runs on pp rank ``s % p`` (or in a V: ``schedules.stage_rank``); neighbouring stages on one rank hand
over their activations and gradients in memory. The last stage divides its loss by the global divisor, so the
gradients accumulated over microbatches are plain sums. Every action is recorded with its start and
end time, from which the real timeline and bubble are measured.
"""

from __future__ import annotations

import datetime
import itertools
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from autoshard import peers
from autoshard.codegen import RankProgram
from autoshard.errors import AutoshardError
from autoshard.kinds import ActionKind
from autoshard.passes.pipeline_split import TensorSpec
from autoshard.runtime.failures import is_peer_failure
from autoshard.runtime.split_backward import WeightGradients, input_gradients
from autoshard.schedules import Action, stage_rank


class PipelineStall(AutoshardError, RuntimeError):
    """A pipeline action failed or timed out; the message names the rank, step and action."""


_EXECUTORS = itertools.count()  # made in the same order on every rank: one name for one pipeline in the store


def _raise_announced(key: str, rank: int, step: int) -> None:
    """Raise here what a peer announced it failed with: every rank ends that step with that rank's error."""
    message = peers.announced(key)
    if message is not None:
        raise PipelineStall(f"pp rank {rank} ended step {step}: {message}")


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
    weights: WeightGradients | None = None  # after I, what W computes


@dataclass
class Record:
    action: Action
    start: float
    end: float


class PipelineExecutor:
    """Runs this rank's actions for one training step (or one forward-only pass)."""

    def __init__(
        self, runners: dict[int, StageRunner], *, num_stages: int, p: int, pp_ranks: list[int], group,
        rank: int, timeout: datetime.timedelta, device: torch.device | None = None, placement: str = "loop",
        back_group=None, whole_backward: bool = False,
    ) -> None:
        self.runners = runners
        self.num_stages = num_stages
        self.p = p
        self.placement = placement
        self.pp_ranks = pp_ranks
        self.group = group
        self.back_group = back_group if back_group is not None else group
        # a compiled program's backward is one autograd node computing every gradient at once: cut in two it would
        # run twice, so ``I`` runs it whole (the weight gradients early) and ``W`` has nothing left to do
        self.whole_backward = whole_backward
        self.rank = rank
        self.timeout = timeout
        self.device = device or torch.device("cpu")  # where received activations and the loss live
        self.records: list[Record] = []
        self.name, self.runs = f"autoshard/pipeline/{next(_EXECUTORS)}", 0

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
        self.runs += 1
        key = f"{self.name}/{self.runs}/failed"
        failed: PipelineStall | None = None
        for index, action in enumerate(actions):
            start = time.perf_counter()
            if failed is not None:  # this rank failed: its peers are given what they wait for, and told why
                try:
                    self._drain(action, state, microbatches, pending)
                except Exception:  # noqa: BLE001 - a peer that failed too: this rank's own error is the one said
                    raise failed from failed.__cause__  # noqa: B904
                continue
            try:
                total = total + self._do(action, state, microbatches, divisor, pending)
            except Exception as e:
                peer = (f", exchanging with rank {self.pp_ranks[action.peer(self.p, self.placement)]}"
                        if not action.is_compute else "")
                failed = PipelineStall(f"pp rank {self.rank} failed in step {step} at action {index} ({action}{peer}): "
                                       f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                failed.__cause__ = e
                if not action.is_compute or is_peer_failure(e):
                    raise failed from e  # a peer stalled or died: nothing to drain
                peers.announce(str(failed), key)  # to the pp peers, which end the step at its end
                peers.announce(str(failed))  # to those waiting in a collective in this step (tp, cp, ep)
                continue
            self.records.append(Record(action, start, time.perf_counter()))
        for work in pending:
            work.wait()
        if failed is not None:
            raise failed from failed.__cause__
        _raise_announced(key, self.rank, step)
        return total

    def _drain(self, action: Action, state, microbatches, pending) -> None:
        """After this rank failed: no compute; every receive its peers send, and zeros for every send they wait
        for (no gradient, by its flags), so each peer ends its step and reads the failure."""
        runner = self.runners.get(action.stage)
        if action.kind in (ActionKind.RECV_F, ActionKind.RECV_B):
            self._do(action, state, microbatches, 1.0, pending)
        elif action.kind == ActionKind.SEND_F:
            zeros = [spec.allocate(self.device)[0].zero_() for spec in runner.send_specs]
            pending += self._send(zeros, action.stage + 1)
        elif action.kind == ActionKind.SEND_B:
            zeros = [torch.zeros(spec.shape, dtype=spec.dtype, device=self.device) for spec in runner.receive_specs]
            flags = torch.zeros(len(zeros), dtype=torch.uint8, device=self.device)
            pending += self._send([*zeros, flags], action.stage - 1)

    def _do(self, action: Action, state, microbatches, divisor, pending) -> torch.Tensor:
        key = (action.microbatch, action.stage)
        mb = state.setdefault(key, _MicrobatchState())
        runner = self.runners.get(action.stage)
        inputs, target = microbatches[action.microbatch]
        done = self._HANDLERS[action.kind](self, action, mb, state, runner, inputs, target, divisor, pending)
        return done if done is not None else torch.zeros((), dtype=torch.float32, device=self.device)

    def _forward(self, action: Action, mb, state, runner, inputs, target, divisor, pending):
        if action.stage > 0 and self._local(action.stage - 1):  # the V's tip: the previous stage is here
            before = state[action.microbatch, action.stage - 1].outputs
            mb.inputs = [o.detach().clone().requires_grad_(o.is_floating_point()) for o in before]
        out = self._call(runner.program.gm, *inputs, target, *mb.inputs)
        if action.stage == self.num_stages - 1:
            mb.loss = out[0] / divisor
            return mb.loss.detach().float()
        mb.outputs = tuple(out)
        return None

    def _whole_backward(self, action: Action, mb, state, runner, inputs, target, divisor, pending):
        if self._reducer is not None:
            self._reducer.before_backward(action.stage, action.microbatch)
        self._backward(mb)
        if self._reducer is not None:
            self._reducer.after_backward(action.stage, action.microbatch)
        self._hand_back(action, state)

    def _input_backward(self, action: Action, mb, state, runner, inputs, target, divisor, pending):
        if self.whole_backward:
            return self._whole_backward(action, mb, state, runner, inputs, target, divisor, pending)
        roots, grads = self._roots(mb)
        dinputs, mb.weights = input_gradients(roots, grads, mb.inputs)
        for x, grad in zip(mb.inputs, dinputs, strict=True):
            x.grad = grad
        mb.loss, mb.outputs, mb.output_grads = None, (), []
        self._hand_back(action, state)

    def _weight_backward(self, action: Action, mb, state, runner, inputs, target, divisor, pending):
        if self.whole_backward:  # done by I
            state.pop((action.microbatch, action.stage))
            return None
        if self._reducer is not None:
            self._reducer.before_backward(action.stage, action.microbatch)
        mb.weights.run()
        if self._reducer is not None:
            self._reducer.after_backward(action.stage, action.microbatch)
        state.pop((action.microbatch, action.stage))

    def _send_forward(self, action: Action, mb, state, runner, inputs, target, divisor, pending):
        sent = [spec.pack(o.detach()) for spec, o in zip(runner.send_specs, mb.outputs, strict=True)]
        pending += self._send(sent, action.stage + 1)

    def _recv_forward(self, action: Action, mb, state, runner, inputs, target, divisor, pending):
        received = self._receive(runner.receive_specs, action.stage - 1, laid_out=True)
        mb.inputs = [t.requires_grad_() if t.is_floating_point() else t for t in received]

    def _send_backward(self, action: Action, mb, state, runner, inputs, target, divisor, pending):
        # with one flag per input: a gradient that does not exist (an input the loss never reads) is not a zero
        flags = torch.tensor([x.grad is not None for x in mb.inputs], dtype=torch.uint8, device=self.device)
        pending += self._send([*self._input_grads(mb), flags], action.stage - 1)
        if mb.weights is None:
            state.pop((action.microbatch, action.stage))

    def _recv_backward(self, action: Action, mb, state, runner, inputs, target, divisor, pending):
        flags = TensorSpec((len(runner.send_specs),), torch.uint8)
        *grads, found = self._receive([*runner.send_specs, flags], action.stage + 1)
        mb.output_grads = [g if f else None for g, f in zip(grads, found.tolist(), strict=True)]

    _HANDLERS = {ActionKind.F: _forward, ActionKind.B: _whole_backward, ActionKind.I: _input_backward,
                 ActionKind.W: _weight_backward, ActionKind.SEND_F: _send_forward, ActionKind.RECV_F: _recv_forward,
                 ActionKind.SEND_B: _send_backward, ActionKind.RECV_B: _recv_backward}

    @staticmethod
    def _roots(mb: _MicrobatchState) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """What a stage's backward starts from: the loss, or the outputs that need gradients with theirs."""
        if mb.loss is not None:
            return [mb.loss], [torch.ones_like(mb.loss)]
        pairs = [(o, g) for o, g in zip(mb.outputs, mb.output_grads, strict=True) if o.requires_grad and g is not None]
        return [o for o, _ in pairs], [g for _, g in pairs]

    @classmethod
    def _backward(cls, mb: _MicrobatchState) -> None:
        roots, grads = cls._roots(mb)
        if roots:
            torch.autograd.backward(roots, grads)
        mb.loss, mb.outputs, mb.output_grads = None, (), []

    @staticmethod
    def _input_grads(mb: _MicrobatchState) -> list[torch.Tensor]:
        return [x.grad if x.grad is not None else torch.zeros_like(x) for x in mb.inputs]

    def _hand_back(self, action: Action, state) -> None:
        """After a backward (B or I) of a stage whose previous stage is on this rank, give that stage its output
        gradients in memory; drop the microbatch's state once nothing (a send, a W) still needs it."""
        key = (action.microbatch, action.stage)
        if action.stage > 0 and self._local(action.stage - 1):
            state[action.microbatch, action.stage - 1].output_grads = [x.grad for x in state[key].inputs]
            if state[key].weights is None:
                state.pop(key)

    def _local(self, stage: int) -> bool:
        return stage_rank(stage, self.p, self.placement) == self.rank

    def _peer(self, stage: int) -> int:
        return self.pp_ranks[stage_rank(stage, self.p, self.placement)]

    def _group_to(self, peer: int):
        """The group of messages between this rank and ``peer`` in their direction (see the module's text)."""
        return self.group if self.pp_ranks.index(peer) > self.rank else self.back_group

    def _group_from(self, peer: int):
        return self.group if self.pp_ranks.index(peer) < self.rank else self.back_group

    def _send(self, tensors: list[torch.Tensor], to_stage: int) -> list:
        peer = self._peer(to_stage)
        ops = [dist.P2POp(dist.isend, t.contiguous(), peer, group=self._group_to(peer)) for t in tensors]
        for op in ops:
            peers.sent("send", op.tensor, None, peer=f"to {peer}", phase="pipeline")
        return dist.batch_isend_irecv(ops) if ops else []

    def _receive(self, specs: list[TensorSpec], from_stage: int, laid_out: bool = False) -> list[torch.Tensor]:
        """Receive one tensor per spec; activations (``laid_out``) in their sender's memory order, gradients
        row-major."""
        peer = self._peer(from_stage)
        pairs = [spec.allocate(self.device) if laid_out else (torch.empty(spec.shape, dtype=spec.dtype,
                 device=self.device),) * 2 for spec in specs]
        ops = [dist.P2POp(dist.irecv, buffer, peer, group=self._group_from(peer)) for buffer, _ in pairs]
        for op in ops:
            peers.sent("recv", op.tensor, None, peer=f"from {peer}", phase="pipeline")
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait(self.timeout)
        return [value for _, value in pairs]
