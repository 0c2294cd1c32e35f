"""strata_jax with XLA's MPI collectives as JAX's engine, under mpirun.

Run as ``mpirun -n P -x MPITRAMPOLINE_LIB -x JAX_CPU_COLLECTIVES_IMPLEMENTATION=mpi python
mpi_engine.py [HOSTS]``. With HOSTS > 1 each rank sets ``STRATA_FABRIC_ID=host<rank*HOSTS//P>``
before ``strata_jax.init()``, so the job plays HOSTS hosts and strata's hierarchical collectives
hand their inter-fabric step to XLA's collectives, i.e. to MPI. Every op, strata's and jax.lax's
over MPI, is checked against numpy on fresh random inputs (XLA-computed inputs, as gradients
are). Prints ``RESULT <json>``; exit code 0 only if every check passed and the process ends
cleanly (no "MPI_Comm_free() after MPI_FINALIZE" abort).

``--hand``: the script starts ``jax.distributed`` itself (``jax.distributed.initialize()``)
before ``strata_jax.init()``, which must still turn async dispatch off for XLA's MPI
collectives.

``--netns`` (under ``python -m strata_jax.launch --netns --engine mpi``): the hosts are found by
hostname (no STRATA_FABRIC_ID), and the result also gives this host's name, this rank's MPI
rank and the bytes this host's ``eth0`` (its one link) sent while the collectives ran.
"""

import os
import sys

netns = "--netns" in sys.argv
hand = "--hand" in sys.argv
args = [a for a in sys.argv[1:] if a not in ("--netns", "--hand")]
hosts = int(args[0]) if args else 1
rank, size = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
if hosts > 1:
    os.environ["STRATA_FABRIC_ID"] = f"host{rank * hosts // size}"

import strata_jax  # noqa: E402

if hand:
    import jax  # noqa: E402

    jax.distributed.initialize()  # finds Open MPI's ranks itself
info = strata_jax.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mp_checks import report  # noqa: E402  (tests/mp_checks.py)

from strata_jax._src import mpi_engine  # noqa: E402

n, me = jax.process_count(), jax.process_index()
mesh = Mesh(np.array(jax.devices()), ("x",))
copy = jax.jit(lambda a: a * 1)
failures = []


def run(lib, name, body, make, expect):
    f = jax.jit(jax.shard_map(body(lib), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    inputs = [make(np.random.default_rng([7, p, len(failures)])) for p in range(n)]
    x = copy(jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), inputs[me]))
    got = np.asarray(f(x).addressable_shards[0].data)
    want = expect(inputs)
    if not np.allclose(got, want, rtol=1e-5, atol=1e-5):
        failures.append(f"{name} over {lib.__name__}")


def eth0_tx() -> int:
    """Bytes this network namespace's eth0 (a simulated host's link) has sent."""
    with open("/proc/net/dev") as f:
        return next(int(ln.split(":")[1].split()[8]) for ln in f if ln.strip().startswith("eth0:"))


tx_before = eth0_tx() if netns else 0
count = 64 * 1024 * n  # 256 KiB * n of float32 per rank: above the allocator's threshold
rnd = lambda r: r.standard_normal(count).astype(np.float32)  # noqa: E731
small = lambda r: r.standard_normal(256).astype(np.float32)  # noqa: E731
for lib in (jax.lax, strata_jax):
    run(lib, "psum", lambda L: lambda x: L.psum(x, "x"), rnd, lambda xs: np.sum(xs, axis=0))
    run(lib, "psum 1K", lambda L: lambda x: L.psum(x, "x"), small, lambda xs: np.sum(xs, axis=0))
    run(lib, "pmax", lambda L: lambda x: L.pmax(x, "x"), rnd, lambda xs: np.max(xs, axis=0))
    run(
        lib,
        "all_gather",
        lambda L: lambda x: L.all_gather(x, "x", tiled=True),
        rnd,
        lambda xs: np.concatenate(xs),
    )
    run(
        lib,
        "psum_scatter",
        lambda L: lambda x: L.psum_scatter(x, "x", tiled=True),
        rnd,
        lambda xs: np.split(np.sum(xs, axis=0), n)[me],
    )
    run(
        lib,
        "all_to_all",
        lambda L: lambda x: L.all_to_all(x, "x", 0, 0, tiled=True),
        rnd,
        lambda xs: np.concatenate([np.split(x, n)[me] for x in xs]),
    )
    run(
        lib,
        "ppermute",
        lambda L: lambda x: L.ppermute(x, "x", [(i, (i + 1) % n) for i in range(n)]),
        rnd,
        lambda xs: xs[(me - 1) % n],
    )
tx_after = eth0_tx() if netns else 0
ms = strata_jax.memory_stats()
out = {
    "mpi_rank": rank,
    "hostname": __import__("socket").gethostname(),
    "fabric_id_env": os.environ.get("STRATA_FABRIC_ID"),
    "eth0_tx_bytes": tx_after - tx_before,
    "count_bytes": count * 4,
    "process": me,
    "failures": failures,
    "engine": jax.config.jax_cpu_collectives_implementation,
    "async_dispatch": mpi_engine.async_dispatch(),
    "finalize": mpi_engine.state["finalize"],
    "num_fabrics": info.get("num_fabrics"),
    "inter_fabric_bytes": ms["inter_fabric_bytes"],
    "zero_copy_bytes": ms["zero_copy_bytes"],
    "staged_bytes": ms["staged_bytes"],
}
report(out, not failures)
