"""``autoshard.hf.Trainer``: HuggingFace's Trainer loop under a mesh, against the plain Trainer in one process.

Every step's loss (unrounded), the parameters after 20 steps and an evaluation's loss then, within 1e-5:
gradient accumulation over 2 batches, AdamW with weight decay by the Trainer's rule over ``named_parameters()``,
a linear schedule with warmup, ``max_grad_norm`` and padded rows; bf16 against the Trainer's autocast. Then a
run saved at step 10 under one mesh and resumed under another.
"""

from __future__ import annotations

import functools

import pytest
import transformers

from autoshard import hf

from harness import golden_hf

STEPS = 20
CELLS = [
    ("llama", {"tp": 2}, {}),
    ("llama", {"pp": 2}, {"microbatches": 2}),
    ("llama", {"dp": 2}, {}),
    ("llama", {"cp": 2}, {}),
    ("bert", {"tp": 2}, {}),
    ("bert_cls", {"dp": 2}, {}),
    ("llama", {"dp": 2, "tp": 2, "pp": 2}, {"microbatches": 2}),
    ("bert", {"dp": 2, "tp": 2, "pp": 2}, {"microbatches": 2}),
]


@functools.cache
def _reference(kind: str, directory: str, bf16: bool = False, replicas: int = 1) -> dict:
    """The plain Trainer in one process; with ``replicas``, at their batch (the per-device batch of each dp
    replica, as DDP's processes would read it)."""
    batch = {"per_device_train_batch_size": golden_hf.ARGS["per_device_train_batch_size"] * replicas}
    return golden_hf.reference(kind, directory, STEPS, **({"bf16": True} if bf16 else {}), **batch)


def _world(mesh: dict) -> int:
    world = 1
    for degree in mesh.values():
        world *= degree
    return world


@pytest.mark.parametrize("kind,mesh,options", CELLS,
                         ids=[f"{k}-{'x'.join(f'{a}{d}' for a, d in m.items())}" for k, m, _ in CELLS])
def test_the_trainer_under_a_mesh_trains_as_the_plain_trainer(pools, tmp_path_factory, kind, mesh, options):
    """The per-device batch is each dp replica's, as under DDP (it had been the whole batch), and the throughput
    counts the rows of every replica once (it had counted them once per process)."""
    expected = _reference(kind, str(tmp_path_factory.mktemp("reference")), replicas=mesh.get("dp", 1))
    results = pools.get(_world(mesh)).run(golden_hf.trained, kind, mesh, str(tmp_path_factory.mktemp("run")),
                                          STEPS, **options)
    golden_hf.check(expected, results)
    if mesh.get("tp", 1) > 1 or mesh.get("pp", 1) > 1:  # the Trainer trained the shards, not a whole copy
        assert all(r["share"] < 0.8 for r in results), [r["share"] for r in results]


def test_mesh_auto_trains_as_the_plain_trainer(pools, tmp_path_factory):
    """``mesh="auto"``: the planner's mesh for 2 processes, whichever it is, trains as the plain Trainer."""
    results = pools.get(2).run(golden_hf.trained, "llama", "auto", str(tmp_path_factory.mktemp("run")), STEPS)
    golden_hf.check(_reference("llama", str(tmp_path_factory.mktemp("reference")), replicas=results[0]["replicas"]),
                    results)
    assert all("Mesh(" in r["mesh"] for r in results), results[0]["mesh"]


def test_bf16_trains_as_the_plain_trainers_autocast(pools, tmp_path_factory):
    """``args.bf16``: autoshard's bf16 autocast against the Trainer's (accelerate's autocast) in one process."""
    expected = _reference("llama", str(tmp_path_factory.mktemp("reference")), bf16=True)
    results = pools.get(2).run(golden_hf.trained, "llama", {"tp": 2}, str(tmp_path_factory.mktemp("run")), STEPS,
                               arguments={"bf16": True})
    golden_hf.check(expected, results, tolerance=2e-2)


def test_a_run_saved_under_tp_resumes_under_pp_with_the_same_losses(pools, tmp_path_factory):
    expected = _reference("llama", str(tmp_path_factory.mktemp("reference")))
    results = pools.get(2).run(golden_hf.trained, "llama", {"tp": 2}, str(tmp_path_factory.mktemp("run")), STEPS,
                               resume_mesh={"pp": 2}, microbatches=2)
    golden_hf.check(expected, results)


def test_a_plain_trainer_resumes_a_run_saved_under_tp_with_its_optimizer_and_schedule(pools, tmp_path_factory):
    """HuggingFace's own Trainer, given a checkpoint ``autoshard.hf.Trainer`` saved under tp2, had started a fresh
    optimizer and schedule without a word (no optimizer.pt): it now resumes as the uninterrupted run goes on."""
    expected = _reference("llama", str(tmp_path_factory.mktemp("reference")))
    directory = str(tmp_path_factory.mktemp("run"))
    first = pools.get(2).run(golden_hf.saved_half, "llama", {"tp": 2}, directory, STEPS)[0]
    resumed = golden_hf.plain_resumed("llama", directory, STEPS)
    resumed["losses"] = first + resumed["losses"]
    golden_hf.check({**expected, "logged": [], "total": None, "saved": None}, [resumed])


