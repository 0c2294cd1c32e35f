"""Start N strata_jax processes on this host: ``python -m strata_jax.launch -n 4 script.py [args]``.

Each rank runs ``sys.executable script.py args`` with the environment of ``_src/launch_env.py``,
in its own process group, with every line it prints prefixed by ``[rank i] ``. If one rank
fails (non-zero exit or killed by a signal) the others are stopped (SIGTERM, then SIGKILL after
``--fail-grace``, 1 s) and the launcher exits non-zero naming the failed rank. The failure grace
is short because the job is lost anyway and a JAX rank ignores SIGTERM: jax.distributed's
preemption notifier catches it (measured: a rank looping psum lived on until the SIGKILL,
5.0-5.3 s with a 5 s grace). SIGINT/SIGTERM sent to the launcher are forwarded to the ranks,
SIGKILL following after ``--grace`` (5 s); ``--timeout`` stops everything after a number of
seconds.

``--hosts H`` simulates H hosts on this machine: shared memory stays inside each; with
``--private-mounts`` each has its own /tmp and /dev/shm; with ``--netns [--link-gbit G]`` each
also has its own network and hostname, joined to the others by veth links (shaped to G Gbit/s)
to a bridge, all in namespaces this launcher makes and frees.

JAX's engine between the ranks (what runs ``jax.lax`` collectives and the ones XLA's partitioner
inserts into ``jax.jit`` programs) is strata's by default: XLA's MPI collectives over
``libstrata_mpi.so``, which runs them on strata's shared-memory fabric (``_src/engine.py``;
``STRATA_ENGINE`` in each rank says which). ``--engine gloo`` keeps JAX's gloo.
``--engine mpi`` makes XLA's MPI collectives over a real MPI the engine: Open MPI's ``mpirun``
starts the ranks as one MPI job (rank r = app context r; with ``--netns`` mpirun runs in the
switch's namespace and MPI crosses the links), the launcher watches mpirun, relabels its
tagged output per rank and cleans up as above.

The environment each rank gets, and the readers of it, are the launcher's contract with the
library: ``_src/launch_env.py``. Simulated hosts live in ``_src/namespaces.py``, the ``mpirun``
job of ``--engine mpi`` in ``_src/mpirun.py``; this module starts, watches and stops the ranks
and holds the command line.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO

from strata_jax._src.launch_env import (
    ALLOC_LIBRARY_NAME,
    ENV_ALLOC_LIB,
    ENV_FABRIC_ID,
    alloc_library_path,
    cluster_env,
    distributed_env,
    joined_ranks,
    listening,
    rank_env,
)
from strata_jax._src.mpirun import mpi_job, mpi_unavailable_reason
from strata_jax._src.namespaces import (
    Namespace,
    Network,
    dies_with_launcher,
    netns_unavailable_reason,
)

__all__ = [
    "ALLOC_LIBRARY_NAME",
    "alloc_library_path",
    "cluster_env",
    "distributed_env",
    "launch",
    "main",
    "mpi_unavailable_reason",
    "netns_unavailable_reason",
]

ENV_STRATA_ENGINE = "STRATA_ENGINE"  # what strata_jax.init() in each rank runs
ENGINES = ("strata", "gloo", "mpi")

_POLL_S = 0.02


# ---------------------------------------------------------------------------------------------
# Launching
# ---------------------------------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (the coordinator binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# level to turn it off): noise in every multi-process run, so the prefixer drops it.
_NOISE = (b"[Gloo] Rank ",)


def _is_noise(line: bytes) -> bool:
    return line.startswith(_NOISE) and b" is connected to " in line


# mpirun --tag-output: "[1,3]<stdout>:text" is a piece of rank 3's output. mpirun tags each
# piece it reads from a rank (a rank writing "ready", " ", "host0\n" separately, as an
# unbuffered print does, gives three tagged pieces), and pieces of several ranks can share a line.
_MPI_TAG = re.compile(rb"\[\d+,(\d+)\]<std(?:out|err|diag)>:")


def _mpi_lines(line: bytes, partial: dict[bytes, bytes]) -> list[tuple[bytes | None, bytes]]:
    """Splits a line of mpirun's --tag-output into (rank, text) of the lines it completes:
    pieces are gathered per rank in ``partial`` until one ends with a newline; text outside any
    tag is mpirun's own (rank None)."""
    out: list[tuple[bytes | None, bytes]] = []
    tags = list(_MPI_TAG.finditer(line))
    if not tags or tags[0].start() > 0:
        own = line[: tags[0].start()] if tags else line
        if own.strip():
            out.append((None, own))
    for i, m in enumerate(tags):
        piece = line[m.end() : tags[i + 1].start() if i + 1 < len(tags) else len(line)]
        rank = m.group(1)
        text = partial.pop(rank, b"") + piece
        if text.endswith(b"\n"):
            out.append((rank, text))
        else:
            partial[rank] = text
    return out


