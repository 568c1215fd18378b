"""``autoshard inspect`` (plan, per-rank code, collectives, DOT files, the schedule grid, bad input) and
``parallelize(mesh="auto")`` with the lint it runs, all in this process except one run of the entry point."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import autoshard
from autoshard import cli
from autoshard.mesh import Mesh
from autoshard.options import CompileOptions
from autoshard.planner import auto

from harness.models import build

HARNESS = Path(__file__).resolve().parent / "harness"
GPT = f'{HARNESS / "models.py"}:build("gpt")'


def inspect(capsys, *args: str) -> str:
    code = cli.main(["inspect", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def test_tensor_parallel_of_a_bare_model_shows_roles_local_code_and_collectives(capsys):
    out = inspect(capsys, f"{HARNESS / 'models.py'}:build_gpt_model", "--mesh", "tp=2")
    assert "rank 0 at pp=0, dp=0, cp=0, tp=0" in out
    assert "global batch 8x16 (made up from the first layer" in out and "inference graph" in out
    row = next(line for line in out.splitlines() if line.lstrip().startswith("transformer.h.0.mlp.c_fc.weight"))
    assert row.split()[1:5] == ["column", "S(0)", "192x48", "96x48"], row  # ffn 4 x 48 cut in two
    assert re.search(r"transformer\.h\.0\.attn\.c_proj\.weight\s+row\s+S\(1\)\s+48x48\s+48x24", out)
    assert "transformer.wte.weight, lm_head.weight  replicated" in out, "vocab-parallel needs the loss"
    assert "def forward(self, inputs_0):" in out
    assert re.search(r"self\.tp_reducefromparallel_1\s+= ReduceFromParallel\(size=2\)", out)
    assert "[8, 16, 2, 12]" in out, "the code views attention at 2 of the 4 heads"
    # 4 x 8x16x48 and the position table's lookup, 16x48 (split by rows)
    assert re.search(r"-\s+tp\s+forward\s+all_reduce\s+ReduceFromParallel\s+5\s+99\.0 KiB", out)
    assert "backward" not in out.split("collectives of rank 0")[1], "an inference graph has no backward"
    assert "lint: no finding" in out


def test_pipeline_partition_code_per_stage_dot_files_and_the_schedule_grid(capsys, tmp_path):
    out = inspect(capsys, GPT, "--mesh", "pp=2", "--rank", "1", "--microbatches", "4", "--schedule",
                  "--dot", str(tmp_path))
    assert "pipeline: 2 stages on 2 pp ranks; rank 1 (pp=1) runs stage 1" in out
    assert "cuts after add_2" in out and "largest over mean" in out
    assert "schedule 1f1b, 4 microbatch(es): simulated bubble 20.0%" in out
    assert "rank 0: F0 F1 .  B0 F2 B1 F3 B2 .  B3" in out
    assert re.search(r"rank 1: \.  F0 B0 F1 B1 F2 B2 F3 B3 \.\s+<- rank 1", out)
    assert "code of rank 1, stage 1 of 2; receives 2x16x48 float32 from pp rank 0:" in out
    assert "def forward(self, args_0, args_1, recv_add_2):" in out
    assert "(stage 0)" in out and "spread over the pp ranks (each stores its rows; gathered for each step, " \
        "gradients reduce-scattered): transformer.wte.weight, lm_head.weight" in out
    assert re.search(r"1\s+pp\s+forward\s+recv\s+activations from pp rank 0\s+1\s+6\.0 KiB", out)
    assert "warning: m=4 microbatches for pp=2, the bubble is 20.0%" in out
    (path,) = tmp_path.iterdir()
    assert path.name == "rank1_stage1.dot" and f"wrote {path}" in out
    check_dot(path.read_text(), collectives=0, receives=1)


def test_context_parallel_shows_the_sequence_split_and_its_gathers(capsys, tmp_path):
    out = inspect(capsys, GPT, "--mesh", "cp=2", "--rank", "1", "--dot", str(tmp_path))
    assert "context-parallel plan over cp=2: attention gather" in out
    assert "args_0: sequence dim 1, 16 tokens -> 8 per rank" in out and "holds token positions 8..15" in out
    assert "cp_sequencegather_" in out
    assert re.search(r"-\s+cp\s+forward\s+all_gather\s+SequenceGather\s+4\s", out)
    assert "per step: all-reduce (sum) of this rank's gradients over 2 ranks (cp=2)" in out
    # the gathers of K and V (2 layers) and the splits of full-length positions and masks
    check_dot((tmp_path / "rank1.dot").read_text(), collectives=6, receives=0)


def test_fsdp_over_a_pipeline_is_described(capsys):
    out = inspect(capsys, GPT, "--mesh", "dp=2,pp=2", "--microbatches", "2", "--data-parallel", "fsdp")
    assert "per step: FSDP2 over 2 ranks (dp=2): this rank's parameters all-gathered once per step" in out, out
    assert "each rank keeps 1/2 of them, of their gradients and of the optimizer state" in out
    out = inspect(capsys, GPT, "--mesh", "dp=2,pp=2", "--microbatches", "2")
    assert "in buckets launched during the last backward that finishes them" in out


@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_and_pipeline_parallel_for_two_ranks(capsys, rank):
    out = inspect(capsys, GPT, "--mesh", "tp=2,pp=2", "--rank", str(rank), "--microbatches", "2")
    assert f"rank {rank} at pp=0, dp=0, cp=0, tp={rank}" in out and "groups of rank" in out
    assert "runs stage 0" in out and "sends 4x16x48 float32 to pp rank 1" in out
    assert "self.tp_vocabparallelembedding_0(args_0, " in out and "[4, 16, 2, 12]" in out
    assert "self.tp_vocabparallelembedding_2(arange, " in out, "the position table is split by rows too"
    vocab = f"vocab_start={40 * rank}, vocab_end={40 * rank + 40}, num_embeddings=80, size=2"
    assert re.search(rf"self\.tp_vocabparallelembedding_0\s+= VocabParallelEmbedding\({vocab}\)", out)
    # 3 x 4x16x48 and the position lookup, 16x48
    assert re.search(r"0\s+tp\s+forward\s+all_reduce\s+ReduceFromParallel\s+4\s+39\.0 KiB", out)
    assert re.search(r"0\s+tp\s+backward\s+all_reduce\s+CopyToParallel\s+2\s+24\.0 KiB", out)


def test_the_entry_point_prints_tp2_pp2_rank1():
    """The issue's command, as a user runs it (the one process this file starts)."""
    done = subprocess.run([sys.executable, "-m", "autoshard.cli", "inspect", GPT, "--mesh", "tp=2,pp=2", "--rank",
                           "1", "--microbatches", "4", "--schedule"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "mesh: Mesh(dp=1, tp=2, pp=2, cp=1), world size 4; rank 1 at pp=0, dp=0, cp=0, tp=1" in out
    assert re.search(r"transformer\.h\.0\.attn\.c_attn\.weight\s+column\s+S\(0, blocks=\(48, 48, 48\)\)\s+144x48\s+"
                     r"72x48", out)
    assert re.search(r"transformer\.h\.1\.mlp\.c_fc\.weight\s+column\s+S\(0\)\s+128x48\s+\(stage 1\)", out)
    assert "rank 0: F0 F1 .  B0 F2 B1 F3 B2 .  B3   <- rank 1" in out
    assert re.search(r"0\s+tp\s+forward\s+all_reduce\s+ReduceFromParallel\s+4\s+21\.0 KiB", out)


def check_dot(text: str, *, collectives: int, receives: int) -> None:
    """A DOT digraph whose edges join declared nodes, with local shapes and highlighted communication."""
    lines = text.strip().splitlines()
    assert re.fullmatch(r'digraph "[\w]+" \{', lines[0]) and lines[-1] == "}"
    nodes = set(re.findall(r"^  (n\d+) \[label=", text, re.M))
    edges = re.findall(r"^  (n\d+) -> (n\d+);$", text, re.M)
    assert nodes and edges and all(a in nodes and b in nodes for a, b in edges)
    assert text.count('"') % 2 == 0 and "\n\n" not in text
    assert len(re.findall(r'label="(?:tp|cp)_\w+\\n\w+\\nforward [^"]*", fillcolor="#(?:ffcc80|90caf9)"', text)) \
        >= collectives
    assert len(re.findall(r'label="recv_\w+\\nplaceholder\\n[\dx]+ float32", shape="ellipse", fillcolor="#a5d6a7"',
                          text)) == receives
    if shutil.which("dot"):
        subprocess.run(["dot", "-Tsvg"], input=text, text=True, check=True, capture_output=True, timeout=60)


# --- bad input: one line with the fix, exit code 2 ------------------------------------------------------------


@pytest.mark.parametrize(("args", "says"), [
    (["tests/harness/models.py"], "is not MODULE:FACTORY"),
    (["no_such_module_xyz:make"], "no module named 'no_such_module_xyz'"),
    (["missing/file.py:make"], "no file 'missing/file.py'"),
    ([f"{HARNESS / 'models.py'}:nothing"], "has no 'nothing'; it defines"),
    ([f"{HARNESS / 'models.py'}:build"], "build() raised TypeError: build() missing 1 required positional argument"),
    ([f'{HARNESS / "models.py"}:build("vgg")'], "build() raised ValueError: unknown zoo model 'vgg'"),
    ([f"{HARNESS / 'models.py'}:GPTConfig"], "returned a GPTConfig: return a model, (model, example_inputs"),
    ([f"{HARNESS / 'models.py'}:build(name)"], "only literals"),
    ([GPT, "--mesh", "tp=0"], "tp=0 is not a valid degree"),
    ([GPT, "--mesh", "tq=2"], "unknown mesh axis 'tq'"),
    ([GPT, "--mesh", "tp=2", "--rank", "2"], "--rank 2 is not in Mesh(dp=1, tp=2, pp=1, cp=1): ranks are 0 .. 1"),
    ([GPT, "--schedule", "zigzag"], "'zigzag' is not a schedule"),
    ([GPT, "--mesh", "dp=2", "--microbatches", "3"], "cannot be cut into 3 microbatches"),
    ([GPT, "--mesh", "tp=3"], "4 heads (a dim of 48 viewed as (4, 12)) do not divide over 3 ranks; degrees that "
                              "divide 4: [1, 2, 4]; or pass --tp-indivisible replicate"),
])
def test_bad_input_is_one_line_with_exit_code_2(args, says, capsys):
    code = cli.main(["inspect", *args])
    out, err = capsys.readouterr()
    assert code == 2 and not out
    assert says in err and err.startswith("autoshard inspect: error: ") and len(err.strip().splitlines()) == 1, err


# --- parallelize(mesh="auto") and the lint ---------------------------------------------------------------------


def test_auto_mesh_on_one_process_is_one_rank(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    case = build("mlp")
    pm = autoshard.parallelize(case.model, "auto", example_inputs=case.inputs, loss_fn=case.loss_fn)
    assert pm.mesh == Mesh()
    assert "mesh='auto' on 1 rank(s) chose Mesh(dp=1, tp=1, pp=1, cp=1)" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"mesh='best'.*\"auto\""):
        autoshard.parallelize(case.model, "best", example_inputs=case.inputs, loss_fn=case.loss_fn)


def test_auto_mesh_asks_the_planner_for_a_transformer_and_uses_dp_otherwise(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "8")
    gpt, mlp = build("gpt"), build("mlp")
    config = auto.transformer_config(gpt.model, gpt.inputs, 8)
    assert (config.layers, config.hidden, config.heads, config.vocab, config.seq, config.ffn) == (2, 48, 4, 80, 16, 128)
    assert config.tied_embeddings
    mesh = auto.auto_mesh(gpt.model, gpt.inputs, microbatches=2)
    assert mesh.world_size == 8 and 8 % (mesh.dp * 2) == 0 and 4 % mesh.tp == 0
    assert auto.transformer_config(mlp.model, mlp.inputs, 8) is None
    assert auto.auto_mesh(mlp.model, mlp.inputs) == Mesh(dp=8)
    auto.auto_mesh(gpt.model, gpt.inputs, microbatches=2, announce=True)  # a CPU model: said whose formulas
    said = capsys.readouterr().out
    assert "predicted with the planner's GPU preset (H100 formulas), not on this machine" in said
    assert re.search(r"predicted step [\d.]+ ms on the H100 preset for a 2-layer transformer", said), said


def lint_warnings(mesh: Mesh, microbatches: int = 1) -> list[str]:
    case = build("gpt")
    findings = auto.lint_findings(mesh, case.model, case.inputs, CompileOptions(microbatches=microbatches))
    return [f"autoshard: {f}" for f in findings if f.severity in ("warning", "error")]


def test_parallelize_warns_with_the_lint_of_its_mesh():
    (message,) = lint_warnings(Mesh(pp=2))
    assert message.startswith("autoshard: warning: m=1 < pp=2: the pipeline never fills, the bubble is 50.0%")
    messages = lint_warnings(Mesh(tp=16))
    assert "autoshard: error: tp=16 does not divide the 4 heads" in messages[0]
    assert "tp=16 spans nodes of 8 GPUs (assuming 8 GPUs per node)" in messages[1]
    assert lint_warnings(Mesh(dp=2, tp=2), microbatches=2) == []


def test_sequence_parallelism_shows_its_gathers_and_scatters_on_the_sp_axis(capsys):
    """Per layer of GPT (2 layers) and the head: a reduce-scatter at each region's exit and an all-gather at each
    entry, the same bytes forward and backward (the all-reduces of plain TP, in halves)."""
    out = inspect(capsys, GPT, "--mesh", "tp=2", "--sequence-parallel").split("collectives of rank 0")[1]
    for direction, kind, op in (("forward", "reduce_scatter", "ReduceScatterToSequence"),
                                ("forward", "all_gather", "GatherSequenceToParallel"),
                                ("backward", "all_gather", "ReduceScatterToSequence"),
                                ("backward", "reduce_scatter", "GatherSequenceToParallel")):
        assert re.search(rf"-\s+sp\s+{direction}\s+{kind}\s+{op}\s+5\s+120\.0 KiB", out), (direction, kind, out)
    assert not re.search(r"tp\s+forward\s+all_reduce\s+ReduceFromParallel\s+[2-9]", out), out


def test_the_job_plan_prints_as_json_and_reads_back(capsys):
    from autoshard.job_plan import JobPlan

    out = inspect(capsys, GPT, "--mesh", "tp=2,pp=2", "--microbatches", "2", "--job-plan")
    plan = JobPlan.from_json(out)
    assert plan.mesh == Mesh(tp=2, pp=2) and plan.options.microbatches == 2 and len(plan.cut_after) == 1
    assert {p.role for p in plan.tp_plan.params.values()} >= {"column", "row"}
    assert plan.to_json() == out.strip()
