"""Rank 1 exits with code 3, the others sleep (no jax): a failed rank under any launcher."""

import os
import sys
import time

if os.environ.get("STRATA_PROCESS_ID") == "1":
    print("exiting with 3", flush=True)
    sys.exit(3)
print("sleeping", flush=True)
time.sleep(120)
