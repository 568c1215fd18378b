"""The parallel model in an ordinary training loop: accumulation, train/eval, bad data, new shapes, odd models."""

from __future__ import annotations

import pytest

import autoshard

from harness import golden_loop


@pytest.mark.parametrize("mesh", [{"dp": 2}, {"cp": 2}, {"pp": 2}, {"tp": 2}], ids=["dp2", "cp2", "pp2", "tp2"])
def test_gradient_accumulation_over_steps_equals_eager(pools, mesh):
    for result in pools.get(2).run(golden_loop.accumulation, "gpt", mesh):
        assert result["compared"] > 0


@pytest.mark.parametrize("mesh,options", [({"dp": 2, "pp": 2}, {"microbatches": 2}),
                                          ({"dp": 2, "cp": 2}, {}),
                                          ({"dp": 2, "tp": 2}, {"data_parallel": "fsdp"})],
                         ids=["dp2xpp2", "dp2xcp2", "fsdp-dp2xtp2"])
def test_gradient_accumulation_on_four_ranks(pools, mesh, options):
    for result in pools.get(4).run(golden_loop.accumulation, "gpt", mesh, **options):
        assert result["compared"] > 0


@pytest.mark.parametrize("mesh", [{"dp": 2}, {"tp": 2}, {"pp": 2}], ids=["dp2", "tp2", "pp2"])
def test_eval_turns_dropout_off_and_train_turns_it_on(pools, mesh):
    for result in pools.get(2).run(golden_loop.eval_mode, "hf_gpt2", mesh):
        assert result["training"] is True
        assert result["train_mode_differs"] > 1e-3, "pm.train() did not turn dropout back on"


BAD = ["big id", "negative id", "big target", "negative target"]


@pytest.mark.parametrize("what", BAD)
@pytest.mark.parametrize("mesh", [{"tp": 2}, {"dp": 2}, {"pp": 2}, {"cp": 2}], ids=["tp2", "dp2", "pp2", "cp2"])
def test_ids_and_targets_outside_the_vocabulary_raise_on_every_rank(pools, mesh, what):
    results = pools.get(2).run(golden_loop.bad_data, "gpt", mesh, what)
    expected = "IndexError: Target" if "target" in what else "IndexError: index out of range in self"
    for rank, message in enumerate(results):
        assert message.startswith(expected), f"rank {rank}: {message}"


@pytest.mark.parametrize("what", ["big id", "big target"])
def test_bad_data_raises_on_all_ranks_of_a_three_axis_mesh(pools, what):
    results = pools.get(8).run(golden_loop.bad_data, "hf_llama", {"dp": 2, "tp": 2, "pp": 2}, what, microbatches=2)
    assert all(m.startswith("IndexError") for m in results), results


@pytest.mark.parametrize("what", ["model", "another batch", "shuffled"])
@pytest.mark.parametrize("mesh", [{"dp": 2}, {"tp": 2}, {"pp": 2}, {"cp": 2}], ids=["dp2", "tp2", "pp2", "cp2"])
def test_a_rank_given_another_model_or_batch_is_refused_on_every_rank(pools, mesh, what):
    """autoshard splits the one model and the one global batch every rank holds: a rank built under another seed, or
    reading another batch (a DistributedSampler kept from a DDP script) trained parts of models and batches that
    were never one, silently."""
    options = {"microbatches": 2} if "pp" in mesh else {}
    results = pools.get(2).run(golden_loop.ranks_differ, "gpt", mesh, what, **options)
    said = "the model's parameters" if what == "model" else "step 2's batch"
    for message in results:
        assert message.startswith(f"RanksDiffer: {said} on rank 1 differs from rank 0's"), results


def test_with_local_batch_each_dp_rank_trains_on_its_own_batch(pools):
    results = pools.get(2).run(golden_loop.ranks_differ, "gpt", {"dp": 2}, "local batch", local_batch=True)
    assert results == ["trained", "trained"], results


@pytest.mark.parametrize("options", [{"cp_attention": "alltoall"},
                                     {"cp_attention": "alltoall", "cp_load_balance": True}],
                         ids=["alltoall", "alltoall-balanced"])
