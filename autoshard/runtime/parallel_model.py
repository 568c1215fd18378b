"""The parallel model a rank runs: captured programs, data-parallel replicas and the training step.

One ``ParallelModel`` per rank. It owns the captures of the model (a training graph with the loss and
an inference graph, each cached by input shapes), the tensor-parallel plan and this rank's programs
built from them, wraps the parameters for data parallelism (PyTorch's DistributedDataParallel or FSDP2
over the mesh's dp x cp group; under pipeline parallelism, ``reducer.GradientReducer``), and runs
``step()``: slice the global batch for this dp rank, cut it into microbatches, run each forward and
backward, and return the loss of the whole global batch.

Loss normalisation: every microbatch's loss term is divided by one global divisor (the number of
counted tokens of the global batch for token losses, the number of microbatches in the global batch
otherwise), so every gradient reduction (microbatches, dp) is a plain sum; DDP's own averaging is
replaced by a summing communication hook.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import fx, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils import _pytree as pytree

from autoshard import codegen
from autoshard.capture import Captured, capture, shapes_of
from autoshard.mesh import Mesh, MeshGroups
from autoshard.passes.collectives import unshard
from autoshard.passes.context_parallel import (
    PARTIAL_OUTPUT,
    ContextParallelPlan,
    check_divisible,
    plan_context_parallel,
)
from autoshard.passes.input_checks import InputChecks, input_checks
from autoshard.passes.loss import TokenLoss, find_token_loss, sum_loss_pass, token_count_graph
from autoshard.passes.placements import R, Shard
from autoshard.passes.propagate import propagate, reaching_output, redistributions
from autoshard.passes.tensor_parallel import plan_tensor_parallel
from autoshard.plan import TensorParallelPlan
from autoshard.runtime import batching
from autoshard.runtime.pipeline import Pipeline

# Buffers are built identically on every rank, so DDP need not broadcast them before every forward.
_NO_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False}
)


class StepError(RuntimeError):
    """A training step failed or stalled on one rank; the message names the rank, step and microbatch."""


@dataclass
class TrainProgram:
    """A training capture, this rank's program built from it, and how its loss is normalised."""

    captured: Captured
    program: codegen.RankProgram
    token_loss: TokenLoss | None
    count_gm: fx.GraphModule | None
    runners: dict | None = None  # under pipeline parallelism: this rank's stages, by stage index
    cp_copies: int = 1  # cp ranks holding the whole loss (1 when each holds a partial sum of it)

    @property
    def gm(self) -> fx.GraphModule:
        return self.program.gm


class _Replica(nn.Module):
    """The module DDP wraps: this rank's parameters, and a forward that runs a given program."""

    def __init__(self, store: codegen.ParamStore) -> None:
        super().__init__()
        self.store = store
        self.sharded_data = False

    def forward(self, gm: fx.GraphModule, *args):
        if self.sharded_data:  # fully_shard swaps the store's parameters: point the program at the current ones
            self.store.adopt(gm)
        return gm(*args)


def _sum_hook(group, bucket):
    """DDP communication hook that sums gradients (DDP's default divides by the group size)."""
    future = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return future.then(lambda f: f.value()[0])


