"""``python -m strata_jax.info``: what a bug report needs, like ``jax.print_environment_info()``.

Prints versions (strata_jax, jax, jaxlib, numpy, Python), the CPU and its cores, JAX's devices,
XLA's CPU launch pool (PJRT_NPROC and whether it was set before JAX created its backend, which
decides whether dispatch-ahead can deadlock), the allocator (preloaded, hooked into jaxlib or
off; its threshold), the registration mode, and under the launcher
(``python -m strata_jax.launch -n 4 -m strata_jax.info``) the fabric map: every process, its
host and its fabric.
"""

from __future__ import annotations

import os
import platform
import socket
import sys

import strata_jax  # first: sizes XLA's launch pool before the backend exists
from strata_jax._src import allocator  # noqa: E402


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform module says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _fabric_id() -> str:
    override = os.environ.get("STRATA_FABRIC_ID")
    if override:
        return override
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()[:8]
    except OSError:
        pass
    return f"{socket.gethostname()}:{boot}"


def collect() -> dict:
    """The report as a dict (``main`` prints it)."""
    import jax
    import jaxlib
    import numpy as np

    from strata_jax._src import launch_env, runtime

    under_launcher = launch_env.distributed_env() is not None
    state = strata_jax.init() if under_launcher else None
    devices = jax.devices()
    runtime.native()  # loads the extension and records the launch pool (backend exists now)
    pool = dict(runtime.launch_pool)
    mem = strata_jax.memory_stats()
    preload = os.environ.get("LD_PRELOAD", "")
    info = {
        "strata_jax": strata_jax.__version__,
        "strata_jax path": os.path.dirname(strata_jax.__file__),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "numpy": np.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cores": f"{os.cpu_count()} (usable: {len(os.sched_getaffinity(0))})",
        "devices": f"{len(devices)} ({jax.local_device_count()} local): "
        + ", ".join(str(d) for d in devices[:8])
        + (" ..." if len(devices) > 8 else ""),
        "PJRT_NPROC": os.environ.get("PJRT_NPROC", "unset"),
        "PJRT_NPROC set in time": pool["set_in_time"],
        "launch pool threads": f"{pool['threads']} for {pool['devices']} local devices"
        + (
            " (fewer than 2 per device: dispatch-ahead can deadlock; import strata_jax first)"
            if pool["threads"]
            and pool["devices"]
            and pool["threads"] < 2 * pool["devices"]
            and pool["devices"] > 1
            else ""
        ),
        "allocator": mem["allocator_mode"] + f" ({allocator.describe()})",
        "LD_PRELOAD": preload or "unset",
        "allocator threshold": mem["pool_threshold"] if mem["allocator"] else "n/a (none)",
        "registration": mem["registration"],
        "fabric": mem["fabric"],
        "timeout s": strata_jax.get_timeout(),
        "two-shot threshold bytes": strata_jax.get_two_shot_threshold(),
        "STRATA_DEBUG": os.environ.get("STRATA_DEBUG", "unset"),
    }
    if state is not None and state["num_processes"] > 1:
        info["fabric map"] = _fabric_map(state)
    return info


def _fabric_map(state: dict) -> list[str]:
    """Every process: host and fabric id, exchanged through jax.distributed's key-value store."""
    from strata_jax._src.jax_compat import distributed

    client = distributed.global_state.client
    pid, n = state["process_id"], state["num_processes"]
    me = f"{socket.gethostname()} pid={os.getpid()} fabric={_fabric_id()}"
    client.key_value_set(f"strata_jax/info/{pid}", me)
    rows = [client.blocking_key_value_get(f"strata_jax/info/{j}", 60_000) for j in range(n)]
    return [f"process {j}: {r}" for j, r in enumerate(rows)]


def format_report(info: dict) -> str:
    width = max(len(k) for k in info)
    lines = []
    for k, v in info.items():
        if isinstance(v, list):
            lines.append(f"{k}:")
            lines += [f"  {x}" for x in v]
        else:
            lines.append(f"{k:<{width}} : {v}")
    return "\n".join(lines)


def main() -> None:
    print(format_report(collect()), flush=True)


if __name__ == "__main__":
    main()
