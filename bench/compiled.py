"""``compile=True`` against eager, and against DTensor TP under ``torch.compile``, on an unmodified HF Llama.

    .venv/bin/python bench/compiled.py            # writes bench/results_compiled.md and prints it

Two ``torchrun --standalone --nproc-per-node 2`` jobs (``bench/compiled_worker.py``, one thread per rank,
runners taking turns step by step): tp=2 (autoshard eager, autoshard ``compile=True``, DTensor TP compiled) and
pp=2 with 4 microbatches (1F1B and ZBV, each eager and compiled). Reported: the median step after the first, the
first step (compiling, for the compiled runners), the graphs compiled, and the first-step losses (the same model
from the same seed: they agree).
"""

from __future__ import annotations

import argparse
import time

import tp_launch
from common import BENCH


def table(job: dict, against: dict[str, str]) -> list[str]:
    if "error" in job:
        return [f"did not run: {job['error']}"]
    result = job["result"]
    shape, ms = result["shape"], {n: v["median_ms"] for n, v in result["step_ms"].items()}
    rows = ["| runner | median step ms | p10–p90 ms | against | first step s (compiling) | graphs compiled | "
            "first loss |", "| --- | ---: | ---: | --- | ---: | --- | ---: |"]
    for name, stats in result["step_ms"].items():
        ratio = "".join(f"{ms[name] / ms[other]:.2f}x of {other}" for other in [against.get(name)] if other)
        rows.append(f"| {name} | **{stats['median_ms']:.0f}** | {stats['p10_ms']:.0f}–{stats['p90_ms']:.0f} | "
                    f"{ratio} | {result['first_step_s'][name]:.1f} | {result['graphs'].get(name, '')} | "
                    f"{result['first_loss'][name]:.6f} |")
    shares = dict(result["eager_shares"])
    runner = shares.pop("runner")
    bound = 1 - shares["other"]
    rows += ["", f"Where the {runner} step's time goes (rank 0, the profiler's self times): " + ", ".join(
        f"{kind} {share:.0%}" for kind, share in shares.items()) + f". `torch.compile` fuses only the last part, the "
        f"one its kernels replace: a compiled step can reach at best {bound:.2f}x of eager here."]
    return [f"## {result['mesh']}=2: HF Llama, {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
            f"vocab {shape['vocab_size']}; sequence {result['seq']}, batch {result['batch']}, fp32, AdamW", "", *rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per runner")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--output", default=str(BENCH / "results_compiled.md"))
    tp_launch.add_arguments(parser, job_timeout=1800)
    parser.set_defaults(quiet_wait=10, retries=0)
    args = parser.parse_args()
    started = time.perf_counter()
    opts = tp_launch.from_args(args)
    # inductor caches compiled graphs across runs: disabled, so the first step shows what compiling costs
    env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    sections = []
    for mesh, against in (("tp", {"compiled": "eager", "dtensor compiled": "compiled"}),
                          ("pp", {"1f1b compiled": "1f1b eager", "zbv compiled": "zbv eager"})):
        argv = tp_launch.torchrun(2, "compiled_worker.py", "--mesh", mesh, "--seq", str(args.seq), "--warmup",
                                  str(args.warmup), "--steps", str(args.steps))
        job = tp_launch.run_json(f"{mesh}=2", argv, opts, env=env)
        notes = tp_launch.disturbed_note(f"{mesh}=2", job.get("others_share"))
        sections.append("\n".join(table(job, against) + ([""] + notes if notes else [])))
    head = "\n".join(tp_launch.header("autoshard compile=True on an HF Llama", started))
    text = "\n\n".join([head, *sections]) + "\n"
    with open(args.output, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
