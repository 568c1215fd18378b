"""Resuming exactly under any mesh: parameters, AdamW's state, the LR schedule and the step move between meshes."""

from __future__ import annotations

import pytest

from harness import golden_resume

FSDP = {"data_parallel": "fsdp"}
PP = {"microbatches": 2}

# (id, save mesh, its options, load mesh, its options)
PAIRS = [
    ("dp2xtp2-to-tp2xpp2", {"dp": 2, "tp": 2}, {}, {"tp": 2, "pp": 2}, PP),
    ("fsdp-dp2-to-ddp-dp2", {"dp": 2}, FSDP, {"dp": 2}, {}),
    ("pp2-to-tp4", {"pp": 2}, PP, {"tp": 4}, {}),
    ("tp2xcp2-to-dp4", {"tp": 2, "cp": 2}, {}, {"dp": 4}, {}),
    ("fsdp-dp2xtp2-to-tp4", {"dp": 2, "tp": 2}, FSDP, {"tp": 4}, {}),
    ("tp2xpp2-to-fsdp-dp2xtp2", {"tp": 2, "pp": 2}, PP, {"dp": 2, "tp": 2}, FSDP),
]


def _world(mesh: dict) -> int:
    out = 1
    for axis, degree in mesh.items():
        out *= degree if axis != "ep" else 1  # ep is carved from dp
    return out


def _check(results: list[dict], first: list[float]) -> None:
    for rank, result in enumerate(results):
        losses = first + result["losses"]
        assert len(losses) == len(result["reference"]) == 2 * golden_resume.HALF
        for got, expected in zip(losses, result["reference"], strict=True):
            assert abs(got - expected) <= 1e-5 * max(1.0, abs(expected)), (rank, losses, result["reference"])
        assert result["param"] < 1e-5, (rank, result["param"])
        assert result["state"] < 1e-5, (rank, result["state"])
        assert result["hyper_equal"], rank


@pytest.mark.parametrize("pair", PAIRS, ids=[p[0] for p in PAIRS])
@pytest.mark.parametrize("name", ["gpt", "hf_llama"])
def test_a_run_resumes_under_another_mesh_as_if_it_had_not_stopped(pools, tmp_path, name, pair):
    _, save, save_options, load, load_options = pair
    path = str(tmp_path / "ckpt")
    first = pools.get(_world(save)).run(golden_resume.first_half, name, save, path, save_options)[0]
    results = pools.get(_world(load)).run(golden_resume.second_half, name, load, path, load_options)
    assert all(r["step"] == golden_resume.HALF for r in results)
    _check(results, first)


@pytest.mark.parametrize("kind", ["sgd", "adam", "adagrad", "rmsprop"])
def test_other_optimizers_resume_under_another_mesh(pools, tmp_path, kind):
    """SGD with Nesterov momentum, Adam with amsgrad, Adagrad, centred RMSprop: every per-parameter state moves."""
    path = str(tmp_path / "ckpt")
    run = golden_resume.with_optimizer
    first = pools.get(4).run(run, kind, golden_resume.first_half, "gpt", {"dp": 2, "tp": 2}, path)[0]
    _check(pools.get(4).run(run, kind, golden_resume.second_half, "gpt", {"tp": 2, "pp": 2}, path, PP), first)


def test_a_single_process_run_moves_to_eight_ranks_and_back(pools, tmp_path):
    """Unsharded (get_optimizer_state_dict) -> dp2 x tp2 x pp2 -> unsharded (set_optimizer_state_dict)."""
    mesh = {"dp": 2, "tp": 2, "pp": 2}
    path = str(tmp_path / "single.pt")
    first = golden_resume.single_first_half("gpt", path)
    _check(pools.get(8).run(golden_resume.second_half, "gpt", mesh, path, PP, full=True), first)
    path = str(tmp_path / "eight.pt")
    first = pools.get(8).run(golden_resume.first_half, "gpt", mesh, path, PP, full=True)[0]
    _check([golden_resume.single_second_half("gpt", path)], first)


# corpus architectures and layouts whose state must move with a non-slice shard
LAYOUTS = [
    ("corpus/gpt_neox", "fused qkv per head"),
    ("corpus/falcon", "multi-query attention, fused qkv"),
    ("corpus/gpt2", "Conv1D weights, tied head"),
    ("corpus/mixtral", "mixture of experts"),
    ("gpt_vocab101", "a padded vocabulary"),
    ("corpus/phi3", "fused qkv whose k and v blocks tp=4 holds whole (2 kv heads)"),
]


