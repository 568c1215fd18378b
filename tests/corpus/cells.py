"""One corpus cell: an architecture at a mesh, run on every rank of a worker pool and classified.

A cell is one of:

- ``exact``: ``autoshard.verify``'s comparison (outputs, the loss of 3 optimizer steps, every gradient,
  every parameter after the steps, replicas bit-identical) holds at fp32 tolerances;
- ``wrong``: it runs but differs; the largest difference and the first differing value are kept;
- ``refused``: autoshard raised an error meant for the user (a ``ValueError``, ``NotImplementedError``,
  ``TypeError`` or a capture error raised by autoshard's own code) on every rank;
- ``crash``: anything else: an internal error (``AssertionError``, ``KeyError``, an error raised inside
  torch while autoshard drives it), a stall, or ranks that disagree (one refuses, another waits).

``run_cell`` runs on each rank and never raises, so one failing architecture leaves the pool usable;
``outcome`` combines the ranks' results into the cell.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autoshard
from autoshard.verify import compare
from corpus.architectures import build

from harness.golden import groups_for

# Mesh label -> (degrees, parallelize options): the corpus's columns; 2 microbatches wherever pp > 1.
MESHES: dict[str, tuple[dict, dict]] = {
    "tp2": ({"tp": 2}, {}),
    "dp2": ({"dp": 2}, {}),
    "pp2": ({"pp": 2}, {"microbatches": 2}),
    "cp2": ({"cp": 2}, {}),
    "dp2xtp2xpp2": ({"dp": 2, "tp": 2, "pp": 2}, {"microbatches": 2}),
    "tp4": ({"tp": 4}, {}),  # run for the mixture-of-experts architectures (experts split four ways)
    "cp2ring": ({"cp": 2}, {"cp_attention": "ring", "cp_load_balance": True}),
    "cp2alltoall": ({"cp": 2}, {"cp_attention": "alltoall", "cp_load_balance": True}),
    "pp2zbv": ({"pp": 2}, {"microbatches": 4, "schedule": "zbv"}),  # four stages in a V, backward split in two
    "tp2sp": ({"tp": 2}, {"sequence_parallel": True}),  # the sequence split over tp between its regions
    "ep2": ({"dp": 2, "ep": 2}, {}),  # the experts split over the two dp ranks, the tokens sent to them
    "ep2xtp2": ({"dp": 2, "ep": 2, "tp": 2}, {}),  # each expert split over tp as well
    "dp2xep2xpp2": ({"dp": 2, "ep": 2, "pp": 2}, {"microbatches": 2}),
    "pp2xcp2": ({"pp": 2, "cp": 2}, {"microbatches": 2}),  # each stage's tokens split over cp, handed on split
    "pp2xcp2il": ({"pp": 2, "cp": 2}, {"microbatches": 2, "schedule": "interleaved", "chunks": 2}),  # 4 stages
}

_USER_ERRORS = (ValueError, NotImplementedError, TypeError)
_STALLS = ("StepError", "PipelineStall")


@dataclass(frozen=True)
class Outcome:
    """A cell's classification, as the corpus table prints it."""

    status: str  # exact | wrong | refused | crash
    message: str = ""  # wrong: the largest difference and where; refused/crash: the error's first line
    max_abs: float = 0.0
    share: float | None = None  # bytes of this rank's parameters / bytes of the whole model (rank 0)

    def text(self) -> str:
        if self.status == "exact":
            return f"exact ({self.message})" if self.message else "exact"
        if self.status == "wrong":
            drift = self.message.partition("; ")[2]
            return f"wrong by {self.max_abs:.1e}" + (f" ({drift})" if drift else "")
        return f"{self.status}: {self.message}"


def world_size(label: str) -> int:
    size = 1
    for axis, degree in MESHES[label][0].items():
        size *= degree if axis != "ep" else 1  # ep is carved from dp: it adds no ranks
    return size


