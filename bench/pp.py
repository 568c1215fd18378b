"""Pipeline benchmark: autoshard against ``torch.distributed.pipelining`` on the zoo GPT, and the partitioner's balance.

    .venv/bin/python bench/pp.py            # writes bench/results_pp.md and prints it

1. ``torchrun --standalone --nproc-per-node p`` jobs (``bench/pp_worker.py``, one thread per rank) for p = 2 and
   4 train the 8-layer zoo GPT of ``tests/harness/models.py`` with GPipe, 1F1B and interleaved 1F1B (v=2), each with
   autoshard (the model unmodified, cut by its own partitioner) and with ``torch.distributed.pipelining``
   (``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B``, stages written by
   hand on the same layers), with the same schedule and microbatches: median step time, autoshard's measured
   bubble (from its executor's records) and the bytes saved for backward at their peak (saved-tensor hooks).
2. A third job, with a larger vocabulary (so the LM head is worth several layers), times autoshard's balanced
   partition against equal layers per stage.
3. The balance (largest stage cost over the mean, from autoshard's cost model) of autoshard's partition against
   an equal number of layers per stage, computed in this process (``passes.partition``, no processes).
"""

from __future__ import annotations

import argparse
import time

import report
import tp_launch
from common import BENCH

LAYERS, BATCH, MICROBATCHES = 8, 16, 8
JOBS = {  # name: (processes, worker arguments)
    "pp=2": (2, ["--schedules", "gpipe,1f1b,interleaved", "--vocab", "256"]),
    "pp=4": (4, ["--schedules", "gpipe,1f1b,interleaved", "--vocab", "256"]),
    "pp=2 vocab 4096": (2, ["--schedules", "1f1b", "--vocab", "4096", "--equal-too"]),
}
BIG = "pp=2 vocab 4096"
BALANCE_VOCABS = (256, 4096, 32768)
BALANCE_STAGES = ((2, 1), (4, 1), (2, 2), (4, 2))  # (p, v)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _ms(stats: dict) -> str:
    return f"{stats['median_ms']:.0f} ({stats['p10_ms']:.0f}–{stats['p90_ms']:.0f})"


def step_rows(jobs: dict[str, dict]) -> list[list[str]]:
    rows = []
    for name, job in jobs.items():
        if "result" not in job:
            continue
        for run in job["result"]["runs"]:
            ms = run["step_ms"]
            label = f"{run['schedule']}" + (f", v={run['v']}" if run["v"] > 1 else "")
            ratio = ms["autoshard"]["median_ms"] / ms["torch"]["median_ms"]
            rows.append([name, label, str(run["m"]), f"{run['split']} ({run['split_source']})", _ms(ms["autoshard"]),
                         _ms(ms["torch"]), f"**{ratio:.2f}x**"])
    return rows


STEP_HEADER = ["job", "schedule", "m", "layers per stage (from)", "autoshard ms (p10–p90)",
               "torch.distributed.pipelining ms (p10–p90)", "autoshard / torch"]


def bubble_rows(jobs: dict[str, dict]) -> list[list[str]]:
    rows = []
    for name, job in jobs.items():
        if "result" not in job or name == BIG:
            continue
        for run in job["result"]["runs"]:
            meas = run["measured"]
            formula = "(p-1)/(v·m+p-1)" if run["v"] > 1 else "(p-1)/(m+p-1)"
            rows.append([name, run["schedule"] + (f", v={run['v']}" if run["v"] > 1 else ""), str(run["m"]),
                         f"{_pct(run['formula_bubble'])} = {formula}", _pct(run["simulated_bubble"]),
                         f"**{_pct(meas['bubble'])}**", " / ".join(_pct(b) for b in meas["per_rank"]),
                         _pct(meas["receive_wait"]), f"{meas['forward_ms']:.1f} / {meas['backward_ms']:.1f}"])
    return rows


BUBBLE_HEADER = ["job", "schedule", "m", "formula", "simulated (F=1, B=2)", "measured", "measured per rank",
                 "of which waiting in receives", "median F / B ms per chunk"]


def _expected_in_flight(run: dict) -> str:
    p, m = run["p"], run["m"]
    if run["schedule"] == "gpipe":
        return f"m = {m} on every rank"
    if run["schedule"] == "1f1b":
        return f"≤ p = {p} (p - r on rank r)"
    return "schedule's own count"