def _pump(
    src: BinaryIO,
    dst: BinaryIO,
    prefix: bytes,
    lock: threading.Lock,
    relabel: bool = False,
    seen: Callable[[bytes], None] | None = None,
) -> None:
    """Copies src to dst line by line, each line prefixed; a final partial line gets a newline.
    gloo's "Rank N is connected to M peer ranks" lines are dropped. With ``relabel`` (mpirun's
    --tag-output) each rank's lines are put back together and get ``[rank R] ``; mpirun's own
    lines get ``prefix``. ``seen`` gets every line copied (the rank's error, _Rank.see)."""
    partial: dict[bytes, bytes] = {}
    try:
        for raw in iter(src.readline, b""):
            lines = _mpi_lines(raw, partial) if relabel else [(None, raw)]
            for rank, line in lines:
                if _is_noise(line):
                    continue
                if not line.endswith(b"\n"):
                    line += b"\n"
                head = prefix if rank is None else b"[rank " + rank + b"] "
                if seen is not None:
                    seen(line)
                with lock:
                    dst.write(head + line)
                    dst.flush()
        with lock:  # what ranks left without a newline
            for rank, text in sorted(partial.items()):
                dst.write(b"[rank " + rank + b"] " + text + b"\n")
            dst.flush()
    except (OSError, ValueError):
        pass  # our own output went away (closed pipe): keep draining is pointless
    finally:
        src.close()


