"""The vocab-parallel embedding and cross-entropy against the global ops, over every argument models use.

Each case runs the op's local rewrite on every rank with the collectives simulated in process
(``rules_sim``) and compares forward and backward with the unsharded op. A rewrite that cannot carry an
argument must refuse (the op runs replicated, with a warning naming the op, the argument and the
model's line), never ignore it; the last tests show that dropping ``padding_idx``, ``ignore_index`` or
``label_smoothing`` would be caught.
"""

from __future__ import annotations

import pytest
import torch

from autoshard.passes import localize
from autoshard.passes.collectives import VocabParallelCrossEntropy, VocabParallelEmbedding
from autoshard.passes.placements import P, R, Shard

from harness.rules_sim import simulate

aten = torch.ops.aten
VOCAB = 10  # over 4 ranks: padded to 12, the last rank holds one real row and two padding rows


def _ids(*shape, pad: int | None = None, seed: int = 0) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))
    if pad is not None:  # the padding id appears, and so do the ids around it
        ids.view(-1)[:3] = torch.tensor([pad, pad, (pad + 1) % VOCAB])
    return ids


def _weight(vocab: int = VOCAB, hidden: int = 6) -> torch.Tensor:
    return torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(1))


# ------------------------------------------------------------------------------------------- embedding


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("padding_idx", [-1, 0, 3, 5, 9])
@pytest.mark.parametrize("shape", [(7,), (2, 5), (2, 3, 4)], ids=["1d", "2d", "3d"])
def test_vocab_parallel_embedding_carries_padding_idx(size, padding_idx, shape):
    pad = None if padding_idx == -1 else padding_idx
    out = simulate(aten.embedding.default, (_weight(), _ids(*shape, pad=pad), padding_idx), shard={0: Shard(0)},
                   size=size)
    assert out.modules == ["VocabParallelEmbedding", "ReduceFromParallel"], out.modules
    out.assert_exact()


def test_the_padding_row_gets_no_gradient_on_the_rank_that_holds_it():
    out = simulate(aten.embedding.default, (_weight(), _ids(2, 5, pad=7), 7), shard={0: Shard(0)}, size=2)
    for grads in out.grads:
        assert grads["p0"][7].abs().max() == 0
    assert out.expected_grads["p0"][7].abs().max() == 0


def test_keyword_arguments_are_the_same_case_as_positional_ones():
    out = simulate(aten.embedding.default, (_weight(), _ids(2, 5, pad=4)), {"padding_idx": 4}, shard={0: Shard(0)})
    assert out.modules[0] == "VocabParallelEmbedding"
    out.assert_exact()


def test_token_split_embedding_keeps_the_split():
    out = simulate(aten.embedding.default, (_weight(), _ids(2, 6, pad=2), 2), shard={1: Shard(1)}, size=2)
    assert out.placement == Shard(1)
    out.assert_exact()


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("padding_idx", [-1, 3])
def test_a_table_split_by_columns_looks_up_its_columns_of_every_row(size, padding_idx):
    """A relative position table (buckets x heads) with the heads split: each rank's lookup is its heads' bias."""
    out = simulate(aten.embedding.default, (_weight(hidden=6), _ids(2, 5), padding_idx), shard={0: Shard(1)},
                   size=size)
    assert out.placement == Shard(2)
    out.assert_exact()