@functools.cache
def _accelerate_reference(kind: str) -> dict:
    return golden_hf.accelerate_loop(kind, None, STEPS // 2)


@pytest.mark.parametrize("mesh,options", [({"tp": 2}, {}), ({"pp": 2}, {"microbatches": 2})], ids=["tp2", "pp2"])
def test_an_accelerate_loop_changed_by_one_line_trains_as_in_one_process(pools, mesh, options):
    """``autoshard.accelerate.prepare`` in place of ``accelerator.prepare``; the loop unchanged."""
    expected = _accelerate_reference("llama")
    results = pools.get(_world(mesh)).run(golden_hf.accelerate_loop, "llama", mesh, STEPS // 2, **options)
    golden_hf.check(expected, results)  # the parameters as accelerator.get_state_dict(model) gives them
    # unwrap_model(model).save_pretrained writes HuggingFace's format (it raised AttributeError); save_state, which
    # wrote no weights and one rank's optimizer shards, is refused naming what saves the run
    assert "model.safetensors" in results[0]["pretrained"] and "config.json" in results[0]["pretrained"], results[0]


def test_accelerate_save_state_under_tp_and_load_state_under_pp_resume_with_the_same_losses(pools, tmp_path):
    """``accelerator.save_state`` wrote no weights and rank 0's optimizer shards alone, and ``load_state`` then
    failed: they save and load autoshard's checkpoint (weights, the optimizer's state, the scheduler's, the step),
    so the loop saved under tp2 and resumed under pp2 has the uninterrupted run's losses."""
    expected = _accelerate_reference("llama")
    results = pools.get(2).run(golden_hf.accelerate_resumed, "llama", {"tp": 2}, {"pp": 2}, STEPS // 2,
                               str(tmp_path / "state"), microbatches=2)
    golden_hf.check(expected, results)


class _SmoothedTrainer(hf.Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


@pytest.mark.parametrize("how", ["override", "compute_loss_func"])
def test_a_loss_the_trainer_would_never_call_is_refused_at_construction(tmp_path, how):
    """A ``compute_loss`` override (label smoothing, a custom objective) or ``compute_loss_func`` had been silently
    replaced by the default next-token loss: refused, saying to pass it as ``loss_fn``."""
    model, data = golden_hf.build("llama")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, **golden_hf.ARGS)
    trainer, extra = (_SmoothedTrainer, {}) if how == "override" else (hf.Trainer, {"compute_loss_func": len})
    with pytest.raises(ValueError, match="is not what autoshard.hf.Trainer trains.*loss_fn="):
        trainer(model=model, args=args, train_dataset=data, **extra)


def test_gradient_checkpointing_and_torch_compile_become_autoshards_options(tmp_path):
    """``gradient_checkpointing=True`` (or the model's own switch) and ``torch_compile=True`` had changed nothing:
    they are autoshard's activation checkpointing and ``compile=True``; trained in one process, the losses are the
    plain Trainer's."""
    model, data = golden_hf.build("llama")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=2, gradient_checkpointing=True,
                                          **golden_hf.ARGS)
    trainer = golden_hf._Trainer(model=model, args=args, train_dataset=data[golden_hf.EVAL:])
    trainer.losses = []
    trainer.train()
    assert trainer.pm.options.activation_checkpointing
    expected = golden_hf.reference("llama", str(tmp_path / "plain"), 2)
    assert trainer.losses == pytest.approx(expected["losses"], rel=1e-5)
    model.gradient_checkpointing_enable()
    assert hf.Trainer(model=model, args=args, train_dataset=data).parallel_options["activation_checkpointing"]
    compiled = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, torch_compile=True,
                                              **golden_hf.ARGS)
    assert hf.Trainer(model=model, args=compiled, train_dataset=data).parallel_options["compile"]


@pytest.mark.parametrize("mesh", [{"tp": 2}, {"dp": 2}], ids=["tp2", "dp2"])
def test_label_smoothing_factor_trains_as_the_trainers_label_smoother(pools, tmp_path_factory, mesh):
    """``label_smoothing_factor`` is applied by the Trainer's ``compute_loss``, which autoshard never calls: it had
    been dropped without a word. It now smooths the default loss's cross-entropy as HF's ``LabelSmoother`` does
    (over the accumulation window's labels): every loss and the parameters are the plain Trainer's."""
    smoothing = {"label_smoothing_factor": 0.1}
    batch = {"per_device_train_batch_size": golden_hf.ARGS["per_device_train_batch_size"] * mesh.get("dp", 1)}
    expected = golden_hf.reference("llama", str(tmp_path_factory.mktemp("reference")), STEPS, **smoothing, **batch)
    results = pools.get(2).run(golden_hf.trained, "llama", mesh, str(tmp_path_factory.mktemp("run")), STEPS,
                               arguments=smoothing)
    golden_hf.check(expected, results)


def test_every_argument_of_the_trainer_is_honoured_mapped_or_refused():
    """The record of what ``autoshard.hf.Trainer`` does with each ``TrainingArguments`` field: a field transformers
    adds must be looked at (honoured as the Trainer would, mapped to autoshard's own, warned, or refused)."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    kinds = [hf.HONOURED, set(hf.MAPPED), set(hf.WARNED), set(hf.REFUSED)]
    assert not fields - set().union(*kinds), sorted(fields - set().union(*kinds))
    assert sum(len(k) for k in kinds) == len(set().union(*kinds)), "a field in two kinds"


@pytest.mark.parametrize("name,value", [("neftune_noise_alpha", 5.0), ("bf16_full_eval", True),
                                        ("include_num_input_tokens_seen", True), ("auto_find_batch_size", True)])
def test_an_argument_autoshard_does_not_honour_is_refused_naming_it(tmp_path, name, value):
    model, data = golden_hf.build("llama")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, **{**golden_hf.ARGS, name: value})
    with pytest.raises(ValueError, match=f"does not honour {name}="):
        hf.Trainer(model=model, args=args, train_dataset=data)

