"""The kinds of things autoshard chooses between, each declared once, as an enum of its names.

A kind equals its name (``Attention.RING == "ring"``) and prints as it (``f"{kind}"``), so options, plans and
messages written with the names keep working, and a misspelt name is refused where it is turned into a kind.
"""

from __future__ import annotations

import enum


class Kind(str, enum.Enum):
    """An enum whose members are their names as strings (``enum.StrEnum`` on Python >= 3.11)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __repr__(self) -> str:  # as its name: options, plans and actions print as they did with names
        return repr(self.value)

    def __hash__(self) -> int:  # as its name's: a kind and its name are the same key of a dict
        return hash(self.value)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(member.value for member in cls)


class Attention(Kind):
    """How attention over a sequence split on the cp axis runs (``cp_attention``)."""

    GATHER = "gather"  # each rank's queries against the gathered keys and values
    RING = "ring"  # keys and values passed around the ring, a piece at a time
    ALLTOALL = "alltoall"  # the sequence split swapped for a head split and back (Ulysses)


class ScheduleName(Kind):
    """The pipeline schedules (``schedule``); ``autoshard.schedules.SPECS`` records and builds each."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"  # 1F1B over chunks > 1 stages per rank, in a loop
    ZB_H1 = "zb-h1"  # 1F1B with each backward split into input and weight gradients
    ZBV = "zbv"  # two chunks per rank in a V, backward split likewise
    DUALPIPEV = "dualpipev"  # the V, a forward of one chunk paired with a backward of the other


class StagePlacement(Kind):
    """Where the pipeline's stages sit on the pp ranks: in a loop (stage s on rank s mod p) or in a V."""

    LOOP = "loop"
    V = "v"


class ActionKind(Kind):
    """What one action of a pipeline schedule does (``schedules.Action``)."""

    F = "F"  # forward
    B = "B"  # backward, whole
    I = "I"  # noqa: E741 - backward for the input gradients (zero bubble)
    W = "W"  # backward for the weight gradients (zero bubble)
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_compute(self) -> bool:
        return self in (ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W)


class DataParallel(Kind):
    """How the dp (x cp) replicas hold the parameters (``data_parallel``)."""

    DDP = "ddp"  # whole on every replica, gradients all-reduced
    FSDP = "fsdp"  # FSDP2's fully_shard over dp x cp
