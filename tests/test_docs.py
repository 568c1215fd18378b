"""The docs' Python examples: the home page's runs as it is; every other one is at least valid Python."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def _blocks():
    return [(page.name, i, code) for page in sorted(DOCS.glob("*.md"))
            for i, code in enumerate(BLOCK.findall(page.read_text()))]


def test_the_home_pages_example_trains_as_it_says():
    (code,) = BLOCK.findall((DOCS / "index.md").read_text())
    exec(compile(code, "docs/index.md", "exec"), {"__name__": "docs_example"})  # noqa: S102 - our own example


def test_every_example_of_the_docs_is_python():
    blocks = _blocks()
    assert len(blocks) >= 5, blocks
    for page, index, code in blocks:
        compile(code, f"docs/{page} example {index}", "exec")
