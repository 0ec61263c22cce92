"""The parallel layout as a value: degrees, this rank's coordinates and its process groups.

``Layout`` is pure arithmetic (usable by the planner and unit tests without any process group);
``ParallelMesh`` adds the rank, device and the groups, built on torch's ``DeviceMesh``. Nothing
here is global: the mesh is passed to every function that communicates.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

AXES = ("dp", "cp", "tp", "pp")


def _with_cp(order: tuple[str, ...]) -> tuple[str, ...]:
    """A rank order naming only dp, tp and pp gets cp right after tp (Megatron's tp-cp-dp-pp):
    a cp group exchanges K/V every layer, so it sits next to the tp group on the fastest links."""
    if "cp" in order:
        return tuple(order)
    at = order.index("tp") + 1 if "tp" in order else 0
    return (*order[:at], "cp", *order[at:])


@dataclass(frozen=True)
class Layout:
    """dp x cp x tp x pp ranks; ``order`` lists the axes innermost first (Megatron's rank order).

    With the default ``("tp", "cp", "dp", "pp")`` consecutive ranks form a tp group (same node,
    fastest links), then cp, and rank = tp + tp_size * (cp + cp_size * (dp + dp_size * pp)).
    An order naming only dp, tp and pp places cp right after tp. ``cp`` comes last among the
    fields so that ``Layout(dp, tp, pp, order)`` keeps its meaning.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    order: tuple[str, ...] = ("tp", "dp", "pp")
    cp: int = 1

    def __post_init__(self):
        object.__setattr__(self, "order", _with_cp(tuple(self.order)))

    @classmethod
    def of(cls, p) -> "Layout":
        """The layout a ``ParallelConfig`` asks for."""
        return cls(p.dp, p.tp, p.pp, tuple(p.order.split("-")), getattr(p, "cp", 1))

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def replicas(self) -> int:
        """Ranks holding the same parameters (dp x cp): they average gradients, and each adds
        its loss to the step's all-reduce."""
        return self.dp * self.cp

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    def _strides(self) -> dict[str, int]:
        strides, s = {}, 1
        for axis in self.order:
            strides[axis] = s
            s *= self.size(axis)
        return strides

    def coords(self, rank: int) -> dict[str, int]:
        return {a: (rank // st) % self.size(a) for a, st in self._strides().items()}

    def rank_of(self, *, dp: int, tp: int, pp: int, cp: int = 0) -> int:
        c = {"dp": dp, "cp": cp, "tp": tp, "pp": pp}
        return sum(c[a] * st for a, st in self._strides().items())

    def describe_rank(self, rank: int) -> str:
        """``dp=1, tp=0, pp=0`` (``cp=`` too when there is a cp axis): a rank's coordinates."""
        c = self.coords(rank)
        return ", ".join(f"{a}={c[a]}" for a in ("dp", "cp", "tp", "pp") if a != "cp" or self.cp > 1)

    def grid(self) -> torch.Tensor:
        """Global ranks as a (pp, dp, cp, tp) tensor, whatever the rank order."""
        g = torch.empty(self.pp, self.dp, self.cp, self.tp, dtype=torch.int64)
        for r in range(self.world_size):
            c = self.coords(r)
            g[c["pp"], c["dp"], c["cp"], c["tp"]] = r
        return g

    def group_ranks(self, axis: str) -> list[list[int]]:
        """All groups along ``axis`` (the other coordinates fixed), as lists of global ranks.
        ``"dcp"``: the dp x cp replicas of one (tp, pp) shard, which reduce gradients together."""
        g = self.grid()
        if axis == "dcp":
            return [row.tolist() for row in g.permute(0, 3, 1, 2).reshape(-1, self.dp * self.cp)]
        dim = {"pp": 0, "dp": 1, "cp": 2, "tp": 3}[axis]
        return [row.tolist() for row in g.movedim(dim, -1).reshape(-1, self.size(axis))]


@dataclass
class ParallelMesh:
    layout: Layout
    rank: int
    device: torch.device
    groups: dict[str, dist.ProcessGroup | None] = field(default_factory=dict)
    device_mesh: object | None = None
    # pairs (first stage, last stage) of one pipeline, for tied embeddings with pp > 1
    embed_group: dist.ProcessGroup | None = None

    @property
    def coords(self) -> dict[str, int]:
        return self.layout.coords(self.rank)

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def cp_rank(self) -> int:
        return self.coords["cp"]

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    def group(self, axis: str) -> dist.ProcessGroup | None:
        return self.groups.get(axis)

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank of pipeline stage ``pp_rank`` in this rank's pipeline."""
        c = self.coords
        return self.layout.rank_of(dp=c["dp"], cp=c["cp"], tp=c["tp"], pp=pp_rank)

    def describe(self) -> str:
        return f"rank {self.rank} ({self.layout.describe_rank(self.rank)})"

    def release(self) -> None:
        """Drop this mesh's process groups (after ``destroy_process_group``), so that they are
        destroyed, and their threads joined, when the last other holder lets go, not at exit."""
        self.groups = {}
        self.embed_group = self.device_mesh = None


def _new_groups(all_ranks: list[list[int]], rank: int) -> dist.ProcessGroup | None:
    """Create every group of ``all_ranks`` (collective over the world: each rank creates all of
    them, in the same order) and return the one holding ``rank``."""
    mine = None
    for ranks in all_ranks:
        g = dist.new_group(ranks)
        if rank in ranks:
            mine = g
    return mine


def single_mesh(device: torch.device | str = "cpu") -> ParallelMesh:
    """A one-process mesh: every group is None and every collective a no-op."""
    return ParallelMesh(Layout(), 0, torch.device(device))


def build_mesh(layout: Layout, device: torch.device, *, embed_group: bool = False) -> ParallelMesh:
    """Create the dp/cp/tp/pp groups, and ``dcp`` (dp x cp: the ranks that reduce gradients
    together), on an initialised default process group.

    Collective: every rank must call it with the same layout.
    """
    if not dist.is_initialized():
        if layout.world_size == 1:
            return single_mesh(device)
        raise RuntimeError("build_mesh needs torch.distributed initialised for world size > 1")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != layout.world_size:
        raise ValueError(f"world size {world} != dp*cp*tp*pp = {layout.world_size}")
    from torch.distributed.device_mesh import DeviceMesh

    grid, names = layout.grid(), ("pp", "dp", "cp", "tp")
    if layout.cp == 1:  # no cp dimension: the mesh (and checkpoints' placements) as without cp
        grid, names = grid.squeeze(2), ("pp", "dp", "tp")
    dm = DeviceMesh(device.type, grid, mesh_dim_names=names)
    groups = {a: (dm.get_group(a) if layout.size(a) > 1 else None) for a in AXES}
    groups["dcp"] = groups["dp"] if layout.cp == 1 else _new_groups(layout.group_ranks("dcp"), rank)
    mesh = ParallelMesh(layout, rank, device, groups, dm)
    if embed_group and layout.pp > 1:
        # new_group is collective over the world: every rank creates every pair, keeps its own
        for ranks in layout.group_ranks("pp"):
            g = dist.new_group([ranks[0], ranks[-1]])
            if rank in (ranks[0], ranks[-1]):
                mesh.embed_group = g
    return mesh
