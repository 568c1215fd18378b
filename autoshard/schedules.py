"""Pipeline schedules as data: per pp rank, the ordered list of actions it runs in one training step.

Terms:

- ``p``: pipeline ranks (the pp degree); ``v``: chunks (virtual stages) per rank; ``m``: microbatches.
- ``S = p * v`` *stages*, numbered ``0..S-1`` in model order. Stage ``s`` lives on pp rank ``s % p``, so rank
  ``r`` holds stages ``r, r + p, r + 2p, ...`` (its chunks ``0..v-1``). A chunk is one stage; with ``v = 1`` the
  two words name the same thing.
- *Placement*: ``"loop"`` puts stage ``s`` on rank ``s % p`` (above); ``"v"`` (two chunks per rank, the
  zero-bubble V schedules) puts rank ``r``'s chunks at stages ``r`` and ``2p-1-r``, so the model goes down the
  ranks and back up, and rank ``p-1`` holds the two middle stages, which hand over without a message.
- An ``Action(kind, microbatch, stage)`` is one thing a rank does. Compute actions: ``F`` runs stage ``stage``
  forward on ``microbatch``, ``B`` runs its backward (input and weight gradients together); or the backward
  in two parts, ``I`` (the gradients of the stage's inputs, which the previous stage waits for) and later ``W``
  (its parameters' gradients, which nothing waits for: zero-bubble schedules move them into the bubbles).
  Communication actions, each named by the stage on the rank that runs it:

  ===========  ================================================================================
  ``SEND_F``   send stage ``s``'s output to stage ``s+1``'s rank (after ``F`` of ``s``)
  ``RECV_F``   receive stage ``s``'s input from stage ``s-1``'s rank (before ``F`` of ``s``)
  ``SEND_B``   send the gradient of stage ``s``'s input to stage ``s-1``'s rank (after ``B`` or ``I`` of ``s``)
  ``RECV_B``   receive the gradient of stage ``s``'s output from stage ``s+1``'s rank (before ``B`` of ``s``)
  ===========  ================================================================================

  So ``SEND_F(j, s)`` pairs with ``RECV_F(j, s+1)`` and ``SEND_B(j, s)`` with ``RECV_B(j, s-1)``. An action
  prints as ``{stage}{kind}{microbatch}`` (``3F1``, ``3B1``, ``3SEND_F1``, ``3RECV_B1``) and parses back.
- A *channel* is an ordered pair of ranks (sender, receiver). gloo matches equal-shaped messages on a channel
  in send order, so every schedule here receives on each channel in exactly the order the peer sends.
- Execution model: sends never block (an executor posts them with ``isend`` and waits for them by the end of
  the step), a receive blocks until its matching send has run. The builders place each send right after the
  compute that produces it and each receive just before the first compute that needs it (or an earlier receive
  on that channel that must come first), so a rank waits only for data it is about to use.

Builders (``gpipe``, ``one_f_one_b``, ``interleaved_1f1b``, ``zero_bubble_h1``, ``zero_bubble_v``,
``dual_pipe_v``, ``schedule``)
return ``dict[rank, list[Action]]``;
``validate`` checks a schedule, ``simulate`` times it, ``render`` draws it as a grid of ranks by time.

``SPECS`` is the one record of what autoshard knows of each schedule (its builder, the chunks per rank it runs,
its placement, whether it splits the backward, its bubble formula); options, lint, explain, the planner and the
search read it through ``spec(name)``. A new schedule is a builder and one ``ScheduleSpec``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from autoshard.errors import AutoshardError
from autoshard.kinds import ActionKind, ScheduleName, StagePlacement

KINDS = ActionKind.names()
SCHEDULES = ScheduleName.names()
PLACEMENTS = StagePlacement.names()

Schedule = dict[int, list["Action"]]

_ACTION_RE = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)")
_CELL_PREFIX = {"F": "F", "B": "B", "I": "I", "W": "W", "SEND_F": ">F", "RECV_F": "<F", "SEND_B": ">B",
                "RECV_B": "<B"}


def stage_rank(stage: int, p: int, placement: str = "loop") -> int:
    """The pp rank that holds ``stage`` (see Placement above)."""
    if placement == "loop":
        return stage % p
    if placement != "v":
        raise ValueError(f"unknown placement {placement!r}; expected one of {', '.join(PLACEMENTS)}")
    if stage >= 2 * p:
        raise ValueError(f"the V placement holds 2 stages per rank; stage {stage} does not exist with p={p}")
    return stage if stage < p else 2 * p - 1 - stage


def placement_of(name: str) -> str:
    """The placement the schedule called ``name`` runs its stages in."""
    return spec(name).placement


def named(chunks: int = 1, zero_bubble: bool = False) -> ScheduleName:
    """The schedule a pipeline of ``chunks`` per rank runs when none is named: 1F1B, interleaved over more chunks;
    with ``zero_bubble``, ZB-H1 for one chunk and ZBV for two."""
    if zero_bubble:
        return ScheduleName.ZBV if chunks == 2 else ScheduleName.ZB_H1
    return ScheduleName.INTERLEAVED if chunks > 1 else ScheduleName.ONE_F_ONE_B


class ScheduleError(AutoshardError, ValueError):
    """A schedule that would compute the wrong thing or hang; names the rank, step and action at fault."""

    def __init__(self, message: str, *, rank: int | None = None, step: int | None = None,
                 action: Action | None = None) -> None:
        super().__init__(message)
        self.rank, self.step, self.action = rank, step, action


@dataclass(frozen=True, repr=False)
class Action:
    kind: ActionKind  # or its name ("F", "SEND_B"), made the kind
    microbatch: int
    stage: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        object.__setattr__(self, "kind", ActionKind(self.kind))
        if self.microbatch < 0 or self.stage < 0:
            raise ValueError(f"microbatch and stage must be >= 0, got {self.microbatch} and {self.stage}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    __repr__ = __str__

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of ``str``: ``"3SEND_F1"`` -> ``Action("SEND_F", 1, 3)``."""
        match = _ACTION_RE.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"cannot parse action {text!r}: expected {{stage}}{{kind}}{{microbatch}} such as '3F1' "
                             f"or '2SEND_B0', with kind one of {', '.join(KINDS)}")
        stage, kind, microbatch = match.groups()
        return cls(kind, int(microbatch), int(stage))

    @property
    def is_compute(self) -> bool:
        return self.kind.is_compute

    @property
    def is_send(self) -> bool:
        return self.kind.startswith("SEND")

    @property
    def is_recv(self) -> bool:
        return self.kind.startswith("RECV")

    def rank(self, p: int, placement: str = "loop") -> int:
        """The pp rank that runs this action."""
        return stage_rank(self.stage, p, placement)

    def peer(self, p: int, placement: str = "loop") -> int:
        """The pp rank a send goes to or a receive comes from."""
        if self.is_compute:
            raise ValueError(f"{self} is a compute action and has no peer rank")
        downstream = self.kind in ("SEND_F", "RECV_B")
        return stage_rank(self.stage + (1 if downstream else -1), p, placement)

    def partner(self) -> Action:
        """The receive that matches this send, or the send that matches this receive."""
        step = {"SEND_F": ("RECV_F", 1), "RECV_F": ("SEND_F", -1), "SEND_B": ("RECV_B", -1), "RECV_B": ("SEND_B", 1)}
        if self.is_compute:
            raise ValueError(f"{self} is a compute action and has no partner")
        kind, delta = step[self.kind]
        return Action(kind, self.microbatch, self.stage + delta)


