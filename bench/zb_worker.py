"""Per-rank worker of ``bench/zb.py``: autoshard's pipeline schedules next to PyTorch's, on an unmodified HF Llama.

    GLOO_SOCKET_IFNAME=lo torchrun --standalone --nproc-per-node 2 bench/zb_worker.py --microbatches 4 --out r.json

The model: ``LlamaForCausalLM`` from a config (8 layers, hidden 512, 8 heads, MLP 1376, vocab 8192), sequence
128, global batch 8, fp32, AdamW, one thread per rank. Runners, all on the same layers per stage and taking turns
step by step:

- ``autoshard <schedule>``: ``parallelize(model, Mesh(pp=2), schedule=...)`` for 1f1b, zb-h1, zbv and dualpipev,
  the model unmodified (autoshard's own partition; where it cuts inside a layer, equal layers for everyone);
- ``torch <schedule>``: ``torch.distributed.pipelining`` with hand-written stages (embedding, decoder layers with
  the model's rotary embedding, final norm and LM head) on the same layers: ``Schedule1F1B``,
  ``ScheduleInterleavedZeroBubble`` with one stage per rank (ZB-H1), ``ScheduleZBVZeroBubble`` and
  ``ScheduleDualPipeV`` (two stages per rank in a V).

Per runner: the first step's loss (all must agree), the median step time, and, for autoshard, the idle fraction
per rank measured from its executor's records (``pm.timeline()``'s data) against ``schedules.simulate`` with the
measured F, I, W (or B) costs, and the bytes saved for backward at their peak per rank.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re

import torch
import torch.distributed as dist
from common import build_hf_llama, summarize
from common import logits_loss as loss_fn
from pp_worker import gather, saved_peak, time_runners
from torch import nn
from torch.distributed import pipelining

import autoshard
from autoshard import meta, schedules

LR = 1e-3
SHAPE = {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8,
         "intermediate_size": 1376, "vocab_size": 8192}
SEQ, BATCH = 128, 8
AUTOSHARD = ("1f1b", "zb-h1", "zbv", "dualpipev")
TORCH = {"1f1b": "Schedule1F1B", "zb-h1": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
         "dualpipev": "ScheduleDualPipeV"}
V = ("zbv", "dualpipev")  # two stages per rank, placed in a V


class Runner:
    def __init__(self, params, forward_backward, pm=None) -> None:
        self.params = list(params)
        self.optimizer = torch.optim.AdamW(self.params, lr=LR)
        self.forward_backward, self.pm, self.losses = forward_backward, pm, []

    def step(self):
        self.optimizer.zero_grad()
        trace = self.forward_backward()
        self.optimizer.step()
        return trace


def autoshard_runner(model, tokens, target, m: int, schedule: str, starts: list[str] | None = None) -> Runner:
    pm = autoshard.parallelize(model, autoshard.Mesh(pp=dist.get_world_size()), example_inputs=(tokens,),
                               loss_fn=loss_fn, target=target, microbatches=m, schedule=schedule,
                               pipeline_starts=starts)
    runner = Runner(pm.parameters(), None, pm)

    def forward_backward():
        runner.losses.append(float(pm.step(tokens, target=target)))
        records = pm.pipeline.executor.records
        return [(r.action.kind, r.action.microbatch, r.action.stage, r.start, r.end) for r in records]

    runner.forward_backward = forward_backward
    return runner


class LlamaStage(nn.Module):
    """A hand-written stage of HF Llama: the embedding on the first, the final norm and LM head on the last."""

    def __init__(self, model: nn.Module, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        inner = model.model
        self.embed = inner.embed_tokens if first else None
        self.layers = nn.ModuleList(inner.layers[i] for i in layers)
        self.rotary = inner.rotary_emb
        self.norm, self.head = (inner.norm, model.lm_head) if last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        positions = torch.arange(x.shape[1], device=x.device)[None]
        rotary = self.rotary(x, positions)
        for layer in self.layers:
            x = layer(x, attention_mask=None, position_ids=positions, position_embeddings=rotary)
            x = x[0] if isinstance(x, tuple) else x
        return self.head(self.norm(x)) if self.head is not None else x


def torch_runner(model, tokens, target, m: int, schedule: str, split: list[range]) -> Runner:
    rank, p, stages_n = dist.get_rank(), dist.get_world_size(), len(split)
    placement = "v" if schedule in V else "loop"
    mine = [s for s in range(stages_n) if schedules.stage_rank(s, p, placement) == rank]
    modules = [LlamaStage(model, split[s], s == 0, s == stages_n - 1) for s in mine]
    stages = [pipelining.PipelineStage(mod, s, stages_n, torch.device("cpu")) for mod, s in zip(modules, mine,
                                                                                                  strict=True)]
    kind = getattr(pipelining.schedules, TORCH[schedule])
    runtime = kind(stages[0], m, loss_fn=loss_fn) if schedule == "1f1b" else kind(stages, m, loss_fn=loss_fn)
    params = {id(q): q for mod in modules for q in mod.parameters()}
    runner = Runner(params.values(), None)

    def forward_backward():
        args = (tokens,) if 0 in mine else ()
        losses: list = []
        kwargs = {"target": target, "losses": losses} if stages_n - 1 in mine else {}
        runtime.step(*args, return_outputs=False, **kwargs)
        total = torch.tensor(float(sum(loss.item() for loss in losses)) / m if losses else 0.0)
        dist.all_reduce(total)
        runner.losses.append(float(total))

    runner.forward_backward = forward_backward
    return runner


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def layer_split(build) -> list[range] | None:
    """The layers of each stage of autoshard's partition when every layer lies in one stage, else None."""
    stage_of, owner = build.partition.stage_of, {}
    for node in build.captured.gm.graph.nodes:
        found = _LAYER.search(meta.module_path(node))
        if found and node.name in stage_of:
            owner.setdefault(int(found.group(1)), set()).add(stage_of[node.name])
    layers = SHAPE["num_hidden_layers"]
    if sorted(owner) != list(range(layers)) or any(len(s) != 1 for s in owner.values()):
        return None
    stage = [next(iter(owner[i])) for i in range(layers)]
    if stage != sorted(stage):
        return None
    return [range(stage.index(s), len(stage) - stage[::-1].index(s)) for s in sorted(set(stage))]


