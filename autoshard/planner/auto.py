"""``mesh="auto"``: the mesh (and options) the planner takes for a model and a world size.

Without a profile, the analytic planner's fastest split of a token transformer described from the model
(``auto_mesh``); with ``planner_profile`` or ``calibrate``, every mesh of the world size compiled here and costed
from the measured profile, the fastest, optionally trained side by side (``measured_choice``, ``autotune``). Also
the planner's lint of the mesh a job runs (``lint_findings``).
"""

from __future__ import annotations

import math
import os
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn

from autoshard.mesh import Mesh
from autoshard.options import CompileOptions
from autoshard.runtime import launch
from autoshard.runtime.metrics import progress


def auto_mesh(model: nn.Module, example_inputs: tuple, *, microbatches: int = 1, local_batch: bool = False,
              world_size: int | None = None, announce: bool = False, sequence_parallel: bool | str = False) -> Mesh:
    """The mesh ``parallelize(mesh="auto")`` uses: the planner's fastest split of the world size.

    The world size is torch.distributed's when it is initialised, else ``$WORLD_SIZE``, else 1. The model is
    described to the planner by :func:`transformer_config`; a model that is not a token transformer, or one the
    planner finds no split for, puts every rank on dp. Only meshes whose dp x ``microbatches`` divides the batch
    are taken. The cluster is the planner's default GPU with ``$LOCAL_WORLD_SIZE`` (at most 8) ranks per node.
    Its memory model counts sequence parallelism's saving under ``sequence_parallel`` (True or ``"auto"``).
    """
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    from autoshard.batching import batch_size

    batch = batch_size(example_inputs) or 1
    fallback, why = Mesh(dp=world_size), "every rank on dp"
    mesh = fallback
    if world_size > 1:
        config = transformer_config(model, example_inputs, batch * world_size if local_batch else batch)
        if config is None:
            why += f": {type(model).__name__} is not a token transformer the planner can describe"
        else:
            mesh, why = _planned_mesh(config, world_size, microbatches, local_batch, fallback,
                                      bool(sequence_parallel))
            if launch.device_of(model) != "cuda" and mesh is not fallback:
                why += ("; predicted with the planner's GPU preset (H100 formulas), not on this machine: "
                        "calibrate=True or planner_profile= predicts from this one")
    if announce and launch.rank() == 0:
        print(f"autoshard: mesh='auto' on {world_size} rank(s) chose {mesh} ({why})", flush=True)
    return mesh


def measured_mesh(model: nn.Module, example_inputs: tuple, options: CompileOptions, *, loss_fn, target,
                  world_size: int | None = None) -> Mesh:
    """The mesh ``mesh="auto"`` takes with ``planner_profile`` (:func:`measured_choice`)."""
    return measured_choice(model, example_inputs, options, loss_fn=loss_fn, target=target, world_size=world_size)[0]


