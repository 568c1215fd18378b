"""Tensor parallelism of convolutional models: convolutions split as Megatron splits linears, by output channels
(a column) then by input channels (a row), with the per-channel layers between them (GroupNorm by whole groups,
BatchNorm, activations, depthwise convolutions, a time embedding's projection) keeping the split. Each zoo image
model at tp=2, tp=4 and dp2 x tp2 x pp2 computes what the unsharded model computes, and a rank holds about 1/tp of
its parameters."""

from __future__ import annotations

import pytest

from autoshard.passes.placements import Shard

from harness import golden
from harness.models import CONV_NAMES

MOST_HELD = {2: 0.55, 4: 0.32}  # the largest rank's share of the parameter bytes
EVAL = {"resnet"}  # BatchNorm split by channels in eval mode (in training it writes its running statistics)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", CONV_NAMES)
def test_golden_conv_tensor_parallel(pools, name, tp):
    results = pools.get(tp).run(golden.golden, name, {"tp": tp}, eval_mode=name in EVAL)
    golden.check(results, {"tp": tp})
    share = max(r["share"] for r in results)
    assert share <= MOST_HELD[tp], f"{name} at tp={tp}: a rank holds {share:.3f} of the parameter bytes"


@pytest.mark.parametrize("name", CONV_NAMES)
def test_golden_conv_data_tensor_and_pipeline_parallel(pools, name):
    mesh = {"dp": 2, "tp": 2, "pp": 2}
    golden.check(pools.get(8).run(golden.golden, name, mesh, microbatches=2, eval_mode=name in EVAL), mesh)


def test_a_resnet_training_its_batch_norms_keeps_their_running_statistics_whole_and_stays_exact(pools):
    """In training BatchNorm updates its running statistics in place: the channels it normalises stay whole (the
    convolutions around it split alone, by input channels), exact, about half the parameters on a rank."""
    results = pools.get(2).run(golden.golden, "resnet", {"tp": 2})
    golden.check(results, {"tp": 2})
    assert max(r["share"] for r in results) <= MOST_HELD[2]


def _planned(name: str, tp: int):
    """The tp plan of a zoo image model and the most parameter bytes a rank holds, planned in this process."""
    from autoshard.compile import compile_global_batch
    from autoshard.mesh import Mesh
    from autoshard.options import CompileOptions

    from harness.models import build

    case = build(name)
    if name in EVAL:
        case.model.eval()
    built = compile_global_batch(case.model, case.inputs, Mesh(tp=tp), 0, CompileOptions(), target=case.target,
                                 loss_fn=case.loss_fn)
    full = dict(built.captured.gm.named_parameters())
    local = dict(built.program.gm.named_parameters())
    held = sum(p.numel() for p in local.values()) / sum(full[n].numel() for n in local)
    return built.tp_plan, held


def test_every_image_model_holds_about_one_tp_th_of_its_parameters_on_a_rank():
    """Planned without processes (the goldens above run the same plans): at most 0.55 at tp=2, 0.32 at tp=4."""
    for name in CONV_NAMES:
        for tp, most in MOST_HELD.items():
            _, held = _planned(name, tp)
            assert held <= most, f"{name} at tp={tp}: rank 0 holds {held:.3f} of the parameters"


def test_a_diffusion_unet_splits_its_blocks_by_channels_from_the_graph():
    """Each ResNet block: conv1 and the time embedding's projection columns, GroupNorm's weight cut by whole groups,
    conv2 the row (its bias added after the sum); the strided conv down, the transposed conv up (its weight (in, out,
    ...) split on dim 0) and the output conv split alone by input channels; the input conv (3 channels) whole."""
    plan, _ = _planned("unet", 2)
    roles = {name.removeprefix("model."): (p.role, p.placement) for name, p in plan.params.items()}
    for block in ("block1", "block2", "block3"):
        assert roles[f"{block}.conv1.weight"] == ("column", Shard(0)), roles
        assert roles[f"{block}.conv1.bias"] == ("column", Shard(0)), roles
        assert roles[f"{block}.time.weight"] == ("column", Shard(0)), roles
        assert roles[f"{block}.norm2.weight"] == ("sliced", Shard(0)), roles
        assert roles[f"{block}.conv2.weight"] == ("row", Shard(1)), roles
        assert roles[f"{block}.conv2.bias"][0] == "replicated", roles
        assert roles[f"{block}.norm1.weight"][0] == "replicated", roles  # it normalises the whole residual
    assert roles["down.weight"] == ("row", Shard(1)) and roles["up.weight"] == ("row", Shard(0)), roles
    assert roles["conv_out.weight"] == ("row", Shard(1)) and roles["conv_in.weight"][0] == "replicated", roles


def test_resnet_blocks_are_column_and_row_pairs_and_a_gated_block_is_one_block():
    """A basic block: conv1 the column, its BatchNorm cut by channels, conv2 the row. The MBConv: the 1x1 expand
    the column, the depthwise conv and its BatchNorms cut by channels, the gate's reducing conv a row (its small
    output summed), its expanding conv a column again, the 1x1 projection a row inside the block. The residual
    stream stays whole: the stem and the BatchNorms after each row are held whole."""
    plan, _ = _planned("resnet", 2)
    roles = {name.removeprefix("model.blocks."): p.role for name, p in plan.params.items()}
    assert [roles[f"0.{n}.weight"] for n in ("conv1", "bn1", "conv2", "bn2")] == [
        "column", "sliced", "row", "replicated"], roles
    gated = [roles[f"2.layers.{n}.weight"] for n in ("0", "1", "3", "4", "6.reduce", "6.expand", "7", "8")]
    assert gated == ["column", "sliced", "sliced", "sliced", "row", "column", "row", "replicated"], roles
    assert plan.params["model.stem.0.weight"].role == "replicated"


def test_an_image_model_without_a_token_sequence_stays_refused_under_cp():
    from autoshard.compile import compile_global_batch
    from autoshard.mesh import Mesh
    from autoshard.options import CompileOptions
    from autoshard.passes.context_parallel import ContextParallelError

    from harness.models import build

    case = build("unet")
    with pytest.raises(ContextParallelError, match="sequence dim could not be found"):
        compile_global_batch(case.model, case.inputs, Mesh(cp=2), 0, CompileOptions(), target=case.target,
                             loss_fn=case.loss_fn)
