"""The parallel model a rank runs: a cache of its compiled builds, a gradient-sync strategy and the step.

One ``ParallelModel`` per rank. It keeps the ``RankBuild`` (``autoshard.compile``) of every capture of the
model, by input shapes and mode (a training graph with the loss, an inference graph), all reading one
store of this rank's parameters; sums gradients over dp x cp through a ``data_parallel.GradientSync``
(DDP, FSDP2 or the pipeline's reducer); and runs ``step()``: slice the global batch for this dp rank, cut
it into microbatches, run each forward and backward (or the pipeline schedule), and return the loss of
the whole global batch.

Loss normalisation: every microbatch's loss term is divided by one global divisor (the number of
counted tokens of the global batch for token losses, the number of microbatches in the global batch
otherwise), so every gradient reduction (microbatches, dp) is a plain sum.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import fx, nn
from torch.utils import _pytree as pytree

from autoshard import batching, codegen, peers
from autoshard.capture import capture, shapes_of
from autoshard.certificate import Certificate
from autoshard.compile import RankBuild, capture_for_training, compile_rank, with_coords
from autoshard.job_plan import plan_job, two_passes
from autoshard.mesh import Mesh, MeshGroups
from autoshard.options import CompileOptions
from autoshard.passes.writes import written_state
from autoshard.runtime import alike, communication, gather, habits, inference, recompute
from autoshard.runtime.anomaly import AnomalyWatch
from autoshard.runtime.compiled import Compiler
from autoshard.runtime.data_parallel import Replica, gradient_sync
from autoshard.runtime.failures import StepError, collective_guard, stall_guard
from autoshard.runtime.metrics import Metrics, progress, ticking
from autoshard.runtime.pipeline import Pipeline
from autoshard.runtime.two_passes import TwoPassStep

__all__ = ["ParallelModel", "StepError"]


log = logging.getLogger("autoshard")
_MODELS = itertools.count()  # parallel models are made in the same order on every rank

class ParallelModel(nn.Module):
    """This rank's part of the parallel program. Use ``step()`` to train and call it for inference."""

    def __init__(self, model: nn.Module, mesh: Mesh, groups: MeshGroups | None, options: CompileOptions, *,
                 example_inputs: tuple, loss_fn: Callable | None, target: torch.Tensor | None,
                 lint: list | None = None) -> None:
        super().__init__()
        options.check_mesh(mesh)
        self.mesh, self.groups, self.options, self.loss_fn, self.lint = mesh, groups, options, loss_fn, lint
        self.ranking = None  # mesh="auto" with a profile: every candidate's prediction, fastest first
        self.replica = Replica(codegen.ParamStore())
        self.anomaly = AnomalyWatch() if options.detect_anomaly else None
        if self.anomaly is not None:
            self.replica.run = self.anomaly.run
        self.compiler = Compiler() if options.compile else None
        if self.compiler is not None:
            self.replica.run = self.compiler
        object.__setattr__(self, "_model", model)  # not a submodule: this rank trains the store's tensors
        self.training = model.training  # train()/eval() on the parallel model choose the mode of later captures
        self._builds: dict[tuple, RankBuild] = {}  # by (input shapes, mode, with loss)
        self._two_passes: dict[tuple, TwoPassStep] = {}  # by the second pass's capture key
        self._runners: dict[tuple, dict] = {}  # under pipeline parallelism: this rank's stage runners, by build
        self._traced: dict[tuple, object] = {}  # inference captures taken with a training one, by (shapes, mode)
        self._steps = 0
        self._verified: set = set()  # the batch shapes whose step's communication was checked
        self._checked: tuple | None = None  # the last step checked, its build and its certificate
        self._metrics = Metrics(self)
        self.padding_is_read: bool | None = None  # by generate: whether right padding changes the logits before it
        self._name, self._exchanges = f"autoshard/exchanges/{next(_MODELS)}", itertools.count(1)  # alike on every rank
        self.materialized = None  # after materialize(): the device and the buffers given, for later builds
        self._kinds: tuple | None = None  # integer or floating, per input and the target, as the first step gave them
        self.pipeline = Pipeline(mesh, groups, options) if mesh.pp > 1 else None
        self.sync = gradient_sync(self.replica, data_parallel=options.data_parallel, ranks=mesh.dp * mesh.cp,
                                  group=groups.group("data") if groups is not None and mesh.dp * mesh.cp > 1 else None,
                                  pipeline=self.pipeline, device_type=self.device.type)
        if groups is not None and mesh.ep > 1 and mesh.expert_replicas > 1:
            self.sync.experts_group = groups.group("ep_replicas")
        self._check_batch(example_inputs)
        self._check_alike_model(model)
        habits.watch(self)  # torch's habits over the user's model or this one: refused, or made exact
        if target is not None:
            self._check_kinds((*example_inputs, target))  # the example's kinds are what steps must pass
            self._training_build(*self.microbatch_views(example_inputs, target)[0])

    # ------------------------------------------------------------------------------- what was compiled

    @property
    def model(self) -> nn.Module:
        """The user's unmodified model (its replicated parameters are the ones trained here)."""
        return self._model

    @property
    def builds(self) -> list[RankBuild]:
        """This rank's build of every capture so far, in the order they were made."""
        return list(self._builds.values())

    @property
    def latest(self) -> RankBuild:
        """The latest training build (the latest inference build when there is none)."""
        builds = [b for b in self.builds if b.training] or self.builds
        if not builds:
            raise ValueError("nothing is captured yet: run step() or pass target=... to autoshard.parallelize")
        return builds[-1]

    @property
    def names(self) -> dict[str, list[str]]:
        """Every parameter's name in the captures -> all of the original model's names for it."""
        return self.latest.captured.names

    @property
    def store(self) -> codegen.ParamStore:
        return self.replica.store

    @property
    def plan(self):
        """The tensor-parallel plan (None at tp=1 or before the first capture)."""
        return self.builds[0].tp_plan if self.builds else self.options.tp_plan

    @property
    def job_plan(self):
        """The job's decisions (``job_plan.JobPlan``) from the first capture, the same on every rank: it prints and
        round-trips through JSON, so a running job can be compared with ``autoshard inspect``'s."""
        if not self.builds:
            raise ValueError("nothing is captured yet: run step() or pass target=... to autoshard.parallelize")
        return self.builds[0].plan

    def layout(self, target: str):
        """How this rank holds parameter ``target`` (its name in the captures): ``layout.ParamLayout``."""
        return self.builds[0].layout(target)

    @property
    def rank(self) -> int:
        return self.groups.rank if self.groups is not None else 0

    def coord(self, axis: str) -> int:
        return self.groups.coords[axis] if self.groups is not None else 0

    @property
    def device(self) -> torch.device:
        """Where this rank computes: its parameters' device (the current CUDA device under NCCL before any)."""
        found = next((p.device for p in self.replica.parameters() if p.device.type != "meta"), None)
        if found is not None:
            return found
        if self.groups is not None and self.groups.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def full_shape(self, target: str) -> tuple[int, ...]:
        """The shape of parameter ``target`` (its name in the captured graphs) in the original model."""
        return self.layout(target).shape

    # ------------------------------------------------------------------------------------- training

    def step(self, *inputs, target: torch.Tensor | None = None, divisor=None, loss_scale: float = 1.0) -> torch.Tensor:
        """Forward and backward over this rank's microbatches; returns the global batch's loss.

        Gradients are accumulated into ``.grad`` (call ``optimizer.zero_grad()`` between steps) and,
        when this returns, are reduced over data parallelism.

        ``divisor``: for a loss that is a mean over counted items (tokens whose target is not ignored), what their
        summed loss is divided by, in place of this batch's count: the count over several accumulated steps
        makes their gradients those of one mean over all of them (HuggingFace's ``num_items_in_batch``).
        ``loss_scale`` multiplies the loss and its gradients (``1 / accumulation steps`` for a plain mean).
        """
        if self.loss_fn is None:
            raise ValueError("step() needs a loss: pass loss_fn=... to autoshard.parallelize")
        if target is None:
            raise TypeError(f"pm.step(*inputs, target=...) takes the target by name, for loss_fn(output, target); this "
                            f"call gave {len(inputs)} positional input(s) and no target: write pm.step(x, target=y)")
        with self._running(f"step {self._steps + 1}"):
            self._metrics.begin()
            verify = self._verifies(inputs, target)
            with peers.recording() if verify else contextlib.nullcontext() as sent:
                loss, build = self._train(inputs, target, divisor, loss_scale)
            if verify:
                self._check_communication(sent, inputs, target)
            self._metrics.end(build, inputs, loss)
            return loss

    def certificate(self, *inputs, target: torch.Tensor, exact: bool = True) -> Certificate:
        """What this rank sends in a training step on this batch (``autoshard.certificate``): every collective, its
        kind, group, dtype and elements, per step; what the first step is checked against."""
        microbatches = self.microbatch_views(inputs, target)
        builds = [self._training_build(*mb) for mb in microbatches]
        return communication.step_certificate(self, builds, (*inputs, target), exact=exact)

    def _verifies(self, inputs: tuple, target: torch.Tensor) -> bool:
        """Whether this step's collectives are recorded and checked against its certificate."""
        when = self.options.verify_communication
        if self.groups is None or when == "never" or self.compiler is not None:
            return False
        key = shapes_of((*inputs, target))
        if when == "first" and key in self._verified:
            return False
        self._verified.add(key)
        return True

    def _check_communication(self, sent: list, inputs: tuple, target: torch.Tensor) -> None:
        build = self._training_build(*self.microbatch_views(inputs, target)[0])
        if build.captured.key in self._two_passes:
            return  # a loss that couples the samples: its two passes are not certified yet
        # read off the programs' recorded values first (milliseconds); where that differs from the record, the
        # programs run on fake tensors decide (a value a pass inserted can carry the shape of what it stands for)
        certificate = self.certificate(*inputs, target=target, exact=False)
        if communication.differences(certificate, sent):
            certificate = self.certificate(*inputs, target=target)
        communication.check(certificate, sent, self._steps)
        self._checked = (self._steps, build, certificate)

    def metrics(self) -> dict[str, float]:
        """The last step's numbers: its seconds, tokens, tokens per second (global and per device), TFLOP/s per
        device, MFU (where the device's peak is known), peak memory and, under pp, the bubble measured
        (``runtime.metrics``)."""
        return dict(self._metrics.last)

    def _train(self, inputs: tuple, target: torch.Tensor, divisor, loss_scale: float):
        self._check_kinds((*inputs, target))
        self._check_batch(inputs)
        self._check_alike_batch((*inputs, target))
        microbatches = self.microbatch_views(inputs, target)
        build = self._training_build(*microbatches[0])
        passes = self._two_passes.get(build.captured.key)
        checked = passes.first if passes is not None else build
        checked.check_sequence((*inputs, target))
        checked.check_data((*inputs, target))
        self._steps += 1
        if divisor is not None and build.captured.count_gm is None:
            raise ValueError("step(divisor=...) replaces the count of a loss averaged over counted items (a "
                             "cross-entropy's tokens), and this loss counts none; scale it with loss_scale= instead")
        divisor = self._divisor(build, inputs, target, microbatches) if divisor is None else \
            torch.as_tensor(divisor, dtype=torch.float32, device=self.device)
        divisor = divisor / loss_scale
        if passes is not None:  # a loss coupling the samples: the first pass and the term, on the whole batch
            with self._guard("the first of two passes (a loss that couples the samples)"):
                microbatches, whole = passes.run(self, microbatches)
        with self.sync.fresh_gradients():
            if self.pipeline is not None:
                loss = self._pipeline_step(build, microbatches, divisor)
            else:
                loss = self._step(microbatches, divisor, build if passes is not None else None)
        if self.anomaly is not None:
            with self._guard("detect_anomaly: what every rank found"):
                self.anomaly.check(self, self._steps)
        return (loss if passes is None else whole * loss_scale), build

    def _step(self, microbatches: list, divisor, fed: RankBuild | None = None) -> torch.Tensor:
        """``fed``: the second pass's build, whose microbatches carry the first pass's gradients."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for index, (mb_inputs, mb_target) in enumerate(microbatches):
            build = fed or self._training_build(mb_inputs, mb_target)
            with self._guard("setting up data parallelism"):
                module = self.sync.module(build)  # after the build: DDP is set up for what its program leaves unused
            with self._guard("forward/backward", index), self.sync.microbatch(index == len(microbatches) - 1):
                (loss,) = self.call(module, build.program.gm, *build.local_inputs((*mb_inputs, mb_target)))
                loss = loss / (divisor * build.cp_copies)
                loss.backward()
            total = total + loss.detach().float()
        with self._guard("expert gradient sums over their replicas"):
            self.sync.sum_experts()
        with self._guard("loss all-reduce"):
            return self._sum_over_data(total)

    def _pipeline_step(self, build: RankBuild, microbatches: list, divisor) -> torch.Tensor:
        local = [build.local_inputs((*i, t)) for i, t in microbatches]
        self.sync.begin_pipeline_step()
        sharded = self.sync.sharded
        call = (lambda gm, *args: self.call(self.replica, gm, *args)) if sharded else self.call
        spread = self.pipeline.spread
        try:
            with self._guard("gathering the weights spread over pp"):
                spread.gather(self.store)
            total = self.pipeline.run_step(self._runners[build.captured.key], [(a[:-1], a[-1]) for a in local],
                                           divisor * build.cp_copies, self._steps, call=call, reducer=self.sync.reducer,
                                           device=self.device, whole_backward=self.compiler is not None)
            with self._guard("gradient sums (dp x cp, tied and spread weights) and the loss sum"):
                self.sync.finish_pipeline_step()
                self.pipeline.sum_tied_gradients(self.store)
                spread.scatter(self.store)
                return self._sum_over_data(total)
        except Exception:
            self.sync.abort()
            spread.restore(self.store)
            raise

    def call(self, fn, *args):
        """Run a program's forward under this model's precision and activation-checkpointing options."""
        program = fn if isinstance(fn, fx.GraphModule) else args[0]
        if self.compiler is not None and fn is program:
            fn = self.compiler(program)
        elif self.anomaly is not None and fn is program:
            fn = self.anomaly.run(program)
        with self.precision():
            if not self.options.activation_checkpointing:
                return fn(*args)
            # by segments where the program runs as it is (each recomputed alone: the peak of one, as a model
            # checkpointed per layer); whole where it runs compiled, inspected or through FSDP2's gathers
            segments = None
            if self.compiler is None and self.anomaly is None and not self.sync.sharded:
                segments = recompute.segmented(program)
            if segments is not None:
                return segments(*args) if fn is program else fn(segments, *args[1:])
            restored = recompute.Restored(written_state(program))
            return torch.utils.checkpoint.checkpoint(
                fn, *args, use_reentrant=False, context_fn=lambda: (contextlib.nullcontext(), restored))

    def precision(self):
        """The autocast of ``mixed_precision`` (a null context without it)."""
        if self.options.mixed_precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def microbatch_views(self, inputs: tuple, target: torch.Tensor) -> list[tuple[tuple, torch.Tensor]]:
        """This rank's microbatches of a global batch (of its local batch with ``local_batch``)."""
        values = (*inputs, target)
        if not self.options.local_batch and self.mesh.dp > 1:
            values = batching.split(values, self.mesh.dp)[self.coord("dp")]
        return [(view[:-1], view[-1]) for view in batching.split(values, self.options.microbatches)]

    def generate(self, input_ids: torch.Tensor, *, max_new_tokens: int, **options) -> torch.Tensor:
        """New tokens after ``input_ids`` (batch, prompt), greedy or sampled (``do_sample=True``, ``temperature``,
        ``top_k``, ``generator``), the same on every rank; lengths padded to multiples of ``bucket`` (32) so that a
        sequence of tokens captures once per bucket (``runtime.generate``). Every rank calls it."""
        from autoshard.runtime.generate import generate

        return generate(self, input_ids, max_new_tokens=max_new_tokens, **options)

    def forward(self, *inputs):
        """Inference: the model's outputs for ``inputs``, on every rank (see ``runtime.inference``)."""
        with self._collective("__call__ (inference)"), self._running("an inference call (pm(x))"):
            return inference.forward(self, inputs)

    # ------------------------------------------------------------------------------------ compiling

    def _training_build(self, mb_inputs: tuple, mb_target: torch.Tensor) -> RankBuild:
        key = (shapes_of((*mb_inputs, mb_target)), self.training, True)
        if key not in self._builds:
            self._new_shape(key, "step()", "pad batches to a few lengths (a tokenizer's or collator's "
                            "pad_to_multiple_of=64) or to one length (padding='max_length')")
            start = time.perf_counter()
            with self._ticking(f"autoshard: capturing {type(self.model).__name__} for training"):
                captured = capture_for_training(self.model, mb_inputs, mb_target, self.loss_fn,
                                                training=self.training, outputs=True)
            self._progress(f"captured {type(self.model).__name__} for training at {shapes_of(mb_inputs)}", start)
            if captured.inference is not None:  # for inference at these shapes: no second trace of the model
                self._traced[(shapes_of(mb_inputs), self.training)] = captured.inference
                captured.inference = None
            cut = two_passes(captured, self.mesh, self.options)
            if cut is None:
                build = self._compile(key, captured)
            else:  # the second pass is the step's build; the first pass is an inference build beside it
                first, captured, passes = cut
                build = self._compile(key, captured, notes=[passes.note])
                self._two_passes[captured.key] = TwoPassStep(passes, self._compile(("first pass", *key), first))
            if self.pipeline is not None:
                self._runners[captured.key] = self.pipeline.runners(build)
        return self._builds[key]

    def inference_build(self, inputs: tuple) -> RankBuild:
        """The build of the inference capture at these inputs' shapes (compiled at the first call)."""
        key = (shapes_of(inputs), self.training, False)
        if key not in self._builds:
            self._new_shape(key, "pm(x) for inference", "pad inputs to a few lengths (a tokenizer's "
                            "pad_to_multiple_of=64), or generate with pm.generate(), which pads to buckets")
            start = time.perf_counter()
            with self._ticking(f"autoshard: capturing {type(self.model).__name__} for inference"):
                captured = self._traced.pop(key[:2], None) or capture(self.model, inputs, training=self.training)
            self._progress(f"captured {type(self.model).__name__} for inference at {key[0]}", start)
            self._compile(key, captured)
        return self._builds[key]

    def _compile(self, key: tuple, captured, notes: list[str] = ()) -> RankBuild:
        """This rank's build of ``captured``; its warnings are said by one rank of each pipeline stage only."""
        earlier = self.builds[0].plan if self._builds else None
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as said, self._ticking("autoshard: planning and compiling"):
            warnings.simplefilter("always")
            plan = plan_job(captured, self.mesh, self.options, earlier=earlier)
            plan.notes.extend(notes)
            build = compile_rank(captured, plan, dict(self.groups.coords) if self.groups else {}, groups=self.groups,
                                 store=self.store)
        if self.materialized is not None:  # compiled from the model still on meta: bound to this rank's tensors
            from autoshard.runtime import state

            state.materialized_build(self, [program.gm for program in build.programs.values()])
        if all(self.coord(axis) == 0 for axis in ("dp", "tp", "cp")):
            for w in said:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            for note in build.notes:
                warnings.warn(f"autoshard: in {type(self.model).__name__}: {note}", stacklevel=4)
        if self.pipeline is not None:
            programs = [p.gm for b in [*self._builds.values(), build] for p in b.programs.values()]
            self.pipeline.prepare(build, self.store, programs, self.device)
        self.sync.prepare(build)
        self._builds[key] = build
        habits.built(self)
        self._progress(f"planned and compiled this rank's program for {self.mesh}", start)
        return build

    def _new_shape(self, key: tuple, what: str, fix: str) -> None:
        """Warn once (rank 0) when ``what`` meets a second input shape of its mode: each new shape is a capture and
        a compile of seconds, which a loop over many lengths pays again and again."""
        same = [k for k in self._builds if k[1:] == key[1:]]
        if len(same) == 1 and self.rank == 0:
            warnings.warn(f"autoshard: {what} at new input shapes {key[0]} (after {same[0][0]}): every new shape is "
                          f"captured and compiled again, which takes seconds; {fix}", stacklevel=4)

    def _ticking(self, doing: str):
        """On rank 0, on a terminal: ``doing`` with its seconds counting up while it runs (``metrics.ticking``)."""
        return ticking(self.options, doing) if self.rank == 0 else contextlib.nullcontext()

    def _progress(self, what: str, start: float) -> None:
        """Say (rank 0) what took how long: capture and compile take seconds (``metrics.progress``)."""
        if self.rank == 0:
            progress(self.options, f"autoshard: {what} in {time.perf_counter() - start:.1f} s")

    # --------------------------------------------------------------------------------------- checks

    def _check_kinds(self, values: tuple) -> None:
        """Refuse an input (or target) of floats where the example (or the first step) had integers, or the reverse: its
        program was
        captured for the first kind (a capture is keyed by shapes), and token ids as floats would fail deep inside
        it. The same on every rank (every rank passes the same batch), before any collective."""
        kinds = tuple(v.is_floating_point() if isinstance(v, torch.Tensor) else None for v in values)
        if self._kinds is None:
            self._kinds = kinds
            return
        for i, (now, first) in enumerate(zip(kinds, self._kinds, strict=False)):
            if now is not None and first is not None and now != first:
                what = "the target" if i == len(values) - 1 else f"input {i}"
                given, wanted = ("floats", "integers (token ids, class labels)") if now else ("integers", "floats")
                raise TypeError(f"{what} holds {given} ({values[i].dtype}), but the example passed {wanted} there: "
                                f"pass {wanted} at every step (convert with .long() or .float())")

    def _check_batch(self, inputs: tuple) -> None:
        batching.check(batching.batch_size(inputs), microbatches=self.options.microbatches, dp=self.mesh.dp,
                       local=self.options.local_batch)

    def _check_alike_model(self, model: nn.Module) -> None:
        """Every rank built the same model (``runtime.alike``); a model on ``meta`` is materialized alike later."""
        params = list(model.parameters())
        if any(p.device.type == "meta" for p in params):
            return
        alike.check("the model's parameters", params, self.groups, ("dp", "cp", "tp", "pp"),
                    "every rank must build the same model: seed every process alike (torch.manual_seed) before "
                    "building it, or load the same weights on every rank, before autoshard.parallelize", self.device)

    def _check_alike_batch(self, values: tuple) -> None:
        """Every rank was given the same batch (with ``local_batch``, every rank of one dp coordinate)."""
        tensors = [v for v in pytree.tree_leaves(values) if isinstance(v, torch.Tensor)]
        if self.options.local_batch:
            fix = ("with local_batch=True, the ranks of one dp coordinate (its tp, pp and cp ranks) must be given the "
                   "same part of the batch")
        else:
            fix = ("autoshard takes the global batch on every rank and splits it over dp itself: give every rank the "
                   "same batch (no DistributedSampler or per-rank shuffling or augmentation), or pass local_batch=True "
                   "where each dp rank reads its own part")
        axes = alike.batch_axes(self.options.local_batch)
        with stall_guard(self.mesh, self.groups, self._steps + 1, "comparing the ranks' batches"):
            alike.check(f"step {self._steps + 1}'s batch", tensors, self.groups, axes, fix, self.device)

    def _divisor(self, build: RankBuild, inputs: tuple, target: torch.Tensor, microbatches: list):
        count = build.captured.count_gm
        if count is None:  # a mean over the samples: the parts' average; a sum over them: the parts' sum
            return 1.0 if build.plan.loss_sum else float(self.options.microbatches * self.mesh.dp)
        if self.options.local_batch:
            local = sum(count(*mb_inputs, mb_target) for mb_inputs, mb_target in microbatches)
            return self._sum_over_data(local.float()) / self.mesh.cp  # every cp rank counted the whole sequence
        views = batching.split((*inputs, target), self.mesh.dp * self.options.microbatches)
        return sum(count(*view) for view in views).float()

    @property
    def steps(self) -> int:
        """Training steps taken (``pm.step`` calls), restored by ``load_checkpoint``."""
        return self._steps

    @steps.setter
    def steps(self, value: int) -> None:
        self._steps = value

    def _sum_over_data(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks that split the batch and the sequence (dp x cp)."""
        if self.mesh.dp * self.mesh.cp == 1:
            return value
        value = value.clone()
        with peers.phase("loss"):
            peers.run(dist.all_reduce, value, group=self.groups.group("data"))
        return value

    def _running(self, what: str):
        """One exchange with every rank (a step, an inference call) under a key every rank names alike: a failure
        on one rank ends it on every rank within seconds, with that rank's error (``autoshard.peers``)."""
        if self.groups is None:
            return contextlib.nullcontext()
        who = f"rank {self.groups.rank} ({dict(self.groups.coords)}) in {what}"
        ranks = list(range(self.mesh.world_size))
        return peers.running(self._name, next(self._exchanges), ranks, self.groups.rank, who, self.groups.timeout)

    def _guard(self, phase: str, microbatch: int | None = None):
        return stall_guard(self.mesh, self.groups, self._steps, phase, microbatch)

    def _collective(self, what: str):
        return collective_guard(self.mesh, self.groups, what)

    # ------------------------------------------------------------------------ the model's own face

    def parameters(self, recurse: bool = True):
        """This rank's parameters (its shards), for any torch optimizer."""
        if not self._builds:
            raise ValueError(
                "nothing is captured yet, so this rank holds no parameters: pass an example target=... to "
                "autoshard.parallelize (the training graph is then captured at once), or run pm.step() first"
            )
        return super().parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """This rank's parameters (its shards) under the model's own names, as ``model.named_parameters()``
        gives them, so optimizer groups built from names (no weight decay on biases and norms) are the same."""
        self.parameters()  # raises what to do when nothing is captured yet
        names = self.names
        for target, param in self.store.named_parameters(remove_duplicate=remove_duplicate):
            original = names.get(target, [target])
            for name in original if not remove_duplicate else original[:1]:
                yield prefix + name, param

    def code(self, rank: int | None = None) -> str:
        """The Python code of the graph module that ``rank`` runs (this rank by default)."""
        rank = self.rank if rank is None else rank
        if not 0 <= rank < self.mesh.world_size:
            raise ValueError(f"rank {rank} is not in {self.mesh}: ranks are 0..{self.mesh.world_size - 1}")
        build = self.latest
        return (build if rank == self.rank else with_coords(build, self.mesh.coords(rank))).program.code

    def gradients(self) -> dict[str, torch.Tensor | None]:
        """Every parameter's gradient at full shape, keyed by all of the original model's names."""
        with self._collective("gradients()"):
            return gather.full_tensors(self, lambda p: p.grad)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter at full shape (gathered over tp), keyed by all of the original model's names."""
        with self._collective("full_parameters()"):
            return gather.full_tensors(self, lambda p: p.detach())

    def timeline(self, trace: str | None = None) -> str:
        """Under pipeline parallelism: the last step's actions on this rank as they ran, with the measured idle
        share next to the schedule's simulated bubble. ``trace``: a path where rank 0 also writes every rank's last
        step as one Chrome trace (chrome://tracing and Perfetto open it); with it, every rank calls."""
        if self.pipeline is None:
            raise ValueError("timeline() describes a pipeline: this model has pp=1")
        if trace is not None:
            with self._collective("timeline(trace=...)"):
                self.pipeline.write_trace(trace, self.rank)
        text, reducer = self.pipeline.timeline(), self.sync.reducer
        if reducer is not None and self._steps:
            text += (f"\n  gradient sums over dp x cp: {reducer.overlapped} of {len(reducer.buckets)} "
                     "buckets launched while the backward still ran")
        return text

    def explain(self, *, code: bool = False) -> str:
        """A readable report of what the compiler did for this rank (the report ``autoshard inspect`` prints)."""
        from autoshard.explain import render

        text = render(self.builds, model=self.model, mesh=self.mesh, rank=self.rank, options=self.options,
                      lint=self.lint, code=code, compiler=self.compiler, ranking=self.ranking)
        if self._checked is None:
            return text
        step, build, certificate = self._checked
        lines = [f"{certificate}", f"  step {step} sent exactly this (its collectives recorded and compared)",
                 "bytes on the wire per step against the least each axis's pattern needs:",
                 *communication.against_minimum(self, build, certificate)]
        return text + "\n\n" + "\n".join(lines)

    # the state functions live in ``state``; these are the model's own methods for them
    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:  # noqa: ARG002 - nn.Module's signature
        """The original model's ``state_dict()``: the same keys, every parameter at full shape."""
        from autoshard.runtime import state

        with self._collective("state_dict()"):
            return state.state_dict(self)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):  # noqa: ARG002
        """Load the original model's full state dict (``strict`` as the model's own); every rank keeps its shards."""
        from autoshard.runtime import state

        with self._collective("load_state_dict()"):
            state.load_state_dict(self, state_dict, strict=strict)

    def update_model(self) -> None:
        """Write the trained weights into the model given to ``parallelize`` (gathered from every rank: every rank
        calls it), so that ``model(x)``, ``model.generate`` and ``model.save_pretrained`` use them. Until then, once
        this rank's tensors have changed, the model refuses to run or give its state."""
        from autoshard.runtime import state

        with self._collective("update_model()"):
            state.update_model(self)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm over all ranks and shards (equal to the unsharded model's)."""
        from autoshard.runtime import state

        with self._collective("clip_grad_norm_()"):
            return state.clip_grad_norm_(self, max_norm)

    def save_pretrained(self, directory: str, *, max_shard_size: int | str = "5GB") -> None:
        """Write the model as HuggingFace's ``save_pretrained`` does (config and safetensors files, an index when
        there are several), gathered from this mesh a tensor at a time: the unmodified ``from_pretrained`` loads it.
        A collective: every rank calls it; rank 0 writes."""
        from autoshard.runtime import pretrained

        with self._collective("save_pretrained()"):
            pretrained.save_pretrained(self, directory, max_shard_size)

    def load_pretrained(self, directory: str) -> int:
        """Fill this rank's parameters from HuggingFace's format in ``directory`` (``save_pretrained``'s, or
        ``transformers``'), reading only this rank's part of each tensor; returns the bytes read. After
        ``materialize()``, a model built on ``meta`` starts from a checkpoint no rank holds whole."""
        from autoshard.runtime import pretrained

        with self._collective("load_pretrained()"):
            return pretrained.load_pretrained(self, directory)

    def save_checkpoint(self, path: str, *, optimizer=None, extra: dict | None = None, asynchronous: bool = False,
                        keep: int | None = None):
        """Each rank writes its shards of the parameters and, with ``optimizer``, of its state; ``extra`` (the
        user's step, an LR scheduler's ``state_dict()``: plain data) and the random streams alongside. Loads under
        any mesh. Written aside and renamed into place when complete, so a killed save loses nothing; ``keep=N``
        makes ``path`` a root of the newest N checkpoints. With ``asynchronous`` the write runs in the background:
        returns a future (``.result()`` waits)."""
        from autoshard.runtime import checkpoint

        with self._collective("save_checkpoint()"):
            return checkpoint.save_checkpoint(self, path, optimizer, extra, asynchronous, keep)

    def resume(self, path: str, *, optimizer=None) -> dict | None:
        """Resume from the newest complete checkpoint at ``path`` (a root saved with ``keep=``, or one checkpoint)
        and return its ``extra``; None when there is none yet (a fresh start). What a run restarted by
        ``torchrun --max-restarts`` calls before its loop: it then goes on where its last complete save left it."""
        from autoshard.runtime import committed

        if not committed.exists(path):
            return None
        return self.load_checkpoint(path, optimizer=optimizer)

    def load_checkpoint(self, path: str, *, optimizer=None) -> dict:
        """Read a checkpoint saved under any mesh into this rank's shards (and ``optimizer``'s state); returns the
        ``extra`` it was saved with. ``path`` is a checkpoint, or a root saved with ``keep=`` (its newest complete
        one); one that is not complete is refused, naming what is missing."""
        from autoshard.runtime import checkpoint

        with self._collective("load_checkpoint()"):
            return checkpoint.load_checkpoint(self, path, optimizer)

    def optimizer_state_dict(self, optimizer) -> dict:
        """The whole optimizer's state at full shapes, keyed by the model's parameter names (a collective): what
        ``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict`` loads into an unsharded optimizer."""
        from autoshard.runtime import optimizer_state

        with self._collective("optimizer_state_dict()"):
            return optimizer_state.full_state_dict(self, optimizer)

    def load_optimizer_state_dict(self, optimizer, state_dict: dict) -> None:
        """Give ``optimizer`` this rank's part of a full optimizer state keyed by parameter names (what
        ``get_optimizer_state_dict(model, optimizer)`` gives for an unsharded model, or ``optimizer_state_dict``)."""
        from autoshard.runtime import optimizer_state

        with self._collective("load_optimizer_state_dict()"):
            optimizer_state.load_full_state_dict(self, optimizer, state_dict)

    def materialize(self, device=None, *, buffers=None, init=None) -> int:
        """For a model built on ``meta``: allocate only this rank's shards on ``device``, then fill them from a
        checkpoint (``load_checkpoint``) or, with ``init``, by the model's own initialisers (see ``state.materialize``).
        """
        from autoshard.runtime import state

        return state.materialize(self, device, buffers=buffers, init=init)
