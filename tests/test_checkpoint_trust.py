"""A checkpoint runs no code when it is loaded: records are plain data read weights-only, metadata only its classes.

Three hostile checkpoints, each made from a real one: a record that is a pickle calling a function, a value DCP
itself would unpickle whole, and a metadata file naming a function. Each is refused with a clear error, and the
function never runs (it would create a directory). ``extra=`` holding an object is refused when saving, naming it.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch

import autoshard
from autoshard.runtime import checkpoint

from models import build


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
    monkeypatch.undo()
    with pytest.raises(Exception, match="run code|Weights only load failed|refused"):
        pm.load_checkpoint(path)
    assert not os.path.exists(marker), "loading the checkpoint ran its code"


def test_extra_holding_an_object_is_refused_when_saving_naming_its_key(tmp_path):
    pm, opt = _model()
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 2)
    with pytest.raises(TypeError, match=r"extra\['scheduler'\] is a StepLR.*state_dict\(\)"):
        pm.save_checkpoint(str(tmp_path / "no"), extra={"step": 1, "scheduler": scheduler})
