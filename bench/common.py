"""What the benchmark scripts share: paths, the benchmark GPT's shape and data, statistics, machine load.

The timed model is the nanoGPT-style GPT of the test zoo (``tests/harness/models.py``) at a shape big enough
that a CPU training step takes tens of milliseconds, so that the time of a step is dominated by the
model's own arithmetic rather than by Python overhead.

On a shared machine, other processes' work shows up in step times; ``wait_until_quiet`` and
``others_share`` (from ``/proc/stat`` and ``getrusage``) let the runner wait for it and report it.
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"

if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))


@dataclass(frozen=True)
class GPTShape:
    """The benchmark GPT: ``build_gpt_model`` arguments plus the global batch of one step."""

    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    vocab: int = 256
    seq: int = 64
    batch: int = 16

    def describe(self) -> str:
        return (
            f"nanoGPT-style GPT from tests/harness/models.py: {self.n_layer} layers, hidden {self.n_embd}, "
            f"{self.n_head} heads, vocab {self.vocab}, sequence {self.seq}, global batch {self.batch}"
        )


GPT_SHAPE = GPTShape()


def build_gpt_case(shape: GPTShape = GPT_SHAPE, seed: int = 0):
    """The benchmark GPT (fp32, CPU) with one global batch of tokens and targets, from ``seed``.

    Returns ``(model, tokens, target, loss_fn)``. The same seed gives the same parameters and data in
    every process, as every rank of a data-parallel job needs.
    """
    import torch

    from harness.models import build_gpt_model, token_data, token_loss

    torch.manual_seed(seed)
    model = build_gpt_model(
        n_layer=shape.n_layer, n_embd=shape.n_embd, n_head=shape.n_head, vocab=shape.vocab, seq=shape.seq
    )
    tokens, target = token_data(torch.Generator().manual_seed(seed + 1), batch=shape.batch, seq=shape.seq,
                                vocab=shape.vocab)
    return model, tokens, target, token_loss


def build_hf_llama(shape: dict, seq: int, batch: int, seed: int = 0):
    """An HF ``LlamaForCausalLM`` from a config (``shape``: its sizes), built from ``seed``, and one batch of random
    token ids and targets: (model, tokens, target). Nothing is downloaded."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**shape, max_position_embeddings=seq, use_cache=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, shape["vocab_size"], (batch, seq), generator=g)
    target = torch.randint(0, shape["vocab_size"], (batch, seq), generator=g)
    return model, tokens, target


def logits_loss(out, target):
    """Cross-entropy of an HF model's logits (or of a plain tensor) against token targets."""
    import torch

    logits = out.logits if hasattr(out, "logits") else out["logits"] if isinstance(out, dict) else out
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, linearly interpolated."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(times_ms: list[float]) -> dict:
    """Median and 10th/90th percentiles of step times in milliseconds."""
    return {
        "median_ms": statistics.median(times_ms),
        "p10_ms": percentile(times_ms, 10),
        "p90_ms": percentile(times_ms, 90),
        "times_ms": times_ms,
    }


def cpu_seconds() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole machine since boot, summed over cores; None off Linux.

    Busy is user + nice + system time, the part that processes are charged for (``getrusage``), so that
    interrupt time of our own loopback traffic is not mistaken for other processes.
    """
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    return sum(values[:3]) / hz, sum(values) / hz


def children_cpu_seconds() -> float:
    """CPU seconds used so far by this process's finished child processes (and theirs)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def others_share(before: tuple[float, float] | None, after: tuple[float, float] | None, own_s: float) -> float | None:
    """Fraction of the machine's CPU time between two ``cpu_seconds()`` samples not spent by us (``own_s``)."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return max(0.0, (after[0] - before[0] - own_s) / (after[1] - before[1]))


def wait_until_quiet(threshold: float = 0.25, max_wait: float = 30.0) -> float | None:
    """Wait (at most ``max_wait`` seconds) until other processes use under ``threshold`` of the cores.

    Returns the last busy fraction measured: timings taken while other work runs are not the model's.
    """
    deadline = time.monotonic() + max_wait
    while True:
        before = cpu_seconds()
        time.sleep(1.0)
        busy = others_share(before, cpu_seconds(), 0.0)
        if busy is None or busy <= threshold or time.monotonic() >= deadline:
            return busy
