"""Worker: capture one Llama-style shape on the ``meta`` device and report time, graph size and peak RSS.

    python bench/compile_time.py --layers 32 --hidden 4096 --heads 32 --kv-heads 32 --ffn 11008 \\
        --vocab 32000 --seq 2048

Prints one JSON line (and writes it to ``--out`` when given). The model, tokens and target live on the
``meta`` device, so nothing of the model's size is allocated: the process's peak resident memory
(``resource.getrusage``) stays near what importing torch costs, whatever the parameter count. Run one
shape per process so the peak is per shape.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import torch
from common import REPO  # noqa: F401 - importing common puts tests/ on sys.path

import autoshard

from harness.models import build_llama_model, token_loss


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far, in MiB (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def measure(args: argparse.Namespace) -> dict:
    """Build the shape on meta and capture it with its loss; times and memory of each phase."""
    rss_after_import = peak_rss_mib()
    start = time.perf_counter()
    model = build_llama_model(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, n_kv_head=args.kv_heads,
                              vocab=args.vocab, seq=args.seq, ffn=args.ffn, device="meta")
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device="meta")
    target = torch.randint(0, args.vocab, (args.batch, args.seq), device="meta")
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    captured = autoshard.capture(model, (tokens,), loss_fn=token_loss, example_target=target)
    capture_s = time.perf_counter() - start
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "all_meta": all(p.is_meta for p in captured.gm.parameters()),
        "nodes": captured.num_nodes,
        "build_s": build_s,
        "capture_s": capture_s,
        "rss_after_import_mib": rss_after_import,
        "peak_rss_mib": peak_rss_mib(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("layers", "hidden", "heads", "kv-heads", "ffn", "vocab", "seq"):
        parser.add_argument(f"--{name}", type=int, required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    text = json.dumps(measure(args))
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
