"""A plan as text for a terminal and as plain data for tools: the ranked table, why each split won or lost,
the seed's recipe next to the model's choice, the bounds solved from the formulas, and the lint findings.

:func:`build` turns a :class:`~autoshard.planner.search.PlanResult` into a JSON-ready dict; :func:`format_text`
prints that dict. Both views carry the same facts, so ``autoshard plan --json`` loses nothing.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap

import sympy

from autoshard.mesh import AXES
from autoshard.planner import model, units
from autoshard.planner.config import Split
from autoshard.planner.lint import Finding, lint
from autoshard.planner.model import Estimate
from autoshard.planner.search import PlanResult, rule_of_thumb

_COMPONENTS = {"compute": "compute", "tp": "TP all-reduces", "cp": "CP ring attention", "pp": "pipeline sends",
               "ep": "EP all-to-alls", "bubble": "bubble", "dp": "DP all-reduce"}
WIDTH = 110
_FLAGS = {"microbatches": "bubble>5%", "deep-pipeline": "pp>32", "tp-spans-nodes": "tp>node"}

ASSUMPTIONS = (
    "Adam in mixed precision: weights and gradients in the training dtype, 12 bytes per parameter of fp32 master "
    "weights, momentum and variance (8 for fp32 weights), replicated over dp unless the optimizer is sharded",
    "activations per layer: Korthikanti et al. without sequence parallelism, attention scores never stored (flash "
    "attention); full recomputation keeps only each layer's input and adds a forward",
    "the first stage holds the most microbatches in flight: min(m, pp) for 1F1B, min(m, pp + (pp-1)/v) interleaved",
    "communication does not overlap compute; ring collectives on the slowest link a group crosses",
    "stages hold ceil(L/(pp*v)) layers per chunk; the LM head's compute is spread over the stages",
)


# ----------------------------------------------------------------------------------------------------- data


def build(result: PlanResult, *, top: int = 5, alternative: PlanResult | None = None) -> dict:
    """Everything the report says, as JSON-ready data."""
    best = result.best
    shown = result.ranked[:top]
    seed = rule_of_thumb(result.config, result.cluster, shard_optimizer=result.shard_optimizer)
    return {
        "model": {**dataclasses.asdict(result.config), "parameters": result.config.parameters},
        "cluster": {**dataclasses.asdict(result.cluster), "nodes": result.cluster.nodes,
                    "device": result.cluster.device},
        "shard_optimizer": result.shard_optimizer,
        "assumptions": list(ASSUMPTIONS),
        "searched": {"splits": result.evaluated, "meshes_with_a_fitting_split": len(result.ranked),
                     "rejected": dict(result.rejected)},
        "ranked": [_row(result, est, best, i + 1) for i, est in enumerate(shown)],
        "closest_rejected": _estimate(result.closest) if result.closest is not None else None,
        "rule_of_thumb": _seed(result, seed, best),
        "alternative": _alternative(result, alternative),
        "bounds": _bounds(result, best),
        "findings": [f.to_dict() for f in _lint(result, best)],
    }


def _split(split: Split) -> dict:
    return dataclasses.asdict(split)


def _estimate(est: Estimate) -> dict:
    return {"split": _split(est.split), "memory_bytes": est.memory, "memory_limit_bytes": est.memory_limit,
            "memory_parts_bytes": {k: est[f"M_{k}"] for k in ("weights", "grads", "optimizer", "activations")},
            "in_flight": est["in_flight"], "step_time_s": est.step_time, "bubble": est.bubble, "mfu": est["mfu"],
            "breakdown_s": est.breakdown(), "links": est.links}


def _lint(result: PlanResult, est: Estimate) -> list[Finding]:
    s = est.split
    return lint(s.mesh, result.config, result.cluster, s.microbatches, interleave=s.interleave,
                recompute=s.recompute, shard_optimizer=s.shard_optimizer, schedule=s.schedule)


def _row(result: PlanResult, est: Estimate, best: Estimate, rank: int) -> dict:
    findings = _lint(result, est)
    flags = [_FLAGS.get(f.rule, f.rule) for f in findings if f.severity != "info"]
    return {"rank": rank, **_estimate(est), "reason": reason(result, est, best), "flags": flags}


def reason(result: PlanResult, est: Estimate, best: Estimate) -> str:
    """Why ``est`` won (it is ``best``) or by how much and where it lost to ``best``."""
    if est is best:
        parts = {k: v for k, v in est.breakdown().items() if k != "compute" and v > 0}
        overhead = ", ".join(f"{k} {v:.2f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
        runner_up = ""
        if len(result.ranked) > 1:
            second = result.ranked[1]
            runner_up = f"; #2 is {second.step_time / est.step_time - 1:.1%} slower"
        return (f"fastest: {est['t_compute'] * est.split.microbatches:.2f} s compute + "
                f"{est.step_time - est.breakdown()['compute']:.2f} s other ({overhead or 'none'}); "
                f"{_gb(est.memory)} of {_gb(est.memory_limit)} GB{runner_up}")
    delta = est.step_time - best.step_time
    diffs = {k: est.breakdown()[k] - best.breakdown()[k] for k in _COMPONENTS}
    ordered = sorted(diffs.items(), key=lambda kv: -abs(kv[1]))
    big = [(k, d) for k, d in ordered if abs(d) >= 0.25 * abs(delta) and abs(d) >= 0.005 * best.step_time][:3]
    causes = "; ".join(f"{_COMPONENTS[k]} {d:+.2f} s ({_cause(k, est if d > 0 else best, result)})"
                       for k, d in big or ordered[:1])
    return f"{delta / best.step_time:+.1%} ({delta:+.2f} s): {causes}"


def _cause(component: str, est: Estimate, result: PlanResult) -> str:
    """What makes ``component`` cost what it costs in ``est`` (in #1, when #1 pays more for it)."""
    text = _cost_of(component, est, result)
    return f"#1 has {text}" if est is result.best else text


def _cost_of(component: str, est: Estimate, result: PlanResult) -> str:
    s, link = est.split, est.links
    if component == "compute":
        why = ["full recomputation"] if s.recompute == "full" else []
        avg = result.config.layers / s.pp
        if est["n"] > avg + 1e-9:
            why.append(f"{est['n']:.0f} layers on the fullest stage, {avg:.3g} on average")
        return ", ".join(why) or "the LM head and layer split"
    if component == "tp":
        return f"tp={s.tp} over {link.get('tp', 'no link')}"
    if component == "cp":
        return f"cp={s.cp} over {link.get('cp', 'no link')}"
    if component == "pp":
        return f"pp={s.pp}, v={s.interleave} over {link.get('pp', 'no link')}"
    if component == "ep":
        return f"ep={s.ep} over {link.get('ep', 'no link')}"
    if component == "bubble":
        return f"{est.bubble:.1%} idle at pp={s.pp}, m={s.microbatches}, v={s.interleave}"
    return f"dp={s.dp} over {link.get('dp', 'no link')}, {_gb(est['M_grads'])} GB of gradients"


def _seed(result: PlanResult, seed: Estimate | None, best: Estimate) -> dict | None:
    if seed is None:
        return None
    mine = result.find(**{axis: seed.split.mesh.degree(axis) for axis in AXES})
    return {**_estimate(seed), "mesh_rank": result.position_of(mine) if mine is not None else None,
            "reason": reason(result, seed, best)}


def _alternative(result: PlanResult, alternative: PlanResult | None) -> dict | None:
    if alternative is None:
        return None
    best = alternative.best
    return {**_estimate(best), "shard_optimizer": alternative.shard_optimizer,
            "speedup": result.best.step_time / best.step_time}


def _bounds(result: PlanResult, best: Estimate) -> list[dict]:
    s = best.split
    bounds = []
    if s.pp > 1:
        exact = model.solve_for("bubble", sympy.Rational(1, 20), "m")
        need = model.min_microbatches(s.pp, interleave=s.interleave, zero_bubble=s.zero_bubble)
        bounds.append({"quantity": "bubble", "formula": str(model.formula("bubble")),
                       "bound": f"bubble <= 5% when m >= {exact}",
                       "at": {"pp": s.pp, "v": s.interleave, "w": int(s.zero_bubble)},
                       "value": need, "chosen": s.microbatches, "chosen_gives": best.bubble})
    values = model.inputs(result.config, result.cluster, s)
    del values["b"]
    try:
        b_max = model.solve_for("memory", best.memory_limit, "b", **values)
        float(b_max)
    except (NotImplementedError, ValueError, TypeError):  # sympy found no closed form: leave the bound out
        return bounds
    bounds.append({"quantity": "memory", "formula": str(model.formula("memory")),
                   "bound": f"memory <= {_gb(best.memory_limit)} GB when b <= {float(b_max):.3g}",
                   "at": {"split": s.short()}, "value": math.floor(float(b_max)), "chosen": s.microbatch_size,
                   "chosen_gives": best.memory})
    return bounds


# ----------------------------------------------------------------------------------------------------- text


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f}"


