"""Every collective over axes inside one fabric, across fabrics and over all devices, against
jax.lax over gloo on the same inputs; gradients of psum and all_gather; evidence that no
memory crosses a fabric.

Run under the launcher with simulated hosts: ``python -m strata_jax.launch -n 4 --hosts 2
check_scaleout.py [--private]``. Meshes: a flat axis over all devices (in process order and
interleaved, so a group's fabrics alternate), and a 2-D ("host", "local") mesh whose outer axis
crosses fabrics and inner axis stays inside one, reduced over "host", "local", both, and both
in the other order. Each (mesh, axes, dtype) compiles one function with every operator, once
with strata_jax and once with jax.lax, and compares each process's own shards. ``--private``:
also checks that this process runs in a private mount namespace (its /tmp has none of the
launcher's folders). ``--netns`` (under ``launch --netns``): also checks that this process runs
on its own simulated host: hostname ``host<h>``, no ``STRATA_FABRIC_ID``, its fabric found by
hostname, and gloo's TCP connections from its own veth address to every other host's, with at
least this process's inter-fabric bytes sent on ``eth0``. Prints ``OK scaleout <checks> checks``
at the end.
"""

from __future__ import annotations

import hashlib
import os
import sys

import numpy as np

import strata_jax as sj

info = sj.init()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from strata_jax._src.startup import _distributed_client  # noqa: E402

sj.set_timeout(60)
topo = sj.topology()
pid = jax.process_index()
devs = sorted(jax.devices(), key=lambda d: d.id)
N = len(devs)
H = len(topo["fabrics"])
checks = 0


def fail(msg: str) -> None:
    print(f"FAIL process {pid}: {msg}", flush=True)
    sys.exit(1)


