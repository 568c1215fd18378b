"""Per-token time of ``pm.generate`` beside HuggingFace's own ``generate`` and a loop over lengths.

    .venv/bin/python bench/generate.py   # writes bench/results_generate.md and prints it

An HF ``LlamaForCausalLM`` (hidden 256, 4 layers, vocab 4096) on one rank of this machine, greedy, 4 rows of a
16-token prompt, 48 new tokens. Three ways: HuggingFace's ``generate`` (its KV cache: each token runs one position),
``pm.generate`` (each token one forward of the whole sequence, lengths padded to multiples of 32: two captures and
the exact prompt's check), and a hand-written greedy loop over ``pm(ids)`` (a capture at every length, as a user
who does not know wrote it). Each is timed on its first run (captures included) and on a second run of the same
lengths (every program already built). The tokens of the first two are compared.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path

import torch

import autoshard

SHAPE = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 4, "vocab_size": 4096, "max_position_embeddings": 256}
ROWS, PROMPT, NEW = 4, 16, 48


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SHAPE, attn_implementation="sdpa")).eval()


def _loop(pm, ids: torch.Tensor) -> torch.Tensor:
    for _ in range(NEW):
        ids = torch.cat([ids, pm(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def _timed(fn) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    out = fn()
    return (time.perf_counter() - start) / NEW, out


def main() -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    warnings.simplefilter("ignore")
    prompt = torch.randint(0, SHAPE["vocab_size"], (ROWS, PROMPT), generator=torch.Generator().manual_seed(1))
    model = _model()
    rows = []
    with torch.no_grad():
        hf = [_timed(lambda: model.generate(prompt, max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW))
              for _ in range(2)]
    rows.append(("HuggingFace generate (KV cache)", hf[0][0], hf[1][0]))
    pm = autoshard.parallelize(_model(), None, example_inputs=(prompt,))
    ours = [_timed(lambda: pm.generate(prompt, max_new_tokens=NEW, eos_token_id=-1)) for _ in range(2)]
    rows.append(("pm.generate (buckets of 32)", ours[0][0], ours[1][0]))
    loop_pm = autoshard.parallelize(_model(), None, example_inputs=(prompt,))
    loop = [_timed(lambda: _loop(loop_pm, prompt)) for _ in range(2)]
    rows.append(("greedy loop over pm(ids)", loop[0][0], loop[1][0]))
    same = torch.equal(hf[1][1], ours[1][1]) and torch.equal(ours[1][1], loop[1][1])
    lines = ["# Per-token time of generation", "", f"`{' '.join(sys.argv)}` on {os.cpu_count()} CPU cores, one rank: "
             f"HF Llama (hidden 256, 4 layers, vocab 4096), {ROWS} rows, a {PROMPT}-token prompt, {NEW} new tokens, "
             f"greedy. Same tokens in all three: {same}.", "",
             "| how | first run, s/token (captures included) | second run, s/token | second run vs HF |",
             "|---|---|---|---|"]
    lines += [f"| {name} | {first:.4f} | {second:.4f} | {second / hf[1][0]:.2f}x |" for name, first, second in rows]
    text = "\n".join(lines) + "\n"
    Path(__file__).with_name("results_generate.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
