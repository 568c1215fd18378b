"""``verify``: run the unsharded model and the parallel program side by side and report differences.

A parallel program is right when it computes what the unsharded model computes. ``verify`` checks
that for a user's own model: outputs, the loss of every step, every gradient (at full shape, keyed
by the original parameter names) and every parameter after a few optimizer steps, with fp32
tolerances. When something differs it also runs both graphs node by node and names the first node
whose value diverges. Under torch.distributed, it also checks that parameters which should be
identical on every rank are bit-identical.

A comparison that compared nothing is not a pass: a report is ``ok`` only when it compared the loss of
every step and the gradient and value of every parameter the model has (a name the parallel program
does not report is a failure, not a skip). It also records ``share``, the fraction of the model's
parameter bytes this rank holds, so a caller can check that the mesh sharded something.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.utils import _pytree as pytree

from autoshard import meta
from autoshard.capture import capture
from autoshard.passes.loss import sum_loss_pass

RTOL = 1e-4
ATOL = 1e-5


@dataclass
class Difference:
    """The largest difference of one compared value."""

    what: str
    max_abs: float
    ok: bool
    detail: str = ""


_KINDS = ("output", "loss", "grad", "param")


@dataclass
class VerifyReport:
    differences: list[Difference] = field(default_factory=list)
    divergence: str | None = None
    replicas_identical: bool | None = None
    share: float | None = None  # this rank's parameter bytes over the unsharded model's

    @property
    def ok(self) -> bool:
        compared_losses = self.counts()["loss"] > 0
        return compared_losses and all(d.ok for d in self.differences) and self.replicas_identical is not False

    def counts(self) -> dict[str, int]:
        """How many values of each kind (output, loss, grad, param) were compared."""
        kinds = [d.what.split(" ")[0].split("[")[0] for d in self.differences]
        return {kind: kinds.count(kind) for kind in _KINDS}

    def failures(self) -> list[Difference]:
        return [d for d in self.differences if not d.ok]

    def worst(self, prefix: str) -> float:
        return max((d.max_abs for d in self.differences if d.what.startswith(prefix)), default=0.0)

    def __str__(self) -> str:
        if not self.counts()["loss"]:
            return "verify: NOTHING COMPARED (no step ran, so no loss, gradient or parameter was compared)"
        summary = ", ".join(f"{k} {self.worst(k):.2e}" for k in _KINDS)
        lines = [f"verify: {'OK' if self.ok else 'DIFFERENT'} (largest differences: {summary})"]
        counted = ", ".join(f"{n} {k}" for k, n in self.counts().items())
        share = f"; this rank holds {self.share:.0%} of the parameter bytes" if self.share is not None else ""
        lines.append(f"  compared {counted}{share}")
        lines += [f"  {d.what}: max |diff| {d.max_abs:.3e} {d.detail}".rstrip() for d in self.failures()[:20]]
        if self.replicas_identical is False:
            lines.append("  replicated parameters are not bit-identical on every rank")
        if self.divergence:
            lines.append(f"  first diverging node: {self.divergence}")
        return "\n".join(lines)


def verify(
    model: nn.Module,
    mesh,
    example_inputs: tuple,
    loss_fn: Callable,
    *,
    target: torch.Tensor,
    steps: int = 3,
    optimizer: Callable[..., torch.optim.Optimizer] | None = None,
    **parallelize_kwargs,
) -> VerifyReport:
    """Parallelize ``model`` on ``mesh`` and compare it with an unsharded copy over ``steps`` steps."""
    from autoshard.api import parallelize

    reference = copy.deepcopy(model)
    pm = parallelize(model, mesh, example_inputs=example_inputs, loss_fn=loss_fn, target=target, **parallelize_kwargs)
    return compare(reference, pm, example_inputs, target, loss_fn=loss_fn, steps=steps, optimizer=optimizer)


def compare(
    reference: nn.Module,
    pm,
    inputs: tuple,
    target: torch.Tensor,
    *,
    loss_fn: Callable,
    steps: int = 3,
    optimizer: Callable[..., torch.optim.Optimizer] | None = None,
) -> VerifyReport:
    """Compare ``pm`` with the unsharded ``reference`` (same initial parameters) on one batch."""
    if steps < 1:
        raise ValueError(f"verify needs steps >= 1 to compare losses, gradients and parameters (got steps={steps})")
    # SGD is linear in the gradient, so parameter differences show gradient differences faithfully;
    # Adam's scale-free update turns rounding noise in a near-zero gradient into an O(lr) difference.
    make_optimizer = optimizer or (lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    report = VerifyReport()
    initial = _snapshot(reference, pm)
    _compare_tree(report, "output", reference(*inputs), pm(*inputs))
    ref_opt = make_optimizer(reference.parameters())
    # A pipeline rank may hold no parameters (a last stage that only computes the loss).
    par_opt = make_optimizer(pm.parameters()) if any(True for _ in pm.parameters()) else _NoParameters()
    for step in range(1, steps + 1):
        ref_opt.zero_grad()
        par_opt.zero_grad()
        ref_loss = loss_fn(reference(*inputs), target)
        ref_loss.backward()
        par_loss = pm.step(*inputs, target=target)
        _compare(report, f"loss step {step}", ref_loss.detach(), par_loss)
        if step == 1:
            ref_grads = {n: p.grad for n, p in reference.named_parameters(remove_duplicate=False)}
            _compare_named(report, "grad {}", ref_grads, pm.gradients())
        ref_opt.step()
        par_opt.step()
    ref_params = {n: p.detach() for n, p in reference.named_parameters(remove_duplicate=False)}
    _compare_named(report, f"param {{}} after {steps} steps", ref_params, pm.full_parameters())
    report.replicas_identical = _replicas_identical(pm)
    report.share = _bytes(pm.parameters()) / max(_bytes(reference.parameters()), 1)
    if not report.ok:
        # Search from the initial parameters: after the steps, every drifted parameter diverges first.
        final = _snapshot(reference, pm)
        _restore(initial)
        report.divergence = first_divergence(reference, pm, inputs, target, loss_fn=loss_fn)
        _restore(final)
    return report


def _snapshot(*modules: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(p, p.detach().clone()) for m in modules for p in m.parameters()]


def _restore(snapshot: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for p, value in snapshot:
            p.copy_(value)


class _NoParameters:
    def zero_grad(self) -> None:
        pass

    def step(self) -> None:
        pass


def first_divergence(reference: nn.Module, pm, inputs: tuple, target: torch.Tensor, *, loss_fn: Callable) -> str | None:
    """Run both graphs on this rank's first microbatch; name the first node whose values differ."""
    if pm.pipeline is not None:
        return "not searched: the program is split into pipeline stages (compare a pp=1 run to localise it)"
    mb_inputs, mb_target = pm.microbatch_views(inputs, target)[0]
    build = next(b for b in reversed(pm.builds) if b.training)
    ref = capture(reference, mb_inputs, loss_fn=loss_fn, example_target=mb_target)
    if build.captured.token_loss is not None:
        sum_loss_pass(ref.gm, build.captured.token_loss)
    args = (*mb_inputs, mb_target)
    ref_values = _record(ref.gm, args)
    par_values = _record(build.program.gm, build.local_inputs(args))
    for node in build.program.gm.graph.nodes:
        if node.op in ("placeholder", "output") or node.name not in ref_values or node.name not in par_values:
            continue
        a, b = ref_values[node.name], par_values[node.name]
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.shape != b.shape:
            continue
        if not _close(a, b):
            diff = (a.double() - b.double()).abs().max().item()
            module, line = meta.module_path(node), meta.source_line(node)
            return (f"{node.name} ({node.target})" + (f" in {module}" if module else "") + f", max |diff| {diff:.3e}"
                    + (f", from {line}" if line else ""))
    return None


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[str, object] = {}

    def run_node(self, n: fx.Node):
        value = super().run_node(n)
        self.values[n.name] = value.detach() if isinstance(value, torch.Tensor) else value
        return value