class ParallelModel(nn.Module):
    """This rank's part of the parallel program. Use ``step()`` to train and call it for inference."""

    def __init__(
        self,
        model: nn.Module,
        mesh: Mesh,
        groups: MeshGroups | None,
        *,
        example_inputs: tuple,
        loss_fn: Callable | None,
        target: torch.Tensor | None,
        microbatches: int,
        local_batch: bool,
        tp_indivisible: str = "error",
        schedule: str = "1f1b",
        chunks: int = 1,
        pipeline_starts: list[str] | None = None,
        cp_attention: str = "gather",
        cp_load_balance: bool = False,
        mixed_precision: str | None = None,
        activation_checkpointing: bool = False,
        tp_plan: TensorParallelPlan | None = None,
        data_parallel: str = "ddp",
        timeout: datetime.timedelta = datetime.timedelta(seconds=120),
    ) -> None:
        super().__init__()
        self.mesh = mesh
        self.groups = groups
        self.loss_fn = loss_fn
        self.microbatches = microbatches
        self.local_batch = local_batch
        self.tp_indivisible = tp_indivisible
        if tp_plan is not None and tp_plan.size != mesh.tp:
            raise ValueError(f"the tp plan was made for tp={tp_plan.size}, the mesh has tp={mesh.tp}")
        self.plan: TensorParallelPlan | None = tp_plan
        self.cp_plan: ContextParallelPlan | None = None  # of the latest capture
        self._cp_plans: dict[tuple, ContextParallelPlan] = {}  # by capture: a new sequence length gets its own
        self._cp_positions: dict[int, int] = {}  # position of each sequence-split input -> its sequence dim
        self.cp_attention = cp_attention
        self.cp_load_balance = cp_load_balance
        if mixed_precision not in (None, "bf16"):
            raise ValueError(f"mixed_precision={mixed_precision!r}: use None (fp32) or 'bf16' (bfloat16 autocast)")
        self.mixed_precision = mixed_precision
        if data_parallel not in ("ddp", "fsdp"):
            raise ValueError(
                f"data_parallel={data_parallel!r}: use 'ddp' (replicas) or 'fsdp' (FSDP2 fully_shard over dp)"
            )
        self.data_parallel = data_parallel
        self.activation_checkpointing = activation_checkpointing
        self.replica = _Replica(codegen.ParamStore())
        object.__setattr__(self, "_model", model)  # not a submodule: this rank trains the store's tensors
        self.training = model.training  # train()/eval() on the parallel model choose the mode of later captures
        self._train: dict[tuple, TrainProgram] = {}
        self._infer: dict[tuple, tuple[Captured, codegen.RankProgram]] = {}
        self._checks: dict[tuple, InputChecks] = {}  # by capture: the range checks of its ids and targets
        self._batched: dict[tuple, list[bool] | None] = {}  # by inference capture: which outputs carry the batch
        self._stages: dict[tuple, list] = {}  # under pipeline parallelism: every stage, by capture
        self._ddp: DistributedDataParallel | None = None
        self._reducer = None  # under pipeline parallelism with dp x cp > 1: sums gradients during the backwards
        self._steps = 0
        self.pipeline = None
        if mesh.pp > 1:
            self.pipeline = Pipeline(mesh, groups, schedule=schedule, chunks=chunks, microbatches=microbatches,
                                     starts=pipeline_starts, timeout=timeout)
        self._check_batch(example_inputs)
        if target is not None:
            self._program(*self._microbatch_views(example_inputs, target)[0])

    # ----------------------------------------------------------------------------------------- API

    @property
    def model(self) -> nn.Module:
        """The user's unmodified model (its replicated parameters are the ones trained here)."""
        return self._model

    @property
    def rank(self) -> int:
        return self.groups.rank if self.groups is not None else 0

    def coord(self, axis: str) -> int:
        return self.groups.coords[axis] if self.groups is not None else 0

    def step(self, *inputs, target: torch.Tensor) -> torch.Tensor:
        """Forward and backward over this rank's microbatches; returns the global batch's loss.

        Gradients are accumulated into ``.grad`` (call ``optimizer.zero_grad()`` between steps) and,
        when this returns, are reduced over data parallelism.
        """
        if self.loss_fn is None:
            raise ValueError("step() needs a loss: pass loss_fn=... to autoshard.parallelize")
        self._check_batch(inputs)
        self._check_sequence((*inputs, target))
        microbatches = self._microbatch_views(inputs, target)
        self._check_data(self._program(*microbatches[0]).captured, (*inputs, target))
        self._steps += 1
        divisor = self._divisor(inputs, target, microbatches)
        with self._fresh_gradients():
            return self._step(microbatches, divisor)

    def _step(self, microbatches: list, divisor) -> torch.Tensor:
        if self.pipeline is not None:
            program = self._program(*microbatches[0])
            local = [self._cp_local(program.captured, (*i, t)) for i, t in microbatches]
            sharded = self.replica.sharded_data
            if sharded:
                _fsdp_accumulate(self.replica)
            call = (lambda gm, *args: self.call(self.replica, gm, *args)) if sharded else self.call
            try:
                total = self.pipeline.run_step(program.runners, [(a[:-1], a[-1]) for a in local], divisor,
                                               self._steps, call=call, reducer=self._reducer, device=self.device)
            except Exception:
                if self._reducer is not None:
                    self._reducer.reset()
                raise
            with self._stall_guard("gradient sums (dp x cp, tied weights) and the loss sum", None):
                if self._reducer is not None:
                    self._reducer.finish(self.replica.store.named_parameters())
                if sharded:
                    _fsdp_reduce(self.replica)
                self.pipeline.sum_tied_gradients(self.replica.store)
                return self._sum_over_dp(total)
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        with self._stall_guard("setting up data parallelism", None):
            replicated = self._replicated()
        for index, (mb_inputs, mb_target) in enumerate(microbatches):
            program = self._program(mb_inputs, mb_target)
            last = index == len(microbatches) - 1
            with self._stall_guard("forward/backward", index), self._sync(last):
                (loss,) = self.call(replicated, program.gm, *self._cp_local(program.captured, (*mb_inputs, mb_target)))
                loss = loss / (divisor * program.cp_copies)
                loss.backward()
            total = total + loss.detach().float()
        with self._stall_guard("loss all-reduce", None):
            return self._sum_over_dp(total)

    @property
    def device(self) -> torch.device:
        """Where this rank computes: its parameters' device (the current CUDA device under NCCL before any)."""
        found = next((p.device for p in self.replica.parameters() if p.device.type != "meta"), None)
        if found is not None:
            return found
        if self.groups is not None and self.groups.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def call(self, fn, *args):
        """Run a program's forward under this model's precision and activation-checkpointing options."""
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16) if self.mixed_precision == "bf16" else None
        with autocast or contextlib.nullcontext():
            if self.activation_checkpointing:
                return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
            return fn(*args)

    def forward(self, *inputs):
        """Inference: the model's outputs for ``inputs``, on every rank.

        Under data parallelism with a global batch, each dp rank computes its own slice of the batch and
        the outputs are all-gathered over dp, when every output carries the batch along dim 0 (found by
        propagating the batch dim through the inference graph); otherwise, for example for an output
        reduced over the batch, every dp rank computes the whole batch.
        """
        batch = batching.batch_size(inputs)
        if self.mesh.dp > 1 and not self.local_batch and batch is not None and batch % self.mesh.dp == 0:
            local = batching.split(inputs, self.mesh.dp)[self.coord("dp")]
            captured, program = self._inference(local)
            self._check_data(captured, inputs)
            batched = self._batch_outputs(captured, batch // self.mesh.dp)
            if batched is not None:
                flat, spec = self._run_inference(captured, program, local)
                flat = [self._gather_batch(t) if split else t for t, split in zip(flat, batched, strict=True)]
                return pytree.tree_unflatten(flat, spec)
        captured, program = self._inference(inputs)
        self._check_data(captured, inputs)
        flat, spec = self._run_inference(captured, program, inputs)
        return pytree.tree_unflatten(flat, spec)

    def _inference(self, inputs: tuple):
        """The inference capture at these input shapes and this rank's program(s) built from it (cached)."""
        key = (shapes_of(inputs), self.training)
        if key not in self._infer:
            captured = capture(self.model, inputs, training=self.training)
            self._infer[key] = (captured, self._build(captured))
        return self._infer[key]

    def _run_inference(self, captured: Captured, program, inputs: tuple) -> tuple[list, pytree.TreeSpec]:
        """This rank's flat outputs for ``inputs`` and the spec that folds them into the model's output."""
        if self.pipeline is None:
            if self.data_parallel == "fsdp" and self.mesh.dp * self.mesh.cp > 1:  # FSDP2 gathers the parameters
                flat = self._replicated()(program.gm, *pytree.tree_leaves(self._cp_local(captured, inputs)))
            else:
                flat = program.gm(*pytree.tree_leaves(self._cp_local(captured, inputs)))
            return list(flat), program.out_spec
        stages = self._stages[captured.key]
        if not self.replica.sharded_data:
            _, flat = self.pipeline.forward_only(stages, program, inputs, device=self.device)
            return flat, captured.gm._out_spec
        self.replica.unshard()  # FSDP2: this rank's stages read their whole (tp-local) parameters
        try:
            for stage in program.values():
                self.replica.store.adopt(stage.gm)
            _, flat = self.pipeline.forward_only(stages, program, inputs, device=self.device)
        finally:
            self.replica.reshard()
        return flat, captured.gm._out_spec

    def _batch_outputs(self, captured: Captured, local_batch: int) -> list[bool] | None:
        """For each flat output of an inference capture at the local batch: whether it is this rank's slice of
        the batch along dim 0. None when the outputs cannot be assembled from slices (an op mixes the batch)."""
        if captured.key in self._batched:
            return self._batched[captured.key]
        gm = codegen.prepare(captured)  # without export's shape guards (they read every input)
        seeds = {n.target: Shard(0) for n in gm.graph.nodes if n.op == "placeholder"
                 and _leading_dim(n) == local_batch}
        prop = propagate(gm, seeds, self.mesh.dp, keep_outputs=True)
        output = next(n for n in gm.graph.nodes if n.op == "output")
        flags: list[bool] | None = []
        for leaf in pytree.tree_leaves(output.args[0]):
            placement = prop.of(leaf) if isinstance(leaf, fx.Node) else R
            if placement == Shard(0):
                flags.append(True)
            elif placement == R:
                flags.append(False)
            else:
                flags = None
                break
        if any(not _broadcast_over_batch(r) for r in redistributions(prop)):
            flags = None  # some op needs the whole batch: computing slices would be wrong
        self._batched[captured.key] = flags
        return flags

    def _gather_batch(self, local: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(local) for _ in range(self.mesh.dp)]
        dist.all_gather(parts, local.contiguous(), group=self.groups.group("dp"))
        return torch.cat(parts, dim=0)

    def parameters(self, recurse: bool = True):
        """This rank's parameters (its shards), for any torch optimizer."""
        if not self._train and not self._infer:
            raise ValueError(
                "nothing is captured yet, so this rank holds no parameters: pass an example target=... to "
                "autoshard.parallelize (the training graph is then captured at once), or run pm.step() first"
            )
        return super().parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """This rank's parameters (its shards) under the model's own names, as ``model.named_parameters()``
        gives them, so optimizer groups built from names (no weight decay on biases and norms) are the same."""
        if not self._train and not self._infer:
            self.parameters()  # raises what to do
        names = self._names()
        for target, param in self.replica.store.named_parameters(remove_duplicate=remove_duplicate):
            original = names.get(target, [target])
            for name in original if not remove_duplicate else original[:1]:
                yield prefix + name, param

    def code(self, rank: int | None = None) -> str:
        """The Python code of the graph module that ``rank`` runs (this rank by default)."""
        rank = self.rank if rank is None else rank
        if not 0 <= rank < self.mesh.world_size:
            raise ValueError(f"rank {rank} is not in {self.mesh}: ranks are 0..{self.mesh.world_size - 1}")
        captured, program = self._latest()
        if rank == self.rank:
            return program.code
        return codegen.build(captured, self._sharding(self.mesh.coords(rank), groups=False)).code

    def gradients(self) -> dict[str, torch.Tensor | None]:
        """Every parameter's gradient at full shape, keyed by all of the original model's names."""
        return self._full(lambda p: p.grad)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter at full shape (gathered over tp), keyed by all of the original model's names."""
        return self._full(lambda p: p.detach())

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:  # noqa: ARG002 - nn.Module's signature
        """The original model's state: every parameter at full shape under its original names, and buffers."""
        state = {name: value.detach() for name, value in self.full_parameters().items()}
        state.update({name: b.detach() for name, b in self.model.named_buffers()})
        return state

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):  # noqa: ARG002
        """Load the original model's full state dict; every rank keeps its own shards."""
        from autoshard.runtime import state

        state.load_state_dict(self, state_dict)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm over all ranks and shards (equal to the unsharded model's)."""
        from autoshard.runtime import state

        return state.clip_grad_norm_(self, max_norm)

    def save_checkpoint(self, path: str) -> None:
        """Each rank writes its own shards (torch.distributed.checkpoint); loadable under any mesh."""
        from autoshard.runtime import state

        state.save_checkpoint(self, path)

    def load_checkpoint(self, path: str) -> None:
        """Read a checkpoint saved under any mesh into this rank's shards."""
        from autoshard.runtime import state

        state.load_checkpoint(self, path)

    def timeline(self) -> str:
        """Under pipeline parallelism: the last step's actions on this rank as they ran, with the measured idle
        share next to the schedule's simulated bubble."""
        if self.pipeline is None:
            raise ValueError("timeline() describes a pipeline: this model has pp=1")
        text = self.pipeline.timeline()
        if self._reducer is not None and self._steps:
            text += (f"\n  gradient sums over dp x cp: {self._reducer.overlapped} of {len(self._reducer.buckets)} "
                     "buckets launched while the backward still ran")
        return text

    def materialize(self, device=None, *, buffers=None, init=None) -> int:
        """For a model built on ``meta``: allocate only this rank's shards on ``device``, then fill them from a
        checkpoint (``load_checkpoint``) or, with ``init``, by the model's own initialisers (see ``state.materialize``).
        """
        from autoshard.runtime import state

        return state.materialize(self, device, buffers=buffers, init=init)

    def explain(self) -> str:
        """A readable report of what the compiler did (see ``autoshard.explain``)."""
        from autoshard.explain import explain

        return explain(self)

    # ----------------------------------------------------------------------------------- internals

    def _latest(self) -> tuple[Captured, codegen.RankProgram]:
        if self._train:
            program = next(reversed(self._train.values()))
            return program.captured, program.program
        if self._infer:
            return next(reversed(self._infer.values()))
        raise ValueError("nothing is captured yet: run step() or pass target=... to autoshard.parallelize")

    def _names(self) -> dict[str, list[str]]:
        captured, _ = self._latest()
        return captured.names

    def _full(self, read: Callable) -> dict[str, torch.Tensor | None]:
        """Full tensors gathered over tp; under pp every rank contributes the parameters of its stages."""
        store = self.replica.store
        mine = {}
        for target in sorted(self._names()):
            if store._lookup(target) is not None:
                mine[target] = self._gather(target, read(store.get_parameter(target)))
        if self.pipeline is not None:
            everyone: list = [None] * self.mesh.pp
            # on the CPU: a pickled CUDA tensor would unpickle onto the sender's GPU index
            dist.all_gather_object(everyone, {t: v.detach().cpu() if v is not None else None for t, v in mine.items()},
                                   group=self.groups.group("pp"))
            mine = {t: v for part in everyone for t, v in part.items()}
        # A parameter the graph never reads is held by no program: report the model's own (never trained) tensor.
        own = dict(self.model.named_parameters(remove_duplicate=False))
        return {
            name: mine[target] if target in mine else (read(own[name]) if read(own[name]) is not None else None)
            for target, names in self._names().items()
            for name in names
        }

    def _gather(self, target: str, local: torch.Tensor | None) -> torch.Tensor | None:
        if local is not None and hasattr(local, "full_tensor"):  # sharded over dp x cp by FSDP2
            local = local.full_tensor()
        placement = self.plan.params[target].placement if self.plan is not None else None
        if local is None or not isinstance(placement, Shard):
            return local
        group = self.groups.group("tp")
        parts = [torch.empty_like(local) for _ in range(self.mesh.tp)]
        dist.all_gather(parts, local.contiguous(), group=group)
        full = unshard(parts, placement.dim, placement.blocks)
        return full.narrow(placement.dim, 0, self.full_shape(target)[placement.dim])  # drop vocab padding

    def full_shape(self, target: str) -> tuple[int, ...]:
        """The shape of parameter ``target`` (its name in the captured graphs) in the original model."""
        captured, _ = self._latest()
        return tuple(captured.gm.get_parameter(target).shape)

    def _build(self, captured: Captured) -> codegen.RankProgram:
        if self.mesh.tp > 1 and self.plan is None:
            self.plan = plan_tensor_parallel(captured.gm, self.mesh.tp, indivisible=self.tp_indivisible)
            if all(not isinstance(p.placement, Shard) for p in self.plan.params.values()):
                warnings.warn(
                    f"autoshard found no block to split over tp={self.mesh.tp} in {type(self.model).__name__} (no "
                    "column -> row pattern, no vocab-parallel embedding): it runs fully replicated on the tp ranks",
                    stacklevel=4,
                )
        if self.mesh.cp > 1:
            self.cp_plan = self._cp_plans[captured.key] = self._plan_context_parallel(captured)
        sharding = self._sharding(self.groups.coords if self.groups else {}, training=captured.with_loss)
        if self.pipeline is None:
            built = codegen.build(captured, sharding, store=self.replica.store)
        else:
            stages, built = self.pipeline.build(captured, sharding, self.replica.store)
            self._stages[captured.key] = stages
        self._check_fully_sharded(captured)
        return built

    def _check_fully_sharded(self, captured: Captured) -> None:
        """Under FSDP2 the parameters are sharded once: a later capture may not bring parameters of its own."""
        if not self.replica.sharded_data:
            return
        new = [name for name, p in self.replica.store.named_parameters() if not hasattr(p, "device_mesh")]
        if new:
            raise ValueError(
                f"the capture at input shapes {captured.input_shapes} reads parameters no earlier capture read "
                f"({', '.join(new[:3])}{'...' if len(new) > 3 else ''}), and under data_parallel='fsdp' the "
                "parameters were sharded when the first training graph was captured: capture first with inputs "
                "that reach every parameter (pass that example target to parallelize), or use data_parallel='ddp'"
            )

    def _sharding(self, coords, *, training: bool = True, groups: bool = True) -> codegen.Sharding:
        """How the rank at ``coords`` shards a captured graph (without process groups when ``groups`` is off)."""
        live = groups and self.groups is not None
        return codegen.Sharding(
            tp_plan=self.plan, tp_rank=coords.get("tp", 0),
            tp_group=self.groups.group("tp") if live and self.mesh.tp > 1 else None,
            cp_plan=self.cp_plan, cp_rank=coords.get("cp", 0),
            cp_group=self.groups.group("cp") if live and self.mesh.cp > 1 else None,
            training=training,
        )

    def _plan_context_parallel(self, captured: Captured) -> ContextParallelPlan:
        """The first capture's cp plan when this capture's sequence is as long, else a plan of its own."""
        names = [n.target for n in captured.gm.graph.nodes if n.op == "placeholder"]
        plan = self.cp_plan
        present = [(name, dim) for name, dim in (plan.inputs.items() if plan is not None else ()) if name in names]
        if plan is not None and all(captured.input_shapes[names.index(name)][dim] == plan.seq_len
                                    for name, dim in present):
            return plan  # the same sequence length (an inference capture, whose inputs are named otherwise, too)
        plan = plan_context_parallel(captured.gm, self.mesh.cp, load_balance=self.cp_load_balance,
                                     attention=self.cp_attention)
        if not self._cp_positions:
            self._cp_positions = {names.index(name): dim for name, dim in plan.inputs.items()}
        return plan

    def _check_sequence(self, values: tuple) -> None:
        """Refuse, on every rank alike and before any collective, a sequence the cp ranks cannot split."""
        for position, dim in self._cp_positions.items():
            value = values[position] if position < len(values) else None
            if isinstance(value, torch.Tensor) and value.dim() > dim:
                check_divisible(dataclasses.replace(self.cp_plan, seq_len=value.shape[dim]))

    def _cp_local(self, captured: Captured, args: tuple) -> tuple:
        """This cp rank's tokens of the sequence-split inputs (all of every other input)."""
        plan = self._cp_plans.get(captured.key)
        if plan is None:
            return args
        names = [n.target for n in captured.gm.graph.nodes if n.op == "placeholder"]
        index = plan.positions(self.coord("cp"))
        return tuple(
            a.index_select(plan.inputs[name], index.to(a.device)) if name in plan.inputs else a
            for name, a in zip(names, args, strict=True)
        )

    def _program(self, mb_inputs: tuple, mb_target: torch.Tensor) -> TrainProgram:
        key = (shapes_of((*mb_inputs, mb_target)), self.training)
        if key not in self._train:
            captured = capture(self.model, mb_inputs, loss_fn=self.loss_fn, example_target=mb_target,
                               training=self.training)
            _check_loss_trains(captured, self.model)
            token_loss = find_token_loss(captured.gm)
            count_gm = None
            if token_loss is not None:
                count_gm = token_count_graph(captured.gm, token_loss)
                sum_loss_pass(captured.gm, token_loss)
            built = self._build(captured)
            if self.data_parallel == "fsdp" and self.mesh.dp * self.mesh.cp > 1:
                self._fully_sharded()  # now, so that an optimizer built next holds the sharded parameters
            if self.pipeline is None:
                copies = self.mesh.cp if self.mesh.cp > 1 and not _returns_partial(built.gm) else 1
                self._train[key] = TrainProgram(captured, built, token_loss, count_gm, cp_copies=copies)
            else:
                stages = self._stages[captured.key]
                first = built[min(built)]
                runners = self.pipeline.runners(stages, built)
                if self._reducer is None and self.mesh.dp * self.mesh.cp > 1 and self.data_parallel == "ddp":
                    self._reducer = self.pipeline.reducer(built, self.replica.store, self.groups.group("data"))
                self._train[key] = TrainProgram(captured, first, token_loss, count_gm, runners)
        return self._train[key]

    def _replicated(self) -> nn.Module:
        """The replica, wrapped by DDP over the dp group when there is more than one dp rank."""
        if self.mesh.dp * self.mesh.cp == 1:
            return self.replica
        if self.data_parallel == "fsdp":
            return self._fully_sharded()
        if self._ddp is None:
            group = self.groups.group("data")
            self._ddp = DistributedDataParallel(
                self.replica,
                process_group=group,
                find_unused_parameters=self._has_unused_parameters(),
                **_NO_BUFFER_SYNC,
            )
            self._ddp.register_comm_hook(group, _sum_hook)
        return self._ddp

    def _fully_sharded(self) -> nn.Module:
        """The replica under PyTorch's FSDP2 over dp x cp: parameters, gradients and optimizer state sharded."""
        if not self.replica.sharded_data:
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.fsdp import fully_shard

            mesh = DeviceMesh.from_group(self.groups.group("data"), self.device.type)
            # Under pipelining a stage runs one forward per microbatch: keep the parameters gathered for the
            # step rather than all-gathering them again for every microbatch (torchtitan's default too).
            fully_shard(self.replica, mesh=mesh, reshard_after_forward=self.pipeline is None)
            self.replica.set_gradient_divide_factor(1.0)  # losses are normalised globally: gradients are sums
            self.replica.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no pre-multiplied sum
            self.replica.sharded_data = True
        return self.replica

    def _has_unused_parameters(self) -> bool:
        """Whether some parameter gets no gradient: the graph may read it (a pooler whose output the loss
        ignores, a sparse-attention indexer that only picks positions), but no differentiable path leads from
        it to the loss. DDP must then be told, or it waits for that gradient forever."""
        gm = next(iter(self._train.values())).gm
        used = {id(_attribute(gm, n.target)) for n in reaching_output(gm) if n.op == "get_attr"}
        return any(id(p) not in used for p in self.replica.parameters() if p.requires_grad)

    def _sync(self, last: bool):
        if self.replica.sharded_data:
            self.replica.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
        if self._ddp is None or last:
            return contextlib.nullcontext()
        return self._ddp.no_sync()

    def _divisor(self, inputs: tuple, target: torch.Tensor, microbatches: list) -> torch.Tensor | float:
        program = self._program(*microbatches[0])
        if program.count_gm is None:
            return float(self.microbatches * self.mesh.dp)
        if self.local_batch:
            local = sum(program.count_gm(*mb_inputs, mb_target) for mb_inputs, mb_target in microbatches)
            return self._sum_over_dp(local.float()) / self.mesh.cp  # every cp rank counted the whole sequence
        views = batching.split((*inputs, target), self.mesh.dp * self.microbatches)
        return sum(program.count_gm(*view) for view in views).float()

    @contextlib.contextmanager
    def _fresh_gradients(self):
        """Set aside the gradients of earlier ``step()`` calls and add them back after this step's sums.

        Every sum a step makes (over dp x cp, over tied copies on several pipeline ranks) must add this step's
        gradients only: a gradient that still holds an earlier, already summed step would be counted once per
        rank. So gradient accumulation over several steps equals eager ``backward()`` calls. FSDP2 adds each
        reduce-scattered gradient into the sharded gradient it keeps, so it needs no help.
        """
        if self.replica.sharded_data:
            yield
            return
        earlier = {}
        for p in self.replica.parameters():
            if p.grad is not None:
                earlier[p], p.grad = p.grad, None
        try:
            yield
        finally:
            for p, grad in earlier.items():
                if p.grad is not None:
                    grad.add_(p.grad)
                p.grad = grad

    def _check_data(self, captured: Captured, values: tuple) -> None:
        """Refuse ids and targets outside the vocabulary, on every rank alike, before any collective.

        ``values`` is what this rank was given (the global batch, or its own slice with ``local_batch``); the
        checks run on every microbatch-sized piece of it, as the capture is at the microbatch's shape.
        """
        if captured.key not in self._checks:
            self._checks[captured.key] = input_checks(captured.gm)
        checks = self._checks[captured.key]
        if not checks.checks:
            return
        batch = batching.batch_size(values)
        size = next((s[0] for s in captured.input_shapes if isinstance(s, tuple) and s), None)
        parts = batch // size if batch and size and batch % size == 0 else 1
        for piece in batching.split(values, parts):
            checks.run(*piece)

    def _sum_over_dp(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks that split the batch and the sequence (dp x cp)."""
        if self.mesh.dp * self.mesh.cp == 1:
            return value
        value = value.clone()
        dist.all_reduce(value, group=self.groups.group("data"))
        return value

    def _check_batch(self, inputs: tuple) -> None:
        batching.check(batching.batch_size(inputs), microbatches=self.microbatches, dp=self.mesh.dp,
                       local=self.local_batch)

    def _microbatch_views(self, inputs: tuple, target: torch.Tensor) -> list[tuple[tuple, torch.Tensor]]:
        values = (*inputs, target)
        if not self.local_batch and self.mesh.dp > 1:
            values = batching.split(values, self.mesh.dp)[self.coord("dp")]
        return [(view[:-1], view[-1]) for view in batching.split(values, self.microbatches)]

    @contextlib.contextmanager
    def _stall_guard(self, phase: str, microbatch: int | None):
        try:
            yield
        except RuntimeError as e:
            if not _is_distributed_failure(e):
                raise
            where = f"microbatch {microbatch} " if microbatch is not None else ""
            coords = dict(self.groups.coords) if self.groups else {}
            raise StepError(
                f"rank {self.rank} ({coords}) failed in step {self._steps}, {where}{phase}, waiting on its peers "
                f"({self._peers()}): one of them stalled or died. {str(e).splitlines()[0]}"
            ) from e

    def _peers(self) -> str:
        """The other ranks this rank exchanges with, by group (the candidates for a stalled peer)."""
        if self.groups is None:
            return "none"
        axes = [a for a in ("tp", "pp", "cp") if self.mesh.degree(a) > 1]
        parts = [f"{a} {self.groups.ranks(a)}" for a in axes]
        if self.mesh.dp * self.mesh.cp > 1:
            parts.append(f"dp x cp {self.groups.ranks('data')}")
        return ", ".join(parts)


def _check_loss_trains(captured: Captured, model: nn.Module) -> None:
    """Refuse, on every rank alike and before any collective, a captured loss that no trainable parameter reaches."""
    trainable = {name for name, p in captured.gm.named_parameters() if p.requires_grad}
    if trainable and not any(n.op == "get_attr" and n.target in trainable for n in reaching_output(captured.gm)):
        raise ValueError(
            f"the captured graph of {type(model).__name__} computes a loss that does not depend on its parameters, "
            "although the model's does: a part of the model hides its computation from the capture (a custom "
            "autograd Function that runs its forward without gradients and recomputes in backward, such as "
            "reversible layers), so autoshard cannot train it; replace that part by plain modules"
        )


def _fsdp_accumulate(replica) -> None:
    """FSDP2 under a pipeline: keep unsharded gradients over the step's many backwards, reduce none yet."""
    replica.set_is_last_backward(False)
    replica.set_reshard_after_backward(False)
    replica.set_requires_gradient_sync(False)


def _fsdp_reduce(replica) -> None:
    """FSDP2 under a pipeline, after the last backward: reduce-scatter the gradients and reshard (as
    torch.distributed.pipelining does, since no single backward is the step's last one). It calls FSDP2's
    own post-backward steps, private API that torch.distributed.pipelining uses the same way (torch 2.13)."""
    from torch.distributed.fsdp import fully_shard

    replica.set_is_last_backward(True)
    replica.set_reshard_after_backward(True)
    replica.set_requires_gradient_sync(True)
    state = fully_shard.state(replica)
    for fsdp_state in state._state_ctx.all_states:
        for group in fsdp_state._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()


def _broadcast_over_batch(redistribution) -> bool:
    """A replicated value that a batch slice needs sliced is harmless when it is an expand over the batch dim:
    every slice of it is the same (an attention mask broadcast to the batch, for example)."""
    value = redistribution.value
    if redistribution.src != R or redistribution.dst != Shard(0) or value.target is not torch.ops.aten.expand.default:
        return False
    source = value.args[0].meta.get("val")
    target = value.meta.get("val")
    return isinstance(source, torch.Tensor) and (source.dim() < target.dim() or source.shape[0] == 1)


def _leading_dim(node: fx.Node) -> int | None:
    val = node.meta.get("val")
    return val.shape[0] if isinstance(val, torch.Tensor) and val.dim() > 0 else None


def _returns_partial(gm: fx.GraphModule) -> bool:
    """Whether the training graph's loss is a per-rank partial sum (split tokens) rather than the whole loss."""
    return bool(gm.meta.get(PARTIAL_OUTPUT, False))


def _attribute(module: nn.Module, target: str):
    for part in target.split("."):
        module = getattr(module, part)
    return module


def _is_distributed_failure(error: RuntimeError) -> bool:
    text = str(error).lower()
    return any(word in text for word in ("timed out", "timeout", "gloo", "nccl", "connection", "peer"))
