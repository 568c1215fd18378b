"""The ``autoshard`` command line: ``autoshard plan`` output, JSON, one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autoshard import cli

LLAMA_7B_ON_A_NODE = ["plan", "--layers", "32", "--hidden", "4096", "--heads", "32", "--vocab", "32000", "--seq",
                      "4096", "--global-batch", "512", "--gpus", "8", "--gpus-per-node", "8", "--gpu-memory", "80GB"]
PALM_540B = ["plan", "--layers", "118", "--hidden", "18432", "--heads", "144", "--vocab", "256000", "--seq", "2048",
             "--global-batch", "2048", "--gpus", "4096", "--gpus-per-node", "8", "--gpu-memory", "80GB"]


def test_plan_prints_a_ranked_table_that_fits_a_terminal(capsys):
    assert cli.main(LLAMA_7B_ON_A_NODE) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(map(len, lines)) <= 120
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("#"))
    assert lines[header].split()[:5] == ["#", "dp", "tp", "pp", "cp"]
    ranks = [int(line.split()[0]) for line in lines[header + 2: header + 7]]
    assert ranks == [1, 2, 3, 4, 5]
    for section in ("why:", "seed's recipe", "bounds for #1", "formulas", "assumed:"):
        assert section in out


@pytest.mark.parametrize("flags,device", [([], "the H100 preset"), (["--gpu", "a100"], "the A100 preset"),
                                          (["--peak-flops", "500TFLOPS", "--intra-bandwidth", "300GB/s"],
                                           "the H100 preset with intra_bandwidth, peak_flops given")],
                         ids=["default", "a100", "given"])
def test_plan_names_the_gpu_its_predicted_times_model(capsys, flags, device):
    """The predicted step times are a GPU's, not this machine's: the cluster line and the table's legend name it,
    with the preset's fields the flags replaced."""
    assert cli.main([*LLAMA_7B_ON_A_NODE, *flags]) == 0
    out = capsys.readouterr().out
    assert f"cluster  8 GPUs of {device} = 1 node x 8" in out
    assert f"times in seconds per step, modelled on {device}\n" in out
    assert cli.main([*LLAMA_7B_ON_A_NODE, *flags, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cluster"]["device"] == device


def test_plan_json_is_for_tools(capsys):
    assert cli.main([*LLAMA_7B_ON_A_NODE, "--json", "--top", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["ranked"]) == 2
    best = data["ranked"][0]
    split = best["split"]
    assert split["dp"] * split["tp"] * split["pp"] * split["cp"] == 8
    assert best["memory_bytes"] <= best["memory_limit_bytes"]
    assert data["model"]["parameters"] == 32 * (12 * 4096**2 + 2 * 4096) + 2 * 32000 * 4096 + 4096


def test_plan_of_one_mesh_searches_only_its_microbatches(capsys):
    assert cli.main([*LLAMA_7B_ON_A_NODE, "--mesh", "tp=2,pp=4", "--json"]) == 0
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    assert [(r["split"]["dp"], r["split"]["tp"], r["split"]["pp"]) for r in ranked] == [(1, 2, 4)]


@pytest.mark.parametrize(("args", "says"), [
    (["--gpu-memory", "80XB"], "unknown unit 'XB'"),
    (["--gpu-memory", "-80GB"], "is negative"),
    (["--gpu-memory", "80"], "has no unit"),
    (["--gpus", "12"], "use 8 or 16 GPUs"),
    (["--gpus", "8", "--gpu-memory", "8GB"], "GB short"),
    (["--mesh", "tp=3"], "must multiply to the world size"),
    (["--gpus", "eight"], "invalid int value"),
])
def test_errors_are_one_line_with_the_fix_and_exit_code_2(args, says, capsys):
    try:
        code = cli.main([*LLAMA_7B_ON_A_NODE, *args])
    except SystemExit as e:  # argparse's own usage errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    assert says in err and len(err.strip().splitlines()) == 1


def test_subcommands_come_from_modules_and_inspect_has_its_place():
    assert cli.COMMAND_MODULES == ("autoshard.planner.command", "autoshard.planner.calibrate_command",
                                   "autoshard.inspect_cli")
    parser = cli.build_parser()
    assert "plan" in parser.format_help() and "calibrate" in parser.format_help()


def test_plan_540b_from_the_entry_point():
    """The issue's own command, run as a user would (the only process this suite starts for the CLI)."""
    done = subprocess.run([sys.executable, "-m", "autoshard.cli", *PALM_540B], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "490.5B parameters" in done.stdout and "4096 GPUs of the H100 preset = 512 nodes x 8" in done.stdout
    first = next(line for line in done.stdout.splitlines() if line.startswith("  1 "))
    dp, tp, pp = (int(x) for x in first.split()[1:4])
    assert tp == 8 and dp > 1 and pp > 1


DATA = Path(__file__).parent / "data"
# each published config.json (tests/data) against the flags a user would type for it
FROM_CONFIG = {
    "llama3_8b_config.json": ["--layers", "32", "--hidden", "4096", "--heads", "32", "--kv-heads", "8", "--ffn",
                              "14336", "--vocab", "128256", "--gated"],
    "mixtral_8x7b_config.json": ["--layers", "32", "--hidden", "4096", "--heads", "32", "--kv-heads", "8", "--ffn",
                                 "14336", "--vocab", "32000", "--gated", "--experts", "8", "--experts-per-token", "2"],
}
JOB = ["--seq", "8192", "--global-batch", "512", "--gpus", "64", "--gpu", "h200", "--json", "--top", "3"]


@pytest.mark.parametrize("name", FROM_CONFIG)
def test_plan_from_a_config_gives_the_answer_of_the_typed_flags(capsys, name):
    assert cli.main(["plan", "--config", str(DATA / name), *JOB]) == 0
    from_config = json.loads(capsys.readouterr().out)
    assert cli.main(["plan", *FROM_CONFIG[name], *JOB]) == 0
    typed = json.loads(capsys.readouterr().out)
    assert from_config == typed
    # and as HuggingFace counts them: Llama-3-8B 8.03B parameters, Mixtral-8x7B 46.7B
    expected = {"llama3_8b_config.json": 8_030_261_248, "mixtral_8x7b_config.json": 46_702_792_704}[name]
    assert from_config["model"]["parameters"] == expected


def test_plan_from_a_model_directory_and_a_flag_over_its_config(capsys, tmp_path):
    (tmp_path / "config.json").write_text((DATA / "llama3_8b_config.json").read_text())
    assert cli.main(["plan", "--model", str(tmp_path), "--layers", "16", *JOB]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    assert (model["layers"], model["hidden"], model["kv_heads"]) == (16, 4096, 8)


def test_plan_without_a_model_says_what_it_needs(capsys):
    assert cli.main(["plan", "--hidden", "4096", *JOB]) == 2
    err = capsys.readouterr().err
    assert "--layers, --heads, --vocab" in err and "--config" in err


def test_plan_from_a_profile_costs_the_factorys_own_programs(capsys, tmp_path):
    """``--profile`` and ``--factory``: the candidates mesh="auto" weighs, ranked with their bytes per rank, and the
    call that takes the winner; under ``--memory-limit`` the faster replica is named as over it."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_planner_profile import _profile

    path = tmp_path / "p.json"
    _profile().save(path)
    factory = f"{Path(__file__).parent / 'harness' / 'models.py'}:build(\"gpt\")"
    assert cli.main(["plan", "--profile", str(path), "--factory", factory, "--gpus", "2"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].startswith("  1. Mesh(dp=2") and " per rank (weights " in out
    assert out.splitlines()[-1] == "parallelize(model, Mesh(dp=2, tp=1, pp=1, cp=1))"
    assert cli.main(["plan", "--profile", str(path), "--factory", factory, "--gpus", "2", "--memory-limit", "1MiB",
                     "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["mesh"] == "Mesh(dp=1, tp=1, pp=2, cp=1)" and data["options"] == {"microbatches": "2"}
    assert all(row["bytes_per_rank"] <= 2**20 for row in data["ranking"] if row["refused"] is None)
    assert cli.main(["plan", "--profile", str(path), "--gpus", "2"]) == 2
    assert "--profile and --factory go together" in capsys.readouterr().err


def test_plan_without_a_profile_needs_the_sequence_and_the_batch(capsys):
    assert cli.main(["plan", "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "100", "--gpus", "2"]) == 2
    assert "the plan needs --seq and --global-batch" in capsys.readouterr().err
