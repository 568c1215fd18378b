"""Zero-bubble pipeline schedules side by side: autoshard's and PyTorch's, on an unmodified HF Llama at pp=2.

    .venv/bin/python bench/zb.py            # writes bench/results_zb.md and prints it

One ``torchrun --standalone --nproc-per-node 2`` job per microbatch count (m = 4 and 8; ``bench/zb_worker.py``,
one thread per rank): autoshard's 1F1B, ZB-H1, ZBV and DualPipeV on the unmodified model, and PyTorch's
``Schedule1F1B``, ``ScheduleInterleavedZeroBubble`` (one stage per rank: ZB-H1), ``ScheduleZBVZeroBubble`` and
``ScheduleDualPipeV`` on hand-written stages of the same layers, taking turns step by step. Reported: median step
time, each against autoshard's 1F1B and against PyTorch's best; autoshard's idle fraction per rank measured from
its executor's records against the schedule simulated with the measured F, I and W costs; the bytes saved for
backward at their peak per rank.
"""

from __future__ import annotations

import argparse
import time

import tp_launch
from common import BENCH

MICROBATCHES = (4, 8)
NAMES = {"1f1b": "1F1B", "zb-h1": "ZB-H1", "zbv": "ZBV", "dualpipev": "DualPipeV"}


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f}"


def table(m: int, job: dict) -> list[str]:
    if "error" in job:
        return [f"## m={m}", "", f"did not run: {job['error']}"]
    result = job["result"]
    ms = {name: stats["median_ms"] for name, stats in result["step_ms"].items()}
    own = ms["autoshard 1f1b"]
    best_torch = min(v for k, v in ms.items() if k.startswith("torch"))
    losses = set(round(v, 5) for v in result["first_loss"].values())
    rows = ["| runner | median step ms | p10–p90 ms | vs autoshard 1F1B | vs PyTorch's best | idle per rank, measured "
            "| idle, simulated with measured costs | F / I / W (or B) ms | saved-for-backward peak MiB per rank |",
            "| --- | ---: | ---: | ---: | ---: | --- | ---: | --- | --- |"]
    for name, stats in result["step_ms"].items():
        who, schedule = name.split()
        got = result["measured"].get(name)
        idle = " / ".join(f"{x:.0%}" for x in got["idle_per_rank"]) if got else ""
        sim = f"{got['simulated_idle']:.0%}" if got else ""
        costs = " / ".join(f"{got['compute_ms'][k]:.0f}" for k in "FIWB" if k in got["compute_ms"]) if got else ""
        peak = " / ".join(_mib(b) for b in result["saved_peak_bytes"][name])
        label = f"{'autoshard' if who == 'autoshard' else 'PyTorch'} {NAMES[schedule]}"
        rows.append(f"| {label} | **{stats['median_ms']:.0f}** | {stats['p10_ms']:.0f}–{stats['p90_ms']:.0f} | "
                    f"{stats['median_ms'] / own:.2f}x | {stats['median_ms'] / best_torch:.2f}x | {idle} | {sim} | "
                    f"{costs} | {peak} |")
    splits = "; ".join(f"{NAMES[s]}: layers {x}" for s, x in result["splits"].items())
    shape = result["shape"]
    return [f"## pp=2, m={m}", "",
            f"HF Llama: {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
            f"{shape['num_attention_heads']} heads, MLP {shape['intermediate_size']}, vocab {shape['vocab_size']}, "
            f"sequence {result['seq']}, global batch {result['batch']}; fp32, AdamW. Stages ({splits}). "
            f"First-step losses of all runners: {', '.join(map(str, sorted(losses)))}.", "",
            *rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per runner")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--output", default=str(BENCH / "results_zb.md"))
    tp_launch.add_arguments(parser, job_timeout=1200)
    parser.set_defaults(quiet_wait=10, retries=0)
    args = parser.parse_args()
    started = time.perf_counter()
    opts = tp_launch.from_args(args)
    env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    jobs = {m: tp_launch.run_json(f"m={m}", tp_launch.torchrun(2, "zb_worker.py", "--microbatches", str(m),
                                                                 "--warmup", str(args.warmup), "--steps",
                                                                 str(args.steps)), opts, env=env)
            for m in MICROBATCHES}
    head = "\n".join(tp_launch.header("autoshard and PyTorch pipeline schedules on an HF Llama", started))
    notes = [note for m, job in jobs.items() for note in tp_launch.disturbed_note(f"m={m}", job.get("others_share"))]
    parts = [head + ("\n" + "\n".join(notes) if notes else "")] + ["\n".join(table(m, job)) for m, job in jobs.items()]
    text = "\n\n".join(parts) + "\n"
    with open(args.output, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
