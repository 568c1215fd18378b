"""Quantities with units, as a person types them: ``"80GB"``, ``"900GB/s"``, ``"400Gb/s"``, ``"312TFLOPS"``, ``"5us"``.

Every quantity is read into its base unit: bytes, bytes per second, FLOP per second, or seconds.
Decimal prefixes are powers of 1000 (``GB`` = 1e9 bytes), binary ones powers of 1024 (``GiB`` = 2**30
bytes). In a bandwidth a lower-case ``b`` means bits (``400Gb/s`` = 50e9 bytes/s), as network cards
are sold; an upper-case ``B`` means bytes. A number without a unit is refused for memory and
bandwidth (is ``80`` gigabytes or bytes?); for FLOP/s and time it is read in the base unit.

:func:`parse` raises :class:`UnitError` (a ``ValueError``) naming the text, what was expected and an example.
"""

from __future__ import annotations

import re

from autoshard.errors import AutoshardError

KINDS = ("bytes", "bandwidth", "flops", "time")

_DECIMAL = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
_BINARY = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}

_NUMBER_RE = re.compile(r"\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*(.*?)\s*")

_EXAMPLES = {
    "bytes": "80GB, 96GiB or 80e9B",
    "bandwidth": "450GB/s (bytes) or 400Gb/s (bits)",
    "flops": "989TFLOPS, 312TFLOP/s or 1.2PFLOPS",
    "time": "5us, 0.01ms or 2e-6s",
}


class UnitError(AutoshardError, ValueError):
    """A quantity that cannot be read, or is negative."""


def parse(text: str | float | int, kind: str) -> float:
    """``text`` in the base unit of ``kind`` (one of ``KINDS``); a number passes through unchanged."""
    if kind not in KINDS:
        raise ValueError(f"unknown quantity kind {kind!r}: expected one of {', '.join(KINDS)}")
    if isinstance(text, bool):
        raise UnitError(f"{text!r} is not a {kind} quantity: write it like {_EXAMPLES[kind]}")
    if isinstance(text, (int, float)):
        return _non_negative(float(text), repr(text), kind)
    match = _NUMBER_RE.fullmatch(str(text))
    if match is None:
        raise UnitError(f"cannot read {text!r} as a {_NAMES[kind]}: write a number and a unit, like {_EXAMPLES[kind]}")
    number, unit = float(match.group(1)), match.group(2)
    scale = _SCALES[kind](unit, text)
    return _non_negative(float(f"{number * scale:.15g}"), text, kind)  # 5us is 5e-06, not 4.9999999999999996e-06


def _non_negative(value: float, text: str, kind: str) -> float:
    if value < 0:
        raise UnitError(f"{text} is negative: a {_NAMES[kind]} must be >= 0, like {_EXAMPLES[kind]}")
    if value != value or value in (float("inf"), float("-inf")):
        raise UnitError(f"{text} is not a finite {_NAMES[kind]}: write it like {_EXAMPLES[kind]}")
    return value


def _prefix(prefix: str, unit: str, text: str, kind: str) -> float:
    if prefix in _BINARY:
        return _BINARY[prefix]
    if prefix in _DECIMAL:
        return _DECIMAL[prefix]
    raise UnitError(f"unknown unit {unit!r} in {text!r}: a {_NAMES[kind]} is written like {_EXAMPLES[kind]}")


def _bytes(unit: str, text: str) -> float:
    if not unit:
        raise UnitError(f"{text!r} has no unit: say whether it is bytes or gigabytes, like {_EXAMPLES['bytes']}")
    if unit.endswith("B") and not unit.endswith("bB"):
        return _prefix(unit[:-1], unit, text, "bytes")
    raise UnitError(f"unknown unit {unit!r} in {text!r}: memory is written like {_EXAMPLES['bytes']}")


def _bandwidth(unit: str, text: str) -> float:
    if not unit:
        raise UnitError(f"{text!r} has no unit: write a bandwidth like {_EXAMPLES['bandwidth']}")
    core = unit[:-2] if unit.endswith("/s") else unit[:-3] + "b" if unit.endswith("bps") else ""
    if not core:
        raise UnitError(f"unknown unit {unit!r} in {text!r}: a bandwidth is written like {_EXAMPLES['bandwidth']}")
    if core.endswith("B"):
        return _prefix(core[:-1], unit, text, "bandwidth")
    if core.endswith("b"):
        return _prefix(core[:-1], unit, text, "bandwidth") / 8
    raise UnitError(f"unknown unit {unit!r} in {text!r}: a bandwidth is written like {_EXAMPLES['bandwidth']}")


def _flops(unit: str, text: str) -> float:
    if not unit:
        return 1.0
    for suffix in ("FLOP/s", "FLOPS", "FLOPs", "flops", "FLOP"):
        if unit.endswith(suffix):
            return _prefix(unit[: -len(suffix)], unit, text, "flops")
    raise UnitError(f"unknown unit {unit!r} in {text!r}: a compute rate is written like {_EXAMPLES['flops']}")


def _time(unit: str, text: str) -> float:
    if not unit:
        return 1.0
    if unit in _TIME:
        return _TIME[unit]
    raise UnitError(f"unknown unit {unit!r} in {text!r}: a time is written like {_EXAMPLES['time']}")


_SCALES = {"bytes": _bytes, "bandwidth": _bandwidth, "flops": _flops, "time": _time}
_NAMES = {"bytes": "memory size", "bandwidth": "bandwidth", "flops": "compute rate", "time": "time"}


def format_si_bytes(n: float) -> str:
    """``80.0 GB``: decimal units, three significant digits."""
    return _format(n, "B")


def format_rate(n: float, unit: str) -> str:
    return _format(n, unit)


def _format(n: float, unit: str) -> str:
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {prefix}{unit}"
    return f"{n:.3g} {unit}"


def format_time(seconds: float) -> str:
    """``12.3 s``, ``45.6 ms`` or ``7.8 us``."""
    if abs(seconds) >= 1:
        return f"{seconds:.3g} s"
    if abs(seconds) >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"
