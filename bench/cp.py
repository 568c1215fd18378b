"""Context-parallel benchmark: activation memory, bytes moved and step time of the zoo GPT as the sequence grows.

    .venv/bin/python bench/cp.py            # writes bench/results_cp.md and prints it

One job per cp degree (``bench/cp_worker.py``, one thread per rank): cp=1 in one plain process (``Mesh()``),
cp=2 and cp=4 under ``torchrun --standalone``. Each job runs the 4-layer GPT of ``tests/harness/models.py`` (hidden
128, 4 heads, vocab 256, global batch 4) at sequence lengths 128, 256 and 512 (``--seqs``) with the three
attention strategies (``cp_attention="gather"``, ``"ring"`` and ``"alltoall"``, load-balanced causal layout), and
at the sequences of ``--unbalanced`` also without load balance. Per configuration: the bytes autograd saves for
backward (rank 0, and the largest over ranks), the bytes each rank sends per step for attention and for the
gradient sum (counted at the ``torch.distributed`` calls) against ``explain.communication`` and the analytic
amount, and the median step time.
"""

from __future__ import annotations

import argparse
import sys
import time

import report
import tp_launch
from common import BENCH
from cp_worker import HEADS, HIDDEN, LAYERS, VOCAB


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def _label(cfg: dict) -> str:
    if cfg["c"] == 1:
        return "—"
    return cfg["attention"] + ("" if cfg["load_balance"] else ", contiguous")


def _configs(jobs: dict) -> list[dict]:
    return [cfg for job in jobs.values() if "result" in job for cfg in job["result"]["configs"]]


def _baseline(jobs: dict) -> dict[int, dict]:
    return {cfg["seq"]: cfg for cfg in _configs(jobs) if cfg["c"] == 1}


def kv_full(cfg: dict) -> int:
    """Bytes of K and V of every layer at the full sequence length (fp32)."""
    return 2 * LAYERS * cfg["batch"] * cfg["seq"] * HIDDEN * 4


