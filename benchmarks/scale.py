"""How strata's start-up and memory grow with the number of processes on this host, against the
same JAX program without strata; and a guard for the cross-host psum (``--hosts-psum``).

``python benchmarks/scale.py --n 2 8 16 32 [--calls psum_1m,ag_64k] [--out DIR]``: for each N,
one job of N processes under ``strata_jax.launch`` with strata (``_scale_rank.py strata``) and
one over plain jax.lax/gloo without importing strata (``--no-preload``, ``_scale_rank.py
plain``). Each rank reports CPU and wall seconds of ``import``, of start-up (``init()``, or
``jax.distributed.initialize``) and of each program's first call, and, after every call ran,
``/proc/self/smaps_rollup``/``status`` (Rss, Pss and its parts, page tables), its maps by kind
(strata's memfds, anonymous memory, files), open files and maps. The table gives medians over
ranks and strata's Pss over plain JAX's per rank, the figure issue-level goals are stated in; a
linear fit of start-up CPU seconds in N and its log-log exponent (<= 1: linear or better) are
printed at the end, and a table of the bytes each rank read from / wrote to its peers per call
(``comm_stats``' zero_copy + peer_bounce bytes) and the rendezvous steps each rank entered per
call (``comm_stats()["rendezvous_steps"]``) against docs/scaling.md's model for the algorithm
taken. On 2 cores the wall time of many
processes measures the scheduler (each ``import jax`` costs ~0.4 CPU-s): read the CPU columns.

``python benchmarks/scale.py --hosts-psum [--rounds 3] [--min-ratio 2.0]``: psum of 16 MiB per
process across 2 simulated hosts of 2 processes (``launch -n 4 --hosts 2``), strata against
jax.lax over gloo, 12 alternated samples per run (each: a barrier of the processes, one untimed
call, 3 timed calls, as benchmarks/_timing.py times calls across processes), ``--rounds`` runs;
prints the medians and exits 1 when the median ratio (jax.lax time / strata time) is below
``--min-ratio``: the check that would have caught the slowdown between d863220 and c9c4db3.

Run it under the team's CPU lock on a shared machine (``flock /tmp/strata-cpu.lock ...``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics as st
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
MIB = 1 << 20


def _launch(n: int, args: list[str], extra: list[str] | None = None, timeout: float = 900):
    cmd = [sys.executable, "-m", "strata_jax.launch", "-n", str(n), *(extra or []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _job(n: int, mode: str, calls: str, out: str) -> list[dict]:
    d = os.path.join(out, f"{mode}{n}")
    extra = ["--no-preload"] if mode == "plain" else []
    r = _launch(n, [os.path.join(HERE, "_scale_rank.py"), mode, d, calls], extra)
    if r.returncode != 0:
        raise SystemExit(f"{mode} job of {n} processes failed:\n{(r.stdout + r.stderr)[-3000:]}")
    return [json.load(open(p)) for p in glob.glob(os.path.join(d, "rank-*.json"))]


def _med(recs: list[dict], *path: str) -> float:
    vals = []
    for r in recs:
        v = r
        for p in path:
            v = v.get(p, {}) if isinstance(v, dict) else 0
        vals.append(v if isinstance(v, (int, float)) else 0)
    return st.median(vals)


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares y = a + b x."""
    mx, my = st.fmean(xs), st.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - b * mx, b


def _power(xs: list[float], ys: list[float]) -> float:
    """Least-squares exponent k of y = c N^k (log-log slope): k <= 1, linear or better."""
    import math

    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if x > 0 and y > 0]
    return _fit([p[0] for p in pts], [p[1] for p in pts])[1] if len(pts) > 1 else float("nan")


CALL_BYTES = {"4k": 4096, "64k": 65536, "1m": 1 << 20, "16m": 16 << 20}