def test_a_sequence_the_cp_ranks_cannot_split_evenly_is_refused_alike_on_every_rank(pools, options):
    results = pools.get(2).run(golden_loop.new_shape, "gpt", {"cp": 2}, 15, **options)
    assert results[0] == results[1], results
    assert results[0].startswith("ValueError") and "length 15" in results[0], results[0]
    assert "use cp attention 'gather' or 'ring'" in results[0] and "pad the sequence so that it is a multiple of" in \
        results[0]


@pytest.mark.parametrize("length", [12, 15], ids=["even", "uneven"])
@pytest.mark.parametrize("options", [{}, {"cp_load_balance": True}], ids=["gather", "load-balanced"])
def test_a_new_sequence_length_gets_its_own_cp_plan(pools, options, length):
    """Gathered keys take any length: 15 tokens are split 8 and 7 (or 4 + 4 and 4 + 3 load balanced)."""
    assert pools.get(2).run(golden_loop.new_shape, "gpt", {"cp": 2}, length, **options) == ["accepted"] * 2


@pytest.mark.parametrize("mesh,options", [({"pp": 2}, {}), ({"pp": 2}, {"microbatches": 2, "schedule": "gpipe"})],
                         ids=["pp2", "pp2-gpipe"])
def test_a_tiny_head_leaves_no_pipeline_stage_without_parameters(pools, mesh, options):
    for rank, result in enumerate(pools.get(2).run(golden_loop.tiny_head, mesh, **options)):
        assert result["held"] > 0, f"pp rank {rank} holds no parameters"
        assert result["ok"] and result["compared"] > 0, result["report"]


@pytest.mark.parametrize("mesh,world,options", [({"dp": 2, "tp": 2, "pp": 2}, 8, {"microbatches": 2})],
                         ids=["dp2xtp2xpp2"])
def test_a_weight_shared_by_three_uses_on_two_stages_is_exact(pools, mesh, world, options):
    for rank, result in enumerate(pools.get(world).run(golden_loop.shared_thrice, mesh, **options)):
        assert result["ok"] and result["compared"] > 0, f"rank {rank}:\n{result['report']}"


@pytest.mark.parametrize("mesh,world", [({"tp": 2, "pp": 2}, 4), ({"dp": 2, "tp": 2, "pp": 2}, 8)],
                         ids=["tp2xpp2", "dp2xtp2xpp2"])
def test_t5_with_its_embeddings_and_head_tied_is_exact(pools, mesh, world):
    """The decoder's cross-attention reads the encoder output received from the previous stage directly with
    column-parallel linears: their input gradient must be summed over tp before it is sent back."""
    for rank, result in enumerate(pools.get(world).run(golden_loop.t5_shared, mesh, microbatches=2)):
        assert result["ok"] and result["compared"] > 0, f"rank {rank}:\n{result['report']}"


@pytest.mark.parametrize("mesh", [{"tp": 2}, {"pp": 2}], ids=["tp2", "pp2"])
def test_optimizer_groups_built_from_named_parameters_use_the_model_s_names(pools, mesh):
    for result in pools.get(2).run(golden_loop.optimizer_groups, "gpt", mesh):
        assert result["names"] > 0 and result["unknown"] == [], result
        assert result["worst"] < 1e-5, result


@pytest.mark.parametrize("mesh,world,before,options", [
    ({"tp": 2}, 2, False, {}), ({"tp": 2}, 2, True, {}), ({"dp": 2}, 2, False, {"data_parallel": "fsdp"}),
    ({"pp": 2}, 2, True, {"microbatches": 2}), ({"dp": 2, "tp": 2, "pp": 2}, 8, False, {"microbatches": 2})],
    ids=["tp2-after", "tp2-before", "fsdp2-after", "pp2-before", "dp2xtp2xpp2-after"])
def test_an_optimizer_over_the_users_model_trains_this_ranks_tensors(pools, mesh, world, before, options):
    """At tp2 an optimizer over ``model.parameters()`` stepped only the replicated parameters (the loss went 4.960,
    4.956 where eager gives 4.776): at its first step it now holds this rank's tensors for them, group by group
    (built from ``named_parameters()``, weight decay kept), and ``torch.nn.utils.clip_grad_norm_(model.parameters(),
    ...)`` clips by the global norm: AdamW's parameters after two steps are the unsharded run's."""
    for result in pools.get(world).run(golden_loop.optimizer_over_the_model, "gpt", mesh, before, **options):
        assert result["worst"] < 5e-5 and result["all_mine"], result


