"""Custom autograd Functions kept whole (``autoshard.functions``): the capture records each ``Function.apply`` as one
node that runs the Function itself, so its backward is its own (a straight-through estimator's identity, not
``round``'s zero), forwards that write in place run as in eager, and ``F.ctc_loss`` is captured without faking its
data-dependent internals. Single-process checks of the capture and of the per-sample proof, then goldens against
the unsharded model at every axis."""

from __future__ import annotations

import pytest
import torch

import autoshard
from autoshard.capture import CaptureError, capture
from autoshard.compile import capture_for_training, compile_global_batch
from autoshard.functions import KEPT_OP, kept_of
from autoshard.job_plan import check_batch_split
from autoshard.options import CompileOptions

from harness.golden_functions import CALLS, MODELS


def _captured(name: str):
    build, batch, loss_fn = MODELS[name]
    inputs, target = batch()
    torch.manual_seed(0)
    model = build()
    return model, inputs, target, loss_fn, capture(model, inputs, loss_fn=loss_fn, example_target=target)


def test_each_function_is_one_node_whose_backward_is_the_functions_own():
    """Six calls (the reversal, a scan and an estimator per block, the cross-entropy), each one node; the captured
    graph's gradients are eager's bit for bit and the estimator's backward ran once per block."""
    model, inputs, target, loss_fn, captured = _captured("lm")
    kept = [kept_of(n).name for n in captured.gm.graph.nodes if n.target is KEPT_OP]
    assert kept == ["ScaleGrad", "Scan", "STE", "Scan", "STE", "VocabCrossEntropy"]
    assert not any(n.target is torch.ops.aten.round.default for n in captured.gm.graph.nodes)
    CALLS["ste"] = 0
    loss = captured.gm(*inputs, target)
    loss.backward()
    assert CALLS["ste"] == 2
    got = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    expected = loss_fn(model(*inputs), target)
    expected.backward()
    assert loss.item() == expected.item()
    for name, p in model.named_parameters():
        assert torch.equal(got[name], p.grad), name


def test_the_ctc_loss_is_captured_as_one_node_and_differentiated_by_torch():
    model, inputs, target, loss_fn, captured = _captured("ctc")
    assert [kept_of(n).name for n in captured.gm.graph.nodes if n.target is KEPT_OP] == ["ctc_loss"]
    loss = captured.gm(*inputs, target)
    loss.backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    expected = loss_fn(model(*inputs), target)
    expected.backward()
    assert loss.item() == expected.item()
    assert all(torch.equal(g, p.grad) for g, p in zip(got, model.parameters(), strict=True))


class _Closure(torch.autograd.Function):
    weight = None

    @staticmethod
    def forward(ctx, x):
        return x @ _Closure.weight

    @staticmethod
    def backward(ctx, grad):
        return grad @ _Closure.weight.T


class _ReadsAParameter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        _Closure.weight = self.weight
        return _Closure.apply(x)


def test_a_function_that_reads_a_parameter_it_is_not_passed_is_refused_at_capture():
    with pytest.raises(CaptureError, match=r"_Closure .*reads a tensor that takes a gradient without being passed"):
        capture(_ReadsAParameter(), (torch.randn(2, 4),))


class _MixesRowsForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x - x.mean(0, keepdim=True)

    @staticmethod
    def backward(ctx, grad):
        return grad - grad.mean(0, keepdim=True)


class _MixesRowsBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad.flip(0) * 2


class _HoldsTheBatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rows: int):
        return x.reshape(rows, -1).cumsum(-1).reshape(x.shape)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Wrapped(torch.nn.Module):
    def __init__(self, function) -> None:
        super().__init__()
        self.function = function
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        args = (x.shape[0],) if self.function is _HoldsTheBatch else ()
        return self.function.apply(self.linear(x), *args)


def _mse(output, target):
    return torch.nn.functional.mse_loss(output, target)


@pytest.mark.parametrize("function", [_MixesRowsForward, _MixesRowsBackward])
def test_a_function_not_proven_per_sample_is_gathered_under_dp_and_refused_under_microbatches(function):
    """A Function whose forward or backward reads other rows is not proven per-sample: dp alone gathers the rows it
    reads (exact); microbatches of one sample refuse, naming it (of two or more, they take it in two passes)."""
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    notes: list[str] = []
    captured = capture_for_training(_Wrapped(function), (x[:2],), y[:2], _mse)
    check_batch_split(captured, autoshard.Mesh(dp=2), CompileOptions(), notes)
    assert "gathers" in notes[0] and function.__name__ in notes[0], notes
    refused = f"Function {function.__name__} at .*test_functions.py.* is not proven to keep"
    with pytest.raises(ValueError, match=refused):
        compile_global_batch(_Wrapped(function), (x,), autoshard.Mesh(dp=2), 0, CompileOptions(microbatches=2),
                             target=y, loss_fn=_mse)


def test_a_function_passed_the_batchs_size_is_refused_under_dp():
    """Its rows traced at twice their count do not grow alone (it reshapes by the number it was given): not proven;
    gathered, it would still be given one rank's count, so dp refuses it, saying why."""
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    with pytest.raises(ValueError, match="Function _HoldsTheBatch at .* is passed a number that changes with the "
                                         "batch's size"):
        compile_global_batch(_Wrapped(_HoldsTheBatch), (x,), autoshard.Mesh(dp=2), 0, CompileOptions(),
                             target=y, loss_fn=_mse)


