"""Expert parallelism against tensor parallelism of the same experts, and against the unsharded model.

    GLOO_SOCKET_IFNAME=lo .venv/bin/torchrun --standalone --nproc-per-node 2 bench/moe_ep.py
    GLOO_SOCKET_IFNAME=lo .venv/bin/torchrun --standalone --nproc-per-node 4 bench/moe_ep.py

Two tiny-but-wide mixtures of experts from transformers, built from configs with no download: a Mixtral-like one
(8 experts, top-2) and a DeepSeek-V3-like one (16 routed experts, top-2, a shared expert, latent attention). At W
ranks, three runners train the same global batch, taking turns step by step (``zero_grad``, forward, loss, backward,
AdamW step, between barriers), one thread each:

- ``unsharded``: the model itself, the whole batch, on every rank (the reference for exactness);
- ``autoshard tp=W``: ``Mesh(tp=W)``: every rank runs every expert's 1/W on every token;
- ``autoshard ep=W``: ``Mesh(dp=W, ep=W)``: every rank holds W-th of the experts whole and its W-th of the batch;
  the tokens travel to their experts and back (all-to-alls).

Reported, from rank 0 into ``bench/results_moe_ep_<W>.md``: the median step time of each, ep's over tp's; each
runner's loss and largest gradient difference from the unsharded model after one step; the experts' bytes per rank
over the whole stacks' (exactly 1/ep); and the all-to-all bytes one ep rank sent in a step (rows to other ranks'
experts, forward and backward), beside the analytic amount for a uniform routing:
tokens x top-k x hidden x 4 B x 2 directions (dispatch, combine) x 2 (forward, backward) x (ep-1)/ep per layer.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent / "tests"), str(BENCH)]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from common import summarize, wait_until_quiet  # noqa: E402
from moe import Runner  # noqa: E402  (AdamW at the same learning rate)
from tp_dtensor import time_steps  # noqa: E402

BATCH, SEQ = 8, 128
HIDDEN = 256
MODELS = {
    "mixtral-like": ("MixtralConfig", "MixtralForCausalLM", {
        "vocab_size": 2048, "hidden_size": HIDDEN, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 4, "num_local_experts": 8, "num_experts_per_tok": 2,
        "router_jitter_noise": 0.0}),
    "deepseek-v3-like": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        "vocab_size": 2048, "hidden_size": HIDDEN, "intermediate_size": 512, "moe_intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 8, "n_routed_experts": 16,
        "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1,
        "q_lora_rank": 64, "kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 32,
        "rope_scaling": None}),
}


def build(name: str, seed: int = 0):
    import transformers

    config_class, model_class, fields = MODELS[name]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**fields)
    config.use_cache = False
    model = getattr(transformers, model_class)(config).train()
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, fields["vocab_size"], (BATCH, SEQ), generator=gen)
    target = torch.randint(0, fields["vocab_size"], (BATCH, SEQ), generator=gen)
    return model, tokens, target


def runners(model, tokens, target, world: int) -> dict[str, Runner]:
    import autoshard

    from harness.models import hf_token_loss

    eager = copy.deepcopy(model)

    def eager_step():
        loss = hf_token_loss(eager(tokens), target)
        loss.backward()
        return loss

    found = {"unsharded": Runner(eager, eager.parameters(), eager_step)}
    for label, mesh in ((f"autoshard tp={world}", autoshard.Mesh(tp=world)),
                        (f"autoshard ep={world}", autoshard.Mesh(dp=world, ep=world))):
        pm = autoshard.parallelize(copy.deepcopy(model), mesh, example_inputs=(tokens,), loss_fn=hf_token_loss,
                                   target=target)
        found[label] = Runner(pm, pm.parameters(), lambda pm=pm: pm.step(tokens, target=target))
    return found


def exactness(found: dict) -> dict:
    """One step's loss and largest gradient difference from the unsharded model (zero_grad first)."""
    ref = found["unsharded"]
    ref.optimizer.zero_grad()
    loss_ref = ref.forward_backward().item()
    want = {n: p.grad for n, p in ref.module.named_parameters()}
    out = {}
    for name, r in found.items():
        if name == "unsharded":
            continue
        r.optimizer.zero_grad()
        loss = r.forward_backward().item()
        grads = r.module.gradients()
        worst = max(((grads[n] - g).abs().max().item(), n) for n, g in want.items())
        out[name] = (abs(loss - loss_ref), *worst)
    return out