def format_text(data: dict, *, formulas: bool = False) -> str:
    """The report for a terminal, about 110 columns wide."""
    prose = ["why:"] + [f"  {row['rank']:>2}  {row['reason']}" + (f"  [{', '.join(row['flags'])}]" if row["flags"]
                                                                     else "") for row in data["ranked"]]
    prose += [""] + _comparisons(data) + [""] + _bound_lines(data) + [""] + _formula_lines(formulas)
    if data["findings"]:
        prose += ["", "checks on #1:"] + [f"  {f['severity']}: {f['message']}. Fix: {f['fix']}"
                                           for f in data["findings"]]
    prose += ["", "assumed: " + "; ".join(data["assumptions"]) + "."]
    lines = [_wrap(line) for line in _header(data)] + [""] + _table(data) + [""] + [_wrap(line) for line in prose]
    return "\n".join(lines)


def _wrap(line: str) -> str:
    """Wrap prose at WIDTH columns, continuation lines indented past the line's own indent and label."""
    if len(line) <= WIDTH:
        return line
    indent = len(line) - len(line.lstrip()) + 6
    return textwrap.fill(line, WIDTH, subsequent_indent=" " * indent, break_on_hyphens=False)


def _header(data: dict) -> list[str]:
    m, c, searched = data["model"], data["cluster"], data["searched"]
    rejected = ", ".join(f"{n:,} {why}" for why, n in searched["rejected"].items()) or "none"
    kv = f" ({m['kv_heads']} kv)" if m["kv_heads"] != m["heads"] else ""
    optimizer = "sharded over dp (ZeRO-1)" if data["shard_optimizer"] else "replicated over dp"
    return [
        f"model    {m['parameters'] / 1e9:.1f}B parameters: {m['layers']} layers, hidden {m['hidden']}, "
        f"{m['heads']} heads{kv}, ffn {m['ffn']}{' gated' if m['gated'] else ''}{_experts(m)}, vocab {m['vocab']}; "
        f"seq {m['seq']}, global batch {m['global_batch']}, {m['dtype_bytes']}-byte dtype; optimizer {optimizer}",
        f"cluster  {c['gpus']} GPUs of {c['device']} = {c['nodes']} node{'s' if c['nodes'] > 1 else ''} x "
        f"{min(c['gpus'], c['gpus_per_node'])}, "
        f"{_gb(c['gpu_memory'])} GB each ({c['usable_memory']:.0%} usable); "
        f"{units.format_rate(c['peak_flops'], 'FLOP/s')} x {c['efficiency']:g}; "
        f"NVLink {units.format_rate(c['intra_bandwidth'], 'B/s')}, {units.format_time(c['intra_latency'])}; "
        f"network {units.format_rate(c['inter_bandwidth'], 'B/s')}, {units.format_time(c['inter_latency'])} per GPU",
        f"searched {searched['splits']:,} splits; {searched['meshes_with_a_fitting_split']} meshes have one that "
        f"fits; rejected: {rejected}",
    ]


