"""The root of the exceptions autoshard raises by classes of its own.

``except autoshard.AutoshardError`` catches each of them: a refusal of what was asked (a mesh the model does not
divide, a loss whose parts run apart, a Function that cannot be kept) and a failure while running (a stalled
pipeline, a step that failed on a rank, a non-finite value). Each class keeps its builtin base as well
(``ValueError`` for a refusal, ``RuntimeError`` for a failure, ``FloatingPointError`` for a non-finite value), so
code that catches those still does.
"""

from __future__ import annotations


class AutoshardError(Exception):
    """Raised by autoshard, under one of its own classes."""
