"""The memory ``gradient_checkpointing=True`` saves through ``autoshard.hf.Trainer``, beside HuggingFace's Trainer.

    .venv/bin/python bench/trainer_checkpointing.py   # writes bench/results_trainer_checkpointing.md and prints it

An HF ``LlamaForCausalLM`` (hidden 256, 8 layers, vocab 4096, 4 rows of 1024 tokens) trained for two steps by
HuggingFace's own Trainer and by ``autoshard.hf.Trainer`` (``mesh=None``, one rank), each with and without
``TrainingArguments(gradient_checkpointing=True)``; each run is a process of its own, with glibc returning every
allocation of 64 KiB or more at once (``MALLOC_MMAP_THRESHOLD_``), so its resident memory follows the tensors alive.
Measured in the second step (the first one builds autoshard's programs): the most resident memory a thread sampling
every millisecond saw above the step's start, and the step's time. HuggingFace checkpoints each decoder layer;
autoshard cuts its program where the fewest bytes cross (``autoshard/runtime/recompute.py``) and recomputes each
part alone. A whole-program recomputation (what ``activation_checkpointing`` did without pp before) is the third
autoshard row: it keeps nothing between the forward and the backward but recomputes every activation at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time

SHAPE = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 8, "num_attention_heads": 8,
         "num_key_value_heads": 4, "vocab_size": 4096}
ROWS, SEQ = 4, 1024
RUNS = [("HuggingFace's Trainer", "plain", False), ("HuggingFace's Trainer", "plain", True),
        ("autoshard.hf.Trainer, one rank", "autoshard", False), ("autoshard.hf.Trainer, one rank", "autoshard", True),
        ("autoshard.hf.Trainer, one rank, whole program recomputed", "whole", True)]


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def one(kind: str, checkpointing: bool) -> dict:
    """Runs in its own process: the second step's added peak (MiB) and time (s)."""
    import torch
    import transformers

    from autoshard import hf
    from autoshard.runtime import recompute

    if kind == "whole":
        recompute.segmented = lambda gm: None
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SHAPE, max_position_embeddings=SEQ, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids}
            for ids in torch.randint(0, SHAPE["vocab_size"], (2 * ROWS, SEQ), generator=g)]
    measured: dict = {}

    class Peak(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:
                self.start, self.most, self.running = _resident(), _resident(), True
                self.began = time.perf_counter()
                self.thread = threading.Thread(target=self.sample, daemon=True)
                self.thread.start()

        def sample(self):
            while self.running:
                self.most = max(self.most, _resident())
                time.sleep(0.001)

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                self.running = False
                self.thread.join()
                measured["seconds"] = time.perf_counter() - self.began
                measured["peak_mib"] = (self.most - self.start) / 2**20

    with tempfile.TemporaryDirectory() as directory:
        args = transformers.TrainingArguments(output_dir=directory, max_steps=2, per_device_train_batch_size=ROWS,
                                              gradient_checkpointing=checkpointing, report_to=[], use_cpu=True,
                                              save_strategy="no", disable_tqdm=True, logging_strategy="no")
        trainer = (transformers.Trainer if kind == "plain" else hf.Trainer)(model=model, args=args,
                                                                             train_dataset=data, callbacks=[Peak()])
        trainer.train()
    return measured


def main() -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    import tp_launch
    from common import BENCH
    from report import table

    started = time.perf_counter()
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    rows, peaks = [], {}
    for label, kind, checkpointing in RUNS:
        out = subprocess.run([sys.executable, __file__, "--one", kind, str(int(checkpointing))], env=env, check=True,
                             capture_output=True, text=True).stdout
        result = json.loads(out.strip().splitlines()[-1])
        peaks[kind, checkpointing] = result["peak_mib"]
        rows.append([label, "on" if checkpointing else "off", f"{result['peak_mib']:.0f}",
                     f"{result['seconds']:.2f}"])
    lines = tp_launch.header("gradient_checkpointing through the HF Trainer: the step's peak memory", started)
    lines += ["", f"HF Llama, hidden {SHAPE['hidden_size']}, {SHAPE['num_hidden_layers']} layers, vocab "
              f"{SHAPE['vocab_size']}; the second step of {ROWS} rows of {SEQ} tokens, one process each.", ""]
    lines.append(table(["trainer", "gradient_checkpointing", "peak above the step's start MiB", "step s"], rows,
                       "llrr"))
    lines += ["", f"Checkpointing keeps {peaks['plain', True] / peaks['plain', False]:.2f} of the step's peak under "
              f"HuggingFace's Trainer, {peaks['autoshard', True] / peaks['autoshard', False]:.2f} under "
              f"autoshard's (by segments), {peaks['whole', True] / peaks['autoshard', False]:.2f} with the whole "
              "program recomputed."]
    text = "\n".join(lines) + "\n"
    (BENCH / "results_trainer_checkpointing.md").write_text(text)
    print(text)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(one(sys.argv[2], bool(int(sys.argv[3])))))
    else:
        main()
