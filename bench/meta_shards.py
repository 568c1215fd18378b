"""A model larger than one rank's share, built on ``meta``: each rank allocates only its own shards.

    .venv/bin/python bench/meta_shards.py

Launches 2 ranks with torchrun; each builds a GPT of several GB on the meta device, parallelizes it at
tp=2 (capture, plan and codegen on meta), materialises its shards with zeros (so every page is really
touched) and reports its parameter bytes and peak resident memory against the whole model's size.
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

    from models import build_gpt_model, token_loss

    torch.set_num_threads(1)
    model = build_gpt_model(**SHAPE, device="meta")
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    tokens = torch.zeros(1, SHAPE["seq"], dtype=torch.long, device="meta")
    start = time.perf_counter()
    pm = autoshard.parallelize(model, autoshard.Mesh(tp=2), example_inputs=(tokens,), loss_fn=token_loss,
                               target=tokens)
    compiled = time.perf_counter() - start
    allocated = pm.materialize("cpu")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if int(os.environ["RANK"]) == 0:
        print(json.dumps({"full": full, "allocated": allocated, "peak_rss": peak, "compile_s": compiled}))


def main() -> None:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    torchrun = Path(sys.executable).with_name("torchrun")
    done = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", __file__, "--worker"],
                          env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    line = next(x for x in done.stdout.splitlines() if x.startswith("{"))
    r = json.loads(line)
    gib = 2**30
    table = (
        "| model (GPT on meta) | whole model, fp32 | parameters allocated on rank 0 (tp=2) | peak RSS of rank 0 | "
        "parallelize() on meta |\n| --- | ---: | ---: | ---: | ---: |\n"
        f"| {SHAPE['n_layer']} layers, hidden {SHAPE['n_embd']}, vocab {SHAPE['vocab']} | {r['full'] / gib:.2f} GiB | "
        f"{r['allocated'] / gib:.2f} GiB ({r['allocated'] / r['full']:.2f} of it) | {r['peak_rss'] / gib:.2f} GiB | "
        f"{r['compile_s']:.1f} s |"
    )
    print(f"command: `.venv/bin/python bench/meta_shards.py`\n\n{table}")


if __name__ == "__main__":
    worker() if "--worker" in sys.argv else main()
