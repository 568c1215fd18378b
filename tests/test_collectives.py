"""Tensor-parallel collectives: each forward and its backward twin compute what the unsharded program computes.

Unit tests need no processes (size 1, index math, inspection graphs); distributed tests run 2 or 4 gloo
ranks and compare values and gradients with a single-process reference computed on every rank.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import fx, nn

from autoshard.passes.collectives import (
    COLLECTIVES,
    CopyToParallel,
    GatherFromParallel,
    ReduceFromParallel,
    ScatterToParallel,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    comm_bytes,
    local_indices,
    shard,
    unshard,
)

close = functools.partial(torch.testing.assert_close, rtol=1e-4, atol=1e-5)
LOCAL = {"group": None, "size": 1, "rank": 0}


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


def _world() -> dict:
    return {"group": dist.group.WORLD, "size": dist.get_world_size(), "rank": dist.get_rank()}


def _detached(pairs: dict) -> dict:
    """Results go back through a pickling queue, which refuses tensors that are part of an autograd graph."""
    return {name: tuple(t.detach() for t in pair) for name, pair in pairs.items()}


def _assert_pairs(results: list[dict]) -> None:
    """Every rank returned {name: (parallel, reference)}; each pair must agree."""
    for rank, pairs in enumerate(results):
        for name, (got, expected) in pairs.items():
            close(got, expected, msg=lambda m, rank=rank, name=name: f"rank {rank}, {name}: {m}")


# ---------------------------------------------------------------------------------------------------------------
# Blocked-shard index math


def test_local_indices_take_the_rank_th_part_of_each_block():
    assert local_indices(8, 1, 2).tolist() == [4, 5, 6, 7]
    # fused q, k, v with grouped-query attention: q has 4 columns, k and v 2 each
    assert local_indices(8, 0, 2, (4, 2, 2)).tolist() == [0, 1, 4, 6]
    assert local_indices(8, 1, 2, (4, 2, 2)).tolist() == [2, 3, 5, 7]


@pytest.mark.parametrize("blocks_per_rank", [None, (1,), (2, 1, 1), (3, 3, 3)])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_shard_then_unshard_is_the_identity(size, blocks_per_rank):
    blocks = None if blocks_per_rank is None else tuple(b * size for b in blocks_per_rank)
    n = sum(blocks) if blocks else 2 * size
    x = torch.randn(3, n, 2)
    parts = [shard(x, 1, rank, size, blocks) for rank in range(size)]
    for rank, part in enumerate(parts):
        assert torch.equal(part, x.index_select(1, local_indices(n, rank, size, blocks)))
    every = torch.cat([local_indices(n, rank, size, blocks) for rank in range(size)])
    assert sorted(every.tolist()) == list(range(n)), "the shards partition the dim"
    assert torch.equal(unshard(parts, 1, blocks), x)
    assert torch.equal(unshard(parts[::-1], 1, blocks), x) == (size == 1), "rank order matters"


def test_blocks_that_do_not_divide_by_the_degree_are_refused():
    with pytest.raises(ValueError, match=r"do not divide by the degree 2"):
        local_indices(9, 0, 2, (3, 3, 3))
    with pytest.raises(ValueError, match=r"add up to 7, but the dim has size 8"):
        local_indices(8, 0, 2, (4, 2, 1))
    with pytest.raises(ValueError, match=r"do not divide by the degree 4"):
        GatherFromParallel(group=None, size=4, rank=0, dim=0, blocks=(8, 6, 6))


# ---------------------------------------------------------------------------------------------------------------
# Size 1: exact local computations without a group


@pytest.mark.parametrize("op", [
    CopyToParallel(**LOCAL),
    ReduceFromParallel(**LOCAL),
    GatherFromParallel(**LOCAL, dim=1, blocks=(2, 1, 1)),
    ScatterToParallel(**LOCAL, dim=-1),
], ids=lambda op: type(op).__name__)
def test_at_size_one_the_communicating_ops_are_identities(op):
    x, probe = _leaf(torch.randn(3, 4)), torch.randn(3, 4)
    y = op(x)
    (y * probe).sum().backward()
    assert torch.equal(y, x) and torch.equal(x.grad, probe)


def test_at_size_one_the_vocab_embedding_is_f_embedding():
    weight, ids = _leaf(torch.randn(10, 4)), torch.tensor([[0, 9, 3], [3, 2, 2]])
    reference = _leaf(weight)
    emb = VocabParallelEmbedding(**LOCAL, vocab_start=0, vocab_end=10, padding_idx=2)
    emb(ids, weight).sum().backward()
    F.embedding(ids, reference, padding_idx=2).sum().backward()
    close(weight.grad, reference.grad)
    assert weight.grad[2].abs().sum() == 0, "the padding row gets no gradient"


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_at_size_one_the_cross_entropy_is_f_cross_entropy_with_padding_excluded(reduction, smoothing):
    logits, target = torch.randn(4, 10), torch.tensor([9, -100, 0, 4])
    padded = _leaf(torch.cat([logits, torch.full((4, 2), 30.0)], 1))  # large padding logits must not count
    reference = _leaf(logits)
    ce = VocabParallelCrossEntropy(**LOCAL, vocab_start=0, vocab_end=12, vocab_size=10, reduction=reduction,
                                   label_smoothing=smoothing)
    loss = ce(padded, target)
    expected = F.cross_entropy(reference, target, reduction=reduction, label_smoothing=smoothing)
    probe = torch.randn(loss.shape)
    (loss * probe).sum().backward()
    (expected * probe).sum().backward()
    close(loss, expected)
    close(padded.grad, torch.cat([reference.grad, torch.zeros(4, 2)], 1))


# ---------------------------------------------------------------------------------------------------------------
# Graphs built for inspection


def test_an_inspection_graph_prints_counts_and_refuses_to_run():
    gm = _inspection_graph()
    assert "self.tp_copy(x)" in gm.code and "self.tp_reduce(" in gm.code
    assert "CopyToParallel(size=2)" in str(gm)
    assert "GatherFromParallel(dim=-1, blocks=(4, 2, 2), size=2, rank=1)" in str(gm)
    kinds = [(m.kind, m.backward_kind) for m in gm.modules() if isinstance(m, COLLECTIVES)]
    assert kinds == [("identity", "all_reduce"), ("all_reduce", "identity"), ("all_gather", "split")]
    shapes = {"tp_copy": (3, 8), "tp_reduce": (3, 8), "tp_gather": (3, 4)}
    moved = [comm_bytes(gm.get_submodule(name), shape, 4) for name, shape in shapes.items()]
    assert moved == [(0, 96), (96, 0), (96, 0)]
    assert copy.deepcopy(gm).tp_gather.blocks == (4, 2, 2)
    with pytest.raises(RuntimeError, match=r"CopyToParallel\(size=2\): this graph was built for inspection"):
        gm(torch.randn(3, 8))


def _inspection_graph() -> fx.GraphModule:
    root = nn.Module()
    root.tp_copy = CopyToParallel(group=None, size=2, rank=1)
    root.tp_reduce = ReduceFromParallel(group=None, size=2, rank=1)
    root.tp_gather = GatherFromParallel(group=None, size=2, rank=1, dim=-1, blocks=(4, 2, 2))
    graph = fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_module("tp_copy", (x,))
    y = graph.call_module("tp_reduce", (y,))
    graph.output(graph.call_module("tp_gather", (y,)))
    return fx.GraphModule(root, graph)


def test_comm_bytes_of_the_vocab_ops():
    ce = VocabParallelCrossEntropy(group=None, size=2, rank=0, vocab_start=0, vocab_end=8, vocab_size=16)
    assert comm_bytes(ce, (5, 8), 2) == (5 * 4 * 3, 0), "a max and two stacked sums per row, in fp32"
    emb = VocabParallelEmbedding(group=None, size=2, rank=0, vocab_start=0, vocab_end=8)
    assert comm_bytes(emb, (5,), 4) == (0, 0)
    assert comm_bytes(ScatterToParallel(**LOCAL, dim=0), (5,), 4) == (0, 0), "size 1 moves nothing"


def test_every_communicating_op_refuses_to_run_without_a_group():
    ops = [
        CopyToParallel(group=None, size=2, rank=0),
        ScatterToParallel(group=None, size=2, rank=0, dim=0),
        VocabParallelCrossEntropy(group=None, size=2, rank=0, vocab_start=0, vocab_end=2, vocab_size=4),
    ]
    inputs = [(torch.ones(2),), (torch.ones(2),), (torch.ones(3, 2), torch.zeros(3, dtype=torch.long))]
    for op, args in zip(ops, inputs, strict=True):
        with pytest.raises(RuntimeError, match="built for inspection"):
            op(*args)


# ---------------------------------------------------------------------------------------------------------------
# Distributed: f -> column-parallel linear -> row-parallel linear -> g, with a replicated residual


def _two_layers(x, w1, b1, w2, b2):
    return x + F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def _tensor_parallel_mlp(torch_all_reduce_as_g: bool = False) -> dict:
    tp = _world()
    size, rank = tp["size"], tp["rank"]
    torch.manual_seed(0)
    x, w1, b1, w2, b2, probe = (torch.randn(s) for s in [(3, 8), (16, 8), (16,), (8, 16), (8,), (3, 8)])
    ref = [_leaf(t) for t in (x, w1, b1, w2, b2)]
    expected = _two_layers(*ref)
    (expected * probe).sum().backward()

    xs, b2s = _leaf(x), _leaf(b2)
    w1s, b1s, w2s = _leaf(shard(w1, 0, rank, size)), _leaf(shard(b1, 0, rank, size)), _leaf(shard(w2, 1, rank, size))
    hidden = F.gelu(F.linear(CopyToParallel(**tp)(xs), w1s, b1s))  # (3, 16 / size)
    partial = F.linear(hidden, w2s)  # (3, 8), a summand of the full product
    if torch_all_reduce_as_g:
        from torch.distributed.nn.functional import all_reduce

        reduced = all_reduce(partial)
    else:
        reduced = ReduceFromParallel(**tp)(partial)
    y = xs + reduced + b2s  # the residual reads x itself, not the copy
    (y * probe).sum().backward()
    return _detached({
        "output": (y, expected),
        "input grad": (xs.grad, ref[0].grad),
        "w1 grad": (w1s.grad, shard(ref[1].grad, 0, rank, size)),
        "b1 grad": (b1s.grad, shard(ref[2].grad, 0, rank, size)),
        "w2 grad": (w2s.grad, shard(ref[3].grad, 1, rank, size)),
        "b2 grad": (b2s.grad, ref[4].grad),
    })


@pytest.mark.parametrize("world", [2, 4])
def test_column_then_row_parallel_layers_match_the_full_layers(pools, world):
    _assert_pairs(pools.get(world).run(_tensor_parallel_mlp))


def test_an_all_reduce_that_reduces_again_in_backward_is_caught(pools):
    results = pools.get(2).run(_tensor_parallel_mlp, torch_all_reduce_as_g=True)
    got, expected = results[0]["w1 grad"]
    close(got, 2 * expected)  # the twin of g must be the identity; an all-reduce multiplies by the degree
    with pytest.raises(AssertionError):
        _assert_pairs(results)


def _wrong_rank() -> str:
    tp = _world()
    op = CopyToParallel(group=tp["group"], size=tp["size"], rank=(tp["rank"] + 1) % tp["size"])
    try:
        op(torch.ones(1))
    except RuntimeError as e:
        return str(e)
    return "ran"


def test_a_module_built_for_another_rank_refuses_to_run(pools):
    for message in pools.get(2).run(_wrong_rank):
        assert "was built for rank" in message


def _deep_copy_shares_the_group() -> bool:
    op = ReduceFromParallel(**_world())
    return copy.deepcopy(op).group is op.group  # a process group cannot be copied, only shared


def test_a_deep_copy_shares_the_process_group(pools):
    assert pools.get(2).run(_deep_copy_shares_the_group) == [True, True]


# ---------------------------------------------------------------------------------------------------------------
# Distributed: scatter and gather of blocked shards


def _scatter_scale_gather(blocks_per_rank: tuple[int, ...] | None, dim: int) -> dict:
    tp = _world()
    size, rank = tp["size"], tp["rank"]
    blocks = None if blocks_per_rank is None else tuple(b * size for b in blocks_per_rank)
    n = sum(blocks) if blocks else 2 * size
    torch.manual_seed(1)
    x, probe = torch.randn(3, n, 2), torch.randn(3, n, 2)
    owner = torch.empty(n)  # the rank that holds each index, plus one: a per-rank computation to undo
    for r in range(size):
        owner[local_indices(n, r, size, blocks)] = r + 1.0
    reference = _leaf(x)
    expected = reference * owner[:, None]
    (expected * probe).sum().backward()

    xs = _leaf(x)
    local = ScatterToParallel(**tp, dim=dim, blocks=blocks)(xs)
    y = GatherFromParallel(**tp, dim=dim, blocks=blocks)(local * (rank + 1.0))
    (y * probe).sum().backward()
    return _detached({
        "local shard": (local, x.index_select(1, local_indices(n, rank, size, blocks))),
        "output": (y, expected),
        "input grad": (xs.grad, reference.grad),
    })


@pytest.mark.parametrize("world,blocks_per_rank,dim", [
    (2, None, 1), (2, (2, 1, 1), 1), (2, (3, 3, 3), -2), (4, (2, 1, 1), 1),
])
def test_scatter_then_gather_of_blocked_shards_round_trips_with_gradients(pools, world, blocks_per_rank, dim):
    _assert_pairs(pools.get(world).run(_scatter_scale_gather, blocks_per_rank, dim))


# ---------------------------------------------------------------------------------------------------------------
# Distributed: vocab-parallel embedding and cross-entropy, with the vocab padded to divide the degree


def _vocab_range(padded: int) -> dict:
    size, rank = dist.get_world_size(), dist.get_rank()
    return {"vocab_start": rank * padded // size, "vocab_end": (rank + 1) * padded // size}


def _pad_last(t: torch.Tensor, padded: int, value: float = 0.0) -> torch.Tensor:
    """``t`` with its last dim padded to ``padded`` entries of ``value``."""
    return F.pad(t, (0, padded - t.shape[-1]), value=value)


def _vocab_parallel_embedding(vocab: int, padded: int) -> dict:
    tp, span = _world(), _vocab_range(padded)
    torch.manual_seed(2)
    weight, probe = torch.randn(vocab, 4), torch.randn(2, 5, 4)
    ids = torch.tensor([[0, vocab - 1, 3, 3, 1], [vocab // 2, 2, vocab - 1, 0, 0]])
    reference = _leaf(weight)
    expected = F.embedding(ids, reference, padding_idx=1)
    (expected * probe).sum().backward()

    local = _leaf(_pad_last(weight.T, padded).T[span["vocab_start"]: span["vocab_end"]])
    partial = VocabParallelEmbedding(**tp, **span, padding_idx=1)(ids, local)
    out = ReduceFromParallel(**tp)(partial)
    (out * probe).sum().backward()
    return _detached({"output": (out, expected), "weight grad": (local.grad, reference.grad)})


@pytest.mark.parametrize("world,vocab,padded", [(2, 10, 10), (4, 10, 12)])
def test_vocab_parallel_embedding_matches_f_embedding(pools, world, vocab, padded):
    results = pools.get(world).run(_vocab_parallel_embedding, vocab, padded)
    _assert_pairs([{"output": r["output"]} for r in results])
    gathered = torch.cat([r["weight grad"][0] for r in results])  # (padded, 4)
    close(gathered, _pad_last(results[0]["weight grad"][1].T, padded).T)


def _targets(shape: tuple[int, ...], vocab: int, ignore_index: int) -> torch.Tensor:
    """Targets that hit both ends of the vocab, with ignored ones bunched unevenly at the front."""
    target = torch.randint(0, vocab, shape)
    flat = target.view(-1)
    flat[[0, 1, 2, 3, 5, -4]] = ignore_index
    flat[[4, -1]] = torch.tensor([0, vocab - 1])
    return target


def _vocab_parallel_cross_entropy(vocab: int, padded: int, shape: tuple[int, ...], reduction: str,
                                  smoothing: float, ignore_index: int) -> dict:
    tp, span = _world(), _vocab_range(padded)
    torch.manual_seed(3)
    logits, target = 3 * torch.randn(*shape, vocab), _targets(shape, vocab, ignore_index)
    reference = _leaf(logits)
    expected = F.cross_entropy(reference.reshape(-1, vocab), target.reshape(-1), ignore_index=ignore_index,
                               reduction=reduction, label_smoothing=smoothing)
    expected = expected.reshape(shape) if reduction == "none" else expected
    probe = torch.randn(expected.shape)
    (expected * probe).sum().backward()

    # Large padding logits would dominate the softmax if they were counted.
    local = _leaf(_pad_last(logits, padded, value=40.0)[..., span["vocab_start"]: span["vocab_end"]])
    ce = VocabParallelCrossEntropy(**tp, **span, vocab_size=vocab, ignore_index=ignore_index, reduction=reduction,
                                   label_smoothing=smoothing)
    loss = ce(local, target)
    (loss * probe).sum().backward()
    ref_grad = _pad_last(reference.grad, padded)[..., span["vocab_start"]: span["vocab_end"]]
    return _detached({"loss": (loss, expected), "logits grad": (local.grad, ref_grad)})


CROSS_ENTROPY_CASES = [
    # (world, vocab, padded vocab, shape of the target, reduction, label smoothing, ignore_index)
    (2, 16, 16, (12,), "mean", 0.0, -100),
    (2, 16, 16, (3, 4), "sum", 0.0, -100),
    (2, 16, 16, (12,), "none", 0.0, -100),
    (2, 16, 16, (12,), "mean", 0.0, 3),
    (2, 16, 16, (3, 4), "mean", 0.1, -100),
    (4, 10, 12, (12,), "mean", 0.0, -100),
    (4, 10, 12, (3, 4), "sum", 0.0, -100),
    (4, 10, 12, (12,), "none", 0.0, -100),
    (4, 10, 12, (3, 4), "none", 0.1, -100),
    (4, 6, 8, (12,), "mean", 0.1, -100),  # rank 3 holds only padding
]


@pytest.mark.parametrize("world,vocab,padded,shape,reduction,smoothing,ignore_index", CROSS_ENTROPY_CASES)
def test_vocab_parallel_cross_entropy_matches_f_cross_entropy(pools, world, vocab, padded, shape, reduction,
                                                              smoothing, ignore_index):
    results = pools.get(world).run(_vocab_parallel_cross_entropy, vocab, padded, shape, reduction, smoothing,
                                   ignore_index)
    _assert_pairs(results)