def test_an_optimizer_that_stepped_the_model_before_parallelize_is_refused(pools):
    """Its state is of the whole tensors, while the rank trains its shards: refused at its next step, saying why."""
    for result in pools.get(2).run(golden_loop.optimizer_stepped_before, "gpt", {"tp": 2}):
        assert "has already stepped parameters of the model" in result and "Build a new optimizer" in result, result


@pytest.mark.parametrize("mesh,options", [({"tp": 2}, {}), ({"pp": 2}, {"microbatches": 2}),
                                          ({"dp": 2}, {"data_parallel": "fsdp"})], ids=["tp2", "pp2", "fsdp2"])
def test_the_users_model_refuses_its_old_weights_until_update_model_writes_the_trained_ones(pools, mesh, options):
    """The model given to ``parallelize`` kept its weights from before training, some tensors changed and others
    not, differently on each rank: called or read after a step it now refuses, naming ``pm.update_model()``, and
    after that its outputs and state dict are the unsharded run's."""
    for result in pools.get(2).run(golden_loop.the_models_own_object, "gpt", mesh, **options):
        assert result["untouched"] and result["worst"] < 5e-5, result
        assert len(result["refused"]) == 2 and all("pm.update_model()" in e for e in result["refused"]), result
        assert result["out"] < 5e-5 and result["state"] < 5e-5 and result["keys"], result


@pytest.mark.parametrize("mesh", [{"dp": 2}, {"pp": 2}, {"cp": 2}, {"tp": 2}], ids=["dp2", "pp2", "cp2", "tp2"])
def test_backward_from_the_parallel_models_outputs_says_that_step_trains(pools, mesh):
    """``loss_fn(pm(x), y).backward()`` raised torch's "element 0 of tensors does not require grad" at dp2 and pp2,
    and at cp2 it gave gradients off by 0.06 with no error: it now raises on every mesh, naming ``pm.step``."""
    for result in pools.get(2).run(golden_loop.eager_backward, "gpt", mesh):
        assert "that call is inference" in result and "pm.step(*inputs, target=target)" in result, result


@pytest.mark.parametrize("mesh,world,options", [
    ({"tp": 2}, 2, {}), ({"pp": 2}, 2, {"microbatches": 2}), ({"dp": 2}, 2, {}),
    ({"dp": 2, "tp": 2, "pp": 2}, 8, {"microbatches": 2})], ids=["tp2", "pp2", "dp2", "dp2xtp2xpp2"])
def test_torchs_clip_grad_norm_over_the_parallel_model_clips_by_the_global_norm(pools, mesh, world, options):
    """``torch.nn.utils.clip_grad_norm_(pm.parameters(), ...)`` had clipped each rank by its own shards' norm at tp2
    and pp2: now the norm it returns and the parameters after two clipped steps are the unsharded model's."""
    for result in pools.get(world).run(golden_loop.torch_clip, "gpt", mesh, **options):
        for got, expected in result["norms"]:
            assert abs(got - expected) <= 1e-4 * expected, result["norms"]
        assert result["worst"] < 1e-5, result


def test_an_optimizer_over_the_users_model_trains_where_the_rank_trains_the_models_own_tensors(pools):
    """Under dp alone each rank trains the model's own tensors: the user's optimizer is the right one as it is."""
    for result in pools.get(2).run(golden_loop.optimizer_over_the_model, "gpt", {"dp": 2}, False):
        assert result["worst"] < 5e-5 and result["all_mine"], result


@pytest.mark.parametrize("mesh,options", [({"dp": 2}, {}), ({"tp": 2}, {}), ({"pp": 2}, {"microbatches": 2}),
                                          ({"cp": 2}, {}), ({"cp": 2}, {"cp_attention": "ring"}),
                                          ({"cp": 2}, {"cp_attention": "alltoall", "cp_load_balance": True})],
                         ids=["dp2", "tp2", "pp2", "cp2", "cp2-ring", "cp2-alltoall"])
