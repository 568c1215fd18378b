"""Compile time of autoshard's tensor parallelism on Llama-shaped models on the ``meta`` device, without processes.

    .venv/bin/python bench/compile_tp.py                 # every shape, each in a fresh process; prints markdown
    .venv/bin/python bench/compile_tp.py --worker --layers 32 --hidden 4096 --heads 32 --kv-heads 32 \\
        --ffn 11008 --vocab 32000 --seq 2048 --tp 8    # one shape: one JSON line

What ``parallelize(model, Mesh(tp=8))`` does before the first step, phase by phase, for tp rank 0: build the
Llama-style decoder of ``tests/harness/models.py`` on ``meta``; ``autoshard.capture`` of model and loss (torch.export)
plus the token-loss rewrite that ``parallelize`` applies (``find_token_loss``, ``sum_loss_pass``);
``plan_tensor_parallel`` (pattern search and sharding propagation over the whole graph); ``codegen.build``
(copy the graph, insert the collectives, rewrite sizes, slice the parameters: rank 0's program, built with no
process group). Each shape runs in its own process so that its peak RSS (``resource.getrusage``) is its own.
The built program's collectives per step are counted with ``autoshard.explain.communication``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import report
import tp_launch
from common import BENCH

# Llama-2-7B's published widths at three depths, its grouped-query variant, and Llama-2-70B.
LLAMA_7B = dict(hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000, seq=2048, batch=1)
SHAPES = {
    "7B widths, 8 layers": dict(LLAMA_7B, layers=8),
    "Llama-2-7B (32 layers)": dict(LLAMA_7B, layers=32),
    "7B widths, 80 layers": dict(LLAMA_7B, layers=80),
    "Llama-2-7B, 8 kv heads": dict(LLAMA_7B, layers=32, kv_heads=8),
    "Llama-2-70B (80 layers)": dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000, seq=2048,
                                    batch=1),
}
TP = 8


def peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def measure(shape: dict, tp: int) -> dict:
    """Build, capture, plan and generate rank 0's program of one shape; seconds per phase and memory."""
    import torch

    import autoshard
    from autoshard import codegen
    from autoshard.explain import communication
    from autoshard.passes.loss import find_token_loss, sum_loss_pass
    from autoshard.passes.tensor_parallel import plan_tensor_parallel

    from harness.models import build_llama_model, token_loss

    rss_after_import = peak_rss_mib()
    clock = [time.perf_counter()]
    model = build_llama_model(n_layer=shape["layers"], n_embd=shape["hidden"], n_head=shape["heads"],
                              n_kv_head=shape["kv_heads"], vocab=shape["vocab"], seq=shape["seq"], ffn=shape["ffn"],
                              device="meta")
    tokens = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), device="meta")
    target = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), device="meta")
    clock.append(time.perf_counter())
    captured = autoshard.capture(model, (tokens,), loss_fn=token_loss, example_target=target)
    token = find_token_loss(captured.gm)
    if token is not None:
        sum_loss_pass(captured.gm, token)
    clock.append(time.perf_counter())
    plan = plan_tensor_parallel(captured.gm, tp)
    clock.append(time.perf_counter())
    program = _build_rank0(codegen, captured, plan)
    clock.append(time.perf_counter())
    comm = communication(program.gm)
    build_s, capture_s, plan_s, codegen_s = (b - a for a, b in zip(clock, clock[1:], strict=False))
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "rank0_parameters": sum(p.numel() for p in program.gm.parameters()),
        "all_meta": all(p.is_meta for p in program.gm.parameters()),
        "nodes": captured.num_nodes,
        "rank0_nodes": len(program.gm.graph.nodes),
        "build_s": build_s,
        "capture_s": capture_s,
        "plan_s": plan_s,
        "codegen_s": codegen_s,
        "compile_s": capture_s + plan_s + codegen_s,
        "collective_calls": sum(calls for calls, _ in comm.values()),
        "collective_bytes": sum(size for _, size in comm.values()),
        "rss_after_import_mib": rss_after_import,
        "peak_rss_mib": peak_rss_mib(),
    }


def _build_rank0(codegen, captured, plan):
    """``codegen.build`` for tp rank 0 with no process group (``Sharding`` where this version of codegen has it)."""
    if hasattr(codegen, "Sharding"):
        return codegen.build(captured, codegen.Sharding({"tp": codegen.On(plan, 0)}))
    return codegen.build(captured, plan, rank=0)


def run_shape(name: str, shape: dict, tp: int, opts) -> dict:
    """``measure`` in a fresh process: ``{"result": ..., "others_share": ...}`` or ``{"error": ...}``."""
    argv = [sys.executable, str(BENCH / "compile_tp.py"), "--worker", "--tp", str(tp)]
    for key, value in shape.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return tp_launch.run_json(name, argv, opts)


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


