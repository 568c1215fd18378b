"""Markdown tables of the benchmark results (pure formatting: no torch, no processes)."""

from __future__ import annotations


def table(header: list[str], rows: list[list[str]], align: str | None = None) -> str:
    """A markdown table; ``align`` has one character per column, ``l`` or ``r`` (default: first left)."""
    align = align or "l" + "r" * (len(header) - 1)
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = [header, rule, *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def _ms(value: float) -> str:
    return f"{value:.1f}"


def _ratio(value: float) -> str:
    return f"{value:.2f}x"


def step_row(label: str, layout: str, microbatches: int, stats: dict, batch: int, baseline_ms: float,
             versus_ddp: float | None) -> list[str]:
    """One configuration of the step-time table; ratios are against the one-process eager baseline."""
    median = stats["median_ms"]
    return [
        label,
        layout,
        str(microbatches),
        _ms(median),
        f"{_ms(stats['p10_ms'])}–{_ms(stats['p90_ms'])}",
        _ratio(median / baseline_ms),
        f"{batch / (median / 1000):.0f}",
        _ratio(baseline_ms / median),
        _ratio(versus_ddp) if versus_ddp is not None else "",
    ]


STEP_HEADER = [
    "configuration",
    "processes × threads",
    "microbatches per rank",
    "median step ms",
    "p10–p90 ms",
    "time vs eager",
    "samples/s",
    "throughput vs eager",
    "autoshard / DDP time",
]


def step_table(rows: list[list[str]]) -> str:
    return table(STEP_HEADER, rows, align="llr" + "r" * (len(STEP_HEADER) - 3))


COMPILE_HEADER = [
    "shape",
    "layers",
    "hidden",
    "heads / kv heads",
    "ffn",
    "vocab",
    "batch × seq",
    "parameters",
    "fp32 weights",
    "graph nodes",
    "capture s",
    "RSS after imports MiB",
    "peak RSS MiB",
]


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def _bytes(n: int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def compile_row(name: str, shape: dict, result: dict) -> list[str]:
    """One shape of the compile-time table."""
    return [
        name,
        str(shape["layers"]),
        str(shape["hidden"]),
        f"{shape['heads']} / {shape['kv_heads']}",
        str(shape["ffn"]),
        str(shape["vocab"]),
        f"{shape['batch']} × {shape['seq']}",
        _count(result["parameters"]),
        _bytes(4 * result["parameters"]),
        str(result["nodes"]),
        f"{result['capture_s']:.2f}",
        f"{result['rss_after_import_mib']:.0f}",
        f"{result['peak_rss_mib']:.0f}",
    ]


def compile_table(rows: list[list[str]]) -> str:
    return table(COMPILE_HEADER, rows, align="l" + "r" * (len(COMPILE_HEADER) - 1))
