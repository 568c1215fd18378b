"""Session-wide fixtures: one pool of gloo worker processes per world size, started on first use."""

from __future__ import annotations

import pytest

from harness.launcher import WorkerPool


class Pools:
    """The worker pools of this test session, by world size; a pool that failed is replaced."""

    def __init__(self) -> None:
        self._pools: dict[int, WorkerPool] = {}

    def get(self, world_size: int) -> WorkerPool:
        pool = self._pools.get(world_size)
        if pool is None or pool.broken:
            pool = self._pools[world_size] = WorkerPool(world_size)
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()


@pytest.fixture(scope="session")
def pools():
    p = Pools()
    yield p
    p.close()


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: the tier run on every change (make test-quick)")
    config.addinivalue_line("markers", "full: run only by make test-full (see tests/harness/tiers.py)")


def pytest_collection_modifyitems(config, items):
    from harness import tiers

    tiers.assign(items)
