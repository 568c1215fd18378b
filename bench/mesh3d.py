"""3D-parallel benchmark: the 2x2x2 mesh (dp=2, tp=2, pp=2) on the 8-layer zoo GPT, against PyTorch by hand.

    .venv/bin/python bench/mesh3d.py            # writes bench/results_3d.md and prints it

Two jobs (``bench/mesh3d_worker.py``, one thread per rank):

1. the unsharded model in one plain process (the baseline), its step timed on one thread and on all cores;
2. ``torchrun --standalone --nproc-per-node 8``: autoshard's ``Mesh(dp=2, tp=2, pp=2)`` on the unmodified model
   and the hand-written PyTorch combination of DTensor TP and ``torch.distributed.pipelining`` with data
   parallelism by hand (``bench/mesh3d_torch.py``), taking turns step by step: median step time, the loss of
   the first two steps against the unsharded model, and every rank's bytes of parameters, gradients and AdamW
   state against the whole model's / (tp x pp).
"""

from __future__ import annotations

import argparse
import sys
import time

import report
import tp_launch
from common import BENCH

LAYERS, BATCH, MICROBATCHES = 8, 16, 4
TP, PP = 2, 2
ENV = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
LABELS = {"autoshard": "autoshard, Mesh(dp=2, tp=2, pp=2), model unmodified",
          "autoshard_fsdp": "autoshard, the same with data_parallel=\"fsdp\" (FSDP2 over dp)",
          "torch": "DTensor TP + torch.distributed.pipelining + DP by hand"}
DP = 2


def _mib(n: float) -> str:
    return f"{n / 2**20:.3f}"


def _ms(stats: dict) -> tuple[str, str]:
    return f"**{stats['median_ms']:.0f}**", f"{stats['p10_ms']:.0f}–{stats['p90_ms']:.0f}"


def time_rows(eager: dict, mesh: dict) -> list[list[str]]:
    base = eager.get("result", {}).get("step_ms", {})
    one = base.get("eager, 1 thread", {}).get("median_ms")
    many = next((v["median_ms"] for k, v in base.items() if k != "eager, 1 thread"), None)
    rows = []
    for name, stats in base.items():
        rows.append([f"unsharded model, {name.removeprefix('eager, ')}", "1", *_ms(stats),
                     f"{stats['median_ms'] / one:.2f}x" if one else "", "", "reference"])
    result = mesh.get("result")
    if result:
        ms = result["step_ms"]
        for name, stats in ms.items():
            losses = result["losses"][name]
            diffs = " / ".join(f"{abs(a - b):.1e}" for a, b in losses)
            versus = f"{stats['median_ms'] / one:.2f}x" + (f" ({stats['median_ms'] / many:.2f}x)" if many else "")
            rows.append([LABELS[name], f"{result['world']} × 1", *_ms(stats), versus if one else "",
                         f"**{stats['median_ms'] / ms['torch']['median_ms']:.2f}x**", diffs])
    return rows


TIME_HEADER = ["runner", "processes × threads", "median step ms", "p10–p90 ms",
               "time / unsharded on 1 thread (on all cores)", "time / hand-written PyTorch",
               "loss diff vs unsharded, steps 1 / 2"]


def bytes_rows(mesh: dict) -> list[list[str]]:
    result = mesh.get("result")
    if not result:
        return []
    ideal = result["full_param_bytes"] / (TP * PP)
    rows = []
    for rank, coords in enumerate(result["coords"]):
        where = f"{rank} (pp {coords['pp']}, dp {coords['dp']}, tp {coords['tp']})"
        row = [where]
        for name in ("autoshard", "autoshard_fsdp", "torch"):
            if name not in result["bytes"]:
                continue
            b = result["bytes"][name][rank]
            share = ideal / DP if name == "autoshard_fsdp" else ideal
            row += [_mib(b["params"]), _mib(b["grads"]), _mib(b["moments"]), f"**{b['params'] / share:.3f}**"]
        rows.append(row)
    return rows


BYTES_HEADER = ["rank (coordinates)", "autoshard params MiB", "grads MiB", "AdamW moments MiB",
                "params / (full / tp·pp)", "autoshard FSDP2 params MiB", "grads MiB", "AdamW moments MiB",
                "params / (full / tp·pp·dp)", "hand-written params MiB", "grads MiB", "AdamW moments MiB",
                "params / (full / tp·pp)"]


def _collectives(mesh: dict) -> str:
    text = mesh.get("result", {}).get("explain", "")
    lines = text.split("collectives per training step:", 1)
    return "\n".join(line.strip() for line in lines[1].strip().splitlines()) if len(lines) == 2 else ""


