"""Train a small GPT with autoshard on CPU processes, and check it against the unsharded model.

    torchrun --standalone --nproc-per-node 8 examples/train_gpt.py --dp 2 --tp 2 --pp 2

Every rank builds the same model from one seed, autoshard parallelizes it for the mesh, and a few
AdamW steps run on a fixed batch. Each rank also trains an unsharded copy on the whole batch, so the
demo ends with the largest difference between the parallel and the unsharded losses. The model is the
nanoGPT-style GPT of the test zoo (tests/harness/models.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import autoshard  # noqa: E402

from harness.models import build  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for axis in ("dp", "tp", "pp", "cp"):
        parser.add_argument(f"--{axis}", type=int, default=1, help=f"{axis} degree")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved"])
    parser.add_argument("--chunks", type=int, default=1, help="pipeline stages per rank (interleaved)")
    parser.add_argument("--cp-attention", default="gather", choices=["gather", "ring", "alltoall"])
    parser.add_argument("--data-parallel", default="ddp", choices=["ddp", "fsdp"],
                        help="replicas (DDP) or FSDP2 (parameters, gradients and optimizer state sharded over dp)")
    parser.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clipping")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: each process on the GPU of its LOCAL_RANK, collectives over NCCL")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    torch.set_num_threads(1)

    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    mesh = autoshard.Mesh(dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp)
    case = build("gpt", seed=0, device=args.device)
    reference = build("gpt", seed=0, device=args.device).model
    pm = autoshard.parallelize(case.model, mesh, example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target, microbatches=args.microbatches, schedule=args.schedule,
                               chunks=args.chunks, cp_attention=args.cp_attention, data_parallel=args.data_parallel,
                               peak_tflops="measure")
    rank = dist.get_rank() if dist.is_initialized() else 0
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"autoshard demo: GPT ({sum(p.numel() for p in reference.parameters()):,} parameters) on {mesh}, "
        f"{args.microbatches} microbatches per rank, {os.environ.get('WORLD_SIZE', '1')} processes")

    optimizer = torch.optim.AdamW(pm.parameters(), lr=args.lr, eps=1e-6)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=args.lr, eps=1e-6)
    worst = 0.0
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = pm.step(*case.inputs, target=case.target)
        pm.clip_grad_norm_(args.clip)
        optimizer.step()
        elapsed = time.perf_counter() - start

        ref_optimizer.zero_grad()
        ref_loss = case.loss_fn(reference(*case.inputs), case.target)
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), args.clip)
        ref_optimizer.step()
        worst = max(worst, abs(loss.item() - ref_loss.item()))
        seen = pm.metrics()  # this step's numbers, as the ``autoshard`` logger's INFO line says them
        say(f"step {step}: loss {loss.item():.6f}  (unsharded {ref_loss.item():.6f})  {elapsed * 1000:.0f} ms  "
            f"tokens/s {seen['tokens_per_second']:.0f}  MFU {seen.get('mfu', 0.0):.1%} of this CPU's measured peak")

    say(f"largest difference from the unsharded model's loss over {args.steps} steps: {worst:.2e}")
    say("")
    say(_summary(pm.explain()))
    if dist.is_initialized():
        dist.destroy_process_group()


def _summary(report: str) -> str:
    """explain() without the per-parameter table (the demo prints what happened, not every tensor)."""
    lines = report.splitlines()
    keep, skipping = [], False
    for line in lines:
        if line.startswith("parameters:"):
            keep.append(line.rstrip(":") + "  (pm.explain() lists each)")
            skipping = True
            continue
        if skipping and line.startswith("  "):
            continue
        skipping = False
        keep.append(line)
    return "\n".join(keep)


if __name__ == "__main__":
    main()