@pytest.mark.parametrize("argument,args", [("scale_grad_by_freq", (-1, True)), ("sparse", (-1, False, True))])
def test_embedding_arguments_the_lookup_cannot_carry_are_refused_with_a_warning(argument, args):
    out = simulate(aten.embedding.default, (_weight(), _ids(2, 5), *args), shard={0: Shard(0)}, size=2)
    assert not any(m.startswith("Vocab") for m in out.modules), out.modules
    assert out.reason is not None and argument in out.reason
    warning = out.fallbacks[0]
    assert "aten.embedding.default" in warning and argument in warning and "/home/user/model.py" in warning, warning
    if argument == "sparse":  # run replicated, its sparse gradient comes back dense through the gather (same values)
        out.expected_grads = {n: g.to_dense() for n, g in out.expected_grads.items()}
        out.grads = [{n: g.to_dense() for n, g in grads.items()} for grads in out.grads]
    out.assert_exact()


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 1, 500, -1, -7])
def test_an_id_outside_the_vocabulary_raises_like_f_embedding_before_any_collective(bad):
    ids = _ids(2, 5)
    ids[1, 2] = bad
    with pytest.raises(IndexError, match="index out of range in self"):
        torch.nn.functional.embedding(ids, _weight())
    out = simulate(aten.embedding.default, (_weight(), ids), shard={0: Shard(0)}, size=4)
    for error in out.errors:
        assert isinstance(error, IndexError), out.errors
        assert str(error).startswith("index out of range in self") and f"token id {bad}" in str(error)
        assert f"vocabulary of {VOCAB}" in str(error)
    assert out.collectives_before_error == [0, 0, 0, 0]


# ---------------------------------------------------------------------------------------------- the loss


def _logits(rows: int = 9, vocab: int = VOCAB, seed: int = 2) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def _target(rows: int = 9, ignore: int | None = None, seed: int = 3) -> torch.Tensor:
    t = torch.randint(0, VOCAB, (rows,), generator=torch.Generator().manual_seed(seed))
    if ignore is not None:
        t[::3] = ignore  # ignored tokens spread over the rows
    return t


CE_CASES = [
    pytest.param(1, -100, 0.0, None, id="mean"),
    pytest.param(2, -100, 0.0, -100, id="sum-ignore-100"),
    pytest.param(0, -100, 0.0, -100, id="none-ignore-100"),
    pytest.param(1, 7, 0.0, 7, id="mean-ignore7"),
    pytest.param(1, -1, 0.0, -1, id="mean-ignore-1"),
    pytest.param(0, 0, 0.0, 0, id="none-ignore0"),
    pytest.param(1, -100, 0.1, None, id="mean-smooth0.1"),
    pytest.param(2, 7, 0.25, 7, id="sum-ignore7-smooth0.25"),
    pytest.param(0, -1, 0.1, -1, id="none-ignore-1-smooth0.1"),
    pytest.param(1, 9, 1.0, 9, id="mean-ignore9-smooth1"),
]


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("reduction,ignore_index,smoothing,ignored", CE_CASES)
def test_vocab_parallel_cross_entropy_carries_every_argument(size, reduction, ignore_index, smoothing, ignored):
    args = (_logits(), _target(ignore=ignored), None, reduction, ignore_index, smoothing)
    out = simulate(aten.cross_entropy_loss.default, args, shard={0: Shard(1)}, size=size)
    assert out.modules == ["VocabParallelCrossEntropy"], out.modules
    out.assert_exact()


def test_cross_entropy_keywords_are_read_by_name():
    kwargs = {"ignore_index": 7, "label_smoothing": 0.2, "reduction": 2}
    out = simulate(aten.cross_entropy_loss.default, (_logits(), _target(ignore=7)), kwargs, shard={0: Shard(1)})
    assert out.modules == ["VocabParallelCrossEntropy"]
    out.assert_exact()


def test_every_target_ignored_gives_nan_as_the_mean_does():
    out = simulate(aten.cross_entropy_loss.default, (_logits(), torch.full((9,), 7), None, 1, 7),
                   shard={0: Shard(1)})
    assert out.expected[0].isnan()
    out.assert_exact()


@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_class_dim_not_last_is_moved_for_the_vocab_parallel_loss(reduction):
    logits = torch.randn(2, VOCAB, 5, generator=torch.Generator().manual_seed(4))  # (N, C, L)
    target = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(5))
    target[0, 1] = 7
    out = simulate(aten.cross_entropy_loss.default, (logits, target, None, reduction, 7, 0.1), shard={0: Shard(1)})
    assert "VocabParallelCrossEntropy" in out.modules
    out.assert_exact()


