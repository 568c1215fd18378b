"""``compile=True``: each rank's programs run through ``torch.compile`` (inductor), forward and backward.

A program (one per input shape, one per pipeline stage) is compiled once, on its first call, and reused; a new
shape is a new program, compiled on its own. autoshard's collectives are ``torch.autograd.Function``s over
``torch.distributed``, which dynamo traces into the graph as functional collectives, so the compiler sees them
beside the compute. Every graph the backend compiles is counted, with the seconds it took, for ``explain()``: a
second step of the same shapes compiles nothing.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable

import torch
from torch import fx


class Compiler:
    """The compiled function of each program, made on first use; and what compiling cost."""

    def __init__(self) -> None:
        self._compiled: weakref.WeakKeyDictionary[fx.GraphModule, Callable] = weakref.WeakKeyDictionary()
        self.graphs = 0  # graphs the backend compiled (forward graphs; a graph break makes two)
        self.seconds = 0.0

    def __call__(self, gm: fx.GraphModule) -> Callable:
        if gm not in self._compiled:
            _check_groups(gm)
            self._compiled[gm] = torch.compile(gm, backend=self._backend)
        return self._compiled[gm]

    def _backend(self, gm: fx.GraphModule, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        start = time.perf_counter()
        self.graphs += 1
        try:
            return compile_fx(gm, example_inputs)
        finally:
            self.seconds += time.perf_counter() - start

    def summary(self) -> str:
        return f"{self.graphs} graph{'s' if self.graphs != 1 else ''} compiled in {self.seconds:.1f} s"


def _check_groups(gm: fx.GraphModule) -> None:
    """Each collective checks its group once, on its first run, and remembers it: done here, before tracing, so
    the compiled graph does not guard on that memory and compile again at the second step."""
    from autoshard.passes.collectives import _ParallelOp

    for module in gm.modules():
        if isinstance(module, _ParallelOp) and module.group is not None:
            module._run_group()