def ops(lib, axes, n: int, floating: bool, mesh_shape: dict):
    """Every operator of ``lib`` (strata_jax or jax.lax) over ``axes``; per-device v: [N, 6]."""
    ring = [(i, (i + 1) % n) for i in range(n)]
    some = [(n - 1, 0), (0, n // 2)] if n > 2 else [(0, n - 1)]
    paxes = axes
    if lib is jax.lax and isinstance(axes, tuple):
        # jax.lax 0.10.2 permutes wrongly over axes named in another order than the mesh's
        # (0.11.1 refuses that order; strata matches numpy's permutation there): the oracle
        # runs over the mesh's order, with the pairs renumbered to it.
        paxes = tuple(a for a in mesh_shape if a in axes)
        dims = [mesh_shape[a] for a in axes]

        def renumber(i: int) -> int:
            at = dict(zip(axes, np.unravel_index(i, dims), strict=True))
            return int(np.ravel_multi_index([at[a] for a in paxes], [mesh_shape[a] for a in paxes]))

        ring = [(renumber(a), renumber(b)) for a, b in ring]
        some = [(renumber(a), renumber(b)) for a, b in some]

    def bcast(v, src):
        if lib is sj:
            return sj.pbroadcast(v, axes, src)
        # jax.lax.pbroadcast has no CPU lowering; its documented equivalent.
        return jax.lax.psum(jnp.where(jax.lax.axis_index(axes) == src, v, jnp.zeros_like(v)), axes)

    def body(v):
        outs = {
            "psum": lib.psum(v, axes),
            "psum_odd": lib.psum(v[:3, :5], axes),  # 15 elements: padded inside a fabric
            "pmax": lib.pmax(v, axes),
            "pmin": lib.pmin(v, axes),
            "all_gather": lib.all_gather(v, axes),
            "all_gather_tiled_1": lib.all_gather(v, axes, axis=1, tiled=True),
            "psum_scatter": lib.psum_scatter(v, axes, tiled=True),
            "all_to_all": lib.all_to_all(v, axes, 0, 1, tiled=True),
            "ppermute_ring": lib.ppermute(v, paxes, ring),
            "ppermute_some": lib.ppermute(v, paxes, some),
            "pbroadcast": bcast(v, n - 1),
        }
        if floating:
            outs["pmean"] = lib.pmean(v, axes)
            w = jnp.arange(v.size * n, dtype=v.dtype).reshape(n * v.shape[0], v.shape[1])
            outs["grad_psum"] = jax.grad(lambda u: (lib.psum(u, axes) ** 2).sum())(v)
            outs["grad_all_gather"] = jax.grad(
                lambda u: (lib.all_gather(u, axes, tiled=True) * w).sum()
            )(v)
            # The transposes: all_gather <-> psum_scatter, all_to_all and ppermute reversed.
            ws = w[: v.shape[0] // n]
            outs["grad_psum_scatter"] = jax.grad(
                lambda u: (lib.psum_scatter(u, axes, tiled=True) * ws).sum()
            )(v)
            outs["grad_all_to_all"] = jax.grad(
                lambda u: (lib.all_to_all(u, axes, 0, 1, tiled=True) ** 2).sum()
            )(v)
            outs["grad_ppermute"] = jax.grad(
                lambda u: (lib.ppermute(u, paxes, ring) * u[::-1]).sum()
            )(v)
        return {k: o[None] for k, o in outs.items()}

    return body


def compare(mesh: Mesh, axes, dtype) -> None:
    global checks
    names = tuple(mesh.axis_names)
    n = int(np.prod([mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,))]))
    rng = np.random.default_rng(1234)
    shape = (mesh.size * mesh.size, 6)  # N rows per device: divisible by any group size
    if jnp.issubdtype(dtype, jnp.floating):
        x = rng.standard_normal(shape).astype(np.float32).astype(dtype)
    else:
        x = rng.integers(-50, 50, size=shape).astype(dtype)
    spec = P(names)
    arr = jax.make_array_from_callback(shape, NamedSharding(mesh, spec), lambda i: x[i])
    floating = bool(jnp.issubdtype(dtype, jnp.floating))
    res = {}
    for lib in (sj, jax.lax):
        f = jax.jit(
            jax.shard_map(
                ops(lib, axes, n, floating, dict(mesh.shape)),
                mesh=mesh,
                in_specs=spec,
                out_specs=spec,
            )
        )
        res[lib] = f(arr)
    tol = {"bfloat16": 3e-2, "float32": 1e-5}.get(jnp.dtype(dtype).name, 0)
    for k in res[sj]:
        a_shards = sorted(res[sj][k].addressable_shards, key=lambda s: s.device.id)
        b_shards = sorted(res[jax.lax][k].addressable_shards, key=lambda s: s.device.id)
        for sa, sb in zip(a_shards, b_shards, strict=True):
            a = np.asarray(sa.data).astype(np.float64)
            b = np.asarray(sb.data).astype(np.float64)
            if a.shape != b.shape or not np.allclose(a, b, rtol=tol, atol=tol * 4):
                fail(
                    f"{k} over {axes} on mesh {dict(mesh.shape)} {jnp.dtype(dtype).name}: "
                    f"max diff {np.max(np.abs(a - b)) if a.shape == b.shape else a.shape}"
                )
            checks += 1


flat = Mesh(np.array(devs), ("x",))
inter = Mesh(np.array(devs[0::2] + devs[1::2]), ("x",))  # fabrics alternate along the axis
grid = Mesh(np.array(devs).reshape(H, N // H), ("host", "local"))
# Each dtype class crosses fabrics at least once; few programs keep the run short.
cases = [
    (flat, "x", (np.float32, jnp.bfloat16)),
    (inter, "x", (np.int32,)),
    (grid, "host", (np.float32,)),
    (grid, "local", (np.int32,)),
    (grid, ("local", "host"), (np.float32,)),
]
before = sj.comm_stats()
for mesh, axes, dtypes in cases:
    for dt in dtypes:
        compare(mesh, axes, dt)


def compare_large(n: int) -> None:
    """psum/pmax/pmin of n float32 per device over the flat axis: with two fabrics the
    partner's shard is combined inside strata's all_gather_reduce (hierarchy/; pushed for a
    shard over 512 KiB, pulled below). Same values as jax.lax; with +0/-0 ties and NaNs every
    rank holds the same bits (fabric slot 0's shard first on both sides)."""
    global checks
    L = N // H
    fused = H == 2 and L > 1
    rng = np.random.default_rng(77)
    x = rng.standard_normal(n * N).astype(np.float32)
    x[::7] = 0.0
    x[3::7] = -0.0
    arr = jax.make_array_from_callback(x.shape, NamedSharding(flat, P("x")), lambda i: x[i])
    y = x.copy()
    y[5::1001] = np.nan
    arr_nan = jax.make_array_from_callback(y.shape, NamedSharding(flat, P("x")), lambda i: y[i])
    for op in ("psum", "pmax", "pmin"):
        fs, fl = (
            jax.jit(
                jax.shard_map(
                    lambda v, f=f: f(v, "x"), mesh=flat, in_specs=P("x"), out_specs=P("x")
                )
            )
            for f in (getattr(sj, op), getattr(jax.lax, op))
        )
        a = np.asarray(fs(arr).addressable_shards[0].data)
        b = np.asarray(fl(arr).addressable_shards[0].data)
        if not np.allclose(a, b, rtol=1e-5, atol=1e-5):
            fail(f"{op} of {n}: max diff {np.max(np.abs(a - b))}")
        checks += 1
        if "strata_all_gather_reduce" not in fs.lower(arr).as_text():
            if fused:
                fail(f"{op} of {n}: the fused all_gather_reduce was not used")
            continue
        got = np.asarray(fs(arr_nan).addressable_shards[0].data)
        want = getattr(np, {"psum": "sum", "pmax": "max", "pmin": "min"}[op])(
            y.reshape(N, n), axis=0
        )
        if not np.allclose(got, want, rtol=1e-5, atol=1e-5, equal_nan=True):
            fail(f"{op} of {n} with NaN: differs from numpy (NaN propagates)")
        digest = hashlib.sha256(got.tobytes()).hexdigest()
        client.key_value_set(f"scaleout/large/{n}/{op}/{pid}", digest)
        for j in range(jax.process_count()):
            other = client.blocking_key_value_get(f"scaleout/large/{n}/{op}/{j}", 60000)
            if other != digest:
                fail(f"{op} of {n}: process {j} holds other bits than process {pid}")
        checks += 2


client = _distributed_client()
compare_large(600_001)  # odd: padded inside the fabric; push form (2 devices per fabric)
compare_large(100_001)  # packed pairs of 400 KB: the general path, pairs staged
compare_large(1_001)  # packed pairs of 4 KB: the low-latency path
after = sj.comm_stats()

# ---- nothing crosses a fabric through shared memory ----
client.key_value_set(f"scaleout/os_pid/{pid}", str(os.getpid()))
os_pids = [
    int(client.blocking_key_value_get(f"scaleout/os_pid/{j}", 60000))
    for j in range(jax.process_count())
]
mine = topo["fabrics"][topo["fabric"]]
ms = sj.memory_stats()
if ms["fabric_id"] != mine["id"]:
    fail(f"memory_stats fabric {ms['fabric_id']} != topology {mine['id']}")
mapped = 0
for peer in ms["fabric_peers"]:
    if peer["process"] not in mine["processes"] or peer["fabric_id"] != mine["id"]:
        fail(f"a peer of another fabric is connected: {peer}")
    if peer["process"] != pid and peer["os_pid"] != os_pids[peer["process"]]:
        fail(f"link of process {peer['process']} ends at pid {peer['os_pid']}, not its own")
    mapped += peer["segments_mapped"]
if ms["peer_segments_mapped"] != mapped:
    fail(f"{ms['peer_segments_mapped']} peer segments mapped, {mapped} from own-fabric peers")
if len(mine["processes"]) > 1 and (mapped == 0 or after["intra_fabric_bytes"] == 0):
    fail("no strata traffic inside the fabric")
if after["inter_fabric_bytes"] <= before["inter_fabric_bytes"]:
    fail("no inter-fabric bytes counted")
if "--private" in sys.argv:
    leaked = [e for e in os.listdir("/tmp") if e.startswith("strata-run-")]
    if leaked or not os.path.isdir("/tmp/strata-host"):
        fail(f"/tmp is not private to this host: {sorted(os.listdir('/tmp'))}")
    checks += 1
if "--netns" in sys.argv:
    import socket

    host = socket.gethostname()
    if host != f"host{topo['fabric']}" or os.environ.get("STRATA_FABRIC_ID"):
        fail(f"hostname {host}, STRATA_FABRIC_ID {os.environ.get('STRATA_FABRIC_ID')!r}")
    if not mine["id"].startswith(host + "/"):
        fail(f"fabric id {mine['id']} is not this host's name and boot id")
    own = socket.gethostbyname(host)
    others = {socket.gethostbyname(f"host{h}") for h in range(H)} - {own}

    def ip_of(hex_addr: str) -> str:
        return socket.inet_ntoa(bytes.fromhex(hex_addr.split(":")[0])[::-1])

    peers: set[str] = set()
    with open("/proc/net/tcp") as f:  # this network namespace's IPv4 sockets
        for line in list(f)[1:]:
            local, remote, state = line.split()[1:4]
            if state == "01" and ip_of(local) == own:  # ESTABLISHED, from our veth address
                peers.add(ip_of(remote))
    if not others <= peers:
        fail(f"no TCP connection from {own} to {sorted(others - peers)}: {sorted(peers)}")
    with open("/proc/net/dev") as f:  # this network namespace's links
        tx = next(int(ln.split(":")[1].split()[8]) for ln in f if ln.strip().startswith("eth0:"))
    if tx < after["inter_fabric_bytes"]:
        fail(f"eth0 sent {tx} B, less than this process's {after['inter_fabric_bytes']} B")
    print(f"netns {host} {own} -> {sorted(peers)} eth0 tx {tx} B", flush=True)
    checks += 1
print(
    f"topology fabric {topo['fabric']}/{H} peers {[p['process'] for p in ms['fabric_peers']]} "
    f"intra {after['intra_fabric_bytes']} B inter {after['inter_fabric_bytes']} B",
    flush=True,
)
print(f"OK scaleout {checks} checks", flush=True)
