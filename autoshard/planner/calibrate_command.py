"""``autoshard calibrate``: measure this machine for the planner (``autoshard.planner.profile``). Registered by
``autoshard.cli``.

Under torchrun it measures the world it is in; otherwise it launches itself on ``--nproc`` local processes
(``torch.distributed.run --standalone``, gloo on the loopback), one thread each unless ``--threads`` says.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

NAME = "calibrate"
HELP = "measure this machine's compute and collectives into a profile that mesh='auto' and the planner read"


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(NAME, help=HELP, description=HELP)
    parser.add_argument("--nproc", type=int, default=1, help="processes to measure with (the job's world size)")
    parser.add_argument("--threads", type=int, default=1, help="threads per process (OMP_NUM_THREADS)")
    parser.add_argument("--out", required=True, help="where to write the profile (JSON)")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats (a few seconds)")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    if args.nproc < 1:
        print(f"autoshard calibrate: error: --nproc {args.nproc} must be at least 1", file=sys.stderr)
        return 2
    command = ["-m", "autoshard.planner.profile", "--out", args.out, *(["--quick"] if args.quick else [])]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if args.nproc > 1 and "RANK" not in os.environ:
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                  str(args.nproc), *command]
    else:
        launch = [sys.executable, *command]
    return subprocess.run(launch, env=env, check=False).returncode