def measured_choice(model: nn.Module, example_inputs: tuple, options: CompileOptions, *, loss_fn, target,
                    world_size: int | None = None, announce: bool = False) -> tuple[Mesh, CompileOptions, list]:
    """What ``mesh="auto"`` takes with ``planner_profile``: every dp x tp x pp x cp mesh of the world size whose dp x
    microbatches divides the batch (and for a mixture of experts, each with the experts split over every ep that
    divides dp x cp and the experts), compiled here and costed from the profile (the same on every rank: the same
    files and the same compilation), the fastest. Where the options leave them at their defaults, a pipeline also
    tries 2, 4 and 8 microbatches, each also interleaved over two chunks per rank, tp sequence parallelism, and cp
    ring (load-balanced) and all-to-all attention. Returns the mesh, the
    options it runs with and the ranking (predictions, fastest first)."""
    import dataclasses

    from autoshard.batching import batch_size
    from autoshard.mesh import _meshes_of
    from autoshard.planner.predict import CandidateCompiler
    from autoshard.planner.profile import Profile

    if loss_fn is None or target is None:
        raise ValueError("mesh='auto' with planner_profile costs the training step: pass loss_fn and target")
    if options.local_batch:
        raise ValueError("mesh='auto' with planner_profile needs the global batch: it cannot be used with "
                         "local_batch=True (pass a mesh)")
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    from autoshard.explain import profile_source

    limit = _memory_limit(options.memory_limit)
    if options.calibrate and launch.device_of(model) != "cpu":
        raise ValueError("calibrate=True measures CPU processes (gloo, CPU kernels) and this model is on "
                         f"{launch.device_of(model)}: pass a mesh, or mesh='auto' without calibrate to plan on the "
                         "GPU presets")
    start = time.perf_counter()
    profile = _calibrated(world_size, options) if options.calibrate else Profile.load(options.planner_profile)
    if options.calibrate and launch.rank() == 0:
        progress(options, f"autoshard: calibrated {world_size} rank(s) in {time.perf_counter() - start:.1f} s")
    limit = limit or profile.memory or math.inf
    batch = batch_size(example_inputs) or 1
    plain = dataclasses.replace(options, planner_profile=None)
    default = CompileOptions()
    compiler = CandidateCompiler(model, example_inputs, target, loss_fn)
    found = []
    experts = compiler.experts()
    for mesh in _with_ep(_meshes_of(world_size), experts):
        counts = [options.microbatches]
        if mesh.pp > 1 and options.microbatches == default.microbatches:
            counts = [m for m in (2, 4, 8) if m >= mesh.pp]
        for m in counts:
            if batch % (mesh.dp * m):
                continue
            for variant in _variants(mesh, plain, default):
                chosen = dataclasses.replace(plain, microbatches=m, **variant)
                found.append(_fitting(compiler, mesh, profile, chosen, plain, default, limit,
                                      ("microbatches", *variant)))
    found.sort(key=lambda pair: (pair[0].error is not None, pair[0].step))
    seen: set[str] = set()  # a variant a memory limit also reaches from its plain mesh (sequence parallelism), once
    found = [pair for pair in found if not (pair[0].label() in seen or seen.add(pair[0].label()))]
    ranking = [p for p, _ in found]
    if not found or found[0][0].error is not None:
        why = "; ".join(str(p) for p in ranking[:3]) or f"no mesh of {world_size} ranks splits the batch of {batch}"
        if found and all(p.over_limit is not None for p in ranking):
            from autoshard.cost import format_bytes

            least = min(ranking, key=lambda p: p.memory.total)
            raise ValueError(f"mesh='auto': no mesh of {world_size} ranks fits in {format_bytes(limit)} per rank "
                             f"(memory_limit, or the profile's): the smallest, {least.label()}, needs {least.memory}. "
                             "Raise memory_limit, use more ranks, or a smaller batch")
        raise ValueError(f"mesh='auto': no mesh of {world_size} ranks compiles for this model ({why})")
    if options.autotune:
        trials = [pair for pair in found if pair[0].error is None][:options.autotune]
        for index, (prediction, candidate) in enumerate(trials, 1):
            prediction.measured = _trial(model, example_inputs, candidate, prediction.mesh, loss_fn, target)
            if launch.rank() == 0:
                progress(options, f"autoshard: autotune {index}/{len(trials)}: {prediction.label()} measured "
                                  f"{prediction.measured * 1e3:.1f} ms a step")
        found.sort(key=lambda pair: (pair[0].error is not None, pair[0].measured is None, pair[0].measured or 0.0,
                                     pair[0].step))
        ranking = [p for p, _ in found]
    best, chosen = found[0]
    if announce and launch.rank() == 0:
        print(f"autoshard: mesh='auto' on {world_size} rank(s) chose {best} from "
              f"{profile_source(options)}", flush=True)
    return best.mesh, dataclasses.replace(chosen, planner_profile=options.planner_profile), ranking


