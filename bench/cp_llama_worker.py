"""Per-rank worker of ``bench/cp_llama.py``: one training step of an unmodified HF Llama under each cp strategy.

    .venv/bin/python bench/cp_llama_worker.py --out result.json                       # cp=1: the unsharded step
    GLOO_SOCKET_IFNAME=lo torchrun --standalone --nproc-per-node 2 bench/cp_llama_worker.py \\
        --strategies gather,ring,alltoall,torch --out result.json                        # cp=2

The model: ``LlamaForCausalLM`` from a config (hidden 256, 4 layers, 4 heads, MLP 688, vocab 2048), batch 1,
one thread per rank. Each strategy is ``autoshard.parallelize(model, Mesh(cp=c), cp_attention=...,
cp_load_balance=True)``; ``torch`` is PyTorch's own ``context_parallel`` (DTensor ring attention) on the same
model, where it runs. Per strategy: the first step's loss against the unsharded model's, and the median step
time (``zero_grad``, ``step``, AdamW) with all strategies taking turns step by step. Rank 0 writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json

import torch
import torch.distributed as dist
from common import build_hf_llama, summarize
from common import logits_loss as loss_fn
from cp_worker import start
from step_time import time_runners

import autoshard

LR = 1e-3
SHAPE = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
         "intermediate_size": 688, "vocab_size": 2048}


def build(seq: int, seed: int = 0):
    return build_hf_llama(SHAPE, seq, 1, seed)


class Autoshard:
    def __init__(self, seq: int, strategy: str, groups) -> None:
        model, self.tokens, self.target = build(seq)
        self.reference = copy.deepcopy(model)
        c = dist.get_world_size() if dist.is_initialized() else 1
        mesh = autoshard.Mesh(cp=c) if c > 1 else autoshard.Mesh()
        options = {"cp_attention": strategy, "cp_load_balance": True} if c > 1 else {}
        self.pm = autoshard.parallelize(model, mesh, example_inputs=(self.tokens,), loss_fn=loss_fn,
                                        target=self.target, groups=groups, **options)
        self.optimizer = torch.optim.AdamW(self.pm.parameters(), lr=LR)

    def step(self) -> float:
        self.optimizer.zero_grad()
        loss = self.pm.step(self.tokens, target=self.target)
        self.optimizer.step()
        return float(loss)


class TorchContextParallel:
    """PyTorch's ``context_parallel``: the sequence of the inputs sharded over a DeviceMesh, SDPA as ring attention."""

    def __init__(self, seq: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        self.model, self.tokens, self.target = build(seq)
        self.reference = copy.deepcopy(self.model)
        self.mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
        self.context = context_parallel
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR)

    def step(self) -> float:
        self.optimizer.zero_grad()
        tokens, target = self.tokens.clone(), self.target.clone()
        with self.context(self.mesh, buffers=[tokens, target], buffer_seq_dims=[1, 1]):
            loss = loss_fn(self.model(tokens), target)
            loss.backward()
        for p in self.model.parameters():  # each rank's loss is over its tokens: sum the gradients over cp
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        self.optimizer.step()
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        return float(loss) / dist.get_world_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--strategies", default="gather,ring,alltoall,torch")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--pin", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    groups, c = start(args.pin)
    strategies = ["none"] if c == 1 else args.strategies.split(",")
    runners, results = {}, {}
    for strategy in strategies:
        try:
            runner = TorchContextParallel(args.seq) if strategy == "torch" else Autoshard(args.seq, strategy, groups)
            loss = runner.step()
            reference = loss_fn(runner.reference(runner.tokens), runner.target).item()
            del runner.reference
            results[strategy] = {"loss": loss, "loss_diff": abs(loss - reference)}
            runners[strategy] = runner.step
        except Exception as e:  # noqa: BLE001 - a strategy that does not run is reported, not fatal
            results[strategy] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    times = time_runners(runners, args.warmup, args.steps)
    for strategy in runners:
        results[strategy]["step_ms"] = {k: v for k, v in summarize(times[strategy]).items() if k != "times_ms"}
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"c": c, "seq": args.seq, "shape": SHAPE, "strategies": results}, f, indent=1)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