def memory_rows(jobs: dict[str, dict]) -> list[list[str]]:
    rows = []
    for name, job in jobs.items():
        if "result" not in job or name == BIG:
            continue
        for run in job["result"]["runs"]:
            saved = run["saved"]

            def cell(runner: str, saved=saved) -> str:
                return " / ".join(f"{s['peak_bytes'] / 2**20:.1f} ({s['in_flight']:.2f})" for s in saved[runner])

            rows.append([name, run["schedule"] + (f", v={run['v']}" if run["v"] > 1 else ""), str(run["m"]),
                         f"{saved['autoshard'][0]['per_microbatch_bytes'] / 2**20:.2f}", cell("autoshard"),
                         cell("torch"), " / ".join(f"{x:g}" for x in run["simulated_in_flight"]),
                         _expected_in_flight(run)])
    return rows


MEMORY_HEADER = ["job", "schedule", "m", "saved MiB per microbatch (rank 0)",
                 "autoshard peak MiB (microbatches in flight), rank 0 / 1 / …",
                 "torch peak MiB (microbatches in flight)", "schedule's count per rank (simulate)", "bound"]


def balance_rows() -> list[list[str]]:
    """autoshard's partition against equal layers per stage, by the cost model, for several vocabulary sizes."""
    import torch
    from pp_worker import build_case, describe, describe_cuts, equal_split, layer_split

    import autoshard
    from autoshard import codegen
    from autoshard.passes.partition import partition

    from harness.models import token_loss

    rows = []
    for vocab in BALANCE_VOCABS:
        model, tokens, target = build_case(LAYERS, BATCH // MICROBATCHES, vocab)
        with torch.no_grad():
            gm = codegen.prepare(autoshard.capture(model, (tokens,), loss_fn=token_loss, example_target=target))
        for p, v in BALANCE_STAGES:
            stages = p * v
            own = partition(gm, stages)
            equal = equal_split(LAYERS, stages)
            even = partition(gm, stages, starts=[f"model.transformer.h.{r.start}" for r in equal[1:]])
            split = layer_split(gm, own.stage_of, LAYERS, stages)
            where = describe(split) if split else describe_cuts(gm, own.cut_after)
            rows.append([str(vocab), f"{p} x {v} = {stages}", where, f"**{own.balance:.3f}**", f"{even.balance:.3f}",
                         " / ".join(f"{c / 1e6:.0f}" for c in own.costs),
                         " / ".join(f"{b / 2**10:.0f}" for b in own.crossing_bytes)])
    return rows


BALANCE_HEADER = ["vocab", "stages (p x v)", "autoshard's stages", "balance, autoshard", "balance, equal layers",
                  "autoshard stage costs (M)", "KiB sent across each cut per microbatch"]


def partition_rows(job: dict) -> list[list[str]]:
    if "result" not in job:
        return []
    rows = []
    for run in job["result"]["runs"]:
        ms = run["step_ms"]
        base = ms["autoshard"]["median_ms"]
        labels = {
            "autoshard": f"autoshard, equal layers: {run['split']}",
            "autoshard_own": f"autoshard, own partition: cuts {run['own_partition']}",
            "torch": f"torch.distributed.pipelining, equal layers: {run['split']}",
        }
        balance = {"autoshard": run["split_balance"], "autoshard_own": run["balance"], "torch": run["split_balance"]}
        measured = run["measured_by_runner"]
        for name in ("autoshard", "autoshard_own", "torch"):
            if name not in ms:
                continue
            busy = measured.get(name)
            real = (f"{busy['stage_balance']:.3f} ({' / '.join(f'{b:.0f}' for b in busy['stage_busy_ms'])})"
                    if busy else "")
            rows.append([labels[name], f"{balance[name]:.3f}", real, run["schedule"], str(run["m"]), _ms(ms[name]),
                         f"**{ms[name]['median_ms'] / base:.2f}x**"])
    return rows


PARTITION_HEADER = ["runner (stages)", "balance (cost model)", "measured balance (stage F+B ms per step)",
                    "schedule", "m", "median ms (p10–p90)", "time / autoshard on equal layers"]


NOTES = [
    "- Split: autoshard partitions the captured graph itself (`parallelize(model, Mesh(pp=p), schedule=..., "
    "chunks=v)`, no cut points given); its cuts are mapped to the model's layers (every block lies in one stage) "
    "and torch's stages (`GPTStage` in bench/pp_worker.py: embeddings on the first stage, final norm and LM head "
    "on the last) hold the same layers. For this GPT (vocab 256) autoshard's partition is equal layers per stage "
    "at every (p, v) measured. Stage s runs on rank s mod p in both.",
    "- Same work per step: global batch 16 (sequence 64) in m microbatches, AdamW, `zero_grad` to `optimizer.step()`"
    " between barriers, timed on rank 0. torch's manual stages leave the tied embedding / LM-head weight as two "
    "copies: the worker all-reduces its gradient between the first and last stage's ranks after each step, as "
    "autoshard does. The losses differ only in normalisation (torch: each microbatch's mean, divided by m; "
    "autoshard: the global count of non-ignored tokens).",
    "- *measured bubble*: from autoshard's executor records of every timed step on every rank: the step's span is "
    "from the first action's start to the last action's end on any rank; a rank's bubble is 1 - (time in F and B) "
    "/ span; *measured* is the mean over ranks (the same definition as the simulator's 1 - compute / (p · "
    "makespan)), median over steps. Sends, receives and the executor's own work between actions count as bubble; "
    "*of which waiting in receives* is the share of p · span spent in blocking receives. The simulated column is "
    "`autoshard.schedules.simulate` of the same action lists with unit costs.",
    "- *peak MiB*: one extra (untimed) step per runner under `torch.autograd.graph.saved_tensors_hooks` that keep "
    "a running sum of the bytes of tensors saved for backward (each storage once, parameters excluded; a stage's "
    "received activation counts when an op saves it), released when autograd frees them; the peak per rank. "
    "*microbatches in flight* = peak / (bytes saved in the step / m): for interleaved 1F1B that is in units of "
    "the rank's two chunks together, the simulator's stage-equivalents.",
    "- Every rank runs one thread. pp=2 runs 2 ranks on this machine's 2 cores. **pp=4 runs 4 ranks on 2 cores "
    "(oversubscribed 2x)**: its times, and its measured bubble (time a rank spends descheduled inside F or B counts "
    "as busy), are not those of 4 devices.",
]


def sections(jobs: dict[str, dict]) -> list[str]:
    out = [
        "## Pipeline parallelism: autoshard vs torch.distributed.pipelining",
        f"nanoGPT-style GPT of tests/harness/models.py: {LAYERS} layers, hidden 128, 4 heads, vocab 256, sequence 64, "
        f"global batch {BATCH}, {MICROBATCHES} microbatches; fp32, AdamW.",
        "### Step time (same split, schedule and m)\n\n" + report.table(STEP_HEADER, step_rows(jobs), "lllllll"),
        "### Bubble: measured against the formulas\n\n" + report.table(BUBBLE_HEADER, bubble_rows(jobs), "lllrrrrrr"),
        "### Activations in flight: bytes saved for backward at the peak, per rank\n\n"
        + report.table(MEMORY_HEADER, memory_rows(jobs), "lllrllll"),
        "### Stage balance: autoshard's partition against equal layers per stage\n\n"
        "Largest stage cost over the mean (1.000 is perfect), from autoshard's cost model (training FLOPs plus 3 per "
        "parameter byte) on the same GPT with three vocabulary sizes (the LM head and the loss grow with it), "
        f"captured at the microbatch shape ({BATCH // MICROBATCHES} x 64); no processes.\n\n"
        + report.table(BALANCE_HEADER, balance_rows(), "llllrrl"),
    ]
    big = jobs.get(BIG, {})
    if "result" in big:
        out.append("### Does the better balance pay? The same GPT with vocab 4096 at pp=2\n\n"
                   + report.table(PARTITION_HEADER, partition_rows(big), "lrrlrrr"))
    notes = list(NOTES)
    for name, job in jobs.items():
        if "error" in job:
            notes.append(f"- The job {name} failed: {job['error']}")
        notes += tp_launch.disturbed_note(f"the job {name}", job.get("others_share"))
    return [*out, "\n".join(notes)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per runner")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--jobs", default=",".join(JOBS), help=f"the jobs to run, comma-separated, of {list(JOBS)}")
    parser.add_argument("--output", default=str(BENCH / "results_pp.md"))
    tp_launch.add_arguments(parser)
    args = parser.parse_args()
    started = time.perf_counter()
    opts = tp_launch.from_args(args)
    wanted = args.jobs.split(",")
    jobs = {}
    for name in wanted:
        nproc, extra = JOBS[name]
        argv = tp_launch.torchrun(nproc, "pp_worker.py", "--layers", str(LAYERS), "--batch", str(BATCH),
                                  "--microbatches", str(MICROBATCHES), "--warmup", str(args.warmup), "--steps",
                                  str(args.steps), *extra)
        jobs[name] = tp_launch.run_json(name, argv, opts, env={"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})
    body = sections(jobs)
    head = "\n".join(tp_launch.header("autoshard pipeline-parallel benchmarks", started))
    text = "\n\n".join([head, *body]) + "\n"
    with open(args.output, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
