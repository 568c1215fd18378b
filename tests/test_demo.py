"""The demo under torchrun itself: the way users launch autoshard."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(processes: int, *flags: str, script: str = "examples/train_gpt.py") -> str:
    """Run an example under torchrun as a user would; returns its output (it must exit 0)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    command = [str(torchrun), "--standalone", "--nproc-per-node", str(processes), script, *flags]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    noise = [line for line in done.stderr.splitlines() if "Deprecat" in line or "deprecated" in line]
    assert not noise, f"a new user would see deprecation warnings: {noise[:3]}"
    return done.stdout


def test_demo_under_torchrun_matches_the_unsharded_model():
    # What `make demo` runs: a 2 x 2 x 2 mesh of 8 processes.
    out = _torchrun(8, "--dp", "2", "--tp", "2", "--pp", "2", "--steps", "3")
    assert len(re.findall(r"^step \d: loss .* tokens/s \d+  MFU \d+\.\d%", out, re.M)) == 3, out
    worst = float(re.search(r"unsharded model's loss over 3 steps: (\S+)", out).group(1))
    assert worst < 1e-5
    assert "all-reduce (sum) of this rank's gradients over 2 ranks (dp=2)" in out
    assert re.search(r"tp\s+forward\s+all_reduce", out) and "pipeline: 2 stages on 2 pp ranks" in out
    assert out.count("warning: m=2 microbatches for pp=2") <= 1, "a warning is said once per job"


def test_the_example_with_fsdp_over_a_pipeline():
    out = _torchrun(4, "--dp", "2", "--pp", "2", "--data-parallel", "fsdp", "--steps", "2")
    worst = float(re.search(r"unsharded model's loss over 2 steps: (\S+)", out).group(1))
    assert worst < 1e-5
    assert "FSDP2 over 2 ranks (dp=2): this rank's parameters all-gathered once per step" in out, out


def test_the_hf_trainer_example_trains_saves_and_resumes_under_another_mesh(tmp_path):
    """examples/hf_trainer.py: a Trainer script whose one changed line is autoshard.hf.Trainer; checkpoints at tp=2
    resumed at pp=2, the model saved for from_pretrained."""
    output = str(tmp_path / "out")
    first = _torchrun(2, "--tp", "2", "--steps", "10", "--output", output, script="examples/hf_trainer.py")
    assert "resumed from None" in first, first
    second = _torchrun(2, "--pp", "2", "--steps", "20", "--resume", "--output", output,
                       script="examples/hf_trainer.py")
    assert "checkpoint-10" in second and "logged losses" in second, second
    import transformers

    loaded = transformers.LlamaForCausalLM.from_pretrained(os.path.join(output, "final"))
    assert loaded.config.num_hidden_layers == 4
