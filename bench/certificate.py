"""The communication certificate per axis: what each rank sends in a step, checked, against the least the axis needs.

    GLOO_SOCKET_IFNAME=lo .venv/bin/torchrun --standalone --nproc-per-node 4 bench/certificate.py

An HF Llama (4 layers, hidden 256, 8 heads of which 4 kv) and an HF Mixtral (2 layers, 8 experts, top-2), built from
configs with no download, on a batch of 4 x 128 tokens, at every axis the 4 ranks allow. For each cell, on every
rank: the first step runs recorded and must equal the build's certificate (``verify_communication="first"``); rank
0 reports, from ``explain()``'s numbers, the bytes each axis puts on the wire in a step (ring algorithms: an
all-reduce 2(n-1)/n of its buffer, ...) against the least its pattern needs (Megatron's four all-reduces of each
block's activation, ...), as a ratio. The check's cost: the first step with the check (recording every collective,
building the certificate, comparing) against the first step of a second parallel model of the same cell without
it, and the certificate's build time alone. Into ``bench/results_certificate.md``.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent / "tests"), str(BENCH)]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from common import build_hf_llama, logits_loss  # noqa: E402

BATCH, SEQ = 4, 128
LLAMA = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
         "intermediate_size": 512, "vocab_size": 2048}
MIXTRAL = {"vocab_size": 2048, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
           "num_attention_heads": 8, "num_key_value_heads": 4, "num_local_experts": 8, "num_experts_per_tok": 2,
           "router_jitter_noise": 0.0}
# (model, mesh, options) at 4 ranks
CELLS = [
    ("llama", {"tp": 4}, {}),
    ("llama", {"tp": 4}, {"sequence_parallel": True}),
    ("llama", {"cp": 4}, {"cp_attention": "gather"}),
    ("llama", {"cp": 4}, {"cp_attention": "ring"}),
    ("llama", {"cp": 4}, {"cp_attention": "alltoall"}),
    ("llama", {"pp": 4}, {"microbatches": 4}),
    ("llama", {"pp": 2, "dp": 2}, {"microbatches": 2, "schedule": "zbv"}),
    ("llama", {"dp": 4}, {}),
    ("llama", {"dp": 4}, {"data_parallel": "fsdp"}),
    ("llama", {"dp": 2, "tp": 2}, {}),
    ("mixtral", {"dp": 4, "ep": 4}, {}),
    ("mixtral", {"tp": 4}, {}),
    ("mixtral", {"dp": 2, "tp": 2, "ep": 2}, {}),
]


def build(name: str):
    if name == "llama":
        return build_hf_llama(LLAMA, SEQ, BATCH)
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(**MIXTRAL, max_position_embeddings=SEQ, use_cache=False)
    model = transformers.MixtralForCausalLM(config).train()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, MIXTRAL["vocab_size"], (BATCH, SEQ), generator=g)
    return model, tokens, torch.randint(0, MIXTRAL["vocab_size"], (BATCH, SEQ), generator=g)


def first_step(name: str, mesh_kwargs: dict, groups, verify: str, **options):
    """A parallel model of the cell, and its first step's seconds (every rank waits for the slowest)."""
    import autoshard

    model, tokens, target = build(name)
    mesh = autoshard.Mesh(**mesh_kwargs)
    pm = autoshard.parallelize(model, mesh, example_inputs=(tokens,), loss_fn=logits_loss, target=target,
                               groups=groups, verify_communication=verify, **options)
    dist.barrier()
    start = time.perf_counter()
    pm.step(tokens, target=target)
    seconds = torch.tensor(time.perf_counter() - start)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return pm, tokens, target, float(seconds)


def cell(name: str, mesh_kwargs: dict, options: dict, groups) -> dict:
    from autoshard.certificate import counted
    from autoshard.runtime import communication

    plain, _, _, unchecked_s = first_step(name, mesh_kwargs, groups, "never", **options)
    del plain
    pm, tokens, target, checked_s = first_step(name, mesh_kwargs, groups, "first", **options)
    start = time.perf_counter()
    certificate = pm.certificate(tokens, target=target)
    build_s = time.perf_counter() - start
    _, build_, _ = pm._checked
    least = communication.minimum(pm, build_, certificate)
    sent = counted(certificate)
    return {"collectives": sum(c.count or 1 for c in certificate.collectives), "sent": sent, "least": least,
            "checked_s": checked_s, "unchecked_s": unchecked_s, "build_s": build_s}


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def main() -> None:
    import autoshard

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    rows = []
    groups = {}
    try:
        for name, mesh_kwargs, options in CELLS:
            mesh = autoshard.Mesh(**mesh_kwargs)
            if mesh.world_size != world:
                continue
            if mesh not in groups:
                groups[mesh] = mesh.create_groups()
            found = cell(name, mesh_kwargs, options, groups[mesh])
            label = f"{name} {' x '.join(f'{a}{d}' for a, d in mesh_kwargs.items())}"
            label += "".join(f", {k}={v}" for k, v in options.items())
            for axis, (least, formula) in found["least"].items():
                sent = found["sent"].get(axis, 0.0)
                rows.append((label, axis, _mib(sent), _mib(least), f"{sent / least:.2f}x" if least else "-",
                             formula, found["collectives"], found["checked_s"], found["unchecked_s"],
                             found["build_s"]))
            if dist.get_rank() == 0:
                print(f"{label}: {found['collectives']} collectives certified and checked, first step "
                      f"{found['checked_s']:.2f} s checked, {found['unchecked_s']:.2f} s not", flush=True)
        if dist.get_rank() == 0:
            write(rows, world)
    finally:
        dist.destroy_process_group()


def write(rows: list[tuple], world: int) -> None:
    lines = [f"# The communication certificate at {world} ranks", "",
             f"`GLOO_SOCKET_IFNAME=lo .venv/bin/torchrun --standalone --nproc-per-node {world} bench/certificate.py`",
             f"on {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
             "gloo. Batch 4 x 128 tokens; per step and rank 0; MiB on the wire with ring algorithms.", "",
             "Every cell's first step was recorded and equal to its certificate on every rank (else the run would have "
             "raised).", "",
             "| cell | axis | sent (MiB) | least (MiB) | ratio | the least: | collectives | first step checked (s) | "
             "unchecked (s) | certificate built (s) |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    for label, axis, sent, least, ratio, formula, calls, checked, unchecked, built in rows:
        lines.append(f"| {label} | {axis} | {sent} | {least} | {ratio} | {formula} | {calls} | {checked:.2f} | "
                     f"{unchecked:.2f} | {built:.3f} |")
    out = BENCH / "results_certificate.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