def run_cell(name: str, mesh_kwargs: dict, *, microbatches: int = 1, steps: int = 3, **options) -> dict:
    """This rank's part of the golden run of ``name`` at ``mesh_kwargs``; plain data, never raises.

    A cell that differs in float32 is run again in float64: where the parallel program is right, its
    difference from eager is rounding (summation order), which verify's SGD amplifies on some architectures,
    and in float64 it vanishes below the same tolerances; a wrong program stays wrong. Such a cell is exact,
    and its text says by how much float32 drifted.
    """
    try:
        report, share = _golden(name, mesh_kwargs, microbatches, steps, torch.float32, options)
        retry = not report.ok and bool(report.differences)
        if dist.is_initialized():  # every rank takes the same path, or the float64 run would wait forever
            flag = torch.tensor([int(retry)])
            dist.all_reduce(flag)
            retry = bool(flag.item())
        fp64 = _golden(name, mesh_kwargs, microbatches, steps, torch.float64, options)[0] if retry else None
    except Exception as e:  # noqa: BLE001 - classified, not raised: the next cell needs the pool
        return {"status": _classify(e), "message": _first_line(e), "traceback": traceback.format_exc()[-3000:]}
    if not report.differences:
        return {"status": "crash", "message": "verify compared nothing", "share": share}
    if report.ok:
        return {"status": "exact", "share": share}
    failures = report.failures()
    worst = max(failures, key=lambda d: d.max_abs) if failures else None
    if fp64 is not None and fp64.ok and worst is not None:
        return {"status": "exact", "share": share,
                "message": f"in float64; float32 differs by {worst.max_abs:.1e} after {steps} steps "
                           f"(eager drifts {eager_drift(name, steps):.1e} under a 1e-6 loss change)"}
    message = f"{worst.what} (first: {failures[0].what})" if worst else "replicas not bit-identical"
    if not any(d.what.startswith(("grad", "output", "loss step 1")) for d in failures):
        message += f"; step-1 gradients exact, eager drifts {eager_drift(name, steps):.1e} under a 1e-6 loss change"
    if fp64 is not None:
        message += f"; float64 differs by {fp64.worst(''):.1e} too"
    return {"status": "wrong", "max_abs": worst.max_abs if worst else 0.0, "message": message,
            "report": str(report)[:3000], "share": share}


def _golden(name: str, mesh_kwargs: dict, microbatches: int, steps: int, dtype: torch.dtype,
            options: dict | None = None):
    """verify of ``name`` at the mesh (with ``parallelize`` ``options``), with the model (and its float inputs) in
    ``dtype``; and this rank's share."""
    with _float64_everywhere() if dtype == torch.float64 else contextlib.nullcontext():
        return _golden_in(name, mesh_kwargs, microbatches, steps, dtype, options or {})


@contextlib.contextmanager
def _float64_everywhere():
    """Keep a float64 run in float64 where the model itself casts to float32 (Gemma's norms ``x.float()``, a
    softmax with ``dtype=torch.float32``): else its own float32 rounding, amplified by verify's SGD, stays.

    Applied alike to the unsharded model and to the capture (export traces the same Python), so both compute
    the same ops, in float64.
    """
    def to64(value):
        return torch.float64 if value is torch.float32 else value

    def from_model() -> bool:  # the model's code, not autoshard's or torch's own casts (a float32 loss sum)
        return sys._getframe(2).f_globals.get("__name__", "").startswith(("transformers", "corpus"))

    def double(self, *a, **k):
        return torch.Tensor.double(self, *a, **k) if from_model() else original[(torch.Tensor, "float")](self, *a, **k)

    def to(self, *a, **k):
        if from_model():
            a, k = tuple(map(to64, a)), {key: to64(v) for key, v in k.items()}
        return original[(torch.Tensor, "to")](self, *a, **k)

    def softmax(*a, dtype=None, **k):
        return original[(F, "softmax")](*a, dtype=to64(dtype) if from_model() else dtype, **k)

    def log_softmax(*a, dtype=None, **k):
        return original[(F, "log_softmax")](*a, dtype=to64(dtype) if from_model() else dtype, **k)

    patches = {(torch.Tensor, "float"): double, (torch.Tensor, "to"): to, (F, "softmax"): softmax,
               (F, "log_softmax"): log_softmax}
    original = {key: getattr(*key) for key in patches}
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        for (owner, attr), patch in patches.items():
            setattr(owner, attr, patch)
        yield
    finally:
        for (owner, attr), value in original.items():
            setattr(owner, attr, value)
        torch.set_default_dtype(default)


