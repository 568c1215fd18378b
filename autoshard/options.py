"""``CompileOptions``: every option of ``parallelize``, in one frozen dataclass checked once.

``parallelize``, ``verify`` and ``autoshard inspect`` all build one (their keyword arguments and flags are
its public face), and every later layer reads it instead of taking the options one by one. A value that
is not valid is refused here with the valid ones named, so a misspelt choice never silently means the
other one. Checks that need the mesh (a tp plan made for another degree) are in :meth:`check_mesh`.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
from dataclasses import dataclass

from autoshard import schedules
from autoshard.kinds import Attention, DataParallel, ScheduleName
from autoshard.mesh import Mesh

DEFAULT_TIMEOUT = datetime.timedelta(seconds=120)

KINDS = {"schedule": ScheduleName, "cp_attention": Attention, "data_parallel": DataParallel}  # made kinds once checked
CHOICES = {
    "schedule": ScheduleName.names(),
    "tp_indivisible": ("error", "replicate"),
    "cp_attention": Attention.names(),
    "mixed_precision": (None, "bf16"),
    "data_parallel": DataParallel.names(),
    "pipeline_balance": ("both", "time", "memory"),
    "batch_norm": ("unsharded", "local"),
    "batch_statistics": ("unsharded", "local"),
    "verify_communication": ("first", "every", "never"),
}
_MEANINGS = {
    "tp_indivisible": "'error' (name the layer and the degrees that work) or 'replicate' (keep such blocks whole)",
    "cp_attention": "'gather' (all-gather keys and values), 'ring' (pass key/value blocks around the cp ranks) or "
                    "'alltoall' (all-to-all the sequence split into a head split for attention)",
    "mixed_precision": "None (fp32) or 'bf16' (bfloat16 autocast)",
    "data_parallel": "'ddp' (replicas) or 'fsdp' (FSDP2 fully_shard over dp x cp)",
    "batch_norm": "'unsharded' (the statistics of the whole batch, as the model run whole: summed over the dp "
                  "ranks as SyncBatchNorm does, refused where a microbatch or a cp or sp rank sees part of it) or "
                  "'local' (each rank's and each microbatch's own statistics, as DDP keeps them)",
    "batch_statistics": "'unsharded' (a loss term computed from the whole batch at once, such as a router's "
                        "load-balancing loss: summed over the dp ranks, refused where microbatches split the batch) "
                        "or 'local' (each rank's and each microbatch's part computes it from its own samples, as DDP "
                        "and gradient accumulation do)",
    "verify_communication": "'first' (the first training step's collectives checked against the certificate), "
                            "'every' (every step's) or 'never'",
    "pipeline_balance": "'both' (each stage's larger share of time or of parameter memory), 'time' or 'memory'",
    "schedule": "'gpipe', '1f1b', 'interleaved' (with chunks > 1), 'zb-h1' (1F1B with each backward split into "
                "input and weight gradients, the weight part deferred into the bubble), 'zbv' (two chunks per rank "
                "in a V, backward split likewise) or 'dualpipev' (the V with forwards and backwards paired)",
}


@dataclass(frozen=True, kw_only=True)
class CompileOptions:
    """How ``parallelize`` compiles and runs a model.

    Fields:
    microbatches: how many microbatches each rank's local batch is cut into.
    local_batch: ``step()`` gets each rank's own slice of the batch (a data loader that shards by
        rank) instead of the global batch.
    timeout: how long any collective may wait before the step fails, naming the rank and step.
    tp_indivisible: what to do with a block whose heads or width the tp degree does not divide:
        ``"error"`` (the default: an error naming the layer and the degrees that work) or
        ``"replicate"`` (keep that block replicated, with a warning).
    schedule: the pipeline schedule, ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` (with ``chunks`` > 1), or a
        zero-bubble one, whose backward is split into input and weight gradients with the weight part deferred
        into the bubble: ``"zb-h1"`` (1F1B's order and memory), ``"zbv"`` (two chunks per rank in a V; sets
        ``chunks`` to 2) or ``"dualpipev"`` (the V, a forward of one chunk paired with a backward of the other;
        at least 2 * pp microbatches).
    chunks: virtual stages per pipeline rank (interleaving); the model is cut into ``pp * chunks`` stages.
    pipeline_starts: instead of the balanced partition, the modules (by qualified name) at which each
        stage after the first begins.
    pipeline_balance: what the partition balances: ``"both"`` (the default: the largest of each stage's
        share of the training time and its share of the parameters, whose gradients and optimizer state
        scale with them), ``"time"`` or ``"memory"``.
    cp_attention: how attention sees the keys of a split sequence: ``"gather"`` (all-gather keys and
        values), ``"ring"`` (pass key/value blocks around the cp ranks; no rank holds all of them) or
        ``"alltoall"`` (Ulysses: an all-to-all turns the sequence split into a split of the heads for
        attention, and back; the heads each rank holds must divide by cp).
    cp_load_balance: give cp rank r sequence chunks r and 2c-1-r of 2c, so causal attention work is even.
    mixed_precision: ``"bf16"`` runs forward and backward under bfloat16 autocast (parameters stay fp32).
    activation_checkpointing: recompute each stage's activations in backward instead of keeping them, segment by
        segment (the program cut where the fewest bytes cross: between a stack's blocks).
    sequence_parallel: between the tensor-parallel regions, split the sequence over the tp ranks (Megatron's
        sequence parallelism): norms, residual adds and dropout run on 1/tp of the tokens, whose activations each
        rank then stores; the regions' all-reduces become a reduce-scatter and an all-gather (the same bytes).
        ``"auto"``: on wherever tp > 1 and the model's sequence is found (it moves the same bytes and stores less),
        else off with a note saying why.
    tp_plan: a ``TensorParallelPlan`` to apply instead of the one the compiler finds (for example one
        printed by ``pm.plan``, edited, and read back with ``TensorParallelPlan.from_json``).
    data_parallel: ``"ddp"`` (replicas, DistributedDataParallel) or ``"fsdp"`` (PyTorch's FSDP2
        ``fully_shard`` over dp x cp: parameters, gradients and optimizer state sharded). Under pipeline
        parallelism a rank's parameters stay gathered for the step (one all-gather per step, not per
        microbatch) and gradients are reduce-scattered after its last backward.
    batch_norm: what a BatchNorm in training mode normalises with where a rank or a microbatch sees only part of
        the batch (dp, cp, microbatches, sequence parallelism): ``"unsharded"`` (the default) computes the whole
        batch's statistics, as the model run whole does: under dp each rank's statistics are gathered over the dp
        group and combined (SyncBatchNorm's semantics, running statistics included); a mesh where a microbatch or
        a cp or sp rank sees part of the batch is refused naming the layers (a microbatch cannot pass the layer
        before every microbatch of the step has reached it); ``"local"`` keeps each rank's and each microbatch's
        own statistics (DDP's behaviour), said once.
    batch_statistics: what a loss term computed from the whole batch at once sees (a router's load-balancing loss:
        the fraction of tokens each expert got times its mean probability; a cross-entropy's mean inside a larger
        loss) where dp or microbatches split the batch: ``"unsharded"`` (the default) takes the whole batch's under
        dp (each statistic summed over the dp ranks, ``passes.batch_statistics``) and refuses such a loss where
        microbatches, pp or cp split the batch, naming the model's line; ``"local"`` lets each rank's and each
        microbatch's part compute it from its own samples and averages the parts' losses (what DDP and gradient
        accumulation compute, and Megatron's default for the load-balancing loss), said once.
    expert_capacity: under ep, each rank sends each expert at most ``ceil(expert_capacity x rows / experts)`` of its
        rows (rows: its tokens x top-k), the first ones in the routed order, as Megatron's capacity factor with its
        position policy; a row beyond it is dropped (the experts add nothing to its token, whose residual passes
        it on), and ``explain()`` counts the rows dropped at the last step. ``None`` (the default): dropless.
    planner_profile: the JSON profile ``autoshard calibrate`` wrote on this machine: ``mesh="auto"`` then compiles
        the model for every mesh of the world size (in this process, without process groups) and takes the one
        whose step, predicted node by node from the profile, is fastest (``autoshard.planner.predict``). Without
        it, ``mesh="auto"`` reads the model as a transformer and plans it on the default GPU's formulas.
    calibrate: with ``mesh="auto"``, measure the job's own ranks first (``autoshard.planner.profile.calibrate``,
        about 8 s on 2 CPU ranks: every rank at once, rank 0's numbers broadcast) and choose from that profile as
        from ``planner_profile``.
    autotune: with ``mesh="auto"`` and a profile (``planner_profile`` or ``calibrate``), the predicted fastest
        ``autotune`` candidates are then each compiled and trained for a few steps on this job's ranks (on a copy of
        the model, its gradients dropped, no optimizer step), and the fastest measured is taken (the slowest rank's
        median step, so every rank agrees). The prediction ranks every candidate; the measurement decides between the
        closest. ``0`` (the default): the prediction alone.
    memory_limit: with ``mesh="auto"`` and a profile, the bytes each rank may hold (``"20GiB"`` or a number):
        candidates predicted to hold more (weights, gradients, AdamW's state and the activations at the step's peak,
        ``autoshard.planner.memory``) try activation checkpointing, FSDP2 and sequence parallelism in turn, and are
        refused where none of them fits. ``None`` (the default): the profile's (the machine's memory over its ranks,
        a GPU's own), no limit where the profile has none.
    detect_anomaly: look at every value each program computes, and at the gradients after the backward: the first
        NaN or infinity is named (rank, step, node, the model's source line) and every rank raises
        ``NonFiniteError`` from ``step()``, before the optimizer applies it. Slow (op by op): for finding where a
        loss turned NaN.
    compile: run each rank's program (each pipeline stage's) through ``torch.compile`` (inductor), forward and
        backward. autoshard's collectives are traced into the compiled graph (as functional collectives), so the
        compiler sees the whole step; a new shape compiles again, and ``explain()`` counts the graphs compiled.
    peak_tflops: the device's peak TFLOP/s that ``pm.metrics()`` and the step's log line take MFU against: a number,
        ``"measure"`` (a matmul timed on the device once), or ``None`` (the default): a known GPU's dense bf16 peak,
        no MFU on a CPU.
    tensorboard: a log directory: rank 0 writes each step's metrics there (``torch.utils.tensorboard``; needs the
        ``tensorboard`` package). ``None`` (the default): none written.
    verify_communication: when a training step records what each collective autoshard issues is handed and
        compares it with the build's communication certificate (``autoshard.certificate``: kind, group, dtype and
        elements of each, per step), raising ``CommunicationDiffers`` on a difference: ``"first"`` (the default: the
        first step, and the first after a new capture), ``"every"`` or ``"never"``.
    progress: say (rank 0) how long the capture, the compile, ``calibrate`` and each ``autotune`` trial took, on the
        ``autoshard`` logger where it speaks at INFO, else on stderr: ``None`` (the default) where stderr is a
        terminal, ``True`` always, ``False`` never.
    """

    microbatches: int = 1
    local_batch: bool = False
    schedule: str = "1f1b"
    chunks: int = 1
    pipeline_starts: tuple[str, ...] | None = None
    pipeline_balance: str = "both"
    tp_indivisible: str = "error"
    cp_attention: str = "gather"
    cp_load_balance: bool = False
    mixed_precision: str | None = None
    activation_checkpointing: bool = False
    sequence_parallel: bool | str = False  # or "auto"
    tp_plan: object = None  # a TensorParallelPlan to apply instead of the one the compiler finds
    data_parallel: str = "ddp"
    timeout: datetime.timedelta = DEFAULT_TIMEOUT
    batch_norm: str = "unsharded"
    batch_statistics: str = "unsharded"
    expert_capacity: float | None = None  # ep: rows each rank sends each expert, as a factor of an even share
    planner_profile: str | None = None  # a profile ``autoshard calibrate`` wrote: mesh="auto" predicts from it
    calibrate: bool = False  # mesh="auto" measures this job's ranks first and predicts from that
    autotune: int = 0  # mesh="auto" with a profile: train the predicted fastest N candidates, take the fastest measured
    memory_limit: str | float | None = None  # mesh="auto" with a profile: bytes per rank ("20GiB"); None: the profile's
    compile: bool = False
    detect_anomaly: bool = False
    peak_tflops: float | str | None = None  # the device's peak for MFU: a number, "measure", or None (a known GPU's)
    tensorboard: str | None = None  # a log directory: each step's metrics written there by rank 0
    progress: bool | None = None  # say what took how long before training: None, on a terminal; True; False
    verify_communication: str = "first"  # a step's collectives checked against its certificate: first, every, never

    def __post_init__(self) -> None:
        for name, valid in CHOICES.items():
            value = getattr(self, name)
            if value not in valid:
                meaning = _MEANINGS.get(name) or " or ".join(map(repr, valid))
                raise ValueError(f"{name}={value!r} is not an option: use {meaning}")
        for name, kind in KINDS.items():
            object.__setattr__(self, name, kind(getattr(self, name)))
        for name in ("microbatches", "chunks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} is not valid: it must be an integer >= 1")
        runs = schedules.spec(self.schedule)
        if runs.placement == "v":
            if self.chunks not in (1, runs.chunks):
                raise ValueError(f"schedule={self.schedule!r} runs {runs.chunks} chunks per pipeline rank "
                                 f"in a V, got chunks={self.chunks}: leave chunks unset or use another schedule")
            object.__setattr__(self, "chunks", runs.chunks)
        if self.progress is not None and not isinstance(self.progress, bool):
            raise ValueError(f"progress={self.progress!r} is not valid: pass True, False, or None (on a terminal)")
        for name in ("local_batch", "cp_load_balance", "activation_checkpointing", "sequence_parallel", "compile",
                     "detect_anomaly", "calibrate"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (name == "sequence_parallel" and value == "auto"):
                raise ValueError(f"{name}={value!r} is not valid: pass True or False"
                                 + (' (or "auto")' if name == "sequence_parallel" else ""))
        if self.pipeline_starts is not None:
            starts = self.pipeline_starts
            if isinstance(starts, str) or not all(isinstance(s, str) for s in starts):
                raise ValueError(f"pipeline_starts={starts!r}: pass a list of module names, e.g. ['layers.4']")
            object.__setattr__(self, "pipeline_starts", tuple(starts))
        if isinstance(self.timeout, (int, float)) and not isinstance(self.timeout, bool):
            object.__setattr__(self, "timeout", datetime.timedelta(seconds=self.timeout))
        if not isinstance(self.timeout, datetime.timedelta) or self.timeout.total_seconds() <= 0:
            raise ValueError(f"timeout={self.timeout!r}: pass a positive datetime.timedelta (or seconds)")
        if self.compile and self.detect_anomaly:
            raise ValueError("detect_anomaly=True looks at every value a program computes, op by op, which it cannot "
                             "do inside a compiled graph: pass compile=False while looking for a NaN")
        if not isinstance(self.autotune, int) or isinstance(self.autotune, bool) or self.autotune < 0:
            raise ValueError(f"autotune={self.autotune!r} is not valid: pass how many of the predicted fastest meshes "
                             "to measure (an integer >= 0; 3 is usual), with mesh='auto' and a profile")
        limit = self.memory_limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (str, int, float))
                                  or (not isinstance(limit, str) and not limit > 0)):
            raise ValueError(f"memory_limit={limit!r} is not valid: pass the bytes each rank may hold, like '20GiB' "
                             "or 20e9, or None for the profile's")
        capacity = self.expert_capacity
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, (int, float))
                                     or not capacity > 0):
            raise ValueError(f"expert_capacity={capacity!r} is not valid: pass a factor > 0 of an even share of the "
                             "rows per expert (1.0 to 2.0 is usual), or None for dropless experts")
        if self.tp_plan is not None and not hasattr(self.tp_plan, "params"):
            raise ValueError(f"tp_plan is a {type(self.tp_plan).__name__}: pass a TensorParallelPlan (pm.plan, or "
                             "TensorParallelPlan.from_json(...))")
        peak = self.peak_tflops
        if peak is not None and peak != "measure" and (isinstance(peak, bool) or not isinstance(peak, (int, float))
                                                        or not peak > 0):
            raise ValueError(f"peak_tflops={peak!r} is not valid: pass the device's peak TFLOP/s (989 for an H100's "
                             "dense bf16), 'measure', or None for a known GPU's")
        if self.tensorboard is not None:
            try:
                import torch.utils.tensorboard  # noqa: F401 - needs the tensorboard package
            except ImportError as e:
                raise ValueError(f"tensorboard={self.tensorboard!r} writes with torch.utils.tensorboard, which needs "
                                 f"the tensorboard package ({e}): pip install tensorboard, or leave tensorboard=None "
                                 "and read pm.metrics()") from None

    def check_mesh(self, mesh: Mesh) -> None:
        """Refuse the options that do not fit ``mesh``."""
        if self.expert_capacity is not None and mesh.ep == 1:
            raise ValueError(f"expert_capacity={self.expert_capacity} drops the rows beyond each expert's capacity "
                             f"where they are sent to the experts' ranks, and {mesh} splits no experts over ep: use a "
                             "mesh with ep > 1, or leave expert_capacity=None")
        if self.tp_plan is not None and self.tp_plan.size != mesh.tp:
            raise ValueError(f"the tp plan was made for tp={self.tp_plan.size}, the mesh has tp={mesh.tp}: make "
                             f"the plan at tp={mesh.tp} or use a mesh of tp={self.tp_plan.size}")

    def replace(self, **changes) -> CompileOptions:
        return dataclasses.replace(self, **changes)

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def of(cls, given: dict, *, where: str = "parallelize") -> CompileOptions:
        """The options ``given`` by name (the keyword arguments of ``where``); a name that is no option is refused
        with the nearest ones and every option named."""
        unknown = sorted(set(given) - set(cls.fields()))
        if unknown:
            near = [m for name in unknown for m in difflib.get_close_matches(name, cls.fields(), n=1)]
            hint = f" (did you mean {', '.join(near)}?)" if near else ""
            raise TypeError(f"{where}() got {', '.join(map(repr, unknown))}, which is not an option{hint}: the "
                            f"options are {', '.join(cls.fields())}")
        return cls(**given)
