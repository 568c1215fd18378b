"""The graph-costed planner: a measured profile (``autoshard calibrate``), predictions from the compiled programs,
and ``mesh="auto"`` choosing by them. Single process: the candidates are compiled without process groups."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import autoshard
from autoshard.options import CompileOptions
from autoshard.planner.auto import measured_mesh
from autoshard.planner.predict import CandidateCompiler, predict
from autoshard.planner.profile import Profile

from harness.models import N_LAYER, build

DATA = Path(__file__).with_name("data")


def _profile(**changes) -> Profile:
    """A machine of 20 GFLOP/s matmuls, 10 us ops and 1 GB/s links with 100 us latency."""
    fields = dict(world_size=2, threads=1, device="cpu",
                  matmul=[(m, n, k, 3 * 2 * m * n * k / 20e9) for m in (64, 1024) for n in (64, 1024)
                          for k in (64, 1024)],
                  attention=[(1e6, 3e6 / 10e9), (1e9, 3e9 / 10e9)], op_seconds=10e-6, byte_seconds=1e-10,
                  view_seconds=2e-6, optimizer_byte_seconds=1e-9,
                  collectives={kind: {"2": (100e-6, 1e-9)} for kind in
                               ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")})
    fields.update(changes)
    return Profile(**fields)


def test_a_profile_round_trips_through_its_json(tmp_path):
    profile = _profile(large={"2": (4.0 * 2**20, 16.0 * 2**20, 0.02)}, copy_byte_seconds=3e-11, zero_byte_seconds=1e-10,
                       points={"all_gather": {"2": [(8192.0, 1e-3), (2.0**20, 2e-3)]}},
                       late=[(4096.0, 2e-3), (2.0**20, 3e-3)])
    profile.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == profile


def test_an_all_reduce_past_the_fitted_sizes_is_costed_on_the_line_to_the_large_one_measured():
    mib = 2**20
    profile = _profile(large={"2": (4 * mib, 16 * mib, 100e-6 + 4 * mib * 1e-9 + 12 * mib * 2e-9)})  # twice per byte
    assert profile.collective_time("all_reduce", 2, 2 * mib) == pytest.approx(100e-6 + 2 * mib * 1e-9)  # the fit
    line = 100e-6 + 4 * mib * 1e-9 + 9 * mib * 2e-9
    assert profile.collective_time("all_reduce", 2, 13 * mib) == pytest.approx(line)
    assert profile.collective_time("all_reduce", 2, 26 * mib, calls=2) == pytest.approx(2 * line)  # per call
    past = 100e-6 + 4 * mib * 1e-9 + 28 * mib * 2e-9
    assert profile.collective_time("all_reduce", 2, 32 * mib) == pytest.approx(past)
    assert profile.collective_time("all_gather", 2, 13 * mib) == pytest.approx(100e-6 + 13 * mib * 1e-9)
    cheaper = _profile(large={"2": (4 * mib, 16 * mib, 1e-6)})  # never cheaper per byte than the fit
    assert cheaper.collective_time("all_reduce", 2, 13 * mib) == pytest.approx(100e-6 + 13 * mib * 1e-9)

def test_a_collective_is_costed_between_the_sizes_measured_not_on_the_fit_s_line():
    """The fit's latency is set by the large sizes (2 ms here for an all-reduce of 1 KiB that took 1): a size
    between two measured ones is costed between them, an all-reduce below the smallest between it and the tiny one
    measured, and past the largest on the fit's slope, or the line to the large all-reduce where there is one."""
    kib, mib = 2**10, 2**20
    points = [(4 * kib, 1e-3), (64 * kib, 1.1e-3), (512 * kib, 2e-3), (4 * mib, 5e-3)]
    profile = _profile(collectives={**_profile().collectives, "all_reduce": {"2": (2e-3, 1e-9)}},
                       points={"all_reduce": {"2": points}, "all_gather": {"2": points}}, tiny={"2": 0.5e-3})
    assert profile.collective_time("all_reduce", 2, 4 * kib) == pytest.approx(1e-3)
    assert profile.collective_time("all_reduce", 2, 288 * kib) == pytest.approx(1.55e-3)
    assert profile.collective_time("all_reduce", 2, 2 * 288 * kib, calls=2) == pytest.approx(2 * 1.55e-3)
    assert profile.collective_time("all_reduce", 2, 4) == pytest.approx(0.5e-3)
    assert 0.5e-3 < profile.collective_time("all_reduce", 2, kib) < 1e-3
    assert profile.collective_time("all_gather", 2, kib) == pytest.approx(1e-3)  # no tiny path: the smallest's
    assert profile.collective_time("all_reduce", 2, 5 * mib) == pytest.approx(5e-3 + mib * 1e-9)
    large = _profile(**{**profile.__dict__, "large": {"2": (4 * mib, 16 * mib, 5e-3 + 12 * mib * 2e-9)}})
    assert large.collective_time("all_reduce", 2, 5 * mib) == pytest.approx(5e-3 + mib * 2e-9)
    assert profile.collective_time("reduce_scatter", 2, 4 * kib) == pytest.approx(100e-6 + 4 * kib * 1e-9)  # fit
    wider = _profile(world_size=4, collectives=profile.collectives, points=profile.points)
    assert wider.collective_time("all_gather", 4, 4 * kib) == pytest.approx(  # measured at 2: the fit, scaled
        100e-6 + 4 * kib * 1e-9 * 1.5)


def test_a_collective_s_slow_calls_are_priced_over_every_size_and_its_point_is_its_lower_quartile():
    """A third of a collective's calls take 1 to 8 ms more here, whatever its size: ten calls do not price so rare a
    tail, and one slow call moved a size's mean by a millisecond. A point is its calls' lower quartile plus the
    mean's excess over it pooled over every size."""
    from autoshard.planner.profile import _base, _tail

    small, large = [1e-3] * 7 + [5e-3], [2e-3] * 8
    assert _base(small) == pytest.approx(1e-3) and _base(large) == pytest.approx(2e-3)
    assert _tail([small, large]) == pytest.approx((0.5e-3 + 0.0) / 2)
    assert _base([3e-3]) == 3e-3


