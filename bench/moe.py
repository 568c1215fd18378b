"""A mixture of experts at tp=2: autoshard against the unsharded model and against a DTensor plan written by hand.

    GLOO_SOCKET_IFNAME=lo .venv/bin/torchrun --standalone --nproc-per-node 2 bench/moe.py

The model is transformers' Mixtral (its experts stored as two 3-D weights per layer, multiplied by the grouped
matmul transformers exports to), built from a small config with no download. Three runners train the same
batch on each of the two ranks, one thread each, taking turns step by step (``zero_grad``, forward, loss,
backward, AdamW step, between barriers):

- ``unsharded``: the model itself on each rank (the reference for exactness and time);
- ``autoshard``: ``autoshard.parallelize(model, Mesh(tp=2))``, trained with ``pm.step``; nothing edited;
- ``dtensor``: ``parallelize_module`` with the plan below, what a user of ``torch.distributed.tensor.parallel``
  writes for this model: q/k/v ColwiseParallel and o RowwiseParallel, the embedding RowwiseParallel and the LM
  head ColwiseParallel into ``loss_parallel``, the router replicated, and for the experts a style of its own
  (``ExpertsTensorParallel``: every expert's fused gate/up weight split on its output features, its down
  weight on its input features, the layer's tokens and routing weights marked replicated with partial
  gradients and its output all-reduced once), since PyTorch ships no style for 3-D expert weights. Its fused
  [gate; up] rows must be permuted so that a contiguous shard holds each rank's gate and up halves (without it
  the run is silently wrong), and its forward runs on the local shards.

Reported, from rank 0 into ``bench/results_moe.md``: each runner's loss and largest gradient difference from
the unsharded model after one step, its median step time, and its parameter bytes per rank.
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
import torch.nn.functional as F
from torch import nn

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent / "tests"), str(BENCH)]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from common import summarize, wait_until_quiet  # noqa: E402
from tp_dtensor import time_steps  # noqa: E402

SHAPE = {"vocab_size": 2048, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 8, "num_key_value_heads": 4, "num_local_experts": 8, "num_experts_per_tok": 2}
BATCH, SEQ, LR = 8, 128, 1e-3


def build(seed: int = 0):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    model = MixtralForCausalLM(MixtralConfig(**SHAPE, router_jitter_noise=0.0)).train()
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, SHAPE["vocab_size"], (BATCH, SEQ), generator=gen)
    target = torch.randint(0, SHAPE["vocab_size"], (BATCH, SEQ), generator=gen)
    return model, tokens, target


def token_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


# ------------------------------------------------------------------------------------------- the DTensor plan


def _gate_up_permutation(rows: int, tp: int) -> torch.Tensor:
    """Rows of [gate; up] reordered so that contiguous shard r is [gate rows of r; up rows of r]."""
    half = rows // 2
    parts = [torch.arange(half).chunk(tp), torch.arange(half, rows).chunk(tp)]
    return torch.cat([torch.cat([parts[0][r], parts[1][r]]) for r in range(tp)])


class ExpertsTensorParallel:
    """Megatron's MLP split inside every expert of a transformers experts module with 3-D weights."""

    def __init__(self, mesh) -> None:
        self.mesh = mesh

    def apply(self, module: nn.Module) -> None:
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

        mesh, tp = self.mesh, self.mesh.size()
        perm = _gate_up_permutation(module.gate_up_proj.shape[1], tp)
        module.gate_up_proj = nn.Parameter(distribute_tensor(module.gate_up_proj.detach()[:, perm], mesh, [Shard(1)]))
        module.down_proj = nn.Parameter(distribute_tensor(module.down_proj.detach(), mesh, [Shard(2)]))
        original = type(module).forward

        def replicated_with_partial_grad(t):
            return DTensor.from_local(t, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])

        def forward(hidden, top_k_index, top_k_weights):
            # both the tokens and the routing weights reach each rank's part of every expert: their gradients are
            # each rank's partial sums (without the routing weights' one the router trains wrong, 2.4e-3 off)
            x, weights = replicated_with_partial_grad(hidden), replicated_with_partial_grad(top_k_weights)
            params = module._parameters
            saved = dict(params)
            params.update({name: p.to_local() for name, p in saved.items()})  # the forward runs on this rank's part
            try:
                out = original(module, x, top_k_index, weights)
            finally:
                params.update(saved)
            return DTensor.from_local(out, mesh, [Partial()]).redistribute(mesh, [Replicate()]).to_local()

        module.forward = forward


