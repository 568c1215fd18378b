"""PyTorch's own tensor parallelism as the baseline: DTensor ``parallelize_module`` with hand-written plans.

    GLOO_SOCKET_IFNAME=lo torchrun --standalone --nproc-per-node 2 bench/tp_dtensor.py --model gpt --tp 2 --json

This is what a user of ``torch.distributed.tensor.parallel`` writes by hand for the two decoders of the test
zoo (``tests/harness/models.py``), and what autoshard's tensor parallelism is measured against. For each model and
plan one run reports, from rank 0:

- exactness against the unsharded model built from the same seed in the same process: the loss, every
  parameter's gradient (DTensor gradients gathered with ``full_tensor()``), the loss after one and every
  parameter after two AdamW steps (which also checks that a tied weight stays tied), at fp32 tolerances;
- collectives of one training step by type, counted with ``CommDebugMode`` separately for the forward
  (model and loss), the backward and the optimizer step, with their bytes (the size of the whole tensor
  the collective is about: the reduced tensor of an all-reduce, the gathered output of an all-gather, the
  input of a reduce-scatter) and the bytes a ring algorithm sends per rank for them;
- the median step time (``zero_grad``, forward, loss, backward, AdamW step, between barriers) next to the
  unsharded model's step in the same processes, taking turns step by step;
- parameter bytes per rank (local shards) and of the whole model.

The plans (``dtensor_tp_gpt``, ``dtensor_tp_llama``) follow the Megatron layout: attention projections
in (q, k, v; the fused ``c_attn``) and the MLP's first linears ColwiseParallel, the output projections
RowwiseParallel; optionally (``vocab_parallel``) the token embedding RowwiseParallel and the LM head
ColwiseParallel with its logits left sharded for ``loss_parallel``; optionally (``shared_input_grad``)
``PrepareModuleInput`` on each attention and MLP module, so that the input gradients of the projections
that read the same input are summed as DTensor partials and all-reduced once, as torchtitan's plans do.

DTensor TP does not change the model's Python code, so the code has to agree with the shards by hand.
The edits each plan makes to the model (``MODEL_EDITS``; autoshard needs none of them):

GPT (nanoGPT-style, fused qkv, tied LM head):

1. Permute the rows of ``c_attn.weight`` and ``c_attn.bias``. Its output is ``[q | k | v]``, each
   ``n_embd`` wide; a contiguous ColwiseParallel shard of it would give rank 0 all of q and half of k.
   After the permutation rank r's contiguous shard is ``[q heads of r | k heads of r | v heads of r]``.
   Checkpoints, the gradient check and anything else that reads ``c_attn`` must undo the permutation.
2. Set ``attn.n_head`` and ``attn.n_embd`` to their per-rank values (``n_head / tp``, ``n_embd / tp``):
   the forward splits the fused output by ``n_embd`` and views it by ``n_head``.
3. Replace ``GPTAttention.forward`` on each attention module: it takes ``C`` from ``x.size()``, the full
   hidden size of the replicated input, and uses it for the head size (``C // n_head``) and the final
   ``view(B, T, C)``; no per-rank value of the attributes makes both right. The replacement is the same
   code with ``C = self.n_embd``.
4. With ``vocab_parallel``, re-tie the embedding to the LM head after ``parallelize_module``: each style
   replaces its module's ``weight`` with a new DTensor parameter, so the tied weight becomes two
   independent parameters (both sharded on the vocabulary, so one shared DTensor serves both), and the
   loss must be computed and differentiated inside ``loss_parallel()``.

Llama (separate q/k/v/o, SwiGLU, grouped-query attention, untied LM head):

1. Set ``self_attn.n_head`` and ``self_attn.n_kv_head`` to their per-rank values. Contiguous shards of
   q, k and v already hold whole heads, and the query heads of a rank use exactly the kv heads of that
   rank (``repeat_interleave`` maps query head h to kv head ``h // (n_head / n_kv_head)``), so no
   permutation is needed when ``n_kv_head`` is divisible by tp.
2. With ``vocab_parallel``, compute and differentiate the loss inside ``loss_parallel()``.

What happens to the GPT without each edit (torch 2.13, CPU, gloo, tp=2):

- without the permutation the step runs and is silently wrong (every rank's q, k and v are the wrong
  columns; the loss is off by about 2e-3 and gradients by 2e-2);
- without the forward replacement it raises ``shape '[8, 64, 2, 64]' is invalid for input of size 32768``;
- without re-tying, the embedding and the LM head train as two parameters: the loss of the first step is
  right, its gradients and every later step are not, and nothing reports it;
- leaving the model unedited and ``c_attn``'s output a DTensor (``use_local_output=False``), so that the
  model's own split and views see global shapes, fails: ``aten._scaled_dot_product_flash_attention_for_cpu``
  has no DTensor sharding strategy.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import time
import types
from collections import defaultdict
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import summarize, wait_until_quiet
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils._pytree import tree_leaves

from harness.models import _perturb_constant_params, build_gpt_model, build_llama_model, token_data, token_loss

MODEL_EDITS = {
    "gpt": [
        "permute c_attn weight/bias rows so each rank's contiguous shard is [q heads | k heads | v heads] of its own",
        "set attn.n_head and attn.n_embd to per-rank values",
        "replace GPTAttention.forward: it takes C from x.size() (full hidden) for the head size and final view",
        "vocab_parallel: re-tie transformer.wte.weight to lm_head.weight after parallelize_module",
        "vocab_parallel: loss and backward inside loss_parallel()",
    ],
    "llama": [
        "set self_attn.n_head and self_attn.n_kv_head to per-rank values",
        "vocab_parallel: loss and backward inside loss_parallel()",
    ],
}


@dataclass(frozen=True)
class TPShape:
    """The benchmark decoders' shape and the batch of one training step (the same on every TP rank)."""

    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    n_kv_head: int = 2  # Llama only
    vocab: int = 256
    seq: int = 64
    batch: int = 8
    gpt_ffn: int = 512  # nanoGPT's 4 * hidden
    llama_ffn: int = 384  # SwiGLU's three matrices at about the parameter count of a 4x GELU MLP


