"""autoshard benchmarks: training step time per configuration, and compile time as the model grows.

    .venv/bin/python bench/run.py            # or: make bench

1. Step time. The benchmark GPT (``bench/common.py``) trains with AdamW under every configuration
   autoshard supports today: the unsharded eager model in one process (the baseline), ``Mesh()`` on one
   rank, and data parallelism dp=2 and dp=4 with 1 and 2 microbatches per rank, each dp job launched
   with ``torchrun --standalone`` and timed side by side with PyTorch's DistributedDataParallel wrapped
   by hand around the eager model (``bench/step_time.py`` is the per-rank worker).
2. Compile time. ``autoshard.capture`` of Llama-style shapes up to Llama-2-70B on the ``meta`` device,
   each in a fresh process, with its peak RSS (``bench/compile_time.py``).

Writes ``bench/results_run.md`` (gathered into bench/results.md by bench/collect.py) and prints the same
tables. On a shared machine other processes' work would be timed too: before each measurement the runner waits
(up to ``--quiet-wait`` seconds) for the cores to go idle, repeats a measurement during which other processes
took a noticeable share of the CPU (within the first ``--patience`` seconds of the run), and notes in the
results any that stayed disturbed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import report
from common import BENCH, GPT_SHAPE, REPO, children_cpu_seconds, cpu_seconds, others_share, wait_until_quiet


@dataclass(frozen=True)
class StepJob:
    """One launch of the step-time worker: ``nproc`` 0 is a plain process, otherwise torchrun."""

    nproc: int
    microbatches: int
    runners: tuple[str, ...]
    threads: int = 1


# Llama-style shapes for the compile-time table: Llama-2-7B and -70B are the published shapes.
COMPILE_SHAPES = {
    "small": dict(layers=4, hidden=512, heads=8, kv_heads=4, ffn=1408, vocab=32000, seq=512, batch=1),
    "medium": dict(layers=16, hidden=2048, heads=16, kv_heads=16, ffn=5504, vocab=32000, seq=2048, batch=1),
    "Llama-2-7B": dict(layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000, seq=2048, batch=1),
    "Llama-2-70B": dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000, seq=2048, batch=1),
}


# Before each step-time job, wait for other processes to use less than BUSY of the machine's cores; a job
# during which they used more than OTHERS_NOTED of its CPU time gets a note in the results.
BUSY = 0.25
OTHERS_NOTED = 0.10


def step_jobs(max_dp: int) -> list[StepJob]:
    jobs = [StepJob(0, 1, ("eager", "autoshard")), StepJob(0, 1, ("eager",), threads=os.cpu_count() or 1)]
    for dp in (2, 4):
        if dp <= max_dp:
            jobs += [StepJob(dp, mb, ("autoshard", "ddp")) for mb in (1, 2)]
    return jobs


def _command(job: StepJob, out: Path, args: argparse.Namespace) -> list[str]:
    worker = [str(BENCH / "step_time.py"), "--runners", ",".join(job.runners), "--microbatches",
              str(job.microbatches), "--threads", str(job.threads), "--warmup", str(args.warmup),
              "--steps", str(args.steps), "--out", str(out)]
    if job.nproc == 0:
        return [sys.executable, *worker]
    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return [*launcher, "--standalone", "--nproc-per-node", str(job.nproc), *worker, "--pin"]


def launch(name: str, argv: list[str], env: dict, args: argparse.Namespace) -> tuple[str | None, float | None]:
    """Run ``argv`` once other processes are quiet; (error or None, share of the CPU other processes took)."""
    wait = min(args.quiet_wait, args.deadline - time.monotonic())
    if wait > 0 and (busy := wait_until_quiet(BUSY, wait)) is not None and busy > BUSY:
        print(f"  other processes keep {busy:.0%} of the CPU busy; starting anyway", flush=True)
    env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCH), os.environ.get("PYTHONPATH")]))}
    start, machine_before, own_before = time.perf_counter(), cpu_seconds(), children_cpu_seconds()
    try:
        proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.job_timeout)
    except subprocess.TimeoutExpired:
        return f"timed out after {args.job_timeout} s", None
    others = others_share(machine_before, cpu_seconds(), children_cpu_seconds() - own_before)
    print(f"  {name}: {time.perf_counter() - start:.1f} s"
          + (f" (other processes took {others:.0%} of the CPU)" if others is not None else ""), flush=True)
    if proc.returncode != 0:
        return f"exit status {proc.returncode}: {(proc.stdout + proc.stderr)[-3000:]}", others
    return None, others


def least_disturbed(measure, args: argparse.Namespace) -> dict:
    """``measure()`` again (up to ``--retries`` times, until ``--patience`` is used up) while other processes
    took a noticeable share of the CPU during it; the result least disturbed by them."""
    results = [measure()]
    while (len(results) <= args.retries and time.monotonic() < args.deadline
           and (results[-1].get("others_share") or 0) > OTHERS_NOTED):
        print("    repeating it: other processes were running", flush=True)
        results.append(measure())
    return min(results, key=lambda r: ("error" in r, r.get("others_share") or 0))


def run_step_job(job: StepJob, workdir: Path, args: argparse.Namespace) -> dict:
    """One step-time job: its JSON result with ``others_share``, or ``{"error": ...}``."""
    out = workdir / f"steps-{job.nproc}-{job.microbatches}-{'-'.join(job.runners)}-{job.threads}.json"
    out.unlink(missing_ok=True)
    env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": str(job.threads)}
    error, others = launch(_job_name(job), _command(job, out, args), env, args)
    if error is not None or not out.exists():
        return {"error": error or "no result written", "others_share": others}
    return {**json.loads(out.read_text()), "others_share": others}


def _job_name(job: StepJob) -> str:
    return (f"{' + '.join(job.runners)} on {max(job.nproc, 1)} process(es) × {job.threads} thread(s), "
            f"{job.microbatches} microbatch(es)")


def step_rows(results: list[tuple[StepJob, dict]]) -> tuple[list[list[str]], list[str]]:
    """Rows of the step-time table, and the errors of failed jobs."""
    baselines = [r["runners"]["eager"]["median_ms"] for job, r in results
                 if "runners" in r and "eager" in r["runners"] and job.threads == 1]
    baseline_ms = baselines[0] if baselines else float("nan")
    labels = {"eager": "eager model, no autoshard", "autoshard": "autoshard", "ddp": "DDP by hand"}
    rows, errors = [], []
    for job, result in results:
        if "error" in result:
            errors.append(f"{_job_name(job)}: {result['error']}")
            continue
        runners = result["runners"]
        for name in job.runners:
            mesh = f"dp={job.nproc}" if job.nproc else ("Mesh()" if name == "autoshard" else "one process")
            versus = None
            if name == "autoshard" and "ddp" in runners:
                versus = runners["autoshard"]["median_ms"] / runners["ddp"]["median_ms"]
            layout = f"{max(job.nproc, 1)} × {result['threads']}"
            rows.append(report.step_row(f"{labels[name]}, {mesh}", layout, job.microbatches, runners[name],
                                        GPT_SHAPE.batch, baseline_ms, versus))
    return rows, errors


def run_compile_shape(name: str, shape: dict, workdir: Path, args: argparse.Namespace) -> dict:
    """Capture one shape in a fresh process: its JSON result with ``others_share``, or ``{"error": ...}``."""
    out = workdir / f"compile-{shape['layers']}-{shape['hidden']}.json"
    argv = [sys.executable, str(BENCH / "compile_time.py"), "--out", str(out)]
    for key, value in shape.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    out.unlink(missing_ok=True)
    error, others = launch(name, argv, {}, args)
    if error is not None or not out.exists():
        return {"error": error or "no result written", "others_share": others}
    return {**json.loads(out.read_text()), "others_share": others}


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{os.cpu_count()} CPU cores ({cpu}), {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def invocation() -> str:
    """The command line that ran this script, with paths relative to the repository root."""
    def rel(path: str) -> str:
        p = Path(path).absolute()
        return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else path

    return " ".join([rel(sys.executable), rel(sys.argv[0]), *sys.argv[1:]])


def step_section(results: list[tuple[StepJob, dict]], args: argparse.Namespace) -> str:
    rows, errors = step_rows(results)
    cores = os.cpu_count() or 1
    lines = [
        "## Training step time",
        "",
        f"{GPT_SHAPE.describe()}; fp32, AdamW. A step is `zero_grad` + forward/backward + `optimizer.step()` "
        f"(through autoshard: `pm.step(tokens, target=target)`). Median of {args.steps} steps after "
        f"{args.warmup} warm-up steps; with several processes each step is timed on rank 0 between two barriers. "
        "Rows with the same processes and microbatches ran in the same job, taking turns step by step.",
        "",
        report.step_table(rows),
        "",
        "- *time vs eager* and *throughput vs eager* compare with the eager model in one process on one thread "
        "(every rank of the other configurations runs one thread too); the eager model on "
        f"{cores} threads is shown for reference. *autoshard / DDP time* below 1 means autoshard is faster than "
        "DistributedDataParallel wrapped by hand around the eager model with the same batch split.",
        f"- This machine has {cores} cores, so dp=4 oversubscribes them ({4 / cores:g} ranks per core): the dp=4 "
        "rows show overhead, not speed-up. Each rank is pinned to one core (rank mod cores).",
        "- autoshard's step also sums the global batch's loss over the dp ranks (a one-element all-reduce) and "
        "normalises by the global count of non-ignored tokens; the hand-written DDP loop does neither.",
    ]
    busy = [(job, r["others_share"]) for job, r in results if (r.get("others_share") or 0) > OTHERS_NOTED]
    for job, share in busy:
        lines.append(f"- Other processes on this machine used {share:.0%} of its CPU time during the job "
                     f"{_job_name(job)}: its times are inflated.")
    if errors:
        lines += ["", "Failed configurations:", "", *[f"- {e}" for e in errors]]
    return "\n".join(lines)


def compile_section(results: dict[str, dict]) -> str:
    rows, errors = [], []
    for name, result in results.items():
        if "error" in result:
            errors.append(f"{name}: {result['error']}")
        else:
            rows.append(report.compile_row(name, COMPILE_SHAPES[name], result))
    lines = [
        "## Compile (capture) time as the model grows",
        "",
        "`autoshard.capture(model, (tokens,), loss_fn=token_loss, example_target=target)` of the Llama-style "
        "decoder of tests/harness/models.py (`build_llama_model`), built on the `meta` device with meta tokens and "
        "targets, one shape per fresh process. *capture s* is the wall time of `capture` (torch.export of model "
        "and loss, plus parameter provenance); *RSS after imports* is the process's peak resident memory before "
        "the model is built, *peak RSS* its peak at the end (`resource.getrusage`). The gap to *fp32 weights* "
        "shows that nothing of the model's size is allocated.",
        "",
        report.compile_table(rows),
    ]
    for name, result in results.items():
        if (result.get("others_share") or 0) > OTHERS_NOTED:
            lines.append(f"- Other processes on this machine used {result['others_share']:.0%} of its CPU time "
                         f"while {name} was captured: its time is inflated.")
    if errors:
        lines += ["", "Failed shapes:", "", *[f"- {e}" for e in errors]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--max-dp", type=int, default=4, choices=(1, 2, 4), help="largest dp degree to launch")
    parser.add_argument("--job-timeout", type=float, default=180, help="seconds before a launch is abandoned")
    parser.add_argument("--quiet-wait", type=float, default=20,
                        help="seconds to wait before each step-time job for other processes to go quiet (0: don't)")
    parser.add_argument("--retries", type=int, default=1,
                        help="times to repeat a step-time job during which other processes used the CPU")
    parser.add_argument("--patience", type=float, default=120,
                        help="seconds into the run after which it neither waits for quiet nor repeats a job")
    parser.add_argument("--output", type=Path, default=BENCH / "results_run.md")
    args = parser.parse_args()
    start = time.perf_counter()
    args.deadline = time.monotonic() + args.patience
    header = [
        "# autoshard benchmarks",
        "",
        f"- command: `{invocation()}` (from the repository root"
        + ("; `make bench` runs the same)" if len(sys.argv) == 1 else ")"),
        f"- date: {datetime.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}",
        f"- machine: {machine()}",
    ]

    with tempfile.TemporaryDirectory(prefix="autoshard-bench-") as tmp:
        print("step time:", flush=True)
        steps = [(job, least_disturbed(lambda job=job: run_step_job(job, Path(tmp), args), args))
                 for job in step_jobs(args.max_dp)]
        print("compile time:", flush=True)
        compiled = {name: least_disturbed(lambda n=name, s=shape: run_compile_shape(n, s, Path(tmp), args), args)
                    for name, shape in COMPILE_SHAPES.items()}

    elapsed = time.perf_counter() - start
    measured = [result for _, result in steps] + list(compiled.values())
    shares = [r["others_share"] for r in measured if r.get("others_share") is not None]
    header.append(f"- whole run: {elapsed:.0f} s"
                  + (f"; other processes took at most {max(shares):.0%} of the CPU during a measurement" if shares
                     else ""))
    text = "\n\n".join(["\n".join(header), step_section(steps, args), compile_section(compiled)]) + "\n"
    args.output.write_text(text)
    print()
    print(text)
    print(f"wrote {args.output} in {elapsed:.0f} s")


if __name__ == "__main__":
    main()
