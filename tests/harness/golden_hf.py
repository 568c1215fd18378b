"""``autoshard.hf.Trainer`` against HuggingFace's own ``Trainer`` in one process: the same model, data and arguments.

``reference`` runs in the test's process (no process group: the plain Trainer as one GPU would run it);
``trained`` on every rank of a pool, whose environment is torchrun's, so accelerate sees the processes and the
Trainer's sharding of the batches is what autoshard undoes. Both record each ``training_step``'s loss unrounded
(the Trainer logs it rounded to 4 digits) and return the parameters after the last step.
"""

from __future__ import annotations

import os
import tempfile

import torch
import transformers

import autoshard
from autoshard import hf

from harness.golden import groups_for

SEQ, EXAMPLES, EVAL = 16, 80, 16  # the first EVAL rows are the evaluation set
ARGS = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=2e-3, weight_decay=0.1,
            lr_scheduler_type="linear", warmup_steps=3, max_grad_norm=0.5, logging_steps=1, report_to=[], seed=0,
            use_cpu=True, dataloader_drop_last=True, save_strategy="no", disable_tqdm=True)


def build(kind: str):
    """A tiny HF model of ``kind`` (``llama``: causal LM, ``bert``: masked LM, ``bert_cls``: a classifier) and its
    data: rows padded at their end by the attention mask, the padding's labels -100."""
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                          attn_implementation="sdpa")
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.BertConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=SEQ, num_labels=3,
                                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                         attn_implementation="eager")
        model = (transformers.BertForSequenceClassification if kind == "bert_cls" else
                 transformers.BertForMaskedLM)(config)
    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(EXAMPLES):
        ids = torch.randint(1, 96, (SEQ,), generator=g)
        mask = torch.ones(SEQ, dtype=torch.long)
        mask[SEQ - int(torch.randint(0, 5, (), generator=g)):] = 0
        if kind == "bert_cls":
            labels = torch.randint(0, 3, (), generator=g)
        elif kind == "bert":
            chosen = (torch.rand(SEQ, generator=g) < 0.3) & (mask == 1)
            labels = ids.masked_fill(~chosen, -100)
            ids = ids.masked_fill(chosen, 0)  # the [MASK] id
        else:
            labels = ids.masked_fill(mask == 0, -100)
        data.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return model, data


class _Recorded:
    losses: list[float]

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.losses.append(float(loss))
        return loss


class _PlainTrainer(_Recorded, transformers.Trainer):
    pass


class _Trainer(_Recorded, hf.Trainer):
    pass


class _StopAt(transformers.TrainerCallback):
    """Stops training after ``step`` steps (the schedule still planned for all of them): a job killed there."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = control.should_training_stop or state.global_step >= self.step
        return control


def reference(kind: str, directory: str, steps: int, **arguments) -> dict:
    """HuggingFace's Trainer, one process: every step's loss, the parameters after ``steps`` steps and the loss of
    an evaluation then. ``arguments``: more ``TrainingArguments``."""
    model, data = build(kind)
    trainer = _PlainTrainer(model=model, train_dataset=data[EVAL:], eval_dataset=data[:EVAL],
                            args=transformers.TrainingArguments(output_dir=directory, max_steps=steps,
                                                                **{**ARGS, **arguments}))
    trainer.losses = []
    metrics = trainer.train().metrics
    return {"losses": trainer.losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "total": _total_batch(metrics),
            "logged": [e["loss"] for e in trainer.state.log_history if "loss" in e],
            "eval_loss": trainer.evaluate()["eval_loss"], **_the_models_own(trainer.model, data, directory, True)}


def saved_half(kind: str, mesh_kwargs: dict, directory: str, steps: int, **options) -> list[float]:
    """``autoshard.hf.Trainer`` under the mesh, saved at half of ``steps`` and stopped there: its losses."""
    mesh = autoshard.Mesh(**mesh_kwargs)
    model, data = build(kind)
    args = transformers.TrainingArguments(output_dir=directory, max_steps=steps, **{**ARGS, "save_strategy": "steps",
                                                                                   "save_steps": steps // 2})
    trainer = _Trainer(model=model, train_dataset=data[EVAL:], eval_dataset=data[:EVAL], args=args, mesh=mesh,
                       parallel_options={"groups": groups_for(mesh), **options}, callbacks=[_StopAt(steps // 2)])
    trainer.losses = []
    trainer.train()
    return trainer.losses


def plain_resumed(kind: str, directory: str, steps: int) -> dict:
    """HuggingFace's own Trainer, one process, resuming from the checkpoint ``saved_half`` wrote: the losses of
    the steps after it, the parameters at the end and an evaluation's loss."""
    model, data = build(kind)
    args = transformers.TrainingArguments(output_dir=directory + "-plain", max_steps=steps, **ARGS)
    trainer = _PlainTrainer(model=model, train_dataset=data[EVAL:], eval_dataset=data[:EVAL], args=args)
    trainer.losses = []
    trainer.train(resume_from_checkpoint=os.path.join(directory, f"checkpoint-{steps // 2}"))
    return {"losses": trainer.losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "logged": [], "eval_loss": trainer.evaluate()["eval_loss"]}


