"""Simulated hosts on one machine (``launch --private-mounts``, ``--netns``): namespaces the
launcher makes and frees, and processes that die with the launcher.

A :class:`Namespace` stands in for one host (private tmpfs on /tmp and /dev/shm; with
``--netns`` its own network, hostname and /etc/hosts); a :class:`Network` joins the hosts'
namespaces by veth links to a bridge, optionally shaped to a link rate. Every holder process
and rank is started so that the kernel kills it when the launcher dies
(:func:`dies_with_launcher`), so nothing outlives a SIGKILLed launcher. Standard library only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence


def dies_with_launcher(argv: Sequence[str]) -> list[str]:
    """``argv`` run so that the kernel SIGKILLs it when the launcher dies (``setpriv
    --pdeathsig KILL``, where util-linux's setpriv has that option; else ``argv`` as is)."""
    setpriv = _setpriv_with_pdeathsig()
    return [setpriv, "--pdeathsig", "KILL", *argv] if setpriv else list(argv)


_SETPRIV: list[str | None] = []  # the probe's answer, once


def _setpriv_with_pdeathsig() -> str | None:
    """The path of a ``setpriv`` that knows ``--pdeathsig`` (util-linux 2.33 and later; RHEL 8
    ships 2.32, whose setpriv refuses the option, which would fail every rank), or None."""
    if not _SETPRIV:
        path = shutil.which("setpriv")
        ok = False
        if path is not None:
            try:
                r = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=10)
                ok = "--pdeathsig" in r.stdout
            except (OSError, subprocess.SubprocessError):
                pass
        _SETPRIV.append(path if ok else None)
    return _SETPRIV[0]


def _holder_argv(unshare_flags: Sequence[str], script: str) -> list[str]:
    """The command of a namespace holder: ``unshare FLAGS sh -c SCRIPT``, killed by the kernel
    when the launcher dies (:func:`dies_with_launcher`), so even a SIGKILLed launcher leaves
    no holder, hence no namespace without ranks, behind."""
    unshare = shutil.which("unshare") or "unshare"
    return dies_with_launcher([unshare, *unshare_flags, "sh", "-c", script])


def _start_holder(argv: Sequence[str], what: str) -> subprocess.Popen:
    """Starts a holder and waits for its ``ready`` line; OSError with its stderr otherwise."""
    proc = subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    line = proc.stdout.readline() if proc.stdout else b""
    if line.strip() != b"ready":
        proc.kill()
        _, err = proc.communicate()
        raise OSError(f"cannot make {what}: {err.decode(errors='replace').strip()}")
    return proc


