"""Prints ``ready <hostname>`` and sleeps (no jax): a rank for tests of how a job is stopped."""

import socket
import time

print("ready", socket.gethostname(), flush=True)
time.sleep(120)
