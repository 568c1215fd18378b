"""Activation checkpointing by segments (``autoshard/runtime/recompute.py``): where the program is cut, and that the
recomputed step is the eager one."""

from __future__ import annotations

import torch
import transformers

import autoshard
from autoshard.runtime import recompute

LAYERS = 4


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=64, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config), config


def _loss(output, target):
    return torch.nn.functional.cross_entropy(output.logits.flatten(0, 1), target.flatten())


def test_a_stack_of_layers_is_cut_between_its_blocks_and_trains_as_eager():
    """Whole-program checkpointing recomputed every activation at once in the backward (the peak of no
    checkpointing): the program is now cut where the fewest bytes cross, at least once in every decoder layer, and a
    step recomputed by segments gives eager's loss and gradients."""
    model, config = _llama()
    reference = transformers.LlamaForCausalLM(config)
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    pm = autoshard.parallelize(model, autoshard.Mesh(), example_inputs=(ids,), loss_fn=_loss, target=ids,
                               activation_checkpointing=True)
    cuts = recompute.cuts(pm.latest.program.gm)
    layers = {name.split("layers.")[1].split(".")[0] for cut in cuts
              for name, _ in cut.meta.get("nn_module_stack", {}).values() if "layers." in name}
    assert layers == {str(k) for k in range(LAYERS)}, [c.name for c in cuts]
    assert recompute.segmented(pm.latest.program.gm) is not None
    loss = pm.step(ids, target=ids)
    expected = _loss(reference(ids), ids)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-6)
    grads = pm.gradients()
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-6, msg=name)
