"""autoshard under a loop written for HuggingFace's ``accelerate``: one line changes.

    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
becomes
    model, optimizer, loader, scheduler = autoshard.accelerate.prepare(accelerator, model, optimizer, loader,
                                                                       scheduler, mesh=autoshard.Mesh(tp=2))

and the rest of the loop stays: ``with accelerator.accumulate(model)``, ``outputs = model(**batch)``,
``accelerator.backward(outputs.loss)``, ``accelerator.clip_grad_norm_(model.parameters(), 1.0)``,
``optimizer.step()``, ``scheduler.step()``, ``optimizer.zero_grad()``, ``model.eval()`` and inference.

In training, ``model(**batch)`` (a batch with ``labels``) runs autoshard's ``step``, forward and backward at once,
with the gradients scaled as ``accelerator.backward`` scales them (``1 / gradient_accumulation_steps``); the
output's ``loss`` is the batch's loss, and ``accelerator.backward`` on it adds nothing. The model is parallelized at
its first call, from that batch; the optimizer built over the model's parameters then holds this rank's shards
instead (by name, before its first step). The loader gives every batch to every rank; clipping takes the global
norm; the scheduler steps once per optimizer step, as in one process. The loss is the task's, as
``autoshard.hf.Trainer`` picks it (``loss_fn=`` for any other).
"""

from __future__ import annotations

import inspect
import os
import types

import torch
from torch import nn

import autoshard
from autoshard import hf
from autoshard.runtime import habits


def prepare(accelerator, *objects, mesh=None, loss_fn=None, **options):
    """``accelerator.prepare(*objects)`` with the model (exactly one ``nn.Module`` among ``objects``) trained by
    autoshard under ``mesh``; ``options`` are :func:`autoshard.parallelize`'s."""
    from accelerate.scheduler import AcceleratedScheduler
    from torch.utils.data import DataLoader

    models = [o for o in objects if isinstance(o, nn.Module)]
    if len(models) != 1:
        raise ValueError(f"autoshard.accelerate.prepare parallelizes one model; got {len(models)} nn.Modules among "
                         "the objects: prepare the others with accelerator.prepare")
    parallel = ParallelModule(models[0], accelerator, mesh, loss_fn or hf.default_loss(models[0]), options)
    prepared = []
    for obj in objects:
        if obj is models[0]:
            prepared.append(parallel)
        elif isinstance(obj, torch.optim.Optimizer):
            parallel.optimizers.append(obj)
            prepared.append(accelerator.prepare(obj))
        elif isinstance(obj, DataLoader):
            prepared.append(hf.unsharded(accelerator.prepare(obj)))
        elif isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
            # once per optimizer step: accelerate would step it once per process, each having read its own batch
            prepared.append(AcceleratedScheduler(obj, accelerator._optimizers, split_batches=True,
                                                 step_with_optimizer=accelerator.step_scheduler_with_optimizer))
        else:
            prepared.append(accelerator.prepare(obj))
    _clip_globally(accelerator, parallel)
    schedulers = [o for o in prepared if isinstance(o, AcceleratedScheduler)]
    _state_as_autoshard_saves_it(accelerator, parallel, schedulers)
    return prepared[0] if len(prepared) == 1 else tuple(prepared)


class ParallelModule(nn.Module):
    """The model as the loop holds it: called like the model, trained by autoshard."""

    def __init__(self, model: nn.Module, accelerator, mesh, loss_fn, options: dict) -> None:
        super().__init__()
        object.__setattr__(self, "model", model)  # not a submodule: its parameters are not the trained ones
        self.accelerator, self.mesh, self.loss_fn, self.options = accelerator, mesh, loss_fn, options
        self.optimizers: list[torch.optim.Optimizer] = []
        self.pm = None
        self.pending: str | None = None  # a checkpoint load_state gave before the model's first call

    def parallel_model(self, positional: tuple, labels):
        if self.pm is None:
            options = {"mixed_precision": "bf16" if self.accelerator.mixed_precision == "bf16" else None,
                       **self.options}
            self.pm = autoshard.parallelize(self.model, self.mesh, example_inputs=positional, loss_fn=self.loss_fn,
                                            target=labels, **options)
            self._hold_shards()
            if self.pending is not None:
                self.load_checkpoint(self.pending)
        return self.pm

    def optimizer(self):
        """The one optimizer a checkpoint holds the state of (None without one)."""
        if len(self.optimizers) > 1:
            raise ValueError(f"autoshard.accelerate: save_state/load_state with {len(self.optimizers)} optimizers; "
                             "autoshard's checkpoint holds one optimizer's state (one over all the parameters)")
        return self.optimizers[0] if self.optimizers else None

    def load_checkpoint(self, path: str) -> None:
        self.pending = None
        self.pm.load_checkpoint(path, optimizer=self.optimizer())

    def _hold_shards(self) -> None:
        """Each optimizer built over the model's parameters holds this rank's shards of them instead."""
        for optimizer in self.optimizers:
            if optimizer.state:
                raise RuntimeError("autoshard.accelerate: the optimizer stepped before the model's first call; "
                                   "call the model first (it is parallelized then)")
            habits.take_over(optimizer, self.pm)

    def _parallel(self, what: str):
        if self.pm is None:
            raise ValueError(f"{what} before the model's first call: the model is parallelized then (call it on a "
                             "batch first)")
        return self.pm

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:  # noqa: ARG002 - nn.Module's signature
        """The model's ``state_dict()``: its keys, every parameter at full shape (a collective: every rank calls)."""
        return self._parallel("state_dict()").state_dict()

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):  # noqa: ARG002
        return self._parallel("load_state_dict()").load_state_dict(state_dict, strict=strict)

    def save_pretrained(self, directory: str, *, max_shard_size: int | str = "5GB", **kwargs) -> None:  # noqa: ARG002
        """HuggingFace's format, as ``unwrap_model(model).save_pretrained(...)`` writes it (every rank calls; rank
        0 writes; accelerate's ``is_main_process``, ``save_function`` and ``state_dict`` are not needed)."""
        self._parallel("save_pretrained()").save_pretrained(directory, max_shard_size=max_shard_size)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        if self.pm is None:
            return self.model.named_parameters(prefix, recurse, remove_duplicate)
        return self.pm.named_parameters(prefix, recurse, remove_duplicate)

    def forward(self, *args, **kwargs):
        names = list(inspect.signature(self.model.forward).parameters)
        batch = {**dict(zip(names, args, strict=False)), **kwargs}
        positional, labels = hf.positional_inputs(self.model, batch)
        pm = self.parallel_model(positional, labels)
        if self.training and labels is not None:
            pm.train()
            scale = 1.0 / self.accelerator.gradient_accumulation_steps  # as accelerator.backward scales
            loss = pm.step(*positional, target=labels, loss_scale=scale) / scale
            return types.SimpleNamespace(loss=_Stepped.apply(loss, _anchor(loss)))
        pm.train(self.training)
        with torch.no_grad():
            output = pm(*positional)
        loss = self.loss_fn(output, labels) if labels is not None else None
        logits = hf._logits(output)
        return types.SimpleNamespace(loss=loss, logits=logits)


