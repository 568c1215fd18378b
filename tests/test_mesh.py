"""Mesh: rank layout, groups along each axis, error messages, and process groups in a world of one."""

from __future__ import annotations

import datetime
import itertools
import socket

import pytest
import torch
import torch.distributed as dist

from autoshard.mesh import AXES, Mesh

MESHES = [
    Mesh(),
    Mesh(dp=2),
    Mesh(tp=4),
    Mesh(dp=2, tp=2),
    Mesh(dp=2, tp=2, pp=2),
    Mesh(dp=3, tp=2, pp=2, cp=2),
    Mesh(pp=3, cp=2),
]


def check_groups_on_rank(mesh_kwargs: dict) -> dict:
    """Run on every rank of an already-initialized gloo world whose size is ``Mesh(**mesh_kwargs).world_size``.

    Creates the mesh's process groups, then all-reduces (sums) this rank's global rank over its group
    along each axis. Returns ``{"rank": r, "coords": {...}, "ranks": {axis: [...]}, "sums": {axis: s}}``;
    the caller checks that ``sums[axis] == sum(ranks[axis])`` and that ``ranks[axis]`` equals
    ``Mesh(**mesh_kwargs).group_of(axis, r)``, on every rank.
    """
    groups = Mesh(**mesh_kwargs).create_groups(timeout=datetime.timedelta(seconds=30))
    sums = {}
    for axis in AXES:
        value = torch.tensor([groups.rank], dtype=torch.int64)
        dist.all_reduce(value, group=groups.group(axis))
        sums[axis] = int(value.item())
    ranks = {axis: groups.ranks(axis) for axis in AXES}
    return {"rank": groups.rank, "coords": dict(groups.coords), "ranks": ranks, "sums": sums}


# --- layout ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_coords_round_trip(mesh: Mesh) -> None:
    seen = set()
    for rank in range(mesh.world_size):
        coords = mesh.coords(rank)
        assert list(coords) == list(AXES)
        assert mesh.rank_of(**coords) == rank
        seen.add(tuple(coords.values()))
    assert seen == set(itertools.product(*(range(d) for d in mesh.shape)))


def test_rank_formula_matches_docstring() -> None:
    mesh = Mesh(dp=2, tp=2, pp=2, cp=3)
    for pp, dp, cp, tp in itertools.product(range(2), range(2), range(3), range(2)):
        assert mesh.rank_of(pp=pp, dp=dp, cp=cp, tp=tp) == ((pp * 2 + dp) * 3 + cp) * 2 + tp


def test_docstring_example() -> None:
    mesh = Mesh(dp=2, tp=2, pp=2)
    assert mesh.world_size == 8
    assert mesh.shape == (2, 2, 1, 2)
    assert mesh.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.groups("cp") == [[r] for r in range(8)]


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_tp_groups_are_consecutive_ranks(mesh: Mesh) -> None:
    for group in mesh.groups("tp"):
        assert group == list(range(group[0], group[0] + mesh.tp))


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_pp_is_outermost(mesh: Mesh) -> None:
    stage_size = mesh.world_size // mesh.pp
    for rank in range(mesh.world_size):
        assert mesh.coords(rank)["pp"] == rank // stage_size


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("axis", AXES)
def test_groups_partition_the_ranks(mesh: Mesh, axis: str) -> None:
    groups = mesh.groups(axis)
    assert sorted(r for g in groups for r in g) == list(range(mesh.world_size))
    assert len(groups) == mesh.world_size // mesh.degree(axis)
    for group in groups:
        coords = [mesh.coords(r) for r in group]
        assert [c[axis] for c in coords] == list(range(mesh.degree(axis)))
        others = {tuple(v for a, v in c.items() if a != axis) for c in coords}
        assert len(others) == 1
        for rank in group:
            assert mesh.group_of(axis, rank) == group


def test_str_parse_and_degree() -> None:
    mesh = Mesh.parse(" tp=2, pp=2 ")
    assert mesh == Mesh(tp=2, pp=2)
    assert str(mesh) == "Mesh(dp=1, tp=2, pp=2, cp=1)"
    assert Mesh.parse("") == Mesh()
    assert mesh.degree("pp") == 2
    assert mesh.rank_of(tp=1, pp=1) == 3  # axes of degree 1 may be left out


def test_mesh_is_frozen_and_keyword_only() -> None:
    with pytest.raises(TypeError):
        Mesh(2, 2)  # type: ignore[misc]
    with pytest.raises(AttributeError):
        Mesh().tp = 2  # type: ignore[misc]