def test_a_padded_batch_with_its_attention_mask_is_exact(pools, mesh, options):
    for rank, result in enumerate(pools.get(2).run(golden_loop.padded_batch, "hf_llama", mesh, **options)):
        assert result["ok"] and result["compared"] > 0, f"rank {rank}:\n{result['report']}"


@pytest.mark.parametrize("mesh,world,options", [({"dp": 2}, 2, {}), ({"dp": 2}, 2, {"microbatches": 2})],
                         ids=["dp2", "dp2-m2"])
def test_parameters_the_loss_gets_no_gradient_from_train_under_data_parallelism(pools, mesh, world, options):
    for rank, result in enumerate(pools.get(world).run(golden_loop.params_without_gradients, mesh, **options)):
        assert result["ok"] and result["compared"] > 0, f"rank {rank}:\n{result['report']}"


@pytest.mark.parametrize("mesh,options", [({"dp": 2}, {}), ({"tp": 2}, {}), ({"pp": 2}, {"microbatches": 2})],
                         ids=["dp2", "tp2", "pp2"])
def test_a_function_whose_forward_runs_without_gradients_trains_exactly(pools, mesh, options):
    """A custom autograd Function whose forward runs without gradients and whose backward is its own (reversible
    layers): it used to be refused (the capture saw a loss depending on no parameter); kept whole, it is exact."""
    for rank, result in enumerate(pools.get(2).run(golden_loop.hidden_from_capture, mesh, **options)):
        assert result["ok"] and result["compared"] > 0, f"rank {rank}:\n{result['report']}"


@pytest.mark.parametrize("options", [{"pipeline_starts": ["blocks.2"]}, {"pipeline_starts": ["blocks.2"],
                                                                         "microbatches": 2}], ids=["m1", "m2"])
def test_a_stage_that_updates_a_received_activation_in_place_is_exact(pools, options):
    """``hidden *= scale`` as a stage's first op on the activation it received (Gemma 4 at pp=2): the received
    value is a leaf that requires grad, which refuses in-place updates."""
    for rank, result in enumerate(pools.get(2).run(golden_loop.in_place_at_the_cut, {"pp": 2}, **options)):
        assert result["ok"] and result["compared"] > 0, f"rank {rank}:\n{result['report']}"


@pytest.mark.parametrize("options", [{"microbatches": 2}, {"microbatches": 4, "schedule": "zbv"}],
                         ids=["1f1b", "zbv"])
def test_a_stages_failure_ends_the_step_on_its_peer_at_once_with_its_error(pools, options):
    """The last stage's forward raises on its rank: its peer, waiting for gradients, had waited out the 120-s
    collective timeout; now the failing rank hands its peers what they wait for (zeros, no gradient) and says why in
    the job's store, so every rank ends the step within seconds naming the failing rank's error."""
    results = pools.get(2).run(golden_loop.stage_failure, {"pp": 2}, **options)
    for rank, result in enumerate(results):
        assert result["error"] is not None and "the stage's own error" in result["error"], (rank, result)
        assert result["seconds"] < 10, (rank, result)
        assert result["after"] is None, (rank, result)  # the drained pipeline's groups are in step: it trains on


# not the ring: a gloo point-to-point wait cannot be sliced (a timed-out wait closes its connection)
@pytest.mark.parametrize("mesh,attention,options", [({"tp": 2}, False, {}), ({"dp": 2}, False, {}),
                                                    ({"cp": 2}, True, {})], ids=["tp2", "dp2", "cp2"])
def test_a_ranks_failure_ends_the_step_on_its_peers_at_once_and_later_steps_are_refused(pools, mesh, attention,
                                                                                        options):
    """Rank 1's forward raises; rank 0 waits in a collective of that step (tp's all-reduce, DDP's bucket, cp's
    gathers or ring): it had waited out the group's timeout. Now it ends within seconds with rank 1's error. Rank 0
    then holds a collective rank 1 never joined: the next step pairs them wrongly (rank 1's step had "succeeded" on
    rank 0's stale data), so it is refused on both ranks, naming the group and the counts that differ."""
    results = pools.get(2).run(golden_loop.stage_failure, mesh, (1,), attention, **options)
    for rank, result in enumerate(results):
        assert result["error"] is not None and "the stage's own error" in result["error"], (rank, result)
        assert rank == 1 or result["error"].startswith("PeerFailed: rank 1"), (rank, result)
        assert result["seconds"] < 10, (rank, result)
        assert result["after"] is not None and "out of step" in result["after"], (rank, result)


