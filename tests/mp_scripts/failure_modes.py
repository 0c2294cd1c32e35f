"""How a failed multi-process job ends: a killed rank, a rank that exits after catching a
timeout, and the same without the launcher.

Usage: ``failure_modes.py MODE OUT_DIR``, under the launcher or started by hand (then argv
continues with ``COORDINATOR NUM_PROCESSES PROCESS_ID`` and the script calls
``jax.distributed.initialize`` itself before ``strata_jax.init()``, as under mpirun/srun).

- ``kill``: every rank loops psum; at step 20 the rank given by $KILL_RANK (default 2) writes
  the time to OUT_DIR/killed and SIGKILLs itself. Survivors must be gone within ~2 s.
- ``none``: the same loop, nobody dies (a rerun right after ``kill`` must pass).
- ``exit``: rank 1 sleeps 120 s at step 5; rank 0 times out there ($STRATA_TIMEOUT_S),
  catches the error, writes the time to OUT_DIR/caught and calls ``sys.exit(1)``.
- ``quit``: rank 1 calls ``sys.exit(0)`` at step 5 (a script bailing out mid-job); rank 0
  enters the psum there and must fail at once naming rank 1, writing the time it took to
  OUT_DIR/quit-caught (not wait out $STRATA_TIMEOUT_S while rank 1 sits in jax.distributed's
  shutdown barrier waiting for it).
Each rank writes its pid to OUT_DIR/pid-<rank>.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

mode, out = sys.argv[1], Path(sys.argv[2])
if len(sys.argv) > 3:  # no strata launcher: jax.distributed by hand, as under mpirun/srun
    import jax

    jax.config.update("jax_num_cpu_devices", 1)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=sys.argv[3], num_processes=int(sys.argv[4]), process_id=int(sys.argv[5])
    )

import strata_jax as sj  # noqa: E402

sj.init()

import jax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

rank = jax.process_index()
(out / f"pid-{rank}").write_text(str(os.getpid()))
devs = sorted(jax.devices(), key=lambda d: d.id)
mesh = Mesh(np.array(devs), ("x",))
f = jax.jit(jax.shard_map(lambda v: sj.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
x = jax.make_array_from_callback(
    (len(devs) * 1024,), NamedSharding(mesh, P("x")), lambda i: np.ones(1024, np.float32)
)
f(x).block_until_ready()
kill_rank = int(os.environ.get("KILL_RANK", "2"))
for step in range({"kill": 200, "none": 30, "exit": 10, "quit": 10}[mode]):
    if mode == "quit" and step == 5:
        if rank == 1:
            sys.exit(0)
        t0 = time.time()
        try:
            f(x).block_until_ready()
        except sj.COLLECTIVE_ERRORS as e:
            (out / "quit-caught").write_text(f"{time.time() - t0!r}")
            print("caught:", str(e)[:300], flush=True)
            sys.exit(1)
    if mode == "kill" and step == 20 and rank == kill_rank:
        (out / "killed").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "exit" and step == 5:
        if rank == 1:
            time.sleep(120)
        else:
            try:
                f(x).block_until_ready()
            except Exception as e:  # noqa: BLE001  (JaxRuntimeError or ValueError: README)
                (out / "caught").write_text(repr(time.time()))
                print("caught:", str(e)[:200], flush=True)
                sys.exit(1)
    y = f(x)
    if not np.all(np.asarray(y.addressable_shards[0].data) == len(devs)):
        print("WRONG", flush=True)
        sys.exit(5)
    time.sleep(0.01)
print("OK done", flush=True)