# --- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tp": 0}, r"tp=0 is not a valid degree: .* integer >= 1 \(use tp=1 for no tensor parallelism\)"),
        ({"dp": -2}, r"dp=-2 is not a valid degree: .* \(use dp=1 for no data parallelism\)"),
        ({"pp": 2.0}, r"pp=2\.0 is not a valid degree: .* \(use pp=2\)"),
        ({"cp": "2"}, r"cp='2' is not a valid degree: .* \(use cp=1 for no context parallelism\)"),
        ({"dp": True}, r"dp=True is not a valid degree"),
    ],
)
def test_bad_degree(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Mesh(**kwargs)


def test_world_size_mismatch_suggests_dp() -> None:
    mesh = Mesh(dp=2, tp=2)
    mesh.check_world_size(4)
    with pytest.raises(ValueError, match=r"dp=2 x tp=2 x pp=1 x cp=1 = 4 ranks, but the world has 8") as info:
        mesh.check_world_size(8)
    assert "keep tp, pp, cp and use dp=4" in str(info.value)
    assert "Mesh(dp=4, tp=2, pp=1, cp=1)" in str(info.value)


def test_world_size_mismatch_lists_alternatives() -> None:
    with pytest.raises(ValueError, match=r"= 8 ranks, but the world has 6") as info:
        Mesh(dp=2, tp=2, pp=2).check_world_size(6)
    message = str(info.value)
    assert "keep tp, pp, cp" not in message  # 6 is not a multiple of tp*pp*cp = 4
    suggested = [Mesh.parse(s.strip()[5:-1]) for s in message.split("use one of:")[1].split(";")]
    assert len(suggested) == 3
    assert all(m.world_size == 6 for m in suggested)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda m: m.coords(8), r"rank 8 is not in Mesh\(dp=2, tp=2, pp=2, cp=1\): ranks are 0 \.\. 7"),
        (lambda m: m.rank_of(pp=0, dp=0, tp=2), r"tp=2 is out of range .*: tp coordinates are 0 \.\. 1"),
        (lambda m: m.rank_of(tp=1), r"rank_of needs a pp coordinate: pp has degree 2"),
        (lambda m: m.rank_of(ep=0), r"unknown mesh axis 'ep': the axes are pp, dp, cp, tp"),
        (lambda m: m.groups("sp"), r"unknown mesh axis 'sp'"),
        (lambda m: m.degree("dim0"), r"unknown mesh axis 'dim0'"),
    ],
)
def test_bad_rank_or_axis(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call(Mesh(dp=2, tp=2, pp=2))


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("tp=2,zp=2", r"unknown mesh axis 'zp' in 'tp=2,zp=2': the axes are pp, dp, cp, tp \(and ep\)"),
        ("tp2", r"cannot read 'tp2' .* write axis=degree pairs"),
        ("tp=two", r"cannot read 'tp=two'"),
        ("tp=2,tp=4", r"mesh axis 'tp' is given twice"),
        ("tp=0", r"tp=0 is not a valid degree"),
    ],
)
def test_parse_errors(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Mesh.parse(text)


def test_create_groups_needs_initialized_world() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"needs torch.distributed to be initialized.*torchrun.*init_process_group"):
        Mesh(tp=2).create_groups()


class _FakeDeviceMesh:
    """Just the attributes Mesh.from_device_mesh reads."""

    def __init__(self, names: tuple[str, ...] | None, mesh: torch.Tensor) -> None:
        self.mesh_dim_names = names
        self.mesh = mesh


@pytest.mark.parametrize(
    ("names", "mesh", "match"),
    [
        (("dp", "sp"), torch.arange(4).reshape(2, 2), r"\['sp'\] are not mesh axes: the accepted names are"),
        (None, torch.arange(4), r"has no mesh_dim_names: name its dims with axes from"),
        (("tp", "dp"), torch.arange(4).reshape(2, 2), r"out of order: autoshard lays out ranks as"),
        (("dp", "tp"), torch.arange(4).reshape(2, 2).T, r"are not ranks 0 \.\. 3 in order"),
    ],
)
def test_from_device_mesh_errors(names, mesh: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Mesh.from_device_mesh(_FakeDeviceMesh(names, mesh))


def test_from_device_mesh_missing_axes_have_degree_1() -> None:
    fake = _FakeDeviceMesh(("dp", "tp"), torch.arange(6).reshape(3, 2))
    assert Mesh.from_device_mesh(fake) == Mesh(dp=3, tp=2)


# --- a real world of one process ------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_world_of_one_creates_groups_and_device_mesh() -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{_free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        with pytest.raises(ValueError, match=r"= 2 ranks, but the world has 1"):
            Mesh(tp=2).create_groups()
        groups = Mesh().create_groups(timeout=datetime.timedelta(seconds=10))
        assert groups.rank == 0 and dict(groups.coords) == dict.fromkeys(AXES, 0)
        for axis in AXES:
            assert groups.ranks(axis) == [0] and groups.local_rank_in(axis) == 0
            assert dist.get_process_group_ranks(groups.group(axis)) == [0]
            # the explicit timeout reached gloo (its default is 30 minutes)
            gloo = groups.group(axis)._get_backend(torch.device("cpu"))
            assert gloo.options._timeout == datetime.timedelta(seconds=10)
        assert check_groups_on_rank({})["sums"] == dict.fromkeys(AXES, 0)
        device_mesh = groups.to_device_mesh()
        assert device_mesh.mesh_dim_names == AXES
        assert device_mesh.get_group("tp") is groups.group("tp")
        assert Mesh.from_device_mesh(device_mesh) == Mesh()
    finally:
        dist.destroy_process_group()


# --- process groups on real gloo worlds -------------------------------------------------------------

GROUP_MESHES = [
    {"dp": 2, "tp": 2},
    {"tp": 2, "pp": 2},
    {"cp": 2, "tp": 2},
    {"pp": 2, "dp": 2},
    {"dp": 2, "tp": 2, "pp": 2},
]


@pytest.mark.parametrize("mesh_kwargs", GROUP_MESHES, ids=lambda k: str(Mesh(**k)))
def test_groups_reduce_over_their_axis(pools, mesh_kwargs: dict) -> None:
    mesh = Mesh(**mesh_kwargs)
    for result in pools.get(mesh.world_size).run(check_groups_on_rank, mesh_kwargs):
        rank = result["rank"]
        assert result["coords"] == mesh.coords(rank)
        for axis in AXES:
            assert result["ranks"][axis] == mesh.group_of(axis, rank)
            assert result["sums"][axis] == sum(mesh.group_of(axis, rank))
