"""Launching for ``bench/tp.py``, ``bench/compile_tp.py`` and ``bench/pp.py``: run a worker, read back its JSON.

The launching itself is ``bench/run.py``'s: before each job wait (a while) for other processes to leave the
cores idle, measure the share of the CPU other processes took during the job, and repeat a job they disturbed.
A worker writes its result as JSON to the file given after ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

from common import BENCH
from run import OTHERS_NOTED, least_disturbed, machine  # noqa: F401 - machine is re-exported
from run import invocation as _invocation
from run import launch as _launch


def options(*, job_timeout: float = 180, quiet_wait: float = 20, retries: int = 1, patience: float = 600):
    """The settings ``run.launch`` reads: per-job timeout, wait for quiet, repeats of a disturbed job."""
    return argparse.Namespace(job_timeout=job_timeout, quiet_wait=quiet_wait, retries=retries, patience=patience,
                              deadline=time.monotonic() + patience)


def add_arguments(parser: argparse.ArgumentParser, *, job_timeout: float = 180) -> None:
    parser.add_argument("--job-timeout", type=float, default=job_timeout, help="seconds before a launch is abandoned")
    parser.add_argument("--quiet-wait", type=float, default=20,
                        help="seconds to wait before each job for other processes to go quiet (0: don't)")
    parser.add_argument("--retries", type=int, default=1, help="times to repeat a job other processes disturbed")
    parser.add_argument("--patience", type=float, default=600,
                        help="seconds into the run after which it neither waits for quiet nor repeats a job")


def from_args(args: argparse.Namespace):
    return options(job_timeout=args.job_timeout, quiet_wait=args.quiet_wait, retries=args.retries,
                   patience=args.patience)


def torchrun(nproc: int, script: str, *script_args: str) -> list[str]:
    launcher = Path(sys.executable).with_name("torchrun")
    head = [str(launcher)] if launcher.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return [*head, "--standalone", "--nproc-per-node", str(nproc), str(BENCH / script), *script_args]


def run_json(name: str, argv: list[str], opts, env: dict | None = None) -> dict:
    """Run ``argv`` (given ``--out FILE`` appended) until undisturbed or out of retries; its JSON with
    ``others_share`` (the CPU share other processes took during it), or ``{"error": ...}``."""
    with tempfile.TemporaryDirectory(prefix="autoshard-bench-") as tmp:
        out = Path(tmp) / "result.json"

        def measure() -> dict:
            out.unlink(missing_ok=True)
            error, others = _launch(name, [*argv, "--out", str(out)], env or {}, opts)
            if error is not None or not out.exists():
                return {"error": error or "no result written", "others_share": others}
            return {"result": json.loads(out.read_text()), "others_share": others}

        return least_disturbed(measure, opts)


def header(title: str, started: float) -> list[str]:
    return [
        f"# {title}",
        "",
        f"- command: `{_invocation()}` (from the repository root)",
        f"- date: {datetime.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}",
        f"- machine: {machine()}",
        f"- whole run: {time.perf_counter() - started:.0f} s",
    ]


def disturbed_note(name: str, others: float | None) -> list[str]:
    if others is None or others <= OTHERS_NOTED:
        return []
    return [f"- Other processes on this machine used {others:.0%} of its CPU time during {name}: its times are "
            "inflated."]