# --------------------------------------------------------------------------------------------------------------------
# Plans
# --------------------------------------------------------------------------------------------------------------------


def qkv_permutation(n_embd: int, tp: int) -> torch.Tensor:
    """Row order of a fused ``[q | k | v]`` projection whose contiguous tp-shards hold ``[q_r | k_r | v_r]``."""
    return torch.arange(3 * n_embd).view(3, tp, n_embd // tp).transpose(0, 1).reshape(-1)


def _gpt_attention_forward_local(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``GPTAttention.forward`` with the per-rank hidden size ``C = self.n_embd`` instead of ``x.size(2)``."""
    B, T, _ = x.size()
    C = self.n_embd
    q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
    k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
    q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
    v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
    y = y.transpose(1, 2).contiguous().view(B, T, C)
    return self.c_proj(y)


def _shared_input(n_args: int = 1) -> PrepareModuleInput:
    """Make a module's first input a replicated DTensor, so its linears' input gradients sum before one all-reduce."""
    layouts = (Replicate(),) + (None,) * (n_args - 1)
    return PrepareModuleInput(input_layouts=layouts, desired_input_layouts=layouts)


def _vocab_plan(embedding: str, lm_head: str) -> dict:
    return {
        embedding: RowwiseParallel(input_layouts=Replicate()),
        lm_head: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }


def dtensor_tp_gpt(model: nn.Module, mesh: DeviceMesh, *, vocab_parallel: bool = True,
                   shared_input_grad: bool = False) -> nn.Module:
    """Tensor-parallelize the nanoGPT-style GPT in place over the 1-D ``mesh`` (see ``MODEL_EDITS['gpt']``)."""
    tp = mesh.size()
    cfg = model.cfg
    if cfg.n_head % tp or cfg.ffn % tp or (vocab_parallel and cfg.vocab % tp):
        raise ValueError(f"heads {cfg.n_head}, ffn {cfg.ffn} and vocab {cfg.vocab} must be divisible by tp={tp}")
    perm = qkv_permutation(cfg.n_embd, tp)
    for block in model.transformer.h:
        attn = block.attn
        with torch.no_grad():
            attn.c_attn.weight.copy_(attn.c_attn.weight[perm])
            if attn.c_attn.bias is not None:
                attn.c_attn.bias.copy_(attn.c_attn.bias[perm])
        attn.n_head //= tp
        attn.n_embd //= tp
        attn.forward = types.MethodType(_gpt_attention_forward_local, attn)
        plan = {
            "attn.c_attn": ColwiseParallel(),
            "attn.c_proj": RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(),
            "mlp.c_proj": RowwiseParallel(),
        }
        if shared_input_grad:
            plan.update({"attn": _shared_input(), "mlp": _shared_input()})
        parallelize_module(block, mesh, plan)
    if vocab_parallel:
        parallelize_module(model, mesh, _vocab_plan("transformer.wte", "lm_head"))
        model.transformer.wte.weight = model.lm_head.weight
    return model


def dtensor_tp_llama(model: nn.Module, mesh: DeviceMesh, *, vocab_parallel: bool = True,
                     shared_input_grad: bool = False) -> nn.Module:
    """Tensor-parallelize the Llama-style decoder in place over the 1-D ``mesh`` (see ``MODEL_EDITS['llama']``)."""
    tp = mesh.size()
    cfg = model.cfg
    if cfg.n_kv_head % tp or cfg.ffn % tp or (vocab_parallel and cfg.vocab % tp):
        raise ValueError(f"kv heads {cfg.n_kv_head}, ffn {cfg.ffn}, vocab {cfg.vocab} must be divisible by tp={tp}")
    for layer in model.layers:
        layer.self_attn.n_head //= tp
        layer.self_attn.n_kv_head //= tp
        plan = {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }
        if shared_input_grad:
            plan.update({"self_attn": _shared_input(3), "mlp": _shared_input()})
        parallelize_module(layer, mesh, plan)
    if vocab_parallel:
        parallelize_module(model, mesh, _vocab_plan("embed_tokens", "lm_head"))
    return model


PLANS = {"gpt": dtensor_tp_gpt, "llama": dtensor_tp_llama}


# --------------------------------------------------------------------------------------------------------------------
# Models, data and one training step
# --------------------------------------------------------------------------------------------------------------------


def build_case(name: str, shape: TPShape = TPShape(), seed: int = 0):
    """The unsharded model (biases and norm weights perturbed as in the zoo) and one batch: (model, tokens, target)."""
    torch.manual_seed(seed)
    if name == "gpt":
        model = build_gpt_model(n_layer=shape.n_layer, n_embd=shape.n_embd, n_head=shape.n_head, vocab=shape.vocab,
                                seq=shape.seq, ffn=shape.gpt_ffn)
    elif name == "llama":
        model = build_llama_model(n_layer=shape.n_layer, n_embd=shape.n_embd, n_head=shape.n_head,
                                  n_kv_head=shape.n_kv_head, vocab=shape.vocab, seq=shape.seq, ffn=shape.llama_ffn)
    else:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(PLANS)}")
    _perturb_constant_params(model, torch.Generator().manual_seed(seed + 1))
    tokens, target = token_data(torch.Generator().manual_seed(seed + 2), batch=shape.batch, seq=shape.seq,
                                vocab=shape.vocab)
    return model, tokens, target


def loss_context(vocab_parallel: bool):
    """``loss_parallel()`` when the logits are sharded on the vocabulary, else nothing."""
    return loss_parallel() if vocab_parallel else contextlib.nullcontext()


def forward_loss(model: nn.Module, tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return token_loss(model(tokens), target)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


# --------------------------------------------------------------------------------------------------------------------
# Exactness
# --------------------------------------------------------------------------------------------------------------------

RTOL, ATOL = 1e-4, 1e-5  # loss, gradients and parameters after two steps, fp32
LR = 1e-3
# AdamW moves a parameter by about lr * g / (|g| + eps). Many gradients here are near the default eps (1e-8),
# where fp32 round-off differences of 1e-10 would become parameter differences of 1e-4; the check's AdamW
# uses eps 1e-6 so that the parameters after its steps are held to the gradients' tolerance. A wrong or
# untied gradient still moves a parameter by up to 2 * lr per step.
CHECK_EPS = 1e-6


def _unpermuted(name: str, full: torch.Tensor, model_name: str, shape: TPShape, tp: int) -> torch.Tensor:
    """A gathered GPT ``c_attn`` tensor back in the unsharded row order; anything else unchanged."""
    if model_name != "gpt" or ".c_attn." not in name:
        return full
    restored = torch.empty_like(full)
    restored[qkv_permutation(shape.n_embd, tp)] = full
    return restored


def _max_diff(named_ref: dict, named_tp: dict, model_name: str, shape: TPShape, tp: int, attr: str):
    """(largest |difference|, its parameter, all within tolerance) over every parameter's ``attr``."""
    worst, worst_name, ok = 0.0, "", True
    for name, p in named_ref.items():
        mine = _unpermuted(name, _full(getattr(named_tp[name], attr)), model_name, shape, tp)
        ref = getattr(p, attr)
        ok = ok and torch.allclose(mine, ref, rtol=RTOL, atol=ATOL)
        diff = (mine - ref).abs().max().item()
        if diff >= worst:
            worst, worst_name = diff, name
    return worst, worst_name, ok


def check_exactness(model_name: str, mesh: DeviceMesh, shape: TPShape, **plan_kw) -> dict:
    """Loss and all gradients, then the loss after one and the parameters after two AdamW steps, against the
    unsharded model. A parameter the plan untied shows as an extra parameter and as wrong gradients."""
    tp = mesh.size()
    ref, tokens, target = build_case(model_name, shape)
    sharded = PLANS[model_name](copy.deepcopy(ref), mesh, **plan_kw)
    named_ref, named_tp = dict(ref.named_parameters()), dict(sharded.named_parameters())
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=LR, eps=CHECK_EPS)
    opt_tp = torch.optim.AdamW(sharded.parameters(), lr=LR, eps=CHECK_EPS)
    losses = []
    for _ in range(2):
        opt_ref.zero_grad()
        opt_tp.zero_grad()
        loss_ref = forward_loss(ref, tokens, target)
        loss_ref.backward()
        with loss_context(plan_kw.get("vocab_parallel", True)):
            loss_tp = forward_loss(sharded, tokens, target)
            loss_tp.backward()
        losses.append((loss_ref.item(), _full(loss_tp).item()))
        if len(losses) == 1:
            grad = _max_diff(named_ref, named_tp, model_name, shape, tp, "grad")
        opt_ref.step()
        opt_tp.step()
    param = _max_diff(named_ref, named_tp, model_name, shape, tp, "data")
    loss_ok = all(abs(a - b) <= ATOL + RTOL * abs(a) for a, b in losses)
    extra = sorted(named_tp.keys() - named_ref.keys())
    return {
        "ok": bool(loss_ok and grad[2] and param[2] and not extra),
        "tolerance": f"rtol {RTOL}, atol {ATOL}; AdamW eps {CHECK_EPS} in the check",
        "loss": losses[0][0],
        "loss_diff": abs(losses[0][0] - losses[0][1]),
        "loss_after_step_diff": abs(losses[1][0] - losses[1][1]),
        "grad_max_diff": grad[0],
        "grad_worst_param": grad[1],
        "param_after_2_steps_max_diff": param[0],
        "param_worst": param[1],
        "n_params_compared": len(named_ref),
        "extra_params": extra,
    }


# --------------------------------------------------------------------------------------------------------------------
# Collectives
# --------------------------------------------------------------------------------------------------------------------


def _tensor_bytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


def ring_bytes(op: str, nbytes: int, n: int) -> float:
    """Bytes one rank sends for a collective on a whole tensor of ``nbytes`` under a ring algorithm over ``n``."""
    if n <= 1:
        return 0.0
    if op.startswith("all_reduce"):
        return 2 * (n - 1) / n * nbytes
    return (n - 1) / n * nbytes  # all-gather, reduce-scatter, all-to-all, broadcast (pipelined)


class CommBytesMode(CommDebugMode):
    """``CommDebugMode`` that also adds up the bytes of each collective (the size of the whole tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.comm_bytes: dict[str, int] = defaultdict(int)
        self._collectives = {str(op) for op in self.comm_registry}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = sum(self.comm_counts.values())
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is not NotImplemented and sum(self.comm_counts.values()) > before:
            name = func._overloadpacket.__name__
            self.comm_bytes[name] += max(_tensor_bytes(args), _tensor_bytes(out))
        return out

    def summary(self, n: int) -> dict:
        counts = {getattr(op, "__name__", str(op)): c for op, c in self.comm_counts.items() if c}
        nbytes = dict(self.comm_bytes)
        return {
            "counts": counts,
            "total": sum(counts.values()),
            "bytes": nbytes,
            "total_bytes": sum(nbytes.values()),
            "ring_bytes_sent_per_rank": sum(ring_bytes(op, b, n) for op, b in nbytes.items()),
        }


def count_collectives(model: nn.Module, tokens: torch.Tensor, target: torch.Tensor, vocab_parallel: bool,
                      n: int) -> dict:
    """Collectives of one training step: forward with loss, backward, and the AdamW step, counted apart."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    optimizer.zero_grad()
    phases = {phase: CommBytesMode() for phase in ("forward", "backward", "optimizer")}
    with loss_context(vocab_parallel):
        with phases["forward"]:
            loss = forward_loss(model, tokens, target)
        with phases["backward"]:
            loss.backward()
    with phases["optimizer"]:
        optimizer.step()
    result = {phase: mode.summary(n) for phase, mode in phases.items()}
    totals: dict[str, int] = defaultdict(int)
    for phase in phases:
        for op, c in result[phase]["counts"].items():
            totals[op] += c
    result["step"] = {
        "counts": dict(totals),
        "total": sum(totals.values()),
        "total_bytes": sum(result[p]["total_bytes"] for p in phases),
        "ring_bytes_sent_per_rank": sum(result[p]["ring_bytes_sent_per_rank"] for p in phases),
    }
    return result


# --------------------------------------------------------------------------------------------------------------------
# Time and memory
# --------------------------------------------------------------------------------------------------------------------


def param_bytes(model: nn.Module) -> int:
    """Bytes of this rank's parameters (local shards of DTensors; a tied parameter once)."""
    return sum(_local(p).numel() * _local(p).element_size() for p in model.parameters())


def _train_step(model: nn.Module, optimizer, tokens, target, vocab_parallel: bool):
    def step() -> None:
        optimizer.zero_grad()
        with loss_context(vocab_parallel):
            forward_loss(model, tokens, target).backward()
        optimizer.step()

    return step


def time_steps(steps: dict, warmup: int, repeats: int) -> dict[str, list[float]]:
    """Run the steps in rotating order ``warmup + repeats`` times, each between barriers; the last timed (ms)."""
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for index in range(warmup + repeats):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            start = time.perf_counter()
            steps[name]()
            dist.barrier()
            if index >= warmup:
                times[name].append((time.perf_counter() - start) * 1000)
    return times


# --------------------------------------------------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------------------------------------------------


def run_tp_dtensor(model_name: str, tp: int, shape: TPShape = TPShape(), *, vocab_parallel: bool = True,
                   shared_input_grad: bool = False, warmup: int = 3, steps: int = 20) -> dict:
    """Everything for one model and plan on this rank (process group initialised, world size == tp)."""
    if dist.get_world_size() != tp:
        raise ValueError(f"run with world size == tp (world {dist.get_world_size()}, tp {tp})")
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    plan_kw = {"vocab_parallel": vocab_parallel, "shared_input_grad": shared_input_grad}
    exact = check_exactness(model_name, mesh, shape, **plan_kw)

    eager, tokens, target = build_case(model_name, shape)
    full_bytes = param_bytes(eager)
    sharded = PLANS[model_name](copy.deepcopy(eager), mesh, **plan_kw)
    counted = PLANS[model_name](copy.deepcopy(eager), mesh, **plan_kw)
    comms = count_collectives(counted, tokens, target, vocab_parallel, tp)

    runners = {
        "dtensor_tp": _train_step(sharded, torch.optim.AdamW(sharded.parameters(), lr=LR), tokens, target,
                                  vocab_parallel),
        "eager": _train_step(eager, torch.optim.AdamW(eager.parameters(), lr=LR), tokens, target, False),
    }
    busy = wait_until_quiet()
    times = time_steps(runners, warmup, steps)
    per_rank = [None] * tp
    dist.all_gather_object(per_rank, param_bytes(sharded))
    step_ms = {k: {m: v for m, v in summarize(t).items() if m != "times_ms"} for k, t in times.items()}
    return {
        "runner": "dtensor_tp",
        "model": model_name,
        "tp": tp,
        "plan": plan_kw,
        "shape": asdict(shape),
        "threads": torch.get_num_threads(),
        "exact": exact,
        "collectives": comms,
        "step_ms": step_ms["dtensor_tp"],
        "eager_step_ms": step_ms["eager"],
        "others_cpu_share_before_timing": busy,
        "param_bytes_per_rank": per_rank,
        "param_bytes_full": full_bytes,
        "model_edits": [e for e in MODEL_EDITS[model_name] if vocab_parallel or not e.startswith("vocab_parallel")],
    }


def _print_report(result: dict) -> None:
    ex, comms = result["exact"], result["collectives"]
    print(f"{result['model']} tp={result['tp']} plan={result['plan']}")
    print(f"  exact: {ex['ok']}  loss diff {ex['loss_diff']:.2e}  grad max diff {ex['grad_max_diff']:.2e} "
          f"({ex['grad_worst_param']})  loss after a step diff {ex['loss_after_step_diff']:.2e}")
    for phase in ("forward", "backward", "optimizer", "step"):
        c = comms[phase]
        print(f"  {phase:9s} collectives {c['counts']} = {c['total']}, {c['total_bytes'] / 2**20:.2f} MiB, "
              f"ring {c['ring_bytes_sent_per_rank'] / 2**20:.2f} MiB sent per rank")
    print(f"  step {result['step_ms']['median_ms']:.1f} ms (unsharded {result['eager_step_ms']['median_ms']:.1f} ms)")
    print(f"  parameter bytes per rank {result['param_bytes_per_rank']} of {result['param_bytes_full']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(PLANS), default="gpt")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--no-vocab-parallel", action="store_true", help="keep embedding and LM head replicated")
    parser.add_argument("--shared-input-grad", action="store_true", help="PrepareModuleInput on attention and MLP")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print one JSON line on rank 0")
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    try:
        result = run_tp_dtensor(args.model, args.tp, vocab_parallel=not args.no_vocab_parallel,
                                shared_input_grad=args.shared_input_grad, warmup=args.warmup, steps=args.steps)
        if dist.get_rank() == 0:
            print(json.dumps(result)) if args.json else _print_report(result)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