def expert_share(pm) -> float:
    """This rank's bytes of the stacks of experts over the whole stacks' bytes."""
    whole = {t: pm.full_shape(t) for t in pm.names}
    stacks = [t for t, shape in whole.items() if len(shape) == 3]
    held = sum(pm.store.find(t).numel() for t in stacks if pm.store.find(t) is not None)
    return held / sum(torch.Size(whole[t]).numel() for t in stacks)


def all_to_all_bytes(runner: Runner) -> int:
    """The bytes this rank sends to other ranks in one step's all-to-alls (its rows to other ranks' experts and
    back), counted from the splits each all-to-all is given."""
    sent = [0]
    original = dist.all_to_all_single

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):  # noqa: A002
        if input_split_sizes is not None and input.dim() == 2:
            me = dist.get_rank(group)
            row = input[0].numel() * input.element_size() if input.shape[0] else 0
            sent[0] += sum(n for i, n in enumerate(input_split_sizes) if i != me) * row
        return original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    dist.all_to_all_single = counting
    try:
        runner.step()
    finally:
        dist.all_to_all_single = original
    return sent[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    started = time.time()
    rows = []
    for name in args.models:
        model, tokens, target = build(name)
        found = runners(model, tokens, target, world)
        exact = exactness(found)
        ep = found[f"autoshard ep={world}"]
        sent = all_to_all_bytes(ep)
        layers = len(ep.module.job_plan.ep_plan.layers)
        top_k, tokens_here = MODELS[name][2]["num_experts_per_tok"], BATCH * SEQ // world
        analytic = tokens_here * top_k * HIDDEN * 4 * 2 * 2 * (world - 1) / world * layers
        busy = wait_until_quiet()
        times = {n: summarize(t) for n, t in time_steps({n: r.step for n, r in found.items()}, args.warmup,
                                                        args.steps).items()}
        shares = {n: expert_share(r.module) for n, r in found.items() if n != "unsharded"}
        rows.append((name, times, exact, shares, sent, analytic, busy))
        del found
    if dist.get_rank() == 0:
        write(rows, world, time.time() - started, args)
    dist.destroy_process_group()


def write(rows: list, world: int, seconds: float, args) -> None:
    tp, ep = f"autoshard tp={world}", f"autoshard ep={world}"
    lines = [
        f"# Expert parallelism at {world} ranks: ep={world} against tp={world} of the same experts, and the "
        "unsharded model", "",
        f"- command: `GLOO_SOCKET_IFNAME=lo .venv/bin/torchrun --standalone --nproc-per-node {world} bench/moe_ep.py`",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; whole run {seconds:.0f} s; "
        f"{args.steps} timed steps after {args.warmup}",
        f"- machine: {os.cpu_count()} CPU cores, Python {platform.python_version()}, torch {torch.__version__}; "
        f"{world} ranks (gloo), 1 thread each" + (" (more ranks than cores: every runner shares them alike)"
                                                 if world > (os.cpu_count() or 1) else ""),
        f"- batch {BATCH} x sequence {SEQ}, fp32, AdamW; the unsharded model and tp take the whole batch on every "
        f"rank, ep its {BATCH // world} rows of it (ep is carved from dp)", "",
        "| model | runner | median step ms | p10-p90 ms | ep / tp | expert bytes per rank / whole | "
        "loss / grad max diff vs unsharded | all-to-all bytes sent per step (analytic, uniform routing) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, times, exact, shares, sent, analytic, _ in rows:
        for runner in (ep, tp, "unsharded"):
            t = times[runner]
            ratio = f"{times[ep]['median_ms'] / times[tp]['median_ms']:.2f}x" if runner == ep else ""
            share = f"{shares[runner]:.3f}" if runner in shares else "1.000"
            diff = "reference" if runner == "unsharded" else \
                f"{exact[runner][0]:.1e} / {exact[runner][1]:.1e} ({exact[runner][2]})"
            moved = f"{sent / 2**10:.1f} KiB ({analytic / 2**10:.1f} KiB, {sent / analytic:.2f}x)" \
                if runner == ep else ""
            lines.append(f"| {name} | {runner} | {t['median_ms']:.1f} | {t['p10_ms']:.1f}-{t['p90_ms']:.1f} | "
                         f"{ratio} | {share} | {diff} | {moved} |")
    lines += ["", f"Other processes' CPU share before timing: {', '.join(f'{r[6]}' for r in rows)}. The all-to-all "
              "bytes are those of one step on rank 0; a routing that sends more of this rank's rows to its own "
              "experts than a uniform one moves less (the ratio below 1)."]
    out = BENCH / f"results_moe_ep_{world}.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