@pytest.mark.parametrize("mesh,options", [({"tp": 2}, {"peak_tflops": "measure"}), ({"pp": 2}, {"microbatches": 2})],
                         ids=["tp2", "pp2"])
def test_each_step_reports_its_time_tokens_flops_memory_and_bubble(pools, mesh, options, tmp_path):
    """As torchtitan logs a step: ``pm.metrics()`` and one line per step on the ``autoshard`` logger (rank 0) with
    the loss, tokens/s, TFLOP/s, MFU against a peak measured or given, memory, and under pp the bubble; and progress
    lines for the capture and the compile. ``pm.timeline(trace=...)`` writes the last pipeline step as a Chrome
    trace."""
    results = pools.get(2).run(golden_loop.metrics_of_a_step, "gpt", mesh, str(tmp_path / "trace"), **options)
    for rank, result in enumerate(results):
        found = result["metrics"]
        assert found["step"] == 2 and found["seconds"] > 0 and found["tokens"] == result["tokens"], found
        assert found["tokens_per_second"] == pytest.approx(found["tokens"] / found["seconds"])
        assert found["tflops_per_device"] > 0 and found["memory"] > 0 and found["loss"] == result["losses"][1]
        assert ("mfu" in found) == ("peak_tflops" in options) and 0 < found.get("mfu", 0.5) < 1, found
        steps = [line for line in result["lines"] if line.startswith("autoshard: step ")]
        progress = [line for line in result["lines"] if "compiled this rank's program" in line]
        if rank == 0:
            assert len(steps) == 2 and "tokens/s" in steps[1] and "TFLOP/s" in steps[1], result["lines"]
            assert progress and any("captured" in line for line in result["lines"]), result["lines"]
        else:
            assert not steps and not progress, "rank 0 speaks for the job"
        if "pp" in mesh:
            assert 0 <= found["bubble"] < 1 and "bubble" in (steps[1] if rank == 0 else "bubble")
    if "pp" in mesh:  # one trace: a process per rank, a slice per action (F and B of 2 microbatches, their messages)
        events = results[0]["events"]
        assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == {
            "rank 0 {'pp': 0, 'dp': 0, 'cp': 0, 'tp': 0}", "rank 1 {'pp': 1, 'dp': 0, 'cp': 0, 'tp': 0}"}, events
        for pid in (0, 1):
            computed = [e for e in events if e["ph"] == "X" and e["pid"] == pid and e["tid"] == 0]
            sent = [e for e in events if e["ph"] == "X" and e["pid"] == pid and e["tid"] == 1]
            assert len(computed) == 4 and len(sent) == 4 and all(e["dur"] >= 0 for e in computed), events


