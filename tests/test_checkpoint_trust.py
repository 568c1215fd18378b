"""A checkpoint runs no code when it is loaded: records are plain data read weights-only, metadata only its classes.

Three hostile checkpoints, each made from a real one: a record that is a pickle calling a function, a value DCP
itself would unpickle whole, and a metadata file naming a function. Each is refused with a clear error, and the
function never runs (it would create a directory). ``extra=`` holding an object is refused when saving, naming it.
"""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

import autoshard
from autoshard.runtime import checkpoint

from harness.models import build


class _Calls:
    """Unpickled by anything but a weights-only loader, it calls ``os.makedirs(path)``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return os.makedirs, (self.path,)


def _model():
    case = build("gpt")
    pm = autoshard.parallelize(case.model, autoshard.Mesh(), example_inputs=case.inputs, loss_fn=case.loss_fn,
                               target=case.target)
    return pm, torch.optim.AdamW(pm.parameters(), lr=1e-3)


def test_a_checkpoint_round_trips_its_records_as_plain_data(tmp_path):
    pm, opt = _model()
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 2)
    pm.save_checkpoint(str(tmp_path / "ok"), optimizer=opt, extra={"step": 3, "scheduler": scheduler.state_dict(),
                                                                   "seen": torch.arange(4)})
    extra = pm.load_checkpoint(str(tmp_path / "ok"), optimizer=opt)
    assert extra["step"] == 3 and extra["scheduler"]["step_size"] == 2 and torch.equal(extra["seen"], torch.arange(4))


@pytest.mark.parametrize("typed", ["ckpt/", "./ckpt//", "~/ckpt"])
def test_a_checkpoint_path_as_users_type_it_saves_and_loads(tmp_path, monkeypatch, typed):
    """A trailing slash had rank 0 rename the checkpoint into itself (EINVAL) and every rank die; ``~`` is the home."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    pm, opt = _model()
    pm.save_checkpoint(typed, optimizer=opt, extra={"step": 1})
    pm.save_checkpoint(typed, optimizer=opt, extra={"step": 2})
    assert pm.load_checkpoint(typed, optimizer=opt)["step"] == 2 and os.listdir(tmp_path) == ["ckpt"]


@pytest.mark.parametrize("where", ["record", "value", "metadata"])
def test_a_checkpoint_that_would_run_code_is_refused_and_runs_none(tmp_path, monkeypatch, where):
    pm, opt = _model()
    marker, path = str(tmp_path / "ran"), str(tmp_path / "hostile")
    hostile = _Calls(marker)
    if where == "record":  # a record of raw pickle bytes that calls os.makedirs
        record = checkpoint._record
        monkeypatch.setattr(checkpoint, "_check_extra", lambda extra: None)
        monkeypatch.setattr(checkpoint, "_record", lambda v: pickle.dumps(v) if isinstance(v, dict) and "x" in v
                            else record(v))
        pm.save_checkpoint(path, extra={"x": hostile})
    elif where == "value":  # an object DCP stores with torch.save and its own loader would unpickle whole
        record = checkpoint._record
        monkeypatch.setattr(checkpoint, "_check_extra", lambda extra: None)
        monkeypatch.setattr(checkpoint, "_record", lambda v: hostile if isinstance(v, dict) and "x" in v else record(v))
        pm.save_checkpoint(path, extra={"x": 1})
    else:
        pm.save_checkpoint(path)
        with open(os.path.join(path, ".metadata"), "wb") as f:
            pickle.dump(hostile, f)
        manifest = os.path.join(path, "autoshard.manifest.json")  # whoever wrote the file rewrote its manifest too
        with open(manifest) as f:
            record = json.load(f)
        record["files"][".metadata"] = os.path.getsize(os.path.join(path, ".metadata"))
        with open(manifest, "w") as f:
            json.dump(record, f)
    monkeypatch.undo()
    with pytest.raises(Exception, match="run code|Weights only load failed|refused"):
        pm.load_checkpoint(path)
    assert not os.path.exists(marker), "loading the checkpoint ran its code"


