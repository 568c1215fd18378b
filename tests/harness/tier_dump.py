"""A pytest plugin writing each collected test's tier to the file ``$AUTOSHARD_TIER_DUMP``: one line per test, its
node id and its tier marks, tab-separated (``quick``, ``full``, or none: the CI tier only). ``test_tiers.py`` reads
the whole suite's tiers from one collection with it."""

from __future__ import annotations

import os


def pytest_collection_finish(session):
    lines = []
    for item in session.items:
        marks = sorted({mark.name for mark in item.iter_markers() if mark.name in ("quick", "full")})
        lines.append("\t".join([item.nodeid, *marks]))
    with open(os.environ["AUTOSHARD_TIER_DUMP"], "w") as f:
        f.write("\n".join(lines) + "\n")
