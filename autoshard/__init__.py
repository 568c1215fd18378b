"""autoshard: compile an unmodified PyTorch model into a parallel program per rank.

    import autoshard
    mesh = autoshard.Mesh(dp=2)
    pm = autoshard.parallelize(model, mesh, example_inputs=(tokens,), loss_fn=loss_fn)
    loss = pm.step(tokens, target=targets)
    print(pm.explain())
"""

from autoshard.api import parallelize
from autoshard.capture import CaptureError, capture
from autoshard.errors import AutoshardError
from autoshard.mesh import Mesh, MeshGroups
from autoshard.options import CompileOptions
from autoshard.passes import rules as _rules  # noqa: F401 - every op's record, before anything counts or shards
from autoshard.runtime.anomaly import NonFiniteError
from autoshard.runtime.communication import CommunicationDiffers
from autoshard.verify import VerifyReport, verify

__all__ = ["AutoshardError", "CaptureError", "CommunicationDiffers", "CompileOptions", "Mesh", "MeshGroups",
           "NonFiniteError", "VerifyReport", "capture", "parallelize", "verify"]
