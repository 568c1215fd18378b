"""The tiers keep what the suite catches: every seeded bug's tests run in the CI tier, and every test, and every
cell a note names as a cover; quick has a golden per axis."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from harness import tiers

ROOT = Path(__file__).resolve().parents[1]


def _tiers(tmp_path) -> dict[str, set[str]]:
    """Each test of the suite and its tier marks, from one collection (``harness/tier_dump.py``)."""
    dump = tmp_path / "tiers.txt"
    env = {**os.environ, "AUTOSHARD_TIER_DUMP": str(dump),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-p",
                    "harness.tier_dump"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=True)
    return {nodeid: set(marks) for nodeid, *marks in (line.split("\t") for line in dump.read_text().splitlines())}


def test_every_mutants_tests_are_in_the_ci_tier_and_quick_has_a_golden_per_axis(tmp_path):
    tiers_of = _tiers(tmp_path)
    ci = {t for t, marks in tiers_of.items() if "full" not in marks}
    full = set(tiers_of) - ci
    quick = {t for t, marks in tiers_of.items() if "quick" in marks}
    named = tiers.mutant_tests()  # node ids, or a whole parametrized test, or a whole file

    def within(test: str, ids: set[str]) -> bool:
        return test in ids or any(i.startswith((test + "[", test + "::")) for i in ids)

    assert all(within(test, ci) for test in named), sorted(t for t in named if not within(t, ci))[:5]
    assert not [t for t in full if t in named or t.partition("[")[0] in named]
    assert not set(tiers.FULL_ONLY) & ci
    assert set(tiers.QUICK_GOLDENS) <= quick
    assert set(tiers.NOT_QUICK) <= ci - quick, sorted(set(tiers.NOT_QUICK) - (ci - quick))
    assert quick <= ci, sorted(quick - ci)[:5]
    assert set(tiers.KEEP) <= ci, sorted(set(tiers.KEEP) - ci)  # each cover a note names runs in CI
    cells_of: dict[str, set[str]] = {}
    for test in tiers_of:
        cells_of.setdefault(test.partition("[")[0], set()).add(test)
    bare = [test for test, cells in cells_of.items() if not cells & ci and not cells <= set(tiers.FULL_ONLY)]
    assert not bare, bare[:5]  # every test keeps a cell in CI but those moved out whole by hand
    axes = {golden.split("::")[0] for golden in tiers.QUICK_GOLDENS}
    assert {"tests/test_tensor_parallel.py", "tests/test_data_parallel.py", "tests/test_pipeline.py",
            "tests/test_context_parallel.py", "tests/test_sequence_parallel.py"} <= axes


def test_every_mutants_original_text_is_in_its_file_once():
    """A mutant whose text a change rewrote judges nothing (``make mutate`` reports it stale): caught here, on
    every change, instead of at the next mutation run."""
    from harness.mutations import MUTANTS

    stale = [(m.name, m.file) for m in MUTANTS if (ROOT / m.file).read_text().count(m.original) != 1]
    assert not stale, stale