def test_extra_holding_an_object_is_refused_when_saving_naming_its_key(tmp_path):
    pm, opt = _model()
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 2)
    with pytest.raises(TypeError, match=r"extra\['scheduler'\] is a StepLR.*state_dict\(\)"):
        pm.save_checkpoint(str(tmp_path / "no"), extra={"step": 1, "scheduler": scheduler})


def _weights(pm) -> dict:
    return {k: v.clone() for k, v in pm.state_dict().items()}


def _train(pm, opt, steps: int = 1) -> None:
    case = build("gpt")
    for _ in range(steps):
        opt.zero_grad()
        pm.step(*case.inputs, target=case.target)
        opt.step()


@pytest.mark.parametrize("killed", ["before the shards", "between the shards and the metadata",
                                    "before the manifest", "between the renames"])
def test_a_save_killed_at_any_point_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch, killed):
    """A save over an existing checkpoint that dies part way: loading the path gives the first checkpoint, exactly,
    and the next save succeeds over what the killed one left."""
    from autoshard.runtime import committed

    pm, opt = _model()
    path = str(tmp_path / "ckpt")
    _train(pm, opt)
    pm.save_checkpoint(path, optimizer=opt, extra={"step": 1})
    first = _weights(pm)
    _train(pm, opt)

    class Killed(Exception):
        pass

    def die(*args, **kwargs):
        raise Killed(killed)

    if killed == "before the shards":
        monkeypatch.setattr(checkpoint.dcp, "save", die)
    elif killed == "between the shards and the metadata":
        from torch.distributed.checkpoint import filesystem

        monkeypatch.setattr(filesystem.FileSystemWriter, "finish", die)
    elif killed == "before the manifest":
        monkeypatch.setattr(committed.json, "dump", die)
    else:
        real, calls = os.replace, []

        def replace(src, dst):
            calls.append(src)
            if src.endswith("ckpt") and dst.endswith(".previous"):
                real(src, dst)
                raise Killed(killed)
            return real(src, dst)

        monkeypatch.setattr(committed.os, "replace", replace)
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises((Killed, CheckpointException)):  # DCP wraps what fails inside its save
        pm.save_checkpoint(path, optimizer=opt, extra={"step": 2})
    monkeypatch.undo()
    fresh, fresh_opt = _model()
    assert fresh.load_checkpoint(path, optimizer=fresh_opt)["step"] == 1
    assert all(torch.equal(v, first[k]) for k, v in fresh.state_dict().items()), "the first checkpoint changed"
    pm.save_checkpoint(path, optimizer=opt, extra={"step": 2})
    assert fresh.load_checkpoint(path, optimizer=fresh_opt)["step"] == 2
    assert not os.path.exists(path + ".partial") and not os.path.exists(path + ".previous")


def test_keep_holds_the_newest_checkpoints_and_a_root_loads_the_newest(tmp_path):
    pm, opt = _model()
    root = str(tmp_path / "run")
    for step in range(1, 4):
        _train(pm, opt)
        pm.save_checkpoint(root, optimizer=opt, extra={"step": step}, keep=2)
    assert sorted(os.listdir(root)) == ["step-00000002", "step-00000003"]
    fresh, fresh_opt = _model()
    assert fresh.load_checkpoint(root, optimizer=fresh_opt)["step"] == 3
    assert all(torch.equal(v, w) for v, w in zip(fresh.state_dict().values(), pm.state_dict().values(), strict=True))


def test_a_directory_a_save_did_not_finish_is_refused_naming_why(tmp_path):
    pm, opt = _model()
    path = str(tmp_path / "ckpt")
    pm.save_checkpoint(path)
    os.remove(os.path.join(path, "autoshard.manifest.json"))
    with pytest.raises(ValueError, match="is not complete: it has no autoshard.manifest.json"):
        pm.load_checkpoint(path)
    pm.save_checkpoint(path)
    with open(os.path.join(path, "__0_0.distcp"), "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match=r"changed after it was written: __0_0.distcp \(100 bytes"):
        pm.load_checkpoint(path)