class _Stepped(torch.autograd.Function):
    """A loss whose backward already ran (in ``step``): ``accelerator.backward`` on it computes nothing more."""

    @staticmethod
    def forward(ctx, loss, anchor):
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, grad):
        return None, None


def _anchor(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=like.dtype, device=like.device, requires_grad=True)


def _clip_globally(accelerator, parallel: ParallelModule) -> None:
    """``accelerator.clip_grad_norm_`` over this model's parameters takes the global norm (over every rank's
    shards, ``pm.clip_grad_norm_``); over anything else it is accelerate's."""
    original = accelerator.clip_grad_norm_

    def clip_grad_norm_(parameters, max_norm, norm_type=2):
        parameters = list(parameters) if not isinstance(parameters, torch.Tensor) else [parameters]
        if parallel.pm is not None and parameters and {id(p) for p in parameters} <= \
                {id(p) for p in parallel.pm.parameters()}:
            if norm_type != 2:
                raise ValueError(f"autoshard clips by the 2-norm; norm_type={norm_type} is not supported")
            accelerator.unscale_gradients()
            return parallel.pm.clip_grad_norm_(max_norm)
        return original(parameters, max_norm, norm_type)

    accelerator.clip_grad_norm_ = clip_grad_norm_


def _state_as_autoshard_saves_it(accelerator, parallel: ParallelModule, schedulers: list) -> None:
    """``get_state_dict(model)`` gives the model's full state dict; ``save_state``/``load_state`` save and load the
    run as autoshard's checkpoint (each rank its shards of the weights and the optimizer's state, the schedulers'
    state and accelerate's step with them), so it resumes under any mesh. Accelerate's own would write no weights
    and only rank 0's optimizer shards."""
    from autoshard.runtime import checkpoint

    get_state_dict = accelerator.get_state_dict

    def state_dict(model, unwrap: bool = True):
        return parallel.state_dict() if model is parallel else get_state_dict(model, unwrap)

    def save_state(output_dir: str | None = None, **kwargs) -> str:  # noqa: ARG001 - accelerate's signature
        pm = parallel._parallel("save_state()")
        directory = output_dir or _next_directory(accelerator)
        pm.save_checkpoint(directory, optimizer=parallel.optimizer(),
                           extra={"schedulers": [s.state_dict() for s in schedulers], "step": accelerator.step})
        return directory

    def load_state(input_dir: str | None = None, **kwargs) -> None:  # noqa: ARG001 - accelerate's signature
        if input_dir is None:
            raise ValueError("autoshard.accelerate: load_state(input_dir) needs the directory save_state wrote")
        extra = checkpoint.read_extra(input_dir)  # every rank reads it; the weights wait for the model's first call
        for scheduler, state in zip(schedulers, extra.get("schedulers", []), strict=True):
            scheduler.load_state_dict(state)
        accelerator.step = extra.get("step", 0)
        parallel.pending = input_dir
        if parallel.pm is not None:
            parallel.load_checkpoint(input_dir)

    accelerator.get_state_dict = state_dict
    accelerator.save_state, accelerator.load_state = save_state, load_state


def _next_directory(accelerator) -> str:
    """Where accelerate's ``save_state()`` with no directory writes: ``<project_dir>/checkpoints/checkpoint_<n>``
    under automatic checkpoint naming."""
    config = accelerator.project_configuration
    if not config.automatic_checkpoint_naming:
        raise ValueError("autoshard.accelerate: save_state() needs output_dir, or automatic_checkpoint_naming in "
                         "the accelerator's ProjectConfiguration")
    directory = os.path.join(accelerator.project_dir, "checkpoints", f"checkpoint_{config.iteration}")
    config.iteration += 1
    return directory