def test_class_weights_are_refused_with_a_warning():
    weight = torch.rand(VOCAB, generator=torch.Generator().manual_seed(6)) + 0.5
    out = simulate(aten.cross_entropy_loss.default, (_logits(), _target(ignore=7), weight, 1, 7), shard={0: Shard(1)},
                   frozen=(2,))
    assert "VocabParallelCrossEntropy" not in out.modules
    assert "weight" in out.reason and "aten.cross_entropy_loss.default" in out.fallbacks[0]
    assert "/home/user/model.py" in out.fallbacks[0]
    out.assert_exact()


def test_class_probability_targets_are_refused_with_a_warning():
    probs = torch.softmax(torch.randn(9, VOCAB, generator=torch.Generator().manual_seed(7)), -1)
    out = simulate(aten.cross_entropy_loss.default, (_logits(), probs, None, 1, -100, 0.1), shard={0: Shard(1)})
    assert "VocabParallelCrossEntropy" not in out.modules
    assert "target" in out.reason
    out.assert_exact()


@pytest.mark.parametrize("reduction,placement", [(0, Shard(0)), (2, P)])
@pytest.mark.parametrize("weighted", [False, True])
def test_rows_split_loss_is_a_per_row_computation(reduction, placement, weighted):
    weight = torch.rand(VOCAB, generator=torch.Generator().manual_seed(6)) + 0.5 if weighted else None
    args = (_logits(rows=8), _target(rows=8, ignore=-1), weight, reduction, -1, 0.1)
    out = simulate(aten.cross_entropy_loss.default, args, shard={0: Shard(0)}, frozen=(2,))
    assert out.placement == placement
    out.assert_exact()


def test_rows_split_mean_runs_replicated():
    out = simulate(aten.cross_entropy_loss.default, (_logits(rows=8), _target(rows=8)), shard={0: Shard(0)})
    assert out.placement == R
    out.assert_exact()


@pytest.mark.parametrize("bad,ignore_index", [(VOCAB, -100), (296, -100), (-5, -100), (-100, 7), (VOCAB + 1, 7)])
def test_a_target_outside_the_vocabulary_raises_like_f_cross_entropy_before_any_collective(bad, ignore_index):
    target = _target(ignore=ignore_index)
    target[4] = bad
    with pytest.raises(IndexError, match=f"Target {bad} is out of bounds."):
        torch.nn.functional.cross_entropy(_logits(), target, ignore_index=ignore_index)
    out = simulate(aten.cross_entropy_loss.default, (_logits(), target, None, 1, ignore_index), shard={0: Shard(1)},
                   size=4)
    for error in out.errors:
        assert isinstance(error, IndexError) and str(error).startswith(f"Target {bad} is out of bounds."), out.errors
    assert out.collectives_before_error == [0, 0, 0, 0]


