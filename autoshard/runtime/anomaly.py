"""``detect_anomaly=True``: the first node whose output is not finite, found on its rank and said on every rank.

Each program runs through an ``fx.Interpreter`` that looks at every floating-point output as it is computed and
remembers the first one holding a NaN or an infinity (its node and the model's source line). After the step's
backward, each rank's gradients are looked at too, and one small all-gather over the world tells every rank what
every rank found: if any found one, every rank raises the same ``NonFiniteError`` naming the rank, step and node,
from ``step()``, so the optimizer never applies it. Off by default: the interpreter runs op by op and reads every
value back (``bench/anomaly.py`` measures the cost).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import fx

from autoshard import meta
from autoshard.errors import AutoshardError


class NonFiniteError(AutoshardError, FloatingPointError):
    """A NaN or infinity appeared in a step: raised on every rank, naming where it appeared first."""


class AnomalyWatch:
    """What this rank found in the current step: the first non-finite output, and the programs' interpreters."""

    def __init__(self) -> None:
        self.first: str | None = None

    def run(self, gm: fx.GraphModule):
        """The function that runs ``gm`` looking at every output."""
        return lambda *args: _Interpreter(gm, self).run(*args)

    def note(self, node: fx.Node, value) -> None:
        if self.first is not None:
            return
        bad = [t for t in _tensors(value) if t.is_floating_point() and not bool(torch.isfinite(t).all())]
        if bad:
            kind = "nan" if any(bool(torch.isnan(t).any()) for t in bad) else "inf"
            where = meta.source_line(node) or meta.module_path(node) or "no source line"
            self.first = f"{kind} first in the output of {node.name} ({node.target}) in the forward, from {where}"

    def check(self, pm, step: int) -> None:
        """After a step's backward: the gradients looked at, then every rank told what every rank found."""
        if self.first is None:
            for name, param in pm.named_parameters():
                grad = param.grad
                grad = grad.to_local() if hasattr(grad, "to_local") else grad
                if grad is not None and not bool(torch.isfinite(grad).all()):
                    self.first = f"a non-finite gradient first in {name}, after the backward (the forward was finite)"
                    break
        found, self.first = self.first, None
        everyone = [found]
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, found)
        ranks = [r for r, f in enumerate(everyone) if f is not None]
        if ranks:
            first = ranks[0]
            raise NonFiniteError(f"step {step}: rank {first} found {everyone[first]}. Every rank stops here, before "
                                 f"the optimizer applies the step (ranks that found one: {ranks})")


class _Interpreter(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, finding: AnomalyWatch) -> None:
        super().__init__(gm)
        self.finding = finding

    def run_node(self, n: fx.Node):
        value = super().run_node(n)
        if n.op in ("call_function", "call_module", "call_method"):
            self.finding.note(n, value)
        return value


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []
