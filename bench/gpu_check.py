"""The GPU check (``make gpu-check``): what autoshard does on one GPU, in one script of a few minutes.

One machine with one GPU cannot run multi-rank NCCL (NCCL takes one GPU per rank), so the check runs what one
GPU can show, each part on its own and each part's result written as soon as it is known:

1. **one rank**: ``Mesh()`` goldens of the zoo on the GPU (``autoshard.verify``: loss, gradients and parameters
   after 3 SGD steps against the unsharded model, fp32 tolerances);
2. **two ranks on one GPU**: two processes, both on the same GPU, joined by gloo (which moves CUDA tensors
   through the host): the golden cells of every axis (dp, tp, tp with sequence parallelism, pp 1F1B and ZBV,
   cp gather, ring and all-to-all). This runs every kernel and every generated constant a CUDA rank runs; only
   the transport differs from NCCL;
3. **throughput**: an HF Llama of Llama-3-8B's layer shape (4 layers) on the GPU under bf16 autocast, one
   training step (forward and backward) timed eager, through autoshard's one-rank program, and both again
   under ``torch.compile``: tokens/s and MFU against the H200's dense bf16 peak.

``--dry-run`` runs all of it on the CPU at tiny sizes (the CUDA parts left out), so CI keeps the script working.
Results go to ``--out`` (default ``bench/results_gpu.md``) and, as JSON, beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "bench"), str(REPO / "tests")]

H200_BF16_PEAK = 989e12  # dense bf16 FLOP/s of an H200 SXM (NVIDIA's datasheet; 1979 is with sparsity)
ONE_RANK = ("gpt", "llama", "bert", "mlp", "hf_gpt2", "hf_llama")
# (name, model, mesh, options): a covering set of the axes, each on a model whose blocks the axis splits
TWO_RANKS = (
    ("dp2", "gpt", {"dp": 2}, {}),
    ("tp2", "gpt", {"tp": 2}, {}),
    ("tp2 hf_llama", "hf_llama", {"tp": 2}, {}),
    ("tp2 sp", "gpt", {"tp": 2}, {"sequence_parallel": True}),
    ("pp2 1f1b", "gpt", {"pp": 2}, {"microbatches": 2}),
    ("pp2 zbv", "gpt", {"pp": 2}, {"microbatches": 2, "schedule": "zbv"}),
    ("cp2 gather", "gpt", {"cp": 2}, {}),
    ("cp2 ring", "gpt", {"cp": 2}, {"cp_attention": "ring", "cp_load_balance": True}),
    ("cp2 alltoall", "gpt", {"cp": 2}, {"cp_attention": "alltoall"}),
    ("cp2 ring hf_llama", "hf_llama", {"cp": 2}, {"cp_attention": "ring"}),
)
LLAMA_8B_LAYER = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                      num_key_value_heads=8, num_hidden_layers=4)
TINY_LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=2)


def _error(e: BaseException) -> str:
    """An exception's type and first line, with the innermost frame of autoshard's that raised it."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "/autoshard/" in f.filename
              or "/passes/" in f.filename]
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}{where}"[:400]


def _golden(name: str, mesh_kwargs: dict, device: str, groups=None, **options) -> dict:
    import autoshard

    from harness.models import build

    case = build(name, device=device)
    mesh = autoshard.Mesh(**mesh_kwargs)
    start = time.perf_counter()
    report = autoshard.verify(case.model, mesh, case.inputs, case.loss_fn, target=case.target, steps=3,
                              groups=groups, **options)
    worst = max((d.max_abs for d in report.differences), default=float("nan"))
    return {"ok": bool(report.ok), "max_abs": worst, "compared": len(report.differences), "share": report.share,
            "seconds": time.perf_counter() - start, "detail": "" if report.ok else str(report)[-600:]}


def one_rank(device: str) -> dict:
    """``Mesh()`` goldens of every zoo model on ``device``."""
    results = {}
    for name in ONE_RANK:
        try:
            results[name] = _golden(name, {}, device)
        except Exception as e:  # one model's failure is a result, not the end of the check
            results[name] = {"ok": False, "error": _error(e)}
    return results


