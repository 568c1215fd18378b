"""Rules for views, reshapes, slicing, joining and element-wise ops against the global ops.

Each case shards an input as given, lets the rule decide, runs every rank's local rewrite with the
collectives simulated in process (``rules_sim``), and compares forward and backward with the unsharded
op, over negative dims, dim lists, ``-1`` sizes, blocked shards, broadcasting and dtypes. The last tests
check that every op of the rule table and every localizer has cases here or in the other
``test_rules_*`` files.
"""

from __future__ import annotations

import pytest
import torch

from autoshard.passes.axis import Axis
from autoshard.passes.placements import R, Shard
from autoshard.passes.tensor_parallel import tensor_axis

from harness.rules_sim import simulate

aten = torch.ops.aten
BIG = 9223372036854775807  # what export writes for an open slice end


def rand(*shape, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


x3 = rand(2, 4, 6)
QKV = Shard(1, (4, 4, 4))  # a fused projection's columns: every rank holds its part of each block
GQA = Shard(1, (8, 3, 3), (1, 2))  # a fused q, k, v whose k and v (3 wide: kv heads 2 ranks do not divide) are whole

VIEW_CASES = [  # (op, args, kwargs, shard, output placement)
    (aten.transpose.int, (x3, 1, 2), {}, {0: Shard(1)}, Shard(2)),
    (aten.transpose.int, (x3, -1, 0), {}, {0: Shard(0)}, Shard(2)),
    (aten.swapaxes.default, (x3, 0, -2), {}, {0: Shard(1)}, Shard(0)),
    (aten.t.default, (rand(4, 6),), {}, {0: Shard(0)}, Shard(1)),
    (aten.permute.default, (x3, [2, 0, 1]), {}, {0: Shard(1)}, Shard(2)),
    (aten.permute.default, (x3, [-1, -3, -2]), {}, {0: Shard(2)}, Shard(0)),
    (aten.movedim.int, (x3, 1, -1), {}, {0: Shard(1)}, Shard(2)),
    (aten.movedim.int, (x3, -1, 0), {}, {0: Shard(0)}, Shard(1)),
    (aten.unsqueeze.default, (rand(2, 4), 0), {}, {0: Shard(1)}, Shard(2)),
    (aten.unsqueeze.default, (rand(2, 4), -1), {}, {0: Shard(1)}, Shard(1)),
    (aten.unsqueeze.default, (rand(2, 4), -3), {}, {0: Shard(0)}, Shard(1)),
    (aten.squeeze.dim, (rand(2, 1, 4), 1), {}, {0: Shard(2)}, Shard(1)),
    (aten.squeeze.dim, (rand(2, 1, 4), -2), {}, {0: Shard(0)}, Shard(0)),
    (aten.squeeze.dims, (rand(1, 4, 1, 6), [0, -2]), {}, {0: Shard(3)}, Shard(1)),
    (aten.squeeze.default, (rand(1, 4, 1, 6),), {}, {0: Shard(3)}, Shard(1)),
    (aten.view.default, (x3, [2, 4, 2, 3]), {}, {0: Shard(2)}, Shard(2)),
    (aten.reshape_as.default, (x3, rand(2, 4, 2, 3)), {}, {0: Shard(2)}, Shard(2)),
    (aten.reshape_as.default, (x3, rand(2, 4, 2, 3)), {}, {0: Shard(2), 1: Shard(1)}, Shard(2)),  # shape only
    (aten.reshape_as.default, (rand(2, 4, 2, 3), x3), {}, {1: Shard(1)}, R),
    # x.view_as(x), as autograd hands back an input a custom Function returns (the second a copy: one tensor twice is
    # one input to the simulator)
    (aten.view_as.default, (x3, x3.clone()), {}, {0: Shard(2), 1: Shard(2)}, Shard(2)),
    (aten.view_as.default, (x3, rand(2, 4, 2, 3)), {}, {0: Shard(2), 1: Shard(1)}, Shard(2)),  # shape only
    (aten.view_as.default, (rand(4, 12), rand(4, 12, seed=1)), {}, {0: QKV, 1: QKV}, QKV),
    (aten.view_as.default, (rand(2, 4, 2, 3), x3), {}, {1: Shard(1)}, R),
    (aten.view.default, (x3, [2, 4, -1, 3]), {}, {0: Shard(2)}, Shard(2)),
    (aten.view.default, (rand(2, 4, 2, 3), [2, 4, 6]), {}, {0: Shard(2)}, Shard(2)),
    (aten.reshape.default, (x3, [8, 6]), {}, {0: Shard(1)}, Shard(0, (4, 4))),
    (aten.reshape.default, (x3, [-1, 6]), {}, {0: Shard(0)}, Shard(0)),
    (aten._unsafe_view.default, (x3, [2, 24]), {}, {0: Shard(1)}, Shard(1)),
    (aten.reshape.default, (rand(2, 12), [2, 3, 4]), {}, {0: Shard(1, (4, 4, 4))}, Shard(2)),
    (aten.expand.default, (rand(2, 1, 6), [2, 3, 6]), {}, {0: Shard(2)}, Shard(2)),
    (aten.expand.default, (rand(2, 1, 6), [-1, 3, -1]), {}, {0: Shard(0)}, Shard(0)),
    (aten.expand.default, (rand(4, 6), [2, 4, 6]), {}, {0: Shard(1)}, Shard(2)),
    (aten.slice.Tensor, (rand(4, 6), 0, 1, 3), {}, {0: Shard(1)}, Shard(1)),
    (aten.slice.Tensor, (rand(4, 6), 1, 0, 3), {}, {0: Shard(1)}, R),
    (aten.slice.Tensor, (rand(4, 6), 1, 0, BIG), {}, {0: Shard(1)}, Shard(1)),
    (aten.slice.Tensor, (rand(4, 6), -1, None, None), {}, {0: Shard(1)}, Shard(1)),
    (aten.slice.Tensor, (rand(4, 6), 1, -6, BIG), {}, {0: Shard(1)}, Shard(1)),  # x[:, -n:] of a dim of n
    (aten.slice.Tensor, (rand(4, 6), 1, 0, None, 2), {}, {0: Shard(1)}, R),
    (aten.slice.Tensor, (rand(4, 6),), {"dim": 1, "start": 2}, {0: Shard(1)}, R),
    # whole blocks of a fused projection (phi3's qkv[..., :q], qkv[..., q:q + k], qkv[..., q + k:])
    (aten.slice.Tensor, (rand(4, 12), 1, 4, 8), {}, {0: QKV}, Shard(1)),
    (aten.slice.Tensor, (rand(4, 12), -1, -4, BIG), {}, {0: QKV}, Shard(1)),
    (aten.slice.Tensor, (rand(4, 12), 1, None, 8), {}, {0: QKV}, Shard(1, (4, 4))),
    (aten.slice.Tensor, (rand(4, 12), 1, 2, 8), {}, {0: QKV}, R),  # not on a block's edge
    # the same with k and v held whole on every rank: q is split, k and v replicated, and the rest gathered
    (aten.slice.Tensor, (rand(4, 14), 1, 0, 8), {}, {0: GQA}, Shard(1)),
    (aten.slice.Tensor, (rand(4, 14), -1, 8, 11), {}, {0: GQA}, R),
    (aten.slice.Tensor, (rand(4, 14), 1, 8, BIG), {}, {0: GQA}, R),
    (aten.slice.Tensor, (rand(4, 14), 1, 0, 11), {}, {0: GQA}, Shard(1, (8, 3), (1,))),
    (aten.slice.Tensor, (rand(4, 14), 1, 2, 8), {}, {0: GQA}, R),
    (aten.split_with_sizes.default, (rand(4, 14), [8, 3, 3], -1), {}, {0: GQA}, (Shard(1), R, R)),
    (aten.split_with_sizes.default, (rand(4, 14), [8, 6], 1), {}, {0: GQA}, (Shard(1), R)),
    (aten.split.Tensor, (rand(4, 14), 7, 1), {}, {0: GQA}, (R, R)),
    (aten.add.Tensor, (rand(4, 14), rand(14, seed=1)), {}, {0: GQA, 1: Shard(0, (8, 3, 3), (1, 2))}, GQA),
    (aten.add.Tensor, (rand(4, 14), rand(14, seed=1)), {}, {0: GQA}, GQA),
    (aten.mul.Tensor, (rand(4, 14), 2.0), {}, {0: GQA}, R),  # no rule for whole blocks but the fused path's
    (aten.gelu.default, (rand(4, 14),), {}, {0: GQA}, R),
    (aten.numpy_T.default, (rand(4, 6),), {}, {0: Shard(1)}, Shard(0)),
    # Llama 4's rotary as complex numbers: pairs of reals in and out, heads split
    (aten.view_as_complex.default, (rand(2, 4, 3, 2),), {}, {0: Shard(1)}, Shard(1)),
    (aten.view_as_complex.default, (rand(2, 4, 2),), {}, {0: Shard(2)}, R),
    (aten.view_as_real.default, (torch.randn(2, 4, 3, dtype=torch.complex64),), {}, {0: Shard(1)}, Shard(1)),
    # the trailing dims padded (a chunked linear attention's sequence), heads split
    (aten.pad.default, (x3, [0, 2]), {}, {0: Shard(1)}, Shard(1)),
    (aten.pad.default, (x3, [0, 0, 1, 1]), {}, {0: Shard(1)}, R),
    (aten.constant_pad_nd.default, (x3, [1, 0], 0.5), {}, {0: Shard(0)}, Shard(0)),
    (aten.cumsum.default, (x3, -1), {}, {0: Shard(1)}, Shard(1)),
    (aten.cumsum.default, (x3, 1), {}, {0: Shard(1)}, R),
    (aten.cumprod.default, (x3, 0), {}, {0: Shard(2)}, Shard(2)),
    (aten.tril.default, (x3,), {}, {0: Shard(0)}, Shard(0)),
    (aten.triu.default, (x3, 1), {}, {0: Shard(1)}, R),
    # gpt-oss's interleaved [gate0, up0, gate1, up1, ...]: x[..., ::2] and x[..., 1::2] of each rank's part
    (aten.slice.Tensor, (rand(4, 8), 1, 0, BIG, 2), {}, {0: Shard(1)}, Shard(1)),
    (aten.slice.Tensor, (rand(4, 8), -1, 1, BIG, 2), {}, {0: Shard(1)}, Shard(1)),
    (aten.slice.Tensor, (rand(4, 12), 1, 0, BIG, 4), {}, {0: Shard(1)}, R),  # a part of 6 is not whole steps of 4
    (aten.select.int, (x3, 0, 1), {}, {0: Shard(2)}, Shard(1)),
    (aten.select.int, (x3, -1, 2), {}, {0: Shard(2)}, R),
    (aten.select.int, (x3, 2, -1), {}, {0: Shard(1)}, Shard(1)),
    (aten.narrow.default, (rand(4, 6), 0, 1, 2), {}, {0: Shard(1)}, Shard(1)),
    (aten.narrow.default, (rand(4, 6), -1, 1, 2), {}, {0: Shard(1)}, R),
    (aten.split.Tensor, (rand(4, 12), 3, 1), {}, {0: Shard(0)}, (Shard(0),) * 4),
    (aten.split.Tensor, (rand(4, 12), 4, -1), {}, {0: QKV}, (Shard(1),) * 3),
    (aten.split.Tensor, (rand(4, 12), 4, 1), {}, {0: Shard(1)}, (R,) * 3),
    (aten.split_with_sizes.default, (rand(4, 12), [8, 4], 1), {}, {0: Shard(1, (8, 4))}, (Shard(1),) * 2),
    # pieces of whole blocks (Mamba2's z, x B C, dt; torch's packed in_proj as q and k v): each keeps its blocks
    (aten.split_with_sizes.default, (rand(4, 12), [2, 8, 2], 1), {}, {0: Shard(1, (2, 4, 4, 2))},
     (Shard(1), Shard(1, (4, 4)), Shard(1))),
    (aten.split_with_sizes.default, (rand(4, 12), [6, 6], 1), {}, {0: Shard(1, (4, 4, 4))}, (R, R)),
    (aten.split_with_sizes.default, (rand(4, 12), [1, 3]), {}, {0: Shard(1)}, (Shard(1),) * 2),
    (aten.chunk.default, (rand(4, 12), 3, -1), {}, {0: QKV}, (Shard(1),) * 3),
    (aten.chunk.default, (rand(4, 12), 2, 1), {}, {0: Shard(0)}, (Shard(0),) * 2),
    # a scan's inputs cut along the sequence into the part scanned at once and the part stepped (none): channels split
    (aten.tensor_split.indices, (x3, [6], 2), {}, {0: Shard(1)}, (Shard(1),) * 2),
    (aten.tensor_split.indices, (x3, [1, 3], -1), {}, {0: Shard(0)}, (Shard(0),) * 3),
    (aten.tensor_split.indices, (x3, [2], 1), {}, {0: Shard(1)}, (R, R)),
    (aten.tensor_split.sections, (rand(4, 12), 3, 1), {}, {0: QKV}, (Shard(1),) * 3),
    (aten.tensor_split.indices, (rand(4, 12), [4, 8], -1), {}, {0: QKV}, (Shard(1),) * 3),
    (aten.tensor_split.indices, (rand(4, 12), [4], 1), {}, {0: QKV}, (Shard(1), Shard(1, (4, 4)))),
    (aten.tensor_split.indices, (rand(4, 12), [6], 1), {}, {0: QKV}, (R, R)),  # not on a block's edge
    (aten.tensor_split.sections, (rand(4, 12), 2), {}, {0: Shard(1)}, (Shard(1),) * 2),
    (aten.unbind.int, (rand(3, 4, 6), 0), {}, {0: Shard(2)}, (Shard(1),) * 3),
    # a fresh tensor of the size given: its input lends a dtype and device only (a scan's unused initial state)
    (aten.new_zeros.default, (x3, [2, 4, 6]), {}, {0: Shard(1)}, R),
    (aten.new_ones.default, (x3, [3]), {"dtype": torch.float64}, {0: Shard(2)}, R),
    (aten.new_empty.default, (x3, [0, 4]), {}, {0: Shard(1)}, R),
    (aten.new_full.default, (x3, [2, 2], 1.5), {}, {0: Shard(0)}, R),
    (aten.unbind.int, (rand(3, 4, 6), -1), {}, {0: Shard(1)}, (Shard(1),) * 6),
    (aten.unbind.int, (rand(4, 6),), {}, {0: Shard(0)}, (R,) * 4),
    (aten.cat.default, ([rand(4, 2), rand(4, 6, seed=1)], 1), {}, {0: Shard(0), 1: Shard(0)}, Shard(0)),
    (aten.cat.default, ([rand(4, 2), rand(4, 6, seed=1)], -1), {}, {0: Shard(0)}, Shard(0)),
    (aten.cat.default, ([rand(2, 4), rand(6, 4, seed=1)],), {}, {0: Shard(1)}, Shard(1)),
    # joined along their split dim: each rank holds its part of each, a blocked shard
    (aten.cat.default, ([rand(4, 2), rand(6, 2, seed=1)], 0), {}, {0: Shard(0), 1: Shard(0)}, Shard(0, (4, 6))),
    (aten.cat.default, ([rand(4, 2), rand(6, 2, seed=1)], 0), {}, {0: Shard(0)}, R),
    # an empty 1-D start (a key/value cache before its first update) takes no part, whatever its placement
    (aten.cat.default, ([torch.zeros(0), rand(2, 4, 6, seed=1)], 2), {}, {1: Shard(1)}, Shard(1)),
    # an empty cache joined along the split sequence (XLM's): the split, unchanged
    (aten.cat.default, ([torch.zeros(2, 0, 6), rand(2, 4, 6, seed=1)], 1), {}, {1: Shard(1)}, Shard(1)),
    # x[mask] = value, one value for every masked element: element-wise
    (aten.index_put.default, (x3, [rand(2, 4, 6, seed=3) > 0], torch.tensor(0.5)), {}, {0: Shard(1), 1: Shard(1)},
     Shard(1)),
    (aten.index_put.default, (x3, [rand(2, 4, 6, seed=3) > 0], torch.tensor(0.5)), {}, {0: Shard(2)}, Shard(2)),
    (aten.index_put.default, (x3, [rand(2, 4, 6, seed=3) > 0], rand(1)), {}, {1: Shard(1)}, R),
    (aten.index_put.default, (x3, [torch.tensor([1, 0])], rand(4, 6)), {}, {0: Shard(1)}, R),  # rows: replicated
    (aten.unflatten.int, (x3, -1, [2, 3]), {}, {0: Shard(2)}, Shard(2)),
    (aten.unflatten.int, (rand(4, 12), 1, [3, 4]), {}, {0: QKV}, Shard(2)),  # torch's packed in_proj as (3, width)
    (aten.unflatten.int, (rand(4, 12), 0, [2, 2]), {}, {0: Shard(1)}, Shard(2)),
    (aten.flatten.using_ints, (rand(2, 4, 3), 1, 2), {}, {0: Shard(1)}, Shard(1)),
    (aten.flatten.using_ints, (rand(2, 4, 3), -2), {}, {0: Shard(0)}, Shard(0)),
    # (tokens, batch, width) -> (tokens, batch * heads, head dim): heads split, every batch row holds its heads
    (aten.view.default, (rand(3, 2, 8), [3, 8, 2]), {}, {0: Shard(2)}, Shard(1, (4, 4))),
    (aten.view.default, (rand(3, 2, 6), [3, 6, 2]), {}, {0: Shard(2)}, R),  # 3 heads over 2 ranks
    # rows of (batch, tokens, heads) with heads split, back to (batch, tokens, features) (a linear attention's output)
    (aten.reshape.default, (rand(12, 4), [2, 3, 8]), {}, {0: Shard(0, (2,) * 6)}, Shard(2)),
    (aten.reshape.default, (rand(12, 4), [2, 3, 2, 4]), {}, {0: Shard(0, (2,) * 6)}, Shard(2)),
    (aten.reshape.default, (rand(24, 4), [2, 3, 16]), {}, {0: Shard(0, (4,) * 6)}, Shard(2)),
    (aten.stack.default, ([rand(2, 4), rand(2, 4, seed=1)], -1), {}, {0: Shard(1), 1: Shard(1)}, Shard(1)),
    (aten.stack.default, ([rand(2, 4), rand(2, 4, seed=1)],), {}, {0: Shard(1)}, Shard(2)),
    (aten.stack.default, ([rand(2, 4), rand(2, 4, seed=1)], 1), {}, {0: Shard(0), 1: Shard(1)}, R),
    (aten.repeat_interleave.self_int, (rand(2, 4, 3), 2, 1), {}, {0: Shard(1)}, Shard(1)),
    (aten.repeat_interleave.self_int, (rand(2, 4, 3), 2, 1), {"output_size": 8}, {0: Shard(1)}, Shard(1)),
    (aten.repeat_interleave.self_int, (rand(2, 4, 3), 2, -3), {}, {0: Shard(1)}, Shard(1)),
    (aten.repeat_interleave.self_int, (rand(2, 4, 3), 2), {}, {0: Shard(1)}, R),
    (aten.repeat.default, (rand(2, 4, 3), [1, 2, 1]), {}, {0: Shard(1)}, Shard(1, (4, 4))),  # heads tiled twice
    (aten.repeat.default, (rand(2, 4, 3), [3, 1, 2]), {}, {0: Shard(1)}, Shard(1)),
    (aten.repeat.default, (rand(2, 4, 3), [2, 1, 3, 1]), {}, {0: Shard(1)}, Shard(2, (4, 4, 4))),  # a dim prepended
    (aten.repeat.default, (rand(2, 4, 3), [1, 2, 1]), {}, {0: Shard(1, (2, 2))}, Shard(1, (2, 2, 2, 2))),
    (aten.index.Tensor, (rand(5, 4), [torch.tensor([3, 0, 3, 1])]), {}, {0: Shard(1)}, Shard(1)),  # tokens picked
    (aten.index.Tensor, (rand(5, 3, 4), [torch.tensor([[3, 0], [1, 1]])]), {}, {0: Shard(2)}, Shard(3)),
    (aten.index.Tensor, (rand(5, 3, 4), [torch.tensor([3, 0]), torch.tensor([2, 1])]), {}, {0: Shard(2)},
     Shard(1)),
    (aten.index.Tensor, (rand(6, 4), [torch.tensor([3, 0])]), {}, {0: Shard(0)}, R),  # a table split by rows:
    (aten.index.Tensor, (rand(6, 4, 2), [torch.tensor([3, 0])]), {}, {0: Shard(0)}, R),  # vocab-parallel; else whole
    (aten.index_add.default, (rand(5, 4), 0, torch.tensor([3, 0, 3]), rand(3, 4, seed=1)), {}, {2: Shard(1)},
     Shard(1)),  # experts' rows added back at their tokens
    (aten.index_add.default, (rand(5, 4), 0, torch.tensor([3, 0, 3]), rand(3, 4, seed=1)), {}, {0: Shard(1)},
     Shard(1)),
    (aten.index_add.default, (rand(4, 6), 1, torch.tensor([3, 0, 3]), rand(4, 3, seed=1)), {}, {2: Shard(1)}, R),
    # torchtitan's combine: a split operand replicates (a pending sum of both stays pending: test_rules_layers.py)
    (aten.scatter_add.default, (rand(5, 4), 0, torch.tensor([[3], [0], [3]]).expand(-1, 4), rand(3, 4, seed=1)), {},
     {2: Shard(1)}, R),
    (aten.scatter_add.default, (rand(5, 4), 0, torch.tensor([[3], [0], [3]]).expand(-1, 4), rand(3, 4, seed=1)), {},
     {0: Shard(1)}, R),
    (aten.index_select.default, (rand(4, 6, 5), 2, torch.tensor([0, 3, 1])), {}, {0: Shard(1)}, Shard(1)),
    (aten.index_select.default, (rand(4, 6, 5), -1, torch.tensor([0, 3, 1])), {}, {0: Shard(2)}, R),
]


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("op,args,kwargs,shard,placement", VIEW_CASES, ids=lambda v: str(v) if callable(v) else None)
def test_views_and_slices(op, args, kwargs, shard, placement, size):
    tensors = [t for t in torch.utils._pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]
    if size == 4 and any(_blocks_of(tensors[i], p) % 4 for i, p in shard.items()):
        pytest.skip("4 ranks cannot split this block evenly (the rule refuses such splits); covered at 2 ranks")
    out = simulate(op, args, kwargs, shard=shard, size=size)
    assert out.placement == placement
    out.assert_exact()


def _blocks_of(t: torch.Tensor, p: Shard) -> int:
    import math

    return math.gcd(*(b for i, b in enumerate(p.blocks or (t.shape[p.dim],)) if i not in p.whole))


# ------------------------------------------------------------------------------------------ element-wise

pos = rand(2, 4, 6).abs() + 0.5
y6 = rand(6, seed=1)  # broadcast along the last dim
yb = rand(2, 1, 6, seed=2)  # broadcast along the split dim
mask = rand(2, 4, 6, seed=3) > 0
POINTWISE_CASES = [  # (op, args, kwargs, shard): the output keeps the input's split
    (aten.add.Tensor, (x3, y6), {"alpha": 2}, {0: Shard(1)}),
    (aten.add.Tensor, (yb, x3), {}, {1: Shard(1)}),
    (aten.add.Scalar, (x3, 3.0), {}, {0: Shard(2)}),
    (aten.sub.Tensor, (x3, yb), {"alpha": -1.5}, {0: Shard(1)}),
    (aten.rsub.Scalar, (x3, 2.0), {}, {0: Shard(1)}),
    (aten.rsub.Tensor, (x3, x3 * 2), {}, {0: Shard(1), 1: Shard(1)}),
    (aten.mul.Tensor, (x3, rand(4, 1, seed=5)), {}, {0: Shard(1)}),
    (aten.mul.Tensor, (x3, rand(4, 1, seed=5)), {}, {1: Shard(0)}),
    (aten.div.Tensor, (x3, pos), {}, {0: Shard(2), 1: Shard(2)}),
    (aten.div.Tensor_mode, (x3, pos), {"rounding_mode": "floor"}, {0: Shard(0)}),
    (aten.pow.Tensor_Scalar, (x3, 3), {}, {0: Shard(1)}),
    (aten.pow.Tensor_Tensor, (pos, x3), {}, {0: Shard(1)}),
    (aten.pow.Scalar, (2.0, x3), {}, {0: Shard(1)}),
    (aten.maximum.default, (x3, yb), {}, {0: Shard(2)}),
    (aten.minimum.default, (x3, y6), {}, {1: Shard(0)}),
    (aten.where.self, (mask, x3, yb), {}, {0: Shard(1)}),
    (aten.where.self, (mask, x3, y6), {}, {1: Shard(2)}),
    (aten.where.ScalarOther, (mask, x3, 0.5), {}, {1: Shard(0)}),
    (aten.masked_fill.Scalar, (x3, mask, -1.0), {}, {0: Shard(1)}),
    (aten.masked_fill.Scalar, (x3, rand(4, 1, seed=4) > 0, -1.0), {}, {1: Shard(0)}),
    (aten.clamp.default, (x3, -0.5, 0.5), {}, {0: Shard(1)}),
    (aten.clamp.Tensor, (x3, y6 - 1, y6 + 1), {}, {0: Shard(2)}),
    (aten.eq.Tensor, (x3, x3.round()), {}, {0: Shard(1)}),
    (aten.ne.Scalar, (x3, 0.0), {}, {0: Shard(1)}),
    (aten.lt.Tensor, (x3, y6), {}, {0: Shard(2)}),
    (aten.le.Scalar, (x3, 0.1), {}, {0: Shard(1)}),
    (aten.gt.Tensor, (x3, yb), {}, {0: Shard(1)}),
    (aten.ge.Scalar, (x3, -0.1), {}, {0: Shard(1)}),
    (aten.__and__.Tensor, (mask, ~mask), {}, {0: Shard(1)}),
    (aten.__or__.Tensor, (mask, rand(6, seed=9) > 0), {}, {0: Shard(2)}),
    (aten.logical_not.default, (mask,), {}, {0: Shard(1)}),
    (aten.bitwise_not.default, (mask,), {}, {0: Shard(1)}),
    (aten.to.dtype, (x3, torch.float64), {}, {0: Shard(1)}),
    (aten._to_copy.default, (x3,), {"dtype": torch.float64}, {0: Shard(1)}),
    (aten.type_as.default, (x3, rand(3, seed=6).double()), {}, {0: Shard(1)}),
    (aten.contiguous.default, (x3,), {}, {0: Shard(1)}),
    (aten.clone.default, (x3,), {}, {0: Shard(1)}),
    (aten.alias.default, (x3,), {}, {0: Shard(1)}),
    (aten.detach.default, (x3,), {}, {0: Shard(1)}),
    (aten.lift_fresh_copy.default, (x3,), {}, {0: Shard(1)}),
    (aten.dropout.default, (x3, 0.0, True), {}, {0: Shard(1)}),
    (aten.dropout.default, (x3, 0.5, False), {}, {0: Shard(1)}),
    (aten.native_dropout.default, (x3, 0.0, True), {}, {0: Shard(1)}),
    (aten.fill.Scalar, (x3, 2.0), {}, {0: Shard(1)}),
    (aten.zeros_like.default, (x3,), {}, {0: Shard(1)}),
    (aten.ones_like.default, (x3,), {"dtype": torch.float64}, {0: Shard(1)}),
    (aten.full_like.default, (x3, 3.0), {}, {0: Shard(1)}),
    (aten.neg.default, (x3,), {}, {0: Shard(1)}),
    (aten.rsqrt.default, (pos,), {}, {0: Shard(1)}),
    (aten.sqrt.default, (pos,), {}, {0: Shard(1)}),
    (aten.exp.default, (x3,), {}, {0: Shard(1)}),
    (aten.log.default, (pos,), {}, {0: Shard(1)}),
    (aten.tanh.default, (x3,), {}, {0: Shard(1)}),
    (aten.sigmoid.default, (x3,), {}, {0: Shard(1)}),
    (aten.gelu.default, (x3,), {"approximate": "tanh"}, {0: Shard(1)}),
    (aten.gelu.default, (x3,), {}, {0: Shard(2)}),
    (aten.round.default, (x3 * 4,), {}, {0: Shard(1)}),
    (aten.ceil.default, (x3 * 4,), {}, {0: Shard(2)}),
    (aten.trunc.default, (x3 * 4,), {}, {0: Shard(0)}),
    (aten.frac.default, (x3 * 4,), {}, {0: Shard(1)}),
    (aten.silu.default, (x3,), {}, {0: Shard(1)}),
    (aten.relu.default, (x3,), {}, {0: Shard(1)}),
    (aten.cos.default, (x3,), {}, {0: Shard(1)}),
    (aten.sin.default, (x3,), {}, {0: Shard(1)}),
    (aten.erf.default, (x3,), {}, {0: Shard(1)}),
    (aten.abs.default, (x3,), {}, {0: Shard(1)}),
    (aten.reciprocal.default, (pos,), {}, {0: Shard(1)}),
    (aten.square.default, (x3,), {}, {0: Shard(1)}),
    (aten.hardtanh.default, (x3, -0.5, 0.5), {}, {0: Shard(1)}),
    (aten.leaky_relu.default, (x3, 0.2), {}, {0: Shard(1)}),
    (aten.elu.default, (x3, 0.5), {}, {0: Shard(1)}),
    (aten.softplus.default, (x3, 2.0, 1.0), {}, {0: Shard(1)}),
    (aten.mish.default, (x3,), {}, {0: Shard(1)}),
    (aten.expm1.default, (x3,), {}, {0: Shard(1)}),
    (aten.log1p.default, (pos,), {}, {0: Shard(1)}),
    (aten.sign.default, (x3,), {}, {0: Shard(1)}),
    (aten.floor.default, (x3,), {}, {0: Shard(1)}),
    (aten.clamp_min.default, (x3, -0.2), {}, {0: Shard(1)}),
    (aten.clamp_max.Tensor, (x3, yb), {}, {0: Shard(2)}),
    (aten.min.other, (x3, yb), {}, {0: Shard(2)}),  # xIELU's min(x, eps)
    (aten.max.other, (x3, y6), {}, {0: Shard(1)}),
    (aten.logical_and.default, (mask, ~mask), {}, {0: Shard(1)}),
    (aten.logical_or.default, (mask, rand(6, seed=9) > 0), {}, {0: Shard(2)}),
    (aten.lerp.Scalar, (x3, yb, 0.3), {}, {0: Shard(1)}),
    (aten.addcmul.default, (x3, yb, y6), {"value": 0.5}, {0: Shard(2)}),
    (aten.expand_as.default, (rand(2, 1, 6), x3), {}, {1: Shard(1)}),  # XLM's mask expanded to the split scores
]

# in place: the written tensor a frozen parameter (autograd refuses writes into a leaf that needs a gradient)
IN_PLACE_CASES = [  # (op, args, kwargs, shard, output placement)
    (aten.add_.Tensor, (x3, y6), {}, {0: Shard(1)}, Shard(1)),
    (aten.sub_.Tensor, (x3, x3 * 2), {"alpha": 2}, {0: Shard(2), 1: Shard(2)}, Shard(2)),
    (aten.mul_.Tensor, (x3, yb), {}, {0: Shard(2)}, Shard(2)),
    (aten.div_.Scalar, (x3, 4.0), {}, {0: Shard(0)}, Shard(0)),
    (aten.masked_fill_.Scalar, (x3, mask, -1.0), {}, {0: Shard(1)}, Shard(1)),
    (aten.index_put_.default, (x3, [mask], torch.tensor(-1.0)), {}, {0: Shard(1)}, Shard(1)),
    (aten.copy_.default, (x3, yb), {}, {0: Shard(2)}, Shard(2)),
    (aten.scatter_add_.default, (rand(4, 6), 1, torch.tensor([[1, 5], [0, 0], [5, 2], [2, 3]]), rand(4, 2, seed=1)),
     {}, {0: Shard(0), 1: Shard(0), 2: Shard(0)}, Shard(0)),
    # the written tensor whole, the other split: splitting it would write into a copy that the model's state
    # (here a parameter) never sees, so the split operand is gathered instead
    (aten.add_.Tensor, (x3, x3 * 2), {}, {1: Shard(1)}, R),
]


@pytest.mark.parametrize("op,args,kwargs,shard,placement", IN_PLACE_CASES,
                         ids=lambda v: str(v) if callable(v) else None)
def test_element_wise_in_place(op, args, kwargs, shard, placement):
    out = simulate(op, args, kwargs, shard=shard, frozen=(0,))
    assert out.placement == placement, (out.placement, out.reason)
    out.assert_exact()


@pytest.mark.parametrize("op,args,kwargs,shard", POINTWISE_CASES, ids=lambda v: str(v) if callable(v) else None)
def test_element_wise(op, args, kwargs, shard):
    out = simulate(op, args, kwargs, shard=shard)
    placement = out.placement[0] if isinstance(out.placement, tuple) else out.placement
    assert isinstance(placement, Shard), out.placement
    out.assert_exact()


def test_two_inputs_split_on_different_dims_are_gathered():
    out = simulate(aten.add.Tensor, (x3, x3 * 2), shard={0: Shard(1), 1: Shard(2)})
    assert out.placement == R
    out.assert_exact()


def test_a_metadata_check_passes_any_placement():
    """Export checks a value's dtype after ``x.to(torch.float32)`` (a norm computed in fp32, inside attention with
    QK-norm): the check reads no data, so a split value passes it without a gather."""
    from torch import fx

    from autoshard.passes.propagate import cost, propagate

    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(2, 4, 6)
    check = graph.call_function(aten._assert_tensor_metadata.default, (x,), {"dtype": torch.float32})
    check.meta["val"] = None
    graph.output(x)
    prop = propagate(fx.GraphModule(torch.nn.Module(), graph), {"x": Shard(2)}, tensor_axis(2))
    assert prop.decisions[check].want == {} and not prop.decisions[check].fallback
    assert cost(prop, {check}) == (0, 0, [])


# ------------------------------------------------------------------------------ every rule has its cases


def _covered() -> set:
    import test_rules_embedding_loss as loss
    import test_rules_layers as layers

    ops = {case[0] for case in VIEW_CASES + POINTWISE_CASES + IN_PLACE_CASES}
    for table in (layers.LINEAR_CASES, layers.NORM_CASES, layers.SOFTMAX_CASES, layers.REDUCE_CASES,
                  layers.MATMUL_CASES, layers.PER_SAMPLE_CASES, layers.CONV_CASES):
        ops |= {case.values[0] for case in table}
    ops |= {aten.scaled_dot_product_attention.default, aten.embedding.default, aten.cross_entropy_loss.default,
            aten._assert_tensor_metadata.default,  # test_a_metadata_check_passes_any_placement
            aten.topk.default,  # dp's only: test_topk_keeps_each_rows_k_where_the_batch_is_split
            aten.empty_like.default}  # its values are none: test_empty_like_keeps_the_split_of_its_input
    from autoshard.functions import KEPT_OP  # a Function kept whole: golden at every axis in test_functions.py
    from autoshard.passes.context_parallel import split_sequence

    assert loss.CE_CASES and layers.ATTENTION_CASES
    # split_sequence is cp's only: golden through real collectives in test_context_parallel (the patch ViT)
    return ops | {op.overloadpacket for op in ops} | {split_sequence, KEPT_OP}


def test_empty_like_keeps_the_split_of_its_input():
    out = simulate(aten.empty_like.default, (x3,), {}, shard={0: Shard(1)})
    assert out.placement == Shard(1)


def test_every_op_of_the_rule_table_has_differential_cases():
    from autoshard.passes.rules import RULES

    ops = {op for op in RULES if not isinstance(op, type)}  # classes: the collectives, tested below
    missing = sorted(str(op) for op in ops - _covered())
    assert not missing, f"ops of the rule table without a differential test: {missing}"


def test_every_localizer_has_differential_cases():
    from autoshard.passes.rules import LOCALIZERS

    missing = sorted(str(op) for op in set(LOCALIZERS) - _covered())
    assert not missing, f"localizers without a differential test: {missing}"


@pytest.mark.parametrize("name", ["CopyToParallel", "ReduceFromParallel", "GatherFromParallel", "ScatterToParallel",
                                  "VocabParallelEmbedding", "VocabParallelCrossEntropy"])
def test_a_collective_seen_by_another_axis_passes_the_token_split_through(name):
    """On a second axis (tokens split for cp or dp) a tp collective of the first keeps the split."""
    from torch import fx, nn

    from autoshard.passes import collectives
    from autoshard.passes.rules import Context, decide

    common = {"group": None, "size": 2, "rank": 0}
    extra = {"GatherFromParallel": {"dim": 2}, "ScatterToParallel": {"dim": 2},
             "VocabParallelEmbedding": {"vocab_start": 0, "vocab_end": 5},
             "VocabParallelCrossEntropy": {"vocab_start": 0, "vocab_end": 5, "vocab_size": 10, "reduction": "none"}}
    root, graph = nn.Module(), fx.Graph()
    root.add_module("op", getattr(collectives, name)(**common, **extra.get(name, {})))
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(2, 4, 6, device="meta")
    args = (x,)
    if name == "VocabParallelCrossEntropy":
        t = graph.placeholder("t")
        t.meta["val"] = torch.empty(2, 4, dtype=torch.long, device="meta")
        args = (x, t)
    node = graph.call_module("op", args)
    node.meta["val"] = torch.empty(2, 4, 6, device="meta")  # as the pass copies it from the value it replaces
    graph.output(node)
    fx.GraphModule(root, graph)
    decision = decide(node, Context(Axis("tp", 2), {x: Shard(1)}))
    assert decision.out == Shard(1), decision
