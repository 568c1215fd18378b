"""What each training step did, as training stacks report it: time, tokens/s, TFLOP/s, MFU, memory, the bubble.

After every ``step()`` the parallel model holds the step's numbers (``pm.metrics()``). On rank 0 they also go to the
``autoshard`` logger at INFO, one line per step as torchtitan prints it (``logging.basicConfig(level=logging.INFO)``
shows them; the logger's level silences them), and to TensorBoard when ``tensorboard=`` names a log directory.
What took how long before the first step (capture, compile, calibrate, autotune) is said by ``progress``: on the
logger, or on a terminal's stderr where the logger is quiet.

- ``tokens``: the global batch's token ids (the first integer input of two dims or more), else its samples.
- ``tflops``: the model's FLOPs per step, counted on the captured graph (``cost.py``: a microbatch's forward, x 3 for
  the backward, x microbatches x dp), per second and per device.
- ``mfu``: that over the device's peak: ``peak_tflops=`` (a number, or ``"measure"``: a matmul timed on this device
  once), else a known GPU's dense bf16 peak; absent where none is known (a CPU).
- ``memory``: the device's peak allocated bytes (CUDA), or the process's peak resident size (CPU).
- ``bubble``: under pp, the share of the step this rank's pipeline spent not computing.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import sys
import threading
import time

import torch

from autoshard import batching, cost

log = logging.getLogger("autoshard")

# Dense bf16 peak TFLOP/s of GPUs by a word of their name (NVIDIA's data sheets).
_PEAKS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "L4": 121.0, "V100": 125.0}


class Metrics:
    """The last step's numbers, and the model's FLOPs per step by build."""

    def __init__(self, pm) -> None:
        self.pm = pm
        self.last: dict[str, float] = {}
        self._flops: dict[tuple, float] = {}
        self._peak: float | None = None
        self._writer = None
        self._start = 0.0
        if pm.options.peak_tflops == "measure":  # now, not inside a step's time
            self._peak = measure_peak(pm.device)

    def begin(self) -> None:
        if self.pm.device.type == "cuda" and self._wanted():
            torch.cuda.synchronize()
        self._start = time.perf_counter()

    def end(self, build, inputs: tuple, loss: torch.Tensor) -> None:
        """Record the step that ``begin`` started: ``build`` ran it on the global batch ``inputs``."""
        wanted = self._wanted()
        if self.pm.device.type == "cuda" and wanted:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - self._start
        world = self.pm.mesh.world_size
        tokens = _tokens(inputs) * (self.pm.mesh.dp if self.pm.options.local_batch else 1)
        flops = self._step_flops(build)
        found = {"step": float(self.pm.steps), "seconds": seconds, "tokens": float(tokens),
                 "tokens_per_second": tokens / seconds, "tokens_per_second_per_device": tokens / seconds / world,
                 "tflops_per_device": flops / seconds / world / 1e12, "memory": float(_peak_memory(self.pm.device))}
        peak = self.peak()
        if peak:
            found["mfu"] = found["tflops_per_device"] / peak
        if self.pm.pipeline is not None:
            bubble = self.pm.pipeline.idle_share()
            if bubble is not None:
                found["bubble"] = bubble
        if wanted:
            found["loss"] = float(loss)
        self.last = found
        if wanted and self.pm.rank == 0:
            self._report(found)

    def peak(self) -> float | None:
        """The device's peak TFLOP/s: given, measured or known; None where none is."""
        if self._peak is None:
            given = self.pm.options.peak_tflops
            if given == "measure":
                self._peak = measure_peak(self.pm.device)
            elif given is not None:
                self._peak = float(given)
            elif self.pm.device.type == "cuda":
                name = torch.cuda.get_device_name(self.pm.device)
                self._peak = next((p for word, p in _PEAKS.items() if word in name), 0.0)
            else:
                self._peak = 0.0
        return self._peak or None

    def _step_flops(self, build) -> float:
        key = build.captured.key
        if key not in self._flops:
            try:
                forward = cost.total_flops(cost.annotate(build.captured.gm))
            except Exception as e:  # noqa: BLE001 - a count that fails costs the metric, never the step
                log.warning("autoshard: the FLOPs of %s could not be counted (%s): no TFLOP/s or MFU",
                            type(self.pm.model).__name__, e)
                forward = 0
            copies = self.pm.options.microbatches * self.pm.mesh.dp  # the capture is of one microbatch of a replica
            self._flops[key] = float(cost.training_flops(forward)) * copies
        return self._flops[key]

    def _wanted(self) -> bool:
        return log.isEnabledFor(logging.INFO) or self.pm.options.tensorboard is not None

    def _report(self, found: dict[str, float]) -> None:
        parts = [f"step {int(found['step'])}", f"loss {found['loss']:.4f}",
                 f"tokens/s {found['tokens_per_second']:.4g} ({found['tokens_per_second_per_device']:.4g} per device)",
                 f"TFLOP/s {found['tflops_per_device']:.3g} per device"]
        if "mfu" in found:
            parts.append(f"MFU {found['mfu']:.1%}")
        parts.append(f"memory {cost.format_bytes(found['memory'])}")
        if "bubble" in found:
            parts.append(f"bubble {found['bubble']:.0%}")
        parts.append(f"{found['seconds'] * 1e3:.1f} ms")
        log.info("autoshard: %s", "  ".join(parts))
        if self.pm.options.tensorboard is not None:
            self.writer().add_scalars("autoshard", {k: v for k, v in found.items() if k != "step"},
                                      int(found["step"]))

    def writer(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(self.pm.options.tensorboard)
        return self._writer


def progress(options, message: str) -> None:
    """Say ``message`` (what took how long; rank 0 calls this): on the ``autoshard`` logger where it speaks at INFO,
    else on stderr where that is a terminal (``progress=True``: always; ``False``: never)."""
    if log.isEnabledFor(logging.INFO):
        log.info(message)
        return
    wanted = options.progress if options.progress is not None else sys.stderr.isatty()
    if wanted:
        print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def ticking(options, doing: str):
    """While the block runs, on a terminal where ``progress`` speaks there: ``doing ... 3 s`` counting up on one line
    (a capture or a compile of tens of seconds says it is alive), cleared at the end for ``progress``'s line."""
    if log.isEnabledFor(logging.INFO) or options.progress is False or not sys.stderr.isatty():
        yield
        return
    stop, start = threading.Event(), time.perf_counter()

    def tick() -> None:
        while not stop.wait(0.5):
            sys.stderr.write(f"\r{doing} ... {time.perf_counter() - start:.0f} s")
            sys.stderr.flush()

    thread = threading.Thread(target=tick, name="autoshard-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        sys.stderr.write("\r\033[K")
        sys.stderr.flush()


def measure_peak(device: torch.device, repeats: int = 5) -> float:
    """TFLOP/s of a square matmul on ``device`` (4096 in bf16 on a GPU, 1024 in float32 on a CPU), the best of
    ``repeats``."""
    dtype, size = (torch.bfloat16, 4096) if device.type == "cuda" else (torch.float32, 1024)
    a = torch.randn(size, size, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ a
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e12


def _tokens(inputs: tuple) -> int:
    for value in inputs:
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and not value.is_floating_point():
            return value.numel()
    return batching.batch_size(inputs) or 1


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