# ---------------------------------------------------------------------------------------------------- builders


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: every rank runs all forwards, then all backwards in the same microbatch order."""
    _check_sizes(p, m, 1)
    orders = {r: [Action("F", j, r) for j in range(m)] + [Action("B", j, r) for j in range(m)] for r in range(p)}
    return _with_comms(orders, p, 1)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-flush): ``min(p-1-r, m)`` warm-up forwards on rank r, then one forward and one backward in
    turn, then the remaining backwards. Rank r holds at most ``min(p - r, m)`` microbatches' activations."""
    _check_sizes(p, m, 1)
    orders: dict[int, list[Action]] = {}
    for r in range(p):
        warmup = min(p - 1 - r, m)
        order = [Action("F", j, r) for j in range(warmup)]
        for j in range(m - warmup):
            order += [Action("F", warmup + j, r), Action("B", j, r)]
        order += [Action("B", j, r) for j in range(m - warmup, m)]
        orders[r] = order
    return _with_comms(orders, p, 1)


def interleaved_1f1b(p: int, m: int, v: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B with ``v`` chunks per rank (``v = 1`` is plain 1F1B).

    Microbatches go in rounds of ``m // rounds`` with ``rounds = max(1, m // p)``: each chunk runs forward on a
    round's microbatches before the next chunk does (depth first). Rank r warms up with
    ``(v-1) * (m // rounds) + 2 * (p-1-r)`` chunk forwards (at most ``m * v``), then alternates one forward and
    one backward. Needs ``m`` divisible by ``rounds``: any ``m < 2p`` or multiple of ``p`` works.
    """
    _check_sizes(p, m, v)
    if v == 1:
        return one_f_one_b(p, m)
    rounds = max(1, m // p)
    if m % rounds:
        ok = [n for n in range(1, 2 * m + 1) if n % max(1, n // p) == 0]
        below, above = max(n for n in ok if n < m), min(n for n in ok if n > m)
        raise ValueError(f"interleaved 1F1B with p={p} runs m={m} microbatches in max(1, m // p) = {rounds} rounds "
                         f"and needs m divisible by that; use m={below} or m={above} (any m < 2p or multiple of p "
                         f"works), or the '1f1b' schedule")
    orders = {r: _interleaved_order(r, p, m, v, m // rounds) for r in range(p)}
    return _with_comms(orders, p, v)


def zero_bubble_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): 1F1B whose backwards compute only the input
    gradients (``I``), each rank r running its weight gradients (``W``) r backwards late, where 1F1B's cool-down
    would idle. With F, I and W of equal cost the bubble is ``(p-1)/(3m+p-1)``, a third of 1F1B's; every rank
    holds at most ``min(p, m)`` microbatches' activations (1F1B's first rank's)."""
    _check_sizes(p, m, 1)
    return _with_comms({r: _zb_h1_order(r, p, m) for r in range(p)}, p, 1)


def _zb_h1_order(r: int, p: int, m: int) -> list[Action]:
    warmup = min(p - 1 - r, m)
    order = [Action("F", j, r) for j in range(warmup)]
    waiting = 0  # the first microbatch whose W has not run
    for j in range(m):
        if j < m - warmup:
            order.append(Action("F", warmup + j, r))
        order.append(Action("I", j, r))
        while waiting <= j - r:
            order.append(Action("W", waiting, r))
            waiting += 1
    return order + [Action("W", j, r) for j in range(waiting, m)]


def zero_bubble_v(p: int, m: int) -> Schedule:
    """ZBV (the zero-bubble paper's V schedule): two chunks per rank placed in a V (rank r holds stages r and
    ``2p-1-r``), backwards split into ``I`` and ``W``. Warm-up fills chunk 0 with ``2(p-r)-1`` forwards, then the
    two chunks alternate F, I and W; with F, I and W of equal cost the bubble is ``(p-1)/(6m+p-1)`` and every rank
    holds p stages' worth of activations (2p chunks of half a stage). Built for ``max(m, 2p-1)`` microbatches with
    the ones beyond m left out, as fewer cannot fill the V."""
    _check_sizes(p, m, 1)
    return _with_comms({r: [a for a in _zbv_order(r, p, max(m, 2 * p - 1)) if a.microbatch < m] for r in range(p)},
                       p, 2, "v")


def _zbv_order(r: int, p: int, n: int) -> list[Action]:
    stage = {0: r, 1: 2 * p - 1 - r}
    count = {(kind, c): 0 for kind in "FIW" for c in (0, 1)}
    order: list[Action] = []

    def do(*steps: tuple[str, int]) -> None:
        for kind, chunk in steps:
            order.append(Action(kind, count[kind, chunk], stage[chunk]))
            count[kind, chunk] += 1

    for _ in range(2 * (p - r) - 1):
        do(("F", 0))
    for _ in range(r):
        do(("F", 1), ("F", 0))
    for _ in range(p - r):
        do(("F", 1), ("I", 1), ("W", 1))
    while count["F", 1] < count["F", 0] or count["F", 0] < n:
        if count["F", 0] < n:
            do(("F", 0))
        do(("I", 0), ("W", 0), ("F", 1), ("I", 1), ("W", 1))
    for _ in range(r):
        do(("I", 0), ("I", 1))
    for _ in range(p - r):
        do(("I", 0), ("W", 0))
    do(*[("W", 1)] * (count["I", 1] - count["W", 1]), *[("W", 0)] * (count["I", 0] - count["W", 0]))
    return order


def dual_pipe_v(p: int, m: int) -> Schedule:
    """DualPipeV (DeepSeek's DualPipe folded into a V, as PyTorch's ``ScheduleDualPipeV``): two chunks per rank in
    a V; after the warm-up each rank pairs a forward of one chunk with a full backward of the other (where GPUs
    overlap the two's compute and communication; here they run one after the other), and the first and last
    backwards are split into I and W to fill the ramps. Needs at least 2p microbatches. With F, I and W of equal
    cost the bubble is ZBV's, ``(p-1)/(6m+p-1)``; every rank holds ``p + 1/2`` stages' worth of activations."""
    _check_sizes(p, m, 1)
    if m < 2 * p:
        raise ValueError(f"DualPipeV with p={p} needs at least 2p = {2 * p} microbatches, got m={m}; use m >= "
                         f"{2 * p}, or 'zbv', which runs any m")
    return _with_comms({r: _dual_pipe_v_order(r, p, m) for r in range(p)}, p, 2, "v")


def _dual_pipe_v_order(r: int, p: int, m: int) -> list[Action]:
    first, second = r, 2 * p - 1 - r  # the rank's chunks: going down the V and coming back up
    count: dict[tuple[int, str], int] = {}  # next microbatch per (stage, F or backward)
    deferred: list[Action] = []  # the W of every I, oldest first
    order: list[Action] = []

    def add(stage: int, kind: str) -> None:
        key = (stage, "F" if kind == "F" else "B")
        j = count.get(key, 0)
        count[key] = j + 1
        order.append(Action(kind, j, stage))
        if kind == "I":
            deferred.append(Action("W", j, stage))

    def weight() -> None:
        if deferred:
            order.append(deferred.pop(0))

    for _ in range(2 * (p - r - 1)):
        add(first, "F")
    for _ in range(r + 1):
        add(first, "F"), add(second, "F")
    for _ in range(p - r - 1):
        add(second, "I"), weight(), add(second, "F")
    for _ in range(m - 2 * p + r + 1):  # the main phase: forward of one chunk paired with backward of the other
        add(first, "F"), add(second, "B")
        add(second, "F"), add(first, "B")
    for _ in range(p - r - 1):
        add(second, "B"), add(second, "F"), add(first, "B")
    split = False
    for i in range(r + 1):  # the last backwards: the second half split into I and W
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        add(second, "I" if split else "B")
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        add(first, "I" if split else "B")
    for _ in range(p - r - 1):
        weight(), add(first, "I" if split else "B")
    while deferred:
        weight()
    return order


@dataclass(frozen=True)
class ScheduleSpec:
    """What autoshard knows of one pipeline schedule."""

    name: ScheduleName
    build: Callable[..., Schedule]  # (p, m) for a fixed number of chunks, (p, m, v) for any
    chunks: int | None  # chunks (stages) per rank it runs; None: any number given (interleaved)
    placement: StagePlacement
    splits_backward: bool  # each backward as input (I) and weight (W) gradients (the zero-bubble schedules)
    bubble: str  # the idle fraction it is known for, in p, m and v (F, I and W of equal cost where it splits)
    fraction: Callable[[int, int, int], float]  # that formula, of (p, m, v)


def _one(p: int, m: int, v: int) -> float:
    return (p - 1) / (m + p - 1)


def _v(p: int, m: int, v: int) -> float:
    return (p - 1) / (6 * m + p - 1)


SPECS: dict[ScheduleName, ScheduleSpec] = {spec.name: spec for spec in (
    ScheduleSpec(ScheduleName.GPIPE, gpipe, 1, StagePlacement.LOOP, False, "(p-1)/(m+p-1)", _one),
    ScheduleSpec(ScheduleName.ONE_F_ONE_B, one_f_one_b, 1, StagePlacement.LOOP, False, "(p-1)/(m+p-1)", _one),
    ScheduleSpec(ScheduleName.INTERLEAVED, interleaved_1f1b, None, StagePlacement.LOOP, False, "(p-1)/(v*m+p-1)",
                 lambda p, m, v: (p - 1) / (v * m + p - 1)),
    ScheduleSpec(ScheduleName.ZB_H1, zero_bubble_h1, 1, StagePlacement.LOOP, True, "(p-1)/(3m+p-1)",
                 lambda p, m, v: (p - 1) / (3 * m + p - 1)),
    ScheduleSpec(ScheduleName.ZBV, zero_bubble_v, 2, StagePlacement.V, True, "(p-1)/(6m+p-1)", _v),  # m >= 2p-1
    ScheduleSpec(ScheduleName.DUALPIPEV, dual_pipe_v, 2, StagePlacement.V, True, "(p-1)/(6m+p-1)", _v),
)}


def spec(name: str) -> ScheduleSpec:
    """The record of the schedule called ``name``."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; valid names are {', '.join(map(repr, SCHEDULES))}")
    return SPECS[ScheduleName(name)]


def schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule called ``name`` (one of ``SCHEDULES``) for p ranks, m microbatches and v chunks per rank."""
    found = spec(name)
    if found.chunks is None:
        return found.build(p, m, v)
    if v != found.chunks:
        if found.placement == StagePlacement.V:
            raise ValueError(f"the {name!r} schedule runs {found.chunks} chunks per rank in a V, got v={v}; "
                             f"use chunks={found.chunks}")
        raise ValueError(f"the {name!r} schedule runs one chunk per rank, got v={v}; use v=1, 'interleaved' or "
                         f"'zbv'")
    return found.build(p, m)


def bubble_formula(name: str, p: int, m: int, v: int = 1) -> tuple[str, float]:
    """The idle fraction the schedule ``name`` is known for (F, I and W of equal cost for the zero-bubble ones;
    ZBV's with at least 2p-1 microbatches), as text and value; ``simulate`` gives the same (tests)."""
    found = spec(name)
    return found.bubble, found.fraction(p, m, v)


def _check_sizes(p: int, m: int, v: int) -> None:
    for name, value in (("p", p), ("m", m), ("v", v)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _interleaved_order(r: int, p: int, m: int, v: int, per_round: int) -> list[Action]:
    total = m * v  # chunk forwards (and chunk backwards) on this rank
    warmup = min((v - 1) * per_round + 2 * (p - 1 - r), total)
    next_mb = {("F", c): 0 for c in range(v)} | {("B", c): 0 for c in range(v)}

    def take(kind: str, chunk: int) -> Action:
        microbatch = next_mb[kind, chunk]
        next_mb[kind, chunk] += 1
        return Action(kind, microbatch, chunk * p + r)

    def forward(i: int) -> Action:  # the i-th forward runs chunk 0 for a round, then chunk 1, ...
        return take("F", (i // per_round) % v)

    def backward(i: int) -> Action:  # backwards walk the chunks the other way round
        return take("B", v - 1 - (i // per_round) % v)

    order = [forward(i) for i in range(warmup)]
    for i in range(total - warmup):
        order += [forward(warmup + i), backward(i)]
    return order + [backward(i) for i in range(total - warmup, total)]


def _with_comms(orders: dict[int, list[Action]], p: int, v: int, placement: str = "loop") -> Schedule:
    """Add sends right after their producers and receives, in each channel's send order, before their consumers.
    Neighbouring stages on one rank (the V's tip) hand over without a message."""
    if p == 1:
        return {0: list(orders[0])}
    last = p * v - 1
    sends = {r: [_send_after(a, last, p, placement) for a in orders[r]] for r in orders}
    channels: dict[tuple[int, int], list[Action]] = {}
    for r in orders:
        for send in filter(None, sends[r]):
            channels.setdefault((r, send.peer(p, placement)), []).append(send)
    received = dict.fromkeys(channels, 0)
    result: Schedule = {}
    for r in orders:
        actions: list[Action] = []
        for compute, send in zip(orders[r], sends[r], strict=True):
            needed = _input_send(compute, last, p, placement)
            if needed is not None:
                channel = (needed.rank(p, placement), r)
                queue = channels[channel]
                while needed not in queue[:received[channel]]:
                    actions.append(queue[received[channel]].partner())
                    received[channel] += 1
            actions += [compute] + ([send] if send else [])
        result[r] = actions
    return result


def _send_after(compute: Action, last: int, p: int, placement: str) -> Action | None:
    send = None
    if compute.kind == "F" and compute.stage < last:
        send = Action("SEND_F", compute.microbatch, compute.stage)
    if compute.kind in ("B", "I") and compute.stage > 0:
        send = Action("SEND_B", compute.microbatch, compute.stage)
    return send if send is not None and send.peer(p, placement) != compute.rank(p, placement) else None


def _input_send(compute: Action, last: int, p: int, placement: str) -> Action | None:
    """The send whose data ``compute`` consumes, if it comes from another rank."""
    send = None
    if compute.kind == "F" and compute.stage > 0:
        send = Action("SEND_F", compute.microbatch, compute.stage - 1)
    if compute.kind in ("B", "I") and compute.stage < last:
        send = Action("SEND_B", compute.microbatch, compute.stage + 1)
    return send if send is not None and send.rank(p, placement) != compute.rank(p, placement) else None


# -------------------------------------------------------------------------------------------------- validation


def validate(actions: Schedule, p: int, v: int = 1, placement: str = "loop") -> None:
    """Raise ``ScheduleError`` unless ``actions`` is a complete, correctly ordered, FIFO-safe, deadlock-free
    schedule for p ranks with v chunks each placed by ``placement`` (the number of microbatches is read from the
    actions). Deadlock-free twice over: where sends never block (gloo), and where a send waits for its receive
    (NCCL) with each direction over its own group, as the executor sends them (``one_way``)."""
    where = _check_placement(actions, p, v, placement)
    _check_complete(actions, p, v, where, placement)
    _check_order(actions, p, v, where, placement)
    _check_channels(actions, p, where, placement)
    _execute(actions, p)
    _rendezvous(actions, p, placement)


def _fail(actions: Schedule, p: int, rank: int, step: int, text: str) -> ScheduleError:
    action = actions[rank][step]
    grid = render(actions, p, mark=(rank, step), comms=True)
    return ScheduleError(f"rank {rank}, step {step} ({action}): {text}\n\n{grid}", rank=rank, step=step, action=action)


def _check_placement(actions: Schedule, p: int, v: int, placement: str) -> dict[Action, tuple[int, int]]:
    """Every action is an Action of a stage this rank holds, and appears once; returns action -> (rank, step)."""
    if sorted(actions) != list(range(p)):
        raise ScheduleError(f"the schedule has ranks {sorted(actions)}; expected exactly the ranks 0..{p - 1}")
    for rank, steps in actions.items():
        for step, action in enumerate(steps):
            if not isinstance(action, Action):
                raise ScheduleError(f"rank {rank}, step {step}: {action!r} is not an Action", rank=rank, step=step)
    where: dict[Action, tuple[int, int]] = {}
    for rank, steps in actions.items():
        for step, action in enumerate(steps):
            if action.stage >= p * v or (placement == "v" and v != 2):
                raise _fail(actions, p, rank, step, f"stage {action.stage} does not exist with p={p}, v={v}"
                            + (" (the V placement holds 2 chunks per rank)" if placement == "v" else ""))
            if action.rank(p, placement) != rank:
                raise _fail(actions, p, rank, step, f"stage {action.stage} lives on rank "
                            f"{action.rank(p, placement)}")
            if not action.is_compute and (_off_the_ends(action, p * v) or action.peer(p, placement) == rank):
                raise _fail(actions, p, rank, step, "this message has no other rank to go to or come from")
            if action in where:
                raise _fail(actions, p, rank, step, f"duplicate of step {where[action][1]}")
            where[action] = (rank, step)
    return where


def _off_the_ends(action: Action, stages: int) -> bool:
    return (action.kind in ("SEND_F", "RECV_B") and action.stage == stages - 1) or (
        action.kind in ("RECV_F", "SEND_B") and action.stage == 0)


def _check_complete(actions: Schedule, p: int, v: int, where: dict[Action, tuple[int, int]], placement: str) -> None:
    """Every (microbatch, stage) runs F, and either B or both I and W."""
    m = 1 + max((a.microbatch for a in where), default=-1)
    for stage in range(p * v):
        for j in range(m):
            f, b, i, w = (Action(kind, j, stage) for kind in "FBIW")
            present = [a for a in (b, i, w) if a in where]
            if f in where and b not in where and not (i in where and w in where):
                missing = f"{b}, or {i} and {w}" if not present else " and ".join(str(a) for a in (i, w)
                                                                                   if a not in where)
                raise _fail(actions, p, *where[f], f"microbatch {j} never runs backward on stage {stage} ({missing} "
                            f"missing)")
            if b in where and (i in where or w in where):
                raise _fail(actions, p, *where[b], f"microbatch {j} runs backward twice on stage {stage}: {b} "
                            f"computes what {i} and {w} do")
            if present and f not in where:
                raise _fail(actions, p, *where[present[0]], f"microbatch {j} never runs forward ({f}) on stage "
                            f"{stage}")
            if f not in where:
                rank = stage_rank(stage, p, placement)
                raise ScheduleError(f"rank {rank}: stage {stage} never runs microbatch {j} ({f}, {b} missing); "
                                    f"microbatches 0..{m - 1} appear elsewhere", rank=rank)


def _check_order(actions: Schedule, p: int, v: int, where: dict[Action, tuple[int, int]], placement: str) -> None:
    """Each action runs after what it depends on, on its own rank."""
    last = p * v - 1
    for rank, steps in actions.items():
        for step, action in enumerate(steps):
            for needed in _needs(action, p, last, placement, where):
                if needed not in where:
                    raise _fail(actions, p, rank, step, f"needs {needed}, which is missing from this rank")
                if where[needed][1] > step:
                    later = f"{needed} (step {where[needed][1]})"
                    raise _fail(actions, p, rank, step, f"runs before {later}, which it needs")


def _needs(action: Action, p: int, last: int, placement: str, where) -> list[Action]:
    j, s = action.microbatch, action.stage

    def local(other: int) -> bool:
        return stage_rank(other, p, placement) == stage_rank(s, p, placement)

    def backward(stage: int) -> Action:  # what computes a stage's input gradients
        return Action("I", j, stage) if Action("I", j, stage) in where else Action("B", j, stage)

    if action.kind == "F" and s > 0:
        return [Action("F", j, s - 1) if local(s - 1) else Action("RECV_F", j, s)]
    if action.kind in ("B", "I"):
        before = [backward(s + 1) if local(s + 1) else Action("RECV_B", j, s)] if s < last else []
        return [Action("F", j, s), *before]
    if action.kind == "W":
        return [Action("I", j, s)]
    if action.kind == "SEND_F":
        return [Action("F", j, s)]
    if action.kind == "SEND_B":
        return [backward(s)]
    return []


def _check_channels(actions: Schedule, p: int, where: dict[Action, tuple[int, int]], placement: str) -> None:
    """Every message is received once, and on each channel in the order it was sent (a FIFO per rank pair)."""
    sent: dict[tuple[int, int], list[Action]] = {}
    got: dict[tuple[int, int], list[tuple[int, Action]]] = {}
    for rank, steps in actions.items():
        for step, action in enumerate(steps):
            if action.is_compute:
                continue
            if action.partner() not in where:
                what = "nothing receives it" if action.is_send else "nothing sends it"
                raise _fail(actions, p, rank, step, f"{what}: {action.partner()} is missing on rank "
                            f"{action.peer(p, placement)}")
            if action.is_send:
                sent.setdefault((rank, action.peer(p, placement)), []).append(action)
            else:
                got.setdefault((action.peer(p, placement), rank), []).append((step, action))
    for (src, dst), receives in got.items():
        for i, (step, recv) in enumerate(receives):
            send = sent[src, dst][i]
            if send.partner() != recv:
                raise _fail(actions, p, dst, step, (
                    f"receive #{i} from rank {src} expects {recv.partner()}, but message #{i} rank {src} sends to "
                    f"rank {dst} is {send} (rank {src}, step {where[send][1]}); gloo matches messages between two "
                    f"ranks in send order, so this receive would get the wrong tensor. Receive in send order"))


def _execute(actions: Schedule, p: int) -> list[tuple[int, int]]:
    """One order in which all ranks can run their lists (sends never block, receives wait for their send)."""
    position = dict.fromkeys(actions, 0)
    done: set[Action] = set()
    order: list[tuple[int, int]] = []
    progress = True
    while progress:
        progress = False
        for rank in sorted(actions):
            steps = actions[rank]
            while position[rank] < len(steps):
                action = steps[position[rank]]
                if action.is_recv and action.partner() not in done:
                    break
                done.add(action)
                order.append((rank, position[rank]))
                position[rank] += 1
                progress = True
    blocked = [r for r in sorted(actions) if position[r] < len(actions[r])]
    if blocked:
        waits = "; ".join(f"rank {r} at step {position[r]} ({actions[r][position[r]]}) waits for "
                          f"{actions[r][position[r]].partner()}" for r in blocked)
        raise _fail(actions, p, blocked[0], position[blocked[0]], f"deadlock, no rank can progress: {waits}")
    return order


def one_way(action: Action, p: int, placement: str = "loop") -> bool:
    """Whether ``action``'s message travels from a lower pp rank to a higher one: the executor sends those over
    one process group and the others over a second (``Mesh.create_groups``' ``"pp_back"``), so that between two
    ranks each group carries messages one way only."""
    sender = action.rank(p, placement) if action.is_send else action.peer(p, placement)
    receiver = action.peer(p, placement) if action.is_send else action.rank(p, placement)
    return sender < receiver


def _rendezvous(actions: Schedule, p: int, placement: str = "loop", both_ways: bool = False) -> None:
    """Run every rank's list as NCCL runs it, and raise on a deadlock. Each rank's host posts its sends without
    waiting and waits on each receive it posts; the sends and receives between two ranks over one group run in
    posting order on one stream, and a message moves only when its send and its receive both head their
    streams. With one group (``both_ways``), rank 0 sending an activation while rank 1 sends it a gradient,
    each posted before its receive, wait for each other forever; with a group per direction they cannot."""
    def stream(rank: int, action: Action) -> tuple:
        return rank, action.peer(p, placement), True if both_ways else one_way(action, p, placement)

    position = dict.fromkeys(actions, 0)
    queues: dict[tuple, list[Action]] = {}
    waiting: dict[int, Action] = {}
    progress = True
    while progress:
        progress = False
        for rank, steps in actions.items():
            while rank not in waiting and position[rank] < len(steps):
                action = steps[position[rank]]
                if not action.is_compute:
                    queues.setdefault(stream(rank, action), []).append(action)
                    if action.is_recv:
                        waiting[rank] = action
                position[rank] += 1
                progress = True
        for (rank, peer, way), queue in queues.items():
            other = queues.get((peer, rank, way), [])
            if queue and other and queue[0].partner() == other[0]:
                for owner, done in ((rank, queue.pop(0)), (peer, other.pop(0))):
                    if waiting.get(owner) == done:
                        del waiting[owner]
                progress = True
    blocked = sorted({r for r in actions if position[r] < len(actions[r]) or r in waiting} |
                     {key[0] for key, queue in queues.items() if queue})
    if blocked:
        heads = "; ".join(f"rank {r}'s stream to rank {peer} starts with {q[0]}"
                          for (r, peer, _), q in sorted(queues.items(), key=lambda kv: kv[0][:2]) if q)
        rank = blocked[0]
        step = actions[rank].index(waiting[rank]) if rank in waiting else position[rank] - 1
        raise _fail(actions, p, rank, step, f"deadlock where a send waits for its receive (NCCL): {heads}")


# -------------------------------------------------------------------------------------------------- simulation


@dataclass(frozen=True)
class SimResult:
    """Timing of one step. ``times[r][i]`` is the (start, end) of ``actions[r][i]``; a receive lasts from when its
    rank reaches it until its send has ended. Activations in flight (forward done, backward not yet) are counted
    per rank at their peak: ``peak_in_flight`` in stage-equivalents (a chunk counts 1/v),
    ``peak_in_flight_chunks`` as (microbatch, chunk) pairs."""

    times: dict[int, list[tuple[float, float]]]
    makespan: float
    bubble: float
    peak_in_flight: dict[int, float]
    peak_in_flight_chunks: dict[int, int]


def simulate(actions: Schedule, p: int, v: int = 1, *, forward_cost: float = 1.0, backward_cost: float = 2.0,
             send_cost: float = 0.0, weight_share: float = 0.5, placement: str = "loop") -> SimResult:
    """Time a (validated) schedule: each chunk's F costs ``forward_cost / v`` and B ``backward_cost / v``, of which
    W is ``weight_share`` and I the rest; a send occupies its rank for ``send_cost``; ranks run their lists in
    order. The bubble is the idle fraction ``1 - compute time / (p * makespan)``. Activations count as in flight
    from F until the B or W that frees them."""
    if forward_cost <= 0 or backward_cost <= 0 or send_cost < 0 or not 0 < weight_share < 1:
        raise ValueError(f"costs must be positive (send_cost >= 0, 0 < weight_share < 1), got forward_cost="
                         f"{forward_cost}, backward_cost={backward_cost}, send_cost={send_cost}, weight_share="
                         f"{weight_share}")
    validate(actions, p, v, placement)
    cost = {"F": forward_cost / v, "B": backward_cost / v, "I": backward_cost * (1 - weight_share) / v,
            "W": backward_cost * weight_share / v, "SEND_F": send_cost, "SEND_B": send_cost}
    clock = dict.fromkeys(actions, 0.0)
    times: dict[int, list[tuple[float, float]]] = {r: [(0.0, 0.0)] * len(steps) for r, steps in actions.items()}
    ended: dict[Action, float] = {}
    for rank, step in _execute(actions, p):
        action, start = actions[rank][step], clock[rank]
        end = max(start, ended[action.partner()]) if action.is_recv else start + cost[action.kind]
        times[rank][step] = (start, end)
        ended[action] = clock[rank] = end
    makespan = max(clock.values(), default=0.0)
    compute = sum(cost[a.kind] for steps in actions.values() for a in steps if a.is_compute)
    peaks = {r: _peak_in_flight(steps) for r, steps in actions.items()}
    return SimResult(times=times, makespan=makespan, bubble=1 - compute / (p * makespan) if makespan else 0.0,
                     peak_in_flight={r: n / v for r, n in peaks.items()}, peak_in_flight_chunks=peaks)


def _peak_in_flight(steps: list[Action]) -> int:
    live = peak = 0
    for action in steps:
        live += {"F": 1, "B": -1, "W": -1}.get(action.kind, 0)
        peak = max(peak, live)
    return peak


# ----------------------------------------------------------------------------------------------------- drawing


def render(actions: Schedule, p: int, *, sim: SimResult | None = None, mark: tuple[int, int] | None = None,
           comms: bool = False) -> str:
    """A grid with one row per rank. With ``sim``, one column per time slot (the shortest compute action) and
    ``.`` for idle; without, one column per action in list order (compute only unless ``comms``).

    Cells: ``F3`` / ``B3`` run microbatch 3 forward / backward (``I3`` / ``W3``: its input / weight gradients);
    ``>F3`` / ``<F3`` send / receive its activation,
    ``>B3`` / ``<B3`` its gradient. With v > 1 the stage follows: ``F3.5``. ``mark=(rank, step)`` brackets that
    action's cells and points at its row.
    """
    v = 1 + max((a.stage for steps in actions.values() for a in steps), default=0) // p
    rows = _time_cells(actions, sim) if sim is not None else {
        r: [(i, a) for i, a in enumerate(steps) if comms or a.is_compute] for r, steps in actions.items()}
    texts = {r: [_cell(a, v, (r, i) == mark) for i, a in row] for r, row in rows.items()}
    width = max((len(t) for row in texts.values() for t in row), default=1)
    label = len(str(max(actions, default=0)))
    lines = []
    for r in sorted(texts):
        line = f"rank {r:>{label}}: " + " ".join(t.ljust(width) for t in texts[r])
        if mark is not None and mark[0] == r:
            line += f"  <-- step {mark[1]}: {actions[r][mark[1]]}"
        lines.append(line.rstrip())
    return "\n".join(lines)


def _cell(action: Action | None, v: int, marked: bool) -> str:
    if action is None:
        return "."
    text = f"{_CELL_PREFIX[action.kind]}{action.microbatch}" + (f".{action.stage}" if v > 1 else "")
    return f"[{text}]" if marked else text


def _time_cells(actions: Schedule, sim: SimResult) -> dict[int, list[tuple[int | None, Action | None]]]:
    spans = [(r, i, *sim.times[r][i]) for r, steps in actions.items() for i, a in enumerate(steps) if a.is_compute]
    slot = min((end - start for *_, start, end in spans if end > start), default=1.0)
    rows: dict[int, list[tuple[int | None, Action | None]]] = {
        r: [(None, None)] * round(sim.makespan / slot) for r in actions}
    for r, i, start, end in spans:
        for t in range(round(start / slot), round(end / slot)):
            rows[r][t] = (i, actions[r][i])
    return rows