@pytest.mark.parametrize("name", [n for n, _ in LAYOUTS])
def test_state_of_fused_padded_tied_and_expert_weights_moves_between_tp_degrees(pools, tmp_path, name):
    path = str(tmp_path / "ckpt")
    first = pools.get(2).run(golden_resume.first_half, name, {"tp": 2}, path)[0]
    _check(pools.get(4).run(golden_resume.second_half, name, {"tp": 4}, path), first)


def test_a_fused_projection_with_kv_blocks_held_whole_moves_back_to_fewer_ranks(pools, tmp_path):
    """Saved at tp=4, where phi3's k and v blocks are whole on every rank (written once), resumed at tp=2."""
    path = str(tmp_path / "ckpt")
    first = pools.get(4).run(golden_resume.first_half, "corpus/phi3", {"tp": 4}, path)[0]
    _check(pools.get(2).run(golden_resume.second_half, "corpus/phi3", {"tp": 2}, path), first)


@pytest.mark.parametrize("kind", ["adamw", "adagrad", "rmsprop"])
@pytest.mark.parametrize("mesh,options", [({"tp": 2, "pp": 2}, PP), ({"dp": 2, "tp": 2}, FSDP)],
                         ids=["tp2xpp2", "fsdp-dp2xtp2"])
def test_resuming_under_the_same_mesh_is_bit_identical(pools, tmp_path, mesh, options, kind):
    run = golden_resume.with_optimizer
    for result in pools.get(4).run(run, kind, golden_resume.same_mesh, "hf_llama", mesh, str(tmp_path / "ckpt"),
                                   options):
        assert result["resumed"] == result["straight"] and result["bitwise"], result
        assert result["steps"] == 2 * golden_resume.HALF


def test_dropout_streams_are_restored_under_the_same_mesh(pools, tmp_path):
    """GPT-2 with dropout 0.1 at dp=2: the resumed run draws the masks the straight run drew."""
    for result in pools.get(2).run(golden_resume.same_mesh, "hf_gpt2_dropout", {"dp": 2}, str(tmp_path / "ckpt")):
        assert result["resumed"] == result["straight"] and result["bitwise"], result


def test_random_streams_under_another_mesh_are_seeded_from_the_checkpoint(pools, tmp_path):
    results = pools.get(4).run(golden_resume.rng_under_another_mesh, "gpt", {"tp": 2, "dp": 2}, {"dp": 4},
                               str(tmp_path / "ckpt"))
    assert all(r["repeatable"] for r in results)
    assert len({tuple(r["draw"]) for r in results}) == 4  # each rank its own stream


def test_bad_checkpoints_and_optimizers_are_refused_clearly(pools, tmp_path):
    results = pools.get(2).run(golden_resume.refusals, str(tmp_path))
    assert results[0] == results[1]
    found = results[0]
    expected = {
        "no optimizer state": "holds no optimizer state: it was saved without optimizer=",
        "another optimizer": "holds the state of a torch.optim.adamw.AdamW, not of a torch.optim.sgd.SGD",
        "LBFGS": "LBFGS keeps state",
        "other groups": "saved with different hyperparameters (weight_decay)",
        "positions": "keyed by positions",
        "foreign optimizer": "not one of this parallel model's parameters",
        "another model": "was not written for this model",
        "missing file": "__1_0.distcp is missing (written by rank 1)",
        "missing directory": "no checkpoint at",
    }
    for what, words in expected.items():
        assert words in found[what], (what, found[what])


def test_a_checkpoint_written_in_the_background_holds_the_state_at_the_call(pools, tmp_path):
    for result in pools.get(2).run(golden_resume.asynchronous_save, "gpt", {"tp": 2}, str(tmp_path / "ckpt")):
        assert result == {"param": 0.0, "state": 0.0, "step": 1.0}, result


@pytest.mark.parametrize("save,load", [({"pp": 2}, {"dp": 2}), ({"dp": 2}, {"pp": 2})],
                         ids=["pp2-to-dp2", "dp2-to-pp2"])
