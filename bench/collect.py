"""Gather every benchmark's results into bench/results.md.

    .venv/bin/python bench/collect.py

bench/run.py writes the data-parallel and capture tables (bench/results_run.md); the other scripts write
bench/results_<name>.md. This puts them in one file, in the order of the compiler's capabilities.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
ORDER = ["run", "tp", "pp", "cp", "3d", "meta", "checkpoint"]


def main() -> None:
    parts = ["# autoshard benchmarks\n\nEach section below is written by one script of bench/ (the command heads it); "
             "`.venv/bin/python bench/collect.py` gathers them here.\n"]
    for name in ORDER:
        path = HERE / f"results_{name}.md"
        if path.exists():
            text = path.read_text().strip()
            parts.append("\n".join("#" + line if line.startswith("#") else line for line in text.splitlines()))
    (HERE / "results.md").write_text("\n\n".join(parts) + "\n")
    print(f"wrote {HERE / 'results.md'} from {len(parts) - 1} sections")


if __name__ == "__main__":
    main()
