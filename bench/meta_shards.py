"""A model larger than one rank's share, built on ``meta``: each rank allocates only its own shards.

    .venv/bin/python bench/meta_shards.py          # writes bench/results_meta.md and prints it

Launches 2 ranks with torchrun, twice; each builds a GPT of several GB on the meta device and
parallelizes it at tp=2 (capture, plan and codegen on meta). The first run materialises its shards
with zeros (the checkpoint route: every page is touched, a checkpoint would fill them); the second
runs the model's own initialiser on its shards (``pm.materialize(init=GPT._init_weights)``, module by
module). Each reports its parameter bytes and peak resident memory against the whole model's size.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = {"n_layer": 8, "n_embd": 4096, "n_head": 32, "vocab": 32000, "seq": 128}


def worker() -> None:
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    import autoshard

    from harness.models import GPT, build_gpt_model, token_loss

    torch.set_num_threads(1)
    model = build_gpt_model(**SHAPE, device="meta")
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    tokens = torch.zeros(1, SHAPE["seq"], dtype=torch.long, device="meta")
    start = time.perf_counter()
    pm = autoshard.parallelize(model, autoshard.Mesh(tp=2), example_inputs=(tokens,), loss_fn=token_loss,
                               target=tokens)
    compiled = time.perf_counter() - start
    start = time.perf_counter()
    allocated = pm.materialize("cpu", init=GPT._init_weights if "--init" in sys.argv else None)
    filled = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    largest = max(sum(p.numel() * p.element_size() for p in m.parameters(recurse=False)) for m in model.modules())
    if int(os.environ["RANK"]) == 0:
        print(json.dumps({"full": full, "allocated": allocated, "peak_rss": peak, "compile_s": compiled,
                          "materialize_s": filled, "largest_module": largest}))


def run(*flags: str) -> dict:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    torchrun = Path(sys.executable).with_name("torchrun")
    done = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", __file__, "--worker", *flags],
                          env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    line = next((x for x in done.stdout.splitlines() if x.startswith("{")), None)
    if line is None:
        raise RuntimeError(f"the worker failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(line)


def main() -> None:
    gib = 2**30
    rows = []
    for label, flags in (("zeros, for a checkpoint to fill", ()), ("the model's own initialiser", ("--init",))):
        r = run(*flags)
        rows.append(
            f"| {label} | {r['full'] / gib:.2f} GiB | {r['allocated'] / gib:.2f} GiB ({r['allocated'] / r['full']:.2f} "
            f"of it) | {r['largest_module'] / gib:.2f} GiB | {r['peak_rss'] / gib:.2f} GiB | {r['compile_s']:.1f} s | "
            f"{r['materialize_s']:.1f} s |"
        )
    text = "\n".join([
        "# A model bigger than its share, built on meta",
        "",
        "command: `.venv/bin/python bench/meta_shards.py`",
        "",
        f"GPT of tests/harness/models.py on `meta`: {SHAPE['n_layer']} layers, hidden {SHAPE['n_embd']}, "
        f"vocab {SHAPE['vocab']} (tied embedding / LM head), fp32; tp=2 on 2 processes; rank 0's figures.",
        "",
        "| shards filled with | whole model | parameters allocated on rank 0 (tp=2) | largest module | peak RSS of "
        "rank 0 | parallelize() on meta | materialize() |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        *rows,
        "",
        "Each of the 2 ranks compiles the whole model on the `meta` device (capture, plan, codegen), then",
        "`pm.materialize()` allocates only its own shards. With zeros every page is resident and a checkpoint",
        "would fill them (`pm.load_checkpoint`). With `init=GPT._init_weights` each module's own parameters",
        "are allocated at full size one module at a time, initialised, and cut to this rank's shard: the peak is",
        "about the zeros run plus the largest module (the embedding table here) and a copy of its shard; every rank",
        "draws the random numbers of the whole model, so the result equals the unsharded initialisation after the",
        "same seed. The whole model is never allocated anywhere.",
    ])
    (ROOT / "bench" / "results_meta.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    worker() if "--worker" in sys.argv else main()