@pytest.mark.parametrize("name", ["lm", "ctc"])
def test_functions_proven_per_sample_run_on_each_ranks_rows(name):
    """The estimator, the reversal, the scan, the cross-entropy and the CTC loss keep the samples apart: dp and
    microbatches split them with no gather."""
    build, batch, loss_fn = MODELS[name]
    inputs, target = batch()
    for mesh, microbatches in [({"dp": 2}, 1), ({"dp": 2}, 2)]:
        built = compile_global_batch(build(), inputs, autoshard.Mesh(**mesh), 0,
                                     CompileOptions(microbatches=microbatches), target=target, loss_fn=loss_fn)
        assert "gathers" not in str(built.plan) and not built.plan.batch_sums


# ------------------------------------------------------------------------------------------ goldens

GOLDENS = [("lm", {"dp": 2}, {}), ("lm", {"tp": 2}, {}), ("lm", {"pp": 2}, {"microbatches": 2}),
           ("lm", {"pp": 2}, {"microbatches": 2, "schedule": "zbv"}), ("lm", {"cp": 2}, {}),
           ("lm", {"dp": 2, "tp": 2, "pp": 2}, {"microbatches": 2}),
           ("ctc", {"dp": 2}, {"microbatches": 2}), ("ctc", {"tp": 2}, {}), ("ctc", {"pp": 2}, {"microbatches": 2}),
           ("lm", {"tp": 2}, {"compile": True}), ("wav2vec2", {"dp": 2}, {"microbatches": 2}),
           ("wav2vec2", {"tp": 2}, {}), ("wav2vec2", {"pp": 2}, {"microbatches": 2})]


def _id(name, mesh, options):
    return "-".join([name, "x".join(f"{k}{v}" for k, v in mesh.items()),
                     *(f"{k}={v}" for k, v in options.items())])


@pytest.mark.parametrize("name,mesh,options", GOLDENS, ids=[_id(*g) for g in GOLDENS])
def test_a_model_trained_through_functions_is_exact(pools, name, mesh, options):
    """Losses, every gradient and the parameters after two steps are the unsharded model's, and the estimator's
    own backward ran on every rank that holds a block."""
    from harness.golden import check
    from harness.golden_functions import functions_golden

    world = 1
    for degree in mesh.values():
        world *= degree
    results = pools.get(world).run(functions_golden, name, mesh, **options)
    check(results)
    if name == "lm" and "pp" not in mesh:
        assert all(r["ste"] > 0 for r in results), [r["ste"] for r in results]


# ------------------------------------------------------------------------------------------ identities


class _ForwardAloneIsTheIdentity(torch.autograd.Function):
    """The identity forward (as Megatron writes it, ``view_as``), but a gradient doubled: not the identity."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class _Through(torch.nn.Module):
    def __init__(self, function, *args) -> None:
        super().__init__()
        self.function, self.args = function, args
        self.fc1, self.fc2 = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(self.function.apply(torch.relu(self.fc1(x)), *self.args))


def _kept_names(model) -> list[str]:
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    captured = capture(model, (x,), loss_fn=_mse, example_target=y)
    return [kept_of(n).name for n in captured.gm.graph.nodes if n.target is KEPT_OP]


def test_megatrons_region_mappings_at_one_rank_are_seen_through_and_other_functions_kept():
    """Copy-to, reduce-from, scatter-to and gather-from a region, run at one rank, hand their input and their gradient
    back: the graph reads the input itself. A forward that is the identity with a backward that is not (a doubled
    gradient, the gradient reversal's ``-alpha``), or a forward that rounds, stays kept whole."""
    from harness.models import CopyToRegion, GatherFromRegion, OneRankGroup, ReduceFromRegion, ScatterToRegion

    for function in (CopyToRegion, ReduceFromRegion, ScatterToRegion, GatherFromRegion):
        assert _kept_names(_Through(function, OneRankGroup())) == [], function.__name__
    from harness.golden_functions import STE, ScaleGrad

    assert _kept_names(_Through(_ForwardAloneIsTheIdentity)) == ["_ForwardAloneIsTheIdentity"]
    assert _kept_names(_Through(ScaleGrad, 0.5)) == ["ScaleGrad"]
    assert _kept_names(_Through(STE)) == ["STE"]


@pytest.mark.parametrize("options", [{}, {"sequence_parallel": True}], ids=["tp2", "tp2-sp"])
def test_a_model_written_for_megatrons_tensor_parallelism_is_planned_as_its_layers_would_split(options):
    """The zoo's Megatron-style decoder at tp=2: every column- and row-parallel linear split as Megatron splits it, at
    most 0.55 of the parameter bytes on either rank, no warning; with sequence parallelism too (before the region
    mappings were seen through, sequence parallelism found no region ending on the sequence and refused)."""
    import math
    import warnings

    from harness.models import build

    case = build("megatron")
    for rank in (0, 1):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            built = compile_global_batch(case.model, case.inputs, autoshard.Mesh(tp=2), rank, CompileOptions(**options),
                                         target=case.target, loss_fn=case.loss_fn)
        assert not [str(w.message) for w in caught if "autoshard" in str(w.message)]
        roles = {name: p.role for name, p in built.tp_plan.params.items() if name.endswith("linear_fc1.weight")
                 or name.endswith("linear_fc2.weight") or name.endswith("linear_qkv.weight")
                 or name.endswith("linear_proj.weight")}
        assert len(roles) == 8 and all(role in ("column", "row") for role in roles.values()), roles
        params = dict(built.captured.gm.named_parameters())
        held = sum(math.prod(built.stored_shape(name)) for name in params)
        assert held / sum(p.numel() for p in params.values()) <= 0.55
