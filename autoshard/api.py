"""``parallelize``: from an unmodified model and a mesh to the program this rank runs.

Terms: the *global batch* is what ``step()`` receives, the same tensors on every rank; each
data-parallel rank takes its *local batch* (a slice along dim 0), which is cut into
``microbatches`` equal *microbatches*, each run forward and backward through the captured graph.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable

import torch
from torch import nn

from autoshard.mesh import Mesh, MeshGroups
from autoshard.options import CompileOptions
from autoshard.planner.auto import auto_mesh, lint_findings, measured_choice
from autoshard.runtime import launch


def parallelize(
    model: nn.Module, mesh: Mesh | str | None = None, *, example_inputs: tuple, loss_fn: Callable | None = None,
    target: torch.Tensor | None = None, groups: MeshGroups | None = None, options: CompileOptions | None = None,
    **option_fields,
):
    """Compile ``model`` for ``mesh`` and return the parallel model this rank runs.

    Args:
        model: the unmodified model (on CPU, GPU or the ``meta`` device).
        mesh: degrees of the parallel axes; ``None`` is one rank (the result equals eager execution);
            ``"auto"`` asks the planner for the fastest mesh of the world size (see :func:`auto_mesh`).
        example_inputs: a global batch of the model's positional inputs (tuple), as ``step()`` will get.
        loss_fn: ``loss_fn(model(*inputs), target) -> scalar``; captured with the model in one graph.
        target: an example global-batch target; with it the training graph is captured now,
            otherwise at the first ``step()``.
        groups: process groups already created by ``mesh.create_groups()``; created here when absent,
            initialising torch.distributed from torchrun's environment if nothing is initialised yet.
        options: the compiler's options as one :class:`~autoshard.options.CompileOptions`.
        **option_fields: or any of its fields by name instead (``microbatches=4, schedule="zbv"``), documented
            there; a name that is no option is refused with the options named.
    """
    from autoshard.runtime.parallel_model import ParallelModel

    if not isinstance(example_inputs, tuple):
        raise TypeError(
            f"example_inputs must be a tuple of the model's positional inputs, got {type(example_inputs).__name__}; "
            "for one input write example_inputs=(tokens,)"
        )
    if loss_fn is not None:
        _check_loss_signature(loss_fn)
    options = _one_set_of_options(options, option_fields)
    if options.autotune and not (mesh == "auto" and (options.planner_profile is not None or options.calibrate)):
        missing = " without planner_profile or calibrate" if mesh == "auto" else ""
        raise ValueError(f"autotune={options.autotune} measures the fastest meshes mesh='auto' predicts from a "
                         f"profile, and this call has mesh={mesh!r}{missing}: pass mesh='auto' with calibrate=True (or "
                         "planner_profile=...), or leave autotune=0")
    ranking = None
    if mesh == "auto" and (options.planner_profile is not None or options.calibrate):
        mesh, options, ranking = measured_choice(model, example_inputs, options, loss_fn=loss_fn, target=target,
                                                 announce=True)
    mesh = _mesh(mesh, model, example_inputs, options)
    findings = lint_findings(mesh, model, example_inputs, options)
    if launch.rank() == 0:  # the lint is about the job: said once, not once per rank
        for finding in findings:
            if finding.severity in ("warning", "error"):
                warnings.warn(f"autoshard: {finding}", stacklevel=2)
    if groups is None:
        groups = launch.groups_for(mesh, options.timeout, launch.device_of(model))
        launch.check_gpu(model)
    elif groups.mesh != mesh:
        raise ValueError(f"the process groups were created for {groups.mesh}, not for {mesh}: pass groups of this mesh")
    pm = ParallelModel(model, mesh, groups, options, example_inputs=example_inputs, loss_fn=loss_fn, target=target,
                       lint=findings if mesh.world_size > 1 else None)
    pm.ranking = ranking
    return pm


def _one_set_of_options(options: CompileOptions | None, fields: dict) -> CompileOptions:
    if options is None:
        return CompileOptions.of(fields)
    if fields:
        named = ", ".join(sorted(fields))
        raise ValueError(f"pass the options either as options=CompileOptions(...) or as keyword arguments, not both "
                         f"(got options= and {named}=): put {named} into the CompileOptions")
    return options


def _mesh(mesh: Mesh | str | None, model: nn.Module, example_inputs: tuple, options: CompileOptions) -> Mesh:
    if isinstance(mesh, str):
        if mesh != "auto":
            raise ValueError(f"mesh={mesh!r}: pass a Mesh, None (one rank) or \"auto\" (the planner's choice)")
        mesh = auto_mesh(model, example_inputs, microbatches=options.microbatches, local_batch=options.local_batch,
                         announce=True, sequence_parallel=options.sequence_parallel)
    mesh = mesh if mesh is not None else Mesh()
    options.check_mesh(mesh)
    return mesh


def _check_loss_signature(loss_fn: Callable) -> None:
    """``loss_fn`` is called as ``loss_fn(output, target)``: one that cannot take that is refused here, before a
    capture would report its TypeError as a graph it could not trace."""
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # a builtin that does not say
        return
    try:
        signature.bind(object(), object())
    except TypeError as e:
        name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
        raise TypeError(f"loss_fn is called as loss_fn(output, target), with the model's output and the target; "
                        f"{name}{signature} cannot take that ({e}): give a function of those two, e.g. "
                        "loss_fn=lambda output, target: F.cross_entropy(output.flatten(0, 1), target.flatten())"
                        ) from None
