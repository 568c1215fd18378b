"""``layout.ParamLayout``: one record of how a rank holds a parameter, which the state functions read."""

from __future__ import annotations

import pytest

from autoshard import Mesh
from autoshard.layout import ParamLayout
from autoshard.passes.placements import Shard


def test_a_layout_gives_the_stored_shape_of_each_split_in_mesh_order():
    mesh = Mesh(dp=2, tp=2, ep=2)
    vocab = ParamLayout.of("wte", (51, 8), mesh, Shard(0), experts=0, spread=False)
    assert vocab.padded and vocab.tp_shape() == (26, 8) == vocab.local_shape()  # 51 rows padded up to 2 x 26
    experts = ParamLayout.of("w1", (8, 16, 12), mesh, Shard(1), experts=8, spread=False)
    assert not experts.padded and experts.local_shape() == (4, 8, 12)  # its ep rank's 4 experts of its tp part
    whole = ParamLayout.of("norm", (12,), mesh, None, experts=0, spread=False)
    assert whole.tp is None and whole.local_shape() == (12,)
    spread = ParamLayout.of("emb", (40, 6), Mesh(tp=2, pp=2), Shard(1), experts=0, spread=True)
    assert spread.local_shape() == (20, 3)  # its pp rank's rows of its tp part
    assert ParamLayout.of("w", (8, 8), Mesh(dp=2), Shard(0), 0, False).tp is None  # no tp: held whole


def test_what_no_rank_can_assemble_whole_is_refused_by_the_layout():
    padded_experts = ParamLayout.of("w", (8, 15, 4), Mesh(dp=2, tp=2, ep=2), Shard(1), experts=8, spread=False)
    with pytest.raises(NotImplementedError, match="padded and its experts split over ep"):
        padded_experts.check_whole_save()
    ParamLayout.of("w", (8, 16, 4), Mesh(dp=2, tp=2, ep=2), Shard(1), experts=8, spread=False).check_whole_save()