def notes(eager: dict, mesh: dict) -> list[str]:
    result = mesh.get("result", {})
    full = result.get("full_param_bytes", 0)
    counters = max((b["step_counters"] for b in result.get("bytes", {}).get("autoshard", [])), default=0)
    out = [
        f"- Model: the nanoGPT-style GPT of tests/harness/models.py, {LAYERS} layers, hidden 128, 4 heads, ffn 512, "
        "vocab 256 "
        f"(tied embedding / LM head), sequence 64; global batch {BATCH}: each dp rank takes 8 rows in "
        f"{MICROBATCHES} microbatches of 2, schedule 1F1B; both split the layers 4 / 4 (autoshard's own "
        "partition cuts after block 3 here, the hand-written stages are equal by construction); fp32, AdamW "
        "(lr 1e-3). A step is `zero_grad` + forward/backward + AdamW, "
        "timed on rank 0 between barriers; the three 8-process runners take turns step by step.",
        "- **8 processes on this machine's 2 cores (4 ranks per core, oversubscribed 4x)**, one thread each, rank r "
        "pinned to core r mod 2: the ratios to the unsharded model show overhead, not the speed-up of 8 devices. "
        "The unsharded model ran in its own job just before, on 1 thread and on both cores.",
        "- The hand-written PyTorch job (bench/mesh3d_torch.py): a `DeviceMesh` of shape (pp, dp, tp) (the same rank "
        "layout as autoshard's), `dtensor_tp_gpt` of bench/tp_dtensor.py over the tp sub-mesh (with its model "
        "edits: fused-qkv row permutation, per-rank head counts, a replaced attention forward, the embedding "
        "re-tied to the vocab-parallel LM head, the loss inside `loss_parallel()`), `GPTStage` stages of "
        "bench/pp_worker.py in `PipelineStage` + `Schedule1F1B` over the pp group, the tied weight's gradient "
        "summed over the pp group and every gradient averaged over dp in one flat all-reduce by hand. One more "
        "edit was needed: on the first stage the vocab-parallel embedding's gradient comes back `Replicate` (the "
        "whole table) for a `Shard(0)` weight (in the tp-only job the LM head's shard is added to it); it has to "
        "be cut to the weight's shard before the sum over pp, or gloo aborts with `Received data size doesn't "
        "match expected size`.",
        "- *loss diff*: rank 0 trains a copy of the unsharded model beside each runner for its first two steps, "
        "under that runner's normalisation: autoshard's loss is the global batch's token mean (the unsharded "
        "loss); the hand-written job's is the mean of its 8 microbatch means (what `Schedule1F1B` with "
        "`scale_grads` and a dp average give). Step 2 follows one AdamW step.",
        f"- *bytes*: this rank's local shards (DTensor local tensors), their gradients after a step and the AdamW "
        f"moments (`exp_avg`, `exp_avg_sq`; the per-tensor step counters, at most {counters} B, are left out). The "
        f"whole model's parameters are {_mib(full)} MiB (the tied weight once), so full / (tp·pp) = "
        f"{_mib(full / (TP * PP))} MiB. Both layouts exceed it by the same amount: layer norms, the row-parallel "
        "layers' biases and the position table are replicated over tp, and the tied embedding / LM-head shard is "
        "held by the first and the last stage. The gradient all-reduces' temporary flat buffers are not counted. "
        "Under FSDP2 every one of these is split again over dp (dim 0, padded to even), measured between steps "
        "(during a step a stage's parameters are gathered once and held until its last backward).",
    ]
    if "result" in mesh:
        block = _collectives(mesh)
        out.append(f"- autoshard's collectives per step (`pm.explain()`, rank 0):\n\n```\n{block}\n```")
    for name, job in (("unsharded", eager), ("2x2x2", mesh)):
        if "error" in job:
            out.append(f"- The {name} job failed: {job['error']}")
        out += tp_launch.disturbed_note(f"the {name} job", job.get("others_share"))
    return out


def sections(eager: dict, mesh: dict) -> list[str]:
    return [
        "## 3D parallelism: dp=2 x tp=2 x pp=2 on 8 processes",
        "### Step time\n\n" + report.table(TIME_HEADER, time_rows(eager, mesh), "llrrrrr"),
        "### Parameters, gradients and optimizer state per rank\n\n"
        + report.table(BYTES_HEADER, bytes_rows(mesh), "l" + "r" * 12),
        "\n".join(notes(eager, mesh)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per runner")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps after the two that check the loss")
    parser.add_argument("--output", default=str(BENCH / "results_3d.md"))
    tp_launch.add_arguments(parser, job_timeout=300)
    parser.set_defaults(quiet_wait=10, retries=0)
    args = parser.parse_args()
    started = time.perf_counter()
    opts = tp_launch.from_args(args)
    worker = ["--warmup", str(args.warmup), "--steps", str(args.steps)]
    eager = tp_launch.run_json("unsharded", [sys.executable, str(BENCH / "mesh3d_worker.py"), "--eager", *worker],
                               opts, env=ENV)
    mesh = tp_launch.run_json("dp=2,tp=2,pp=2", tp_launch.torchrun(8, "mesh3d_worker.py", *worker, "--pin"), opts,
                              env=ENV)
    head = "\n".join(tp_launch.header("autoshard 3D-parallel benchmarks", started))
    text = "\n\n".join([head, *sections(eager, mesh)]) + "\n"
    with open(args.output, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
