"""Per-rank worker of ``bench/pp.py``: autoshard's pipeline next to ``torch.distributed.pipelining``.

    GLOO_SOCKET_IFNAME=lo torchrun --standalone --nproc-per-node 2 bench/pp_worker.py \\
        --schedules gpipe,1f1b,interleaved --microbatches 8 --out result.json

The zoo GPT (``tests/harness/models.py``) trains on one global batch, for each schedule twice, taking turns step by
step:

- ``autoshard``: ``parallelize(model, Mesh(pp=p), microbatches=m, schedule=..., chunks=v)``, the model unmodified
  and cut by autoshard's own partitioner into ``p * v`` stages;
- ``torch``: ``torch.distributed.pipelining`` with one ``PipelineStage`` per stage and ``ScheduleGPipe``,
  ``Schedule1F1B`` or ``ScheduleInterleaved1F1B``, the stages written by hand (``GPTStage``) on the *same
  layers* as autoshard's stages (autoshard's cuts mapped to layers; equal layers per stage for both when a cut
  falls inside a block). The tied embedding / LM-head weight lives on the first and last stage's ranks; its
  gradient is summed between them after each step, as autoshard does (torch's manual stages leave that to the
  user).

Per runner: the median step time (``zero_grad``, ``step``, AdamW, between barriers, on rank 0). For autoshard,
the executor's records of every timed step (what ran, when) from every rank give the measured bubble. One
further, untimed step per runner runs under ``torch.autograd.graph.saved_tensors_hooks`` that track the live
bytes of tensors saved for backward (distinct storages, parameters excluded): the peak per rank, and the bytes
saved per microbatch, whose ratio is the number of microbatches whose activations were in flight at the peak.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from common import summarize, wait_until_quiet
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

import autoshard
from autoshard import meta, schedules

from harness.models import build_gpt_model, token_data, token_loss

LR = 1e-3
CHUNKS = {"gpipe": 1, "1f1b": 1, "interleaved": 2}
TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


def build_case(layers: int, batch: int, vocab: int, seed: int = 0):
    """The benchmark GPT (hidden 128, 4 heads, sequence 64) and one global batch: (model, tokens, target)."""
    torch.manual_seed(seed)
    model = build_gpt_model(n_layer=layers, n_embd=128, n_head=4, vocab=vocab, seq=64)
    tokens, target = token_data(torch.Generator().manual_seed(seed + 1), batch=batch, seq=64, vocab=vocab)
    return model, tokens, target


# --------------------------------------------------------------------------------------------------------------------
# Splits: autoshard's partition mapped to the model's layers
# --------------------------------------------------------------------------------------------------------------------

_LAYER = re.compile(r"(?:^|\.)transformer\.h\.(\d+)(?:\.|$)")


def layer_split(gm, stage_of: dict[str, int], layers: int, stages: int) -> list[range] | None:
    """The layers of each stage when every layer lies in one stage (and stages hold consecutive layers), else None."""
    owner: dict[int, set[int]] = {}
    for node in gm.graph.nodes:
        found = _LAYER.search(meta.module_path(node))
        if found and node.name in stage_of:
            owner.setdefault(int(found.group(1)), set()).add(stage_of[node.name])
    if sorted(owner) != list(range(layers)) or any(len(s) != 1 for s in owner.values()):
        return None
    stage = [next(iter(owner[i])) for i in range(layers)]
    if stage != sorted(stage) or set(stage) != set(range(stages)):
        return None
    return [range(stage.index(s), len(stage) - stage[::-1].index(s)) for s in range(stages)]


def equal_split(layers: int, stages: int) -> list[range]:
    if layers % stages:
        raise ValueError(f"{layers} layers do not split equally into {stages} stages")
    per = layers // stages
    return [range(s * per, (s + 1) * per) for s in range(stages)]


def describe(split: list[range]) -> str:
    return "; ".join(f"h.{r.start}-{r.stop - 1}" if len(r) > 1 else f"h.{r.start}" for r in split)


# --------------------------------------------------------------------------------------------------------------------
# Runners
# --------------------------------------------------------------------------------------------------------------------


class Runner:
    """One way of training: its parameters, and ``forward_backward()`` (which may return the step's trace)."""

    def __init__(self, params: list, forward_backward: Callable[[], list | None], **info) -> None:
        self.params = params
        self.optimizer = torch.optim.AdamW(params, lr=LR)
        self.forward_backward = forward_backward
        self.info = info

    def step(self) -> list | None:
        self.optimizer.zero_grad()
        trace = self.forward_backward()
        self.optimizer.step()
        return trace


def autoshard_runner(model, tokens, target, m: int, schedule: str, starts: list[str] | None = None) -> Runner:
    p = dist.get_world_size()
    pm = autoshard.parallelize(model, autoshard.Mesh(pp=p), example_inputs=(tokens,), loss_fn=token_loss,
                               target=target, microbatches=m, schedule=schedule, chunks=CHUNKS[schedule],
                               pipeline_starts=starts)

    def forward_backward() -> list:
        pm.step(tokens, target=target)
        records = pm.pipeline.executor.records
        return [(r.action.kind, r.action.microbatch, r.action.stage, r.start, r.end) for r in records]

    return Runner(list(pm.parameters()), forward_backward, pm=pm)


class GPTStage(nn.Module):
    """A hand-written pipeline stage of the zoo GPT: the embeddings on the first, norm and LM head on the last."""

    def __init__(self, model: nn.Module, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        t = model.transformer
        self.wte, self.wpe = (t.wte, t.wpe) if first else (None, None)
        self.h = nn.ModuleList(t.h[i] for i in layers)
        self.ln_f, self.lm_head = (t.ln_f, model.lm_head) if last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wte is not None:
            x = self.wte(x) + self.wpe(torch.arange(x.size(1), device=x.device))
        for block in self.h:
            x = block(x)
        if self.lm_head is not None:
            x = self.lm_head(self.ln_f(x))
        return x


def torch_runner(model, tokens, target, m: int, schedule: str, split: list[range], tied_group) -> Runner:
    rank, p, num_stages = dist.get_rank(), dist.get_world_size(), len(split)
    mine = [s for s in range(num_stages) if s % p == rank]
    modules = [GPTStage(model, split[s], s == 0, s == num_stages - 1) for s in mine]
    stages = [PipelineStage(mod, s, num_stages, torch.device("cpu")) for mod, s in zip(modules, mine, strict=True)]
    if schedule == "interleaved":
        runtime = ScheduleInterleaved1F1B(stages, m, loss_fn=token_loss)
    else:
        runtime = TORCH_SCHEDULES[schedule](stages[0], m, loss_fn=token_loss)
    params = list({id(q): q for mod in modules for q in mod.parameters()}.values())
    tied = model.transformer.wte.weight if rank in (0, (num_stages - 1) % p) else None

    def forward_backward() -> None:
        args = (tokens,) if 0 in mine else ()
        kwargs = {"target": target, "losses": []} if num_stages - 1 in mine else {}
        runtime.step(*args, return_outputs=False, **kwargs)
        if tied is not None:  # the embedding's and the LM head's gradients of the one tied weight
            if tied.grad is None:
                tied.grad = torch.zeros_like(tied)
            dist.all_reduce(tied.grad, group=tied_group)

    return Runner(params, forward_backward)


# --------------------------------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------------------------------


class _Saved:
    __slots__ = ("tensor", "owner", "ptr")

    def __init__(self, tensor: torch.Tensor, owner: SavedBytes, ptr: int) -> None:
        self.tensor, self.owner, self.ptr = tensor, owner, ptr

    def __del__(self) -> None:
        self.owner.release(self.ptr)


def _storage(t: torch.Tensor):
    """The storage holding ``t``'s bytes on this rank (a DTensor's local shard, a collective's result)."""
    for attr in ("_local_tensor", "elem"):
        inner = getattr(t, attr, None)
        if isinstance(inner, torch.Tensor):
            return _storage(inner)
    return t.untyped_storage()


class SavedBytes:
    """Live bytes of the tensors autograd saves for backward (each storage once; parameters excluded)."""

    def __init__(self, params) -> None:
        self.excluded = {_storage(q).data_ptr() for q in params}
        self.refs: dict[int, list[int]] = {}
        self.live = self.peak = self.total = 0

    def pack(self, t: torch.Tensor):
        storage = _storage(t)
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in self.excluded:
            return t
        if ptr in self.refs:
            self.refs[ptr][0] += 1
        else:
            self.refs[ptr] = [1, storage.nbytes()]
            self.live += storage.nbytes()
            self.total += storage.nbytes()
            self.peak = max(self.peak, self.live)
        # detached: a saved output would otherwise hold its own autograd node, a cycle through C++ that outlives a
        # graph kept by retain_graph (a backward split into input and weight gradients keeps it until W)
        return _Saved(t.detach(), self, ptr)

    @staticmethod
    def unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def release(self, ptr: int) -> None:
        entry = self.refs[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.refs[ptr]


def saved_peak(runner) -> int:
    """The peak live bytes saved for backward during one ``runner.step()`` (``runner.params`` excluded)."""
    tracker = SavedBytes(runner.params)
    with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
        runner.step()
    return tracker.peak


def saved_bytes_step(runner: Runner, m: int) -> dict:
    """One step under the saved-tensor hooks: peak live bytes, bytes per microbatch, and their ratio."""
    tracker = SavedBytes(runner.params)
    with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
        runner.step()
    per_microbatch = tracker.total / m
    return {"peak_bytes": tracker.peak, "per_microbatch_bytes": per_microbatch, "left_live": tracker.live,
            "in_flight": tracker.peak / per_microbatch if per_microbatch else 0.0}


def time_runners(runners: dict[str, Runner], warmup: int, steps: int) -> tuple[dict, dict]:
    """Steps in rotating order between barriers: times (ms, rank 0's clock) and each step's trace, per runner."""
    names = list(runners)
    times: dict[str, list[float]] = {n: [] for n in names}
    traces: dict[str, list] = {n: [] for n in names}
    for index in range(warmup + steps):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            start = time.perf_counter()
            trace = runners[name].step()
            dist.barrier()
            if index >= warmup:
                times[name].append((time.perf_counter() - start) * 1000)
                if trace is not None:
                    traces[name].append(trace)
    return times, traces


def measured_bubble(per_rank: list[list[list]], p: int) -> dict:
    """From every rank's traces of the same steps: per step, the span from the first action's start to the last
    action's end on any rank, and per rank ``1 - busy / span`` with busy the time in F and B; medians over steps.
    Also each stage's busy time (its measured cost) and the share of time spent in blocking receives."""
    overall, ranks, waiting, stage_busy = [], [[] for _ in range(p)], [], {}
    compute: dict[str, list[float]] = {"F": [], "B": []}
    for step in zip(*per_rank, strict=True):
        records = [rec for trace in step for rec in trace]
        start = min(rec[3] for rec in records)
        span = max(rec[4] for rec in records) - start
        busy = [sum(rec[4] - rec[3] for rec in trace if rec[0] in compute) for trace in step]
        overall.append(1 - sum(busy) / (p * span))
        waiting.append(sum(rec[4] - rec[3] for rec in records if rec[0].startswith("RECV")) / (p * span))
        for r in range(p):
            ranks[r].append(1 - busy[r] / span)
        per_stage: dict[int, float] = {}
        for kind, _, stage, begin, end in records:
            if kind in compute:
                compute[kind].append((end - begin) * 1000)
                per_stage[stage] = per_stage.get(stage, 0.0) + (end - begin) * 1000
        for stage, ms in per_stage.items():
            stage_busy.setdefault(stage, []).append(ms)
    busy_ms = [_median(stage_busy[s]) for s in sorted(stage_busy)]
    return {"bubble": _median(overall), "per_rank": [_median(r) for r in ranks], "receive_wait": _median(waiting),
            "forward_ms": _median(compute["F"]), "backward_ms": _median(compute["B"]), "stage_busy_ms": busy_ms,
            "stage_balance": max(busy_ms) / (sum(busy_ms) / len(busy_ms))}


def _median(values: list[float]) -> float:
    return summarize(values)["median_ms"] if values else float("nan")


def gather(value) -> list:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def schedule_runners(case, m: int, schedule: str, layers: int, tied_group, equal_too: bool):
    """``autoshard`` and ``torch`` on the same layers: autoshard's own partition when every block lies in one stage,
    else equal layers per stage for both. With ``equal_too``, both on equal layers and ``autoshard_own`` on
    autoshard's own partition."""
    model, tokens, target = case
    stages = dist.get_world_size() * CHUNKS[schedule]
    own = autoshard_runner(copy.deepcopy(model), tokens, target, m, schedule)
    build = own.info["pm"].builds[0]
    part, gm = build.partition, build.captured.gm
    split, equal = layer_split(gm, part.stage_of, layers, stages), equal_split(layers, stages)
    runners = {}
    if split is not None and not equal_too:
        runners["autoshard"], source = own, "autoshard's partition"
    else:
        if equal_too:
            runners["autoshard_own"] = own
        split, source = equal, "equal layers" + ("" if equal_too else " (autoshard's partition cuts inside a block)")
        runners["autoshard"] = autoshard_runner(copy.deepcopy(model), tokens, target, m, schedule, _starts(equal))
    runners["torch"] = torch_runner(copy.deepcopy(model), tokens, target, m, schedule, split, tied_group)
    info = {"split": describe(split), "split_source": source, "balance": part.balance, "stage_costs": list(part.costs),
            "own_partition": describe_cuts(gm, part.cut_after),
            "split_balance": runners["autoshard"].info["pm"].builds[0].partition.balance}
    return runners, info


def describe_cuts(gm, cut_after) -> str:
    """Where cuts fall, in the model's terms: ``after h.3`` (between blocks) or ``inside h.5 (after add_11)``."""
    order = [n for n in gm.graph.nodes if n.op == "call_function"]
    position = {n.name: i for i, n in enumerate(order)}
    words = []
    for name in cut_after:
        i = position[name]
        here = meta.module_path(order[i]).removeprefix("model.").removeprefix("transformer.")
        after = meta.module_path(order[i + 1]).removeprefix("model.").removeprefix("transformer.")
        block = re.match(r"h\.\d+", here)
        if block and not after.startswith(block.group(0) + ".") and after != block.group(0):
            words.append(f"after {block.group(0)}")
        elif block:
            words.append(f"inside {block.group(0)} (after {name})")
        else:
            words.append(f"after {here or 'the top level'} ({name})")
    return ", ".join(words)


def _starts(split: list[range]) -> list[str]:
    """``pipeline_starts`` for a split: the first block of every stage after the first, as the capture names it."""
    return [f"model.transformer.h.{r.start}" for r in split[1:]]


def run_schedule(case, m: int, schedule: str, layers: int, tied_group, args) -> dict:
    p, v = dist.get_world_size(), CHUNKS[schedule]
    runners, split = schedule_runners(case, m, schedule, layers, tied_group, args.equal_too)
    busy = wait_until_quiet(max_wait=10)
    times, traces = time_runners(runners, args.warmup, args.steps)
    memory = {name: gather(saved_bytes_step(r, m)) for name, r in runners.items()}
    measured = {name: measured_bubble(gather(trace), p) for name, trace in traces.items() if trace}
    pipe = runners["autoshard"].info["pm"].pipeline
    sim = schedules.simulate(pipe.actions, p, v)
    return {
        "schedule": schedule, "p": p, "v": v, "m": m, **split,
        "step_ms": {n: {k: x for k, x in summarize(t).items() if k != "times_ms"} for n, t in times.items()},
        "measured": measured["autoshard"],
        "measured_by_runner": measured,
        "simulated_bubble": sim.bubble,
        "formula_bubble": (p - 1) / (v * m + p - 1),
        "simulated_in_flight": [sim.peak_in_flight[r] for r in range(p)],
        "saved": memory,
        "others_cpu_share_before_timing": busy,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--equal-too", action="store_true",
                        help="also time autoshard on equal layers per stage when its own partition differs")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        p = dist.get_world_size()
        tied_group = dist.new_group(sorted({0, p - 1}))
        case = build_case(args.layers, args.batch, args.vocab)
        results = [run_schedule(case, args.microbatches, name, args.layers, tied_group, args)
                   for name in args.schedules.split(",")]
        if dist.get_rank() == 0:
            with open(args.out, "w") as f:
                json.dump({"world": p, "threads": torch.get_num_threads(), "args": vars(args), "runs": results}, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
