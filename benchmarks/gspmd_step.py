"""A GSPMD training step -- the main job's dense part, as jit + sharding -- over each engine
between processes: strata's engine, gloo, and XLA over MPI.

The model is ``train_moe.py``'s byte-level decoder with a dense MLP in place of the MoE layer
(embedding, RMSNorm, causal self-attention, a GELU MLP, tied output), written as plain JAX with
no collective in it: ``jax.jit`` with ``NamedSharding`` in and out, so every collective of the
step is one XLA's partitioner inserts (GSPMD). Two layouts, over one mesh axis of all devices:

- ``dp``: parameters replicated, the batch sharded: the gradients are all-reduced;
- ``tp``: Megatron's tensor parallelism, ``wqkv``/``w1`` sharded on their output dimension and
  ``wo``/``w2`` on their input dimension, the batch replicated: the partial sums of the attention
  and MLP outputs are all-reduced forward and backward.

One process per device. Run from a shell, the script relaunches itself under
``python -m strata_jax.launch -n P`` once per engine (``--engine strata``, ``gloo``, ``mpi``: the
last needs mpirun and MPITRAMPOLINE_LIB naming MPIwrapper's library, and is left out with a note
otherwise), engines alternated over ``--rounds`` rounds, and prints the medians side by side
with the ratios (XLA's engine time over strata's engine time: > 1, strata faster). Each launch
also checks that its losses equal the first launch's (bitwise with 2 processes; gloo adds
around a ring with more, so within float32 rounding there).

    python benchmarks/gspmd_step.py --procs 2
    python benchmarks/gspmd_step.py --procs 4 --layout dp,tp --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import strata_jax as sj  # before jax: the engine between processes is chosen at its import

if str(Path(__file__).resolve().parent) not in sys.path:  # imported from elsewhere
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import parse_list  # noqa: E402
from _machine import machine_info, print_machine  # noqa: E402
from _report import write_json  # noqa: E402
from _timing import align_processes  # noqa: E402

CHILD_ENV = "STRATA_BENCH_CHILD"
RESULT_ENV = "STRATA_BENCH_RESULT"
FREE_ENV = "STRATA_BENCH_FREE"
# "free": the bound, the same step with free exchanges (dp only): every process runs its own
# share of the step (its batch, the whole model) on a mesh of its own device, all processes at
# once as in the other launches, with no collective at all.
ENGINES = ("strata", "gloo", "mpi", "free")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--procs", type=int, default=2, help="processes (one device each)")
    p.add_argument("--layout", default="dp,tp", help="comma list of dp, tp")
    p.add_argument(
        "--engines",
        default="strata,gloo,mpi,free",
        help="comma list of strata, gloo, mpi, free (the step with free exchanges: dp only)",
    )
    p.add_argument("--rounds", type=int, default=2, help="launches per engine, alternated")
    p.add_argument("--steps", type=int, default=20, help="timed steps per layout")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps first")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--d-ff", type=int, default=2048)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="sequences per device (dp), per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    p.add_argument("--no-progress", action="store_true", help="(accepted; nothing to show)")
    a = p.parse_args(argv)
    a.layouts = parse_list(a.layout, ["dp", "tp"])
    a.engine_list = parse_list(a.engines, list(ENGINES))
    return a


# ---- the model (plain JAX; no collective anywhere) ----


def init_params(a, rng: np.random.Generator) -> dict:
    d, f = a.d_model, a.d_ff

    def normal(shape, scale):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    layers = [
        {
            "ln1": np.ones(d, np.float32),
            "wqkv": normal((d, 3 * d), d**-0.5),
            "wo": normal((d, d), d**-0.5),
            "ln2": np.ones(d, np.float32),
            "w1": normal((d, f), d**-0.5),
            "w2": normal((f, d), f**-0.5),
        }
        for _ in range(a.layers)
    ]
    return {
        "embed": normal((256, d), 0.02),
        "pos": normal((a.seq, d), 0.02),
        "ln_f": np.ones(d, np.float32),
        "layers": layers,
    }


def specs(params: dict, layout: str, axis: str):
    """The PartitionSpec of every parameter for a layout."""
    from jax.sharding import PartitionSpec as P

    def layer_spec(name: str):
        if layout != "tp":
            return P()
        return {
            "wqkv": P(None, axis),
            "w1": P(None, axis),
            "wo": P(axis, None),
            "w2": P(axis, None),
        }.get(name, P())

    return {
        "embed": P(),
        "pos": P(),
        "ln_f": P(),
        "layers": [{k: layer_spec(k) for k in lp} for lp in params["layers"]],
    }


def loss_fn(params, tokens, heads: int):
    import jax
    import jax.numpy as jnp

    x_in, y = tokens[:, :-1], tokens[:, 1:]
    x = params["embed"][x_in] + params["pos"][None, : x_in.shape[1]]
    s = x.shape[1]
    mask = jnp.tril(jnp.ones((s, s), bool))

    def rms(v, g):
        return v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + 1e-6) * g

    for p in params["layers"]:
        h = rms(x, p["ln1"])
        b, _, d = h.shape
        q, k, v = (t.reshape(b, s, heads, d // heads) for t in jnp.split(h @ p["wqkv"], 3, -1))
        sc = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads)
        att = jax.nn.softmax(jnp.where(mask, sc, -1e30), axis=-1)
        x = x + jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, d) @ p["wo"]
        x = x + jax.nn.gelu(rms(x, p["ln2"]) @ p["w1"]) @ p["w2"]
    logits = rms(x, params["ln_f"]) @ params["embed"].T
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, y[..., None].astype(jnp.int32), -1))


# ---- one launch (a child): every layout, timed ----


def child(a) -> None:
    info = sj.init()
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    free = bool(os.environ.get(FREE_ENV))
    devices = jax.local_devices()[:1] if free else jax.devices()
    n = len(devices)
    mesh = Mesh(np.array(devices), ("x",))
    rng = np.random.default_rng(a.seed)
    host_params = init_params(a, rng)
    engine = "free" if free else info.get("engine")
    out = {"engine": engine, "why": info.get("engine_why"), "layouts": {}}
    for layout in a.layouts:
        if free and layout != "dp":
            continue  # a tensor-parallel shard alone is not the same step: no bound for tp
        pspec = specs(host_params, layout, "x")
        shard = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), pspec)

        def put(h, sh):
            return jax.make_array_from_callback(h.shape, sh, lambda idx: h[idx])

        params = jax.tree_util.tree_map(put, host_params, shard)
        global_batch = a.batch * n if layout == "dp" else a.batch
        bspec = NamedSharding(mesh, P("x") if layout == "dp" else P())
        data = np.random.default_rng(a.seed + 1 + (jax.process_index() if free else 0)).integers(
            0, 256, size=(a.warmup + a.steps, global_batch, a.seq + 1), dtype=np.int32
        )

        def step(params, tokens):
            loss, grads = jax.value_and_grad(loss_fn)(params, tokens, a.heads)
            return loss, jax.tree_util.tree_map(lambda p, g: p - 0.01 * g, params, grads)

        step = jax.jit(step, in_shardings=(shard, bspec), out_shardings=(None, shard))
        losses, times = [], []
        for i in range(a.warmup + a.steps):
            tokens = put(data[i], bspec)
            align_processes(f"gspmd-{layout}-{i}")  # every process starts the step together
            t = time.perf_counter()
            loss, params = step(params, tokens)
            jax.block_until_ready((loss, params))
            dt = time.perf_counter() - t
            losses.append(float(loss))
            if i >= a.warmup:
                times.append(dt)
        recs = [r for r in sj.coverage() if r.compiled]
        rec = recs[-1] if recs else None
        out["layouts"][layout] = {
            "median_ms": statistics.median(times) * 1e3,
            "times_ms": [t * 1e3 for t in times],
            "losses": losses,
            "collectives": rec.compiled_where() if rec else [],
            "compiled": rec.compiled if rec else None,
        }
        if jax.process_index() == 0:
            print(
                f"{out['engine']:6s} {layout}: step {statistics.median(times) * 1e3:.2f} ms "
                f"(median of {a.steps}); {rec if rec else 'no collective'}",
                flush=True,
            )
    if jax.process_index() == 0 and os.environ.get(RESULT_ENV):
        Path(os.environ[RESULT_ENV]).write_text(json.dumps(out))


# ---- the parent: one launch per engine and round ----


def parent(a, argv) -> int:
    from strata_jax import launch

    engines = list(a.engine_list)
    if "mpi" in engines:
        reason = launch.mpi_unavailable_reason()
        if reason:
            print(f"# XLA over MPI left out: {reason}")
            engines.remove("mpi")
    info = machine_info()
    print(
        "# strata_jax GSPMD step benchmark (jit + NamedSharding; XLA's partitioner's collectives)"
    )
    print_machine(info)
    print(
        f"# model      : byte-level decoder, {a.layers} layers, d_model {a.d_model}, "
        f"{a.heads} heads, dense MLP d_ff {a.d_ff}, seq {a.seq}; batch {a.batch} sequences per "
        f"device (dp) / in all (tp); SGD; float32"
    )
    print(
        "# engines    : strata = XLA's collectives on strata's engine (libstrata_mpi.so); gloo ="
        " JAX's gloo; mpi = XLA over Open MPI through MPIwrapper, MPI initialised"
        " MPI_THREAD_MULTIPLE with every thread main (libstrata_mpi.so's STRATA_MPI_DELEGATE"
        " mode: out of the box XLA over MPI fails this step, 'Communicator requested from a"
        " thread that is not the one MPI was initialized from'), async dispatch off as"
        " strata_jax.init() sets it for MPI"
    )
    print(
        f"# compared   : {', '.join(engines)} (the engine between processes), {a.procs} processes, "
        f"{a.rounds} round(s) alternated, {a.steps} timed steps after {a.warmup}; times are "
        "medians of the steps of a launch, then the median over rounds"
    )
    a.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {e: [] for e in engines}
    rc = 0
    for _ in range(a.rounds):
        for engine in engines:
            note = (a.out / f".gspmd-{os.getpid()}-{engine}").resolve()
            note.unlink(missing_ok=True)
            cmd = [sys.executable, "-m", "strata_jax.launch", "-n", str(a.procs),
                   "--engine", "gloo" if engine == "free" else engine,
                   str(Path(__file__).resolve()), *argv]  # fmt: skip
            env = dict(os.environ, **{CHILD_ENV: "1", RESULT_ENV: str(note)})
            if engine == "free":
                env[FREE_ENV] = "1"
            if engine == "mpi":
                # XLA over the real MPI fails this step on every rank out of the box ("MPI:
                # Communicator requested from a thread that is not the one MPI was initialized
                # from": XLA's executor runs the step's collectives on its pool threads).
                # libstrata_mpi.so's delegate mode runs it over the same MPI with
                # MPI_THREAD_MULTIPLE and every thread main (native/mpiabi/abi/delegate.h).
                from strata_jax._src import engine as strata_engine

                env["STRATA_MPI_DELEGATE"] = os.environ["MPITRAMPOLINE_LIB"]
                env["MPITRAMPOLINE_LIB"] = strata_engine.library_path()
            r = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if r.returncode != 0:
                rc = r.returncode
                print(f"# {engine}: launch failed (exit {r.returncode}):\n{r.stderr[-2000:]}")
                continue
            for line in r.stdout.splitlines():
                if line.startswith("[rank 0] "):
                    print(f"#   {line[9:]}")
            if note.is_file():
                results[engine].append(json.loads(note.read_text()))
                note.unlink()
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    print(f"#\n# step time (ms), median over rounds; load {load}")
    if "free" in engines:
        print(
            "# free       : the bound, each process's share of the dp step on its own device, all"
            " at once, no collective; gloo/free is the most any engine could gain over gloo, and"
            " strata's share is (gloo - strata) / (gloo - free) of that gain"
        )
    compared = [e for e in engines if e not in ("strata", "free")]
    header = "| layout | " + " | ".join(f"{e} ms" for e in engines)
    header += "".join(f" | {e}/strata" for e in compared)
    if "free" in engines and "gloo" in engines:
        header += " | gloo/free (bound) | strata's share of the gain"
    header += " | losses |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    rows = []
    for layout in a.layouts:
        med = {}
        for e in engines:
            ms = [r["layouts"][layout]["median_ms"] for r in results[e] if layout in r["layouts"]]
            med[e] = statistics.median(ms) if ms else None
        same_job = [e for e in engines if e != "free"]  # free runs other batches, on one device
        ref = next((r["layouts"][layout]["losses"] for e in same_job for r in results[e]), None)
        same = all(
            np.allclose(r["layouts"][layout]["losses"], ref, rtol=1e-5, atol=1e-6)
            for e in same_job
            for r in results[e]
        )
        bitwise = all(r["layouts"][layout]["losses"] == ref for e in same_job for r in results[e])
        cells = " | ".join("-" if med[e] is None else f"{med[e]:.2f}" for e in engines)
        ratios = "".join(
            f" | {med[e] / med['strata']:.2f}" if med.get(e) and med.get("strata") else " | -"
            for e in compared
        )
        bound = {}
        if "free" in engines and "gloo" in engines:
            g, s_, f = med.get("gloo"), med.get("strata"), med.get("free")
            if g and s_ and f and g > f:
                bound = {"gloo_over_free": g / f, "strata_share": (g - s_) / (g - f)}
                ratios += f" | {g / f:.2f} | {100 * (g - s_) / (g - f):.0f} %"
            else:
                ratios += " | - | -"
        eq = "bitwise equal" if bitwise else ("equal within 1e-5" if same else "DIFFER")
        print(f"| {layout} | {cells}{ratios} | {eq} |")
        rows.append({"layout": layout, "median_ms": med, "losses": eq, **bound})
        if not same:
            rc = rc or 1
    write_json(
        a.out / f"gspmd_step_p{a.procs}.json",
        {"benchmark": "gspmd_step", "machine": info, "args": vars(a) | {"out": str(a.out)},
         "rows": rows, "launches": results},
    )  # fmt: skip
    print(f"# wrote {a.out / f'gspmd_step_p{a.procs}.json'}")
    return rc


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    if os.environ.get(CHILD_ENV):
        child(a)
        return 0
    return parent(a, argv)


if __name__ == "__main__":
    sys.exit(main())