def extras(cfg: dict) -> dict[str, int]:
    """What a cp rank saves beyond cp=1's bytes / c, by the model of the notes (bytes per term)."""
    if cfg["c"] == 1:
        return {}
    output = LAYERS * cfg["batch"] * (cfg["seq"] // cfg["c"]) * HIDDEN * 4
    if cfg["attention"] == "gather":  # the full-length K/V, and the output laid out for the model's transpose
        return {"K/V": kv_full(cfg), "output": output}
    # ring: its fp32 result; all-to-all: the output laid out for the model's transpose (attention itself saves
    # heads/c x seq, what cp=1 saves over c)
    return {"output": output}


def memory_rows(jobs: dict) -> list[list[str]]:
    base, rows = _baseline(jobs), []
    for cfg in sorted(_configs(jobs), key=lambda c: (c["seq"], c["c"], c["attention"], not c["load_balance"])):
        one, extra = base.get(cfg["seq"]), extras(cfg)
        cells = ["", "", "", "", ""]
        if one:
            share = one["saved_peak"] / cfg["c"]
            model = share + sum(extra.values())
            cells = [f"{cfg['saved_peak'] / one['saved_peak']:.3f}", _mib(share),
                     " + ".join(f"{k} {_mib(v)}" for k, v in extra.items()), _mib(model),
                     f"{(cfg['saved_peak'] - model) / 2**20:+.2f}"]
        rows.append([str(cfg["seq"]), str(cfg["c"]), _label(cfg), f"**{_mib(cfg['saved_peak'])}**",
                     _mib(cfg["saved_peak_max"]), cells[0], f"{1 / cfg['c']:.3f}", *cells[1:]])
    return rows


MEMORY_HEADER = ["seq", "cp", "attention", "saved MiB, rank 0", "largest rank", "vs cp=1", "1/c", "cp=1 / c MiB",
                 "+ extra MiB (model)", "model MiB", "measured − model MiB"]


def _measured(cfg: dict, key: str) -> float:
    return cfg["measured"].get(key, {}).get("sent", 0.0)


def comm_rows(jobs: dict) -> list[list[str]]:
    rows = []
    for cfg in sorted(_configs(jobs), key=lambda c: (c["seq"], c["c"], c["attention"], not c["load_balance"])):
        if cfg["c"] == 1:
            continue
        ops = "; ".join(f"{k.split(' cp ')[0]} x{v[0]}" for k, v in cfg["explain"].items())
        fwd, bwd = _measured(cfg, "attention forward"), _measured(cfg, "attention backward")
        an, ex = cfg["analytic"], cfg["explain_sent"]
        data = _measured(cfg, "data forward") + _measured(cfg, "data backward")
        rows.append([str(cfg["seq"]), str(cfg["c"]), _label(cfg), ops,
                     f"{_mib(an['forward'])} / {_mib(an['backward'])}",
                     f"{_mib(ex['forward'])} / {_mib(ex['backward'])}",
                     f"**{_mib(fwd)} / {_mib(bwd)}**", _mib(an["backward_min"]) if cfg["attention"] == "gather" else "",
                     _mib(data)])
    return rows


COMM_HEADER = ["seq", "cp", "attention", "collectives in the graph (explain)", "analytic MiB sent fwd / bwd",
               "explain.communication MiB sent fwd / bwd", "measured MiB sent fwd / bwd",
               "least bwd MiB (reduce-scatter)", "measured gradient + loss sums MiB sent"]


def time_rows(jobs: dict) -> list[list[str]]:
    base, rows = _baseline(jobs), []
    for cfg in sorted(_configs(jobs), key=lambda c: (c["seq"], c["c"], c["attention"], not c["load_balance"])):
        ms, one = cfg["step_ms"], base.get(cfg["seq"])
        versus = f"{ms['median_ms'] / one['step_ms']['median_ms']:.2f}x" if one else ""
        rows.append([str(cfg["seq"]), str(cfg["c"]), _label(cfg), f"**{ms['median_ms']:.0f}**",
                     f"{ms['p10_ms']:.0f}–{ms['p90_ms']:.0f}", versus, f"{cfg['loss_diff']:.1e}"])
    return rows


TIME_HEADER = ["seq", "cp", "attention", "median step ms", "p10–p90 ms", "vs cp=1", "loss diff vs unsharded"]


def notes(jobs: dict) -> list[str]:
    out = [
        f"- Model: the nanoGPT-style GPT of tests/harness/models.py, {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads, "
        "vocab "
        f"{VOCAB}, learned positions sized to the sequence; global batch 4; fp32, AdamW; one microbatch. Every "
        "configuration ran under `autoshard.parallelize(model, Mesh(cp=c), cp_attention=..., cp_load_balance=...)` "
        "on the unmodified model; cp=1 is `Mesh()` in one process. *loss diff vs unsharded* is the first step's "
        "loss against the unsharded model's in the same process.",
        "- **Every rank runs one thread. cp=2 runs 2 ranks on this machine's 2 cores; cp=4 runs 4 ranks on 2 cores "
        "(oversubscribed 2x)**: cp=4's step times are not those of 4 devices. Each rank is pinned to core rank mod "
        "2. Step time is `zero_grad` + `pm.step` + AdamW between barriers on rank 0, the configurations of a job "
        "taking turns step by step.",
        "- *saved MiB*: one step under `torch.autograd.graph.saved_tensors_hooks` keeping a running sum of the "
        "bytes of the tensors autograd saves for backward (each storage once; parameters and the program's "
        "buffers excluded); its peak. With one microbatch "
        "everything saved in the forward lives until the backward, so the peak is the step's total. Tensors that "
        "are not saved (the gradients in flight, the ring's score blocks recomputed in the backward) are not "
        "counted.",
        "- *model*: cp=1's bytes / c plus what each strategy adds. `gather`: the full-length K and V of every layer "
        "(2 · layers · B · T · hidden · 4 bytes; the gathered copies are new tensors, while the rank's own K and "
        "V stay alive inside the fused qkv projection's output, which the query view that attention saves keeps "
        "whole, as at cp=1); under the causal flag no mask: each run of the rank's query positions attends the keys "
        "before it whole and its own run causally, with the fused kernel, and one copy of its output per layer (laid "
        "out for the model's transpose, as below). `ring` keeps only its own K/V block "
        "and adds one copy of the attention "
        "output per layer (layers · B · T/c · hidden · 4 bytes: its fp32 result, saved before it is laid out for "
        "the model's transpose). `alltoall` holds q, k, v at (heads/c × T), as many bytes as cp=1's over c, and "
        "adds the same one copy of the output per layer (the all-to-all's result laid out for the transpose).",
        "- *contiguous*: without load balance (rank r holds the r-th of c chunks). The ring computes a causal block "
        "in pieces (runs of consecutive query positions against runs of key positions) and skips every piece whose "
        "keys all lie after its queries: contiguous, rank r computes r + 1 of the c blocks (uneven work); "
        "load-balanced (chunks r and 2c-1-r), every rank computes the same amount, about half the c blocks, so the "
        "slowest rank finishes sooner. `gather` computes the keys up to each query run's last position, and "
        "`alltoall` the full T × T of its heads/c heads, with the causal flag.",
        "- *MiB sent* per rank per step, forward / backward. *measured*: every call of `torch.distributed` during "
        "one step, counted by `bench/cp_comm.py` and attributed to attention when it comes from the graph's "
        "context-parallel ops; bytes sent under gloo's ring algorithms (all-gather: (c-1) local blocks; "
        "all-reduce: 2 (c-1)/c of the tensor; reduce-scatter: (c-1)/c of its input; point-to-point: what is "
        "sent). *analytic*: `gather` all-gathers K and V of every layer forward ((c-1)/c of the full-length bytes) "
        "and reduce-scatters their full-length gradients backward ((c-1)/c); `ring` sends c-1 K/V blocks forward, "
        "and c-1 K/V blocks plus c fp32 dK/dV accumulators backward; `alltoall` moves q, k, v and the output of "
        "every layer (T/c tokens each) forward, keeping 1/c and sending the rest, and their gradients backward. "
        "*explain.communication* is autoshard's own count from the rank's graph "
        "converted with the same factors (its byte column is the gathered output for an all-gather, the reduced "
        "tensor for an all-reduce or the input of a reduce-scatter, the bytes sent for ring attention).",
        "- *least bwd*: `gather`'s backward needs only each rank's slice of the summed dK/dV, a reduce-scatter "
        "((c-1)/c of the full-length bytes): what autoshard sends.",
        "- *gradient + loss sums*: DistributedDataParallel's all-reduce of the parameters' gradients over the cp "
        "group (every parameter is replicated over cp) and `pm.step`'s loss sum; they depend on the sequence only "
        "through the learned position table, sized to it.",
    ]
    for c, job in jobs.items():
        if "error" in job:
            out.append(f"- The cp={c} job failed: {job['error']}")
        out += tp_launch.disturbed_note(f"the cp={c} job", job.get("others_share"))
    return out


def sections(jobs: dict) -> list[str]:
    return [
        "## Context parallelism: the zoo GPT as the sequence grows",
        "### Activation memory per rank: bytes saved for backward\n\n"
        + report.table(MEMORY_HEADER, memory_rows(jobs), "lllrrrrrlrr"),
        "### Bytes moved per step, per rank\n\n" + report.table(COMM_HEADER, comm_rows(jobs), "llllrrrrr"),
        "### Step time\n\n" + report.table(TIME_HEADER, time_rows(jobs), "lllrrrr"),
        "\n".join(notes(jobs)),
    ]


def _argv(c: int, args: argparse.Namespace) -> list[str]:
    worker = ["--seqs", args.seqs, "--batch", str(args.batch), "--unbalanced", args.unbalanced, "--warmup",
              str(args.warmup), "--steps", str(args.steps)]
    if c == 1:
        return [sys.executable, str(BENCH / "cp_worker.py"), *worker]
    return tp_launch.torchrun(c, "cp_worker.py", *worker, "--pin")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", default="1,2,4", help="cp degrees, comma-separated, of 1, 2, 4")
    parser.add_argument("--seqs", default="128,256,512")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--unbalanced", default="512", help="sequence lengths also run without load balance")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--output", default=str(BENCH / "results_cp.md"))
    tp_launch.add_arguments(parser)
    parser.set_defaults(quiet_wait=10, retries=0)
    args = parser.parse_args()
    started = time.perf_counter()
    opts = tp_launch.from_args(args)
    env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    jobs = {c: tp_launch.run_json(f"cp={c}", _argv(c, args), opts, env=env) for c in map(int, args.cp.split(","))}
    head = "\n".join(tp_launch.header("autoshard context-parallel benchmarks", started))
    text = "\n\n".join([head, *sections(jobs)]) + "\n"
    with open(args.output, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
