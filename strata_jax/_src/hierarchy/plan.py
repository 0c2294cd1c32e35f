"""The plan of a collective whose groups span fabrics: how fabric domains cut each group into F
fabric slots of L members (see the package's docstring), or None when no group crosses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from strata_jax._src import topology
from strata_jax._src.jax_compat import SPMDAxisContext


@dataclass(frozen=True)
class Plan:
    groups: np.ndarray  # [G, n] partition ids, rank order
    uniform: bool  # every group cut into F slots of L in the same layout
    F: int = 1
    L: int = 1
    f: np.ndarray | None = None  # [n] fabric slot of each group rank
    loc: np.ndarray | None = None  # [n] local index of each group rank
    intra: tuple = ()  # [G*F][L] partition ids
    inter: tuple = ()  # [G*L][F] partition ids
    who: np.ndarray | None = None  # [num partitions, 3]: global device id, process, fabric

    def rank_of(self, slot: int, k: int) -> int:
        return int(np.flatnonzero((self.f == slot) & (self.loc == k))[0])

    def perm_lf(self) -> np.ndarray:
        """Group ranks in (l, f) order (l major)."""
        return np.array([self.rank_of(s, k) for k in range(self.L) for s in range(self.F)])

    def perm_fl(self) -> np.ndarray:
        """Group ranks in (f, l) order (f major)."""
        return np.array([self.rank_of(s, k) for s in range(self.F) for k in range(self.L)])


def _layout(fabrics: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order: dict[int, int] = {}
    f = np.empty(len(fabrics), np.int64)
    loc = np.empty(len(fabrics), np.int64)
    count: dict[int, int] = {}
    for j, fab in enumerate(fabrics.tolist()):
        f[j] = order.setdefault(fab, len(order))
        loc[j] = count.get(fab, 0)
        count[fab] = loc[j] + 1
    return f, loc


def plan(ctx, axes: tuple) -> Plan | None:
    """How the groups of a collective over ``axes`` cross fabrics; None when none does."""
    if topology.num_fabrics() == 1:
        return None
    axis_ctx = ctx.module_context.axis_context
    if not isinstance(axis_ctx, SPMDAxisContext):
        return None
    mesh = axis_ctx.mesh
    names = tuple(mesh.axis_names)
    sizes = tuple(int(s) for s in mesh.axis_sizes)
    idx = [names.index(a) for a in axes]
    rest = [i for i in range(len(names)) if i not in idx]
    n = math.prod(sizes[i] for i in idx)
    groups = np.arange(math.prod(sizes)).reshape(sizes).transpose(rest + idx).reshape(-1, n)
    fab = np.array([topology.fabric_of_device(d) for d in np.asarray(mesh.devices).flat])
    gf = fab[groups]
    if all(len(set(row.tolist())) == 1 for row in gf):
        return None
    who = np.array(
        [
            (d.id, d.process_index, f)
            for d, f in zip(np.asarray(mesh.devices).flat, fab, strict=True)
        ],
        np.int64,
    )
    layouts = [_layout(row) for row in gf]
    f0, l0 = layouts[0]
    F = int(f0.max()) + 1
    L = n // F
    uniform = (
        n % F == 0
        and all(np.array_equal(f, f0) and np.array_equal(lo, l0) for f, lo in layouts)
        and all(int((f0 == s).sum()) == L for s in range(F))
    )
    if not uniform:
        return Plan(groups, False, who=who)
    intra = tuple(
        tuple(int(groups[g, np.flatnonzero((f0 == s) & (l0 == k))[0]]) for k in range(L))
        for g in range(len(groups))
        for s in range(F)
    )
    inter = tuple(
        tuple(int(groups[g, np.flatnonzero((f0 == s) & (l0 == k))[0]]) for s in range(F))
        for g in range(len(groups))
        for k in range(L)
    )
    return Plan(groups, True, F, L, f0, l0, intra, inter, who)
