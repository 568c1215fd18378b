"""Pipeline parallelism at run time: the schedule, the executor and tied-weight gradients.

The stages come compiled in a ``RankBuild`` (``autoshard.compile``): every capture is cut after the same
nodes, so every capture places every parameter on the same rank; stage s runs on pp rank ``s % p``, or in a V
for the V schedules (``schedules.stage_rank``).
A parameter read by stages on two ranks (a tied embedding and LM head) is spread over the pp ranks
(``runtime.spread``): each stores its rows, all gather it for the step and its gradient is reduce-scattered
after. One that is not (under FSDP2) has one copy per rank; their gradients are summed over a process
group of exactly those ranks before the step returns, so the copies stay identical.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import fx
from torch.utils import _pytree as pytree

from autoshard import codegen, meta, peers, schedules
from autoshard.compile import RankBuild
from autoshard.mesh import Mesh, MeshGroups
from autoshard.options import CompileOptions
from autoshard.passes.pipeline_split import Stage
from autoshard.runtime import spread
from autoshard.runtime.executor import PipelineExecutor, StageRunner
from autoshard.runtime.reducer import GradientReducer


class Pipeline:
    """This rank's part of the pipeline: the schedule, the executor and the sums of tied gradients."""

    def __init__(self, mesh: Mesh, groups: MeshGroups, options: CompileOptions) -> None:
        self.mesh = mesh
        self.groups = groups
        self.p = mesh.pp
        self.v = options.chunks
        self.num_stages = self.p * self.v
        self.timeout = options.timeout
        self.pp_index = groups.coords["pp"]
        self.placement = schedules.placement_of(options.schedule)
        self.actions: schedules.Schedule = {}  # the schedule its builds were compiled with (the same for each)
        self.tied: dict[str, frozenset[int]] = {}
        self.spread = spread.NONE
        self.executor: PipelineExecutor | None = None

    def prepare(self, build: RankBuild, store: codegen.ParamStore, programs: list, device: torch.device) -> None:
        """A build was compiled: create the groups of its tied parameters and, at the first build, give this rank
        its rows of the spread weights (collective, on every rank). ``programs``: every program of this rank."""
        self.actions = build.actions
        if not self.spread and build.spread:
            self.spread = spread.Spread(build.spread, self.groups.group("pp"), self.p, self.pp_index,
                                        self.groups.ranks("pp"))
            self.spread.setup(store, programs, device)
        for name, ranks in build.tied.items():
            self.groups.across_pp(ranks)
            self.tied.setdefault(name, ranks)
        self.check_handoffs(build)

    def check_handoffs(self, build: RankBuild) -> None:
        """Compare what each stage sends with what the next stage, on another pp rank, allocates to receive: the
        same shapes, dtypes and layouts, in the same order (collective over the pp group). Every rank compiles its
        stages from its own capture; ranks whose captures or plans differ (another library version on one of
        them, a capture that depends on the process) are refused here, before a step, on every rank alike, where
        they would fail inside a stage while the others wait out a receive's timeout, or, where the shapes happen
        to agree, compute on values laid out otherwise."""
        mine = {s: (list(received), list(sent)) for s, (received, sent) in build.local_specs.items()}
        everyone: list = [None] * self.p
        dist.all_gather_object(everyone, mine, group=self.groups.group("pp"))
        specs = {s: pair for found in everyone for s, pair in found.items()}
        rank = [schedules.stage_rank(s, self.p, self.placement) for s in range(self.num_stages)]
        for s in range(self.num_stages - 1):
            sent, received = specs[s][1], specs[s + 1][0]
            if rank[s] != rank[s + 1] and sent != received:  # within one rank nothing is allocated for it
                raise RuntimeError(
                    f"pipeline stage {s} (pp rank {rank[s]}) sends {[(tuple(x.shape), str(x.dtype)) for x in sent]}, "
                    f"but stage {s + 1} (pp rank {rank[s + 1]}) receives "
                    f"{[(tuple(x.shape), str(x.dtype)) for x in received]}: the ranks compiled different programs "
                    "of the model. Run every rank on the same versions of torch, transformers and autoshard, with "
                    "the same model code and inputs; if they are, this is a bug in autoshard's pipeline cut")

    def reducer(self, programs: dict[int, codegen.RankProgram], store: codegen.ParamStore, group,
                experts: tuple[str, ...] = ()) -> GradientReducer:
        """Sums over ``group`` (dp x cp) of this rank's gradients, launched during each stage's last backward;
        the ``experts`` split over ep are not replicas over dp x cp (``GradientSync.sum_experts`` sums them)."""
        stage_params = {
            s: [store.get_parameter(n.target) for n in program.gm.graph.nodes
                if n.op == "get_attr" and store.find(n.target) is not None and n.target not in experts
                and store.get_parameter(n.target).requires_grad]  # a frozen weight has no gradient to sum
            for s, program in programs.items()
        }
        return GradientReducer(stage_params, self.actions[self.pp_index], group)

    def runners(self, build: RankBuild) -> dict[int, StageRunner]:
        return {s: StageRunner(s, program, *build.local_specs[s]) for s, program in build.programs.items()}

    def run_step(self, runners, microbatches, divisor, step: int, call=None, reducer=None,
                 device: torch.device | None = None, whole_backward: bool = False) -> torch.Tensor:
        """One training step's actions on this rank; returns the global loss (on every pp rank).
        ``whole_backward``: a split schedule's ``I`` runs the whole backward, and ``W`` nothing (compiled
        programs, whose backward is one node that computes every gradient at once)."""
        self.executor = PipelineExecutor(
            runners, num_stages=self.num_stages, p=self.p, pp_ranks=self.groups.ranks("pp"),
            group=self.groups.group("pp"), back_group=self.groups.group("pp_back"), rank=self.pp_index,
            timeout=self.timeout, device=device, placement=self.placement, whole_backward=whole_backward,
        )
        total = self.executor.run(self.actions[self.pp_index], microbatches, divisor, step, call=call,
                                  reducer=reducer)
        with peers.phase("loss"):  # only the last stage's rank holds the loss
            peers.run(dist.all_reduce, total, group=self.groups.group("pp"))
        return total

    def forward_only(self, build: RankBuild, inputs: tuple, device: torch.device | None = None) -> list[torch.Tensor]:
        """Inference through the stages in order; the last stage's outputs are broadcast to every pp rank."""
        stages, programs = build.stages, build.programs
        group, ranks = self.groups.group("pp"), self.groups.ranks("pp")
        received: list[torch.Tensor] = []
        flat_out: list[torch.Tensor] = []
        def rank(stage: int) -> int:
            return schedules.stage_rank(stage, self.p, self.placement)

        for s in range(self.num_stages):
            owner = ranks[rank(s)]
            if s in programs:
                if s > 0 and rank(s - 1) != self.pp_index:
                    pairs = [spec.allocate(device) for spec in build.local_specs[s][0]]
                    for buffer, _ in pairs:
                        dist.recv(buffer, src=ranks[rank(s - 1)], group=group)
                    received = [value for _, value in pairs]
                out = programs[s].gm(*inputs, *received)
                if s < self.num_stages - 1:
                    received = [t.detach() for t in out]  # kept for the next stage when it runs here too
                    if rank(s + 1) != self.pp_index:
                        for spec, tensor in zip(build.local_specs[s][1], out, strict=True):
                            dist.send(spec.pack(tensor.detach()), dst=ranks[rank(s + 1)], group=group)
                else:
                    flat_out = [t.detach().contiguous() for t in out]
            if s == self.num_stages - 1:
                flat_out = self._broadcast_outputs(stages[s], flat_out, owner, device)
        return flat_out

    def _broadcast_outputs(self, last: Stage, flat_out: list[torch.Tensor], owner: int,
                           device: torch.device | None) -> list[torch.Tensor]:
        output = next(n for n in last.gm.graph.nodes if n.op == "output")
        specs = [meta.val(n) for n in pytree.tree_leaves(output.args[0]) if isinstance(n, fx.Node)]
        if not flat_out:
            flat_out = [torch.empty(v.shape, dtype=v.dtype, device=device) for v in specs]
        else:  # in the capture's dtypes, as every other rank receives them (under autocast, bf16 becomes float32)
            flat_out = [t.to(v.dtype) for t, v in zip(flat_out, specs, strict=True)]
        for tensor in flat_out:
            dist.broadcast(tensor, src=owner, group=self.groups.group("pp"))
        return flat_out

    def idle_share(self) -> float | None:
        """The share of the last step this rank spent not computing, or None before a step."""
        if self.executor is None or not self.executor.records:
            return None
        records = self.executor.records
        span = records[-1].end - records[0].start
        busy = sum(r.end - r.start for r in records if r.action.is_compute)
        return 1 - busy / span if span > 0 else 0.0

    def write_trace(self, path: str, rank: int) -> None:
        """The last step's actions of every rank as one Chrome trace, which rank 0 writes: a process per rank (its
        coordinates in its name), compute on one row and messages on another, a slice per action, on one clock (each
        rank's monotonic times moved to the wall clock). A collective over every rank."""
        import json
        import time

        records = self.executor.records if self.executor is not None else []
        to_wall = time.time() - time.perf_counter()
        mine = {"rank": rank, "coords": dict(self.groups.coords),
                "actions": [(str(r.action), r.action.is_compute, r.action.stage, r.action.microbatch,
                             r.start + to_wall, r.end - r.start) for r in records]}
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        if rank != 0:
            return
        start = min((a[4] for found in everyone for a in found["actions"]), default=0.0)
        events = []
        for found in everyone:
            pid = found["rank"]
            events.append({"name": "process_name", "ph": "M", "pid": pid,
                           "args": {"name": f"rank {pid} {found['coords']}"}})
            events += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
                       for tid, name in ((0, "compute"), (1, "messages"))]
            events += [{"name": name, "ph": "X", "pid": pid, "tid": 0 if compute else 1, "ts": (at - start) * 1e6,
                        "dur": seconds * 1e6, "args": {"stage": stage, "microbatch": microbatch}}
                       for name, compute, stage, microbatch, at, seconds in found["actions"]]
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)

    def timeline(self) -> str:
        """This rank's last step as it ran: compute actions with their times, and the measured idle share."""
        if self.executor is None or not self.executor.records:
            return "no pipeline step has run yet"
        records = self.executor.records
        start = records[0].start
        span = records[-1].end - start
        busy = sum(r.end - r.start for r in records if r.action.is_compute)
        sim = schedules.simulate(self.actions, self.p, self.v, placement=self.placement)
        head = (f"pp rank {self.pp_index}: {len(records)} actions in {span * 1e3:.1f} ms, computing "
                f"{busy / span:.0%} of it; idle {1 - busy / span:.0%} (the schedule alone: {sim.bubble:.0%})")
        cells = [f"{r.action}@{(r.start - start) * 1e3:.1f}-{(r.end - start) * 1e3:.1f}ms"
                 for r in records if r.action.is_compute]
        return head + "\n  " + " ".join(cells)

    def tied_certified(self, store: codegen.ParamStore) -> list[tuple[list[int], torch.dtype, int, int | None]]:
        """The all-reduces ``sum_tied_gradients`` issues, for ``runtime.communication``: (the global ranks, dtype,
        elements, calls or None where the gradients found decide)."""
        found = []
        for ranks, params in self._tied_by_ranks(store).items():
            members = [self.groups.ranks("pp")[i] for i in sorted(ranks)]
            found.append((members, torch.float32, len(params), 1))
            found += [(members, p.dtype, p.numel(), None) for p in params]
        return found

    def _tied_by_ranks(self, store: codegen.ParamStore) -> dict[frozenset[int], list]:
        by_ranks: dict[frozenset[int], list] = {}
        for name, ranks in self.tied.items():
            param = store.get_parameter(name) if self.pp_index in ranks else None
            if param is not None and param.requires_grad:
                by_ranks.setdefault(ranks, []).append(param)
        return by_ranks

    def sum_tied_gradients(self, store: codegen.ParamStore) -> None:
        """Sum the gradients of the weights held on several pp ranks over those ranks. A weight no holder got a
        gradient for this step (read only without gradients, as a top-k indexer's is to pick positions; an expert
        no token reached) keeps none, as in the model run whole; first one flag per weight says which had any."""
        for ranks, params in self._tied_by_ranks(store).items():
            group = self.groups.across_pp(ranks)
            some = torch.tensor([float(p.grad is not None) for p in params], device=params[0].device)
            with peers.phase("gradient sync"):
                peers.run(dist.all_reduce, some, group=group)
            for param, found in zip(params, some.tolist(), strict=True):
                if not found:
                    continue
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad  # an FSDP2 shard:
                with peers.phase("gradient sync"):  # the same part of the weight on every rank
                    peers.run(dist.all_reduce, grad, group=group)