def test_a_tensorboard_directory_without_tensorboard_is_refused_naming_the_package(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as where the package is not installed
    with pytest.raises(ValueError, match="pip install tensorboard"):
        autoshard.CompileOptions(tensorboard="runs/")
    with pytest.raises(ValueError, match="peak_tflops=-1 is not valid"):
        autoshard.CompileOptions(peak_tflops=-1)


@pytest.mark.parametrize("mesh,options", [({"tp": 2}, {}), ({"dp": 2}, {}), ({"pp": 2}, {"microbatches": 2})],
                         ids=["tp2", "dp2", "pp2"])
def test_generate_gives_the_unsharded_models_tokens_and_captures_once_per_bucket(pools, mesh, options):
    """``pm.generate`` on HF Llama: the greedy tokens of the unsharded model's own ``generate``, and its sampled
    tokens under one seed (top-k 50, as HF's default), on every rank; 10 new tokens from a 6-token prompt capture
    the lengths 8 and 16 (bucket 8) and the exact prompt once (the check that the padding is not read), where a
    loop over lengths had captured 10."""
    for rank, result in enumerate(pools.get(2).run(golden_loop.generated, "hf_llama", mesh, **options)):
        assert result["greedy"] == result["reference_greedy"], (rank, result)
        assert result["sampled"] == result["reference_sampled"], (rank, result)
        assert len(result["inference_shapes"]) <= 3, (rank, result["inference_shapes"])


@pytest.mark.parametrize("kind,mesh,world,options", [("lora", {"tp": 2}, 2, {}), ("ia3", {"tp": 2}, 2, {}),
                                                     ("lora", {"dp": 2, "pp": 2}, 4, {"microbatches": 2})],
                         ids=["lora-tp2", "ia3-tp2", "lora-dp2xpp2"])
def test_a_peft_model_trains_as_it_is_and_saves_the_adapter_peft_loads(pools, kind, mesh, world, options, tmp_path):
    """``get_peft_model(llama, LoraConfig(...))`` (or IA3) given to ``parallelize`` as it is trains exactly, and
    ``pm.save_pretrained`` writes PEFT's own adapter files (it had written the whole model with ``base_layer`` keys,
    which ``from_pretrained`` then re-initialised): ``PeftModel.from_pretrained`` reads back the adapter bit for bit
    as the parallel model trained it."""
    results = pools.get(world).run(golden_loop.peft_adapter, kind, mesh, str(tmp_path / "adapter"), **options)
    for rank, result in enumerate(results):
        assert result["worst"] < 1e-5 and result["trained"] > 0, (rank, result)
    assert "adapter_model.safetensors" in results[0]["files"] and "model.safetensors" not in results[0]["files"]
    assert results[0]["as_saved"] and results[0]["adapter"] < 1e-5 and results[0]["outputs"] < 1e-5, results[0]


def test_the_trainers_batch_reaches_a_peft_model_through_the_model_it_wraps():
    """``PeftModel.forward(*args, **kwargs)`` names no input: the Trainer's batch had been refused ("drop those
    columns", wrong advice); its columns are now read off the base model's forward, which PEFT passes them to."""
    from peft import LoraConfig, get_peft_model

    from autoshard.hf import positional_inputs

    from harness.models import build

    case = build("hf_llama")
    model = get_peft_model(case.model, LoraConfig(r=4, target_modules=["q_proj"]))
    ids = case.inputs[0]
    inputs, labels = positional_inputs(model, {"input_ids": ids, "attention_mask": None, "labels": ids})
    assert len(inputs) == 1 and inputs[0] is ids and labels is ids


def test_progress_is_said_on_a_terminal_when_the_logger_is_quiet(capsys):
    """What took how long before training goes to the ``autoshard`` logger where it speaks at INFO, else to stderr
    where that is a terminal (``progress=None``), always with ``progress=True`` and never with ``False``."""
    from autoshard.runtime.metrics import progress

    progress(autoshard.CompileOptions(progress=True), "autoshard: captured it in 1.0 s")
    progress(autoshard.CompileOptions(progress=False), "autoshard: said nowhere")
    progress(autoshard.CompileOptions(), "autoshard: said on a terminal only")  # pytest's stderr is no terminal
    assert capsys.readouterr().err == "autoshard: captured it in 1.0 s\n"
    with pytest.raises(ValueError, match="progress='yes' is not valid"):
        autoshard.CompileOptions(progress="yes")


def test_a_long_capture_counts_its_seconds_on_a_terminal(monkeypatch):
    """On a terminal (and nowhere else) a capture or compile says it is alive: its seconds count up on one line,
    cleared at the end for the line that says how long it took."""
    import io
    import time

    from autoshard.runtime import metrics

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    monkeypatch.setattr(metrics.sys, "stderr", screen)
    with metrics.ticking(autoshard.CompileOptions(), "autoshard: capturing GPT for training"):
        time.sleep(1.2)
    said = screen.getvalue()
    assert "\rautoshard: capturing GPT for training ... 1 s" in said and said.endswith("\033[K"), said
    quiet = Terminal()
    monkeypatch.setattr(metrics.sys, "stderr", quiet)
    with metrics.ticking(autoshard.CompileOptions(progress=False), "autoshard: capturing"):
        time.sleep(0.6)
    assert quiet.getvalue() == ""
