"""Checkpoint directories that are complete or absent: written aside, marked by a manifest, then renamed in place.

Saving: every rank writes into ``<path>.partial``; once all have (DCP's save returns on rank 0 after every rank's
files and the metadata are written), rank 0 writes ``autoshard.manifest.json`` there (every file with its size),
moves a checkpoint already at ``path`` aside to ``<path>.previous``, renames ``<path>.partial`` to ``path`` and
removes the previous one. A save killed at any point leaves ``path`` holding a complete checkpoint (the old one, or
the new), or, between the two renames, ``<path>.previous`` holding the old one, which loading then takes. With
``keep=N`` the path is a root: each save is ``<root>/step-<steps>``, and complete ones beyond the newest N are
removed.

Loading (``resolve``): ``path`` when it holds a manifest; else the newest complete ``step-*`` directory under it;
else ``<path>.previous``; a directory without a manifest (a save that did not finish) is refused, and every file
the manifest names is checked for its size before anything is read.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading

import torch.distributed as dist

MANIFEST = "autoshard.manifest.json"
_STEP = re.compile(r"step-(\d+)$")


def as_typed(path) -> str:
    """A path as users type it (``ckpt/``, ``~/runs/a``, a ``pathlib.Path``) as the one directory it names: a trailing
    slash would have the rename put the checkpoint inside itself."""
    return os.path.normpath(os.path.expanduser(os.fspath(path)))


def target(path: str, keep: int | None, steps: int) -> str:
    """Where this save goes: ``path``, or under the root ``path`` with ``keep``."""
    path = as_typed(path)
    if keep is None:
        return path
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        raise ValueError(f"keep={keep!r}: give how many complete checkpoints to keep under the root (1 or more)")
    return os.path.join(path, f"step-{steps:08d}")


def begin(final: str, rank: int) -> str:
    """The directory every rank writes into (emptied by rank 0 of what a killed save left there)."""
    partial = f"{final}.partial"
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    if dist.is_initialized():
        dist.barrier()
    return partial


def finish(partial: str, final: str, keep: int | None, root: str) -> None:
    """Rank 0, once every rank's files are written: the manifest last, then the checkpoint renamed into place."""
    files = {}
    for name in sorted(os.listdir(partial)):
        files[name] = os.path.getsize(os.path.join(partial, name))
    with open(os.path.join(partial, MANIFEST + ".tmp"), "w") as f:
        json.dump({"files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(os.path.join(partial, MANIFEST + ".tmp"), os.path.join(partial, MANIFEST))
    previous = f"{final}.previous"
    if os.path.isdir(final):
        shutil.rmtree(previous, ignore_errors=True)
        os.replace(final, previous)
    os.replace(partial, final)
    shutil.rmtree(previous, ignore_errors=True)
    if keep is not None:
        complete = sorted(_steps(root))
        for _, name in complete[:-keep]:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _steps(root: str) -> list[tuple[int, str]]:
    """The complete ``step-*`` checkpoints under ``root``: (step, directory name)."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _STEP.match(name)
        if match and os.path.isfile(os.path.join(root, name, MANIFEST)):
            found.append((int(match.group(1)), name))
    return found


def exists(path: str) -> bool:
    """Whether ``path`` holds a complete checkpoint to resume from (itself, one under it, or the one a killed save
    had moved aside)."""
    return (os.path.isfile(os.path.join(path, MANIFEST)) or bool(_steps(path))
            or os.path.isfile(os.path.join(f"{path}.previous", MANIFEST)))


def resolve(path: str) -> str:
    """The complete checkpoint to load at ``path`` (see the module doc), its files checked; refuses the rest."""
    path = as_typed(path)
    if os.path.isfile(os.path.join(path, MANIFEST)):
        chosen = path
    elif steps := _steps(path):
        chosen = os.path.join(path, max(steps)[1])
    elif os.path.isfile(os.path.join(f"{path}.previous", MANIFEST)):
        chosen = f"{path}.previous"  # a save killed between its two renames: the checkpoint it replaced
    elif os.path.isdir(path) and os.listdir(path):
        raise ValueError(f"the checkpoint at {path} is not complete: it has no {MANIFEST}, which a save writes last, "
                         "once every rank's files are in place (a save that was killed, or one written before "
                         "autoshard marked them). Load an earlier complete checkpoint")
    else:
        raise FileNotFoundError(f"no checkpoint at {path}: pass the directory pm.save_checkpoint() wrote (or its "
                                "root, with keep=)")
    _check(chosen)
    return chosen


def _check(path: str) -> None:
    """Every file the manifest names is there at its size (a rank's file missing is named with its rank)."""
    with open(os.path.join(path, MANIFEST)) as f:
        files = json.load(f)["files"]
    missing = sorted(name for name in files if not os.path.exists(os.path.join(path, name)))
    if missing:
        ranks = sorted({name.split("_")[2] for name in missing if name.startswith("__") and name.count("_") >= 3})
        whose = f" (written by rank {', '.join(ranks)})" if ranks else ""
        raise FileNotFoundError(
            f"the checkpoint at {path} is incomplete: {', '.join(missing[:4])} is missing{whose}. Copy every file "
            "the saving ranks wrote into the directory")
    wrong = [f"{name} ({os.path.getsize(os.path.join(path, name))} bytes, written as {size})"
             for name, size in files.items() if os.path.getsize(os.path.join(path, name)) != size]
    if wrong:
        raise ValueError(f"the checkpoint at {path} was changed after it was written: {', '.join(wrong[:4])}. "
                         "Load an earlier complete checkpoint")


class Pending:
    """A checkpoint written in the background: ``result()`` waits for this rank's write and, on rank 0 (whose write
    ends after every rank's), puts the checkpoint in place; so does the write's end if nobody waits."""

    def __init__(self, future, commit) -> None:
        self._future, self._commit = future, commit
        self._lock, self._committed = threading.Lock(), False
        future.add_done_callback(lambda _: self._finish())

    def _finish(self) -> None:
        with self._lock:
            if not self._committed and self._future.exception() is None:
                self._commit()
                self._committed = True

    def result(self, timeout: float | None = None):
        value = self._future.result(timeout)
        self._finish()
        return value

    def done(self) -> bool:
        return self._future.done() and self._committed
