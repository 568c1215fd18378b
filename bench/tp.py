"""Tensor-parallel benchmark: autoshard against PyTorch's DTensor ``parallelize_module``, and compile time at 7B.

    .venv/bin/python bench/tp.py            # writes bench/results_tp.md and prints it

1. One ``torchrun --standalone --nproc-per-node 2`` job (``bench/tp_worker.py``, one thread per rank) trains the
   zoo GPT (fused qkv, tied LM head) and the Llama-style decoder (separate q/k/v, grouped-query attention,
   SwiGLU) of ``tests/harness/models.py`` at tp=2, each with autoshard (``parallelize(model, Mesh(tp=2))``, the model
   unmodified) and with DTensor's ``parallelize_module`` under the hand-written plans and model edits of
   ``bench/tp_dtensor.py``: collectives and bytes per training step, all counted by one dispatch-level counter
   (and autoshard's analytic count), median step time taking turns step by step, parameter bytes per rank,
   and the loss and gradients against the unsharded model.
2. ``bench/compile_tp.py``: capture + ``plan_tensor_parallel`` + ``codegen.build`` of Llama-shaped models up to
   70B on the ``meta`` device at tp=8, without processes, each shape in a fresh process.
"""

from __future__ import annotations

import argparse
import time

import compile_tp
import report
import tp_launch
from common import BENCH

LABELS = {"autoshard": "autoshard (model unmodified)", "dtensor": "DTensor parallelize_module",
          "dtensor_shared": "DTensor + PrepareModuleInput", "eager": "unsharded model (each rank)"}
MODEL_TITLES = {"gpt": "nanoGPT-style GPT (fused qkv, tied embedding / LM head)",
                "llama": "Llama-style decoder (separate q/k/v, grouped-query attention, SwiGLU, untied LM head)"}


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def _calls(phase: dict | None) -> str:
    if not phase:
        return "0"
    return ", ".join(f"{c} {kind.replace('_', '-')}" for kind, c in phase["counts"].items())


def collective_rows(r: dict) -> list[list[str]]:
    rows = []
    for name in ("autoshard", "dtensor", "dtensor_shared"):
        c = r["collectives"][name]
        phases = c["phases"]
        check = ""
        if name == "autoshard":
            a = r["autoshard_analytic"]
            check = f"analytic: {a['calls']} calls, {_mib(a['bytes'])} MiB"
        elif name == "dtensor":
            d = r["dtensor_comm_debug_mode"]
            check = f"CommDebugMode: {d['total']} calls, {_mib(d['total_bytes'])} MiB"
        rows.append([LABELS[name], _calls(phases.get("forward")), _calls(phases.get("backward")),
                     _calls(phases.get("optimizer")), str(c["total"]), _mib(c["total_bytes"]),
                     _mib(c["ring_bytes_sent_per_rank"]), check])
    return rows


COLLECTIVE_HEADER = ["runner", "forward (with loss)", "backward", "optimizer step", "calls per step",
                     "MiB per step", "ring MiB sent per rank", "cross-check"]


def step_rows(r: dict) -> list[list[str]]:
    ms = {name: s["median_ms"] for name, s in r["step_ms"].items()}
    full = r["param_bytes_full"]
    rows = []
    for name in ("autoshard", "dtensor", "dtensor_shared", "eager"):
        s = r["step_ms"][name]
        per_rank = r["param_bytes_per_rank"][name]
        exact = r["exact"].get(name)
        diffs = f"{exact['loss_diff']:.1e} / {exact['grad_max_diff']:.1e}" if exact else "reference"
        rows.append([LABELS[name], f"{s['median_ms']:.1f}", f"{s['p10_ms']:.1f}–{s['p90_ms']:.1f}",
                     f"{ms[name] / ms['dtensor']:.2f}x", f"{ms[name] / ms['eager']:.2f}x",
                     " / ".join(_mib(b) for b in per_rank), f"{max(per_rank) / full:.3f}", diffs])
    return rows


STEP_HEADER = ["runner", "median step ms", "p10–p90 ms", "time / DTensor", "time / unsharded",
               "parameter MiB per rank (rank 0 / 1)", "share of full", "loss / grad max diff vs unsharded"]


