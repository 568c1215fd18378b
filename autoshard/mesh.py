"""The device mesh: how many ranks each parallel axis gets, and which rank sits where.

Terms used here and throughout autoshard:

- An **axis** is a mesh axis: ``dp`` (data parallel), ``tp`` (tensor parallel), ``pp`` (pipeline
  parallel) or ``cp`` (context parallel). Its **degree** is the number of ranks along it.
- A **dim** is a tensor dimension. "Shard dim 0 over the tp axis" uses both words.
- A **group** along an axis is the set of ranks that differ only in that axis's coordinate, ordered
  by that coordinate. Along every axis the groups partition the world.

Rank layout. ``AXES = ("pp", "dp", "cp", "tp")`` lists the axes from outermost to innermost, so::

    rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i

where ``pp_i, dp_i, cp_i, tp_i`` are the rank's coordinates and ``dp, cp, tp`` the degrees. tp is
innermost so that a tp group is consecutive ranks and stays on one node (tp communicates every
layer); pp is outermost because it only sends activations between neighbouring stages. Example,
``Mesh(dp=2, tp=2, pp=2)`` (8 ranks)::

    pp=0: dp=0 -> ranks 0 1 (tp 0, 1)    pp=1: dp=0 -> ranks 4 5
          dp=1 -> ranks 2 3                    dp=1 -> ranks 6 7

    groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]

:class:`Mesh` is pure data: the planner and ``inspect`` use it without any process. The only place
that creates process groups is :meth:`Mesh.create_groups`, which returns a :class:`MeshGroups`.
"""

from __future__ import annotations

import datetime
import itertools
import math
import types
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

AXES: tuple[str, ...] = ("pp", "dp", "cp", "tp")
"""Mesh axes from outermost (slowest-varying rank coordinate) to innermost."""