def test_the_copy_that_packs_a_collective_s_buffer_is_costed_as_a_copy_not_as_an_op_s_forward_and_backward(gpt):
    """A gathered tensor's parts are cat together, an all-reduce's input cloned: copies without autograd, a few
    times cheaper per byte than an op forward and backward (0.08 against 0.6 ms per MiB here)."""
    _, compiler = gpt
    assert _profile(copy_byte_seconds=1e-12).copy_time(2**20) == pytest.approx(2e-6 + 2**20 * 1e-12)
    assert _profile().copy_time(2**20) == pytest.approx(2e-6 + 2**20 * 1e-10)  # no copy measured: an op's bytes
    plain = predict(compiler, autoshard.Mesh(tp=2), _profile())
    cheap = predict(compiler, autoshard.Mesh(tp=2), _profile(copy_byte_seconds=1e-12))
    assert 0 < cheap.parts["collectives"] < plain.parts["collectives"]
    assert cheap.parts["compute"] == plain.parts["compute"]


class _Casting(torch.nn.Module):
    """A linear whose output is cast to ``dtype`` and back, as an RMSNorm casts to float32 and back."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype, self.linear = dtype, torch.nn.Linear(64, 64)

    def forward(self, x):
        return self.linear(x).to(self.dtype).to(x.dtype)


def test_a_conversion_to_what_a_tensor_already_is_costs_a_view_not_a_copy():
    """An RMSNorm's ``.to(float32)`` of a float32 tensor returns the tensor itself: 24 such casts had cost a
    mixture 15 ms of its predicted step here, where they took 0.3."""
    x, target = torch.randn(256, 64), torch.randn(256, 64)
    profile = _profile(op_seconds=1e-3, byte_seconds=1e-9)

    def compute(dtype):
        compiler = CandidateCompiler(_Casting(dtype), (x,), target, torch.nn.functional.mse_loss)
        return predict(compiler, autoshard.Mesh(), profile).parts["compute"]

    same, other = compute(torch.float32), compute(torch.float64)
    assert other - same > 2 * 1e-3 > 0, (same, other)  # two copies, forward and backward, where the dtype changes


def test_transformers_expert_loop_pays_for_zeroing_its_buffers():
    """transformers' grouped matmul on CPU loops over the experts, writing into a zeroed output, and its backward
    into zeroed gradients of its input and of the stacked weights: 13 ms of a mixture's 224 ms step here, which
    no node of the graph shows. Fresh buffers, out of the caches: costed at the profile's zero fill, timed after a
    pass over 128 MiB (0.14 to 0.19 ms per MiB here, 0.05 in a loop)."""
    import transformers

    from harness.models import hf_token_loss

    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=16)
    model = transformers.MixtralForCausalLM(config).train()
    tokens = torch.randint(0, 64, (2, 16))
    compiler = CandidateCompiler(model, (tokens,), tokens, hf_token_loss)
    nodes = [n for n in compiler.builds(autoshard.Mesh(), CompileOptions())[0][0].programs[0].gm.graph.nodes
             if n.op == "call_function" and "grouped_mm_fallback" in str(n.target)]
    assert len(nodes) == 2, nodes  # the gate-up and down projections
    free = predict(compiler, autoshard.Mesh(), _profile(zero_byte_seconds=1e-15)).parts["compute"]
    paid = predict(compiler, autoshard.Mesh(), _profile(zero_byte_seconds=1e-9)).parts["compute"]
    assert predict(compiler, autoshard.Mesh(), _profile(zero_byte_seconds=1e-15, copy_byte_seconds=1e-9)).parts[
        "compute"] == pytest.approx(free)  # not a copy's: a collective's buffer is copied just computed, in the caches
    weights = sum(p.numel() * 4 for name, p in model.named_parameters() if "experts" in name)
    rows = 2 * 16 * 2  # tokens x experts per token
    activations = rows * (32 + 2 * 64) * 4 + rows * (64 + 32) * 4  # each projection's input and output
    assert paid - free == pytest.approx((weights + activations) * (1e-9 - 1e-15), rel=1e-6)


def test_tp_s_loss_and_embedding_pay_for_their_compute(gpt, monkeypatch):
    """Under tp the loss over the vocab-sharded logits and the embedding of the vocab-sharded table are the passes'
    modules: the loss runs max, subtract, exp, sum and a divide over the local logits, and backward a copy, an
    index_put and a product (8.5 ms of a mixture's tp2 step here, costed nothing before); the embedding masks its
    ids and rows, and backward adds its rows' gradients into the table's."""
    from autoshard.planner import predict as P
    from autoshard.planner.memory import node_bytes

    case, compiler = gpt
    gm = compiler.builds(autoshard.Mesh(tp=2), CompileOptions())[0][0].programs[0].gm
    of = {name: [n for n in gm.graph.nodes if n.op == "call_module"
                 and type(gm.get_submodule(n.target)).__name__ == name] for name in P._MODULE_OPS}
    assert len(of["VocabParallelCrossEntropy"]) == 1 and len(of["VocabParallelEmbedding"]) == 2  # tokens, positions
    profile = _profile()
    paid = P.program_time(gm, profile)[0]
    logits = of["VocabParallelCrossEntropy"][0].args[0]
    mine = (P._MODULE_OPS["VocabParallelCrossEntropy"][0] * profile.op_time(node_bytes(logits))
            + sum(P._MODULE_OPS["VocabParallelEmbedding"][0] * profile.op_time(node_bytes(n))
                  for n in of["VocabParallelEmbedding"]))
    monkeypatch.setattr(P, "_MODULE_OPS", {})
    assert mine > 0 and paid - P.program_time(gm, profile)[0] == pytest.approx(mine, rel=1e-9)


def test_a_product_is_costed_at_the_rate_interpolated_between_the_measured_shapes_around_it():
    """The rate (FLOPs per second) is interpolated in log sizes between the measured shapes around a product, each
    corner weighted by its closeness; corners the grid lacks are left out, and past its ends the edge's rate holds.
    Taking the nearest shape alone put a size midway between two at whichever came first (a 1024 x 2048 x 256
    product read 1.41x its time where one of its two neighbours had read slow; 0.91x to 1.04x interpolated)."""
    profile = _profile(matmul=[(64, 64, 64, 1e-3), (1024, 1024, 1024, 2.0)])
    assert profile.matmul_time(64, 64, 64) == pytest.approx(1e-3)
    assert profile.matmul_time(128, 64, 64) == pytest.approx(2e-3)  # the only corner measured: its rate, twice the rows
    assert profile.matmul_time(1024, 1024, 512) == pytest.approx(1.0)
    assert profile.matmul_time(4096, 1024, 1024) == pytest.approx(8.0)  # past the grid: its edge's rate
    slow, fast = 1e-3, 0.25e-3  # the same shape's time at n = 64 and, four times the rate, at n = 1024 (per its FLOPs)
    grid = _profile(matmul=[(m, n, k, (slow if n == 64 else fast * 16) * (m / 64) * (k / 64))
                            for m in (64, 1024) for n in (64, 1024) for k in (64, 1024)])
    flops_rate_slow = 2 * 64**3 / slow
    midway = grid.matmul_time(64, 256, 64)  # log-midway in n: twice the slow rate (the geometric mean of 1x and 4x)
    assert midway == pytest.approx(2 * 64 * 256 * 64 / (2 * flops_rate_slow))
    assert grid.matmul_time(512, 256, 256) == pytest.approx(2 * 512 * 256 * 256 / (2 * flops_rate_slow))


def test_collectives_pay_their_latency_per_call_and_a_ring_scales_with_the_group():
    profile = _profile()
    one = profile.collective_time("all_reduce", 2, 1e6)
    assert one == pytest.approx(100e-6 + 1e6 * 1e-9)
    assert profile.collective_time("all_reduce", 2, 1e6, calls=3) == pytest.approx(300e-6 + 1e6 * 1e-9)
    assert profile.collective_time("all_reduce", 4, 1e6) == pytest.approx(100e-6 + 1e6 * 1e-9 * 1.5)  # 3/4 over 1/2
    assert profile.collective_time("all_reduce", 1, 1e6) == 0.0
    assert profile.gradient_sync_time(2, 60 * 2**20) == pytest.approx(3 * 100e-6 + 60 * 2**20 * 1e-9)  # 3 buckets


@pytest.fixture(scope="module")
def gpt():
    case = build("gpt")
    return case, CandidateCompiler(case.model, case.inputs, case.target, case.loss_fn)


def test_the_ranks_waiting_on_each_other_cost_each_collective_and_a_share_of_the_compute(gpt):
    """A profile that measured 1 ms per collective and a tenth of the compute between them: tp pays per collective
    (many per microbatch), dp once per step; a pipeline's sends are simulated, not charged here."""
    case, compiler = gpt
    plain, waiting = _profile(), _profile(sync={"2": (1e-3, 0.1)})
    assert waiting.sync_time(2, 3, 0.5) == pytest.approx(3e-3 + 0.05) and waiting.sync_time(1, 3, 0.5) == 0
    tp, tp_waiting = (predict(compiler, autoshard.Mesh(tp=2), p) for p in (plain, waiting))
    calls = (tp_waiting.parts["collectives"] - tp.parts["collectives"] - 0.1 * tp.parts["compute"]) / 1e-3
    # an all-reduce closing each attention and MLP block forward, one opening each backward: 4 per layer at least
    assert calls == pytest.approx(round(calls), abs=1e-6) and round(calls) >= 4 * N_LAYER, calls
    dp, dp_waiting = (predict(compiler, autoshard.Mesh(dp=2), p) for p in (plain, waiting))
    assert dp_waiting.parts["gradient sync"] - dp.parts["gradient sync"] == pytest.approx(
        1e-3 + 0.1 * dp.parts["compute"])


def test_measured_crowding_attention_and_the_optimizers_tensors_are_read_as_measured(gpt):
    """Compute is calibrated alone and slowed by the crowding measured at the profile's world size (other sizes:
    the ranks' threads over the cores, times what the world measured beyond its share where the cores are
    outnumbered); causal attention points, recorded at 4 b h s^2 d, are read at the work a causal run does (half);
    AdamW pays per parameter tensor as well as per byte."""
    crowded = _profile(world_size=4, cores=2, crowding=1.7)
    assert crowded.contention(4) == 1.7 and crowded.contention(8) == 4.0 and _profile().contention(2) == 1.0
    # beyond the ranks' share of the cores: ranks taking turns on a core pay it wherever the cores are outnumbered
    switching = _profile(world_size=4, cores=2, crowding=2.4)
    assert switching.contention(2) == 1.0 and switching.contention(3) == pytest.approx(1.5 * 1.2)
    assert switching.contention(8) == pytest.approx(4.0 * 1.2)
    point_flops, point_seconds = _profile().attention[0]
    assert _profile().attention_time(point_flops / 2) == pytest.approx(point_seconds)
    case, compiler = gpt
    plain = predict(compiler, autoshard.Mesh(), _profile())
    per_tensor = predict(compiler, autoshard.Mesh(), _profile(optimizer_param_seconds=1e-3))
    tensors = len(list(case.model.parameters()))
    assert per_tensor.parts["optimizer"] - plain.parts["optimizer"] == pytest.approx(tensors * 1e-3)


def test_a_prediction_splits_the_work_as_the_mesh_splits_it(gpt):
    case, compiler = gpt
    profile = _profile()
    whole = predict(compiler, autoshard.Mesh(), profile)
    tp = predict(compiler, autoshard.Mesh(tp=2), profile)
    dp = predict(compiler, autoshard.Mesh(dp=2), profile)
    pp = predict(compiler, autoshard.Mesh(pp=2), profile, microbatches=2)
    for p in (whole, tp, dp, pp):
        assert p.error is None and p.step > 0, p
    assert tp.parts["compute"] < 0.8 * whole.parts["compute"] and tp.parts["collectives"] > 0
    assert dp.parts["compute"] < 0.8 * whole.parts["compute"] and dp.parts["gradient sync"] > 0
    assert pp.parts["bubble"] > 0 and "gradient sync" in pp.parts and pp.parts["gradient sync"] == 0
    assert whole.parts["collectives"] == 0 and whole.parts["gradient sync"] == 0


def test_the_slowest_cp_rank_sets_the_step(gpt):
    """Causal attention gives the cp rank holding the later half of the sequence three times the first's pairs."""
    case, compiler = gpt
    profile = _profile()
    builds = compiler.builds(autoshard.Mesh(cp=2), CompileOptions())
    from autoshard.planner.predict import program_time

    first, second = (sum(program_time(p.gm, profile)[0] for p in b.programs.values()) for b in builds[0])
    assert second > first
    assert predict(compiler, autoshard.Mesh(cp=2), profile).parts["compute"] == pytest.approx(second)


def test_a_mesh_the_model_cannot_take_is_predicted_as_refused(gpt):
    case, compiler = gpt
    found = predict(compiler, autoshard.Mesh(tp=3), _profile(world_size=3))
    assert found.error and found.step == float("inf")


def test_mesh_auto_with_a_profile_takes_the_fastest_prediction(gpt, tmp_path):
    """Links that move bytes slowly for every collective but a pair's send make the pipeline the fastest at 2 ranks
    (it sums only its loss and its tied weights); fast links and slow matmuls make the data-parallel split the
    fastest."""
    case, _ = gpt
    slow = {kind: {"2": (1e-6, 1e-5)} for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")}
    path = tmp_path / "slow_links.json"
    _profile(collectives={**slow, "send_recv": {"2": (1e-6, 1e-12)}}).save(path)
    options = CompileOptions(microbatches=2, planner_profile=str(path))
    chosen = measured_mesh(case.model, case.inputs, options, loss_fn=case.loss_fn, target=case.target, world_size=2)
    assert chosen == autoshard.Mesh(pp=2)
    path = tmp_path / "fast_links.json"
    _profile().save(path)
    options = CompileOptions(planner_profile=str(path))
    chosen = measured_mesh(case.model, case.inputs, options, loss_fn=case.loss_fn, target=case.target, world_size=2)
    assert chosen == autoshard.Mesh(dp=2)


@pytest.mark.parametrize("name", ["gpt", "llama", "hf_llama", "bert", "moe"])
def test_the_activations_a_program_keeps_for_its_backward_are_read_from_its_graph(name):
    """What ``saved_bytes`` reads from the one-rank program against what autograd keeps when the model itself runs
    (saved-tensor hooks, each storage once, parameters excluded): within 20% on the zoo (measured 0.99x to 1.14x)."""
    from autoshard.planner.memory import saved_bytes

    case = build(name)
    compiler = CandidateCompiler(case.model, case.inputs, case.target, case.loss_fn)
    program = compiler.builds(autoshard.Mesh(), CompileOptions())[0][0].programs[0]
    weights = {p.untyped_storage().data_ptr() for p in case.model.parameters()}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        case.loss_fn(case.model(*case.inputs), case.target).backward()
    assert 0.85 <= saved_bytes(program.gm) / sum(kept.values()) <= 1.2, (saved_bytes(program.gm), sum(kept.values()))


def test_a_pipeline_is_simulated_stage_by_stage_on_shared_cores():
    """Ranks with cores of their own: 1F1B over equal stages takes the schedule's own simulation; a cheaper stage
    shortens it. Four ranks on two cores: no shorter than their compute over the cores, a collective's wait leaves
    the core to the others (so adding waits costs less than their sum), and a collective with fewer ranks busy
    ends sooner than the profile's, timed with all of them."""
    from autoshard import schedules
    from autoshard.planner.predict import _shared_makespan

    def by_stage(times):
        return dict(enumerate(times))

    actions = schedules.schedule("1f1b", 4, 8)
    alone = _profile(world_size=4, cores=4)
    equal = [(0.03, 0.0)] * 4
    expected = schedules.simulate(actions, 4, forward_cost=0.01, backward_cost=0.02).makespan
    assert _shared_makespan(actions, by_stage(equal), 0.0, 1, alone) == pytest.approx(expected)
    assert _shared_makespan(actions, by_stage([(0.01, 0.0), *equal[1:]]), 0.0, 1, alone) < expected
    crowded = _profile(world_size=4, cores=2)
    shared = _shared_makespan(actions, by_stage(equal), 0.0, 1, crowded)
    assert shared >= 4 * 8 * 0.03 / 2 - 1e-9 and shared > expected
    waiting = _shared_makespan(actions, by_stage([(0.03, 0.03)] * 4), 0.0, 1, crowded)
    assert shared < waiting < shared + 8 * 0.03
    # the profile times collectives with the whole world communicating: while the pipeline fills and drains,
    # fewer ranks are busy and their collectives end sooner (tp2 x pp2's steps here were predicted 18% to 57% high)
    only_waits = [(0.0, 0.03)] * 4
    assert _shared_makespan(actions, by_stage(only_waits), 0.0, 1, crowded) < _shared_makespan(
        actions, by_stage(only_waits), 0.0, 1, alone) == pytest.approx(expected)


def test_an_interleaved_rank_runs_each_chunk_at_its_own_stage_time():
    """Interleaved over 2 ranks: a rank's chunks are not alike (the first stage holds the embedding, the last the head
    and the loss). Each chunk is simulated at its own stage's time: with the same work on each rank, heavy first and
    last stages hold up the chunks between them, where the ranks' averages would predict the balanced schedule."""
    from autoshard import schedules
    from autoshard.planner.predict import _shared_makespan

    actions = schedules.schedule("interleaved", 2, 4, 2)
    alone = _profile(world_size=2, cores=2)
    even = {stage: (0.03, 0.0) for stage in range(4)}
    balanced = schedules.simulate(actions, 2, 2, forward_cost=0.02, backward_cost=0.04).makespan
    assert _shared_makespan(actions, even, 0.0, 1, alone) == pytest.approx(balanced)
    ends = {0: (0.05, 0.0), 1: (0.01, 0.0), 2: (0.01, 0.0), 3: (0.05, 0.0)}  # each rank's chunks still sum to 0.06
    assert _shared_makespan(actions, ends, 0.0, 1, alone) == pytest.approx(1.22 * balanced, rel=0.01)


def test_a_receive_posted_after_its_send_waits_for_the_sender_s_thread():
    """A pipeline rank that reaches a receive after its neighbour sent waits for the sender's communication thread,
    which shares a core with the sender's compute (1.9 to 2.2 ms here for 4 KiB to 512 KiB, 3.7 for 4 MiB; a
    receive posted first ends 0.05 ms after its send). The simulation charges ``late`` to each such receive and
    none to one posted first: an interleaved pipeline, with more of them on its path, pays more (the Llama's
    interleaved pp2 with 4 microbatches had been predicted 13% to 24% fast, 1F1B within 13%)."""
    from autoshard import schedules
    from autoshard.planner.predict import _shared_makespan

    profile = _profile(late=[(4096.0, 2e-3), (2.0**20, 3e-3)])
    assert profile.late_receive_time(4096) == profile.late_receive_time(10) == pytest.approx(2e-3)
    assert profile.late_receive_time(2**19) == pytest.approx(2e-3 + 1e-3 * (2**19 - 4096) / (2**20 - 4096))
    assert profile.late_receive_time(2**21) == pytest.approx(4e-3, rel=0.01)  # on the line through the last two
    assert _profile().late_receive_time(2**20) == 0.0  # a profile from before: not measured

    alone = _profile(world_size=2, cores=2)
    for name, v in (("1f1b", 1), ("interleaved", 2)):
        actions = schedules.schedule(name, 2, 4, v)
        stages = {stage: (0.03, 0.0) for stage in range(2 * v)}
        on_time = _shared_makespan(actions, stages, 0.0, 1, alone)
        assert _shared_makespan(actions, stages, 0.0, 1, alone, late=0.0) == on_time
        late = _shared_makespan(actions, stages, 0.0, 1, alone, late=2e-3)
        receives = sum(a.is_recv for steps in actions.values() for a in steps)
        assert on_time + 2e-3 <= late <= on_time + receives * 2e-3, (name, on_time, late)
    plain = schedules.schedule("1f1b", 2, 4)
    mixed = schedules.schedule("interleaved", 2, 4, 2)
    even = {stage: (0.03, 0.0) for stage in range(4)}
    plain_extra = (_shared_makespan(plain, {0: (0.06, 0.0), 1: (0.06, 0.0)}, 0.0, 1, alone, late=2e-3)
                   - _shared_makespan(plain, {0: (0.06, 0.0), 1: (0.06, 0.0)}, 0.0, 1, alone))
    mixed_extra = _shared_makespan(mixed, even, 0.0, 1, alone, late=2e-3) - _shared_makespan(mixed, even, 0.0, 1, alone)
    assert mixed_extra > plain_extra


def _late_measured() -> list:
    from autoshard.planner.profile import _late_receives

    return _late_receives([4096, 65536], 3)


def test_the_calibration_times_late_receives_on_rank_0(pools):
    results = pools.get(2).run(_late_measured, timeout=120)
    assert [b for b, _ in results[0]] == [4096.0, 65536.0] and all(0 < t < 1 for _, t in results[0])
    assert results[1] == []  # the sender; rank 0's numbers are the profile's


def test_a_ring_pays_for_merging_each_of_its_pieces(gpt):
    """Ring attention runs its pieces (each run of query rows against each reached run of another rank's keys) one
    kernel at a time and merges each by its log-sum-exp: a few ops per piece over its rows, on top of the attention's
    work (left out, GPT-2's cp2 ring was predicted 14-21% fast here)."""
    from autoshard.planner.predict import _attention_module_time

    case, compiler = gpt
    build = compiler.builds(autoshard.Mesh(cp=2), CompileOptions(cp_attention="ring", cp_load_balance=True))[0][0]
    gm = build.programs[min(build.programs)].gm
    rings = [n for n in gm.graph.nodes if n.op == "call_module" and callable(getattr(gm.get_submodule(n.target),
                                                                                    "blocks", None))]
    assert rings
    free, fixed = _profile(op_seconds=0.0, byte_seconds=0.0), _profile(op_seconds=1e-3, byte_seconds=0.0)
    pieces = sum(len(gm.get_submodule(n.target).blocks(src)) for n in rings for src in range(2))
    added = sum(_attention_module_time(gm, n, fixed) - _attention_module_time(gm, n, free) for n in rings)
    assert pieces >= 3 * len(rings) and added == pytest.approx(pieces * 6 * 1e-3)  # six ops a piece


def test_a_product_with_a_number_keeps_nothing_for_the_backward():
    """GPT-2's tanh GELU, ``0.5 * x * (1 + tanh(c * (x + 0.044715 * x ** 3)))``: autograd keeps x (for the power),
    the tanh, and the two sides of the last product; a number times a tensor keeps nothing (read as keeping its
    tensor, the graph counted 1.43x what this model keeps, and 1.28x on HF GPT-2)."""
    import math

    from autoshard.planner.memory import saved_bytes

    class Gelu(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

        def forward(self, x):
            h = self.up(x)
            h = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))
            return self.down(h)

    model, x, target = Gelu(), torch.randn(4, 32, 64), torch.randn(4, 32, 64)
    compiler = CandidateCompiler(model, (x,), target, torch.nn.functional.mse_loss)
    program = compiler.builds(autoshard.Mesh(), CompileOptions())[0][0].programs[0]
    kept = {}

    def pack(t):
        if all(t.untyped_storage().data_ptr() != p.untyped_storage().data_ptr() for p in model.parameters()):
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.nn.functional.mse_loss(model(x), target).backward()
    assert 0.95 <= saved_bytes(program.gm) / sum(kept.values()) <= 1.1, (saved_bytes(program.gm), kept)


def test_a_footprint_splits_as_the_mesh_and_the_options_split_it(gpt):
    case, compiler = gpt
    profile = _profile()
    whole = predict(compiler, autoshard.Mesh(), profile).memory
    tp = predict(compiler, autoshard.Mesh(tp=2), profile).memory
    dp = predict(compiler, autoshard.Mesh(dp=2), profile)
    fsdp = predict(compiler, autoshard.Mesh(dp=2), profile, data_parallel="fsdp")
    assert 0.45 < tp.weights / whole.weights < 0.6 and tp.activations < whole.activations
    assert whole.gradients == whole.weights and whole.optimizer == 2 * whole.weights  # AdamW's two moments
    assert dp.memory.gradients == 2 * dp.memory.weights  # DDP's buckets
    assert fsdp.memory.optimizer == dp.memory.optimizer / 2 and fsdp.memory.total < dp.memory.total
    assert fsdp.parts["optimizer"] == pytest.approx(dp.parts["optimizer"] / 2)
    one_f_one_b = predict(compiler, autoshard.Mesh(pp=2), profile, microbatches=4)
    gpipe = predict(compiler, autoshard.Mesh(pp=2), profile, microbatches=4, schedule="gpipe")
    recomputed = predict(compiler, autoshard.Mesh(pp=2), profile, microbatches=4, activation_checkpointing=True)
    assert gpipe.memory.activations > 1.5 * one_f_one_b.memory.activations  # 4 microbatches in flight against 2
    assert recomputed.memory.activations < one_f_one_b.memory.activations
    assert recomputed.parts["compute"] > one_f_one_b.parts["compute"]  # the forward runs again


def test_mesh_auto_under_a_memory_limit_takes_the_fastest_that_fits(gpt, tmp_path):
    from autoshard.explain import planner_ranking
    from autoshard.planner.auto import measured_choice

    case, _ = gpt
    path = tmp_path / "p.json"
    _profile().save(path)

    def choose(**options):
        return measured_choice(case.model, case.inputs, CompileOptions(planner_profile=str(path), **options),
                               loss_fn=case.loss_fn, target=case.target, world_size=2)

    mesh, _, ranking = choose()
    assert mesh == autoshard.Mesh(dp=2)
    needs = ranking[0].memory.total
    limited, options, ranking = choose(memory_limit=0.8 * needs)
    assert limited != mesh and ranking[0].memory.total <= 0.8 * needs
    lines = planner_ranking(ranking, options)
    assert any(line.startswith("  over the memory limit, though predicted faster: Mesh(dp=2") for line in lines)
    _profile(memory=0.8 * needs).save(path)  # the profile's limit where none is given
    assert choose()[0] == limited
    with pytest.raises(ValueError, match=r"no mesh of 2 ranks fits in 1\.0 KiB per rank .* Raise memory_limit"):
        choose(memory_limit="1KiB")
    with pytest.raises(ValueError, match="memory_limit='lots' is not valid: cannot read 'lots' as a memory size"):
        choose(memory_limit="lots")
    with pytest.raises(ValueError, match="memory_limit=-1 is not valid"):
        CompileOptions(memory_limit=-1)


def test_a_profile_written_before_memory_was_measured_loads_without_a_limit(tmp_path):
    path = tmp_path / "old.json"
    data = json.loads(json.dumps(_profile().__dict__))
    del data["memory"]
    path.write_text(json.dumps(data))
    assert Profile.load(path).memory == 0


def test_mesh_auto_with_a_profile_needs_the_loss():
    case = build("gpt")
    with pytest.raises(ValueError, match="pass loss_fn and target"):
        measured_mesh(case.model, case.inputs, CompileOptions(planner_profile="p.json"), loss_fn=None, target=None,
                      world_size=2)


def test_calibrate_writes_a_profile_of_this_machine(tmp_path):
    out = tmp_path / "profile.json"
    done = subprocess.run([sys.executable, "-m", "autoshard.cli", "calibrate", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    profile = Profile.load(out)
    assert profile.world_size == 1 and profile.threads == 1 and profile.seconds < 60
    assert all(seconds > 0 for *_, seconds in profile.matmul) and profile.op_seconds > 0
    assert profile.matmul_time(512, 512, 512) > profile.matmul_time(128, 128, 128)
    assert json.loads(out.read_text())["device"] == "cpu" and profile.memory > 2**30
    assert torch.get_num_threads() >= 1


def test_mesh_auto_with_this_machines_profile_takes_the_measured_best():
    """``tests/data/profile_cpu_2.json`` is a profile calibrated on this machine at 2 ranks (``autoshard calibrate
    --nproc 2``, 1 thread a rank). On ``bench/planner_check.py``'s HF Llama (hidden 256, 4 layers, batch 8 x 128)
    dp2 measured fastest in the bench's run beside it (163.8 ms, against 195.9 for pp2, 200.5 for cp2 with
    all-to-all attention, 201.7 with ring attention, 213.1 for cp2 and 220.9 for tp2) and in every run of the bench
    since (``bench/results_planner_2.md``). ``mesh="auto"`` with that profile takes dp2."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128,
                                      attn_implementation="sdpa", use_cache=False)
    model = transformers.LlamaForCausalLM(config).train()
    tokens = torch.randint(0, 2048, (8, 128))
    from harness.models import hf_token_loss

    options = CompileOptions(planner_profile=str(DATA / "profile_cpu_2.json"))
    chosen = measured_mesh(model, (tokens,), options, loss_fn=hf_token_loss, target=tokens, world_size=2)
    assert chosen == autoshard.Mesh(dp=2)


def test_the_ranking_and_why_the_winner_wins_are_explained(gpt, tmp_path):
    from autoshard.explain import planner_ranking
    from autoshard.planner.auto import measured_choice

    case, _ = gpt
    path = tmp_path / "p.json"
    _profile().save(path)
    mesh, options, ranking = measured_choice(case.model, case.inputs, CompileOptions(planner_profile=str(path)),
                                             loss_fn=case.loss_fn, target=case.target, world_size=2)
    assert mesh == ranking[0].mesh and options.planner_profile == str(path)
    labels = [p.label() for p in ranking]
    assert any("microbatches=4" in label for label in labels), labels  # searched for the pipeline
    lines = planner_ranking(ranking, options)
    assert lines[0].startswith("mesh='auto' from the profile") and lines[1].startswith("  1. ")
    assert lines[0].endswith("predicted steps, modelled on cpu (2 rank(s) of 1 thread(s), as measured)"), lines[0]
    assert len(lines) == 7 and lines[-1].startswith("  why: ") and "ms more" in lines[-1]


def test_a_pipeline_is_also_searched_interleaved(gpt, tmp_path):
    """Under pp, mesh='auto' also costs interleaved 1F1B with two chunks per rank, each microbatch count it tries
    (on this machine's Llama at pp2: 2 microbatches interleaved measured 182 to 191 ms, 1F1B's best 182 to 203);
    a schedule or chunks the user gave are kept."""
    from autoshard.planner.auto import _variants, measured_choice

    case, _ = gpt
    path = tmp_path / "p.json"
    _profile().save(path)
    _, _, ranking = measured_choice(case.model, case.inputs, CompileOptions(planner_profile=str(path)),
                                   loss_fn=case.loss_fn, target=case.target, world_size=2)
    interleaved = [p for p in ranking if p.options.get("schedule") == "interleaved"]
    assert {(p.mesh, p.options["chunks"], p.options["microbatches"]) for p in interleaved} == {
        (autoshard.Mesh(pp=2), 2, m) for m in (2, 4, 8)}, [p.label() for p in ranking]
    assert all(p.error is None and math.isfinite(p.step) for p in interleaved)
    default = CompileOptions()
    assert {"schedule": "interleaved", "chunks": 2} not in _variants(autoshard.Mesh(dp=2), default, default)
    for given in (CompileOptions(schedule="zb-h1"), CompileOptions(schedule="interleaved", chunks=2)):
        assert _variants(autoshard.Mesh(pp=2), given, default) == [{}]


def test_mesh_auto_searches_ep_for_a_mixture_of_experts():
    """The zoo's mixture (8 experts) at 2 ranks: every mesh, and each with the experts split over every ep that
    divides dp x cp and the experts, is compiled and costed (the all-to-alls of its rows against the experts'
    gradients left out of DDP's); a model without experts gets no ep candidate."""
    from autoshard.planner.auto import measured_choice

    profile = str(DATA / "profile_cpu_2.json")
    case = build("moe")
    _, _, ranking = measured_choice(case.model, case.inputs, CompileOptions(planner_profile=profile),
                                   loss_fn=case.loss_fn, target=case.target, world_size=2)
    eps = {(p.mesh.dp, p.mesh.cp, p.mesh.ep) for p in ranking if p.mesh.ep > 1 and p.error is None}
    assert eps == {(2, 1, 2), (1, 2, 2)}, eps
    split = next(p for p in ranking if p.mesh == autoshard.Mesh(dp=2, ep=2))
    whole = next(p for p in ranking if p.mesh == autoshard.Mesh(dp=2) and not p.options)
    # the experts' gradients leave DDP's all-reduce (each held once); their tokens cross in all-to-alls instead
    assert split.parts["gradient sync"] < whole.parts["gradient sync"]
    assert split.parts["collectives"] > whole.parts["collectives"]
    case = build("llama")
    _, _, ranking = measured_choice(case.model, case.inputs, CompileOptions(planner_profile=profile),
                                   loss_fn=case.loss_fn, target=case.target, world_size=2)
    assert all(p.mesh.ep == 1 for p in ranking)


def test_data_parallel_pays_for_copying_its_gradients_into_buckets_and_back(gpt):
    """DDP (and a pipeline's reducer) flattens the gradients into buckets for the all-reduce and copies the sums
    back: one op over the gradients' bytes (about 9 ms of GPT-2's 206 ms dp2 step here)."""
    case, compiler = gpt
    plain, slow_copies = _profile(), _profile(byte_seconds=1e-6)
    dp, dp_slow = (predict(compiler, autoshard.Mesh(dp=2), p) for p in (plain, slow_copies))
    grads = sum(p.numel() * p.element_size() for p in case.model.parameters())
    assert dp_slow.parts["gradient sync"] - dp.parts["gradient sync"] == pytest.approx((1e-6 - 1e-10) * grads)


def test_a_pipeline_step_pays_for_its_sums(gpt):
    """GPT's tied embedding and head, spread over 2 pp ranks, are gathered and reduce-scattered each step, and the
    ranks' batches gathered to be compared: with those collectives at a second each, the pipeline pays three seconds
    more; tiny all-reduces (the loss, a flag per weight) cost the profile's ``tiny``, not the fit's latency."""
    case, compiler = gpt
    slow = _profile(collectives={**_profile().collectives, "all_gather": {"2": (1.0, 0.0)},
                                 "reduce_scatter": {"2": (1.0, 0.0)}}, tiny={"2": 1e-3})
    plain, slowed = (predict(compiler, autoshard.Mesh(pp=2), p, microbatches=2) for p in (_profile(), slow))
    assert slowed.step - plain.step == pytest.approx(3.0, abs=3e-3)
    assert slowed.parts["pipeline sums"] == pytest.approx(3.0 + 2 * 1e-3, abs=1e-4)  # and its 15 KiB copied twice
    assert slow.collective_time("all_reduce", 2, 4) == 1e-3 and slow.collective_time("all_reduce", 2, 4096) > 1e-4


class _TiedOddVocab(torch.nn.Module):
    """An embedding and LM head tied, over 63 rows: 2 pp ranks cannot split them in rows, so each holds the weight
    whole and their gradients are summed."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(63, 16)
        self.blocks = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
                                            for _ in range(4)))

    def forward(self, tokens):
        return torch.nn.functional.linear(self.blocks(self.embed(tokens)), self.embed.weight)


def _pipeline_step_collectives(name: str) -> dict:
    """One pp2 step's collectives besides its sends, as ``(kind, group size, bytes)``, against what the planner
    counts for the rank's build."""
    import torch.distributed as dist

    from autoshard.planner.predict import pipeline_collectives

    if name == "tied":
        torch.manual_seed(0)
        tokens = torch.randint(0, 63, (4, 8))
        model, inputs, target = _TiedOddVocab(), (tokens,), tokens.roll(-1, 1)

        def loss_fn(logits, target):
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
    else:
        case = build(name)
        model, inputs, target, loss_fn = case.model, case.inputs, case.target, case.loss_fn
    pm = autoshard.parallelize(model, autoshard.Mesh(pp=2), example_inputs=inputs, loss_fn=loss_fn, target=target,
                               microbatches=2)
    pm.step(*inputs, target=target)  # compiled, its groups made
    seen = []
    counted = {"all_reduce": lambda a: a[0].nbytes, "all_gather": lambda a: sum(t.nbytes for t in a[0]),
               "all_gather_into_tensor": lambda a: a[0].nbytes, "reduce_scatter_tensor": lambda a: a[1].nbytes,
               "reduce_scatter_single": lambda a: a[1].nbytes, "broadcast": lambda a: a[0].nbytes}
    originals = {fn: getattr(dist, fn) for fn in counted if hasattr(dist, fn)}

    def counting(fn):
        def call(*args, **kwargs):
            kind = fn.replace("_into_tensor", "").replace("_tensor", "").replace("_single", "")
            seen.append((kind, dist.get_world_size(kwargs.get("group")), float(counted[fn](args))))
            return originals[fn](*args, **kwargs)
        return call

    try:
        for fn in originals:
            setattr(dist, fn, counting(fn))
        pm.step(*inputs, target=target)
    finally:
        for fn, original in originals.items():
            setattr(dist, fn, original)
    return {"seen": sorted(seen), "counted": sorted(pipeline_collectives(pm.builds[0], 2))}


@pytest.mark.parametrize("name", ["gpt", "llama", "tied"])
def test_a_pipeline_step_runs_the_collectives_the_planner_counts(pools, name):
    """The loss summed over the pp ranks; GPT's tied embedding and head spread over them (gathered, a flag,
    reduce-scattered); the same tied over 63 rows no rank count divides, held whole (a flag and the gradient's
    all-reduce); the batch compared across the pp ranks: each collective the runtime runs around a pipeline's
    schedule, of the bytes the planner costs."""
    for result in pools.get(2).run(_pipeline_step_collectives, name):
        assert result["seen"] == result["counted"]
        assert len(result["counted"]) == {"gpt": 5, "llama": 2, "tied": 4}[name]


def _auto_from_a_profile(path: str) -> dict:
    from autoshard.verify import compare

    case, reference = build("gpt"), build("gpt").model
    pm = autoshard.parallelize(case.model, "auto", example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, planner_profile=path)
    report = compare(reference, pm, case.inputs, case.target, loss_fn=case.loss_fn, steps=2)
    return {"ok": report.ok, "report": str(report), "mesh": pm.mesh, "explain": pm.explain()}


def test_mesh_auto_from_a_profile_trains_exactly_on_the_mesh_it_chose(pools, tmp_path):
    """Every rank compiles and costs the same candidates from the same file, so all take the same mesh."""
    path = tmp_path / "p.json"
    slow = {kind: {"2": (1e-6, 1e-5)} for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")}
    _profile(collectives={**slow, "send_recv": {"2": (1e-6, 1e-12)}}).save(path)
    results = pools.get(2).run(_auto_from_a_profile, str(path))
    for rank, result in enumerate(results):
        assert result["ok"], (rank, result["report"])
        assert result["mesh"] == autoshard.Mesh(pp=2), result["mesh"]
        assert "mesh='auto' from the profile" in result["explain"]


def _auto_under_a_limit(path: str) -> dict:
    from autoshard.verify import compare

    case, reference = build("gpt"), build("gpt").model
    pm = autoshard.parallelize(case.model, "auto", example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, planner_profile=path, memory_limit="1MiB")
    report = compare(reference, pm, case.inputs, case.target, loss_fn=case.loss_fn, steps=2)
    return {"ok": report.ok, "report": str(report), "mesh": pm.mesh, "microbatches": pm.options.microbatches,
            "explain": pm.explain()}


def test_mesh_auto_under_a_memory_limit_trains_exactly_on_what_fits(pools, tmp_path):
    """Fast links make dp2 the fastest (1.3 MiB per rank); under 1 MiB the pipeline is taken, and trains exactly."""
    path = tmp_path / "p.json"
    _profile().save(path)
    results = pools.get(2).run(_auto_under_a_limit, str(path))
    for rank, result in enumerate(results):
        assert result["ok"], (rank, result["report"])
        assert result["mesh"] == autoshard.Mesh(pp=2) and result["microbatches"] == 2, result["mesh"]
        assert "over the memory limit, though predicted faster: Mesh(dp=2" in result["explain"]


def _groups_alive() -> int:
    from torch.distributed import distributed_c10d as c10d

    return len(c10d._world.pg_map)


def _left_behind(pm, before: int) -> tuple[int, int]:
    """(the process groups alive beyond ``before`` and ``pm``'s own set, one set of ``pm``'s mesh): what ``mesh=
    "auto"`` left behind besides the model it returned; a set created and destroyed to count one."""
    alive = _groups_alive() - before
    extra = pm.mesh.create_groups()
    one_set = _groups_alive() - before - alive
    extra.destroy()
    assert _groups_alive() - before == alive, "MeshGroups.destroy() left groups alive"
    return alive - one_set, one_set


def _auto_tuned(path: str) -> dict:
    from autoshard.verify import compare

    case, reference = build("gpt"), build("gpt").model
    before = _groups_alive()
    pm = autoshard.parallelize(case.model, "auto", example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, planner_profile=path, autotune=2)
    left = _left_behind(pm, before)
    report = compare(reference, pm, case.inputs, case.target, loss_fn=case.loss_fn, steps=2)
    return {"ok": report.ok, "report": str(report), "mesh": pm.mesh, "ranking": pm.ranking, "explain": pm.explain(),
            "left": left}


def test_autotune_trains_the_predicted_fastest_and_takes_the_fastest_measured(pools, tmp_path):
    """``autotune=2``: the two fastest predictions are compiled and trained on the job's ranks; the mesh taken is the
    faster measured (the slower rank's median, so both ranks agree), and it trains exactly."""
    path = tmp_path / "p.json"
    _profile().save(path)
    results = pools.get(2).run(_auto_tuned, str(path), timeout=300)
    assert results[0]["mesh"] == results[1]["mesh"]
    for rank, result in enumerate(results):
        assert result["ok"], (rank, result["report"])
        measured = [p for p in result["ranking"] if p.measured is not None]
        assert len(measured) == 2 and all(p.measured > 0 for p in measured), result["ranking"]
        assert result["mesh"] == min(measured, key=lambda p: p.measured).mesh == result["ranking"][0].mesh
        assert "measured: the 2 fastest predicted trained on this job's ranks (autotune=2)" in result["explain"]
        assert result["left"][0] == 0 < result["left"][1], result["left"]  # the trials' groups destroyed with them
    assert [p.measured for p in results[0]["ranking"][:2]] == [p.measured for p in results[1]["ranking"][:2]]


def test_autotune_is_refused_without_mesh_auto_and_a_profile():
    case = build("gpt")
    for mesh, options in ((autoshard.Mesh(), {}), ("auto", {})):
        with pytest.raises(ValueError, match="autotune=2 measures the fastest meshes mesh='auto' predicts"):
            autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                                  target=case.target, autotune=2, **options)
    with pytest.raises(ValueError, match="autotune=-1 is not valid"):
        CompileOptions(autotune=-1)


def _auto_calibrated() -> dict:
    from autoshard.verify import compare

    case, reference = build("llama"), build("llama").model
    before = _groups_alive()
    pm = autoshard.parallelize(case.model, "auto", example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, calibrate=True)
    left = _left_behind(pm, before)
    report = compare(reference, pm, case.inputs, case.target, loss_fn=case.loss_fn, steps=2)
    return {"ok": report.ok, "report": str(report), "mesh": pm.mesh, "explain": pm.explain(), "left": left}


def test_mesh_auto_calibrating_its_own_ranks_trains_exactly_on_the_mesh_it_chose(pools):
    """``calibrate=True``: the job's 2 ranks measure this machine together, rank 0's profile reaches both, and both
    take the same mesh from it."""
    results = pools.get(2).run(_auto_calibrated, timeout=300)
    assert results[0]["mesh"] == results[1]["mesh"]
    for rank, result in enumerate(results):
        assert result["ok"], (rank, result["report"])
        assert result["left"][0] == 0 < result["left"][1], result["left"]  # the calibration's groups destroyed
        assert "mesh='auto' from a calibration of this job's ranks" in result["explain"]