def _stop_holder(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for f in (proc.stdout, proc.stderr):
        if f is not None:
            f.close()


class Namespace:
    """A mount namespace standing in for one host: private tmpfs on /tmp and /dev/shm.

    A holder process (``unshare --mount``) mounts the two tmpfs, makes the host's run dir in
    its own /tmp and sleeps; ranks enter it with ``nsenter --mount``. Killing the holder once
    the ranks are gone frees the namespace and everything in its tmpfs. With ``hostname`` (the
    ``--netns`` mode) the holder also gets its own network and UTS namespaces: that hostname,
    loopback up, and ``etc_hosts`` bind-mounted over /etc/hosts (the simulated hosts' names and
    addresses), so names resolve inside the simulated cluster and never through DNS.
    """

    RUN_DIR = "/tmp/strata-host"
    _MOUNTS = (
        "mount -t tmpfs -o mode=1777 strata-tmp /tmp && "
        "mount -t tmpfs -o mode=1777 strata-shm /dev/shm && "
        f"mkdir -m 700 {RUN_DIR}"
    )
    _READY = "echo ready && exec sleep 100000"

    def __init__(self, proc: subprocess.Popen, net: bool) -> None:
        self.proc = proc
        self.run_dir = self.RUN_DIR
        self.net = net

    @classmethod
    def start(cls, hostname: str | None = None, etc_hosts: str = "") -> Namespace:
        if not shutil.which("unshare") or not shutil.which("nsenter"):
            raise OSError("private_mounts needs the unshare and nsenter commands (util-linux)")
        if hostname is None:
            flags = ["--mount", "--propagation", "private"]
            script = f"{cls._MOUNTS} && {cls._READY}"
            what = "a private mount namespace (unshare --mount needs root or CAP_SYS_ADMIN)"
        else:
            flags = ["--net", "--uts", "--mount", "--propagation", "private"]
            hosts_file = "/tmp/.strata-etc-hosts"
            script = (
                f"hostname {hostname} && {cls._MOUNTS} && "
                f"printf '{etc_hosts}' > {hosts_file} && "
                f"mount --bind {hosts_file} /etc/hosts && rm {hosts_file} && "
                "mount -t sysfs strata-sys /sys && "  # /sys/class/net: this namespace's links
                f"ip link set lo up && {cls._READY}"
            )
            what = f"the namespaces of simulated host {hostname} (unshare --net --uts --mount)"
        return cls(_start_holder(_holder_argv(flags, script), what), hostname is not None)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wrap(self, argv: Sequence[str]) -> list[str]:
        nsenter = shutil.which("nsenter") or "nsenter"
        spaces = ["--net", "--uts", "--mount"] if self.net else ["--mount"]
        # Entering a mount namespace resets the working directory to /: keep the launcher's.
        cmd = [nsenter, "-t", str(self.proc.pid), *spaces, f"--wd={os.getcwd()}", "--", *argv]
        # A rank dies with the launcher: one left running would keep its host's namespaces
        # (and with --netns its links and tmpfs) alive after a SIGKILLed launcher.
        return dies_with_launcher(cmd)

    def stop(self) -> None:
        _stop_holder(self.proc)


def netns_unavailable_reason(link_gbit: float | None = None) -> str | None:
    """Why ``--netns`` cannot run here (not root, a command missing), or None when it can.

    ``--netns`` needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN: namespaces, mounts, links) and the
    commands ``unshare``/``nsenter`` (util-linux), ``ip`` (iproute2) and, with a link rate,
    ``tc`` (iproute2).
    """
    if os.geteuid() != 0:
        return (
            "--netns needs root (it makes network, UTS and mount namespaces, veth links and a "
            f"bridge); the launcher runs as uid {os.geteuid()}"
        )
    need = ["unshare", "nsenter", "ip"] + (["tc"] if link_gbit is not None else [])
    missing = [c for c in need if shutil.which(c) is None]
    if missing:
        util = ("unshare", "nsenter")
        pkgs = sorted({"util-linux" if c in util else "iproute2" for c in missing})
        return (
            f"--netns needs the command(s) {', '.join(missing)} on PATH "
            f"(package {' and '.join(pkgs)})"
        )
    return None


class Network:
    """The ``--netns`` cluster: one network/UTS/mount namespace per simulated host, joined by veth
    pairs to a bridge that lives in a namespace of its own, every piece made by this launcher.

    Host h is named ``host<h>``, has address ``10.87.0.<h+1>/24`` on its ``eth0`` (a private
    range, inside namespaces only this job can reach: nothing is ever sent to an address outside
    them) and reaches the others through the bridge ``strata-br`` in the switch namespace. With a
    rate, each host's link is shaped to it in both directions with ``tc`` tbf: on ``eth0``
    (what the host sends) and on its bridge port (what it receives), so it behaves as one
    full-duplex link of that rate. Links carry frames of up to ``MTU`` bytes. Everything lives
    in namespaces held by the holder processes: stopping them (and the ranks) frees all of it,
    veth pairs and the bridge included; the root namespace's network is never touched.
    """

    SUBNET = "10.87.0"
    PREFIX = 24
    MTU = 65520  # veth's maximum: per-packet CPU costs would otherwise bound a 2-core machine
    BRIDGE = "strata-br"
    HEAD = 254  # the switch namespace's address on the bridge, .254 (mpirun's, --engine mpi)
    COORDINATOR_PORT = 8476
    # tbf's queue, in time at the link rate. 1 ms dropped frames: this machine's TCP (BBR, which
    # over veth estimates 30-55 Gbit/s and sends bursts at that rate) then waited for 200 ms
    # retransmission timeouts (strata's all_gather at 1 Gbit/s: 8-28 % of the link bound).
    QUEUE = "20ms"

    def __init__(self, hosts: int, link_gbit: float | None, head: bool = False) -> None:
        if hosts > 250:
            raise ValueError(f"--netns supports at most 250 simulated hosts, got {hosts}")
        self.hosts = hosts
        self.link_gbit = link_gbit
        self.head = head  # the switch namespace is also a head node (add_head, in_switch)
        self.switch: subprocess.Popen | None = None
        self.namespaces: list[Namespace] = []

    @staticmethod
    def hostname(h: int) -> str:
        return f"host{h}"

    def address(self, h: int) -> str:
        return f"{self.SUBNET}.{h + 1}"

    @property
    def coordinator(self) -> str:
        return f"{self.address(0)}:{self.COORDINATOR_PORT}"

    @property
    def head_address(self) -> str:
        """The switch namespace's own address on the bridge (``add_head``)."""
        return f"{self.SUBNET}.{self.HEAD}"

    def add_head(self) -> None:
        """Gives the switch namespace loopback and ``head_address`` on the bridge (unshaped):
        a head node where mpirun runs and the ranks reach its PMIx server (``--engine mpi``)."""
        assert self.switch is not None
        sw = self.switch.pid
        self._in(sw, "ip", "link", "set", "lo", "up")
        self._in(sw, "ip", "addr", "add", f"{self.head_address}/{self.PREFIX}", "dev", self.BRIDGE)

    def in_switch(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run in the head's network and mount namespaces (a private /tmp), in the
        launcher's working directory."""
        assert self.switch is not None and self.head
        nsenter = shutil.which("nsenter") or "nsenter"
        pid = str(self.switch.pid)
        return [nsenter, "-t", pid, "--net", "--mount", f"--wd={os.getcwd()}", "--", *argv]

    def tbf(self, dev: str) -> list[str]:
        """tc arguments shaping ``dev``'s egress to the link rate (token bucket filter)."""
        assert self.link_gbit is not None
        rate = int(self.link_gbit * 1e9)  # bit/s
        # The bucket: at least two full frames (tbf drops a frame larger than it), else 100 us
        # of the rate; a burst lets that many bytes pass at once after an idle moment.
        burst = max(2 * self.MTU, rate // 8 // 10_000)
        return ["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate}bit",
                "burst", str(burst), "latency", self.QUEUE]  # fmt: skip

    def _in(self, pid: int, *cmd: str) -> None:
        """Runs ``cmd`` in the network namespace of ``pid``; OSError naming it when it fails."""
        nsenter = shutil.which("nsenter") or "nsenter"
        r = subprocess.run(
            [nsenter, "-t", str(pid), "--net", "--", *cmd],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            raise OSError(f"--netns: `{' '.join(cmd)}` failed: {r.stderr.strip() or r.returncode}")

    def start(self) -> None:
        reason = netns_unavailable_reason(self.link_gbit)
        if reason is not None:
            raise OSError(reason)
        # A head node (mpirun's, --engine mpi) also gets private mounts: a tmpfs on /tmp for
        # mpirun's session directory, freed with the namespace however the job ends.
        flags = ["--net", "--mount", "--propagation", "private"] if self.head else ["--net"]
        tmp = "mount -t tmpfs -o mode=1777 strata-tmp /tmp && " if self.head else ""
        self.switch = _start_holder(
            _holder_argv(
                flags,
                f"{tmp}ip link add {self.BRIDGE} mtu {self.MTU} type bridge && "
                f"ip link set {self.BRIDGE} up && echo ready && exec sleep 100000",
            ),
            f"the switch namespace (unshare {' '.join(flags)})",
        )
        etc_hosts = "127.0.0.1 localhost\n::1 localhost\n" + "".join(
            f"{self.address(h)} {self.hostname(h)}\n" for h in range(self.hosts)
        )
        sw = self.switch.pid
        for h in range(self.hosts):
            ns = Namespace.start(self.hostname(h), etc_hosts)
            self.namespaces.append(ns)
            port = f"port{h}"
            mtu = str(self.MTU)
            self._in(sw, "ip", "link", "add", port, "mtu", mtu, "type", "veth",
                     "peer", "name", "eth0", "mtu", mtu, "netns", str(ns.pid))  # fmt: skip
            self._in(sw, "ip", "link", "set", port, "master", self.BRIDGE, "up")
            self._in(ns.pid, "ip", "addr", "add", f"{self.address(h)}/{self.PREFIX}", "dev", "eth0")
            self._in(ns.pid, "ip", "link", "set", "eth0", "up")
            if self.link_gbit is not None:
                self._in(ns.pid, *self.tbf("eth0"))
                self._in(sw, *self.tbf(port))

    def describe(self) -> str:
        rate = f"{self.link_gbit:g} Gbit/s" if self.link_gbit is not None else "unshaped"
        hosts = ", ".join(
            f"{self.hostname(h)} {self.address(h)} (net:[{_ns_inode(ns.pid)}])"
            for h, ns in enumerate(self.namespaces)
        )
        return (
            f"network: {hosts}; links {rate}, MTU {self.MTU}, bridge {self.BRIDGE} in "
            f"net:[{_ns_inode(self.switch.pid) if self.switch else '?'}]"
        )

    def stop(self) -> None:
        for ns in self.namespaces:
            ns.stop()
        if self.switch is not None:
            _stop_holder(self.switch)


def _ns_inode(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/net").split("[")[-1].rstrip("]")
    except OSError:
        return "?"
