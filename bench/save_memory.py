"""Peak memory of each rank while ``pm.save_pretrained`` writes an HF Llama from a dp x tp x pp mesh.

    .venv/bin/python bench/save_memory.py        # writes bench/results_save_memory.md and prints it

One ``torchrun --nproc-per-node 4`` job (this script with ``--worker``): an HF ``LlamaForCausalLM`` (hidden 1024,
8 layers, vocab 32000: 0.24 B parameters, 0.94 GB in fp32) built on ``meta``, parallelized over tp=2 x pp=2 and
materialized, so each rank allocates only its shards; then ``save_pretrained`` into files of at most 200 MB. A
thread samples the process's resident memory every millisecond during the save. Reported per rank: its share (the
bytes of the parameters it holds), what the save added at its peak, and the peak against the bound asked of it:
1.2 x the share plus the largest tensor (the one tensor a rank may hold whole while it is gathered and written).
``SAVE_MEMORY_MMAP=1`` runs the job with glibc returning every allocation of 1 MiB or more at once
(``MALLOC_MMAP_THRESHOLD_``): what is then left of the peak is autoshard's, not the allocator's keeping.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time

import tp_launch
from common import BENCH

SHAPE = {"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 8,
         "intermediate_size": 2816, "vocab_size": 32000}


ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "1048576"} if os.environ.get("SAVE_MEMORY_MMAP") else {}


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Peak:
    """The most resident memory seen by a thread sampling every millisecond while it runs."""

    def __init__(self) -> None:
        self.most, self._running = _resident(), True
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while self._running:
            self.most = max(self.most, _resident())
            time.sleep(0.001)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._running = False
        self._thread.join()
        self.most = max(self.most, _resident())


def worker(out: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import autoshard

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        config = LlamaConfig(**SHAPE, max_position_embeddings=64, use_cache=False)
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        tokens = torch.zeros(2, 64, dtype=torch.long, device="meta")
        pm = autoshard.parallelize(model, autoshard.Mesh(tp=2, pp=2), example_inputs=(tokens,), target=tokens,
                                   loss_fn=lambda out, t: out.logits.float().mean(), microbatches=2)
        pm.materialize("cpu")
        share = sum(p.numel() * p.element_size() for p in pm.parameters())
        largest = max(p.numel() * p.element_size() for p in model.parameters())
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        with tempfile.TemporaryDirectory() as directory:
            dist.barrier()
            before = _resident()
            with _Peak() as peak:
                start = time.perf_counter()
                pm.save_pretrained(directory, max_shard_size="200MB")
                seconds = time.perf_counter() - start
            files = len([f for f in os.listdir(directory) if f.endswith(".safetensors")]) if dist.get_rank() == 0 \
                else None
        row = {"rank": dist.get_rank(), "share": share, "added": peak.most - before, "largest": largest,
               "total": total, "seconds": seconds, "files": files}
        rows: list = [None] * dist.get_world_size()
        dist.all_gather_object(rows, row)
        if dist.get_rank() == 0:
            with open(out, "w") as f:
                json.dump(rows, f)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out")
    parser.add_argument("--output", default=str(BENCH / "results_save_memory.md"))
    tp_launch.add_arguments(parser, job_timeout=900)
    parser.set_defaults(retries=0)
    args = parser.parse_args()
    if args.worker:
        worker(args.out)
        return
    started = time.perf_counter()
    job = tp_launch.run_json("save", tp_launch.torchrun(4, "save_memory.py", "--worker"), tp_launch.from_args(args),
                             env={"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", **ALLOCATOR})
    lines = tp_launch.header("Memory of save_pretrained from tp=2 x pp=2", started) + [""]
    if "error" in job:
        lines.append(f"did not run: {job['error']}")
    else:
        rows = job["result"]
        mb = 2**20
        lines += [f"HF Llama, {SHAPE['num_hidden_layers']} layers, hidden {SHAPE['hidden_size']}, vocab "
                  f"{SHAPE['vocab_size']}: {rows[0]['total'] / mb:.0f} MiB in fp32, its largest tensor "
                  f"{rows[0]['largest'] / mb:.0f} MiB; {rows[0]['files']} files of at most 200 MB, written in "
                  f"{rows[0]['seconds']:.1f} s.", "",
                  "| rank | share MiB | added by the save at its peak MiB | peak (share + added) against 1.2 x share "
                  "+ largest tensor |", "| ---: | ---: | ---: | ---: |"]
        for r in rows:
            peak, bound = r["share"] + r["added"], 1.2 * r["share"] + r["largest"]
            lines.append(f"| {r['rank']} | {r['share'] / mb:.0f} | {r['added'] / mb:.0f} | {peak / mb:.0f} of "
                         f"{bound / mb:.0f} ({peak / bound:.2f}) |")
    text = "\n".join(lines) + "\n"
    with open(args.output, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
