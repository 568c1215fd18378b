"""Batches: cutting the global batch into each data-parallel rank's slice and into microbatches.

The *global batch* is what ``step()`` receives; a dp rank's *local batch* is its slice along dim 0;
the local batch is cut into equal *microbatches*. Tensors whose dim 0 is not the batch (and
non-tensors) are given whole to every slice.
"""

from __future__ import annotations

import torch


def batch_size(values: tuple) -> int | None:
    sizes = [v.shape[0] for v in values if isinstance(v, torch.Tensor) and v.dim() > 0]
    return sizes[0] if sizes else None


def split(values: tuple, parts: int) -> list[tuple]:
    """Cut every batch-shaped tensor of ``values`` into ``parts`` along dim 0; others are shared."""
    if parts == 1:
        return [values]
    batch = batch_size(values)
    chunks = [v.chunk(parts) if _is_batched(v, batch) else [v] * parts for v in values]
    return [tuple(c[i] for c in chunks) for i in range(parts)]


def check(batch: int | None, *, microbatches: int, dp: int, local: bool) -> None:
    """Raise a ValueError saying what works when the batch cannot be cut evenly."""
    ranks = 1 if local else dp
    parts = microbatches * ranks
    if batch is None or batch % parts == 0:
        return
    what = "local batch" if local else "global batch"
    valid = [m for m in range(1, batch + 1) if batch % (m * ranks) == 0]
    if valid:
        fix = f"with this batch use microbatches in {valid}"
        fix += "" if local else f" or a global batch divisible by {parts}"
    else:  # the dp ranks cannot share this batch equally, whatever the number of microbatches
        fewer = f" (or by {dp} with fewer microbatches)" if parts != dp else ""
        fix = (f"no number of microbatches helps, as {batch} does not split over dp={dp} ranks: use a global batch "
               f"divisible by {parts}{fewer}, or pass local_batch=True and give each rank its own batch")
    raise ValueError(
        f"a {what} of {batch} cannot be cut into {microbatches} microbatches"
        + ("" if local or dp == 1 else f" on each of dp={dp} ranks")
        + f": the batch must be divisible by {parts}; {fix}"
    )


def _is_batched(value, batch: int | None) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch
