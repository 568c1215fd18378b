"""Ring attention over cp ranks computes what ``F.scaled_dot_product_attention`` computes on the whole sequence.

Every rank builds the whole sequence's q, k, v, upstream gradient and mask from one seed, keeps the rows of
its layout (contiguous or load-balanced), runs ``RingAttention`` forward and backward, and returns its
output and gradients; the test puts them back at their global positions and compares them with
single-process SDPA and autograd on the whole sequence.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from autoshard.passes.context_parallel import ContextParallelPlan
from autoshard.passes.ring_attention import RingAttention

TOL = {"rtol": 1e-4, "atol": 1e-5}
B, H, T, D = 2, 4, 16, 8


def _case(causal=True, load_balance=False, mask=None, kv_heads=H, scale=None, seed=0, frozen=False,
          v_dim=D) -> dict:
    return {"causal": causal, "load_balance": load_balance, "mask": mask, "kv_heads": kv_heads, "scale": scale,
            "seed": seed, "frozen": frozen, "v_dim": v_dim}


def _layout(size: int, load_balance: bool) -> list[torch.Tensor]:
    plan = ContextParallelPlan(size, {}, T, load_balance)
    return [plan.positions(r) for r in range(size)]


def _inputs(case: dict) -> dict[str, torch.Tensor | None]:
    """The whole sequence's tensors, the same on every rank."""
    g = torch.Generator().manual_seed(case["seed"])
    q, dout = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, case["v_dim"], generator=g)
    k, v = torch.randn(B, case["kv_heads"], T, D, generator=g), torch.randn(B, case["kv_heads"], T, case["v_dim"],
                                                                            generator=g)
    mask = None
    if case["mask"] == "padding":  # (B, 1, 1, T): the last tokens of each sample are padding
        mask = torch.arange(T)[None, :] < torch.tensor([T - 3, T - 5])[:, None]
        mask = mask[:, None, None, :]
    elif case["mask"] == "bool":  # (B, H, T, T) at random, with a fully masked query row
        mask = torch.rand(B, H, T, T, generator=g) > 0.4
        mask[0, 1, 5] = False
    elif case["mask"] == "float":  # (B, 1, T, T) additive bias
        mask = torch.randn(B, 1, T, T, generator=g)
    elif case["mask"] == "tril":  # (B, 1, T, T) causal, built by the model (HF's), the causal flag off
        mask = torch.ones(T, T, dtype=torch.bool).tril().expand(B, 1, T, T)
    elif case["mask"] == "window":  # (T, T) local attention: keys within 3 positions
        mask = (torch.arange(T)[:, None] - torch.arange(T)[None, :]).abs() < 4
    elif case["mask"] == "documents":  # (B, 1, T, T) packed documents of uneven lengths: attend inside one's own
        doc = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 9 + [1] * 7])
        mask = (doc[:, :, None] == doc[:, None, :])[:, None]
    return {"q": q, "k": k, "v": v, "dout": dout, "mask": mask}


def _reference(case: dict) -> dict[str, torch.Tensor]:
    """Single-process SDPA on the whole sequence, with autograd."""
    x = _inputs(case)
    leaves = {n: x[n].clone().requires_grad_() for n in ("q", "k", "v")}
    mask = x["mask"]
    if mask is not None and mask.is_floating_point() and not case["frozen"]:
        leaves["mask"] = mask = mask.clone().requires_grad_()
    if case["causal"]:
        tril = torch.ones(T, T, dtype=torch.bool).tril()
        if mask is None:
            mask = tril
        else:
            mask = mask & tril if mask.dtype == torch.bool else mask.masked_fill(~tril, float("-inf"))
    out = F.scaled_dot_product_attention(leaves["q"], leaves["k"], leaves["v"], attn_mask=mask, scale=case["scale"],
                                         enable_gqa=case["kv_heads"] != H)
    out.backward(x["dout"])
    return {"out": out.detach(), **{f"d{n}": t.grad for n, t in leaves.items()}}


def _rank_rows(mask: torch.Tensor | None, pos: torch.Tensor) -> torch.Tensor | None:
    return mask if mask is None or mask.shape[-2] == 1 else mask[..., pos, :]


def run_ring_rank(case: dict) -> dict[str, torch.Tensor]:
    """One cp rank: its rows of the sequence through RingAttention, forward and backward."""
    rank, size = dist.get_rank(), dist.get_world_size()
    layout = _layout(size, case["load_balance"])
    pos = layout[rank]
    x = _inputs(case)
    leaves = {n: x[n][..., pos, :].clone().requires_grad_() for n in ("q", "k", "v")}
    mask = _rank_rows(x["mask"], pos)
    if mask is not None and mask.is_floating_point() and not case["frozen"]:
        leaves["mask"] = mask = mask.clone().requires_grad_()
    module = RingAttention(causal=case["causal"], scale=case["scale"], layout=layout, group=dist.group.WORLD,
                           size=size, rank=rank)
    out = module(leaves["q"], leaves["k"], leaves["v"], mask)
    out.backward(x["dout"][..., pos, :])
    return {"pos": pos, "out": out.detach(), **{f"d{n}": t.grad for n, t in leaves.items()}}


def _assemble(results: list[dict], like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every rank's rows put back at their global positions (dim -2)."""
    full = {name: torch.full_like(t, float("nan")) for name, t in like.items()}
    for result in results:
        for name, t in full.items():
            t[..., result["pos"], :] = result[name]
    return full


CASES = {
    "causal-contiguous": _case(),
    "causal-balanced": _case(load_balance=True),
    "full-contiguous": _case(causal=False),
    "full-balanced": _case(causal=False, load_balance=True, seed=1),
    "padding-causal-balanced": _case(mask="padding", load_balance=True, seed=2),
    "float-mask-full": _case(causal=False, mask="float", seed=3),
    "bool-mask-masked-row": _case(causal=False, mask="bool", load_balance=True, seed=4),
    "gqa-causal-balanced-scale": _case(load_balance=True, kv_heads=2, scale=0.3, seed=5),
    "float-mask-causal-balanced": _case(mask="float", load_balance=True, seed=6),
    "float-bias-frozen-causal": _case(mask="float", frozen=True, seed=7),  # the fused kernel's path
    "window-causal-balanced": _case(mask="window", load_balance=True, seed=8),
    "documents-causal": _case(mask="documents", seed=9),
    "documents-causal-balanced": _case(mask="documents", load_balance=True, seed=10),
    "documents-full": _case(causal=False, mask="documents", seed=11),
    "built-causal-balanced": _case(causal=False, mask="tril", load_balance=True, seed=12),
    "built-causal-contiguous": _case(causal=False, mask="tril", seed=13),
    "values-narrower-than-keys": _case(load_balance=True, v_dim=6, seed=14),  # multi-head latent attention's
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_matches_sdpa(pools, cp, name):
    case = CASES[name]
    want = _reference(case)
    got = _assemble(pools.get(cp).run(run_ring_rank, case), want)
    for key, expected in want.items():
        torch.testing.assert_close(got[key], expected, **TOL, msg=lambda m, key=key: f"{key} at cp={cp}: {m}")


@pytest.mark.parametrize("name", list(CASES))
def test_size_one_is_local_sdpa(name):
    case = CASES[name]
    want = _reference(case)
    got = run_ring_local(case)
    for key, expected in want.items():
        torch.testing.assert_close(got[key], expected, **TOL, msg=lambda m, key=key: f"{key}: {m}")


def run_ring_local(case: dict) -> dict[str, torch.Tensor]:
    x = _inputs(case)
    leaves = {n: x[n].clone().requires_grad_() for n in ("q", "k", "v")}
    mask = x["mask"]
    if mask is not None and mask.is_floating_point():
        leaves["mask"] = mask = mask.clone().requires_grad_()
    module = RingAttention(causal=case["causal"], scale=case["scale"], layout=[torch.arange(T)], group=None, size=1,
                           rank=0)
    out = module(leaves["q"], leaves["k"], leaves["v"], mask)
    out.backward(x["dout"])
    return {"out": out.detach(), **{f"d{n}": t.grad for n, t in leaves.items()}}


def test_fully_masked_rows_are_zero_without_nan():
    x = _inputs(_case(causal=False, mask="bool", seed=4))
    mask = x["mask"].clone()
    mask[1] = False  # every row of sample 1
    q = x["q"].clone().requires_grad_()
    module = RingAttention(causal=False, scale=None, layout=[torch.arange(T)], group=None, size=1, rank=0)
    out = module(q, x["k"], x["v"], mask)
    out.sum().backward()
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isfinite(out).all()
    assert torch.equal(q.grad[1], torch.zeros_like(q.grad[1])) and torch.isfinite(q.grad).all()


def _module(size=4, rank=1, group=None) -> RingAttention:
    return RingAttention(causal=True, scale=None, layout=_layout(size, True), group=group, size=size, rank=rank)


def test_without_a_group_it_refuses_to_run():
    x = _inputs(_case())
    pos = _layout(4, True)[1]
    q, k, v = (x[n][..., pos, :] for n in ("q", "k", "v"))
    with pytest.raises(RuntimeError, match="no process group"):
        _module()(q, k, v)


def test_checks_shapes():
    x = _inputs(_case())
    q, k, v = (x[n][..., :4, :] for n in ("q", "k", "v"))
    module = _module()
    with pytest.raises(ValueError, match="holds 4 positions"):
        module(x["q"], x["k"], x["v"])
    with pytest.raises(ValueError, match="query heads are not a multiple"):
        module(q, k[:, :3], v[:, :3])
    with pytest.raises(ValueError, match="must broadcast"):
        module(q, k, v, torch.ones(4, 4, dtype=torch.bool))
    uneven = RingAttention(causal=True, scale=None, layout=[torch.arange(3), torch.arange(3, 8)], group=None, size=2,
                           rank=0)
    assert uneven.most == 5, "ranks holding 3 and 5 tokens: blocks travel padded to 5"


def test_describes_itself_and_counts_its_bytes():
    module = _module()
    assert module.kind == "ring"
    assert "causal=True" in repr(module) and "tokens=4/16" in repr(module) and "size=4, rank=1" in repr(module)
    block = B * H * 4 * D
    assert module.comm_bytes((B, H, 4, D), 2) == (3 * 2 * block * 2, 3 * 2 * block * 2 + 4 * 2 * block * 4)
    assert _module(size=1, rank=0).comm_bytes((B, H, 16, D), 4) == (0, 0)
    clone = copy.deepcopy(module)
    assert clone.layout[1].tolist() == module.layout[1].tolist() and clone is not module


def run_wrong_rank() -> str:
    rank, size = dist.get_rank(), dist.get_world_size()
    module = RingAttention(causal=True, scale=None, layout=_layout(size, False), group=dist.group.WORLD, size=size,
                           rank=size - 1 - rank)
    t = torch.zeros(1, 1, T // size, D)
    try:
        module(t, t, t)
    except RuntimeError as e:
        return str(e)
    return ""


def test_refuses_a_group_it_was_not_built_for(pools):
    messages = pools.get(2).run(run_wrong_rank)
    assert all("was built for rank" in m for m in messages), messages


def test_the_fused_pieces_are_diagonal_full_or_left_out_and_a_mask_that_empties_one_skips_it():
    """The fused kernel's pieces under load balance at cp=2 (rank 0 holds 0-3 and 12-15, rank 1 holds 4-11): each
    pair of runs is causal from the top left (the same positions), full (keys all before), or left out; a piece an
    explicit mask empties (another document's keys) is skipped at run time."""
    from autoshard.passes.ring_attention import _piece_mask

    layout = _layout(2, True)
    zero = RingAttention(causal=True, scale=None, layout=layout, group=None, size=2, rank=0)
    assert zero.blocks(0) == [(slice(0, 4), slice(0, 4), "diagonal"), (slice(4, 8), slice(0, 4), "full"),
                              (slice(4, 8), slice(4, 8), "diagonal")]
    assert zero.blocks(1) == [(slice(4, 8), slice(0, 8), "full")]
    documents = torch.tensor([0] * 8 + [1] * 8)
    mask = (documents[:, None] == documents[None, :])[layout[0]]  # rank 0's rows
    like = torch.zeros(1)
    assert _piece_mask(zero, mask, slice(0, 4), slice(0, 4), 0, "diagonal", like) == (None, True)
    assert _piece_mask(zero, mask, slice(4, 8), slice(0, 4), 0, "full", like) is None, "keys of another document"
    # a causal mask the model built itself, no causal flag: read from the mask, piece by piece
    plain = RingAttention(causal=False, scale=None, layout=layout, group=None, size=2, rank=0)
    built = torch.ones(16, 16, dtype=torch.bool).tril()[layout[0]][None, None]
    assert len(plain.blocks(1)) == 2, "runs x runs: rank 0's two runs against rank 1's one"
    assert _piece_mask(plain, built, slice(0, 4), slice(0, 8), 1, "full", like) is None, "keys after the queries"
    assert _piece_mask(plain, built, slice(4, 8), slice(0, 8), 1, "full", like) == (None, False), "all attended"
    assert _piece_mask(plain, built, slice(4, 8), slice(4, 8), 0, "full", like) == (None, True), "the diagonal"


def test_wholly_masked_parts_of_a_block_are_not_computed():
    """Load balance at cp=2, 16 tokens: rank 0 holds 0-3 and 12-15, rank 1 holds 4-11. Causal attention never
    needs rank 0's first run against rank 1's keys, nor rank 1's queries against rank 0's last run."""
    layout = _layout(2, True)
    zero = RingAttention(causal=True, scale=None, layout=layout, group=None, size=2, rank=0)
    one = RingAttention(causal=True, scale=None, layout=layout, group=None, size=2, rank=1)
    assert zero.pairs(0) == [(slice(0, 4), [slice(0, 4)]), (slice(4, 8), [slice(0, 4), slice(4, 8)])]
    assert zero.pairs(1) == [(slice(4, 8), [slice(0, 8)])]
    assert one.pairs(0) == [(slice(0, 8), [slice(0, 4)])]
    full = RingAttention(causal=False, scale=None, layout=layout, group=None, size=2, rank=0)
    assert full.pairs(1) == [(slice(0, 8), [slice(0, 8)])], "without a causal mask the block is one piece"
