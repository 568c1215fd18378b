"""Every Python example of the docs (docs/*.md) and of README.md, run as a user runs it.

The home page's example runs as it is, in this process. The others are parts of a script written for ``torchrun``:
each runs as a script of its own under ``torchrun --standalone --nproc-per-node 2``, in a fresh directory, on
loopback, with

- a **setup** before it: the names its page says it uses (the home page's ``model``, ``tokens``, ``targets`` and
  ``loss_fn``; a tiny transformers model and its rows; a profile file written first), built alike on every rank;
- **swaps**: the substitutions that fit it to this machine's two processes (a mesh of 8 processes to one of 2,
  10,000 steps to a few, a placeholder ``...`` to arguments). Each must occur in the example, so that an example
  that changes fails here instead of running something else;
- a **check** after it: asserts that it did what its page says (a verify report that is OK, a run resumed).

``test_every_python_block_of_the_docs_and_the_readme_is_run_here`` holds each block to exactly one test.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
DATA = Path(__file__).with_name("data")
TIMEOUT = 300  # seconds a launch may take: each takes 10 to 40 here with other jobs running

# each example: (its page, a text that only its block holds on that page)
HOME = ("docs/index.md", "autoshard.Mesh()")
USE = ("README.md", "autoshard.verify(")
TRAINER = ("docs/guide.md", "autoshard.hf.Trainer(")
ACCELERATE = ("docs/guide.md", "autoshard.accelerate.prepare(")
EXPERTS = ("docs/guide.md", "ep=2")
RESUME = ("docs/guide.md", "pm.resume(")
PROFILE = ("docs/planning.md", 'planner_profile="profile.json"')
CALIBRATE = ("docs/planning.md", "calibrate=True")
RUN_BY: dict[tuple[str, str], str] = {}  # each example -> the test that runs it


def runs(example: tuple[str, str]):
    """Record that the decorated test runs ``example``."""
    def record(test):
        RUN_BY[example] = test.__name__
        return test
    return record


def _blocks(page: str) -> list[str]:
    return BLOCK.findall((ROOT / page).read_text())


def _example(example: tuple[str, str]) -> str:
    page, text = example
    found = [block for block in _blocks(page) if text in block]
    assert len(found) == 1, f"{len(found)} Python examples of {page} hold {text!r}"
    return found[0]


def _home_setup() -> str:
    """The home page's example up to its ``parallelize``: the model, batch and loss the other examples use."""
    code = _example(HOME)
    return code[:code.index("\npm = ")]


# a tiny Llama and 40 rows of 16 tokens: the transformers ``model`` and datasets of the Trainer and accelerate
HF_SETUP = """
import math

import torch
import transformers

torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
model = transformers.LlamaForCausalLM(config)
rows = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        for ids in torch.randint(0, 96, (40, 16))]
train, test = rows[8:], rows[:8]
"""

# the accelerate loop's objects, built as for ``accelerator.prepare``
ACCELERATE_SETUP = HF_SETUP + """
from accelerate import Accelerator
from torch.utils.data import DataLoader

accelerator = Accelerator(cpu=True)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
loader = DataLoader(train, batch_size=4)
scheduler = torch.optim.lr_scheduler.LinearLR(optimizer)
"""

# a tiny Mixtral (4 experts, 2 a token) and its batch: the guide's mixture of experts
EXPERTS_SETUP = """
import math

import torch
import transformers
from torch import nn

import autoshard

torch.manual_seed(0)
config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                    num_experts_per_tok=2, max_position_embeddings=16)
model = transformers.MixtralForCausalLM(config)
tokens = torch.randint(0, 64, (4, 16))
targets = torch.randint(0, 64, (4, 16))


def loss_fn(output, target):
    return nn.functional.cross_entropy(output.logits.flatten(0, 1), target.flatten())
"""


def _script(code: str, *, setup: str, swaps: tuple[tuple[str, str], ...] = (), check: str = "") -> str:
    for text, instead in swaps:
        assert text in code, f"the example no longer holds {text!r}: update the test's substitution\n{code}"
        code = code.replace(text, instead)
    return "\n".join((textwrap.dedent(setup), code, textwrap.dedent(check), 'print("example ran")\n'))


def _torchrun(script: str, directory: Path) -> str:
    """Run ``script`` under ``torchrun --standalone --nproc-per-node 2`` in ``directory``; returns what the ranks
    printed (each must reach the end). A run past ``TIMEOUT`` is killed with every process it started."""
    (directory / "example.py").write_text(script)
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    command = [str(torchrun), "--standalone", "--nproc-per-node", "2", "example.py"]
    run = subprocess.Popen(command, cwd=directory, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True)
    try:
        out, _ = run.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        out, _ = run.communicate()
        raise AssertionError(f"the example ran past {TIMEOUT} s:\n{script}\n{out[-6000:]}") from None
    assert run.returncode == 0, f"the example failed:\n{script}\n{_ranks_output(out)}"
    assert out.count("example ran") == 2, out[-6000:]
    return out


def _ranks_output(out: str) -> str:
    """What the ranks wrote to stderr (torchrun prefixes it ``[rank<n>]:``): their tracebacks, which torchrun's own
    summary leaves out."""
    lines = [line for line in out.splitlines() if line.startswith("[rank")]
    return "\n".join(lines[-80:]) or out[-6000:]


