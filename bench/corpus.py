"""The architecture corpus at every mesh: which models nobody here wrote does autoshard train exactly?

    .venv/bin/python bench/corpus.py                     # or: make corpus (all of it; about an hour)
    .venv/bin/python bench/corpus.py --meshes tp2 dp2    # some meshes
    .venv/bin/python bench/corpus.py --only llama gpt2   # some architectures
    .venv/bin/python bench/corpus.py --limit 20          # the first 20 architectures
    .venv/bin/python bench/corpus.py --planned           # only the planned tp=2 / tp=4 parameter shares (minutes)
    .venv/bin/python bench/corpus.py --writes            # only the writes sweep (tests/corpus/writes.py; minutes)
    .venv/bin/python bench/corpus.py --programs new.json --against old.json --meshes tp2 cp2 tp2sp
                                                         # every rank's program fingerprinted, and compared

Every architecture of ``tests/corpus`` (every causal LM of the installed transformers, a few masked-LM and
encoder-decoder families, torch's own transformer modules) is first built and trained eagerly at tiny size;
those that cannot be are listed with the reason and not counted. Each of the rest is run through
``autoshard.verify`` (3 SGD steps, every gradient) at dp=2, tp=2, pp=2, cp=2 and dp2 x tp2 x pp2 (2
microbatches where pp > 1), and classified exact / wrong / refused / crash (``tests/corpus/cells.py``).

Resumable: each cell's result is cached in ``bench/corpus.json`` (keyed by architecture and mesh, with the
transformers and torch versions; another version starts afresh), so an interrupted run continues where it
stopped and ``--rerun`` recomputes cells. Cost: one pool of worker processes per world size, reused by
every cell; a pool is restarted only after a cell that crashed or stalled (its groups may be left
mid-collective). ``bench/corpus.md`` is rewritten after every cell.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
# tests/ first: its package ``corpus`` must win over this file's own name.
sys.path[:0] = [str(REPO / "tests")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from conftest import Pools as SessionPools  # noqa: E402
from corpus import cells  # noqa: E402
from corpus.architectures import check_eager, names  # noqa: E402

from harness.launcher import WorkerPool, WorkerTimeout  # noqa: E402

ORDER = ("tp2", "dp2", "pp2", "cp2", "dp2xtp2xpp2")  # the meshes (tests/corpus/cells.py), in the order a run fills
# run only when asked (--meshes tp4 --only ...)
EXTRA = ("tp4", "cp2ring", "cp2alltoall", "pp2zbv", "tp2sp", "ep2", "ep2xtp2", "dp2xep2xpp2", "pp2xcp2", "pp2xcp2il")
WHAT = {"tp4": "the mixtures of experts", "cp2ring": "ring attention, load balanced",
        "cp2alltoall": "all-to-all attention, load balanced",
        "pp2zbv": "the zero-bubble V schedule, 4 microbatches (4 stages: the backward split into input and weight "
                  "gradients)",
        "tp2sp": "sequence parallelism: the sequence split over tp between the tensor-parallel regions",
        "ep2": "expert parallelism: the experts split over the two dp ranks, tokens sent to their experts",
        "ep2xtp2": "expert parallelism over dp=2 with every expert split over tp=2 too",
        "dp2xep2xpp2": "expert parallelism over dp=2 inside each of two pipeline stages, 2 microbatches",
        "pp2xcp2": "two pipeline stages, each one's sequence split over cp=2 (what a stage hands on stays split), "
                   "2 microbatches",
        "pp2xcp2il": "interleaved 1F1B over pp=2 x cp=2: two chunks per rank (four stages, cut more finely), "
                     "2 microbatches"}
WRITES = ("pp2", "pp2zbv", "dp2xtp2xpp2", "cp2", "tp2sp")  # the meshes the writes sweep builds every rank of
WRITES_VERSION = 2  # a sweep made before the passes kept every write is run again (without --rerun too)
PLANNED = (2, 4)  # tp degrees whose per-rank parameter share is planned (one process, no run)
SLACK = 0.02  # above 1/tp and what is replicated on purpose
TIMEOUT = {2: 480.0, 4: 600.0, 8: 900.0}  # seconds before a cell counts as stalled, by world size
STATUSES = ("exact", "wrong", "refused", "crash")


def versions() -> dict[str, str]:
    import torch
    import transformers

    return {"transformers": transformers.__version__, "torch": torch.__version__}


def load(path: Path) -> dict:
    """The cached results, or an empty cache when absent or from other library versions."""
    fresh = {**versions(), "unbuildable": {}, "buildable": [], "cells": {}}
    if not path.exists():
        return fresh
    cache = json.loads(path.read_text())
    return cache if all(cache.get(k) == v for k, v in versions().items()) else fresh


def save(cache: dict, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cache, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


def sort_buildable(cache: dict, selected: list[str], path: Path, recheck: bool = False) -> list[str]:
    """Train each selected architecture eagerly once (cached): the buildable ones, in corpus order."""
    if recheck:
        cache["buildable"] = [n for n in cache["buildable"] if n not in selected]
        cache["unbuildable"] = {n: r for n, r in cache["unbuildable"].items() if n not in selected}
    known = set(cache["buildable"]) | set(cache["unbuildable"])
    for name in selected:
        if name in known:
            continue
        reason = check_eager(name)
        if reason is None:
            cache["buildable"].append(name)
        else:
            cache["unbuildable"][name] = reason
        print(f"eager {name}: {reason or 'ok'}", flush=True)
        save(cache, path)
    return [n for n in selected if n in cache["buildable"]]


class Pools(SessionPools):
    """The test session's pools, but one world at a time (two cores: never keep two worlds of idle workers), and a
    pool is dropped after a cell that may have left its groups unusable."""

    def get(self, world: int) -> WorkerPool:
        for other in [w for w in self._pools if w != world]:
            self._pools.pop(other).close()
        return super().get(world)

    def discard(self, world: int) -> None:
        pool = self._pools.pop(world, None)
        if pool is not None:
            pool.broken = True
            pool.close()


def run_one(pools: Pools, name: str, label: str) -> dict:
    """One cell: its outcome as plain data, with the wall time."""
    mesh, options = cells.MESHES[label]
    world = cells.world_size(label)
    timeout = TIMEOUT[world]
    start = time.monotonic()
    try:
        results = pools.get(world).run(cells.run_cell, name, mesh, timeout=timeout, **options)
        found = cells.outcome(results)
    except WorkerTimeout as e:
        found = cells.Outcome("crash", f"stalled: no result within {timeout:.0f} s ({str(e).splitlines()[0]})")
        results = []
    except Exception as e:  # noqa: BLE001 - a worker that died: the cell crashed, the run goes on
        found = cells.Outcome("crash", f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
        results = []
    if found.status == "crash":
        pools.discard(world)
    detail = next((r.get("traceback") or r.get("report") for r in results if r.get("traceback") or r.get("report")),
                  None)
    return {"status": found.status, "message": found.message, "max_abs": found.max_abs, "share": found.share,
            "seconds": round(time.monotonic() - start, 1), "detail": detail}


def planned_share(name: str, tp: int) -> dict:
    """The parameter bytes rank 0 would hold at ``tp`` (planned in this process, nothing run), over the bytes of the
    parameters the model's loss uses; and the most it should hold: 1/tp, plus what stays whole on purpose (norm
    weights and biases, kv heads the degree does not divide, each held whole instead of 1/tp), plus 2%."""
    import warnings

    from corpus.architectures import build

    from autoshard.compile import compile_global_batch
    from autoshard.mesh import Mesh
    from autoshard.options import CompileOptions

    case = build(name)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            built = compile_global_batch(case.model, case.inputs, Mesh(tp=tp), 0, CompileOptions(),
                                         target=case.target, loss_fn=case.loss_fn)
    except Exception as e:  # noqa: BLE001 - a refusal (heads the degree does not divide) is the cell's result
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    full = dict(built.captured.gm.named_parameters())
    local = {n: p for program in built.programs.values() for n, p in program.gm.named_parameters()}
    size = lambda p: p.numel() * p.element_size()  # noqa: E731
    total = sum(size(full[n]) for n in local)
    whole = sum(_held_whole(built.tp_plan.params[n], full[n]) * size(full[n]) for n in local)
    return {"share": sum(size(p) for p in local.values()) / total,
            "allowed": 1 / tp + whole / total * (1 - 1 / tp) + SLACK}


def _held_whole(planned, full) -> float:
    """The part of a parameter every rank holds whole on purpose: a norm weight, a bias, duplicated kv heads (a
    k or v projection kept whole, or a fused projection's k and v blocks)."""
    if planned.role == "replicated":
        return float(full.dim() <= 1 or planned.reason.startswith("heads duplicated"))
    placement = getattr(planned.placement, "whole", ())
    return sum(planned.placement.blocks[i] for i in placement) / sum(planned.placement.blocks) if placement else 0.0


def writes_of(name: str) -> dict:
    """The writes sweep of ``name`` at every mesh of ``WRITES`` (one process, nothing run)."""
    from corpus.architectures import build
    from corpus.writes import sweep

    found = {}
    for label in WRITES:
        if found and all(r.get("writers") == 0 for r in found.values()):  # the graph is the same at every mesh
            found[label] = {"writers": 0, "programs": 0, "lost": []}
            continue
        case = build(name)
        found[label] = sweep(case.model, case.inputs, case.target, case.loss_fn, *cells.MESHES[label])
    return found


def fingerprints(buildable: list[str], meshes: list[str], path: Path, against: Path | None) -> None:
    """Fingerprint each architecture's programs at each mesh into ``path`` (resumable), and print every cell whose
    fingerprint differs from ``against``'s: the cells a change moved, to be run again."""
    from corpus.architectures import build
    from corpus.programs import fingerprint

    found = json.loads(path.read_text()) if path.exists() else {}
    old = json.loads(against.read_text()) if against else {}
    moved = []
    for name in buildable:
        for label in meshes:
            if label not in found.setdefault(name, {}):
                case = build(name)
                found[name][label] = fingerprint(case.model, case.inputs, case.target, case.loss_fn,
                                                 *cells.MESHES[label])
                save(found, path)  # through a temporary file: a run stopped mid-write keeps what it had
            if label in old.get(name, {}) and old[name][label] != found[name][label]:
                moved.append(f"{label} {name}")
            print(f"programs {label:12s} {name:28s} {'MOVED' if moved and moved[-1] == f'{label} {name}' else ''}",
                  flush=True)
    if against:
        compared = sum(1 for n in buildable for m in meshes if m in old.get(n, {}))
        print(f"{compared} cells compared, {len(moved)} moved" + "".join(f"\n  {m}" for m in moved))


def writes_summary(cache: dict, buildable: list[str]) -> list[str]:
    swept = [n for n in buildable if n in cache.get("writes", {})]
    if not swept:
        return []
    rows = [cache["writes"][n][m] for n in swept for m in WRITES]
    lost = [(n, m, cache["writes"][n][m]["lost"]) for n in swept for m in WRITES if cache["writes"][n][m].get("lost")]
    written = [n for n in swept if any(cache["writes"][n][m].get("writers") for m in WRITES)]
    lines = [f"The writes sweep (`--writes`: every rank's program at {', '.join(WRITES)}, built in one process): "
             f"{len(swept)} architectures, {len(written)} of them with in-place writes in the capture, "
             f"{sum(r.get('programs', 0) for r in rows)} programs checked, {sum(1 for r in rows if 'error' in r)} "
             f"meshes refused, **{sum(len(x) for _, _, x in lost)} writes lost**."]
    lines += [f"- {n} at {m}: {x[0]}" for n, m, x in lost]
    return lines


def planned_summary(cache: dict, buildable: list[str]) -> list[str]:
    lines = []
    for tp in PLANNED:
        cells = [cache.get("planned", {}).get(n, {}).get(f"tp{tp}") for n in buildable]
        ran = [c for c in cells if c is not None]
        within = [c for c in ran if "share" in c and c["share"] <= c["allowed"]]
        shares = sorted(c["share"] for c in ran if "share" in c)
        if ran:
            lines.append(f"- tp={tp}: {len(within)} of {len(ran)} within the bound; median share "
                         f"{shares[len(shares) // 2]:.3f}; {len(ran) - len(shares)} refused")
    return lines


def _cell_text(cell: dict | None) -> str:
    if cell is None:
        return "not run"
    text = cells.Outcome(cell["status"], cell["message"], cell["max_abs"]).text()
    return text.replace("|", "/").replace("\n", " ")[:110]


def _planned_text(cell: dict | None) -> str:
    if cell is None:
        return ""
    if "share" not in cell:
        return "refused: " + cell["error"].replace("|", "/")[:90]
    return f"{cell['share']:.2f} ({cell['allowed']:.2f}){' !' if cell['share'] > cell['allowed'] else ''}"


def summary(cache: dict, buildable: list[str]) -> list[str]:
    """The summary lines: architectures exact at every mesh, then the counts per mesh."""
    rows = cache["cells"]
    complete = [n for n in buildable if all(m in rows.get(n, {}) for m in ORDER)]
    exact = [n for n in complete if all(rows[n][m]["status"] == "exact" for m in ORDER)]
    ran = [m for m in ORDER if any(m in rows.get(n, {}) for n in buildable)]
    so_far = [n for n in buildable if all(rows.get(n, {}).get(m, {}).get("status") == "exact" for m in ran)]
    lines = [f"**{len(exact)} of {len(buildable)} architectures exact at every mesh** "
             f"({len(complete)} of {len(buildable)} run at every mesh so far; {len(so_far)} of {len(buildable)} "
             f"exact at every mesh run so far: {', '.join(ran)}).", ""]
    lines += ["| mesh | run | exact | wrong | refused | crash | not run |", "|---|---|---|---|---|---|---|"]
    for m in ORDER:
        got = [rows[n][m]["status"] for n in buildable if m in rows.get(n, {})]
        counts = " | ".join(str(got.count(s)) for s in STATUSES)
        lines.append(f"| {m} | {len(got)} | {counts} | {len(buildable) - len(got)} |")
    shares = sorted((rows[n]["pp2"]["share"], n) for n in buildable
                    if rows.get(n, {}).get("pp2", {}).get("share") is not None)
    if shares:
        within = sum(share <= 0.6 for share, _ in shares)
        median = shares[len(shares) // 2][0]
        lines += ["", f"pp2 share: {within} of {len(shares)} at 0.60 or less; median {median:.2f}, "
                      f"largest {shares[-1][0]:.2f} ({shares[-1][1]})."]
    return lines


def write_table(cache: dict, every: list[str], path: Path) -> None:
    """``bench/corpus.md``: the summary, one row per buildable architecture, then the unbuildable ones."""
    buildable = [n for n in every if n in cache["buildable"]]
    rows = cache["cells"]
    lines = [
        "# The architecture corpus", "",
        f"transformers {cache['transformers']}, torch {cache['torch']}. Written by `bench/corpus.py` "
        "(`make corpus`); each cell is `autoshard.verify` (3 SGD steps, every gradient, fp32 tolerances) of the "
        "tiny architecture at that mesh: exact / wrong by the largest difference / refused with autoshard's "
        "error / crash (an internal error, a stall, or ranks that disagree). \"tp2 share\" is the bytes of the "
        "parameters the largest rank holds over the whole model's at tp=2 (0.50 is the aim); \"pp2 share\" the "
        "same for the pp rank that stores most at pp=2 (a weight spread over the pp ranks counts its rows; 0.60 is "
        "the bound). \"not run\" cells were not run yet.",
        "", *summary(cache, buildable), "",
        "\"tp4 share (planned)\" is planned in one process (`--planned`), over the parameters the loss uses: the "
        "share, then in brackets the most a rank should hold (1/tp, plus norm weights, biases and kv heads the degree "
        "does not divide held whole, plus 2%), with ! where the share is above it. Planned the same way:", "",
        *planned_summary(cache, buildable), "", *writes_summary(cache, buildable), "",
        "| architecture | " + " | ".join(ORDER) + " | tp2 share | pp2 share | tp4 share (planned) |",
        "|---|" + "---|" * (len(ORDER) + 3),
    ]
    for name in buildable:
        row = rows.get(name, {})
        shares = [row.get(mesh, {}).get("share") for mesh in ("tp2", "pp2")]
        cols = [_cell_text(row.get(m)) for m in ORDER] + [f"{s:.2f}" if s is not None else "" for s in shares]
        cols.append(_planned_text(cache.get("planned", {}).get(name, {}).get("tp4")))
        lines.append(f"| {name} | " + " | ".join(cols) + " |")
    for mesh in EXTRA:
        ran = [n for n in buildable if mesh in rows.get(n, {})]
        if ran:
            statuses = [rows[n][mesh]["status"] for n in ran]
            lines += ["", f"## {mesh}, run on {len(ran)} architectures ({WHAT[mesh]}): "
                      + ", ".join(f"{statuses.count(s)} {s}" for s in STATUSES if statuses.count(s)), "",
                      f"| architecture | {mesh} | {mesh} share |", "|---|---|---|"]
            lines += [f"| {n} | {_cell_text(rows[n][mesh])} | {rows[n][mesh]['share'] or 0:.2f} |" for n in ran]
    unbuildable = [n for n in every if n in cache["unbuildable"]]
    lines += ["", f"## Not counted: {len(unbuildable)} architectures that do not build or train eagerly at tiny size",
              "", "| architecture | reason |", "|---|---|"]
    lines += [f"| {n} | {cache['unbuildable'][n].replace('|', '/')[:200]} |" for n in unbuildable]
    unchecked = [n for n in every if n not in buildable and n not in unbuildable]
    if unchecked:
        lines += ["", f"Not built yet: {', '.join(unchecked)}."]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="architectures to run (names as in the table)")
    parser.add_argument("--meshes", nargs="*", choices=list(ORDER + EXTRA), default=list(ORDER))
    parser.add_argument("--limit", type=int, help="run only the first N architectures")
    parser.add_argument("--rerun", action="store_true", help="recompute cells already in the cache")
    parser.add_argument("--rerun-status", nargs="*", default=[], choices=STATUSES,
                        help="recompute the cached cells of these statuses (after a fix)")
    parser.add_argument("--recheck", action="store_true", help="build and train the selection eagerly again")
    parser.add_argument("--planned", action="store_true",
                        help="only plan the selection at tp=2 and tp=4 and record each rank's parameter share")
    parser.add_argument("--writes", action="store_true",
                        help="only sweep the selection for in-place writes its rank programs lose")
    parser.add_argument("--programs", type=Path, metavar="JSON",
                        help="only fingerprint every rank's programs at --meshes into JSON (tests/corpus/programs.py)")
    parser.add_argument("--against", type=Path, metavar="JSON",
                        help="with --programs: list the cells whose fingerprint differs from this earlier file")
    parser.add_argument("--cache", type=Path, default=BENCH / "corpus.json")
    parser.add_argument("--out", type=Path, default=BENCH / "corpus.md")
    args = parser.parse_args(argv)
    if args.programs and os.environ.get("PYTHONHASHSEED") != "0":
        # transformers builds some graphs by iterating a set of strings (Gemma's rotary embedding per layer type),
        # whose order Python's per-process hash seed picks: without a fixed seed, one program prints in either order
        os.execve(sys.executable, [sys.executable, __file__, *(sys.argv[1:] if argv is None else argv)],
                  {**os.environ, "PYTHONHASHSEED": "0"})
    cache = load(args.cache)
    every = names()
    selected = [n for n in every if not args.only or n in args.only][: args.limit]
    buildable = sort_buildable(cache, selected, args.cache, args.recheck)
    write_table(cache, every, args.out)
    if args.planned:
        for name in buildable:
            cache.setdefault("planned", {})[name] = {f"tp{tp}": planned_share(name, tp) for tp in PLANNED}
            print(f"planned {name:28s} {cache['planned'][name]}", flush=True)
            save(cache, args.cache)
            write_table(cache, every, args.out)
        return
    if args.programs:
        return fingerprints(buildable, args.meshes, args.programs, args.against)
    if args.writes:
        for name in buildable:
            if cache.get("writes_swept", {}).get(name) == WRITES_VERSION and not args.rerun:
                continue
            cache.setdefault("writes", {})[name] = writes_of(name)
            cache.setdefault("writes_swept", {})[name] = WRITES_VERSION
            print(f"writes {name:28s} " + " ".join(f"{m}:{r.get('writers', 'refused')}/{len(r.get('lost', []))}"
                                                   for m, r in cache["writes"][name].items()), flush=True)
            save(cache, args.cache)
            write_table(cache, every, args.out)
        return
    pools = Pools()
    try:
        for label in [m for m in ORDER + EXTRA if m in args.meshes]:
            for name in buildable:
                row = cache["cells"].setdefault(name, {})
                if label in row and not args.rerun and row[label]["status"] not in args.rerun_status:
                    continue
                row[label] = run_one(pools, name, label)
                print(f"{label:12s} {name:28s} {row[label]['seconds']:6.1f}s  "
                      f"{cells.Outcome(**{k: row[label][k] for k in ('status', 'message', 'max_abs')}).text()}",
                      flush=True)
                save(cache, args.cache)
                write_table(cache, every, args.out)
    finally:
        pools.close()


if __name__ == "__main__":
    main()