def two_ranks(device: str, out: Path, timeout: float) -> dict:
    """Every axis's golden cell on two processes sharing ``device``, joined by gloo over loopback."""
    for rank in (0, 1):  # a run that dies before its first cell must not report an earlier run's results
        out.with_name(f"{out.stem}.rank{rank}.json").unlink(missing_ok=True)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               __file__, "--worker", "--device", device, "--out", str(out)]
    try:
        done = subprocess.run(command, env=env, timeout=timeout, capture_output=True, text=True)
        log = done.stdout[-2000:] + done.stderr[-4000:]
    except subprocess.TimeoutExpired as e:
        log = f"stopped after {timeout:.0f} s\n" + (e.stderr or b"")[-4000:].decode(errors="replace")
    results = {}
    for rank in (0, 1):
        path = out.with_name(f"{out.stem}.rank{rank}.json")
        for cell, result in (json.loads(path.read_text()) if path.exists() else {}).items():
            results.setdefault(cell, {})[f"rank{rank}"] = result
    for cell, *_ in TWO_RANKS:
        if cell not in results:
            results[cell] = {"rank0": {"ok": False, "error": "not reached (see the log)"}}
    results["log"] = log
    return results


class _Staged:
    """A receive through the host: waits for the CPU buffer, then copies it into the CUDA tensor."""

    def __init__(self, work, host, tensor) -> None:
        self.work, self.host, self.tensor = work, host, tensor

    def wait(self, *args):
        self.work.wait(*args)
        if self.host is not None:
            self.tensor.copy_(self.host)
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()


def _with_tensor(op, tensor):
    """A copy of a ``P2POp`` on another tensor (``copy.copy`` fails: its ``__new__`` wants arguments)."""
    twin = object.__new__(type(op))
    twin.__dict__.update(op.__dict__, tensor=tensor)
    return twin


def _host_staged_point_to_point() -> None:
    """gloo's sends and receives take CPU tensors only (a CUDA pointer fails in ``writev``, measured), while its
    collectives take CUDA tensors: here the two ranks' sends and receives go through host copies, in the order
    posted, so that pipelines and the ring run their CUDA kernels. NCCL needs none of this."""
    import torch.distributed as dist

    batch, send, recv = dist.batch_isend_irecv, dist.send, dist.recv

    def batch_isend_irecv(ops):
        staged, hosts = [], []
        for op in ops:
            host = op.tensor.cpu() if op.tensor.is_cuda else None
            if host is not None:
                op = _with_tensor(op, host)
            staged.append(op)
            hosts.append(host)
        works = batch(staged)
        if len(works) != len(ops):  # a backend that coalesces returns one work for the batch: nothing staged then
            return works
        receives = [(h, o.tensor) if o.op is dist.irecv and h is not None else (None, None)
                    for o, h in zip(ops, hosts, strict=True)]
        return [_Staged(w, *r) for w, r in zip(works, receives, strict=True)]

    def staged_send(tensor, *args, **kwargs):
        return send(tensor.cpu() if tensor.is_cuda else tensor, *args, **kwargs)

    def staged_recv(tensor, *args, **kwargs):
        if not tensor.is_cuda:
            return recv(tensor, *args, **kwargs)
        host = tensor.cpu()
        peer = recv(host, *args, **kwargs)
        tensor.copy_(host)
        return peer

    dist.batch_isend_irecv, dist.send, dist.recv = batch_isend_irecv, staged_send, staged_recv


def _worker(device: str, out: Path) -> None:
    """One of the two ranks: every cell of ``TWO_RANKS``, each result written as soon as it is known."""
    import torch
    import torch.distributed as dist

    import autoshard

    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", timeout=timeout)
    if device == "cuda":
        torch.cuda.set_device(0)  # both ranks on the one GPU
        _host_staged_point_to_point()
    rank = dist.get_rank()
    path = out.with_name(f"{out.stem}.rank{rank}.json")
    results: dict = {}
    groups: dict = {}
    for cell, model, mesh_kwargs, options in TWO_RANKS:
        mesh = autoshard.Mesh(**mesh_kwargs)
        try:
            if mesh not in groups:
                groups[mesh] = mesh.create_groups(timeout=timeout)
            results[cell] = _golden(model, mesh_kwargs, device, groups=groups[mesh], **options)
        except Exception as e:
            results[cell] = {"ok": False, "error": _error(e)}
        path.write_text(json.dumps(results, indent=1))
        print(f"rank {rank} {cell}: {results[cell].get('ok')}", flush=True)
    dist.destroy_process_group()