def dtensor_tp_mixtral(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(len(model.model.layers)):
        plan.update({f"model.layers.{i}.self_attn.{p}_proj": ColwiseParallel() for p in "qkv"})
        plan[f"model.layers.{i}.self_attn.o_proj"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    for layer in model.model.layers:
        ExpertsTensorParallel(mesh).apply(layer.mlp.experts)
    return model


def dtensor_loss(model, tokens, target):
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        loss = token_loss(model(tokens).logits, target)
        loss.backward()
    return loss


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


# ------------------------------------------------------------------------------------------------- the runners


class Runner:
    def __init__(self, module, params, forward_backward) -> None:
        self.module, self.forward_backward = module, forward_backward
        self.optimizer = torch.optim.AdamW(params, lr=LR)

    def step(self):
        self.optimizer.zero_grad()
        loss = self.forward_backward()
        self.optimizer.step()
        return loss


def runners(model, tokens, target, mesh) -> dict[str, Runner]:
    import autoshard

    from harness.models import hf_token_loss

    eager = copy.deepcopy(model)
    pm = autoshard.parallelize(copy.deepcopy(model), autoshard.Mesh(tp=mesh.size()), example_inputs=(tokens,),
                               loss_fn=hf_token_loss, target=target)
    sharded = dtensor_tp_mixtral(copy.deepcopy(model), mesh)

    def eager_step():
        loss = hf_token_loss(eager(tokens), target)
        loss.backward()
        return loss

    return {"unsharded": Runner(eager, eager.parameters(), eager_step),
            "autoshard": Runner(pm, pm.parameters(), lambda: pm.step(tokens, target=target)),
            "dtensor": Runner(sharded, sharded.parameters(), lambda: dtensor_loss(sharded, tokens, target))}


def exactness(model, tokens, target, mesh) -> dict:
    """One step of each runner from the same weights: loss and the largest gradient difference from unsharded."""
    fresh = runners(model, tokens, target, mesh)
    ref = fresh["unsharded"]
    ref.optimizer.zero_grad()
    loss_ref = ref.forward_backward().item()
    want = {n: p.grad for n, p in ref.module.named_parameters()}
    found = {}
    for name in ("autoshard", "dtensor"):
        r = fresh[name]
        r.optimizer.zero_grad()
        loss = _full(r.forward_backward()).item()
        if name == "autoshard":
            grads = r.module.gradients()
        else:
            grads = {n: _full(p.grad) for n, p in r.module.named_parameters()}
            perm = _gate_up_permutation(SHAPE["intermediate_size"] * 2, mesh.size())
            grads = {n: g[:, perm.argsort()] if n.endswith("gate_up_proj") else g for n, g in grads.items()}
        worst = max(((grads[n] - g).abs().max().item(), n) for n, g in want.items())
        found[name] = {"loss_diff": abs(loss - loss_ref), "grad_max_diff": worst[0], "worst": worst[1]}
    return {"loss": loss_ref, **found}


def param_bytes(module) -> int:
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in module.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--output", default=str(BENCH / "results_moe.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    started = time.time()
    model, tokens, target = build()
    exact = exactness(model, tokens, target, mesh)
    found = runners(model, tokens, target, mesh)
    busy = wait_until_quiet()
    times = time_steps({name: r.step for name, r in found.items()}, args.warmup, args.steps)
    sizes = {name: param_bytes(r.module) for name, r in found.items()}
    if dist.get_rank() == 0:
        write(args, exact, {n: summarize(t) for n, t in times.items()}, sizes, busy, time.time() - started)
    dist.destroy_process_group()


def write(args, exact: dict, times: dict, sizes: dict, busy, seconds: float) -> None:
    full = sizes["unsharded"]
    base = times["unsharded"]["median_ms"]
    dt = times["dtensor"]["median_ms"]
    lines = [
        "# A mixture of experts at tp=2: autoshard, a hand-written DTensor plan, the unsharded model", "",
        "- command: `GLOO_SOCKET_IFNAME=lo .venv/bin/torchrun --standalone --nproc-per-node 2 bench/moe.py`",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; whole run {seconds:.0f} s",
        f"- machine: {os.cpu_count()} CPU cores, Python {platform.python_version()}, torch {torch.__version__}; "
        "2 ranks (gloo), 1 thread each",
        f"- model: transformers Mixtral {SHAPE}, batch {BATCH} x sequence {SEQ} (the same batch on both ranks), "
        f"fp32, AdamW; experts as 3-D weights through transformers' grouped matmul; other processes' CPU share "
        f"before timing: {busy}", "",
        "| runner | median step ms | p10-p90 ms | time / unsharded | time / DTensor | parameter MiB per rank "
        "| share of full | loss / grad max diff vs unsharded |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in ("autoshard", "dtensor", "unsharded"):
        t = times[name]
        diff = "reference" if name == "unsharded" else \
            f"{exact[name]['loss_diff']:.1e} / {exact[name]['grad_max_diff']:.1e} ({exact[name]['worst']})"
        lines.append(f"| {name} | {t['median_ms']:.1f} | {t['p10_ms']:.1f}-{t['p90_ms']:.1f} | "
                     f"{t['median_ms'] / base:.2f}x | {t['median_ms'] / dt:.2f}x | {sizes[name] / 2**20:.2f} | "
                     f"{sizes[name] / full:.3f} | {diff} |")
    lines += ["", "The DTensor plan's edits to the model: the fused [gate; up] rows of every expert permuted (and "
              "permuted back to compare gradients); the experts' forward replaced by one that runs on the local "
              "shards between a replicated input with a partial gradient and an all-reduced output. autoshard "
              "needs neither."]
    Path(args.output).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
