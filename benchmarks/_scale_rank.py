"""One rank of ``benchmarks/scale.py``: start-up, a few collectives, and what this process holds.

Run under the launcher: ``python -m strata_jax.launch -n N [--no-preload] _scale_rank.py MODE
OUT_DIR [CALLS]``. MODE ``strata`` calls ``strata_jax.init()`` and strata's collectives; MODE
``plain`` is the same program over jax.lax (gloo) without importing strata_jax at all (run it with
``--no-preload``), the baseline of the memory figures. Each rank writes ``OUT_DIR/rank-<r>.json``:
CPU and wall seconds of ``import jax``, of start-up (``init()``, or ``jax.distributed.initialize``)
and of the first call of each program; then, after every call ran, ``/proc/self/smaps_rollup`` and
``/proc/self/status`` (Rss, Pss and their parts, page tables), open files, memory maps and, in
strata mode, ``memory_stats()`` and the per-call counters. Every result is checked against numpy.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

MODE = sys.argv[1]
OUT = sys.argv[2]
CALLS = sys.argv[3].split(",") if len(sys.argv) > 3 and sys.argv[3] else ["psum_1m", "ag_64k"]


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def smaps_by_kind() -> dict:
    """Rss/Pss/Private_Dirty (bytes) of this process's mappings, summed by what they are:
    strata's memfds (``strata_seg``: pool segments, this process's and the peers' alike;
    ``strata_control``, ``strata_bounce``), other shared memory, anonymous memory, files."""
    kinds: dict = {}
    cur = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                name = head[5] if len(head) > 5 else ""
                if name.startswith("/memfd:"):
                    cur = name[len("/memfd:") :]
                elif name.startswith("/dev/shm") or name.startswith("/SYSV"):
                    cur = "other_shm"
                elif name == "" or name.startswith("["):
                    cur = "anon"
                else:
                    cur = "file"
                kinds.setdefault(cur, {"maps": 0, "Rss": 0, "Pss": 0, "Private_Dirty": 0})
                kinds[cur]["maps"] += 1
            elif cur and head[0].rstrip(":") in ("Rss", "Pss", "Private_Dirty"):
                kinds[cur][head[0].rstrip(":")] += int(head[1]) * 1024
    return kinds


def proc_memory() -> dict:
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmPTE", "VmRSS", "RssAnon", "RssFile", "RssShmem", "VmSize")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) * 1024
    out["open_files"] = len(os.listdir("/proc/self/fd"))
    out["by_kind"] = smaps_by_kind()
    with open("/proc/self/maps") as f:
        out["maps"] = sum(1 for _ in f)
    return out


t = {}
c0, w0 = cpu(), time.perf_counter()
if MODE == "strata":
    import strata_jax as sj

    c1, w1 = cpu(), time.perf_counter()
    info = sj.init()
    c2, w2 = cpu(), time.perf_counter()
    import jax
else:
    import jax

    c1, w1 = cpu(), time.perf_counter()
    jax.distributed.initialize(
        os.environ["STRATA_COORDINATOR"],
        int(os.environ["STRATA_NUM_PROCESSES"]),
        int(os.environ["STRATA_PROCESS_ID"]),
    )
    c2, w2 = cpu(), time.perf_counter()
t["import_cpu"], t["import_wall"] = c1 - c0, w1 - w0
t["init_cpu"], t["init_wall"] = c2 - c1, w2 - w1

import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

devs = sorted(jax.devices(), key=lambda d: d.id)
N = len(devs)
mesh = Mesh(np.array(devs), ("x",))
lib = sj if MODE == "strata" else jax.lax


def row(elems: int, seed: int, j: int) -> np.ndarray:
    """Row ``j`` of the global input (one per device), made alone: a process holds its own
    rows and the reference's one row, not the global input (64 processes each holding the
    global input and the all_gather's tiled reference made 256 MiB a process)."""
    return np.random.default_rng([seed, j]).standard_normal(elems).astype(np.float32)


def program(name: str):
    """(jitted function, input array, numpy reference of every device's output row)."""
    op, size = name.split("_")
    elems = {"4k": 1024, "64k": 16384, "1m": 262144, "16m": 4194304}[size]
    seed = sum(map(ord, name))
    if op == "psum":
        body, spec_out = (lambda v: lib.psum(v, "x")), P("x")
        ref = np.zeros(elems, np.float32)
        for j in range(N):
            ref += row(elems, seed, j)
    elif op == "ag":
        body = lambda v: lib.all_gather(v, "x", axis=1, tiled=True)  # noqa: E731
        ref = np.concatenate([row(elems, seed, j) for j in range(N)])
        spec_out = P("x")
    else:
        raise ValueError(name)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=spec_out))
    arr = jax.make_array_from_callback(
        (N, elems),
        NamedSharding(mesh, P("x")),
        lambda i: row(elems, seed, i[0].start or 0)[None],
    )
    return f, arr, ref


def counters() -> dict:
    """strata's per-process counters the scaling model is checked against (docs/scaling.md)."""
    if MODE != "strata":
        return {}
    ms, cs = sj.memory_stats(), sj.comm_stats()
    return {
        "peer_bytes": ms["zero_copy_bytes"] + ms["peer_bounce_bytes"],
        "calls": cs["calls"],
        "one_shot": cs["one_shot_all_reduce"],
        "two_shot": cs["two_shot_all_reduce"],
        "low_latency": cs["low_latency_calls"] + cs["direct_calls"],
        "steps": cs["rendezvous_steps"],
    }


results = {}
per_call = {}
for name in CALLS:
    f, arr, ref = program(name)
    k0 = counters()
    c0, w0 = cpu(), time.perf_counter()
    out = f(arr)
    out.block_until_ready()
    t[f"first_{name}_cpu"], t[f"first_{name}_wall"] = cpu() - c0, time.perf_counter() - w0
    for s in out.addressable_shards:
        got = np.asarray(s.data)
        if not np.allclose(got, ref[None], rtol=1e-4, atol=1e-4):
            print(f"MISMATCH {name} on device {s.device.id}", flush=True)
            sys.exit(3)
    for _ in range(3):
        f(arr).block_until_ready()
    results[name] = "ok"
    k1 = counters()
    # 4 calls of this program (the first and 3 more): each counter's change per call
    per_call[name] = {k: (k1[k] - k0[k]) / 4 for k in k1}

rec = {"mode": MODE, "n": N, "rank": jax.process_index(), "times": t, "calls": results}
rec["per_call"] = per_call
rec["memory"] = proc_memory()
if MODE == "strata":
    rec["memory_stats"] = {
        k: v for k, v in sj.memory_stats().items() if isinstance(v, (int, float, str))
    }
os.makedirs(OUT, exist_ok=True)
with open(os.path.join(OUT, f"rank-{jax.process_index()}.json"), "w") as fh:
    json.dump(rec, fh)
