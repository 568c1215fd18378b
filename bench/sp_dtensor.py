"""PyTorch's own tensor + sequence parallelism on an HF Llama: DTensor ``parallelize_module`` with torchtitan's plan.

The plan (torchtitan's ``apply_tp`` for Llama, written for transformers' module names): the token embedding
RowwiseParallel, every RMSNorm ``SequenceParallel``, attention's and
the MLP's inputs gathered by ``PrepareModuleInput`` (``Shard(1)`` -> ``Replicate()``), q/k/v and gate/up
ColwiseParallel, o_proj and down_proj RowwiseParallel with outputs ``Shard(1)`` (reduce-scatters), the LM head
ColwiseParallel with its logits left sharded for ``loss_parallel``. transformers' attention takes its input as a
keyword argument (``hidden_states=``), which ``PrepareModuleInput`` is told. One change from torchtitan: the
embedding's output is all-reduced whole and split at the first layer (torchtitan reduce-scatters it), since
transformers computes the rotary tables from that output's shape, which a ``Shard(1)`` DTensor gives wrong.
Nothing of the model itself is edited.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)


def dtensor_tp_sp_llama(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """``model`` (an HF ``LlamaForCausalLM``) sharded in place over the 1-D ``mesh``; returns it."""
    parallelize_module(model, mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "model.layers.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                             use_local_output=True),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for layer in model.model.layers:
        parallelize_module(layer, mesh, {
            "input_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        })
    return model


def sp_loss(model: torch.nn.Module, tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The token loss on vocab-sharded logits, differentiated inside ``loss_parallel`` (call ``backward`` on it
    inside the same context: ``loss_and_backward``)."""
    logits = model(tokens).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def loss_and_backward(model: torch.nn.Module, tokens: torch.Tensor, target: torch.Tensor) -> float:
    with loss_parallel():
        loss = sp_loss(model, tokens, target)
        loss.backward()
    return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