# ------------------------------------------------------------------------------------------------ dtypes


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["no-autocast", "bf16-autocast"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", [0, 1])
def test_the_loss_keeps_the_dtype_policy_of_cross_entropy(dtype, autocast, reduction):
    """Under autocast cross-entropy runs in float32 and returns float32 (it is on autocast's float32 list);
    without it the loss has the logits' dtype. The gradient has the logits' dtype either way."""
    args = (_logits().to(dtype), _target(ignore=7), None, reduction, 7, 0.1)
    out = simulate(aten.cross_entropy_loss.default, args, shard={0: Shard(1)}, autocast=autocast)
    assert out.modules == ["VocabParallelCrossEntropy"]
    assert out.expected[0].dtype == (torch.float32 if autocast else dtype)
    # a bf16 loss is rounded to bf16 (2**-8 relative) from float32 sums that differ in order
    tolerance = {"rtol": 1e-2, "atol": 1e-2} if torch.bfloat16 in (dtype, out.expected[0].dtype) else {}
    out.assert_exact(**tolerance)


def test_float64_logits_are_computed_in_float64():
    args = (_logits().double(), _target(ignore=-1), None, 1, -1, 0.3)
    out = simulate(aten.cross_entropy_loss.default, args, shard={0: Shard(1)}, size=4)
    out.assert_exact(rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_the_lookup_keeps_the_weight_dtype_under_autocast(autocast):
    out = simulate(aten.embedding.default, (_weight(), _ids(2, 5, pad=3), 3), shard={0: Shard(0)}, autocast=autocast)
    assert out.expected[0].dtype == torch.float32
    out.assert_exact()


# ------------------------------------------------------------------------------------------ the planner


def _plan_with_warnings(model, loss_fn):
    import warnings

    from autoshard.capture import capture
    from autoshard.passes.tensor_parallel import plan_tensor_parallel

    tokens = _ids(2, 16).remainder(8)
    captured = capture(model, (tokens,), loss_fn=loss_fn, example_target=tokens)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = plan_tensor_parallel(captured.gm, 2)
    return plan, [str(w.message) for w in caught]


def test_the_planner_keeps_an_embedding_it_cannot_split_replicated_and_says_why():
    from harness.models import build_gpt_model, token_loss

    model = build_gpt_model(vocab=VOCAB)
    model.transformer.wte = torch.nn.Embedding(VOCAB, 48, scale_grad_by_freq=True)
    plan, warnings = _plan_with_warnings(model, token_loss)
    assert plan.params["model.transformer.wte.weight"].placement == R
    assert any("scale_grad_by_freq=True" in n and "models.py" in n for n in plan.notes), plan.notes
    assert any("scale_grad_by_freq=True" in w and "aten.embedding.default" in w for w in warnings), warnings


def test_the_planner_keeps_a_class_weighted_loss_replicated_and_says_why():
    from harness.models import build_gpt_model

    def weighted(logits, target):
        weight = torch.linspace(0.5, 1.5, VOCAB)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), weight=weight)

    plan, warnings = _plan_with_warnings(build_gpt_model(vocab=VOCAB), weighted)
    assert all(p.placement == R for n, p in plan.params.items() if "wte" in n)  # tied with the LM head
    assert any("weight=<a tensor> (class weights)" in n for n in plan.notes), plan.notes
    assert any("aten.cross_entropy_loss.default" in w for w in warnings), warnings


# ------------------------------------------------------------------------- the tests can fail: seeded bugs


def _dropping(monkeypatch, cls, name: str, **replacement) -> None:
    """Seed a bug: the localizer builds ``cls`` without argument ``name`` (its default instead)."""
    def build(**kwargs):
        kwargs.pop(name)
        return cls(**kwargs, **replacement)

    monkeypatch.setattr(localize, cls.__name__, build)


def test_dropping_padding_idx_would_be_caught(monkeypatch):
    _dropping(monkeypatch, VocabParallelEmbedding, "padding_idx", padding_idx=None)
    out = simulate(aten.embedding.default, (_weight(), _ids(2, 5, pad=3), 3), shard={0: Shard(0)})
    with pytest.raises(AssertionError, match="grad of p0"):
        out.assert_exact()


@pytest.mark.parametrize("ignore_index", [7, -1])
def test_dropping_ignore_index_would_be_caught(monkeypatch, ignore_index):
    _dropping(monkeypatch, VocabParallelCrossEntropy, "ignore_index")
    args = (_logits(), _target(ignore=ignore_index), None, 1, ignore_index)
    out = simulate(aten.cross_entropy_loss.default, args, shard={0: Shard(1)})
    with pytest.raises(AssertionError):  # 7 counted as a class; -1 as a class is out of bounds (raises)
        out.assert_exact()


