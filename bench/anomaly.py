"""The cost of ``detect_anomaly=True``: a training step of the benchmark GPT with it off and on, in one process.

    .venv/bin/python bench/anomaly.py            # prints the medians and writes bench/results_anomaly.md

``parallelize(model, Mesh())`` twice from the same model, steps taking turns (10 timed after 2 warm-up steps);
with it on, every program runs op by op through an ``fx.Interpreter`` that reads each output back to look for a
NaN, and the gradients are looked at after the backward.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time

import torch
from common import BENCH, build_gpt_case

import autoshard


def main() -> None:
    torch.set_num_threads(1)
    model, tokens, target, loss_fn = build_gpt_case()
    inputs = (tokens,)
    runs = {name: autoshard.parallelize(copy.deepcopy(model), autoshard.Mesh(), example_inputs=inputs, loss_fn=loss_fn,
                                        target=target, detect_anomaly=on)
            for name, on in (("off", False), ("on", True))}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for index in range(12):
        for name, pm in runs.items():
            start = time.perf_counter()
            pm.step(*inputs, target=target)
            if index >= 2:
                times[name].append((time.perf_counter() - start) * 1000)
    off, on = (statistics.median(times[n]) for n in ("off", "on"))
    text = (f"# detect_anomaly=True\n\n- command: `.venv/bin/python bench/anomaly.py`\n- torch {torch.__version__}, "
            f"one thread\n\n| detect_anomaly | median step ms |\n| --- | ---: |\n| off | {off:.1f} |\n"
            f"| on | {on:.1f} ({on / off:.2f}x) |\n")
    (BENCH / "results_anomaly.md").write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