def _record(gm: fx.GraphModule, args: tuple) -> dict[str, object]:
    recorder = _Recorder(gm)
    with torch.no_grad():
        recorder.run(*args)
    return recorder.values


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Element-wise ``assert_close`` at fp32 tolerances, and the whole tensor within ``RTOL`` in norm.

    The second test matters for small-valued tensors: a layer-norm weight's gradient of about 3e-4
    passes ``atol=1e-5`` even when it is 3% wrong, but not a relative-norm bound of 1e-4 (fp32
    summation-order noise measured on the zoo is about 1e-6 relative).
    """
    try:
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL, equal_nan=True)
    except AssertionError:
        return False
    if not a.is_floating_point() or a.numel() == 0:
        return True
    a, b = a.double(), b.double()
    return bool((a - b).norm() <= RTOL * a.norm() + 1e-9 * a.numel() ** 0.5)


def _compare(report: VerifyReport, what: str, expected, actual) -> None:
    if expected is None or actual is None:
        ok = expected is None and actual is None
        report.differences.append(Difference(what, 0.0 if ok else float("inf"), ok, "" if ok else "(missing)"))
        return
    expected, actual = expected.detach().float().cpu(), actual.detach().float().cpu()
    if expected.shape != actual.shape:
        detail = f"(shape {tuple(actual.shape)} instead of {tuple(expected.shape)})"
        report.differences.append(Difference(what, float("inf"), False, detail))
        return
    max_abs = (expected.double() - actual.double()).abs().max().item() if expected.numel() else 0.0
    report.differences.append(Difference(what, max_abs, _close(expected, actual)))


def _compare_named(report: VerifyReport, what: str, expected: dict, actual: dict) -> None:
    """Every name of ``expected`` is compared; one that ``actual`` lacks (or adds) is a failure, never a skip."""
    for name, value in expected.items():
        if name in actual:
            _compare(report, what.format(name), value, actual[name])
        else:
            report.differences.append(Difference(what.format(name), float("inf"), False, "(not reported)"))
    for name in actual.keys() - expected.keys():
        report.differences.append(Difference(what.format(name), float("inf"), False, "(not in the model)"))


def _bytes(parameters) -> int:
    """Bytes held locally (a DTensor shard counts its local part); a tensor seen twice counts once."""
    seen, total = set(), 0
    for p in parameters:
        local = p.to_local() if hasattr(p, "to_local") else p
        if id(p) not in seen:
            seen.add(id(p))
            total += local.numel() * local.element_size()
    return total


def _compare_tree(report: VerifyReport, what: str, expected, actual) -> None:
    exp_leaves, _ = pytree.tree_flatten(expected)
    act_leaves, _ = pytree.tree_flatten(actual)
    exp_leaves = [x for x in exp_leaves if isinstance(x, torch.Tensor)]
    act_leaves = [x for x in act_leaves if isinstance(x, torch.Tensor)]
    if len(exp_leaves) != len(act_leaves):
        report.differences.append(Difference(what, float("inf"), False, "(different number of outputs)"))
        return
    for i, (e, a) in enumerate(zip(exp_leaves, act_leaves, strict=False)):
        _compare(report, what if len(exp_leaves) == 1 else f"{what}[{i}]", e, a)


def _replicas_identical(pm) -> bool | None:
    """Whether every rank holds bit-identical copies of the parameters that are replicated everywhere."""
    if not dist.is_initialized() or pm.mesh.world_size == 1:
        return None
    for _name, p in sorted(pm.full_parameters().items()):
        local = p.detach().contiguous()
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local)
        if any(not torch.equal(g, gathered[0]) for g in gathered):
            return False
    return True
