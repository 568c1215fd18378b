"""Saving and resuming a training run of several GB: parameters and AdamW's state, written per rank, read elsewhere.

    .venv/bin/python bench/checkpoint.py          # writes bench/results_checkpoint.md and prints it

Launches 2 ranks with torchrun three times. Each builds a GPT on the meta device and allocates only its
shards (``pm.materialize``). The first, at tp=2, gives AdamW its state (one step on zero gradients: both
moments and the step count exist), saves a checkpoint with the optimizer (timed), then saves again in the
background (``asynchronous=True``: the time training is blocked, and the time until the write is done),
and reports the bytes each rank wrote. The second loads the checkpoint at pp=2 (another layout: every
tensor is read from the other mesh's shards) and the third at tp=2 (the same mesh), timed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = {"n_layer": 4, "n_embd": 3072, "n_head": 24, "vocab": 32000, "seq": 128}


def _parallel(mesh_kwargs: dict):
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    import autoshard

    from harness.models import build_gpt_model, token_loss

    torch.set_num_threads(1)
    model = build_gpt_model(**SHAPE, device="meta")
    tokens = torch.zeros(2, SHAPE["seq"], dtype=torch.long, device="meta")
    options = {"microbatches": 2} if mesh_kwargs.get("pp", 1) > 1 else {}
    pm = autoshard.parallelize(model, autoshard.Mesh(**mesh_kwargs), example_inputs=(tokens,), loss_fn=token_loss,
                               target=tokens, **options)
    pm.materialize("cpu")
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    return pm, torch.optim.AdamW(pm.parameters(), lr=1e-4, weight_decay=0.1), full


def save(path: str) -> dict:
    import torch

    pm, opt, full = _parallel({"tp": 2})
    for p in pm.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    held = sum(p.numel() * p.element_size() for p in pm.parameters())
    start = time.perf_counter()
    pm.save_checkpoint(path, optimizer=opt, extra={"step": 1})
    saved = time.perf_counter() - start
    start = time.perf_counter()
    future = pm.save_checkpoint(path + "-async", optimizer=opt, extra={"step": 1}, asynchronous=True)
    blocked = time.perf_counter() - start
    future.result()
    done = time.perf_counter() - start
    written = sum(f.stat().st_size for f in Path(path).glob(f"__{pm.rank}_*.distcp"))
    return {"full": full, "held": held, "save_s": saved, "async_blocked_s": blocked, "async_done_s": done,
            "written": written}


def load(path: str, mesh_kwargs: dict) -> dict:
    pm, opt, _ = _parallel(mesh_kwargs)
    start = time.perf_counter()
    extra = pm.load_checkpoint(path, optimizer=opt)
    loaded = time.perf_counter() - start
    moments = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if v.dim() > 0)
    return {"load_s": loaded, "moments": moments, "step": extra["step"]}


def worker() -> None:
    what, path = sys.argv[sys.argv.index("--worker") + 1:][:2]
    result = save(path) if what == "save" else load(path, json.loads(what))
    print(json.dumps({"rank": int(os.environ["RANK"]), **result}), flush=True)


def run(what: str, path: str) -> list[dict]:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    torchrun = Path(sys.executable).with_name("torchrun")
    done = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", __file__, "--worker", what, path],
                          env=env, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    if len(lines) != 2:
        raise RuntimeError(f"the workers failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return sorted(lines, key=lambda r: r["rank"])


def main() -> None:
    gib = 2**30
    scratch = tempfile.mkdtemp(prefix="autoshard-ckpt-")
    path = os.path.join(scratch, "ckpt")
    try:
        saved = run("save", path)
        to_pp = run(json.dumps({"pp": 2}), path)
        to_tp = run(json.dumps({"tp": 2}), path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    full = saved[0]["full"]
    state = 3 * full  # parameters, exp_avg, exp_avg_sq (fp32)
    rows = [
        f"| rank {r['rank']} | {r['held'] / gib:.2f} GiB | {r['written'] / gib:.2f} GiB ({r['written'] / state:.2f} "
        f"of the state) | {r['save_s']:.1f} s | {r['async_blocked_s']:.1f} s / {r['async_done_s']:.1f} s | "
        f"{p['load_s']:.1f} s | {t['load_s']:.1f} s |"
        for r, p, t in zip(saved, to_pp, to_tp, strict=True)
    ]
    total = sum(r["written"] for r in saved)
    text = "\n".join([
        "# Checkpoints of a training run: parameters and AdamW state",
        "",
        "command: `.venv/bin/python bench/checkpoint.py`",
        "",
        f"GPT of tests/harness/models.py built on `meta`: {SHAPE['n_layer']} layers, hidden {SHAPE['n_embd']}, vocab "
        f"{SHAPE['vocab']} (tied embedding / LM head), fp32: {full / gib:.2f} GiB of parameters, "
        f"{state / gib:.2f} GiB with AdamW's two moments. Saved at tp=2 on 2 processes (one thread each), "
        "loaded at pp=2 (resharded) and at tp=2.",
        "",
        "| rank | parameters held | written | save | async save: blocked / written | load at pp=2 | load at tp=2 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        *rows,
        "",
        f"Both ranks wrote {total / gib:.2f} GiB together ({total / state:.2f} of parameters plus moments): each "
        "rank writes only its shards, and a tensor replicated over tp (norms, biases of row-parallel layers) once.",
        "Under pp=2 each rank reads only the tensors of its stages, cut from the tp=2 shards of the checkpoint.",
        "The asynchronous save blocks training only while it copies the shards to host memory.",
    ])
    (ROOT / "bench" / "results_checkpoint.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    worker() if "--worker" in sys.argv else main()
