"""``detect_anomaly=True``: a NaN is named where it first appears (rank, step, node, the model's line), and every rank
stops with the same error before the optimizer applies it; a finite run is unchanged."""

from __future__ import annotations

import pytest

from harness import golden_anomaly

MESHES = [({"tp": 2}, 2), ({"pp": 2}, 2), ({"dp": 2}, 2)]


@pytest.mark.parametrize("mesh,world", MESHES, ids=["tp2", "pp2", "dp2"])
def test_the_first_nan_is_named_on_every_rank(pools, mesh, world):
    results = pools.get(world).run(golden_anomaly.found, mesh)
    errors = {r["error"] for r in results}
    assert len(errors) == 1 and None not in errors, f"every rank raises the same error: {errors}"
    (error,) = errors
    assert "step 1: rank 0 found nan first in the output of" in error, error
    assert "torch.log(self.proj(x))" in error, error  # the model's own line
    assert "before the optimizer applies the step" in error


def test_a_finite_step_is_not_disturbed(pools):
    for r in pools.get(2).run(golden_anomaly.found, {"tp": 2}, poison=False):
        assert r["error"] is None and r["loss"] > 0


def test_detect_anomaly_with_compile_is_refused():
    import autoshard

    with pytest.raises(ValueError, match="detect_anomaly=True .* compile=False"):
        autoshard.CompileOptions(compile=True, detect_anomaly=True)
