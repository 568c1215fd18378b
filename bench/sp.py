"""Sequence parallelism against plain tensor parallelism on an unmodified HF Llama at tp=2.

    .venv/bin/python bench/sp.py            # writes bench/results_sp.md and prints it

One ``torchrun --standalone --nproc-per-node 2`` job (``bench/sp_worker.py``, one thread per rank): autoshard's
tp=2 with ``sequence_parallel`` off and on, and PyTorch's DTensor TP + ``SequenceParallel`` (torchtitan's plan,
``bench/sp_dtensor.py``), at sequence 1024, batch 1. Reported: the median step time, the bytes
saved for backward at their peak per rank, and the analytic estimate of Korthikanti et al. ("Reducing Activation
Recomputation in Large Transformer Models") per layer: TP ``s*b*h*(10 + 24/t + 5*a*s/(h*t))`` bytes in 16-bit,
TP+SP ``s*b*h/t*(34 + 5*a*s/h)``; here fp32 (twice the bytes) and attention that stores no scores (the fused
kernel keeps its log-sum-exp: the ``5*a*s/h`` terms drop), so TP+SP / TP = 34/t / (10 + 24/t), 0.77 at t=2.
"""

from __future__ import annotations

import argparse
import time

import tp_launch
from common import BENCH


def table(job: dict) -> list[str]:
    if "error" in job:
        return [f"did not run: {job['error']}"]
    result = job["result"]
    t, s, shape = result["world"], result["seq"], result["shape"]
    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    analytic = {"tp": 2 * s * h * (10 + 24 / t) * layers, "tp+sp": 2 * s * h / t * 34 * layers}
    analytic["dtensor tp+sp"] = analytic["tp+sp"]
    ms = {n: v["median_ms"] for n, v in result["step_ms"].items()}
    peaks = result["saved_peak_bytes"]
    rows = ["| run | median step ms | p10–p90 ms | vs plain TP | saved-for-backward peak MiB per rank | vs plain TP "
            "(rank 0) | Korthikanti et al., fp32, no scores, layers only (MiB) |",
            "| --- | ---: | ---: | ---: | --- | ---: | ---: |"]
    for name, stats in result["step_ms"].items():
        label = {"tp": "autoshard tp=2", "tp+sp": "autoshard tp=2, sequence_parallel=True",
                 "dtensor tp+sp": "DTensor TP + SequenceParallel (torchtitan's plan)"}[name]
        rows.append(f"| {label} | **{stats['median_ms']:.0f}** | {stats['p10_ms']:.0f}–{stats['p90_ms']:.0f} | "
                    f"{ms[name] / ms['tp']:.2f}x | {' / '.join(f'{b / 2**20:.1f}' for b in peaks[name])} | "
                    f"{peaks[name][0] / peaks['tp'][0]:.2f}x | {analytic[name] / 2**20:.1f} |")
    losses = ", ".join(f"{n} {v:.6f}" for n, v in result["first_loss"].items())
    return [f"## HF Llama: {layers} layers, hidden {h}, {shape['num_attention_heads']} heads, MLP "
            f"{shape['intermediate_size']}, vocab {shape['vocab_size']}; sequence {s}, batch 1, fp32, AdamW", "",
            *rows, "", f"First-step losses: {losses}. The analytic ratio TP+SP / TP: "
            f"{analytic['tp+sp'] / analytic['tp']:.2f}. autoshard with sequence parallelism against DTensor TP + SP: "
            f"{ms['tp+sp'] / ms['dtensor tp+sp']:.2f}x the step time, "
            f"{peaks['tp+sp'][0] / peaks['dtensor tp+sp'][0]:.2f}x the saved bytes."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per runner")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--output", default=str(BENCH / "results_sp.md"))
    tp_launch.add_arguments(parser, job_timeout=1200)
    parser.set_defaults(quiet_wait=10, retries=0)
    args = parser.parse_args()
    started = time.perf_counter()
    opts = tp_launch.from_args(args)
    env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    job = tp_launch.run_json("tp=2", tp_launch.torchrun(2, "sp_worker.py", "--seq", str(args.seq), "--warmup",
                                                        str(args.warmup), "--steps", str(args.steps)), opts, env=env)
    head = "\n".join(tp_launch.header("autoshard sequence parallelism on an HF Llama", started))
    notes = tp_launch.disturbed_note("tp=2", job.get("others_share"))
    text = "\n\n".join([head + ("\n" + "\n".join(notes) if notes else ""), "\n".join(table(job))]) + "\n"
    with open(args.output, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