def test_every_python_block_of_the_docs_and_the_readme_is_run_here():
    """A new example needs a test here: each block is exactly one of the examples the tests run."""
    assert len(RUN_BY) == 8, RUN_BY
    for page in PAGES:
        name = str(page.relative_to(ROOT))
        for block in _blocks(name):
            claims = [RUN_BY[example] for example in RUN_BY if example[0] == name and example[1] in block]
            assert len(claims) == 1, f"an example of {name} is run by {claims or 'no test'}:\n{block}"
    for example in RUN_BY:
        _example(example)


@runs(HOME)
def test_the_home_pages_example_trains_as_it_says():
    exec(compile(_example(HOME), "docs/index.md", "exec"), {"__name__": "docs_example"})  # noqa: S102 - our own


@runs(USE)
def test_the_readmes_use_trains_checks_and_saves_under_torchrun(tmp_path):
    out = _torchrun(_script(_example(USE), setup=_home_setup(),
                            swaps=(("autoshard.Mesh(dp=2, tp=2, pp=2)", "autoshard.Mesh(pp=2)"),),
                            check="""
                                import os
                                assert report.ok, report
                                assert os.path.isfile("ckpt/autoshard.manifest.json"), os.listdir("ckpt")
                                """), tmp_path)
    assert out.count("verify: OK") == 2 and "pipeline: 2 stages on 2 pp ranks" in out, out[-6000:]


@runs(TRAINER)
def test_the_guides_trainer_trains_under_torchrun(tmp_path):
    arguments = ('TrainingArguments(output_dir="out", max_steps=3, per_device_train_batch_size=4, logging_steps=1, '
                 'save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)')
    _torchrun(_script(_example(TRAINER), setup=HF_SETUP,
                      swaps=(("TrainingArguments(...)", arguments),
                             ("resume_from_checkpoint=...", "resume_from_checkpoint=None")),
                      check="""
                          losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
                          assert trainer.state.global_step == 3 and len(losses) == 3, trainer.state.log_history
                          assert all(math.isfinite(loss) for loss in losses), losses
                          """), tmp_path)


@runs(ACCELERATE)
def test_the_guides_accelerate_loop_trains_under_torchrun(tmp_path):
    _torchrun(_script(_example(ACCELERATE), setup=ACCELERATE_SETUP, check="""
                          losses = []
                          for batch, _ in zip(loader, range(3)):  # the loop as written for accelerate
                              with accelerator.accumulate(model):
                                  loss = model(**batch).loss
                                  accelerator.backward(loss)
                                  accelerator.clip_grad_norm_(model.parameters(), 1.0)
                                  optimizer.step()
                                  scheduler.step()
                                  optimizer.zero_grad()
                              losses.append(loss.item())
                          assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0], losses
                          """), tmp_path)


@runs(EXPERTS)
def test_the_guides_experts_split_over_ep_train_under_torchrun(tmp_path):
    out = _torchrun(_script(_example(EXPERTS), setup=EXPERTS_SETUP,
                            swaps=(("autoshard.Mesh(dp=4, ep=2, tp=2)", "autoshard.Mesh(dp=2, ep=2)"),),
                            check="""
                                loss = pm.step(tokens, target=targets)
                                assert math.isfinite(loss.item()), loss
                                print(pm.explain())
                                """), tmp_path)
    assert out.count("expert-parallel plan over ep=2 (carved from dp=2): 1 layer(s) of experts split") == 2, out


@runs(RESUME)
def test_the_guides_loop_resumes_under_another_mesh(tmp_path):
    """The loop runs 4 steps at tp=2, saving every 2; run again to 8 steps at pp=2, it resumes from step 4."""
    for mesh, steps, started, kept in (("tp=2", 4, 0, [2, 4]), ("pp=2", 8, 4, [4, 6, 8])):
        setup = _home_setup() + (f"\npm = autoshard.parallelize(model, autoshard.Mesh({mesh}), "
                                 "example_inputs=(tokens,), loss_fn=loss_fn, target=targets)\n")
        _torchrun(_script(_example(RESUME), setup=setup, swaps=(("10_000", str(steps)), ("% 500", "% 2")),
                          check=f"""
                              import os
                              assert extra["step"] == {started}, extra
                              kept = sorted(os.listdir("ckpt"))
                              assert kept == [f"step-{{n:08d}}" for n in {kept}], kept
                              """), tmp_path)


@runs(PROFILE)
def test_the_plannings_mesh_auto_from_a_profile_trains_under_torchrun(tmp_path):
    """The profile is one ``autoshard calibrate --nproc 2`` wrote on this machine (``tests/data``)."""
    (tmp_path / "profile.json").write_text((DATA / "profile_cpu_2.json").read_text())
    out = _torchrun(_script(_example(PROFILE), setup=_home_setup(), check="""
                                loss = pm.step(tokens, target=targets)
                                print(pm.explain())
                                """), tmp_path)
    assert out.count("mesh='auto' from the profile profile.json") == 2, out[-6000:]


@runs(CALIBRATE)
def test_the_plannings_mesh_auto_calibrated_and_autotuned_trains_under_torchrun(tmp_path):
    """Two calibrations of the job's ranks and three trials (full tier: 226 s here with other jobs running). Rank 0
    measures its compute alone while rank 1 waits in a barrier under the group's timeout (120 s): on a machine crowded
    8 times over that wait ran out."""
    out = _torchrun(_script(_example(CALIBRATE), setup=_home_setup(), check="""
                                loss = pm.step(tokens, target=targets)
                                print(pm.explain())
                                """), tmp_path)
    assert "from a calibration of this job's ranks" in out, out[-6000:]
    assert out.count("trained on this job's ranks (autotune=3)") == 2, out[-6000:]
