"""Fine-tune a HuggingFace causal LM with HuggingFace's ``Trainer``, under an autoshard mesh.

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --tp 2
    torchrun --standalone --nproc-per-node 4 examples/hf_trainer.py --dp 2 --pp 2 --resume

The script is an ordinary Trainer script (a tiny Llama built from its config, a dataset of padded rows, AdamW with
weight decay, a linear schedule, gradient accumulation, clipping, checkpoints every 10 steps); the one line that
differs is ``autoshard.hf.Trainer(..., mesh=...)`` in place of ``transformers.Trainer(...)``. ``--resume`` starts
from the newest checkpoint in the output directory, whatever mesh saved it. Rank 0 prints the logged losses and
the directory ``save_model`` wrote, which ``from_pretrained`` loads.
"""

from __future__ import annotations

import argparse
import os

import torch
import transformers
from transformers.trainer_utils import get_last_checkpoint

import autoshard
import autoshard.hf


def dataset(vocab: int, seq: int, rows: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(rows):
        ids = torch.randint(1, vocab, (seq,), generator=g)
        mask = torch.ones(seq, dtype=torch.long)
        mask[seq - int(torch.randint(0, 5, (), generator=g)):] = 0  # padded at the end
        data.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for axis in ("dp", "tp", "pp", "cp"):
        parser.add_argument(f"--{axis}", type=int, default=1, help=f"{axis} degree")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--output", default="hf_trainer_out")
    parser.add_argument("--resume", action="store_true", help="resume from the newest checkpoint in --output")
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config)
    mesh = autoshard.Mesh(dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp)
    training = transformers.TrainingArguments(
        output_dir=args.output, max_steps=args.steps, per_device_train_batch_size=8, gradient_accumulation_steps=2,
        learning_rate=2e-3, weight_decay=0.1, lr_scheduler_type="linear", warmup_steps=3, max_grad_norm=1.0,
        logging_steps=5, save_strategy="steps", save_steps=10, report_to=[], seed=0, use_cpu=True,
        dataloader_drop_last=True, disable_tqdm=True)
    trainer = autoshard.hf.Trainer(model=model, args=training, train_dataset=dataset(256, 32, 256), mesh=mesh,
                                   parallel_options={"microbatches": 2} if args.pp > 1 else None)
    resume = get_last_checkpoint(args.output) if args.resume and os.path.isdir(args.output) else None
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(os.path.join(args.output, "final"))
    if trainer.args.process_index == 0:
        losses = [round(e["loss"], 4) for e in trainer.state.log_history if "loss" in e]
        print(f"mesh {mesh}: logged losses {losses}; resumed from {resume}; "
              f"model saved in {os.path.join(args.output, 'final')}")


if __name__ == "__main__":
    main()
