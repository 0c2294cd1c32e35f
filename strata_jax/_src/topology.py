"""Fabric domains: which processes can map each other's memory.

A *fabric* is a set of processes that share one host's memory: strata moves the bytes inside
it (unix sockets carry memfds, peers read each other's buffers), and XLA's own collectives
(gloo over TCP, or MPI) move them between fabrics, as NCCL splits NVLink from the network and
DeepEP NVLink from RDMA. By default a process's fabric id is its host: hostname plus the
kernel's boot id (two containers on one machine with different hostnames are two fabrics,
which is safe; a rebooted machine reusing a name is a new one). ``STRATA_FABRIC_ID`` (any
string) overrides it, so one machine can stand in for several hosts (``python -m
strata_jax.launch -n 4 --hosts 2``).

``strata_jax.init()`` exchanges the ids through the ``jax.distributed`` key-value store and
records the map here; the collectives' lowerings read it (:func:`fabric_of_process`) to split
a group that spans fabrics, and :func:`topology` reports it.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

ENV_FABRIC_ID = "STRATA_FABRIC_ID"
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


@dataclass(frozen=True)
class FabricMap:
    """Fabric ids of every process of the job (index = jax process index)."""

    ids: tuple[str, ...]
    process: int

    @property
    def names(self) -> tuple[str, ...]:
        """Distinct fabric ids, ordered by their lowest process index."""
        seen: dict[str, None] = {}
        for f in self.ids:
            seen.setdefault(f, None)
        return tuple(seen)

    def index_of_process(self, p: int) -> int:
        return self.names.index(self.ids[p])

    def members(self, fabric: int) -> tuple[int, ...]:
        name = self.names[fabric]
        return tuple(p for p, f in enumerate(self.ids) if f == name)

    @property
    def own(self) -> int:
        return self.index_of_process(self.process)


_map: FabricMap | None = None


def local_fabric_id() -> str:
    """This process's fabric id: ``$STRATA_FABRIC_ID``, else ``hostname/boot id``."""
    override = os.environ.get(ENV_FABRIC_ID)
    if override:
        return override
    try:
        with open(BOOT_ID_PATH) as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"


def set_fabric_map(ids: list[str] | tuple[str, ...], process: int) -> FabricMap:
    """Records the job's fabric map (called once by ``init()``)."""
    global _map
    _map = FabricMap(tuple(ids), int(process))
    return _map


def fabric_map() -> FabricMap:
    """The job's fabric map; a single fabric when ``init()`` found one process."""
    if _map is None:
        return FabricMap((local_fabric_id(),), 0)
    return _map


def fabric_of_process(p: int) -> int:
    """Fabric index of jax process ``p`` (0 for every process before ``init()``)."""
    m = _map
    if m is None or p >= len(m.ids):
        return 0
    return m.index_of_process(p)


def fabric_of_device(d) -> int:
    """Fabric index of a jax device ``d`` (the fabric of its process)."""
    return fabric_of_process(d.process_index)


def num_fabrics() -> int:
    return 1 if _map is None else len(_map.names)


def topology() -> dict:
    """The fabric domains of the current job.

    The result is a dict with these keys:

    - ``process``: this process's index; ``fabric``: its fabric index;
    - ``fabric_ids``: the fabric id string of every process (index = process index);
    - ``fabrics``: one dict per fabric (ordered by lowest process index) with ``id``,
      ``processes`` (process indices) and ``devices`` (global ids of the jax devices of
      those processes).

    Returns:
      The dict described above.

    Shared memory connects only processes of one fabric; a collective whose group spans
    fabrics moves the bytes between them with XLA's own collectives (see ``hierarchy/``).
    Call it after ``strata_jax.init()``.
    """
    import jax

    m = fabric_map()
    devs = jax.devices()
    fabrics = []
    for i, name in enumerate(m.names):
        procs = m.members(i)
        fabrics.append(
            {
                "id": name,
                "processes": list(procs),
                "devices": sorted(d.id for d in devs if d.process_index in procs),
            }
        )
    return {
        "process": m.process,
        "fabric": m.own,
        "fabric_ids": list(m.ids),
        "fabrics": fabrics,
    }
