"""``make mutate``: is the suite strong enough to catch the bugs it exists to catch?

Each entry of ``harness.mutations.MUTANTS`` is a seeded one-line bug (a file, its exact original text, the text that
replaces it) and the tests that must catch it. This runner copies the repository to a temporary directory
(the committed ``HEAD`` by default, or ``--worktree`` for the files as they are now), applies one mutant at a
time there, runs only that mutant's tests (with a time limit) and reports each mutant caught or survived. The
repository itself is never modified. First the listed tests are collected and run once unmutated: a mutant
whose tests are missing or fail without it cannot be judged and is reported as an error. Exit status 1 when
a mutant survived, its original text was not found exactly once (the list is stale), or it could not be
judged.

Imports. The package is an editable install whose finder maps ``autoshard`` to this checkout. In the copy,
``PYTHONPATH`` puts the copy's ``autoshard`` first, so the ordinary path finder resolves it (and its subpackages)
inside the copy before the editable finder, which Python consults last. The runner checks that every module
resolves inside the copy before it runs any mutant.

    .venv/bin/python tests/mutate.py                  # every mutant
    .venv/bin/python tests/mutate.py cp-mask-diagonal  # some, by name
    .venv/bin/python tests/mutate.py --list
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.mutations import MUTANTS, Mutant  # noqa: E402 - the list sits in harness/, beside this file

ROOT = Path(__file__).resolve().parents[1]
_MODULES = ("autoshard", "autoshard.passes", "autoshard.passes.localize", "autoshard.runtime.parallel_model")


@dataclass
class Outcome:
    mutant: Mutant
    verdict: str  # "caught", "survived", "stale" (original text not found once), "error" (tests did not run)
    seconds: float
    detail: str = ""


def snapshot(dest: Path, *, worktree: bool) -> None:
    """The repository's files in ``dest``: ``HEAD`` (git archive), or the tracked and unignored files as they are."""
    if worktree:
        listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                                capture_output=True).stdout.decode().split("\0")
        for name in filter(None, listed):
            source = ROOT / name
            if source.is_file():
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, dest / name)
    else:
        archive = subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, check=True, capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(dest, filter="data")


def environment(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(copy), env.get("PYTHONPATH")]))
    return env


def check_imports(copy: Path, env: dict[str, str]) -> None:
    """Every module must come from the copy, or a mutant there would be tested against the unmutated package."""
    code = "import importlib\n" + "".join(f"print(importlib.import_module({m!r}).__file__)\n" for m in _MODULES)
    files = subprocess.run([sys.executable, "-c", code], cwd=copy, env=env, check=True, capture_output=True,
                           text=True).stdout.split()
    outside = [f for f in files if not Path(f).is_relative_to(copy)]
    if outside or len(files) != len(_MODULES):
        raise SystemExit(f"mutate: the copy's modules do not resolve inside {copy}: {files}")