_AXIS_MEANING = {"dp": "data", "tp": "tensor", "pp": "pipeline", "cp": "context", "ep": "expert"}
_DEFAULT_TIMEOUT = datetime.timedelta(seconds=120)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def _meshes_of(world_size: int) -> list[Mesh]:
    """Every mesh with ``world_size`` ranks."""
    out = []
    for dp in _divisors(world_size):
        for tp in _divisors(world_size // dp):
            for pp in _divisors(world_size // (dp * tp)):
                out.append(Mesh(dp=dp, tp=tp, pp=pp, cp=world_size // (dp * tp * pp)))
    return out


def _check_axis(axis: str) -> None:
    if axis not in AXES:
        raise ValueError(f"unknown mesh axis {axis!r}: the axes are {', '.join(AXES)}")


def _check_degree(axis: str, value: object) -> None:
    meaning = _AXIS_MEANING[axis]
    if isinstance(value, bool) or not isinstance(value, int):
        hint = f"use {axis}={int(value)}" if isinstance(value, float) and value.is_integer() else ""
        hint = hint or f"use {axis}=1 for no {meaning} parallelism"
        # ValueError, not TypeError: one exception type for every bad degree, wherever it came from
        raise ValueError(  # noqa: TRY004
            f"{axis}={value!r} is not a valid degree: every axis degree must be an integer >= 1 ({hint})"
        )
    if value < 1:
        raise ValueError(
            f"{axis}={value} is not a valid degree: every axis degree must be an integer >= 1 "
            f"(use {axis}=1 for no {meaning} parallelism)"
        )


@dataclass(frozen=True, kw_only=True)
class Mesh:
    """Degrees of the four parallel axes; ``world_size`` is their product. See the module docstring.

    ``ep`` (expert parallelism) is carved from dp x cp, as torchtitan carves it: the dp x cp ranks, numbered
    ``cp * dp_degree + dp`` (dp fastest), form groups of ``ep`` consecutive numbers, each rank of a group holding
    ``1/ep`` of every mixture's experts, while every other layer stays data and context parallel over all of them.
    Where ``ep`` divides dp, a group is consecutive dp coordinates at one cp coordinate; a larger ``ep`` takes cp
    coordinates too. It adds no ranks, so ``ep`` must divide ``dp x cp``.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_degree(f.name, getattr(self, f.name))
        if (self.dp * self.cp) % self.ep:
            shared = self.dp * self.cp
            fits = [d for d in range(1, shared + 1) if shared % d == 0]
            raise ValueError(
                f"ep={self.ep} does not divide dp x cp = {self.dp} x {self.cp}: expert parallelism splits the experts "
                f"over groups of data- and context-parallel ranks (it adds no ranks of its own), so ep must divide "
                f"dp x cp; use ep in {fits}, or dp={self.ep * max(1, self.dp // self.ep)} with more ranks")

    def __str__(self) -> str:
        ep = f", ep={self.ep}" if self.ep > 1 else ""
        return f"Mesh(dp={self.dp}, tp={self.tp}, pp={self.pp}, cp={self.cp}{ep})"

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    @property
    def shape(self) -> tuple[int, ...]:
        """Degrees in ``AXES`` order (pp, dp, cp, tp): the shape of the rank grid."""
        return tuple(getattr(self, axis) for axis in AXES)

    def degree(self, axis: str) -> int:
        _check_axis(axis)
        return getattr(self, axis)

    def coords(self, rank: int) -> dict[str, int]:
        """The rank's coordinate on every axis, keyed in ``AXES`` order."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank!r} is not in {self}: ranks are 0 .. {self.world_size - 1}")
        out: dict[str, int] = {}
        for axis in reversed(AXES):  # innermost axis varies fastest
            rank, out[axis] = divmod(rank, self.degree(axis))
        return {axis: out[axis] for axis in AXES}

    def rank_of(self, **coords: int) -> int:
        """Inverse of :meth:`coords`. An axis of degree 1 may be left out (its coordinate is 0)."""
        for axis in coords:
            _check_axis(axis)
        rank = 0
        for axis in AXES:
            rank = rank * self.degree(axis) + self._coord(axis, coords)
        return rank

    def _coord(self, axis: str, coords: Mapping[str, int]) -> int:
        degree = self.degree(axis)
        if axis not in coords and degree > 1:
            raise ValueError(f"rank_of needs a {axis} coordinate: {axis} has degree {degree} in {self}")
        value = coords.get(axis, 0)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < degree:
            raise ValueError(f"{axis}={value!r} is out of range for {self}: {axis} coordinates are 0 .. {degree - 1}")
        return value

    def groups(self, axis: str) -> list[list[int]]:
        """All rank groups along ``axis``, ordered by the other axes' coordinates in ``AXES`` order."""
        _check_axis(axis)
        others = [a for a in AXES if a != axis]
        result = []
        for fixed in itertools.product(*(range(self.degree(a)) for a in others)):
            base = dict(zip(others, fixed, strict=False))
            result.append([self.rank_of(**base, **{axis: i}) for i in range(self.degree(axis))])
        return result

    def data_groups(self) -> list[list[int]]:
        """The groups of ranks that differ only in their dp and cp coordinates: they hold the same parameter
        shards and sum their gradients (data parallelism splits the batch, context parallelism the sequence)."""
        fixed_axes = ("pp", "tp")
        result = []
        for fixed in itertools.product(*(range(self.degree(a)) for a in fixed_axes)):
            base = dict(zip(fixed_axes, fixed, strict=True))
            result.append([self.rank_of(**base, dp=d, cp=c) for d in range(self.dp) for c in range(self.cp)])
        return result

    @property
    def expert_replicas(self) -> int:
        """How many ranks hold each expert alike (``dp x cp / ep``; each one's group in ``expert_replica_groups``)."""
        return self.dp * self.cp // self.ep

    def coord(self, axis: str, coords: Mapping[str, int]) -> int:
        """The coordinate on ``axis`` (``AXES`` or ep) of the rank at ``coords``: ep adds no ranks of its own, so a
        rank's ep coordinate is its place in its ep group (``expert_coord``)."""
        return self.expert_coord(coords) if axis == "ep" else coords[axis]

    def expert_coord(self, coords: Mapping[str, int]) -> int:
        """The ep coordinate of the rank at ``coords``: its place in its ep group."""
        rank = self.rank_of(**{axis: coords[axis] for axis in AXES})
        return self.expert_group_of(rank).index(rank)

    def expert_groups(self) -> list[list[int]]:
        """The groups of ``ep`` ranks that split the experts among them: the same pp and tp coordinates, numbers
        ``b * ep .. b * ep + ep - 1`` in dp x cp (``cp * dp_degree + dp``). Each is ordered by rank, as a process
        group orders its members, and a rank's place in it is its ep coordinate (which experts it holds)."""
        def rank(number: int, p: int, t: int) -> int:
            cp, dp = divmod(number, self.dp)
            return self.rank_of(pp=p, dp=dp, cp=cp, tp=t)

        return [sorted(rank(b * self.ep + e, p, t) for e in range(self.ep))
                for p in range(self.pp) for b in range(self.dp * self.cp // self.ep) for t in range(self.tp)]

    def expert_replica_groups(self) -> list[list[int]]:
        """The ranks holding the same experts (the same pp and tp coordinates and ep coordinate): they sum their
        experts' gradients, as ``data_groups`` do for every other parameter."""
        by_pp_tp: dict[tuple[int, int], list[list[int]]] = {}
        for group in self.expert_groups():
            first = self.coords(group[0])
            by_pp_tp.setdefault((first["pp"], first["tp"]), []).append(group)
        return [[group[e] for group in groups] for groups in by_pp_tp.values() for e in range(self.ep)]

    def expert_group_of(self, rank: int) -> list[int]:
        """The ranks of ``rank``'s ep group, ordered by their ep coordinate."""
        return next(group for group in self.expert_groups() if rank in group)

    def group_of(self, axis: str, rank: int) -> list[int]:
        """The ranks of ``rank``'s group along ``axis``, ordered by their ``axis`` coordinate."""
        coords = self.coords(rank)
        _check_axis(axis)
        return [self.rank_of(**{**coords, axis: i}) for i in range(self.degree(axis))]

    @classmethod
    def parse(cls, text: str) -> Mesh:
        """Read a command-line mesh such as ``"tp=2,pp=2"``; absent axes get degree 1."""
        degrees: dict[str, int] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            axis, sep, value = (s.strip() for s in item.partition("="))
            if not sep or not value.lstrip("-").isdigit():
                raise ValueError(f"cannot read {item!r} in mesh {text!r}: write axis=degree pairs, e.g. 'dp=2,tp=2'")
            if axis not in (*AXES, "ep"):
                raise ValueError(f"unknown mesh axis {axis!r} in {text!r}: the axes are {', '.join(AXES)} (and ep)")
            if axis in degrees:
                raise ValueError(f"mesh axis {axis!r} is given twice in {text!r}: give each axis once")
            degrees[axis] = int(value)
        return cls(**degrees)

    @classmethod
    def from_device_mesh(cls, device_mesh: DeviceMesh) -> Mesh:
        """The :class:`Mesh` of a torch ``DeviceMesh`` spanning the world in autoshard's rank layout."""
        names = device_mesh.mesh_dim_names
        if names is None:
            raise ValueError(f"the DeviceMesh has no mesh_dim_names: name its dims with axes from {AXES}")
        unknown = [n for n in names if n not in AXES]
        if unknown:
            raise ValueError(f"DeviceMesh dim names {unknown} are not mesh axes: the accepted names are {AXES}")
        if list(names) != [a for a in AXES if a in names]:
            raise ValueError(f"DeviceMesh dims {names} are out of order: autoshard lays out ranks as {AXES}")
        mesh = cls(**dict(zip(names, device_mesh.mesh.shape, strict=False)))
        if device_mesh.mesh.flatten().tolist() != list(range(mesh.world_size)):
            raise ValueError(
                f"the DeviceMesh's ranks {device_mesh.mesh.tolist()} are not ranks 0 .. {mesh.world_size - 1} "
                f"in order: {mesh} describes the whole world with rank = ((pp*dp + dp)*cp + cp)*tp + tp"
            )
        return mesh

    def check_world_size(self, world_size: int) -> None:
        """Raise ValueError, with meshes that would fit, unless the degrees multiply to ``world_size``."""
        if self.world_size == world_size:
            return
        product = " x ".join(f"{axis}={self.degree(axis)}" for axis in ("dp", "tp", "pp", "cp"))
        fits = "; ".join(str(m) for m in self._fitting(world_size)) or "none: the world size must be at least 1"
        rest = self.tp * self.pp * self.cp
        keep = (
            f"keep tp, pp, cp and use dp={world_size // rest}, or " if world_size > 0 and world_size % rest == 0 else ""
        )
        raise ValueError(
            f"{product} = {self.world_size} ranks, but the world has {world_size}: the degrees must multiply "
            f"to the world size. To fit, {keep}use one of: {fits}"
        )

    def _fitting(self, world_size: int, limit: int = 3) -> list[Mesh]:
        """Up to ``limit`` meshes of ``world_size`` ranks, those changing the fewest axes of this one first."""
        if world_size < 1:
            return []

        def distance(m: Mesh) -> tuple[int, float, int]:
            changed = [a for a in ("dp", "tp", "pp", "cp") if m.degree(a) != self.degree(a)]
            spread = sum(abs(math.log(m.degree(a) / self.degree(a))) for a in changed)
            return len(changed), spread, 0 if changed == ["dp"] else 1

        return sorted(_meshes_of(world_size), key=distance)[:limit]

    def create_groups(self, *, timeout: datetime.timedelta = _DEFAULT_TIMEOUT) -> MeshGroups:
        """Create every axis's process groups, on every rank in the same order; the only place that does
        (with :meth:`MeshGroups.across_pp`, which adds the groups of tied parameters the same way).

        Must be called by all ranks of an initialized world. Each group gets ``timeout``: gloo's
        default of 30 minutes turns a mismatched collective into a half-hour hang.
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"{self}.create_groups() needs torch.distributed to be initialized, and it is not: launch with "
                "torchrun and call torch.distributed.init_process_group() first, or call "
                "torch.distributed.init_process_group(backend, init_method=..., rank=..., world_size=...) yourself. "
                "Planning and inspection need no processes: pass the Mesh itself to them."
            )
        self.check_world_size(dist.get_world_size())
        rank = dist.get_rank()
        groups = {axis: self._new_groups(self.groups(axis), rank, timeout) for axis in AXES}
        ranks = {axis: self.group_of(axis, rank) for axis in AXES}
        groups["data"] = self._new_groups(self.data_groups(), rank, timeout)
        ranks["data"] = next(g for g in self.data_groups() if rank in g)
        if self.pp > 1:  # pipeline messages from a higher pp rank to a lower one (``schedules.one_way``)
            groups["pp_back"], ranks["pp_back"] = self._new_groups(self.groups("pp"), rank, timeout), ranks["pp"]
        if self.ep > 1:
            for name, every in (("ep", self.expert_groups()), ("ep_replicas", self.expert_replica_groups())):
                groups[name] = self._new_groups(every, rank, timeout)
                ranks[name] = next(g for g in every if rank in g)
        return MeshGroups(
            mesh=self,
            rank=rank,
            timeout=timeout,
            coords=types.MappingProxyType(self.coords(rank)),
            _groups=types.MappingProxyType(groups),
            _ranks=types.MappingProxyType(ranks),
        )

    def _new_groups(self, all_ranks: list[list[int]], rank: int, timeout: datetime.timedelta) -> ProcessGroup:
        """Call new_group for every group of ``all_ranks`` (collective); keep the one holding ``rank``."""
        import torch.distributed as dist

        mine = None
        for ranks in all_ranks:
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine = group
        assert mine is not None, f"rank {rank} is in no group of {all_ranks}"
        return mine


@dataclass(frozen=True, kw_only=True)
class MeshGroups:
    """This rank's process groups along every axis of ``mesh``. Made by :meth:`Mesh.create_groups`."""

    mesh: Mesh
    rank: int
    coords: Mapping[str, int]
    _groups: Mapping[str, ProcessGroup] = field(repr=False)
    _ranks: Mapping[str, list[int]] = field(repr=False)
    timeout: datetime.timedelta = _DEFAULT_TIMEOUT
    _across_pp: dict = field(default_factory=dict, repr=False)

    def across_pp(self, pp_indices: frozenset[int]) -> ProcessGroup | None:
        """The group of the ranks at these pp coordinates and this rank's other coordinates (the pipeline ranks
        that share a tied parameter), or None when this rank is not among them. Collective on the first call:
        every rank calls it with the same ``pp_indices`` in the same order, and the groups of every other
        coordinate are created alongside, as :meth:`Mesh.create_groups` does."""
        import torch.distributed as dist

        if pp_indices not in self._across_pp:
            others = [a for a in AXES if a != "pp"]
            every = [[self.mesh.rank_of(pp=i, **dict(zip(others, coords, strict=True))) for i in sorted(pp_indices)]
                     for coords in itertools.product(*(range(self.mesh.degree(a)) for a in others))]
            member = any(self.rank in ranks for ranks in every)
            self._across_pp[pp_indices] = self.mesh._new_groups(every, self.rank, self.timeout) if member else None
            if not member:  # still create every group, in the same order as the members do
                for ranks in every:
                    dist.new_group(ranks, timeout=self.timeout)
        return self._across_pp[pp_indices]

    def destroy(self) -> None:
        """Destroy this rank's groups (every axis's, and the pipeline's for tied parameters). A set left alive keeps
        its threads and sockets: after a few dozen, a 4-rank calibration here read the ranks' waits at collectives
        ten to a hundred times what a fresh process reads. Every rank calls it, after its last collective on them."""
        import torch.distributed as dist
        from torch.distributed import GroupMember

        done: set[int] = set()
        for group in [*self._groups.values(), *self._across_pp.values()]:
            if group is None or group is GroupMember.NON_GROUP_MEMBER or group is GroupMember.WORLD \
                    or id(group) in done:
                continue
            done.add(id(group))
            dist.destroy_process_group(group)
        self._across_pp.clear()

    def group(self, axis: str) -> ProcessGroup:
        """The group along ``axis``; ``"data"`` is the group over dp and cp together (gradient sums), and
        ``"pp_back"`` a second group over the pp ranks, for pipeline messages to a lower pp rank."""
        if axis not in ("data", "pp_back", "ep", "ep_replicas"):
            _check_axis(axis)
        return self._groups[axis]

    def ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along ``axis``, ordered by their ``axis`` coordinate."""
        if axis not in ("data", "ep", "ep_replicas"):
            _check_axis(axis)
        return list(self._ranks[axis])

    def local_rank_in(self, axis: str) -> int:
        """This rank's index within its ``axis`` group: its ``axis`` coordinate."""
        _check_axis(axis)
        return self.coords[axis]

    @property
    def device_type(self) -> str:
        """Where these groups' collectives run: ``"cuda"`` for NCCL groups, ``"cpu"`` for gloo."""
        import torch.distributed as dist

        return "cuda" if "nccl" in str(dist.get_backend(self._groups[AXES[-1]])) else "cpu"

    def to_device_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """A torch DeviceMesh over the already-created groups, dims named ``AXES`` (creates no groups)."""
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        layout = torch.arange(self.mesh.world_size, dtype=torch.int).reshape(self.mesh.shape)
        groups = [self._groups[axis] for axis in AXES]  # the "data" group is not a mesh dim
        return DeviceMesh.from_group(groups, device_type, mesh=layout, mesh_dim_names=AXES)