def _golden_in(name: str, mesh_kwargs: dict, microbatches: int, steps: int, dtype: torch.dtype, options: dict):
    case = build(name)
    case.model.to(dtype)
    inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in case.inputs)
    target = case.target.to(dtype) if case.target.is_floating_point() else case.target
    mesh = autoshard.Mesh(**mesh_kwargs)
    reference = copy.deepcopy(case.model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autoshard.parallelize(case.model, mesh, example_inputs=inputs, loss_fn=case.loss_fn, target=target,
                                   microbatches=microbatches, groups=groups_for(mesh), **options)
        share = parameter_share(pm, reference)
        return compare(reference, pm, inputs, target, loss_fn=case.loss_fn, steps=steps), share


def eager_drift(name: str, steps: int, eps: float = 1e-6) -> float:
    """How far the unsharded model's parameters move after ``steps`` steps when its loss is scaled by 1 + eps.

    verify's SGD (lr 0.1, momentum 0.9) amplifies rounding noise on some architectures: a parallel run whose
    step-1 gradients are exact but whose parameters differ after the steps by about this much differs by
    summation order, not by a bug. Reported beside the difference, never used to call a cell exact.
    """
    runs = []
    for scale in (1.0, 1.0 + eps):
        case = build(name)
        opt = torch.optim.SGD(case.model.parameters(), lr=0.1, momentum=0.9)
        for _ in range(steps):
            opt.zero_grad()
            (case.loss_fn(case.model(*case.inputs), case.target) * scale).backward()
            opt.step()
        runs.append([p.detach() for p in case.model.parameters()])
    return max((a - b).abs().max().item() for a, b in zip(*runs, strict=True))


def parameter_share(pm, reference: torch.nn.Module) -> float:
    """Bytes of the parameters this rank holds over the bytes of the whole model (0.5 is the aim at tp=2)."""
    local = sum(p.numel() * p.element_size() for p in pm.parameters())
    full = sum(p.numel() * p.element_size() for p in reference.parameters())
    return local / full if full else 0.0


def _classify(e: BaseException) -> str:
    """``refused`` for an error autoshard raises for the user, ``crash`` for anything else."""
    if type(e).__name__ in _STALLS:
        return "crash"
    if type(e).__name__ == "CaptureError" or (isinstance(e, _USER_ERRORS) and _raised_by_autoshard(e)):
        return "refused"
    return "crash"


def _raised_by_autoshard(e: BaseException) -> bool:
    """Whether the innermost frame of the traceback is autoshard's own code (not torch's, not the model's)."""
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return False
    roots = (Path(autoshard.__file__).parent, Path(autoshard.passes.__file__).parent)
    where = Path(frames[-1].filename).resolve()
    return any(root.resolve() in where.parents for root in roots)


def _first_line(e: BaseException) -> str:
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    text = lines[0] if lines else ""
    return f"{type(e).__name__}: {text}"[:240]


def outcome(results: list[dict]) -> Outcome:
    """The cell from every rank's result: the worst rank decides; ranks that disagree on an error crash. Its share is
    the largest rank's (the largest pipeline stage's under pp)."""
    shares = [r["share"] for r in results if r.get("share") is not None]
    share = max(shares) if shares else None
    statuses = {r["status"] for r in results}
    if statuses <= {"exact", "wrong"}:
        wrong = [r for r in results if r["status"] == "wrong"]
        if not wrong:
            return Outcome("exact", results[0].get("message", ""), share=share)
        worst = max(wrong, key=lambda r: r["max_abs"])
        return Outcome("wrong", worst["message"], worst["max_abs"], share)
    if statuses == {"refused"}:
        return Outcome("refused", results[0]["message"], share=share)
    rank, first = next((i, r) for i, r in enumerate(results) if r["status"] in ("crash", "refused"))
    if statuses == {"crash"}:
        return Outcome("crash", first["message"], share=share)
    others = ", ".join(f"rank {i} {r['status']}" for i, r in enumerate(results) if i != rank)
    return Outcome("crash", f"ranks disagree: rank {rank} {first['status']} ({first['message']}); {others}", 0.0,
                   share)
