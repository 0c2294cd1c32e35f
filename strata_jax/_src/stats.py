"""The counters a user reads: :func:`comm_stats` (per operator) and :func:`memory_stats`
(registration, zero-copy and allocator), and :func:`reset_stats`.

Both read the native library's counters (``native/fabric/stats.h``, ``op_stats.h``); nothing is
counted here.
"""

from __future__ import annotations

from strata_jax._src import allocator, operators, topology
from strata_jax._src.runtime import native


def comm_stats() -> dict:
    """Process-wide communication counters, in total and per operator.

    Returns:
      dict with ``calls`` (collective calls, counted per rank), ``zero_copy_bytes`` (bytes read
      straight from peers' buffers), ``staged_bytes`` (bytes copied through a bounce buffer),
      ``one_shot_all_reduce``/``two_shot_all_reduce`` (algorithm choices), ``timeouts``,
      ``low_latency_calls`` (calls across processes that took the small-message path,
      native/fabric/shm_ll.h; slot and staged forms), ``direct_calls`` (those that took its direct
      form: peers read each rank's own buffers in place), ``channel_waits`` and ``channel_sleeps``
      (waits of that path for a peer, and those of them that slept on the futex instead of
      catching the peer while spinning or yielding), ``lead_calls`` and ``pair_calls`` (in-process
      calls made in one rendezvous, counted per rank: the last rank to arrive ran every rank's
      part, calls of up to 256 KiB per rank; or, for a larger ``all_to_all``, each pair of blocks
      was copied by the second of its two ranks to arrive), ``rendezvous_steps`` (per rank: entries
      into a barrier of a call's group, and publications of the low-latency path; the steps
      column of docs/scaling.md), and ``ops``: per operator (``psum``,
      ``pmax``, ``pmin``, ``psum_scatter``, ``all_gather``, ``all_to_all``, ``ppermute``,
      ``pbroadcast``, ``ragged_all_to_all``, ``moe.dispatch``, ``moe.combine``, ``moe.combine
      (weights cotangent)``, ``moe.low_latency_dispatch``, ``moe.low_latency_combine``; only those
      called; each rank's call counted once) a dict with ``calls``, ``bytes`` (input bytes per
      rank, summed), ``algorithm`` (``{"one_shot": n, "two_shot": m}`` for the all-reduces,
      ``{"direct": n}`` otherwise), ``p50_s``/``p99_s`` (time in the handler, from a histogram
      with 12.5% buckets), ``total_s``, ``wait_s`` (until every peer had arrived) and ``move_s``
      (the rest: the algorithm moving data, and the departure; on the pairs path of ``pair_calls``
      the copies happen while peers arrive, and the whole call counts as ``wait_s``).
      ``STRATA_STATS=0`` turns the per-operator
      counters off (their cost is measured in tests/test_comm_stats.py).
    """
    nat = native()
    out = dict(nat.comm_stats())
    ops = {}
    for d in nat.op_stats():
        name = d["name"]
        op = operators.BY_STATS.get(name)
        algos = op.algorithms if op is not None else ("direct",)
        ops[name] = {
            "calls": d["calls"],
            "bytes": d["bytes"],
            # The native counters split calls in two (``one_shot``: the first algorithm).
            "algorithm": (
                {algos[0]: d["one_shot"], algos[1]: d["two_shot"]}
                if len(algos) == 2
                else {algos[0]: d["calls"]}
            ),
            "p50_s": d["p50_s"],
            "p99_s": d["p99_s"],
            "total_s": d["total_s"],
            "wait_s": d["wait_s"],
            "move_s": max(0.0, d["total_s"] - d["wait_s"]),
        }
    out["ops"] = ops
    return out


def reset_stats() -> None:
    """Zeroes the per-operator counters of :func:`comm_stats` (``ops``)."""
    native().reset_op_stats()


def memory_stats() -> dict:
    """Registration, zero-copy and allocator counters of this process.

    Returns:
      dict with (bytes are bytes, seconds are seconds, counts are per process):

      - ``fabric``: ``"shm"`` (connected across processes) or ``"inproc"``;
        ``registration``: the mode in effect (``"none"`` in-process; ``"staging"`` when the
        allocator does not serve XLA's buffers, whatever mode was asked for).
      - ``registered_segments`` / ``registered_bytes``: live segments of this process exported
        to every peer (allocator segments and bounce buffers).
      - ``peer_segments_mapped`` / ``peer_bytes_mapped``: peers' segments mapped here.
      - ``registrations_critical`` / ``registrations_critical_s``: registrations a collective
        had to do itself or wait for (on the critical path), and the time they took.
      - ``registrations_offpath`` / ``registrations_offpath_s``: registrations done by the
        allocator's background thread (off the critical path).
      - ``zero_copy_bytes``: bytes collectives read from / wrote to peers' own buffers.
      - ``staged_bytes``: bytes copied into / out of bounce buffers; ``staged_calls``: calls
        that staged at least one buffer; ``peer_bounce_bytes``: bytes moved between peers
        through bounce buffers; ``bounce_buffer_bytes``: size of this process's bounce buffers.
      - ``allocator``: whether libstrata_alloc serves XLA's buffers in this process;
        ``allocator_mode``: how (``"preload"``: LD_PRELOAD, by ``strata_jax.launch`` or
        ``strata-run``; ``"hook"``: hooked into jaxlib at ``import strata_jax``, the default
        under any other launcher; ``"off"``); ``pool_segments``,
        ``pool_segment_bytes``, ``pool_bytes_in_use``, ``pool_bytes_cached``, ``pool_allocs``,
        ``pool_threshold`` from ``strata_alloc_stats`` (zeros without the allocator).
      - ``intra_fabric_bytes``: bytes strata moved between devices of this fabric (zero-copy
        plus through peers' bounce buffers); ``inter_fabric_bytes``: bytes the inter-fabric
        steps of hierarchical collectives handed to XLA's own collectives (gloo/MPI).
      - ``fabric``/``fabric_index``/``fabric_id``: this process's fabric domain;
        ``fabric_peers``: one dict per process of this fabric connected through shared memory
        (``process``: jax process index, ``fabric_id``, ``os_pid``: the pid at the other end
        of the link as the kernel attests it (SO_PEERCRED; 0 for this process),
        ``segments_mapped`` / ``bytes_mapped``: that process's segments mapped here). Every
        peer segment mapped here is listed under its owner, so this shows that no memory of
        another fabric is mapped.
    """
    d = dict(native().memory_stats())
    d["allocator_mode"] = allocator.state["mode"] if d.get("allocator") else "off"
    fmap = topology.fabric_map()
    members = fmap.members(fmap.own)
    d["fabric_index"] = fmap.own
    d["fabric_id"] = fmap.ids[fmap.process]
    peers = []
    for e in d.get("fabric_peers", []):
        e = dict(e)
        p = members[e.pop("fabric_rank")]
        peers.append({"process": p, "fabric_id": fmap.ids[p], **e})
    d["fabric_peers"] = peers
    return d
