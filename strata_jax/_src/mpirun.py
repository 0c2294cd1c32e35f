"""``launch --engine mpi``: the ranks started as one MPI job by Open MPI's ``mpirun``, so XLA's
MPI collectives are JAX's engine between them. Standard library only.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence

from strata_jax._src.launch_env import ENV_ENGINE, ENV_TRAMPOLINE
from strata_jax._src.namespaces import Network, dies_with_launcher


def mpi_unavailable_reason(environ: Mapping[str, str] | None = None) -> str | None:
    """Why ``--engine mpi`` cannot run here, or None when it can.

    It needs Open MPI's ``mpirun`` on PATH (Debian/Ubuntu: ``openmpi-bin``) and
    ``MPITRAMPOLINE_LIB`` (in ``environ``, default ``os.environ``) naming an existing
    ``libmpiwrapper.so``: jaxlib loads MPI through MPItrampoline, which needs MPIwrapper built
    from its source against that MPI (docs/guide/hosts.md, XLA over MPI).
    """
    env = os.environ if environ is None else environ
    missing = []
    if shutil.which("mpirun") is None:
        missing.append("Open MPI's mpirun on PATH (package openmpi-bin)")
    lib = env.get(ENV_TRAMPOLINE, "")
    if not lib:
        missing.append(
            f"{ENV_TRAMPOLINE} naming a libmpiwrapper.so built from MPIwrapper against this "
            "machine's MPI (it is not set)"
        )
    elif not os.path.isfile(lib):
        missing.append(f"{ENV_TRAMPOLINE} naming a libmpiwrapper.so ({lib!r} is no file)")
    if not missing:
        return None
    return "--engine mpi (XLA's MPI collectives) needs " + " and ".join(missing)


def mpi_job(
    ranks: Sequence[tuple[list[str], dict[str, str]]],
    base: Mapping[str, str],
    per_host: int,
    network: Network | None,
    session_dir: str,
) -> tuple[list[str], dict[str, str]]:
    """The mpirun command line and environment that start ``ranks`` (each its argv and the
    environment :func:`launch_env.rank_env` made for it) as one MPI job, rank r as app context r.

    mpirun hands its children its own environment, so the variables that differ per rank (the
    STRATA_* ones, ``LD_PRELOAD``) go on each app context's command line through ``env``. With
    ``network``, mpirun runs in the switch's network namespace, which gets an address on the
    bridge (``Network.add_head``); each rank enters its host's namespaces (``Namespace.wrap``,
    so it also dies with mpirun); PMIx listens on the bridge's subnet (PMIx 4 accepts only
    loopback clients otherwise: the ranks' ``MPI_Init`` failed, "OPAL ERROR: Unreachable") and
    keeps its data in its hash store (its shared-memory one is in mpirun's session directory,
    which a host's private /tmp hides), and
    Open MPI moves MPI's bytes with its TCP transport on ``eth0``, over the shaped links (its
    shared-memory transports would find the other host's /dev/shm missing). Open MPI's session
    directory goes under ``session_dir`` (``/tmp`` of the head's private mounts with
    ``network``, else a folder the launcher removes).
    """
    mpirun = shutil.which("mpirun") or "mpirun"
    envcmd = shutil.which("env") or "env"
    job_env = dict(base)
    job_env[ENV_ENGINE] = "mpi"
    job_env["TMPDIR"] = session_dir  # mpirun's session directory
    head = [mpirun, "--oversubscribe", "--bind-to", "none", "--tag-output"]
    if os.geteuid() == 0:
        head.append("--allow-run-as-root")
    if network is not None:
        network.add_head()
        subnet = f"{network.SUBNET}.0/{network.PREFIX}"
        job_env["PMIX_MCA_ptl_tcp_remote_connections"] = "1"
        job_env["PMIX_MCA_ptl_tcp_if_include"] = subnet
        job_env["OMPI_MCA_oob_tcp_if_include"] = subnet
        # PMIx's shared-memory data store lives in mpirun's session directory, which the
        # hosts' private /tmp hides ("PMIX ERROR: ... gds_ds12_lock_pthread.c"): its hash store.
        job_env["PMIX_MCA_gds"] = "hash"
        head += ["--mca", "pml", "ob1", "--mca", "btl", "tcp,self"]
        head += ["--mca", "btl_tcp_if_include", "eth0"]
    argv = list(head)
    for r, (cmd, env_r) in enumerate(ranks):
        own = [f"{k}={v}" for k, v in env_r.items() if job_env.get(k) != v]
        # Each rank's temporary files in its own TMPDIR (its host's /tmp with --netns), not in
        # mpirun's session directory.
        own += [f"TMPDIR={base['TMPDIR']}"] if "TMPDIR" in base else []
        unset = ["-u", "TMPDIR"] if "TMPDIR" not in base else []
        cmd_r = [envcmd, *unset, *own, *cmd]
        if network is not None:
            cmd_r = network.namespaces[r // per_host].wrap(cmd_r)
        else:
            cmd_r = dies_with_launcher(cmd_r)
        argv += ([":"] if r else []) + ["-n", "1", *cmd_r]
    if network is not None:
        argv = network.in_switch(argv)
    return dies_with_launcher(argv), job_env