_COLUMNS = ("  #   dp  tp  pp  cp     m   b  v zb sp recomp  mem GB  step s  bubble    MFU | compute    tp    cp    pp"
            "  idle    dp")
# a mixture of experts: ep and its all-to-alls, in the same width
_EXPERT_COLUMNS = ("  #   dp  tp  pp  cp  ep    m   b  v zb sp recomp  mem GB  step s  bubble    MFU | compute"
                   "   tp   cp   pp   ep idle   dp")


def _table(data: dict) -> list[str]:
    experts = any(row["split"].get("ep", 1) > 1 for row in data["ranked"])
    header = _EXPERT_COLUMNS if experts else _COLUMNS
    lines = [header, "-" * len(header)]
    for row in data["ranked"]:
        s, t = row["split"], row["breakdown_s"]
        degrees = f"{row['rank']:>3}{s['dp']:>5}{s['tp']:>4}{s['pp']:>4}{s['cp']:>4}"
        degrees += f"{s.get('ep', 1):>4}{s['microbatches']:>5}" if experts else f"{s['microbatches']:>6}"
        times = (f"{t['compute']:>7.2f}{t['tp']:>5.2f}{t['cp']:>5.2f}{t['pp']:>5.2f}{t['ep']:>5.2f}{t['bubble']:>5.2f}"
                 f"{t['dp']:>5.2f}") if experts else \
            f"{t['compute']:>7.2f}{t['tp']:>6.2f}{t['cp']:>6.2f}{t['pp']:>6.2f}{t['bubble']:>6.2f}{t['dp']:>6.2f}"
        lines.append(
            f"{degrees}{s['microbatch_size']:>4}{s['interleave']:>3}{'zb' if s.get('zero_bubble') else '-':>3}"
            f"{'sp' if s.get('sequence_parallel') else '-':>3} "
            f"{s['recompute'] if s['recompute'] != 'none' else '-':<6}"
            f"{_gb(row['memory_bytes']):>8}{row['step_time_s']:>8.2f}{row['bubble']:>8.1%}{row['mfu']:>7.1%} | "
            f"{times}")
    lines.append("columns: m microbatches of b sequences, v chunks per pipeline rank, zb a zero-bubble schedule")
    lines.append("(ZB-H1 at v=1, ZBV at v=2), sp sequence parallelism; times in seconds per step, modelled on "
                 f"{data['cluster']['device']}")
    if experts:
        lines.append("ep: the experts split over ep of the dp ranks, each token's rows sent to their experts and back")
    return lines