def describe(split: list[range]) -> str:
    return "; ".join(f"{r.start}-{r.stop - 1}" for r in split)


def measured(traces: list[list[list]], p: int, m: int, schedule: str) -> dict:
    """Idle fraction per rank over the step's span (first action to last, any rank), median over steps, and the
    simulation of the schedule with the median measured cost of each compute kind."""
    idle, span_ms, cost = [[] for _ in range(p)], [], {}
    for step in zip(*traces, strict=True):
        records = [rec for trace in step for rec in trace]
        start, end = min(r[3] for r in records), max(r[4] for r in records)
        span_ms.append((end - start) * 1000)
        for r, trace in enumerate(step):
            busy = sum(rec[4] - rec[3] for rec in trace if rec[0] in "FBIW")
            idle[r].append(1 - busy / (end - start))
        for kind, *_, begin, finish in records:
            if kind in "FBIW":
                cost.setdefault(kind, []).append((finish - begin) * 1000)
    median = {k: summarize(v)["median_ms"] for k, v in cost.items()}
    v = 2 if schedule in V else 1
    backward = median.get("B", median.get("I", 0) + median.get("W", 0))
    sim = schedules.simulate(schedules.schedule(schedule, p, m, v), p, v, forward_cost=median["F"] * v,
                             backward_cost=backward * v, weight_share=median["W"] / backward if "W" in median else 0.5,
                             placement="v" if schedule in V else "loop")
    return {"idle_per_rank": [summarize(x)["median_ms"] for x in idle], "span_ms": summarize(span_ms)["median_ms"],
            "compute_ms": median, "simulated_idle": sim.bubble, "simulated_ms": sim.makespan,
            "simulated_in_flight": [sim.peak_in_flight[r] for r in range(p)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--torch", default="1f1b,zb-h1,zbv,dualpipev", help="PyTorch's schedules to run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        p, m = dist.get_world_size(), args.microbatches
        model, tokens, target = build_hf_llama(SHAPE, SEQ, BATCH)
        runners = {f"autoshard {s}": autoshard_runner(copy.deepcopy(model), tokens, target, m, s) for s in AUTOSHARD}
        splits = {s: layer_split(runners[f"autoshard {s}"].pm.builds[0]) for s in AUTOSHARD}
        for s in AUTOSHARD:  # a cut inside a layer: equal layers for autoshard and torch alike
            if splits[s] is None:
                stages = p * (2 if s in V else 1)
                per = SHAPE["num_hidden_layers"] // stages
                splits[s] = [range(i * per, (i + 1) * per) for i in range(stages)]
                starts = [f"model.model.layers.{r.start}" for r in splits[s][1:]]
                runners[f"autoshard {s}"] = autoshard_runner(copy.deepcopy(model), tokens, target, m, s, starts)
        for s in args.torch.split(","):
            split = splits.get(s, splits["zbv" if s in V else "1f1b"])
            runners[f"torch {s}"] = torch_runner(copy.deepcopy(model), tokens, target, m, s, split)
        times, traces = time_runners(runners, args.warmup, args.steps)
        peaks = {name: gather(saved_peak(r)) for name, r in runners.items()}
        result = {
            "world": p, "m": m, "shape": SHAPE, "seq": SEQ, "batch": BATCH,
            "splits": {s: describe(x) for s, x in splits.items()},
            "step_ms": {n: {k: x for k, x in summarize(t).items() if k != "times_ms"} for n, t in times.items()},
            "first_loss": {n: r.losses[0] for n, r in runners.items()},
            "measured": {n: measured(gather(traces[n]), p, m, n.split()[1]) for n in runners if traces[n]},
            "saved_peak_bytes": peaks,
        }
        if dist.get_rank() == 0:
            with open(args.out, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