def model_section(r: dict, others: float | None) -> str:
    shape = r["shape"]
    ffn = shape["gpt_ffn"] if r["model"] == "gpt" else shape["llama_ffn"]
    kv = f", {shape['n_kv_head']} kv heads" if r["model"] == "llama" else ""
    lines = [
        f"### {MODEL_TITLES[r['model']]}",
        "",
        f"{shape['n_layer']} layers, hidden {shape['n_embd']}, {shape['n_head']} heads{kv}, ffn {ffn}, vocab "
        f"{shape['vocab']}, sequence {shape['seq']}, batch {shape['batch']} (the same batch on both tp ranks); fp32, "
        f"AdamW; tp={r['tp']}, {r['threads']} thread per rank.",
        "",
        "Collectives per training step (rank 0; both ranks issue the same):",
        "",
        report.table(COLLECTIVE_HEADER, collective_rows(r), align="lllrrrrl"),
        "",
        "Step time and memory:",
        "",
        report.table(STEP_HEADER, step_rows(r), align="lrrrrrrr"),
        "",
        "Edits DTensor's plan needs in the model (autoshard needs none): " + "; ".join(r["model_edits"]) + ".",
    ]
    lines += tp_launch.disturbed_note(f"the tp=2 job of {r['model']}", others)
    return "\n".join(lines)


NOTES = [
    "- Counting: every runner's step runs once inside one `TorchDispatchMode` (`CollectiveCounter` in "
    "bench/tp_worker.py) that counts the c10d collectives autoshard calls (`dist.all_reduce`) and the functional "
    "collectives DTensor lowers to, in the forward, in the backward (a collective issued while the autograd "
    "engine runs a graph task) and in the optimizer step; *MiB per step* adds the whole tensor of each "
    "collective (the reduced tensor of an all-reduce). *ring MiB sent per rank* is what a ring algorithm sends "
    "for them (2 (n-1)/n of an all-reduce: at n=2 the same number). For DTensor the count equals PyTorch's "
    "`CommDebugMode` (cross-check column). `CommDebugMode` is not used on autoshard: a root module called twice "
    "inside it (autoshard calls its graph modules once per microbatch and for the token count) leaves a forward "
    "hook behind (torch 2.13 keys the hook handles by module name), and the next call of that module after the "
    "mode exits raises `IndexError` in `_fw_set_module_hook`.",
    "- *analytic* is `autoshard.explain.communication(gm)` of this rank's training graph module: the calls each "
    "inserted collective module makes (the vocab-parallel cross-entropy makes 2 all-reduces: the row max, then "
    "the stacked sums) and their bytes, to compare with the measured ones.",
    "- Step: `zero_grad`, forward with loss, backward, AdamW step; the four runners take turns step by step in "
    "rotating order, each step between two barriers, timed on rank 0. 2 ranks on this machine's 2 cores: no "
    "oversubscription, but the unsharded model runs on both ranks at once in its turn.",
    "- *share of full*: the largest rank's parameter bytes over the unsharded model's (a tied weight counted "
    "once); norms and the biases of row-parallel linears are replicated.",
]


def tp_section(job: dict) -> str:
    if "error" in job:
        return f"## Tensor parallelism at tp=2: autoshard vs DTensor\n\nThe tp=2 job failed: {job['error']}"
    body = [model_section(r, job.get("others_share")) for r in job["result"]]
    return "\n\n".join(["## Tensor parallelism at tp=2: autoshard vs DTensor", *body, "\n".join(NOTES)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt,llama")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per runner")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true", help="skip the compile-time table")
    parser.add_argument("--output", default=str(BENCH / "results_tp.md"))
    tp_launch.add_arguments(parser)
    args = parser.parse_args()
    started = time.perf_counter()
    opts = tp_launch.from_args(args)
    argv = tp_launch.torchrun(2, "tp_worker.py", "--models", args.models, "--steps", str(args.steps),
                              "--warmup", str(args.warmup))
    job = tp_launch.run_json("tp=2 autoshard vs DTensor", argv, opts,
                             env={"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})
    sections = [tp_section(job)]
    if not args.no_compile:
        sections.append(compile_tp.section(compile_tp.compile_results(opts), compile_tp.TP))
    head = "\n".join(tp_launch.header("autoshard tensor-parallel benchmarks", started))
    text = "\n\n".join([head, *sections]) + "\n"
    with open(args.output, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
