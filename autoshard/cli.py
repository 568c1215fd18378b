"""The ``autoshard`` command: one subcommand per module.

Each module in ``COMMAND_MODULES`` defines ``register(subparsers) -> ArgumentParser``, which adds its
subcommand and sets the default ``run`` to a function ``run(args) -> int`` (the exit code). To add a
subcommand, write such a module and list it here.

Errors in the user's input are one line on stderr and exit code 2, as argparse's own are.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Sequence

COMMAND_MODULES = ("autoshard.planner.command", "autoshard.planner.calibrate_command", "autoshard.inspect_cli")


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line, with where to look for the fix."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="autoshard", description="Plan and inspect the parallel split of a PyTorch model.")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", parser_class=_Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def _attach_negative_values(argv: list[str]) -> list[str]:
    """``--gpu-memory -80GB`` -> ``--gpu-memory=-80GB``: argparse takes ``-80GB`` for an option, and then says
    "expected one argument" instead of what is wrong with the value."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and re.match(r"-\.?\d", arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(_attach_negative_values(list(sys.argv[1:] if argv is None else argv)))
    if not hasattr(args, "run"):
        parser.print_help(sys.stderr)
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
