"""Every rank of the last simulated host SIGKILLs itself mid-run while all ranks loop on a psum
across hosts (``launch --hosts 2 [--netns]``): the survivors must fail fast (strata's timeout
is 20 s here) and the launcher must name the dead ranks. Prints ``step 2 ok`` first."""

import os
import sys

import strata_jax as sj

sj.init()

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mp_checks import psum_until_killed  # noqa: E402  (tests/mp_checks.py)

sj.set_timeout(20)
# Leftovers a host's processes make: a /dev/shm segment and a file in the run dir, both inside
# the simulated host's private tmpfs, gone with it.
for d in ("/dev/shm", os.environ["STRATA_RUN_DIR"]):
    with open(os.path.join(d, f"strata-test-{os.getpid()}"), "wb") as fh:
        fh.write(b"x" * 4096)
topo = sj.topology()
psum_until_killed(1024, 100_000, killed=topo["fabric"] == len(topo["fabrics"]) - 1)
