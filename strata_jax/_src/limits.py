"""The operating-system limits a job of many processes can hit, checked at ``init()``.

A shared-memory fabric of ``P`` processes holds, in each process: a unix socket to every other
process (``P - 1`` file descriptors), the memfd of each of its own pool segments and bounce
buffers (one descriptor each; peers' segments are mapped and their descriptors closed), and a
memory map for each segment of every peer (``vm.max_map_count`` counts maps per process). JAX
itself holds a gloo connection to each other process of the job. What ``init()`` checks, in every
process, before it connects anything (``check``):

- ``RLIMIT_NOFILE``: the open files this process will need. A soft limit below it is raised to
  it when the hard limit allows (as many servers do at start); otherwise an error.
- ``vm.max_map_count``: the maps this process will need (the host's setting; only root raises it).
- memory: ``MemAvailable`` against what strata itself will fault in on the host (the fabric's
  pool reserves, control segment and first bounce buffers); JAX's own memory is not judged here.

Not limits of strata's: the size of ``/dev/shm`` (memfd memory is not in that file system; a job
runs with a 64 KiB ``/dev/shm``) and the memfd count (one file descriptor each: ``RLIMIT_NOFILE``).
Every process posts what it found through the ``jax.distributed`` store and every process fails
with the same message naming each process whose limit is short (``startup.py``), within a few
polls of the store; the messages are listed in docs/guide/troubleshooting.md.
"""

from __future__ import annotations

import os
import resource

# Per process, besides what it has open at init(): the pool's segments at most (its 1 GiB cache
# cap in 64 MiB segments) and a few bounce buffers, then room for the application.
POOL_FDS = 16 + 4
FDS_MARGIN = 64
# Maps of one peer's memory in this process: its pool segments in use (a handful; 1-4 measured
# at 2-32 processes) and its bounce buffers. 8 each, plus room for the application.
MAPS_PER_PEER = 8
MAPS_MARGIN = 1024
# Memory strata faults in per process on its own (besides the reserve): control segment pages,
# the first bounce buffer's 256 KiB, the low-latency slots of its rings.
OWN_BYTES_PER_PROCESS = 4 << 20


def default_reserve(fabric_procs: int) -> int:
    """The pool reserve each process of a fabric keeps (native/fabric/shm_link.cc,
    fabric_reserve_bytes, the same rule): ``STRATA_ALLOC_RESERVE_BYTES`` when set, else 128 MiB
    while the fabric's reserves stay within 1/32 of the host's memory, else whole 64 MiB units
    of that share."""
    from strata_jax._src import runtime

    if os.environ.get("STRATA_ALLOC_RESERVE_BYTES"):
        return runtime.env_bytes("STRATA_ALLOC_RESERVE_BYTES", 128 << 20, "128M; 0: no reserve")
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 128 << 20
    units = total // 32 // max(fabric_procs, 1) // (64 << 20)
    return 128 << 20 if units >= 2 else units * (64 << 20)


class LimitError(RuntimeError):
    """A limit of the operating system is below what the job needs (message: which limit, its
    value, what this job needs and how to raise it)."""


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 32


def _maps_now() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return 1000


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def needs(fabric_procs: int, job_procs: int, *, open_now: int, maps_now: int) -> dict:
    """What one process of a fabric of ``fabric_procs`` processes (``job_procs`` in the job)
    needs: ``{"nofile": open files, "maps": memory maps}``."""
    links = max(fabric_procs - 1, 0)
    nofile = open_now + links + max(job_procs - 1, 0) + POOL_FDS + FDS_MARGIN
    maps = maps_now + links * MAPS_PER_PEER + MAPS_MARGIN
    # Rounded up (64 files, 1024 maps), so that processes with a few more or fewer open now
    # report the same figure and every process prints one message.
    return {"nofile": -(-nofile // 64) * 64, "maps": -(-maps // 1024) * 1024}


def check(
    fabric_procs: int,
    job_procs: int,
    reserve_bytes: int,
    control_bytes: int,
    *,
    nofile: tuple[int, int] | None = None,
    max_map_count: int | None = None,
    mem_available: int | None = None,
    open_now: int | None = None,
    maps_now: int | None = None,
    raise_soft: bool = True,
) -> list[str]:
    """The limits this process is short of for a fabric of ``fabric_procs`` processes (of
    ``job_procs`` in the job), each as one message; ``[]`` when none.

    ``reserve_bytes``: the pool reserve each process of the fabric keeps; ``control_bytes``: the
    control segment's pages the fabric touches. The keyword arguments replace what is read from
    the system (tests); ``raise_soft``: raise a short soft RLIMIT_NOFILE to what is needed when
    the hard limit allows.
    """
    problems = []
    need = needs(
        fabric_procs,
        job_procs,
        open_now=_open_fds() if open_now is None else open_now,
        maps_now=_maps_now() if maps_now is None else maps_now,
    )
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE) if nofile is None else nofile
    unlimited = resource.RLIM_INFINITY
    if soft != unlimited and soft < need["nofile"]:
        if raise_soft and (hard == unlimited or hard >= need["nofile"]):
            resource.setrlimit(resource.RLIMIT_NOFILE, (need["nofile"], hard))
        else:
            problems.append(
                f"RLIMIT_NOFILE (open files) is {soft} (hard limit {hard}); this process needs "
                f"about {need['nofile']} for a fabric of {fabric_procs} processes in a job of "
                f"{job_procs} (a socket to each process of its fabric, a gloo connection to "
                f"each process of the job, its pool's memfds). Raise it before starting the job: "
                f"`ulimit -n {need['nofile']}` in the shell that starts it (the hard limit: "
                f"/etc/security/limits.conf, or LimitNOFILE= for a systemd service)"
            )
    mmc = _read_int("/proc/sys/vm/max_map_count") if max_map_count is None else max_map_count
    if mmc is not None and mmc < need["maps"]:
        problems.append(
            f"vm.max_map_count is {mmc}; this process needs about {need['maps']} memory maps "
            f"for a fabric of {fabric_procs} processes (it maps {MAPS_PER_PEER} segments of each "
            f"peer at most). Raise it as root: `sysctl -w vm.max_map_count={need['maps'] * 2}`"
        )
    avail = _mem_available() if mem_available is None else mem_available
    host_need = fabric_procs * (reserve_bytes + OWN_BYTES_PER_PROCESS) + control_bytes
    if avail is not None and avail < host_need:
        mib = 1 << 20
        problems.append(
            f"memory: MemAvailable is {avail // mib} MiB; the {fabric_procs} processes of this "
            f"fabric need {host_need // mib} MiB of it for strata alone (pool reserves of "
            f"{reserve_bytes // mib} MiB each, control segment, first buffers), before JAX's "
            f"own. Free memory, run fewer processes per host, or turn the reserve off "
            f"(STRATA_ALLOC_RESERVE_BYTES=0)"
        )
    return problems