def test_weights_spread_over_pipeline_ranks_resume_under_another_mesh(pools, tmp_path, save, load):
    """ALBERT's one shared layer is read on both pp=2 stages: each rank stores its rows of it (and of AdamW's
    state for it); a checkpoint holds it whole, as any other mesh holds it."""
    path = str(tmp_path / "ckpt")
    options = lambda mesh: PP if "pp" in mesh else {}  # noqa: E731
    first = pools.get(2).run(golden_resume.first_half, "corpus/mlm/albert", save, path, options(save))[0]
    _check(pools.get(2).run(golden_resume.second_half, "corpus/mlm/albert", load, path, options(load)), first)


# experts split over ep, moved to more ep ranks, to tp, and from tp with ep inside
EP_PAIRS = [
    ("ep2-to-ep4", {"dp": 2, "ep": 2}, {"dp": 4, "ep": 4}),
    ("ep2-to-tp2", {"dp": 2, "ep": 2}, {"tp": 2}),
    ("tp2-to-ep2xtp2", {"tp": 2}, {"dp": 2, "ep": 2, "tp": 2}),
    ("cp2xep2-to-ep2", {"cp": 2, "ep": 2}, {"dp": 2, "ep": 2}),
    ("dp2xcp2xep4-to-tp2", {"dp": 2, "cp": 2, "ep": 4}, {"tp": 2}),
]


@pytest.mark.parametrize("save,save_options,load,load_options", [
    ({"dp": 2, "ep": 2}, FSDP, {"dp": 4, "ep": 4}, {}), ({"dp": 2, "ep": 2}, {}, {"dp": 4, "ep": 2}, FSDP)],
    ids=["fsdp-ep2-to-ep4", "ep2-to-fsdp-dp4xep2"])
def test_experts_under_fsdp_resume_under_another_split(pools, tmp_path, save, save_options, load, load_options):
    """FSDP2 shards every other parameter (and its AdamW moments) over dp x cp while the experts stay their ep
    rank's rows: a checkpoint written either way loads under the other."""
    path = str(tmp_path / "ckpt")
    first = pools.get(_world(save)).run(golden_resume.first_half, "corpus/mixtral", save, path, save_options)[0]
    _check(pools.get(_world(load)).run(golden_resume.second_half, "corpus/mixtral", load, path, load_options), first)


@pytest.mark.parametrize("pair", EP_PAIRS, ids=[p[0] for p in EP_PAIRS])
@pytest.mark.parametrize("name", ["corpus/mixtral", "corpus/gpt_oss"])
def test_experts_split_over_ep_resume_under_another_split(pools, tmp_path, name, pair):
    """Each ep rank writes its experts as its rows of one tensor (and their AdamW moments alike): any other split
    reads exactly its part."""
    _, save, load = pair
    path = str(tmp_path / "ckpt")
    first = pools.get(_world(save)).run(golden_resume.first_half, name, save, path, {})[0]
    _check(pools.get(_world(load)).run(golden_resume.second_half, name, load, path, {}), first)


def test_experts_looped_one_at_a_time_resume_at_more_ep_ranks(pools, tmp_path):
    """The zoo's mixture whose experts run one at a time (torchtitan's loop, split over ep as its grouped matmuls):
    saved at dp2 x ep2 (each rank half of every stack), resumed at dp4 x ep4 (a quarter) as if it had not stopped."""
    path = str(tmp_path / "ckpt")
    first = pools.get(2).run(golden_resume.first_half, "moe_loop", {"dp": 2, "ep": 2}, path, {})[0]
    _check(pools.get(4).run(golden_resume.second_half, "moe_loop", {"dp": 4, "ep": 4}, path, {}), first)


def test_experts_held_as_separate_modules_resume_at_more_ep_ranks(pools, tmp_path):
    """The zoo's mixture with litgpt's experts (modules of a list, each held by one ep rank): saved at dp2 x ep2 (each
    rank half of the experts, and their AdamW moments), resumed at dp4 x ep4 (a quarter) as if it had not stopped."""
    path = str(tmp_path / "ckpt")
    first = pools.get(2).run(golden_resume.first_half, "moe_list", {"dp": 2, "ep": 2}, path, {})[0]
    _check(pools.get(4).run(golden_resume.second_half, "moe_list", {"dp": 4, "ep": 4}, path, {}), first)
