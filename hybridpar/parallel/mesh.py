"""The parallel layout as a value: degrees, this rank's coordinates and its process groups.

``Layout`` is pure arithmetic (usable by the planner and unit tests without any process group);
``ParallelMesh`` adds the rank, device and the groups, built on torch's ``DeviceMesh``. Nothing
here is global: the mesh is passed to every function that communicates.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

AXES = ("dp", "tp", "pp")


@dataclass(frozen=True)
class Layout:
    """dp x tp x pp ranks; ``order`` lists the axes innermost first (Megatron's rank order).

    With the default ``("tp", "dp", "pp")`` consecutive ranks form a tp group (same node, fastest
    links), and rank = tp + tp_size * (dp + dp_size * pp).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    order: tuple[str, ...] = ("tp", "dp", "pp")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

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

    def rank_of(self, *, dp: int, tp: int, pp: int) -> int:
        c = {"dp": dp, "tp": tp, "pp": pp}
        return sum(c[a] * st for a, st in self._strides().items())

    def grid(self) -> torch.Tensor:
        """Global ranks as a (pp, dp, tp) tensor, whatever the rank order."""
        g = torch.empty(self.pp, self.dp, self.tp, dtype=torch.int64)
        for r in range(self.world_size):
            c = self.coords(r)
            g[c["pp"], c["dp"], c["tp"]] = r
        return g

    def group_ranks(self, axis: str) -> list[list[int]]:
        """All groups along ``axis`` (the other coordinates fixed), as lists of global ranks."""
        dim = {"pp": 0, "dp": 1, "tp": 2}[axis]
        g = self.grid().movedim(dim, -1).reshape(-1, self.size(axis))
        return [row.tolist() for row in g]


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
        return self.layout.rank_of(dp=c["dp"], tp=c["tp"], pp=pp_rank)

    def describe(self) -> str:
        c = self.coords
        return f"rank {self.rank} (dp={c['dp']}, tp={c['tp']}, pp={c['pp']})"


def single_mesh(device: torch.device | str = "cpu") -> ParallelMesh:
    """A one-process mesh: every group is None and every collective a no-op."""
    return ParallelMesh(Layout(), 0, torch.device(device))


def build_mesh(layout: Layout, device: torch.device, *, embed_group: bool = False) -> ParallelMesh:
    """Create the dp/tp/pp groups on an initialised default process group.

    Collective: every rank must call it with the same layout.
    """
    if not dist.is_initialized():
        if layout.world_size == 1:
            return single_mesh(device)
        raise RuntimeError("build_mesh needs torch.distributed initialised for world size > 1")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != layout.world_size:
        raise ValueError(f"world size {world} != dp*tp*pp = {layout.world_size}")
    from torch.distributed.device_mesh import DeviceMesh

    dm = DeviceMesh(device.type, layout.grid(), mesh_dim_names=("pp", "dp", "tp"))
    groups = {a: (dm.get_group(a) if layout.size(a) > 1 else None) for a in AXES}
    mesh = ParallelMesh(layout, rank, device, groups, dm)
    if embed_group and layout.pp > 1:
        # new_group is collective over the world: every rank creates every pair, keeps its own
        for ranks in layout.group_ranks("pp"):
            g = dist.new_group([ranks[0], ranks[-1]])
            if rank in (ranks[0], ranks[-1]):
                mesh.embed_group = g
    return mesh
