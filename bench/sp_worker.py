"""Per-rank worker of ``bench/sp.py``: tensor parallelism with and without sequence parallelism, side by side.

    GLOO_SOCKET_IFNAME=lo torchrun --standalone --nproc-per-node 2 bench/sp_worker.py --seq 1024 --out r.json

The model: ``LlamaForCausalLM`` from a config (4 layers, hidden 512, 8 heads, MLP 1376, vocab 8192), batch 1,
fp32, AdamW, one thread per rank; ``parallelize(model, Mesh(tp=2))`` with ``sequence_parallel`` off and on, and
PyTorch's DTensor TP + ``SequenceParallel`` with torchtitan's plan (``sp_dtensor.py``), taking turns step by
step. Per runner: the first step's loss, the median step time, and the bytes saved for backward at their peak on
each rank (saved-tensor hooks, each storage once, parameters excluded).
"""

from __future__ import annotations

import argparse
import copy
import json
import os

import torch
import torch.distributed as dist
from common import build_hf_llama, summarize
from common import logits_loss as loss_fn
from pp_worker import gather, saved_peak, time_runners
from sp_dtensor import dtensor_tp_sp_llama, loss_and_backward

import autoshard

LR = 1e-3
SHAPE = {"hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
         "intermediate_size": 1376, "vocab_size": 8192}


class Runner:
    def __init__(self, model, tokens, target, sequence_parallel: bool) -> None:
        self.pm = autoshard.parallelize(model, autoshard.Mesh(tp=dist.get_world_size()), example_inputs=(tokens,),
                                        loss_fn=loss_fn, target=target, sequence_parallel=sequence_parallel)
        self.params = list(self.pm.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=LR)
        self.tokens, self.target, self.losses = tokens, target, []

    def step(self):
        self.optimizer.zero_grad()
        self.losses.append(float(self.pm.step(self.tokens, target=self.target)))
        self.optimizer.step()


class DTensorRunner:
    """PyTorch's own TP + ``SequenceParallel`` (torchtitan's plan, ``sp_dtensor.py``) on the same model."""

    def __init__(self, model, tokens, target) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.model = dtensor_tp_sp_llama(model, init_device_mesh("cpu", (dist.get_world_size(),)))
        self.params = list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=LR)
        self.tokens, self.target, self.losses = tokens, target, []

    def step(self):
        self.optimizer.zero_grad()
        self.losses.append(loss_and_backward(self.model, self.tokens, self.target))
        self.optimizer.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        model, tokens, target = build_hf_llama(SHAPE, args.seq, 1)
        runners = {name: Runner(copy.deepcopy(model), tokens, target, sp)
                   for name, sp in (("tp", False), ("tp+sp", True))}
        runners["dtensor tp+sp"] = DTensorRunner(copy.deepcopy(model), tokens, target)
        times, _ = time_runners(runners, args.warmup, args.steps)
        peaks = {name: gather(saved_peak(r)) for name, r in runners.items()}
        result = {"world": dist.get_world_size(), "seq": args.seq, "shape": SHAPE,
                  "step_ms": {n: {k: x for k, x in summarize(t).items() if k != "times_ms"} for n, t in times.items()},
                  "first_loss": {n: r.losses[0] for n, r in runners.items()}, "saved_peak_bytes": peaks}
        if dist.get_rank() == 0:
            with open(args.out, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
