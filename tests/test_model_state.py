"""The parallel model's state as the unmodified model's: ``state_dict()`` keys, and buffers of a model built on meta.

``state.state_dict(pm)`` must load with ``strict=True`` into the model it stands for; ``materialize()`` must
recompute the buffers a module derives from its configuration (rotary tables) and, when it cannot, name every
buffer it still needs in one error.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autoshard

from harness import golden_loop

# ---------------------------------------------------------------------------------------------- state_dict()


@pytest.mark.parametrize("name,mesh", [("hf_llama", {"tp": 2}), ("gpt", {"pp": 2})],
                         ids=["hf_llama-tp2-rotary-buffers", "gpt-pp2-tied-head"])
def test_state_dict_has_exactly_the_model_s_keys_and_loads_strictly(pools, name, mesh):
    """Seed: HF Llama's non-persistent ``rotary_emb.inv_freq`` appeared, so ``load_state_dict(strict=True)`` into the
    unmodified model failed. A tied head is listed under both of its names, as ``model.state_dict()`` lists it."""
    for result in pools.get(2).run(golden_loop.state_dict_keys, name, mesh):
        assert result["keys"] == result["expected"], (set(result["keys"]) ^ set(result["expected"]))
        assert result["method"] == result["expected"]
        assert "unexpected keys ['not_in_the_model.weight']" in result["refused"], result["refused"]


# ------------------------------------------------------------------------------------------- materialize()


def test_an_hf_llama_built_on_meta_recomputes_its_rotary_tables(pools):
    """Seed: materialize() asked for ``rotary_emb.inv_freq``, then on the next try for ``original_inv_freq``."""
    for result in pools.get(2).run(golden_loop.meta_hf_rotary, {"tp": 2}):
        assert result["loss"] < 1e-5, result
        assert result["buffers"] and all(d == 0.0 for d in result["buffers"].values()), result


@pytest.mark.parametrize("mesh,options", [({"tp": 2}, {}), ({"pp": 2}, {"microbatches": 2})], ids=["tp2", "pp2"])
def test_the_meta_route_end_to_end(pools, tmp_path, mesh, options):
    """An HF Llama built on meta, CPU example inputs, materialize, load_pretrained, train, evaluate (at the captured
    shape and a new one), save_pretrained: it had failed at four points (the capture's device mismatch naming no
    line; load_pretrained before materialize returning with every parameter on meta; pm(x) after materialize on a
    device mismatch; a new shape's build reading meta buffers). Against the unsharded model from the same files."""
    for result in pools.get(2).run(golden_loop.meta_route, mesh, str(tmp_path), **options):
        assert "call pm.materialize() first" in result["early"], result["early"]
        assert result["worst"] < 1e-4 and result["evaluated"] < 1e-5 and result["written"] < 1e-4, result


def test_materialize_init_true_on_an_hf_model_names_its_init_weights():
    """HuggingFace's modules initialise through the model's ``_init_weights``, not ``reset_parameters``: the
    refusal now says to pass it."""
    from harness.models import build

    case = build("hf_llama", device="meta")
    pm = autoshard.parallelize(case.model, autoshard.Mesh(), example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target)
    with pytest.raises(ValueError, match=r"pm.materialize\(init=model._init_weights\)"):
        pm.materialize("cpu", init=True)


class _Tables(nn.Module):
    """Rotary tables from constructor arguments it does not keep: nothing can build them again."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        inv_freq = 1.0 / 500.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)


class _Rotary(nn.Module):
    """Rotary tables from constructor arguments it keeps under their own names: it can be built again."""

    def __init__(self, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        self.dim, self.base = dim, base
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim),
                             persistent=False)


class _RenamedRotary(nn.Module):
    """Keeps its ``base`` as ``theta``: built again from its attributes it would take the default base."""

    def __init__(self, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        self.dim, self.theta = dim, base
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim),
                             persistent=False)


class _Net(nn.Module):
    """A projection scaled by rotary-like tables of the positions: (B, T, 8) -> (B, T, 8)."""

    def __init__(self, tables: nn.Module) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.rope = tables

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device, dtype=torch.float32)  # (T,)
        buffers = list(self.rope.buffers())
        freqs = torch.outer(pos, sum(buffers) / len(buffers))  # (T, 4)
        return self.proj(x) * torch.cat((freqs, freqs), dim=-1).cos()  # (B, T, 8)


class _TitanStyle(nn.Module):
    """Owns its tables beside its weights and recomputes them in ``init_weights(buffer_device)`` (torchtitan)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("freqs", self._tables(), persistent=False)

    @staticmethod
    def _tables() -> torch.Tensor:
        return 1.0 / 700.0 ** (torch.arange(0, 8, dtype=torch.float32) / 8)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        with torch.device(buffer_device or self.freqs.device):
            self.freqs = self._tables()
        nn.init.normal_(self.proj.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.freqs  # (B, T, 8)


class _Forgetful(_TitanStyle):
    """Its ``init_weights(buffer_device)`` forgets the tables: taking that for a rebuild would train on garbage."""

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        nn.init.normal_(self.proj.weight, std=0.02)


_MODELS = {"tables": lambda: _Net(_Tables(8)), "rotary": lambda: _Net(_Rotary(8, base=500.0)),
           "renamed": lambda: _Net(_RenamedRotary(8, base=500.0)), "titan": _TitanStyle, "forgetful": _Forgetful}


def _on_meta_and_cpu(kind: str):
    """The same model built on meta and on the CPU (from one seed), parallelized on one rank from the meta one."""
    torch.manual_seed(0)
    with torch.device("meta"):
        meta_model = _MODELS[kind]()
    torch.manual_seed(0)
    reference = _MODELS[kind]()
    x, target = torch.randn(2, 6, 8), torch.randn(2, 6, 8)
    pm = autoshard.parallelize(meta_model, autoshard.Mesh(), example_inputs=(x.to("meta"),),
                               loss_fn=nn.functional.mse_loss, target=target.to("meta"))
    return pm, reference, x, target


def test_materialize_names_every_buffer_it_cannot_rebuild_in_one_error():
    pm, _, _, _ = _on_meta_and_cpu("tables")
    with pytest.raises(ValueError) as caught:
        pm.materialize("cpu")
    message = str(caught.value)
    assert "rope.inv_freq" in message and "rope.original_inv_freq" in message, message
    assert "_Tables" in message and "materialize(buffers=" in message, message


def test_a_constructor_argument_kept_under_another_name_is_not_guessed():
    """Built again from its attributes, ``_RenamedRotary`` would take the default base: refuse, never guess."""
    pm, _, _, _ = _on_meta_and_cpu("renamed")
    with pytest.raises(ValueError, match=r"rope\.inv_freq.*_RenamedRotary.*theta"):
        pm.materialize("cpu")


def test_a_rebuild_that_leaves_the_buffer_alone_is_not_taken_for_one():
    pm, _, _, _ = _on_meta_and_cpu("forgetful")
    with pytest.raises(ValueError, match=r"freqs .*init_weights\(buffer_device=\.\.\.\): it left some elements"):
        pm.materialize("cpu")


@pytest.mark.parametrize("kind", ["rotary", "titan"], ids=["constructor-again", "init_weights-buffer_device"])
def test_materialize_recomputes_buffers_the_module_can_rebuild(kind):
    pm, reference, x, target = _on_meta_and_cpu(kind)
    pm.materialize("cpu")
    pm.load_state_dict(reference.state_dict())
    loss = pm.step(x, target=target)
    torch.testing.assert_close(loss, nn.functional.mse_loss(reference(x), target), rtol=1e-6, atol=0)
    assert all(b.device.type == "cpu" for b in pm.model.buffers())