def _trial(model: nn.Module, example_inputs: tuple, options: CompileOptions, mesh: Mesh, loss_fn, target, *,
           warmup: int = 1, steps: int = 3) -> float:
    """``mesh``'s training step measured on this job's ranks: a copy of the model compiled for it, trained
    ``warmup + steps`` times on the example batch (gradients dropped, no optimizer step); the slowest rank's median
    step, the same on every rank."""
    import copy
    import statistics

    if any(p.device.type == "meta" for p in model.parameters()):
        raise ValueError("autotune trains the candidates, and this model is on the meta device (no values to train): "
                         "pass a model with its weights, or leave autotune=0")
    groups = launch.groups_for(mesh, options.timeout, launch.device_of(model))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the lint speaks once, for the mesh taken
        from autoshard.runtime.parallel_model import ParallelModel

        pm = ParallelModel(copy.deepcopy(model), mesh, groups, options, example_inputs=example_inputs,
                           loss_fn=loss_fn, target=target)
    times = []
    for _ in range(warmup + steps):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        pm.step(*example_inputs, target=target)
        for p in pm.parameters():
            p.grad = None
        if pm.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    seconds = torch.tensor([statistics.median(times[warmup:])], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    del pm
    if groups is not None:  # the trial's groups gone with it: left alive, they slow the job that trains next
        groups.destroy()
    return float(seconds)


def _with_ep(meshes: list[Mesh], experts: int) -> list[Mesh]:
    """``meshes``, and for a model with ``experts`` experts per mixture each mesh with the experts split over every
    ep that divides both dp x cp and the experts."""
    import dataclasses

    out = []
    for mesh in meshes:
        out.append(mesh)
        out += [dataclasses.replace(mesh, ep=e) for e in range(2, mesh.dp * mesh.cp + 1)
                if experts and (mesh.dp * mesh.cp) % e == 0 and experts % e == 0]
    return out


def _variants(mesh: Mesh, options: CompileOptions, default: CompileOptions) -> list[dict]:
    """The options a mesh may also run with, where ``options`` leave them at their defaults: ring (load-balanced)
    and all-to-all attention under cp; sequence parallelism under tp (without cp: its variants are enough there);
    interleaved 1F1B with two chunks per rank under pp (a model too shallow for ``pp * 2`` stages is refused in
    the ranking). Not searched, for their cost is not yet predicted well enough to choose them: the zero-bubble
    schedules (ZB-H1's split backward measured up to 32% slower, slower than 1F1B on GPT-2 and a mixture)."""
    variants = [{}]
    if mesh.pp > 1 and options.schedule == default.schedule and options.chunks == default.chunks:
        variants.append({"schedule": "interleaved", "chunks": 2})
    if mesh.cp > 1 and options.cp_attention == default.cp_attention and not options.cp_load_balance:
        variants += [{"cp_attention": "ring", "cp_load_balance": True}, {"cp_attention": "alltoall"}]
    if mesh.tp > 1 and mesh.cp == 1 and options.sequence_parallel == default.sequence_parallel:
        variants.append({"sequence_parallel": True})
    return variants


def _memory_limit(given) -> float | None:
    """``memory_limit`` in bytes ("20GiB", 20e9), None where not given."""
    if given is None:
        return None
    from autoshard.planner.units import UnitError, parse

    try:
        limit = parse(given, "bytes")
    except (UnitError, ValueError) as e:
        raise ValueError(f"memory_limit={given!r} is not valid: {e}") from None
    if not limit > 0:
        raise ValueError(f"memory_limit={given!r} is not valid: pass the bytes each rank may hold, like '20GiB', or "
                         "None for the profile's")
    return limit


def _fitting(compiler, mesh: Mesh, profile, chosen: CompileOptions, plain: CompileOptions,
             default: CompileOptions, limit: float, named: tuple[str, ...]) -> tuple:
    """``(prediction, options)`` of ``mesh`` with ``chosen``; where it holds more than ``limit`` bytes per rank, the
    fastest of it with the options that save memory (activation checkpointing, FSDP2 where dp x cp > 1, sequence
    parallelism where tp > 1, and their combinations) that fits, or the plain one refused for its memory."""
    import dataclasses
    import itertools

    from autoshard.cost import format_bytes
    from autoshard.planner.predict import predict

    plain_prediction = predict(compiler, mesh, profile, chosen, **_changed(chosen, plain, named))
    if plain_prediction.error is not None or plain_prediction.memory is None or plain_prediction.memory.total <= limit:
        return plain_prediction, chosen
    savers = [saver for saver, usable in (
        ({"activation_checkpointing": True}, not chosen.activation_checkpointing),
        ({"data_parallel": "fsdp"}, chosen.data_parallel == default.data_parallel and mesh.dp * mesh.cp > 1),
        ({"sequence_parallel": True}, chosen.sequence_parallel == default.sequence_parallel and mesh.tp > 1),
    ) if usable]
    fits = []
    for count in range(1, len(savers) + 1):
        for combination in itertools.combinations(savers, count):
            changes = {k: v for saver in combination for k, v in saver.items()}
            saving = dataclasses.replace(chosen, **changes)
            prediction = predict(compiler, mesh, profile, saving, **_changed(saving, plain, (*named, *changes)))
            if prediction.error is None and prediction.memory.total <= limit:
                fits.append((prediction, saving))
    if fits:
        return min(fits, key=lambda pair: pair[0].step)
    plain_prediction.error = f"needs {plain_prediction.memory}, over the {format_bytes(limit)} per rank allowed"
    plain_prediction.over_limit = limit
    return plain_prediction, chosen  # its predicted step kept, for explain() to say what the limit costs


def _calibrated(world_size: int, options: CompileOptions):
    """This job's profile: its ranks measured together (the process group initialised from torchrun's environment
    when nothing has), rank 0's numbers on every rank, so every rank chooses alike."""
    from autoshard.planner.profile import calibrate

    if world_size > 1 and not dist.is_initialized():
        if "RANK" not in os.environ:
            raise RuntimeError(f"calibrate=True on {world_size} ranks needs the ranks: launch with torchrun")
        dist.init_process_group("gloo", timeout=options.timeout, **launch.restarted_store(options.timeout))
    return calibrate()


def _changed(options: CompileOptions, before: CompileOptions, names: tuple[str, ...]) -> dict:
    return {name: str(getattr(options, name)) if name in ("schedule", "cp_attention") else getattr(options, name)
            for name in names if getattr(options, name) != getattr(before, name)}


def _planned_mesh(config, world_size: int, microbatches: int, local_batch: bool, fallback: Mesh,
                  sequence_parallel: bool) -> tuple[Mesh, str]:
    from autoshard.planner import Cluster, PlanError, plan

    per_node = min(int(os.environ.get("LOCAL_WORLD_SIZE", "8")), 8, world_size)
    cluster = Cluster(gpus=world_size, gpus_per_node=per_node)
    try:
        result = plan(config, cluster, sequence_parallel=sequence_parallel)
    except PlanError as e:
        return fallback, f"every rank on dp: the planner found no split ({e})"
    for rank, est in enumerate(result.ranked, 1):
        mesh = est.split.mesh
        if local_batch or config.global_batch % (mesh.dp * microbatches) == 0:
            return mesh, (f"planner's #{rank} of {len(result.ranked)} meshes, predicted step "
                          f"{est.step_time * 1e3:.3g} ms on {cluster.device} for a {config.layers}-layer transformer "
                          f"of {config.parameters / 1e6:.3g}M parameters")
    return fallback, f"every rank on dp: no planned mesh splits the batch of {config.global_batch} into dp x m"


def transformer_config(model: nn.Module, example_inputs: tuple, global_batch: int):
    """The planner's :class:`~autoshard.planner.TransformerConfig` of ``model``, or None when it is not a token
    transformer (token-id inputs of shape (batch, sequence) and an embedding). Sizes come from a ``config``
    (HuggingFace) or ``cfg`` attribute, or from attributes of the modules (``n_head``, ``num_heads``, ...);
    the layer count falls back to the longest ``ModuleList``, ``ffn`` to 4 x hidden."""
    from autoshard.planner import PlanError, TransformerConfig

    tokens = example_inputs[0] if example_inputs else None
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if not embeddings or not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.is_floating_point():
        return None
    embedding = max(embeddings, key=lambda m: m.num_embeddings)
    sources = [getattr(model, "config", None), getattr(model, "cfg", None), *model.modules()]

    def read(*names: str) -> int | None:
        for source in sources:
            for name in names:
                value = getattr(source, name, None)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
        return None

    lists = [len(m) for m in model.modules() if isinstance(m, nn.ModuleList)]
    layers = read("num_hidden_layers", "n_layer", "n_layers", "num_layers") or max(lists, default=None)
    heads = read("num_attention_heads", "n_head", "n_heads", "num_heads")
    if layers is None or heads is None:
        return None
    weight = embedding.weight
    tied = any(m.weight is weight for m in model.modules() if isinstance(m, nn.Linear))
    try:
        return TransformerConfig(
            layers=layers, hidden=embedding.embedding_dim, heads=heads, vocab=embedding.num_embeddings,
            seq=tokens.shape[1], global_batch=global_batch, kv_heads=read("num_key_value_heads", "n_kv_head",
            "n_kv_heads", "num_kv_heads"), ffn=read("intermediate_size", "n_inner", "ffn", "ffn_dim", "d_ff"),
            tied_embeddings=tied, dtype_bytes=weight.element_size(),
        )
    except PlanError:
        return None


def lint_findings(mesh: Mesh, model: nn.Module, example_inputs: tuple, options: CompileOptions) -> list:
    """The planner's lint (the seeds' rules) of ``mesh`` for this model and batch; none for one rank."""
    if mesh.world_size == 1:
        return []
    from autoshard.batching import batch_size
    from autoshard.planner import lint

    batch = (batch_size(example_inputs) or 1) * (mesh.dp if options.local_batch else 1)
    config = transformer_config(model, example_inputs, batch)
    return lint(mesh, config, microbatches=options.microbatches, interleave=options.chunks,
                schedule=options.schedule)