def model_peer_bytes(call: str, n: int, algo: str) -> float:
    """docs/scaling.md's bytes one rank reads from or writes to its peers' buffers in one call of
    ``call`` (``psum_1m``: B bytes per rank) over n ranks of one fabric, given the algorithm taken:
    all-reduce one-shot (and low-latency) (n-1) B, two-shot 2 (n-1) B / n; all_gather (n-1) B."""
    op, size = call.split("_")
    b = CALL_BYTES[size]
    if op == "psum":
        return 2 * (n - 1) * b / n if algo == "two_shot" else (n - 1) * b
    return (n - 1) * b


def model_steps(low_latency: bool) -> int:
    """docs/scaling.md's rendezvous steps per rank and call: the low-latency path (its slot or
    direct form, whichever algorithm it runs) publishes once; the general path enters two
    barriers (arrive, depart)."""
    return 1 if low_latency else 2


def _algo(pc: dict) -> str:
    if pc.get("two_shot", 0) >= 1:
        return "two_shot"
    if pc.get("low_latency", 0) >= 1:
        return "low_latency"
    return "one_shot" if pc.get("one_shot", 0) >= 1 else "general"


def scale(ns: list[int], calls: str, out: str) -> None:
    first = calls.split(",")[0]
    print(f"load {open('/proc/loadavg').read().strip()}")
    print(
        "| N | init CPU s | first call CPU s | Pss MiB strata | Pss MiB plain | strata - plain "
        "| strata_seg Pss | PTE KiB | open files | maps |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for n in ns:
        s, p = _job(n, "strata", calls, out), _job(n, "plain", calls, out)
        row = {
            "n": n,
            "init_cpu": _med(s, "times", "init_cpu"),
            "first_cpu": _med(s, "times", f"first_{first}_cpu"),
            "pss": _med(s, "memory", "Pss") / MIB,
            "pss_plain": _med(p, "memory", "Pss") / MIB,
            "seg": _med(s, "memory", "by_kind", "strata_seg", "Pss") / MIB,
            "pte": _med(s, "memory", "VmPTE") / 1024,
            "fds": _med(s, "memory", "open_files"),
            "maps": _med(s, "memory", "maps"),
        }
        row["model"] = {}
        for c in calls.split(","):
            pcs = [r["per_call"][c] for r in s if c in r.get("per_call", {})]
            if not pcs:
                continue
            got = st.median(pc["peer_bytes"] for pc in pcs)
            algo = _algo(pcs[0])
            ll = pcs[0].get("low_latency", 0) >= 1
            row["model"][c] = {
                "algorithm": algo + (" (low-latency path)" if ll and algo != "low_latency" else ""),
                "peer_bytes": got,
                "model": model_peer_bytes(c, n, algo),
                "steps": st.median(pc.get("steps", float("nan")) for pc in pcs),
                "model_steps": model_steps(ll),
                "calls_per_call": st.median(pc["calls"] for pc in pcs),
            }
        rows.append(row)
        print(
            f"| {n} | {row['init_cpu']:.3f} | {row['first_cpu']:.3f} | {row['pss']:.1f} | "
            f"{row['pss_plain']:.1f} | {row['pss'] - row['pss_plain']:+.1f} | {row['seg']:.1f} | "
            f"{row['pte']:.0f} | {row['fds']:.0f} | {row['maps']:.0f} |",
            flush=True,
        )
    print(
        "\n| N | call | algorithm | peer bytes per rank and call | model | measured / model "
        "| rendezvous steps per rank and call | model | measured / model |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        for c, m in row["model"].items():
            ratio = m["peer_bytes"] / m["model"] if m["model"] else float("nan")
            print(
                f"| {row['n']} | {c} | {m['algorithm']} | {m['peer_bytes']:.0f} | "
                f"{m['model']:.0f} | {ratio:.3f} | {m['steps']:.2f} | {m['model_steps']} | "
                f"{m['steps'] / m['model_steps']:.3f} |"
            )
    if len(rows) > 1:
        ns_ = [r["n"] for r in rows]
        for key in ("init_cpu", "first_cpu"):
            a, b = _fit(ns_, [r[key] for r in rows])
            k = _power(ns_, [r[key] for r in rows])
            verdict = "linear or better" if k <= 1.1 else "FASTER than linear"
            print(
                f"fit {key} = {a:.4f} + {b:.6f} * N (CPU seconds per rank); "
                f"log-log exponent {k:.2f} ({verdict})"
            )
    with open(os.path.join(out, "scale.json"), "w") as f:
        json.dump(rows, f, indent=1)


REG_SCRIPT = """
import sys, time
import numpy as np
import strata_jax as sj
sj.init()
import jax
from strata_jax._src.jax_compat import distributed
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
devs = sorted(jax.devices(), key=lambda d: d.id)
mesh = Mesh(np.array(devs), ("x",))
x = np.random.default_rng(0).standard_normal((len(devs), 4 << 20)).astype(np.float32)
arr = jax.make_array_from_callback(x.shape, NamedSharding(mesh, P("x")), lambda i: x[i])
fs = {k: jax.jit(jax.shard_map(lambda v, lib=lib: lib.psum(v, "x"), mesh=mesh, in_specs=P("x"),
      out_specs=P("x"))) for k, lib in (("strata", sj), ("lax", jax.lax))}
for k, f in fs.items():
    for s in f(arr).addressable_shards:
        assert np.allclose(np.asarray(s.data)[0], x.sum(0), rtol=1e-4, atol=1e-3), k
# As benchmarks/_timing.time_interleaved(align=align_processes, batch=3): every sample starts
# with the processes together (coordinator barrier) and one untimed call, so that no call is
# charged the skew the other implementation's call left; then 3 calls timed together.
t = {k: [] for k in fs}
client = distributed.global_state.client
n = 0
for i in range(12):
    for k in (("strata", "lax") if i % 2 == 0 else ("lax", "strata")):
        n += 1
        client.wait_at_barrier(f"hosts_psum/{n}", 60000)
        fs[k](arr).block_until_ready()
        t0 = time.perf_counter()
        for _ in range(3):
            fs[k](arr).block_until_ready()
        t[k].append((time.perf_counter() - t0) / 3)
if jax.process_index() == 0:
    print("RESULT", 1e3 * np.median(t["strata"]), 1e3 * np.median(t["lax"]), flush=True)
"""


def hosts_psum(rounds: int, min_ratio: float, out: str) -> int:
    path = os.path.join(out, "hosts_psum.py")
    with open(path, "w") as f:
        f.write(REG_SCRIPT)
    print(f"load {open('/proc/loadavg').read().strip()}")
    ratios = []
    for i in range(rounds):
        r = _launch(4, [path], ["--hosts", "2"], timeout=600)
        line = [ln for ln in r.stdout.splitlines() if "RESULT" in ln]
        if r.returncode != 0 or not line:
            raise SystemExit(f"run {i} failed:\n{(r.stdout + r.stderr)[-3000:]}")
        s, lax = map(float, line[0].split("RESULT")[1].split())
        ratios.append(lax / s)
        print(
            f"run {i}: psum 16 MiB, 2 hosts x 2: strata {s:.2f} ms, jax.lax {lax:.2f} ms, "
            f"{lax / s:.2f}x",
            flush=True,
        )
    med = st.median(ratios)
    ok = med >= min_ratio
    print(f"median {med:.2f}x jax.lax over gloo ({'ok' if ok else 'BELOW'} the {min_ratio}x goal)")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--calls", default="psum_1m,ag_64k")
    ap.add_argument("--out", default=None)
    ap.add_argument("--hosts-psum", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-ratio", type=float, default=2.0)
    a = ap.parse_args()
    out = a.out or tempfile.mkdtemp(prefix="strata-scale-")
    os.makedirs(out, exist_ok=True)
    if a.hosts_psum:
        return hosts_psum(a.rounds, a.min_ratio, out)
    scale(a.n, a.calls, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