def _describe(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with code {returncode}"


@dataclass
class _Rank:
    index: int
    proc: subprocess.Popen
    pumps: list[threading.Thread] = field(default_factory=list)
    host: str | None = None  # the simulated host, where there are several
    label: str | None = None  # what the process is, where it is not one rank ("mpirun")
    # The last line of the first Python traceback the rank printed, and when (monotonic s).
    error: tuple[float, str] | None = None
    _in_traceback: bool = False

    def see(self, line: bytes) -> None:
        """Reads the rank's stderr for its first uncaught exception ("ValueError: ...")."""
        text = line.decode(errors="replace").rstrip()
        if text.startswith("Traceback (most recent call last):"):
            self._in_traceback = True
        elif self._in_traceback and text and not text[0].isspace():
            self._in_traceback = False
            if self.error is None:
                self.error = (time.monotonic(), text)

    def ended(self, code: int) -> str:
        """'rank 3 was killed by SIGKILL on host1' (the host where there are several)."""
        if self.label:
            return f"{self.label} {_describe(code)}"
        return f"rank {self.index} {_describe(code)}" + (f" on {self.host}" if self.host else "")

    def signal_group(self, sig: int) -> None:
        """Sends sig to the rank's whole process group (it and anything it started)."""
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class _Launch:
    """One run of N ranks: start, watch, stop, clean up."""

    def __init__(self, grace: float, err: BinaryIO, fail_grace: float = 1.0) -> None:
        self.ranks: list[_Rank] = []
        self.grace = grace
        self.fail_grace = fail_grace
        self.err = err
        self.lock = threading.Lock()
        self.signalled: int | None = None  # a signal the launcher received and forwarded
        # The coordinator's address where the launcher can see it listen (not with --netns):
        # a rank that started jax.distributed, with or without strata_jax.init().
        self.coordinator: str | None = None
        self.coordinator_seen = False

    def message(self, text: str) -> None:
        with self.lock:
            self.err.write(f"strata-launch: {text}\n".encode())
            self.err.flush()

    def start(
        self,
        argv: Sequence[str],
        env: dict[str, str],
        rank: int,
        out: BinaryIO,
        host: str | None = None,
        label: str | None = None,
    ) -> None:
        """Starts one process (a rank, or with ``label`` a process that starts the ranks itself:
        mpirun, whose tagged lines are relabelled with each rank's number)."""
        proc = subprocess.Popen(
            list(argv),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # our own forwarding is the only way signals reach a rank
        )
        r = _Rank(rank, proc, host=host, label=label)
        prefix = f"[{label}] ".encode() if label else f"[rank {rank}] ".encode()
        for src, dst in ((proc.stdout, out), (proc.stderr, self.err)):
            seen = r.see if src is proc.stderr and not label else None
            t = threading.Thread(
                target=_pump, args=(src, dst, prefix, self.lock, bool(label), seen), daemon=True
            )
            t.start()
            r.pumps.append(t)
        self.ranks.append(r)

    def forward(self, sig: int, _frame: object = None) -> None:
        """Signal handler: pass SIGINT/SIGTERM on; a second one kills at once."""
        sig = int(sig)
        if self.signalled is not None:
            self.kill_all(signal.SIGKILL)
            return
        self.signalled = sig
        self.kill_all(sig)

    def kill_all(self, sig: int) -> None:
        for r in self.ranks:
            if r.proc.poll() is None or sig == signal.SIGKILL:
                r.signal_group(sig)

    def stop_all(self, grace: float) -> None:
        """SIGTERM to every live rank, SIGKILL to those still alive after ``grace`` seconds."""
        self.kill_all(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(r.proc.poll() is None for r in self.ranks):
            time.sleep(_POLL_S)
        self.kill_all(signal.SIGKILL)
        for r in self.ranks:
            r.proc.wait()

    def watch(self, timeout: float | None) -> int:
        """Waits for the ranks; returns the launcher's exit code."""
        started = time.monotonic()
        signalled_at: float | None = None
        while True:
            if self.coordinator and not self.coordinator_seen:
                self.coordinator_seen = listening(self.coordinator)  # until seen once
            codes = [r.proc.poll() for r in self.ranks]
            failed = [(r, c) for r, c in zip(self.ranks, codes, strict=True) if c not in (None, 0)]
            if self.signalled is not None:
                signalled_at = signalled_at or time.monotonic()
                if all(c is not None for c in codes):
                    self.message(f"stopped by {signal.Signals(self.signalled).name}")
                    return 128 + self.signalled
                if time.monotonic() - signalled_at > self.grace:
                    self.kill_all(signal.SIGKILL)
            elif failed:
                rank, code = failed[0]
                if rank.label:  # mpirun: it stopped the ranks and named the failed one above
                    for t in rank.pumps:  # its last lines (that report) first
                        t.join(timeout=2.0)
                    self.message(f"{rank.ended(code)} (mpirun's own message above names the rank)")
                    return code if code > 0 else 128 - code
                self.message(f"{rank.ended(code)}; stopping the other ranks")
                # Ranks already gone before the stop (a whole simulated host killed at once):
                # whatever ended them, it was not the stop.
                gone = {r.index for r in self.ranks if r.proc.poll() is not None}
                self.stop_all(min(self.grace, self.fail_grace))
                # The rank seen first is not always the cause: a peer's collective fails at
                # once naming a dead rank, and may exit before the dead rank is reaped. Name
                # every rank that exited by itself with an error (signals are the stop's).
                for r in self.ranks:
                    c = r.proc.returncode
                    if r is not rank and c is not None and (c > 0 or c < 0 and r.index in gone):
                        self.message(f"{r.ended(c)} as well")
                self._say_first_error()
                return code if code > 0 else 128 - code
            elif all(c == 0 for c in codes):
                return 0
            elif timeout is not None and time.monotonic() - started > timeout:
                self.message(f"timed out after {timeout:g} s; stopping all ranks")
                self.stop_all(self.grace)
                return 124
            time.sleep(_POLL_S)

    def _say_first_error(self) -> None:
        """After a failure, the first uncaught exception any rank printed, which the traces of
        the ranks stopped after it (XLA's check failures, hundreds of lines) bury."""
        for r in self.ranks:  # the ranks are gone: their last lines are in the pipes
            for t in r.pumps:
                t.join(timeout=1.0)
        errors = sorted((r.error, r.index) for r in self.ranks if r.error is not None)
        if errors:
            (_, text), index = errors[0]
            cut = text if len(text) <= 600 else text[:600] + " ..."
            self.message(f"the first error a rank raised: rank {index}: {cut}")

    def finish(self) -> None:
        """Kills whatever is left (ranks' children included) and drains the output."""
        for r in self.ranks:
            if r.proc.poll() is None:
                r.signal_group(signal.SIGKILL)
                r.proc.wait()
            r.signal_group(signal.SIGKILL)  # stragglers a rank left behind in its group
        for r in self.ranks:
            for t in r.pumps:
                t.join(timeout=2.0)


def launch(
    nproc: int,
    argv: Sequence[str],
    *,
    devices_per_proc: int = 1,
    preload: bool = True,
    timeout: float | None = None,
    grace: float = 5.0,
    fail_grace: float = 1.0,
    env: Mapping[str, str] | None = None,
    stdout: BinaryIO | None = None,
    stderr: BinaryIO | None = None,
    hosts: int = 1,
    private_mounts: bool = False,
    netns: bool = False,
    link_gbit: float | None = None,
    engine: str | None = None,
) -> int:
    """Runs ``argv`` (a full command line) as ``nproc`` ranks on this host; returns the exit code.

    Args:
      nproc: number of processes (>= 1).
      argv: the command each rank runs, e.g. ``[sys.executable, "train.py", "--steps", "10"]``.
      devices_per_proc: CPU devices each process should create (``STRATA_LOCAL_DEVICES``).
      preload: put ``libstrata_alloc.so`` in ``LD_PRELOAD`` (a warning is printed if not found).
      timeout: seconds after which every rank is stopped (exit code 124); None for no limit.
      grace: seconds between SIGTERM and SIGKILL when stopping ranks on a signal or timeout.
      fail_grace: the same after a rank failed (at most ``grace``): short, since the job is
        lost and JAX ranks ignore SIGTERM (jax.distributed's preemption notifier catches it).
      env: base environment (default ``os.environ``).
      stdout, stderr: binary streams for the prefixed output (default: the launcher's own).
      hosts: simulate this many hosts (must divide ``nproc``): rank r belongs to host
        ``r // (nproc // hosts)``, gets ``STRATA_FABRIC_ID=host<h>`` and that host's own run dir,
        so shared memory stays inside each simulated host and everything between them goes
        through XLA's collectives (gloo). The planned topology is printed at start.
      private_mounts: run each simulated host in its own mount namespace with private tmpfs
        on /tmp and /dev/shm (``unshare --mount``; needs root): no path of one host is visible
        from another. Raises OSError when unshare is not permitted.
      netns: each simulated host in its own network, UTS and mount namespaces (its own
        hostname ``host<h>``, loopback, /etc/hosts, private /tmp and /dev/shm), joined by veth
        pairs to a bridge in a namespace of its own, host h at ``10.87.0.<h+1>``; the
        coordinator listens on host 0's address, fabrics are found by hostname (no
        ``STRATA_FABRIC_ID``) and gloo binds the address its hostname resolves to, the veth's.
        Everything is freed when the job ends, however it ends. Needs root, ``unshare``,
        ``nsenter``, ``ip`` (and ``tc`` with ``link_gbit``): OSError saying which is missing
        (:func:`netns_unavailable_reason`).
      link_gbit: with ``netns``, shape each host's link to this many Gbit/s in each direction
        (``tc`` tbf on both ends of its veth pair).
      engine: JAX's engine between processes: None (the default: ``STRATA_ENGINE`` as the
        caller's environment has it, else strata's) or ``"strata"``: XLA's collectives on
        strata's fabric through ``libstrata_mpi.so``; ``"gloo"``; both with the ranks started
        by the launcher (``STRATA_ENGINE`` set in each); or
        ``"mpi"``: XLA's MPI collectives, the ranks started as one MPI job by Open MPI's
        ``mpirun`` (one app context per rank, each in its simulated host's namespaces with
        ``netns``), with ``JAX_CPU_COLLECTIVES_IMPLEMENTATION=mpi``; ``jax.distributed`` still
        uses the launcher's coordinator. Needs ``mpirun`` on PATH, ``MPITRAMPOLINE_LIB`` naming
        a ``libmpiwrapper.so`` and one device per process: OSError/ValueError saying what is
        missing (:func:`mpi_unavailable_reason`). With ``netns`` mpirun runs in the switch's
        network namespace, which gets the address ``10.87.0.254`` on the bridge (unshaped), so
        the ranks reach its PMIx server; MPI's own traffic between hosts goes over the links
        (Open MPI's TCP transport on ``eth0``; no shared-memory transport).

    Returns 0 when every rank exits 0; the failed rank's exit code (128+signal when it was killed)
    when one fails; 124 on timeout; 128+signal when the launcher itself was interrupted.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    if devices_per_proc < 1:
        raise ValueError(f"devices_per_proc must be >= 1, got {devices_per_proc}")
    if hosts < 1 or nproc % hosts:
        raise ValueError(f"hosts must be >= 1 and divide nproc={nproc}, got {hosts}")
    if link_gbit is not None and (not netns or not link_gbit > 0):
        raise ValueError(f"link_gbit needs netns=True and a rate > 0, got {link_gbit}")
    if engine is not None and engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine == "mpi":
        if devices_per_proc != 1:
            raise ValueError(
                "engine 'mpi' needs one device per process (XLA's MPI collectives refuse several "
                f"devices in a process), got devices_per_proc={devices_per_proc}"
            )
        if private_mounts and not netns:
            raise ValueError(
                "engine 'mpi' runs with --netns or without namespaces, not with --private-mounts "
                "alone (mpirun's PMIx server would not be reachable the way --netns provides)"
            )
        reason = mpi_unavailable_reason(env)
        if reason is not None:
            raise OSError(reason)
    if netns:
        reason = netns_unavailable_reason(link_gbit)
        if reason is not None:
            raise OSError(reason)
    if netns or private_mounts:
        hidden = _hidden_by_private_mounts(argv, os.getcwd())
        if hidden:
            raise OSError(
                "each simulated host gets an empty /tmp and /dev/shm of its own (--netns, "
                f"--private-mounts), which hide {', '.join(hidden)}: put the interpreter (its "
                "virtual environment), the script and the working directory elsewhere, e.g. "
                "under your home directory"
            )
    out = stdout if stdout is not None else sys.stdout.buffer
    err = stderr if stderr is not None else sys.stderr.buffer
    run = _Launch(grace, err, fail_grace)

    lib = None
    if preload:
        lib = alloc_library_path()
        if lib is None:
            run.message(
                f"{ALLOC_LIBRARY_NAME} not found (set {ENV_ALLOC_LIB} or reinstall strata_jax); "
                "running without the allocator"
            )
    network = Network(hosts, link_gbit, head=engine == "mpi") if netns else None
    coordinator = network.coordinator if network else f"127.0.0.1:{free_port()}"
    per_host = nproc // hosts
    simulated = hosts > 1 or private_mounts or netns
    run_dirs = (
        [] if network else [tempfile.mkdtemp(prefix="strata-run-") for _ in range(hosts)]
    )  # mode 0700
    base = dict(os.environ if env is None else env)
    if engine is not None:
        base[ENV_STRATA_ENGINE] = engine  # what strata_jax.init() in each rank runs
    if network:
        base.pop(ENV_FABRIC_ID, None)  # fabrics are found by hostname and boot id
    if simulated:
        plan = "; ".join(
            f"host{h}: ranks {h * per_host}-{(h + 1) * per_host - 1}" for h in range(hosts)
        )
        run.message(
            f"{nproc} processes as {hosts} simulated host(s) of {per_host} "
            f"({devices_per_proc} device(s) each): {plan}"
        )
    namespaces: list[Namespace] = []
    # mpirun's session directory: with --netns in the head's private /tmp (gone with its
    # namespace, even after a SIGKILL), else in a folder the launcher removes.
    mpi_dir = tempfile.mkdtemp(prefix="strata-mpi-") if engine == "mpi" and not netns else None
    reaper = _reaper(run_dirs + ([mpi_dir] if mpi_dir else []))

    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = {}
    if in_main_thread:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, run.forward)
    try:
        if network:
            network.start()
            namespaces = network.namespaces
            run.message(network.describe())
        elif private_mounts:
            namespaces = [Namespace.start() for _ in range(hosts)]
        rank_cmds: list[tuple[list[str], dict[str, str]]] = []
        for rank in range(nproc):
            h = rank // per_host
            env_r = rank_env(
                base,
                rank=rank,
                nproc=nproc,
                coordinator=coordinator,
                devices_per_proc=devices_per_proc,
                run_dir=namespaces[h].run_dir if namespaces else run_dirs[h],
                preload=lib,
                fabric_id=f"host{h}" if simulated and not network else None,
            )
            if engine == "mpi":
                rank_cmds.append((list(argv), env_r))
                continue
            argv_r = namespaces[h].wrap(argv) if namespaces else dies_with_launcher(argv)
            run.start(argv_r, env_r, rank, out, host=f"host{h}" if simulated else None)
        if engine == "mpi":
            mpi_argv, mpi_env = mpi_job(rank_cmds, base, per_host, network, mpi_dir or "/tmp")
            where = (
                f" in the switch's network namespace (its PMIx server at {network.head_address}"
                " on the bridge; MPI between hosts over the links)"
                if network
                else ""
            )
            run.message(f"engine: XLA's MPI collectives; the ranks started by mpirun{where}")
            run.start(mpi_argv, mpi_env, 0, out, label="mpirun")
        run.coordinator = None if network else coordinator
        code = run.watch(timeout)
        # Every rank succeeded: did they make one job? A rank that joined left a file in its
        # run folder (strata_jax.init()) or started the coordinator (jax.distributed). A
        # simulated host's run folder is seen through its holder (its mount namespace); where
        # that cannot be read, nothing is said.
        dirs = run_dirs + [f"/proc/{ns.pid}/root{ns.run_dir}" for ns in namespaces]
        if code == 0 and nproc > 1 and not run.coordinator_seen:
            if all(os.path.isdir(d) for d in dirs) and not joined_ranks(dirs):
                run.message(
                    f"no rank called strata_jax.init() or started jax.distributed: the {nproc} "
                    f"processes ran as {nproc} separate one-process jobs (each its own process "
                    "0 of 1). Run an unmodified script with `--wrap`, or call "
                    "strata_jax.init() first in the script"
                )
        return code
    finally:
        run.finish()
        if network:
            network.stop()
        for ns in namespaces if not network else ():
            ns.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for d in run_dirs + ([mpi_dir] if mpi_dir else []):
            shutil.rmtree(d, ignore_errors=True)
        if reaper is not None:
            # Nothing is left for it to remove. Killed, not waited for until its stdin closes:
            # a child the host program forked meanwhile may hold the pipe open.
            reaper.kill()
            reaper.communicate()


def _reaper(paths: Sequence[str]) -> subprocess.Popen | None:
    """A ``sh`` that removes ``paths`` once its stdin closes. The launcher is that pipe's only
    writer (the ranks do not inherit it), so the folders go when the launcher ends, however it
    ends: a SIGKILLed launcher, whose own cleanup never runs, included. Its own session, so a
    Ctrl-C to the launcher's terminal does not stop it first."""
    if not paths:
        return None
    return subprocess.Popen(
        ["sh", "-c", 'cat >/dev/null; rm -rf -- "$@"', "strata-reaper", *paths],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="strata-launch",
        description="Start N strata_jax processes on this host (one jax.distributed process each).",
    )
    p.add_argument("-n", "--nproc", type=int, required=True, help="number of processes")
    p.add_argument(
        "--devices-per-proc", type=int, default=1, help="CPU devices per process (default 1)"
    )
    p.add_argument(
        "--no-preload", action="store_true", help=f"do not LD_PRELOAD {ALLOC_LIBRARY_NAME}"
    )
    p.add_argument(
        "--hosts",
        type=int,
        default=1,
        help="simulate this many hosts (fabrics) of nproc/hosts ranks each (default 1)",
    )
    p.add_argument(
        "--private-mounts",
        action="store_true",
        help="each simulated host in its own mount namespace (private /tmp, /dev/shm; root)",
    )
    p.add_argument(
        "--netns",
        action="store_true",
        help="each simulated host in its own network, UTS and mount namespaces, joined by veth "
        "links to a bridge (root; unshare, nsenter, ip)",
    )
    p.add_argument(
        "--link-gbit",
        type=float,
        default=None,
        metavar="G",
        help="with --netns: shape each host's link to G Gbit/s each way (tc tbf)",
    )
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default=None,
        help="JAX's engine between processes: strata (default: XLA's collectives, jax.lax's and "
        "the partitioner's, on strata's fabric through libstrata_mpi.so), gloo, or mpi: XLA's "
        "MPI collectives over a real MPI, the "
        "ranks started as one job by Open MPI's mpirun (needs mpirun and MPITRAMPOLINE_LIB; "
        "with --netns, MPI runs over the links)",
    )
    p.add_argument("--timeout", type=float, default=None, help="stop everything after N seconds")
    p.add_argument(
        "--grace", type=float, default=5.0, help="seconds from SIGTERM to SIGKILL (default 5)"
    )
    p.add_argument(
        "--fail-grace",
        type=float,
        default=1.0,
        help="seconds from SIGTERM to SIGKILL after a rank failed (default 1; at most --grace)",
    )
    p.add_argument(
        "-m", dest="module", action="store_true", help="run the target as a module (python -m)"
    )
    p.add_argument(
        "--wrap",
        action="store_true",
        help="run an unmodified JAX script (one that does not import strata_jax): each rank "
        "runs `python -m strata_jax.wrap SCRIPT`, which calls strata_jax.init() first",
    )
    p.add_argument("script", help="the Python script (or module, with -m) every rank runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m strata_jax.launch`` and ``strata-launch``; returns the exit
    code."""
    ns = _parser().parse_args(argv)
    if ns.nproc < 1:
        _parser().error("-n must be at least 1")
    if ns.devices_per_proc < 1:
        _parser().error("--devices-per-proc must be at least 1")
    if ns.hosts < 1 or ns.nproc % ns.hosts:
        _parser().error("--hosts must be at least 1 and divide -n")
    if ns.link_gbit is not None and not ns.netns:
        _parser().error("--link-gbit needs --netns")
    if ns.link_gbit is not None and not ns.link_gbit > 0:
        _parser().error("--link-gbit must be > 0")
    if ns.engine == "mpi" and ns.devices_per_proc != 1:
        _parser().error("--engine mpi needs --devices-per-proc 1 (XLA's MPI: one device each)")
    if ns.engine == "mpi" and ns.private_mounts and not ns.netns:
        _parser().error("--engine mpi runs with --netns or without namespaces (not with "
                        "--private-mounts alone)")  # fmt: skip
    for reason in (
        netns_unavailable_reason(ns.link_gbit) if ns.netns else None,
        mpi_unavailable_reason() if ns.engine == "mpi" else None,
    ):
        if reason is not None:
            print(f"strata-launch: error: {reason}", file=sys.stderr)
            return 2
    if ns.wrap and ns.module:
        _parser().error("--wrap runs a script file, not a module (-m)")
    target = ["-m", ns.script] if ns.module else [ns.script]
    if ns.wrap:
        target = ["-m", "strata_jax.wrap", ns.script]
    try:
        return _launch_from_args(ns, target)
    except OSError as e:  # namespaces or links that could not be made: say why, no traceback
        print(f"strata-launch: error: {e}", file=sys.stderr)
        return 2


def _hidden_by_private_mounts(argv: list[str], cwd: str) -> list[str]:
    """The paths a process started in a simulated host's private mounts cannot see: the working
    directory and every argument naming an existing path under /tmp or /dev/shm (a virtual
    environment's interpreter too, whatever its link points to: nsenter runs the path)."""
    out = []
    for a in [cwd, *(a for a in argv if os.path.exists(a))]:
        p = os.path.abspath(a)
        if any(p == h or p.startswith(h + "/") for h in ("/tmp", "/dev/shm")):
            out.append(a)
    return out


def _launch_from_args(ns: argparse.Namespace, target: list[str]) -> int:
    return launch(
        ns.nproc,
        [sys.executable, *target, *ns.args],
        devices_per_proc=ns.devices_per_proc,
        preload=not ns.no_preload,
        timeout=ns.timeout,
        grace=ns.grace,
        hosts=ns.hosts,
        private_mounts=ns.private_mounts,
        netns=ns.netns,
        link_gbit=ns.link_gbit,
        fail_grace=ns.fail_grace,
        engine=ns.engine,
    )


if __name__ == "__main__":
    sys.exit(main())
