"""One rank of a corpus cell, or one capture's digest, in an interpreter of its own (as torchrun starts each rank).

    python tests/harness/hash_seed_worker.py digest NAME      # prints the digest of NAME's captured graph
    python tests/harness/hash_seed_worker.py cell NAME MESH   # under RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT

The cell's outcome (``tests/corpus/cells.py``) is printed by rank 0 as one JSON line.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: ``corpus`` imports from there
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main() -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    from corpus import cells
    from corpus.architectures import build
    from corpus.programs import canonical_code

    what, name = sys.argv[1], sys.argv[2]
    if what == "digest":
        from autoshard.compile import capture_for_training

        case = build(name)
        captured = capture_for_training(case.model, case.inputs, case.target, case.loss_fn)
        print(hashlib.sha256(canonical_code(captured.gm).encode()).hexdigest()[:16])
        return
    mesh_kwargs, options = cells.MESHES[sys.argv[3]]
    dist.init_process_group("gloo")
    result = cells.run_cell(name, dict(mesh_kwargs), **dict(options))
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, {k: result.get(k) for k in ("status", "message", "max_abs")})
    if dist.get_rank() == 0:
        outcome = cells.outcome([{k: v for k, v in r.items() if v is not None} for r in results])
        print(json.dumps({"status": outcome.status, "message": outcome.message}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
