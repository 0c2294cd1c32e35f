"""Rank 3 (the other fabric of ranks 0-1 under ``--hosts 2``) is SIGKILLed mid-run while every
rank loops on a psum across fabrics: the launcher must name it and exit non-zero."""

import os
import sys

import strata_jax as sj

sj.init()

import jax  # noqa: E402  (after init: it configures the backend)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mp_checks import psum_until_killed  # noqa: E402  (tests/mp_checks.py)

sj.set_timeout(20)
psum_until_killed(8, 1000, killed=jax.process_index() == 3)
