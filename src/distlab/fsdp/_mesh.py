"""``DeviceMesh``: the ranks of a job arranged in one or two dimensions, for ``fully_shard(group=...)``.

Mirrors the part of torch's ``DeviceMesh`` (torch/distributed/device_mesh.py) that FSDP uses. A 1-D mesh of W ranks
shards over all of them. A 2-D mesh of shape ``(R, S)`` is hybrid sharding (HSDP): rank ``r * S + s`` shards with
the S ranks of its row (dimension 1, "shard": one host, when ranks are placed on hosts in blocks of S) and
replicates with the R ranks of its column (dimension 0, "replicate": the ranks holding the same shard on the
other hosts). Every rank of the group calls the constructor; it makes the rows and columns as process groups.
"""
from __future__ import annotations

import math

__all__ = ["DeviceMesh", "init_device_mesh"]


class DeviceMesh:
    """Ranks of ``group`` (default: the world) arranged in ``mesh_shape`` (torch's ``DeviceMesh``).

    Parameters
    ----------
    mesh_shape : tuple of int
        ``(W,)`` or ``(R, S)``; the product must be the group's size.
    mesh_dim_names : tuple of str, optional
        Names of the dimensions, e.g. ``("replicate", "shard")``.
    group : distlab.comm.ProcessGroup, optional
        The ranks to arrange (default :func:`distlab.comm.world`).
    """

    def __init__(self, mesh_shape, mesh_dim_names=None, group=None):
        from .. import comm

        shape = tuple(int(d) for d in (mesh_shape if isinstance(mesh_shape, (tuple, list)) else (mesh_shape,)))
        self.group = group if group is not None else comm.world()
        if math.prod(shape) != self.group.size or any(d < 1 for d in shape):
            raise ValueError(f"DeviceMesh: a mesh of shape {shape} needs {math.prod(shape)} ranks, but the group has "
                             f"{self.group.size}")
        if mesh_dim_names is not None and len(tuple(mesh_dim_names)) != len(shape):
            raise ValueError(f"DeviceMesh: {len(tuple(mesh_dim_names))} dimension names for a {len(shape)}-D mesh")
        self.shape = shape
        self.mesh_dim_names = None if mesh_dim_names is None else tuple(mesh_dim_names)
        self._groups = self._make_groups()

    @classmethod
    def from_groups(cls, replicate_group, shard_group, group):
        """A 2-D mesh from process groups made elsewhere (torch's ``DeviceMesh.from_group`` with two groups)."""
        mesh = cls.__new__(cls)
        mesh.group = group
        mesh.shape = (replicate_group.size, shard_group.size)
        mesh.mesh_dim_names = ("replicate", "shard")
        mesh._groups = (replicate_group, shard_group)
        return mesh

    def _make_groups(self) -> tuple:
        if len(self.shape) == 1:
            return (self.group,)
        if len(self.shape) != 2:
            return ()  # fully_shard refuses it, in torch's words
        rows, cols = self.shape
        shard = replicate = None
        for r in range(rows):  # every rank takes part in making every group
            made = self.group.new_group([r * cols + s for s in range(cols)], name=f"mesh shard row {r}")
            if made is not None:
                shard = made
        for s in range(cols):
            made = self.group.new_group([r * cols + s for r in range(rows)], name=f"mesh replicate column {s}")
            if made is not None:
                replicate = made
        return (replicate, shard)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def size(self, mesh_dim=None) -> int:
        """The number of ranks (along ``mesh_dim``)."""
        return math.prod(self.shape) if mesh_dim is None else self.shape[mesh_dim]

    def get_group(self, mesh_dim=0):
        """The process group of this rank along ``mesh_dim`` (an index or a dimension name)."""
        if isinstance(mesh_dim, str):
            if self.mesh_dim_names is None or mesh_dim not in self.mesh_dim_names:
                raise KeyError(f"DeviceMesh: no dimension named {mesh_dim!r} (names: {self.mesh_dim_names})")
            mesh_dim = self.mesh_dim_names.index(mesh_dim)
        return self._groups[mesh_dim]

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh(shape={self.shape}{names})"


def init_device_mesh(mesh_shape, mesh_dim_names=None, group=None) -> DeviceMesh:
    """``DeviceMesh(mesh_shape, mesh_dim_names, group)`` (torch's ``init_device_mesh`` without a device type:
    the arrays' own module decides where data lives)."""
    return DeviceMesh(mesh_shape, mesh_dim_names, group)