HEADER = ["shape", "layers", "hidden / heads / kv heads / ffn", "parameters", "rank 0 share", "nodes", "capture s",
          "plan s", "codegen s", "compile s", "compile ms per layer", "collectives per step (calls / bytes)",
          "peak RSS MiB"]


def _row(name: str, shape: dict, r: dict) -> list[str]:
    return [
        name, str(shape["layers"]), f"{shape['hidden']} / {shape['heads']} / {shape['kv_heads']} / {shape['ffn']}",
        f"{r['parameters'] / 1e9:.2f} B", f"{r['rank0_parameters'] / r['parameters']:.3f}", str(r["nodes"]),
        f"{r['capture_s']:.2f}", f"{r['plan_s']:.2f}", f"{r['codegen_s']:.2f}", f"**{r['compile_s']:.2f}**",
        f"{1000 * r['compile_s'] / shape['layers']:.0f}", f"{r['collective_calls']} / {_gib(r['collective_bytes'])}",
        f"{r['peak_rss_mib']:.0f}",
    ]


def section(results: dict[str, dict], tp: int) -> str:
    """The markdown section of the compile-time table."""
    lines = [
        f"## Tensor-parallel compile time at tp={tp} on the `meta` device",
        "",
        "Llama-style decoder of tests/harness/models.py (`build_llama_model`), vocab 32000, sequence 2048, batch 1, "
        "built on "
        "`meta`, one shape per fresh process, no process group. *capture*: `autoshard.capture` of model and loss "
        f"(torch.export) plus the token-loss rewrite; *plan*: `plan_tensor_parallel(gm, {tp})`; *codegen*: "
        "`codegen.build` of rank 0's program (collectives inserted, sizes made local, parameters sliced). "
        "*compile* = capture + plan + codegen (building the model on `meta` is not included). *rank 0 share*: rank "
        "0's parameters over the model's. *collectives*: rank 0's program per training step (forward and backward), "
        "from `autoshard.explain.communication`. *peak RSS*: the process's peak resident memory "
        "(`resource.getrusage`), about 220 MiB of which is importing torch.",
        "",
    ]
    rows, notes = [], []
    for name, job in results.items():
        if "error" in job:
            notes.append(f"- {name} failed: {job['error']}")
            continue
        rows.append(_row(name, SHAPES[name], job["result"]))
        notes += tp_launch.disturbed_note(f"the {name} compile", job.get("others_share"))
    lines.append(report.table(HEADER, rows, align="lrl" + "r" * (len(HEADER) - 3)))
    lines += _growth(results)
    if notes:
        lines += ["", *notes]
    return "\n".join(lines)


def _growth(results: dict[str, dict]) -> list[str]:
    depth = [n for n in ("7B widths, 8 layers", "Llama-2-7B (32 layers)", "7B widths, 80 layers")
             if "result" in results.get(n, {})]
    if len(depth) < 2:
        return []
    r = {n: results[n]["result"] for n in depth}
    first = r[depth[0]]
    steps = "; ".join(f"{SHAPES[n]['layers']} layers ({SHAPES[n]['layers'] / SHAPES[depth[0]]['layers']:g}x the "
                      f"layers): compile {r[n]['compile_s'] / first['compile_s']:.1f}x, capture "
                      f"{r[n]['capture_s'] / first['capture_s']:.1f}x, plan {r[n]['plan_s'] / first['plan_s']:.1f}x, "
                      f"codegen {r[n]['codegen_s'] / first['codegen_s']:.1f}x" for n in depth[1:])
    return ["", f"Growth with depth at 7B widths, against {SHAPES[depth[0]]['layers']} layers: {steps}."]


def compile_results(opts, tp: int = TP) -> dict[str, dict]:
    return {name: run_shape(name, shape, tp, opts) for name, shape in SHAPES.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help="measure one shape in this process")
    parser.add_argument("--tp", type=int, default=TP)
    for name in ("layers", "hidden", "heads", "kv-heads", "ffn", "vocab", "seq", "batch"):
        parser.add_argument(f"--{name}", type=int)
    parser.add_argument("--out", type=Path, help="worker: write the JSON result here")
    parser.add_argument("--output", type=Path, help="also write the markdown here")
    tp_launch.add_arguments(parser, job_timeout=170)
    args = parser.parse_args()
    if args.worker:
        shape = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq", "batch")}
        text = json.dumps(measure(shape, args.tp))
        print(text)
        if args.out:
            args.out.write_text(text + "\n")
        return
    started = time.perf_counter()
    body = section(compile_results(tp_launch.from_args(args), args.tp), args.tp)
    text = "\n".join(tp_launch.header("autoshard tensor-parallel compile time", started)) + "\n\n" + body + "\n"
    if args.output:
        args.output.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
