"""The architecture corpus: models nobody here wrote, shrunk to tiny configs, for golden runs at many meshes.

``architectures`` lists and builds them; ``cells`` runs one (architecture, mesh) cell on a worker pool's
ranks and classifies it (exact / wrong / refused / crash).
"""

from corpus.architectures import build, check_eager, names

__all__ = ["build", "check_eager", "names"]
