"""Per-rank worker of ``bench/cp.py``: context parallelism on the zoo GPT as the sequence grows.

    .venv/bin/python bench/cp_worker.py --seqs 128,256,512 --out result.json                  # cp=1
    GLOO_SOCKET_IFNAME=lo torchrun --standalone --nproc-per-node 2 bench/cp_worker.py \\
        --seqs 128,256,512 --attention gather,ring --out result.json                           # cp=2

The world size is the cp degree: ``autoshard.parallelize(model, Mesh(cp=c), cp_attention=...,
cp_load_balance=...)`` on the unmodified GPT of ``tests/harness/models.py`` (4 layers, hidden 128, 4 heads, vocab 256),
one configuration per sequence length and attention strategy (one process: ``Mesh()``). For each:

1. the loss of the first step against the unsharded model's in the same process;
2. the bytes autograd saves for backward during one step (``torch.autograd.graph.saved_tensors_hooks``,
   each storage once, parameters and the program's buffers excluded), at their peak, on every rank;
3. one step under ``CommCounter`` (``bench/cp_comm.py``): bytes sent per rank by phase and by who called,
   next to ``autoshard.explain.communication(gm)`` of the rank's program and the analytic amount;
4. the median step time (``zero_grad``, ``pm.step``, AdamW; between barriers), all configurations of the
   job taking turns step by step.

Rank 0 writes the results as JSON to ``--out``. ``--pin`` binds each rank to one core (rank mod cores).
"""

from __future__ import annotations

import argparse
import copy
import json
import os

import torch
import torch.distributed as dist
from common import summarize
from cp_comm import CommCounter, analytic_sent, explain_sent
from pp_worker import SavedBytes
from step_time import pin_to_core, time_runners

import autoshard
from autoshard.explain import communication

from harness.models import build_gpt_model, token_data, token_loss

LAYERS, HIDDEN, HEADS, VOCAB = 4, 128, 4, 256
LR = 1e-3


def build_case(seq: int, batch: int, seed: int = 0):
    """The benchmark GPT (its learned positions sized to ``seq``) and one global batch: (model, tokens, target)."""
    torch.manual_seed(seed)
    model = build_gpt_model(n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS, vocab=VOCAB, seq=seq)
    tokens, target = token_data(torch.Generator().manual_seed(seed + 1), batch=batch, seq=seq, vocab=VOCAB)
    return model, tokens, target


class Config:
    """One configuration: its parallel model, optimizer and data."""

    def __init__(self, seq: int, batch: int, attention: str, load_balance: bool, groups) -> None:
        self.seq, self.attention, self.load_balance = seq, attention, load_balance
        self.c = dist.get_world_size() if dist.is_initialized() else 1
        model, self.tokens, self.target = build_case(seq, batch)
        self.reference = copy.deepcopy(model)
        mesh = autoshard.Mesh(cp=self.c) if self.c > 1 else autoshard.Mesh()
        options = {"cp_attention": attention, "cp_load_balance": load_balance} if self.c > 1 else {}
        self.pm = autoshard.parallelize(model, mesh, example_inputs=(self.tokens,), loss_fn=token_loss,
                                        target=self.target, groups=groups, **options)
        self.optimizer = torch.optim.AdamW(self.pm.parameters(), lr=LR)

    @property
    def name(self) -> str:
        return f"seq {self.seq}, cp={self.c}, {self.attention}" + (", balanced" if self.load_balance else "")

    def step(self) -> torch.Tensor:
        self.optimizer.zero_grad()
        loss = self.pm.step(self.tokens, target=self.target)
        self.optimizer.step()
        return loss

    def program(self):
        return self.pm.builds[0].program.gm


def _gather(value) -> list:
    if not dist.is_initialized():
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def measure(cfg: Config, batch: int) -> dict:
    """Loss check, saved bytes, and collectives of one step each (the first three steps of ``cfg``)."""
    gm = cfg.program()
    tracker = SavedBytes([*cfg.pm.parameters(), *gm.parameters(), *gm.buffers()])
    with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
        loss = cfg.step()
    reference = token_loss(cfg.reference(cfg.tokens), cfg.target).item()
    del cfg.reference
    cfg.step()
    with CommCounter() as counter:
        cfg.step()
    explained = {f"{d} {k} {op}": list(v) for (d, k, op), v in communication(gm).items()}
    peaks = _gather(tracker.peak)
    return {
        "seq": cfg.seq, "c": cfg.c, "attention": cfg.attention, "load_balance": cfg.load_balance, "batch": batch,
        "loss": loss.item(), "loss_diff": abs(loss.item() - reference),
        "saved_peak": peaks[0], "saved_peak_max": max(peaks), "saved_total": tracker.total,
        "measured": _gather(counter.summary())[0],
        "explain": explained,
        "explain_sent": explain_sent(communication(gm), cfg.c),
        "analytic": analytic_sent(cfg.attention, cfg.c, LAYERS, batch, cfg.seq, HIDDEN),
    }


def start(pin: bool):
    """One thread per rank (pinned to its core with ``pin``); under torchrun, gloo and the cp groups. Returns the cp
    groups (None in one process) and the cp degree."""
    torch.set_num_threads(1)
    if pin:
        pin_to_core(int(os.environ.get("LOCAL_RANK", "0")))
    groups = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
        groups = autoshard.Mesh(cp=dist.get_world_size()).create_groups()
    return groups, dist.get_world_size() if dist.is_initialized() else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="128,256,512")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--attention", default="gather,ring,alltoall", help="strategies to run (cp > 1)")
    parser.add_argument("--unbalanced", default="", help="sequence lengths also run without load balance")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--pin", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    groups, c = start(args.pin)
    seqs = [int(s) for s in args.seqs.split(",")]
    unbalanced = {int(s) for s in args.unbalanced.split(",") if s}
    plans = [(s, "none", False) for s in seqs] if c == 1 else [
        (s, a, lb) for s in seqs for a in args.attention.split(",") for lb in (True, False) if lb or s in unbalanced]
    configs = [Config(s, args.batch, a, lb, groups) for s, a, lb in plans]
    results = [measure(cfg, args.batch) for cfg in configs]
    times = time_runners({cfg.name: cfg.step for cfg in configs}, args.warmup, args.steps)
    for cfg, result in zip(configs, results, strict=True):
        result["step_ms"] = {k: v for k, v in summarize(times[cfg.name]).items() if k != "times_ms"}
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"c": c, "threads": torch.get_num_threads(), "configs": results}, f, indent=1)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
