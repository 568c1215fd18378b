"""Per-rank worker of ``bench/compiled.py``: eager against ``torch.compile`` on an unmodified HF Llama, side by side.

    GLOO_SOCKET_IFNAME=lo torchrun --standalone --nproc-per-node 2 bench/compiled_worker.py --mesh tp --out r.json

``--mesh tp``: ``parallelize(model, Mesh(tp=2))`` eager and with ``compile=True``, and PyTorch's DTensor TP
(``ColwiseParallel`` q/k/v and gate/up, ``RowwiseParallel`` o/down, the embedding and LM head as torchtitan
plans them, logits gathered for the plain loss) under ``torch.compile``. ``--mesh pp``: ``Mesh(pp=2)`` with the
1F1B and ZBV schedules (4 microbatches), each eager and compiled. The model: ``LlamaForCausalLM`` from a config
(4 layers, hidden 512, 8 heads, MLP 1376, vocab 8192; 8 layers for pp), batch 1 (4 for pp), fp32, AdamW, one
thread per rank, runners taking turns step by step. Per runner: the first step's loss and seconds (the compile
time for the compiled ones), and the median of the later steps.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time

import torch
import torch.distributed as dist
from common import build_hf_llama, summarize
from common import logits_loss as loss_fn
from pp_worker import time_runners

import autoshard

LR = 1e-3
SHAPE = {"hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
         "intermediate_size": 1376, "vocab_size": 8192}


class Runner:
    def __init__(self, model, tokens, target, mesh: autoshard.Mesh, **options) -> None:
        self.pm = autoshard.parallelize(model, mesh, example_inputs=(tokens,), loss_fn=loss_fn, target=target,
                                        **options)
        self.optimizer = torch.optim.AdamW(list(self.pm.parameters()), lr=LR)
        self.tokens, self.target, self.losses = tokens, target, []

    def step(self):
        self.optimizer.zero_grad()
        self.losses.append(float(self.pm.step(self.tokens, target=self.target)))
        with torch.profiler.record_function("optimizer"):
            self.optimizer.step()


class DTensorRunner:
    """PyTorch's DTensor TP (torchtitan's plan without sequence parallelism) under ``torch.compile``."""

    def __init__(self, model, tokens, target) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        parallelize_module(model, mesh, {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate()),
        })
        for layer in model.model.layers:
            parallelize_module(layer, mesh, {
                **{f"self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")},
                "self_attn.o_proj": RowwiseParallel(),
                **{f"mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")},
                "mlp.down_proj": RowwiseParallel(),
            })
        self.model = torch.compile(model)
        self.optimizer = torch.optim.AdamW(list(model.parameters()), lr=LR)
        self.tokens, self.target, self.losses = tokens, target, []

    def step(self):
        self.optimizer.zero_grad()
        loss = loss_fn(self.model(self.tokens), self.target)
        loss.backward()
        self.losses.append(float(loss))
        self.optimizer.step()


KINDS = {"matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"),
         "attention": ("scaled_dot_product", "flash_attention"),
         "collectives": ("c10d", "gloo", "all_reduce", "allreduce", "reduce_scatter", "all_gather", "allgather",
                         "send", "recv", "broadcast", "batch_isend_irecv")}


def breakdown(runner) -> dict[str, float]:
    """Shares of one eager step's time on this rank (the profiler's self times): matmuls, attention kernels,
    collectives (and waiting in them), the optimizer, and everything else, which is all ``torch.compile`` can
    shrink here: inductor fuses elementwise ops but calls the same matmul and attention kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.step()
    times = dict.fromkeys((*KINDS, "optimizer", "other"), 0.0)
    for event in prof.key_averages():
        if event.key == "optimizer":
            times["optimizer"] = event.cpu_time_total
            continue
        kind = next((k for k, names in KINDS.items() if any(n in event.key.lower() for n in names)), "other")
        times[kind] += event.self_cpu_time_total
    times["other"] -= times["optimizer"]  # the optimizer's own ops were counted as other
    total = sum(times.values())
    return {k: v / total for k, v in times.items()}


def first_step(runners: dict) -> dict[str, float]:
    """Each runner's first step, alone between barriers: seconds (compiling, for the compiled ones)."""
    seconds = {}
    for name, runner in runners.items():
        dist.barrier()
        start = time.perf_counter()
        runner.step()
        dist.barrier()
        seconds[name] = time.perf_counter() - start
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", choices=("tp", "pp"), default="tp")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        world = dist.get_world_size()
        if args.mesh == "tp":
            shape, batch = SHAPE, 1
            model, tokens, target = build_hf_llama(shape, args.seq, batch)
            mesh = autoshard.Mesh(tp=world)
            runners = {"eager": Runner(copy.deepcopy(model), tokens, target, mesh),
                       "compiled": Runner(copy.deepcopy(model), tokens, target, mesh, compile=True),
                       "dtensor compiled": DTensorRunner(copy.deepcopy(model), tokens, target)}
        else:
            shape, batch = {**SHAPE, "num_hidden_layers": 8}, 4
            model, tokens, target = build_hf_llama(shape, args.seq, batch)
            mesh = autoshard.Mesh(pp=world)
            runners = {f"{schedule} {how}": Runner(copy.deepcopy(model), tokens, target, mesh, microbatches=4,
                                                   schedule=schedule, compile=how == "compiled")
                       for schedule in ("1f1b", "zbv") for how in ("eager", "compiled")}
        first = first_step(runners)
        times, _ = time_runners(runners, args.warmup, args.steps)
        eager = "eager" if args.mesh == "tp" else "1f1b eager"
        shares = breakdown(runners[eager])
        graphs = {n: r.pm.compiler.summary() for n, r in runners.items()
                  if isinstance(r, Runner) and r.pm.compiler is not None}
        result = {"world": world, "mesh": args.mesh, "seq": args.seq, "batch": batch, "shape": shape,
                  "first_step_s": first, "graphs": graphs, "eager_shares": {"runner": eager, **shares},
                  "step_ms": {n: {k: x for k, x in summarize(t).items() if k != "times_ms"} for n, t in times.items()},
                  "first_loss": {n: r.losses[0] for n, r in runners.items()}}
        if dist.get_rank() == 0:
            with open(args.out, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