def test_dropping_label_smoothing_would_be_caught(monkeypatch):
    _dropping(monkeypatch, VocabParallelCrossEntropy, "label_smoothing")
    out = simulate(aten.cross_entropy_loss.default, (_logits(), _target(), None, 1, -100, 0.1), shard={0: Shard(1)})
    with pytest.raises(AssertionError):
        out.assert_exact()


def test_an_off_by_one_vocab_range_would_be_caught(monkeypatch):
    """A rank that also claims the first id of the next rank's range: its local lookup fails."""
    original = VocabParallelEmbedding.__init__

    def off_by_one(self, **kwargs):
        original(self, **kwargs)
        self.vocab_end += 1

    monkeypatch.setattr(VocabParallelEmbedding, "__init__", off_by_one)
    monkeypatch.setattr(VocabParallelEmbedding, "_check_local", lambda self, n, what: None)
    out = simulate(aten.embedding.default, (_weight(), _ids(2, 5, pad=5)), shard={0: Shard(0)})
    with pytest.raises(AssertionError):
        out.assert_exact()


def test_dropping_the_reduction_would_be_caught(monkeypatch):
    _dropping(monkeypatch, VocabParallelCrossEntropy, "reduction")
    out = simulate(aten.cross_entropy_loss.default, (_logits(), _target(), None, 2), shard={0: Shard(1)})
    with pytest.raises(AssertionError):
        out.assert_exact()


# --------------------------------------------------------------------------------- writes in place


def test_an_in_place_write_into_a_split_weight_is_refused_not_lost():
    """nn.Embedding(max_norm=...) renorms its weight in place: on a gathered copy the write would be lost."""
    with pytest.raises(ValueError, match=r"embedding_renorm_.*writes in place into p0.*leave its weight out"):
        simulate(aten.embedding_renorm_.default, (_weight(), _ids(2, 5), 1.0, 2.0), shard={0: Shard(0)})


def test_the_planner_keeps_an_embedding_with_max_norm_replicated_and_says_why():
    from harness.models import build_gpt_model, token_loss

    model = build_gpt_model(vocab=VOCAB)
    model.transformer.wte = torch.nn.Embedding(VOCAB, 48, max_norm=1.0)
    plan, warnings = _plan_with_warnings(model, token_loss)
    assert plan.params["model.transformer.wte.weight"].placement == R
    assert any("embedding_renorm_" in n and "writes in place" in n for n in plan.notes), plan.notes


def test_the_range_checks_skip_values_without_data():
    """A program run on meta tensors (to find shapes) has no ids to check: the checks must not fail there."""
    ids, weight = torch.empty(2, 5, dtype=torch.long, device="meta"), torch.empty(5, 6, device="meta")
    lookup = VocabParallelEmbedding(group=None, size=2, rank=0, vocab_start=0, vocab_end=5, num_embeddings=10)
    assert lookup(ids, weight).shape == (2, 5, 6)
    loss = VocabParallelCrossEntropy(group=None, size=1, rank=0, vocab_start=0, vocab_end=10, vocab_size=10)
    assert loss(torch.empty(4, 10, device="meta"), torch.empty(4, dtype=torch.long, device="meta")).shape == ()


@pytest.mark.parametrize("read_later", [False, True])
def test_an_in_place_write_matters_when_the_value_is_model_state_or_read_later(read_later):
    from torch import fx

    from autoshard.passes.rules import read_after

    graph = fx.Graph()
    x = graph.placeholder("x")
    h = graph.call_function(aten.relu.default, (x,))
    write = graph.call_function(aten.add_.Tensor, (h, 1.0))
    outputs = [write]
    if read_later:
        outputs.append(graph.call_function(aten.mul.Tensor, (h, 2.0)))
    graph.output(tuple(outputs))
    assert read_after(h, write) is read_later  # an intermediate nothing reads again may take the write on a copy
    assert read_after(x, graph.call_function(aten.mul_.Tensor, (x, 2.0)))  # an input always matters
