"""Which weights to spread over the pipeline ranks (stored in rows, gathered for each step: ``runtime.spread``).

Every weight read on more than one pp rank (it moves no more bytes than the sum of its copies' gradients did);
then, while the rank holding the most holds more than ``LIMIT`` / pp of the parameters, that rank's largest
weight, as long as spreading it lowers the largest rank's bytes. Chosen when the job is compiled, from the
stages' reads alone.
"""

from __future__ import annotations

LIMIT = 1.2  # the most a pp rank should hold, as a multiple of an even share (0.6 of the model at pp=2)


def choose(holders: dict[str, frozenset[int]], nbytes: dict[str, int], rows: dict[str, int], p: int,
           limit: float = LIMIT, balance: bool = True) -> tuple[str, ...]:
    """The weights to spread over ``p`` pp ranks.

    ``holders``: the pp ranks that read each weight; ``nbytes`` and ``rows``: its bytes and dim-0 size on a rank
    (its tp shard). A weight whose rows ``p`` does not divide stays where it is. ``balance=False`` spreads only the
    weights read on several ranks."""
    eligible = {name for name in holders if rows.get(name, 0) % p == 0 and rows.get(name, 0) >= p}
    spread = {name for name in eligible if len(holders[name]) > 1}
    total = sum(nbytes.values())
    while balance and total:
        current = held_bytes(holders, nbytes, spread, p)
        top = max(range(p), key=lambda r: current[r])
        if current[top] <= limit * total / p:
            break
        candidates = sorted((n for n in eligible - spread if top in holders[n]), key=lambda n: (-nbytes[n], n))
        for name in candidates:
            spread.add(name)
            if max(held_bytes(holders, nbytes, spread, p)) < current[top]:
                break
            spread.discard(name)
        else:
            break
    return tuple(sorted(spread))


def held_bytes(holders: dict[str, frozenset[int]], nbytes: dict[str, int], spread, p: int) -> list[float]:
    """The parameter bytes each pp rank stores: a weight whole on each rank that reads it, or 1/p of it on every
    rank when it is spread."""
    out = [0.0] * p
    for name, ranks in holders.items():
        for r in range(p) if name in spread else ranks:
            out[r] += nbytes[name] / p if name in spread else nbytes[name]
    return out
