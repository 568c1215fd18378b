"""Placements: how a value is laid out over the ranks of one mesh axis.

- ``Replicate()``: every rank holds the whole value.
- ``Shard(dim)``: rank r holds the r-th of ``size`` equal contiguous chunks along tensor dim ``dim``.
  A *blocked* shard ``Shard(dim, blocks=(48, 48, 48))`` splits the dim into consecutive blocks first
  (fused q, k, v) and gives rank r the r-th chunk of every block, concatenated: each rank then holds
  whole heads of q, of k and of v. Some blocks may be held ``whole`` by every rank instead
  (``Shard(2, blocks=(64, 32, 32), whole=(1, 2))``: the k and v of a fused projection whose kv heads the
  degree does not divide, duplicated as grouped-query attention reads them): rank r then holds the r-th chunk
  of the other blocks and all of these, in block order.
- ``Partial()``: every rank holds a summand; the value is the sum over ranks (a row-parallel matmul).

A dim that the degree does not divide (a vocabulary of 50257 over 2 ranks) is padded up to a multiple:
every rank holds ceil(n/size) entries and the last one's tail is padding, masked out where it matters
(the vocab-parallel embedding never looks it up, the cross-entropy excludes it, a gather drops it).

Placements are plain frozen data, printed as ``R``, ``S(2)``, ``S(2, blocks=(48, 48, 48))``,
``S(2, blocks=(64, 32, 32), whole=(1, 2))``, ``P``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Replicate:
    def __repr__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard:
    dim: int
    blocks: tuple[int, ...] | None = None
    whole: tuple[int, ...] = ()  # indices of ``blocks`` every rank holds whole

    def __repr__(self) -> str:
        if self.blocks is None:
            return f"S({self.dim})"
        whole = f", whole={self.whole}" if self.whole else ""
        return f"S({self.dim}, blocks={self.blocks}{whole})"

    def at(self, dim: int) -> Shard:
        """The same split (its blocks, the blocks held whole) along another dim: a view or permute moved it."""
        return replace(self, dim=dim)


@dataclass(frozen=True)
class Partial:
    def __repr__(self) -> str:
        return "P"


Placement = Replicate | Shard | Partial

R = Replicate()
P = Partial()


def local_shape(shape: tuple[int, ...], placement: Placement, size: int) -> tuple[int, ...]:
    """The shape one rank holds of a value of global ``shape``."""
    if not isinstance(placement, Shard):
        return tuple(shape)
    out = list(shape)
    if placement.whole:
        out[placement.dim] = sum(b if i in placement.whole else b // size for i, b in enumerate(placement.blocks))
    else:
        out[placement.dim] = -(-out[placement.dim] // size)  # a dim the degree does not divide is padded up
    return tuple(out)


def to_json(placement: Placement) -> str:
    return repr(placement)


def from_json(text: str) -> Placement:
    """Parse what ``repr`` printed: ``R``, ``P``, ``S(0)``, ``S(0, blocks=(48, 24, 24))``,
    ``S(0, blocks=(64, 32, 32), whole=(1, 2))``."""
    text = text.strip()
    if text == "R":
        return R
    if text == "P":
        return P
    if text.startswith("S(") and text.endswith(")"):
        inner = text[2:-1]
        if ", blocks=" in inner:
            dim, blocks = inner.split(", blocks=")
            blocks, _, whole = blocks.partition(", whole=")
            return Shard(int(dim), _ints(blocks), _ints(whole))
        return Shard(int(inner))
    raise ValueError(f"not a placement: {text!r} (expected R, P, S(dim) or S(dim, blocks=(...)))")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(b) for b in text.strip("()").split(",") if b.strip())
