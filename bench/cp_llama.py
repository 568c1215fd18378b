"""Context-parallel strategies side by side on an unmodified HF Llama: step time against the unsharded step.

    .venv/bin/python bench/cp_llama.py            # writes bench/results_cp_llama.md and prints it

Two jobs (``bench/cp_llama_worker.py``, one thread per rank, each rank pinned to its own core): the unsharded
step in one plain process, and cp=2 under ``torchrun --standalone`` with autoshard's three strategies
(``cp_attention="gather"``, ``"ring"``, ``"alltoall"``, load-balanced layout) and PyTorch's own
``context_parallel`` on the same model where it runs. The model builds its causal mask itself (HF's ``sdpa``
path hands attention an explicit boolean mask, not ``is_causal``), as users' models do.
"""

from __future__ import annotations

import argparse
import sys
import time

import tp_launch
from common import BENCH

STRATEGIES = ("gather", "ring", "alltoall", "torch")
NAMES = {"gather": "autoshard, gathered keys and values", "ring": "autoshard, ring (fused kernel per block)",
         "alltoall": "autoshard, all-to-all (Ulysses)", "torch": "PyTorch context_parallel (DTensor ring)"}


def _argv(c: int, args) -> list[str]:
    worker = ["--seq", str(args.seq), "--warmup", str(args.warmup), "--steps", str(args.steps)]
    if c == 1:
        return [sys.executable, str(BENCH / "cp_llama_worker.py"), *worker]
    return tp_launch.torchrun(c, "cp_llama_worker.py", *worker, "--strategies", ",".join(STRATEGIES), "--pin")


def table(jobs: dict, seq: int) -> list[str]:
    base = jobs[1].get("result", {}).get("strategies", {}).get("none", {}).get("step_ms", {}).get("median_ms")
    found = jobs[2].get("result", {}).get("strategies", {})
    gather = found.get("gather", {}).get("step_ms", {}).get("median_ms")
    rows = ["| run | median step ms | p10–p90 ms | vs unsharded | vs gather | loss diff vs unsharded |",
            "| --- | ---: | ---: | ---: | ---: | ---: |"]
    if base is not None:
        rows.append(f"| unsharded (cp=1) | **{base:.0f}** | | 1.00x | | |")
    for strategy in STRATEGIES:
        got = found.get(strategy)
        if got is None:
            continue
        if "error" in got:
            rows.append(f"| cp=2, {NAMES[strategy]} | does not run: {got['error']} | | | | |")
            continue
        ms = got["step_ms"]
        vs = f"{ms['median_ms'] / base:.2f}x" if base else ""
        vg = f"{ms['median_ms'] / gather:.2f}x" if gather else ""
        rows.append(f"| cp=2, {NAMES[strategy]} | **{ms['median_ms']:.0f}** | {ms['p10_ms']:.0f}–{ms['p90_ms']:.0f} | "
                    f"{vs} | {vg} | {got['loss_diff']:.1e} |")
    errors = [f"- cp={c}: {job['error']}" for c, job in jobs.items() if "error" in job]
    return [f"## HF Llama (hidden 256, 4 layers, 4 heads, vocab 2048), sequence {seq}, batch 1, one thread per rank",
            "", *rows, *([""] + errors if errors else [])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--output", default=str(BENCH / "results_cp_llama.md"))
    tp_launch.add_arguments(parser, job_timeout=900)
    parser.set_defaults(quiet_wait=10, retries=0)
    args = parser.parse_args()
    started = time.perf_counter()
    opts = tp_launch.from_args(args)
    env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    jobs = {c: tp_launch.run_json(f"cp={c}", _argv(c, args), opts, env=env) for c in (1, 2)}
    head = "\n".join(tp_launch.header("autoshard context-parallel strategies on an HF Llama", started))
    notes = [note for c, job in jobs.items() for note in tp_launch.disturbed_note(f"cp={c}", job.get("others_share"))]
    text = "\n\n".join([head + ("\n" + "\n".join(notes) if notes else ""), "\n".join(table(jobs, args.seq))]) + "\n"
    with open(args.output, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
