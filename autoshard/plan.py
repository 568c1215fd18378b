"""Plans: what the compiler decided, as plain data that prints, round-trips through JSON and can be edited.

A ``TensorParallelPlan`` gives, per parameter (by its name in the captured graph), its placement on
the tp axis, its role (``column``, ``row``, ``vocab``, ``replicated``) and the reason: the pattern
that matched, or why none did. Applying a plan is a separate step (``passes.tensor_parallel``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from autoshard.passes.placements import Placement, from_json, to_json


@dataclass(frozen=True)
class ParamPlan:
    placement: Placement
    role: str
    reason: str = ""


@dataclass
class TensorParallelPlan:
    size: int
    params: dict[str, ParamPlan] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def placements(self) -> dict[str, Placement]:
        return {name: p.placement for name, p in self.params.items()}

    def to_json(self) -> str:
        params = {n: {**asdict(p), "placement": to_json(p.placement)} for n, p in self.params.items()}
        return json.dumps({"size": self.size, "params": params, "notes": self.notes}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> TensorParallelPlan:
        data = json.loads(text)
        params = {
            name: ParamPlan(from_json(p["placement"]), p["role"], p.get("reason", ""))
            for name, p in data["params"].items()
        }
        return cls(size=data["size"], params=params, notes=list(data.get("notes", [])))

    def __str__(self) -> str:
        lines = [f"tensor-parallel plan over {self.size} ranks:"]
        width = max((len(n) for n in self.params), default=0)
        for name, p in self.params.items():
            lines.append(f"  {name:<{width}}  {p.role:<10} {p.placement!r:<22} {p.reason}")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)
