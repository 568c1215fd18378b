"""``pm.save_pretrained``: HuggingFace's format from any mesh, which the unmodified ``from_pretrained`` loads exactly.

Tiny corpus models with the layouts that make gathering hard: phi3's fused q/k/v (blocked, and at tp=4 with k and v
held whole), GPT-2's Conv1D weights and tied head, Mixtral's experts; trained two steps, saved in files of 20 KB (so
several, with an index), loaded by ``from_pretrained`` and compared with ``pm.state_dict()`` bit for bit.
"""

from __future__ import annotations

import pytest

from harness import golden_pretrained

CELLS = [
    ("phi3", {"tp": 2}, {}),
    ("gpt2", {"pp": 2}, {}),
    ("mixtral", {"dp": 2, "tp": 2}, {"data_parallel": "fsdp"}),
    ("phi3", {"tp": 4}, {}),
    ("gpt2", {"dp": 2, "tp": 2, "pp": 2}, {}),
    ("phi3", {"dp": 2, "tp": 2, "pp": 2}, {}),
    ("mixtral", {"dp": 2, "tp": 2, "pp": 2}, {}),
    ("phi3", {"dp": 2, "tp": 2}, {"data_parallel": "fsdp"}),
    ("gpt2", {"dp": 2, "tp": 2}, {"data_parallel": "fsdp"}),
    ("mixtral", {"dp": 2, "ep": 2, "tp": 2}, {}),  # each expert's rows from its ep rank, its columns from tp
    ("gpt_oss", {"dp": 2, "ep": 2, "pp": 2}, {}),
    ("mixtral", {"dp": 2, "ep": 2}, {"data_parallel": "fsdp"}),  # the experts outside FSDP2, the rest sharded by it
]


@pytest.mark.parametrize("name,mesh,options", CELLS,
                         ids=[f"{n}-{'x'.join(f'{a}{d}' for a, d in m.items())}" for n, m, _ in CELLS])
def test_save_pretrained_loads_exactly_with_from_pretrained(pools, tmp_path, name, mesh, options):
    world = 1
    for axis, degree in mesh.items():
        world *= degree if axis != "ep" else 1  # ep is carved from dp
    results = pools.get(world).run(golden_pretrained.saved_and_loaded, name, mesh, str(tmp_path / "hf"), **options)
    saved = results[0]
    assert saved["config"] and saved["index"] and len(saved["files"]) > 1, saved
    assert not saved["missing"], f"from_pretrained lacks {saved['missing'][:5]}"
    assert not saved["differ"], f"loaded tensors differ from the trained ones: {saved['differ'][:5]}"


def test_a_model_without_a_huggingface_config_is_refused_before_any_collective():
    import torch

    import autoshard

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    pm = autoshard.parallelize(model, autoshard.Mesh(), example_inputs=(torch.randn(2, 4),),
                               loss_fn=lambda y, t: (y - t).pow(2).mean(), target=torch.randn(2, 4))
    with pytest.raises(ValueError, match="no HuggingFace config"):
        pm.save_pretrained("unused")


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_a_fused_qkv_with_kv_heads_held_whole_trains_as_a_user_loop_trains_it(pools, bf16):
    """phi3 at tp=4 (its k and v blocks whole on every rank) with sequence parallelism, from an ordinary loop:
    padded batches with an attention mask, gradient accumulation, optimizer groups, clipping; bf16 autocast."""
    for rank, r in enumerate(pools.get(4).run(golden_pretrained.user_loop, "phi3", {"tp": 4}, bf16=bf16,
                                              sequence_parallel=True)):
        tol = 2e-2 if bf16 else 1e-5
        for got, want in zip(r["losses"], r["reference"], strict=True):
            assert abs(got - want) <= tol * max(1.0, abs(want)), (rank, r["losses"], r["reference"])
        assert r["worst"] <= (5e-2 if bf16 else 1e-5), (rank, r["worst"])


@pytest.mark.parametrize("name,mesh,options", [
    ("phi3", {"tp": 2}, {}),
    ("phi3", {"tp": 4}, {}),
    ("gpt2", {"pp": 2}, {}),
    ("gpt2", {"dp": 2, "tp": 2}, {"data_parallel": "fsdp"}),
], ids=["phi3-tp2", "phi3-tp4", "gpt2-pp2", "gpt2-dp2xtp2-fsdp"])
def test_load_pretrained_reads_only_each_ranks_part(pools, tmp_path, name, mesh, options):
    """The reverse of save_pretrained: a model built on meta starts from HuggingFace's files, each rank reading its
    part (its tp blocks, its stage's weights) and none the whole model."""
    world = 1
    for axis, degree in mesh.items():
        world *= degree if axis != "ep" else 1
    results = pools.get(world).run(golden_pretrained.loaded_from_pretrained, name, mesh, str(tmp_path / "hf"),
                                   **options)
    for rank, r in enumerate(results):
        assert not r["missing"] and not r["differ"], f"rank {rank}: {r['missing'][:5]} {r['differ'][:5]}"
        assert r["read"] < 0.8 * r["total"], f"rank {rank} read {r['read']} of {r['total']} bytes"