def _flops_per_token(model, seq: int) -> float:
    """Training FLOPs per token: 6 per parameter of every matrix product plus attention's scores and values
    (PaLM's 6N + 12 L h s, attention counted whole although causal)."""
    config = model.config
    matmul = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n)
    return 6 * matmul + 12 * config.num_hidden_layers * config.hidden_size * seq


def _timed(step, steps: int, warmup: int, device: str) -> dict:
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    start = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - start
    for _ in range(warmup - 1):
        step()
    sync()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    times.sort()
    return {"first_s": first, "step_s": times[len(times) // 2], "min_s": times[0]}


def throughput(device: str, dry: bool, compiled: bool) -> dict:
    """One training step of an HF Llama, eager and through autoshard's one-rank program, with and without
    ``torch.compile`` (autoshard's through ``compile=True``): tokens/s and MFU."""
    import torch
    from common import logits_loss
    from transformers import LlamaConfig, LlamaForCausalLM

    import autoshard

    shape, seq, batch = (TINY_LLAMA, 32, 2) if dry else (LLAMA_8B_LAYER, 2048, 2)
    steps, warmup = (2, 1) if dry else (10, 3)
    torch.manual_seed(0)
    with torch.device(device):  # built where it runs: a billion parameters initialise in seconds on a GPU
        model = LlamaForCausalLM(LlamaConfig(**shape, max_position_embeddings=seq, use_cache=False,
                                             attn_implementation="sdpa"))
        tokens, target = torch.randint(0, shape["vocab_size"], (2, batch, seq)).unbind(0)
    flops = _flops_per_token(model, seq) * batch * seq
    peak = H200_BF16_PEAK if device == "cuda" else None
    results: dict = {"shape": {**shape, "seq": seq, "batch": batch},
                     "parameters": sum(p.numel() for p in model.parameters()), "flops_per_step": flops}

    def eager(module):
        def step():
            module.zero_grad(set_to_none=True)
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = logits_loss(module(tokens), target)
            loss.backward()
        return step

    pm = autoshard.parallelize(model, autoshard.Mesh(), example_inputs=(tokens,), loss_fn=logits_loss,
                               target=target, mixed_precision="bf16")

    def sharded():
        pm.zero_grad(set_to_none=True)
        pm.step(tokens, target=target)

    runners = [("eager", eager(model)), ("autoshard", sharded)]
    if compiled:
        runners.append(("eager + torch.compile", eager(torch.compile(model))))

        compiled_pm = autoshard.parallelize(model, autoshard.Mesh(), example_inputs=(tokens,), loss_fn=logits_loss,
                                            target=target, mixed_precision="bf16", compile=True)

        def compiled_program():
            compiled_pm.zero_grad(set_to_none=True)
            compiled_pm.step(tokens, target=target)
        runners.append(("autoshard + torch.compile", compiled_program))
    for label, step in runners:
        try:
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            timing = _timed(step, steps, warmup, device)
            timing["tokens_per_s"] = batch * seq / timing["step_s"]
            timing["mfu"] = flops / timing["step_s"] / peak if peak else None
            if device == "cuda":
                timing["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            results[label] = timing
        except Exception as e:
            results[label] = {"error": _error(e)}
    return results


def _markdown(results: dict, command: str) -> str:
    env = results["env"]
    lines = [f"# GPU check: {env.get('gpu', 'no GPU (dry run)')}", "",
             f"`{command}` on {env['date']}: torch {env['torch']}, transformers {env['transformers']}"
             f"{', CUDA ' + env['cuda'] if env.get('cuda') else ''}. Written by `bench/gpu_check.py`.", "",
             "## One rank (`Mesh()`), goldens against the unsharded model (3 SGD steps)", "",
             "| model | exact | largest difference | compared | error |", "|---|---|---|---|---|"]
    for name, r in results.get("one_rank", {}).items():
        lines.append(f"| {name} | {'yes' if r.get('ok') else 'NO'} | {r.get('max_abs', float('nan')):.2e} | "
                     f"{r.get('compared', 0)} | {r.get('error', '')} |")
    lines += ["", "## Two ranks on one device (gloo), goldens of every axis", "",
              "| cell | exact (rank 0, rank 1) | largest difference | share per rank | error |",
              "|---|---|---|---|---|"]
    for cell, *_ in TWO_RANKS:
        ranks = results.get("two_ranks", {}).get(cell, {})
        r0, r1 = ranks.get("rank0", {}), ranks.get("rank1", {})
        ok = ", ".join("yes" if r.get("ok") else "NO" for r in (r0, r1))
        share = r0.get("share")
        lines.append(f"| {cell} | {ok} | {r0.get('max_abs', float('nan')):.2e} | "
                     f"{'' if share is None else f'{share:.2f}'} | {r0.get('error') or r1.get('error') or ''} |")
    t = results.get("throughput", {})
    if t:
        s = t.get("shape", {})
        lines += ["", "## Throughput: one training step (forward and backward, bf16 autocast, fp32 parameters)", "",
                  f"HF Llama, {s.get('num_hidden_layers')} layers of hidden {s.get('hidden_size')}, "
                  f"{s.get('num_attention_heads')} heads ({s.get('num_key_value_heads')} kv), ffn "
                  f"{s.get('intermediate_size')}, vocab {s.get('vocab_size')}; batch {s.get('batch')} x sequence "
                  f"{s.get('seq')}; {t.get('parameters', 0) / 1e6:.0f}M parameters. MFU: 6N + 12·L·h·s FLOPs per "
                  f"token over the dense bf16 peak ({H200_BF16_PEAK / 1e12:.0f} TFLOP/s). Median of the timed steps.",
                  "", "| runner | step (ms) | tokens/s | MFU | first step (s) | peak memory (GiB) | error |",
                  "|---|---|---|---|---|---|---|"]
        for label, r in t.items():
            if not isinstance(r, dict) or label == "shape":
                continue
            if "error" in r:
                lines.append(f"| {label} | | | | | | {r['error']} |")
                continue
            mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else ""
            lines.append(f"| {label} | {r['step_s'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} | {mfu} | "
                         f"{r['first_s']:.1f} | {r.get('peak_gib', float('nan')):.1f} | |")
    return "\n".join(lines) + "\n"


def _env(device: str) -> dict:
    import torch
    import transformers

    env = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
           "transformers": transformers.__version__}
    if device == "cuda":
        env.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda)
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="everything on the CPU at tiny sizes, no CUDA")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results_gpu.md")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile runners")
    parser.add_argument("--parts", default="one_rank,two_ranks,throughput", help="which parts to run (comma-separated)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--device", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.device, args.out)
        return 0
    import torch

    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here; `--dry-run` runs the same check on the CPU", file=sys.stderr)
        return 2
    results: dict = {"env": _env(device)}
    command = "python bench/gpu_check.py" + (" --dry-run" if args.dry_run else "")
    as_json = args.out.with_suffix(".json")
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def write() -> None:
        as_json.write_text(json.dumps(results, indent=1, default=str))
        args.out.write_text(_markdown(results, command))

    parts = [("one_rank", lambda: one_rank(device)),
             ("two_ranks", lambda: two_ranks(device, args.out, timeout=240)),
             ("throughput", lambda: throughput(device, args.dry_run, compiled=not args.no_compile))]
    for part, run in [p for p in parts if p[0] in args.parts.split(",")]:
        start = time.perf_counter()
        try:
            results[part] = run()
        except Exception as e:
            results[part] = {"error": _error(e), "traceback": traceback.format_exc()[-3000:]}
        print(f"gpu-check: {part} in {time.perf_counter() - start:.1f} s", flush=True)
        write()
    print(args.out.read_text())
    failed = [n for n, r in results.get("one_rank", {}).items() if not r.get("ok")] + [
        c for c, *_ in TWO_RANKS if not all(r.get("ok") for r in results.get("two_ranks", {}).get(c, {}).values())] + [
        f"{part} ({r['error']})" for part in ("one_rank", "two_ranks") if "error" in (r := results.get(part, {}))] + [
        f"throughput {label}" for label, r in results.get("throughput", {}).items()
        if isinstance(r, dict) and "error" in r]
    if failed:
        print(f"gpu-check: not exact: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