def _comparisons(data: dict) -> list[str]:
    lines = []
    seed = data["rule_of_thumb"]
    if seed is None:
        lines.append("seed's recipe (tp = node, pp = fewest stages that fit, dp = rest): finds nothing that fits")
    else:
        where = f"its mesh ranks #{seed['mesh_rank']}" if seed["mesh_rank"] else "its mesh is not in the ranking"
        lines += ["seed's recipe (tp = GPUs per node, pp = fewest stages that fit, dp = the rest, b = 1):",
                  f"  {Split(**seed['split']).short()}: {seed['step_time_s']:.2f} s, {_gb(seed['memory_bytes'])} GB; "
                  f"{where}", f"  vs #1: {seed['reason']}"]
    alt = data["alternative"]
    if alt is not None:
        what = "sharded over dp (ZeRO-1)" if alt["shard_optimizer"] else "replicated"
        lines.append(f"with the optimizer state {what}: best {Split(**alt['split']).short()}, "
                     f"{alt['step_time_s']:.2f} s ({alt['speedup']:.2f}x the step rate of #1), "
                     f"{_gb(alt['memory_bytes'])} GB")
    return lines


def _bound_lines(data: dict) -> list[str]:
    lines = ["bounds for #1, solved from the formulas:"]
    for b in data["bounds"]:
        if b["quantity"] == "bubble":
            at = ", ".join(f"{k}={v}" for k, v in b["at"].items())
            lines.append(f"  {b['bound']}: m >= {b['value']} at {at}; chosen m={b['chosen']} gives "
                         f"{b['chosen_gives']:.1%}")
        else:
            lines.append(f"  {b['bound']}: at most b={b['value']} sequences per microbatch; chosen b={b['chosen']} "
                         f"uses {_gb(b['chosen_gives'])} GB")
    return lines


def _formula_lines(everything: bool) -> list[str]:
    names = list(model.FORMULAS) if everything else ["t_step", "t_microbatch", "bubble", "memory", "M_activations"]
    lines = ["formulas (per GPU of the first stage" + ("" if everything else "; --formulas prints all") + "):"]
    for name in names:
        expr, meaning = model.FORMULAS[name]
        lines.append(f"  {name} = {sympy.sstr(expr)}    # {meaning}")
    if everything:
        lines.append("  symbols: " + "; ".join(f"{k} {v}" for k, v in model.SYMBOLS.items()))
    return lines


def _experts(m: dict) -> str:
    if m.get("experts", 1) == 1:
        return ""
    return f" x {m['experts']} experts ({m['experts_per_token']} per token)"
