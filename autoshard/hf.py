"""autoshard inside HuggingFace's ``Trainer``: the Trainer's own loop, run under a mesh.

    trainer = autoshard.hf.Trainer(model=model, args=TrainingArguments(...), train_dataset=..., mesh=Mesh(tp=2))
    trainer.train()

launched with ``torchrun`` as any Trainer script is. What the Trainer does stays as it does it: its data order,
gradient accumulation (the loss of each batch scaled exactly as the Trainer scales it), its optimizer and
scheduler built from ``named_parameters()`` (weight decay by its own rule, over this rank's shards under the
model's names), ``max_grad_norm`` (the global norm, ``pm.clip_grad_norm_``), logging, evaluation and ``bf16``.
What autoshard changes:

- the model is parallelized at the start of ``train()`` (or ``evaluate()``) from the first batch;
- every rank reads every batch (the Trainer's sampler, not sharded over the processes: autoshard splits a batch
  over dp itself, and the ranks of a tp or pp group read the same one), and nothing is wrapped in DDP; a batch is
  ``per_device_train_batch_size`` rows per dp replica, as under DDP;
- ``save_steps`` write autoshard's checkpoints (``<checkpoint>/autoshard``, the optimizer's state and the
  scheduler's with them) beside the model in HuggingFace's format (``pm.save_pretrained``), so
  ``resume_from_checkpoint`` resumes under any mesh and ``from_pretrained`` loads the model; and the optimizer's and
  scheduler's files of a plain Trainer, which resumes from them in one process;
- after ``train()`` the trained weights are written into ``trainer.model`` (``pm.update_model()``);
- each ``TrainingArguments`` field is honoured, mapped to autoshard's own, warned or refused (``HONOURED``,
  ``MAPPED``, ``WARNED``, ``REFUSED``).

The loss is the task's usual one, computed from the model's output: the next token's cross-entropy for a causal
LM, the cross-entropy of the labelled tokens for a masked LM, and the classification losses HuggingFace picks
from ``config.problem_type`` (``loss_fn=`` takes any other). Labels of ``-100`` are ignored, as HuggingFace's are.
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

import autoshard

IGNORE_INDEX = -100


def causal_lm_loss(output, labels: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """The next token's cross-entropy, in float32, over the labels that are not ``-100`` (smoothed as the Trainer's
    ``label_smoothing_factor`` smooths it)."""
    logits = _logits(output)
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                           ignore_index=IGNORE_INDEX, label_smoothing=label_smoothing)


def masked_lm_loss(output, labels: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """The cross-entropy of the labelled tokens (those not ``-100``), in float32."""
    logits = _logits(output)
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=IGNORE_INDEX,
                           label_smoothing=label_smoothing)


def classification_loss(config, label_smoothing: float = 0.0) -> Callable:
    """HuggingFace's sequence-classification loss for ``config``: mean squared error for one label (regression),
    cross-entropy for integer labels, binary cross-entropy with logits for multi-label."""
    problem = config.problem_type

    def loss_fn(output, labels: torch.Tensor) -> torch.Tensor:
        logits = _logits(output)
        kind = problem or ("regression" if config.num_labels == 1 else
                           "single_label_classification" if not labels.is_floating_point() else
                           "multi_label_classification")
        if kind == "regression":
            return F.mse_loss(logits.squeeze(-1).float(), labels.float().reshape(-1)) if config.num_labels == 1 \
                else F.mse_loss(logits.float(), labels.float())
        if kind == "single_label_classification":
            return F.cross_entropy(logits.float().reshape(-1, config.num_labels), labels.reshape(-1),
                                   label_smoothing=label_smoothing)
        return F.binary_cross_entropy_with_logits(logits.float(), labels.float())

    return loss_fn


# losses whose value is a mean over counted labels: the Trainer divides their sum by the labels of the whole
# accumulation window (``num_items_in_batch``), and so does autoshard (``pm.step(divisor=...)``)
COUNTED = (causal_lm_loss, masked_lm_loss)


def counted(loss_fn: Callable) -> bool:
    return getattr(loss_fn, "func", loss_fn) in COUNTED


def default_loss(model: nn.Module, label_smoothing: float = 0.0) -> Callable:
    """The loss of ``model``'s task, by the HuggingFace class it is (its architecture's mapping names)."""
    from transformers.models.auto import modeling_auto as auto

    name = type(model).__name__
    for mapping, loss in ((auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, causal_lm_loss),
                          (auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES, masked_lm_loss),
                          (auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
                           classification_loss(model.config, label_smoothing))):
        if name in mapping.values():
            return functools.partial(loss, label_smoothing=label_smoothing) if label_smoothing and \
                loss in COUNTED else loss
    raise ValueError(f"autoshard.hf.Trainer: no default loss for {name}, which is not a causal LM, masked LM or "
                     "sequence classifier by transformers' auto mappings; pass loss_fn=lambda output, labels: ...")


# What autoshard.hf.Trainer does with each of the Trainer's arguments (every field of ``TrainingArguments``).
# HONOURED: the Trainer's own loop acts on them as it would in one process (data, schedule, optimizer, logging,
# evaluation, saving, the hub; the DDP ones have no DDP wrapper to act on).
HONOURED = frozenset([
    "output_dir", "num_train_epochs", "max_steps", "learning_rate", "lr_scheduler_type", "lr_scheduler_kwargs",
    "warmup_steps", "optim", "optim_args", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
    "gradient_accumulation_steps", "tf32", "use_cache", "torch_empty_cache_steps", "logging_strategy",
    "logging_steps", "logging_first_step", "log_on_each_node", "logging_nan_inf_filter", "log_level",
    "log_level_replica", "disable_tqdm", "report_to", "run_name", "project", "trackio_space_id",
    "trackio_bucket_id", "trackio_static_space_id", "eval_strategy", "eval_steps", "eval_delay",
    "per_device_eval_batch_size", "prediction_loss_only", "eval_on_start", "eval_do_concat_batches",
    "eval_use_gather_object", "eval_accumulation_steps", "include_for_metrics", "batch_eval_metrics",
    "save_only_model", "save_strategy", "save_steps", "save_on_each_node", "save_total_limit",
    "enable_jit_checkpoint", "push_to_hub", "hub_token", "hub_private_repo", "hub_model_id", "hub_strategy",
    "hub_always_push", "hub_revision", "metric_for_best_model", "greater_is_better", "ignore_data_skip",
    "restore_callback_states_from_checkpoint", "full_determinism", "seed", "data_seed", "use_cpu",
    "accelerator_config", "dataloader_drop_last", "dataloader_num_workers", "dataloader_pin_memory",
    "dataloader_persistent_workers", "dataloader_prefetch_factor", "dataloader_multiprocessing_context",
    "dataloader_in_order", "remove_unused_columns", "label_names", "train_sampling_strategy", "length_column_name",
    "ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_static_graph", "ddp_backend",
    "ddp_timeout", "debug", "skip_memory_metrics", "do_train", "do_eval", "do_predict", "resume_from_checkpoint",
    "local_rank"
])
MAPPED = {
    "per_device_train_batch_size": "each dp replica's rows, as under DDP: every rank reads them x the mesh's dp",
    "bf16": "parallelize(mixed_precision='bf16')",
    "gradient_checkpointing": "parallelize(activation_checkpointing=True), as the model's own switch is",
    "activation_checkpointing": "parallelize(activation_checkpointing=True)",
    "torch_compile": "parallelize(compile=True)",
    "max_grad_norm": "pm.clip_grad_norm_: the global norm over every rank's shards",
    "average_tokens_across_devices": "off: every rank reads the whole batch, so its count is the batch's already",
    "label_smoothing_factor": "the default loss's cross-entropy, smoothed as the Trainer's LabelSmoother smooths it "
                              "(refused beside a loss_fn=, which is the whole loss)",
}
WARNED = {  # options of what MAPPED turns on that autoshard's own version does not take
    "gradient_checkpointing_kwargs": "autoshard's activation checkpointing is non-reentrant, by segments of each "
                                     "stage found from its graph, and takes no options",
    "activation_checkpointing_kwargs": "autoshard's activation checkpointing takes no options",
    "torch_compile_backend": "autoshard compiles each rank's programs with torch.compile's default backend",
    "torch_compile_mode": "autoshard compiles each rank's programs with torch.compile's default mode",
}
REFUSED = {  # set to anything but their defaults, these would be ignored or would act on another model
    "fp16": "autoshard's mixed precision is bf16: use bf16=True",
    "fp16_full_eval": "it would cast the parallel model's parameters to fp16 for evaluation",
    "bf16_full_eval": "it would cast the parallel model's parameters to bf16 for evaluation, and training on",
    "neftune_noise_alpha": "its noise is a forward hook on the input embeddings, drawn apart on each rank",
    "use_liger_kernel": "its kernels replace the model's modules; autoshard captures and shards the model's own",
    "liger_kernel_config": "its kernels replace the model's modules; autoshard captures and shards the model's own",
    "auto_find_batch_size": "a step that runs out of memory on one rank leaves the others in its collectives",
    "load_best_model_at_end": "the best checkpoint would be loaded into the model object, not the parallel model: "
                              "resume from it with resume_from_checkpoint, or pm.load_checkpoint",
    "include_num_input_tokens_seen": "every rank reads the whole batch, so the gathered count would be the world "
                                     "size too high",
    "optim_target_modules": "GaLore-style optimizers are built over the model's modules, not this rank's shards",
    "fsdp": "autoshard is the parallelism: Mesh(dp=...) with parallel_options={'data_parallel': 'fsdp'}",
    "fsdp_config": "autoshard is the parallelism: Mesh(dp=...) with parallel_options={'data_parallel': 'fsdp'}",
    "deepspeed": "autoshard is the parallelism: give the mesh=...",
    "parallelism_config": "autoshard is the parallelism: give the mesh=...",
}


def check_arguments(args) -> None:
    """Refuse every argument in ``REFUSED`` that is set, naming it and why; warn once for each in ``WARNED`` that
    is set. (Every default of theirs is off: None, False, 0, empty or "no".)"""
    changed = [name for name in REFUSED if _is_set(getattr(args, name))]
    if changed:
        raise ValueError("autoshard.hf.Trainer does not honour " + "; ".join(
            f"{name}={getattr(args, name)!r}: {REFUSED[name]}" for name in changed))
    for name in WARNED:
        if _is_set(getattr(args, name)):
            warnings.warn(f"autoshard.hf.Trainer: {name}={getattr(args, name)!r} is ignored: {WARNED[name]}",
                          stacklevel=3)


def _is_set(value) -> bool:
    return value not in (None, False, 0, "", "no") and value != [] and value != {}


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` that trains ``model`` under autoshard's ``mesh``.

    Args (beyond the Trainer's own):
        mesh: a :class:`autoshard.Mesh`, ``"auto"`` (the planner's choice for the world size) or ``None`` (one
            rank).
        loss_fn: ``loss_fn(output, labels) -> scalar``; by default the task's (see the module's text).
        parallel_options: options of :func:`autoshard.parallelize` (``microbatches``, ``schedule``,
            ``sequence_parallel``, ...). ``mixed_precision="bf16"`` follows ``args.bf16``.
    """

    def __init__(self, model: nn.Module | None = None, args=None, *, mesh=None, loss_fn: Callable | None = None,
                 parallel_options: dict | None = None, **kwargs) -> None:
        if model is None:
            raise ValueError("autoshard.hf.Trainer needs the model itself (model_init is not supported)")
        _check_loss_is_ours(type(self), kwargs.get("compute_loss_func"))
        self.mesh = mesh
        smoothing = args.label_smoothing_factor if args is not None else 0.0
        if loss_fn is not None and smoothing:
            raise ValueError(f"autoshard.hf.Trainer: label_smoothing_factor={smoothing} beside loss_fn=: the loss_fn "
                             "is the whole loss; smooth inside it (F.cross_entropy(..., label_smoothing=...))")
        self.loss_fn = loss_fn or default_loss(model, smoothing)
        self.parallel_options = dict(parallel_options or {})
        self.pm = None
        super().__init__(model=model, args=args, **kwargs)
        check_arguments(self.args)
        # every rank reads the whole batch: the labels counted on one rank are those of the batch
        self.args.average_tokens_across_devices = False
        # the Trainer's switches that autoshard runs as its own options (its checkpointing recomputes each segment of
        # a stage's program alone in backward, as HuggingFace recomputes each layer)
        if self.args.gradient_checkpointing or self.args.activation_checkpointing or \
                getattr(model, "is_gradient_checkpointing", False):
            self.parallel_options.setdefault("activation_checkpointing", True)
        if self.args.torch_compile:
            self.parallel_options.setdefault("compile", True)

    # ------------------------------------------------------------------------------------------ the model

    def parallel_model(self, inputs: dict | None = None):
        """The parallel model, made from ``inputs`` (a batch) on the first call."""
        if self.pm is None:
            if inputs is None:
                inputs = next(iter(self.get_train_dataloader() if self.train_dataset is not None
                                   else self.get_eval_dataloader()))
            positional, labels = self._split(self._prepare_inputs(inputs))
            options = {"mixed_precision": "bf16" if self.args.bf16 else None, **self.parallel_options}
            self.pm = autoshard.parallelize(self.model, self.mesh, example_inputs=positional, loss_fn=self.loss_fn,
                                            target=labels, **options)
        return self.pm

    def _split(self, inputs: dict) -> tuple[tuple, torch.Tensor | None]:
        return positional_inputs(self.model, inputs)

    def replicas(self) -> int:
        """The data-parallel replicas the batch is split over (the mesh's dp): the Trainer's per-device batch size
        is each replica's, as under DDP, so every rank reads ``per_device_train_batch_size x replicas`` rows a batch.
        ``mesh="auto"`` is planned first, from one per-device batch."""
        if isinstance(self.mesh, autoshard.Mesh):
            return self.mesh.dp
        if self.mesh is None:
            return 1
        if self.pm is None:
            self._planning = True  # the loader that gives the planner its example batch: one replica's
            try:
                self.parallel_model()
            finally:
                self._planning = False
        return self.pm.mesh.dp

    def get_total_train_batch_size(self, args) -> int:
        """The rows of one optimizer step over every replica, as the Trainer counts them for its throughput."""
        return self._train_batch_size * args.gradient_accumulation_steps * self.replicas()

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader=None) -> nn.Module:
        # not the Trainer's model, so accelerate wraps nothing (a DDP wrapper would broadcast rank 0's shards)
        return _Parallel(self.parallel_model())

    def _get_dataloader(self, dataset, description, batch_size, *args, is_training: bool = False, **kwargs):
        """The Trainer's loader, every batch on every rank: accelerate's shard of the batch sampler is undone. In
        training a batch is every replica's rows (``batch_size`` is one replica's); an evaluation's batches stay
        ``per_device_eval_batch_size`` rows, whose losses are those DDP's processes would average."""
        replicas = self.replicas() if is_training and not getattr(self, "_planning", False) else 1
        return unsharded(super()._get_dataloader(dataset, description, batch_size * replicas, *args,
                                                 is_training=is_training, **kwargs))

    def get_decay_parameter_names(self, model) -> list[str]:
        return super().get_decay_parameter_names(self.model)  # the model's modules: the shards keep its names

    def create_optimizer(self, model=None):
        return super().create_optimizer(_Parallel(self.parallel_model()))

    def train(self, *args, **kwargs):
        """The Trainer's ``train()``; after it the trained weights are written into ``trainer.model`` on every rank
        (``pm.update_model()``), so ``trainer.model.generate`` and ``save_pretrained`` use them."""
        output = super().train(*args, **kwargs)
        if self.pm is not None:
            self.pm.update_model()
        return output

    # -------------------------------------------------------------------------------------- the step

    def training_step(self, model, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        pm = self.parallel_model(inputs)
        pm.train()
        positional, labels = self._split(self._prepare_inputs(inputs))
        scaled = self.model_accepts_loss_kwargs and num_items_in_batch is not None  # as the Trainer decides
        if scaled and counted(self.loss_fn) and _divides_by_the_window(self.model):
            loss = pm.step(*positional, target=labels, divisor=num_items_in_batch)  # the window's count
        else:
            loss = pm.step(*positional, target=labels,
                           loss_scale=1.0 if scaled else 1.0 / self.current_gradient_accumulation_steps)
        return loss.detach().to(self.args.device)

    def _clip_grad_norm(self, model):
        return self.pm.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:
            grad_norm = self.pm.clip_grad_norm_(float("inf"))
        return grad_norm.item() if hasattr(grad_norm, "item") else grad_norm

    def prediction_step(self, model, inputs: dict, prediction_loss_only: bool, ignore_keys=None):
        pm = self.parallel_model(inputs)
        pm.eval()
        positional, labels = self._split(self._prepare_inputs(inputs))
        with torch.no_grad():
            output = pm(*positional)
            loss = self.loss_fn(output, labels).detach() if labels is not None else None
        return loss, None if prediction_loss_only else _logits(output).detach(), labels

    # ------------------------------------------------------------------------- saving and resuming

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The model in HuggingFace's format, gathered from every rank (each rank calls it)."""
        output_dir = output_dir or self.args.output_dir
        self.parallel_model().save_pretrained(output_dir)
        if self.processing_class is not None and self.args.should_save:
            self.processing_class.save_pretrained(output_dir)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """autoshard's checkpoint (each rank its shards; resumes under any mesh), and beside it the files a plain
        Trainer resumes from in one process: the optimizer's whole state by position (gathered: every rank calls)
        and the scheduler's."""
        optimizer = self._optimizer()
        self.pm.save_checkpoint(os.path.join(output_dir, "autoshard"), optimizer=optimizer,
                                extra={"scheduler": self.lr_scheduler.state_dict()})
        whole = by_position(self.pm.optimizer_state_dict(optimizer))
        if self.args.should_save:
            torch.save(whole, os.path.join(output_dir, OPTIMIZER_NAME))
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        return None  # the weights come with the optimizer's state (_load_optimizer_and_scheduler)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, "autoshard")
        if not os.path.isdir(path):
            raise FileNotFoundError(f"autoshard.hf.Trainer: {checkpoint} holds no autoshard checkpoint ({path}); "
                                    "resume from a checkpoint this Trainer saved")
        extra = self.pm.load_checkpoint(path, optimizer=self._optimizer())
        self.lr_scheduler.load_state_dict(extra["scheduler"])

    def _optimizer(self):
        return getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wrapper holds the torch one


def _check_loss_is_ours(trainer: type, compute_loss_func) -> None:
    """A ``compute_loss`` override or a ``compute_loss_func`` would be silently replaced by the compiled loss:
    refused, saying how to give that loss."""
    overridden = trainer.compute_loss is not transformers.Trainer.compute_loss
    if overridden or compute_loss_func is not None:
        what = f"{trainer.__name__}.compute_loss" if overridden else "compute_loss_func"
        raise ValueError(
            f"{what} is not what autoshard.hf.Trainer trains: the model is compiled with its loss as one graph, "
            "loss_fn(output, labels), and the Trainer's compute_loss is never called. Pass that loss as "
            "loss_fn=... (label smoothing, for one: loss_fn=lambda output, labels: F.cross_entropy(output.logits"
            "[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, label_smoothing=0.1))")


def by_position(state: dict) -> dict:
    """An optimizer state dict keyed by parameter names (``pm.optimizer_state_dict``) keyed as ``optimizer.
    state_dict()`` keys it: by position, counted over the groups in order (within a group, the model's order, as the
    Trainer builds its groups from ``named_parameters()``)."""
    position: dict[str, int] = {}
    groups = []
    for group in state["param_groups"]:
        groups.append({**group, "params": [position.setdefault(name, len(position)) for name in group["params"]]})
    return {"state": {position[name]: value for name, value in state["state"].items()}, "param_groups": groups}


def positional_inputs(model: nn.Module, inputs: dict) -> tuple[tuple, torch.Tensor | None]:
    """A batch (a dict, as HuggingFace's collators make) as ``model``'s positional inputs, in ``forward``'s order,
    and its labels: autoshard captures and runs a model's inputs by position."""
    names = _positional(model)
    given = {k: v for k, v in inputs.items() if k != "labels" and v is not None}
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise ValueError(f"autoshard: the batch holds {unknown}, which {type(model).__name__}.forward does not take "
                         f"by position (it takes {names[:8]}...); drop those columns")
    last = max(names.index(k) for k in given)
    missing = [n for n in names[:last + 1] if n not in given]
    if missing:
        raise ValueError(f"autoshard: the batch gives {sorted(given)} but not {missing}, which "
                         f"{type(model).__name__}.forward takes before them: autoshard passes the inputs by "
                         "position; give the batch those columns too")
    return tuple(given[n] for n in names[:last + 1]), inputs.get("labels")


def _positional(model: nn.Module) -> list[str]:
    """The names ``model.forward`` takes by position; through a wrapper whose forward takes ``*args`` alone and
    passes them on to the model it wraps (PEFT's ``PeftModel``), that model's."""
    seen = model
    while True:
        names = [n for n, p in inspect.signature(seen.forward).parameters.items()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if names or not hasattr(seen, "get_base_model") or seen.get_base_model() is seen:
            return names
        seen = seen.get_base_model()


def unsharded(dataloader):
    """``dataloader`` as accelerate prepared it, but every batch on every rank: its shard of the batch sampler
    undone (autoshard splits a batch over dp itself; the ranks of a tp or pp group read the same one)."""
    shard = getattr(dataloader, "batch_sampler", None)
    if hasattr(shard, "num_processes"):
        shard.num_processes, shard.process_index = 1, 0
    return dataloader


def _divides_by_the_window(model: nn.Module) -> bool:
    """Whether ``model``'s own loss divides by the Trainer's ``num_items_in_batch`` (the labels counted over the
    accumulation window): HuggingFace's models that compute it through ``self.loss_function`` do; those computing
    a plain mean (BERT's masked LM) do not, and the Trainer then leaves each batch's mean unscaled. Read from the
    forward's code, as nothing else says it."""
    try:
        return "self.loss_function" in inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return True


class _Parallel(nn.Module):
    """What the Trainer's loop holds as its model: the parallel model, not the Trainer's ``model``."""

    def __init__(self, pm) -> None:
        super().__init__()
        self.pm = pm

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.pm.named_parameters(prefix, recurse, remove_duplicate)  # the model's own names

    def forward(self, *args, **kwargs):
        return self.pm(*args, **kwargs)


def _logits(output) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output[0] if isinstance(output, tuple) else output