def _total_batch(metrics: dict) -> int:
    """The rows of one optimizer step as the Trainer's throughput counts them (its samples over its steps)."""
    return round(metrics["train_samples_per_second"] / metrics["train_steps_per_second"])


def _the_models_own(model, data: list, directory: str, writes: bool) -> dict:
    """What users do with ``trainer.model`` after ``train()``: a greedy ``generate`` from a prompt (a causal LM's),
    and ``save_pretrained`` (by one process, as scripts write it) read back by ``from_pretrained``."""
    out = {}
    if "CausalLM" in type(model).__name__:
        prompt = data[0]["input_ids"][None, :5]
        out["generated"] = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6,
                                          do_sample=False, pad_token_id=0).tolist()
    if writes:
        model.save_pretrained(os.path.join(directory, "final"))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    loaded = type(model).from_pretrained(os.path.join(directory, "final"))
    out["saved"] = {k: v.detach().clone() for k, v in loaded.state_dict().items()}
    return out


def trained(kind: str, mesh_kwargs: dict, directory: str, steps: int, *, resume_mesh: dict | None = None,
            arguments: dict | None = None, **options) -> dict:
    """``autoshard.hf.Trainer`` under the mesh for ``steps`` steps; with ``resume_mesh``, it saves at half way and a
    second Trainer under ``resume_mesh`` resumes from that checkpoint and trains to the end. The losses of every
    step (the resumed run's after the first half), and on rank 0 the parameters gathered."""
    mesh = autoshard.Mesh(**mesh_kwargs) if isinstance(mesh_kwargs, dict) else mesh_kwargs  # or "auto"
    groups = {"groups": groups_for(mesh)} if isinstance(mesh, autoshard.Mesh) else {}
    model, data = build(kind)
    save = {"save_strategy": "steps", "save_steps": steps // 2} if resume_mesh else {}
    arguments = {**ARGS, **(arguments or {})}
    args = transformers.TrainingArguments(output_dir=directory, max_steps=steps, **{**arguments, **save})
    trainer = _Trainer(model=model, train_dataset=data[EVAL:], eval_dataset=data[:EVAL], args=args, mesh=mesh,
                       parallel_options={**groups, **options}, callbacks=[_StopAt(steps // 2)] if resume_mesh else None)
    trainer.losses = []
    metrics = trainer.train().metrics
    losses, logged = trainer.losses, [e["loss"] for e in trainer.state.log_history if "loss" in e]
    if resume_mesh:
        mesh = autoshard.Mesh(**resume_mesh)
        model, _ = build(kind)
        args = transformers.TrainingArguments(output_dir=directory + "-resumed", max_steps=steps, **arguments)
        trainer = _Trainer(model=model, train_dataset=data[EVAL:], eval_dataset=data[:EVAL], args=args, mesh=mesh,
                           parallel_options={"groups": groups_for(mesh), **options})
        trainer.losses = []
        metrics = trainer.train(resume_from_checkpoint=os.path.join(directory, f"checkpoint-{steps // 2}")).metrics
        # the resumed state's log holds the first half's entries too
        losses, logged = losses + trainer.losses, [e["loss"] for e in trainer.state.log_history if "loss" in e]
    state = trainer.pm.state_dict()
    own = _the_models_own(trainer.model, data, directory, torch.distributed.get_rank() == 0)
    return {"losses": losses, "logged": logged, "eval_loss": trainer.evaluate()["eval_loss"], **own,
            "mesh": str(trainer.pm.mesh), "replicas": trainer.replicas(), "total": _total_batch(metrics),
            "state": {k: v.detach().clone() for k, v in state.items()} if torch.distributed.get_rank() == 0 else None,
            "share": sum(p.numel() for p in trainer.pm.parameters()) / sum(p.numel() for p in model.parameters())}


def check(expected: dict, results: list[dict], tolerance: float = 1e-5) -> None:
    for rank, got in enumerate(results):
        assert got.get("total") == expected.get("total"), (rank, "rows a step", got.get("total"), expected["total"])
        assert len(got["losses"]) == len(expected["losses"]), (rank, len(got["losses"]), len(expected["losses"]))
        worst = max(abs(a - b) for a, b in zip(got["losses"], expected["losses"], strict=True))
        assert worst <= tolerance, f"rank {rank}: losses differ by {worst:.2e}: {got['losses']} {expected['losses']}"
        assert len(got["logged"]) == len(expected["logged"]), (rank, got["logged"], expected["logged"])
        assert abs(got["eval_loss"] - expected["eval_loss"]) <= tolerance, (rank, got["eval_loss"],
                                                                           expected["eval_loss"])
    state = results[0]["state"]
    assert set(state) >= {k for k in expected["state"] if not k.endswith("position_ids")}, sorted(expected["state"])
    worst = max(float((state[k] - v).abs().max()) for k, v in expected["state"].items() if k in state)
    assert worst <= tolerance, f"parameters after training differ by {worst:.2e}"
    if expected.get("saved") is None:
        return
    # trainer.model after train(): what it generates, on every rank, and what its save_pretrained wrote
    for rank, got in enumerate(results):
        assert got.get("generated") == expected.get("generated"), (rank, got.get("generated"), expected["generated"])
    saved = results[0]["saved"]
    worst = max(float((saved[k] - v).abs().max()) for k, v in expected["saved"].items())
    assert worst <= tolerance, f"trainer.model.save_pretrained wrote parameters that differ by {worst:.2e}"



# ------------------------------------------------------------------------------------------------- accelerate


def accelerate_loop(kind: str, mesh_kwargs: dict | None, steps: int, **options) -> dict:
    """A loop written for ``accelerate`` (accumulation over 2 batches, clipping, AdamW groups by name, a warmup
    schedule, then an evaluation); ``mesh_kwargs`` None prepares it with ``accelerator.prepare``, else with
    ``autoshard.accelerate.prepare`` under that mesh. Every batch's loss, the evaluation's, and the parameters."""
    accelerator, model, optimizer, loader, scheduler, evaluation = _accelerate_prepared(kind, mesh_kwargs, steps,
                                                                                        **options)
    losses = _accelerate_train(accelerator, model, optimizer, loader, scheduler, [], 2 * steps)
    result = _accelerate_result(accelerator, model, evaluation, losses)
    if mesh_kwargs is not None:
        rank = torch.distributed.get_rank()
        with tempfile.TemporaryDirectory() as directory:
            accelerator.unwrap_model(model).save_pretrained(directory, is_main_process=rank == 0)
            result["pretrained"] = sorted(os.listdir(directory)) if rank == 0 else None
    return result


def accelerate_resumed(kind: str, mesh_kwargs: dict, resume_mesh: dict, steps: int, directory: str,
                       **options) -> dict:
    """The same loop saved by ``accelerator.save_state`` after its first epoch (8 of its optimizer steps) under
    ``mesh_kwargs``, then a new model, optimizer and scheduler prepared under ``resume_mesh`` that
    ``accelerator.load_state`` resumes (before the model's first call), trained to the end."""
    per_epoch = (EXAMPLES - EVAL) // 4
    accelerator, model, optimizer, loader, scheduler, _ = _accelerate_prepared(kind, mesh_kwargs, steps, **options)
    losses = _accelerate_train(accelerator, model, optimizer, loader, scheduler, [], per_epoch)
    saved = accelerator.save_state(directory)
    accelerator, model, optimizer, loader, scheduler, evaluation = _accelerate_prepared(kind, resume_mesh, steps,
                                                                                        **options)
    accelerator.load_state(saved)
    for _ in loader:  # the first epoch's order drawn, as the saved run drew it (the batches are skipped)
        pass
    losses = _accelerate_train(accelerator, model, optimizer, loader, scheduler, losses, 2 * steps)
    return _accelerate_result(accelerator, model, evaluation, losses)


def _accelerate_prepared(kind: str, mesh_kwargs: dict | None, steps: int, **options) -> tuple:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from torch.utils.data import DataLoader

    import autoshard.accelerate

    AcceleratorState._reset_state()  # accelerate's state is one per process: a bf16 Trainer run before leaves bf16
    model, data = build(kind)
    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                  lr=2e-3)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, 3, steps)
    loader = DataLoader(data[EVAL:], batch_size=4, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(0))
    evaluation = DataLoader(data[:EVAL], batch_size=4)
    if mesh_kwargs is None:
        return accelerator, *accelerator.prepare(model, optimizer, loader, scheduler, evaluation)
    mesh = autoshard.Mesh(**mesh_kwargs)
    return accelerator, *autoshard.accelerate.prepare(accelerator, model, optimizer, loader, scheduler, evaluation,
                                                      mesh=mesh, groups=groups_for(mesh), **options)


def _accelerate_train(accelerator, model, optimizer, loader, scheduler, losses: list, until: int) -> list:
    model.train()
    while len(losses) < until:
        for batch in loader:
            with accelerator.accumulate(model):
                output = model(**batch)
                accelerator.backward(output.loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 0.5)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(output.loss.item())
            if len(losses) == until:
                break
    return losses


def _accelerate_result(accelerator, model, evaluation, losses: list) -> dict:
    model.eval()
    with torch.no_grad():
        eval_loss = sum(float(model(**batch).loss) for batch in evaluation) / len(evaluation)
    state = accelerator.get_state_dict(model)  # accelerate's idiom: the full state dict
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return {"losses": losses, "eval_loss": eval_loss, "logged": [],
            "state": {k: v.detach().clone() for k, v in state.items()} if rank == 0 else None}
