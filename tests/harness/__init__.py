"""What the tests of ``tests/`` run on: the model zoo, the worker pools and the golden checks sent to them.

``models`` is the zoo; ``launcher`` the pools of gloo worker processes (forked from a server that imported
``pool_preload``); ``golden`` and ``golden_*`` the checks each rank of a pool runs against the unsharded model;
``rules_sim`` the sharding rules run with collectives simulated in one process; ``tiers`` which tier each test
runs in (``tier_dump`` writes them out); ``mutations`` the seeded bugs ``tests/mutate.py`` runs; the ``*_worker``
modules are scripts ``torchrun`` starts by path. ``tests/`` is on ``sys.path`` (pytest puts it there for
``conftest.py``; the scripts put it there themselves), so each imports as ``harness.<module>``: under that one name
the pools' workers unpickle the functions they are sent.
"""