def _pytest(copy: Path, env: dict[str, str], args: list[str], timeout: float) -> tuple[int | None, str, float]:
    """(exit status, or None on timeout; output; seconds) of pytest run in the copy."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    start = time.monotonic()
    process = subprocess.Popen(command, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # pytest and the worker pools it started
        output, _ = process.communicate()
        return None, output, time.monotonic() - start
    return process.returncode, output, time.monotonic() - start


def _failures(output: str) -> list[str]:
    """The node ids of the failed tests in pytest's short summary (``FAILED <id> - <message>``)."""
    lines = [line for line in output.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    return [line.split(" ", 1)[1].split(" - ")[0] for line in lines]


def _covers(spec: str, node: str) -> bool:
    """Whether the test ``spec`` (a file, a test or a parametrized node id) includes the node id ``node``."""
    return node == spec or node.startswith((spec + "[", spec + "::"))


def run_tests(copy: Path, env: dict[str, str], tests: tuple[str, ...], timeout: float) -> tuple[str, float, str]:
    """Run ``tests`` in the copy: (verdict, seconds, the first failure). Stops at the first failing test."""
    status, output, seconds = _pytest(copy, env, ["-x", *tests], timeout)
    if status is None:
        return "caught", seconds, f"no result within {timeout:.0f} s (a hang)"
    failed = next(iter(_failures(output)), "")
    if status == 0:
        return "survived", seconds, ""
    if status == 1:
        return "caught", seconds, f"FAILED {failed}"
    return "error", seconds, f"pytest exit status {status}: {failed or output.strip()[-500:]}"


def usable(copy: Path, env: dict[str, str], mutants: list[Mutant], timeout: float) -> dict[str, str]:
    """Why a mutant cannot be judged, by name: a test that is not collected, or one that fails unmutated."""
    files = sorted({t.split("::")[0] for m in mutants for t in m.tests if (copy / t.split("::")[0]).is_file()})
    _, listing, _ = _pytest(copy, env, ["--collect-only", *files], timeout)
    nodes = [line for line in listing.splitlines() if "::" in line and not line.startswith(("ERROR", "FAILED"))]
    unusable = {}
    for m in mutants:
        missing = [t for t in m.tests if not any(_covers(t, n) for n in nodes)]
        if missing:
            unusable[m.name] = f"no such test: {missing[0]}"
    tests = list(dict.fromkeys(t for m in mutants if m.name not in unusable for t in m.tests))
    status, output, seconds = _pytest(copy, env, tests, timeout)
    failed = _failures(output) if status != 0 else []
    print(f"baseline: {len(tests)} tests unmutated in {seconds:.0f} s, {len(failed)} failed"
          + ("" if status in (0, 1) else f" (pytest exit status {status})"), flush=True)
    for m in mutants:
        broken = [f for f in failed if any(_covers(t, f) for t in m.tests)]
        if broken and m.name not in unusable:
            unusable[m.name] = f"fails without the mutant: {broken[0]}"
    return unusable


def mutate(copy: Path, env: dict[str, str], mutant: Mutant, timeout: float) -> Outcome:
    path = copy / mutant.file
    original = path.read_text()
    found = original.count(mutant.original)
    if found != 1:
        return Outcome(mutant, "stale", 0.0, f"the original text occurs {found} times in {mutant.file}")
    path.write_text(original.replace(mutant.original, mutant.replacement))
    try:
        verdict, seconds, detail = run_tests(copy, env, mutant.tests, timeout)
    finally:
        path.write_text(original)
    return Outcome(mutant, verdict, seconds, detail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutants to run (all by default)")
    parser.add_argument("--list", action="store_true", help="print the mutants and their tests, run nothing")
    parser.add_argument("--worktree", action="store_true", help="copy the working tree instead of HEAD")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip collecting the tests and running them once unmutated first")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant's tests")
    args = parser.parse_args(argv)
    unknown = set(args.names) - {m.name for m in MUTANTS}
    if unknown:
        parser.error(f"no mutant named {sorted(unknown)}; --list shows them")
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.file}: {m.why}\n    " + "\n    ".join(m.tests))
        return 0
    with tempfile.TemporaryDirectory(prefix="autoshard-mutate-") as tmp:
        copy = Path(tmp)
        snapshot(copy, worktree=args.worktree)
        env = environment(copy)
        check_imports(copy, env)
        unusable = {} if args.no_baseline else usable(copy, env, chosen, args.timeout * 3)
        outcomes = []
        for mutant in chosen:
            if mutant.name in unusable:
                outcome = Outcome(mutant, "error", 0.0, unusable[mutant.name])
            else:
                outcome = mutate(copy, env, mutant, args.timeout)
            outcomes.append(outcome)
            print(f"{outcome.verdict:>8}  {outcome.seconds:5.0f} s  {mutant.name}: {mutant.why}"
                  + (f"\n{'':>18}{outcome.detail}" if outcome.detail else ""), flush=True)
    return report(outcomes)


def report(outcomes: list[Outcome]) -> int:
    caught = sum(o.verdict == "caught" for o in outcomes)
    print(f"\nmutate: {caught} of {len(outcomes)} mutants caught")
    bad = [o for o in outcomes if o.verdict != "caught"]
    for o in bad:
        print(f"  {o.verdict}: {o.mutant.name} ({o.mutant.file}) {o.detail}".rstrip())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
