"""The tiers keep what the suite catches: every seeded bug's tests run in the CI tier; quick has a golden per axis."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tiers

ROOT = Path(__file__).resolve().parents[1]


def _collected(marks: str) -> set[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m",
                          marks], cwd=ROOT, capture_output=True, text=True, timeout=300).stdout
    return {line.strip() for line in out.splitlines() if "::" in line}


def test_every_mutants_tests_are_in_the_ci_tier_and_quick_has_a_golden_per_axis():
    ci, full = _collected("not full"), _collected("full")
    named = tiers.mutant_tests()  # node ids, or a whole parametrized test, or a whole file

    def within(test: str, ids: set[str]) -> bool:
        return test in ids or any(i.startswith((test + "[", test + "::")) for i in ids)

    assert all(within(test, ci) for test in named), sorted(t for t in named if not within(t, ci))[:5]
    assert not [t for t in full if t in named or t.partition("[")[0] in named]
    assert not set(tiers.FULL_ONLY) & ci
    assert set(tiers.QUICK_GOLDENS) <= _collected("quick")
    axes = {golden.split("::")[0] for golden in tiers.QUICK_GOLDENS}
    assert {"tests/test_tensor_parallel.py", "tests/test_data_parallel.py", "tests/test_pipeline.py",
            "tests/test_context_parallel.py", "tests/test_sequence_parallel.py"} <= axes


def test_every_mutants_original_text_is_in_its_file_once():
    """A mutant whose text a change rewrote judges nothing (``make mutate`` reports it stale): caught here, on
    every change, instead of at the next mutation run."""
    from mutations import MUTANTS

    stale = [(m.name, m.file) for m in MUTANTS if (ROOT / m.file).read_text().count(m.original) != 1]
    assert not stale, stale
