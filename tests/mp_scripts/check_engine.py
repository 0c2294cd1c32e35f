"""Unmodified JAX programs across processes: what they compute, and where XLA's collectives ran.

Run under ``python -m strata_jax.launch -n N [--engine gloo]`` (or in one process with N CPU
devices, ``python check_engine.py OUT SEED --devices N``), it runs programs nobody here wrote
for strata -- jit + NamedSharding data parallel, a matmul sharded on its contraction dimension,
a sharding constraint that forces an all-to-all, Flax NNX with partitioning annotations trained
with optax, jax.pmap with psum, shard_map with jax.lax collectives (no use_for_jax_lax), and a
shard_map strata call inside a GSPMD program -- and writes every device's part of every result
to OUT/<engine>_d<device>.npz. The test compares those files between engines bit for bit.

For each case it prints one ``CASE<tab>name<tab>where<tab>ops`` line: how many of the
collectives in the case's compiled programs run where (strata_jax.coverage()) and of which
kind, and ``ENGINE<tab>name<tab>counts``: the engine calls it made per operator (comm_stats()),
which tests/test_engine.py checks against the compiled programs. ``OK all`` at the end.
"""

from __future__ import annotations

import json
import os
import sys

OUT, SEED = sys.argv[1], int(sys.argv[2])
if "--devices" in sys.argv:  # one process, XLA's in-process communicator (the reference)
    os.environ["JAX_NUM_CPU_DEVICES"] = sys.argv[sys.argv.index("--devices") + 1]

import strata_jax as sj  # noqa: E402  (before jax: it picks the engine)

info = sj.init()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

engine = info.get("engine", "inproc")
n = jax.device_count()
devices = np.array(jax.devices())
mesh = Mesh(devices, ("x",))
rng = np.random.default_rng(SEED)
results: dict[str, np.ndarray] = {}  # name -> this process's data, per device


def put(a: np.ndarray, spec) -> jax.Array:
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])


position = {d.id: k for k, d in enumerate(devices)}  # the same in every run, whatever the ids


def keep(name: str, x) -> None:
    """Every addressable shard of x (or of each leaf) under name/<leaf>/d<device position>."""
    for i, leaf in enumerate(jax.tree_util.tree_leaves(x)):
        leaf = jnp.asarray(leaf) if not isinstance(leaf, jax.Array) else leaf
        for s in leaf.addressable_shards:
            results[f"{name}/{i}/d{position[s.device.id]}"] = np.asarray(s.data)


def engine_calls() -> dict[str, int]:
    ops = sj.comm_stats()["ops"]
    return {k: v["calls"] for k, v in ops.items()}


def case(name: str):
    """Runs the decorated function as one case: its results kept, its compiled programs'
    collectives and the engine calls they made printed."""

    def wrap(fn):
        before_rec, before = len(sj.coverage()), engine_calls()
        out = fn()
        jax.block_until_ready(out)
        keep(name, out)
        recs = sj.coverage()[before_rec:]
        where: dict[str, int] = {}
        ops: dict[str, int] = {}
        for r in recs:
            for loc, k in r.compiled_where().items():
                where[loc] = where.get(loc, 0) + k
            for op, ws in r.compiled.items():
                ops[op] = ops.get(op, 0) + sum(ws.values())
        after = engine_calls()
        delta = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
        w, o = json.dumps(where, sort_keys=True), json.dumps(ops, sort_keys=True)
        print(f"CASE\t{name}\t{w}\t{o}")
        print(f"ENGINE\t{name}\t{json.dumps(delta, sort_keys=True)}")
        return out

    return wrap


# ---- jit + NamedSharding data parallel: the partitioner all-reduces the gradients ----
@case("data_parallel")
def _():
    w1 = put(rng.standard_normal((16, 32)).astype(np.float32) * 0.3, P())
    w2 = put(rng.standard_normal((32, 4)).astype(np.float32) * 0.3, P())
    xs = put(rng.standard_normal((8 * n, 16)).astype(np.float32), P("x"))
    ys = put(rng.standard_normal((8 * n, 4)).astype(np.float32), P("x"))

    def loss(params, x, y):
        a, b = params
        return jnp.mean((jnp.tanh(x @ a) @ b - y) ** 2)

    @jax.jit
    def step(params, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        return value, jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)

    params, losses = (w1, w2), []
    for _ in range(3):
        value, params = step(params, xs, ys)
        losses.append(value)
    return losses, params


# ---- tensor parallel: a matmul sharded on its contraction dimension ----
@case("tensor_parallel")
def _():
    a = put(rng.standard_normal((16, 8 * n)).astype(np.float32), P(None, "x"))
    b = put(rng.standard_normal((8 * n, 4 * n)).astype(np.float32), P("x", None))
    rs = jax.jit(lambda a, b: a @ b, out_shardings=NamedSharding(mesh, P("x", None)))(a, b)
    ar = jax.jit(lambda a, b: a @ b, out_shardings=NamedSharding(mesh, P()))(a, b)
    ag = jax.jit(lambda b: b * 2.0, out_shardings=NamedSharding(mesh, P()))(b)
    prod = jax.jit(lambda b: jnp.prod(b[:, :2] * 0.5 + 1.0, axis=0))(b)  # a multiply all-reduce
    return rs, ar, ag, prod


# ---- a sharding constraint that forces an all-to-all ----
@case("all_to_all")
def _():
    c = put(rng.standard_normal((8 * n, 8 * n)).astype(np.float32), P("x", None))

    @jax.jit
    def f(c):
        d = jnp.sin(c)
        return jax.lax.with_sharding_constraint(d, NamedSharding(mesh, P(None, "x"))) * 2.0

    return f(c)


# ---- Flax NNX with partitioning annotations, trained with optax ----
@case("flax_nnx")
def _():
    import optax
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, din: int, dmid: int, dout: int, rngs: nnx.Rngs):
            init = nnx.initializers.lecun_normal()
            self.up = nnx.Linear(
                din, dmid, kernel_init=nnx.with_partitioning(init, (None, "x")), rngs=rngs
            )
            self.down = nnx.Linear(
                dmid, dout, kernel_init=nnx.with_partitioning(init, ("x", None)), rngs=rngs
            )

        def __call__(self, x):
            return self.down(jax.nn.gelu(self.up(x)))

    @nnx.jit
    def create():
        model = MLP(16, 8 * n, 4, rngs=nnx.Rngs(0))
        state = nnx.state(model)
        nnx.update(model, jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))
        return model

    with jax.set_mesh(mesh):
        model = create()
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

        @nnx.jit
        def train_step(model, optimizer, x, y):
            def loss_fn(model):
                return jnp.mean((model(x) - y) ** 2)

            loss, grads = nnx.value_and_grad(loss_fn)(model)
            optimizer.update(model, grads)
            return loss

        x = put(rng.standard_normal((8, 16)).astype(np.float32), P())
        y = put(rng.standard_normal((8, 4)).astype(np.float32), P())
        losses = [train_step(model, optimizer, x, y) for _ in range(3)]
    return losses, nnx.state(model, nnx.Param)


# ---- jax.pmap with jax.lax.psum ----
@case("pmap")
def _():
    local = jax.local_device_count()
    a = rng.standard_normal((n, 5)).astype(np.float32)
    first = jax.process_index() * local
    f = jax.pmap(lambda v: jax.lax.psum(v, "i") * 0.5, axis_name="i")
    return f(a[first : first + local])


# ---- shard_map with jax.lax collectives (no use_for_jax_lax) ----
@case("shard_map")
def _():
    from jax import shard_map

    x = put(rng.standard_normal((4 * n * n, 3)).astype(np.float32), P("x"))
    xi = put(rng.integers(-1000, 1000, size=(4 * n,)).astype(np.int32), P("x"))
    xh = put(rng.standard_normal((4 * n,)).astype(np.float16), P("x"))
    xb = put(rng.standard_normal((4 * n,)).astype(jnp.bfloat16), P("x"))
    ring = [(i, (i + 1) % n) for i in range(n)]

    def body(v, vi, vh, vb):
        return (
            jax.lax.psum(v, "x"),
            jax.lax.pmean(v, "x"),
            jax.lax.pmax(v, "x"),
            jax.lax.pmin(vi, "x"),
            jax.lax.psum(vi, "x"),
            jax.lax.all_gather(v, "x"),
            jax.lax.all_gather(v, "x", tiled=True),
            jax.lax.psum_scatter(v, "x", tiled=True),
            jax.lax.all_to_all(v, "x", 0, 0, tiled=True),
            jax.lax.ppermute(v, "x", ring),
            jax.lax.ppermute(v, "x", [(0, 1)]),
            jax.lax.psum(vh, "x"),  # float16: XLA's MPI path refuses it; strata's call runs it
            jax.lax.psum(vb, "x"),
        )

    specs = (P(), P(), P(), P(), P(), P(), P(), P("x"), P("x"), P("x"), P("x"), P(), P())
    f = shard_map(body, mesh=mesh, in_specs=(P("x"),) * 4, out_specs=specs, check_vma=False)
    f = jax.jit(f)
    return f(x, xi, xh, xb)


# ---- a strata call (shard_map) inside a GSPMD program: one fabric, one matching of calls ----
@case("mixed")
def _():
    from jax import shard_map

    w = put(rng.standard_normal((8, 8)).astype(np.float32), P())
    x = put(rng.standard_normal((4 * n, 8)).astype(np.float32), P("x"))
    exchange = shard_map(
        lambda h: sj.all_to_all(h, "x", 0, 0, tiled=True),
        mesh=mesh,
        in_specs=P("x"),
        out_specs=P("x"),
    )

    @jax.jit
    def f(w, x):
        h = jnp.tanh(x @ w)
        h = exchange(h)
        return jnp.sum(h * h), h.mean(axis=0)

    return [f(w, x) for _ in range(2)]


np.savez(os.path.join(OUT, f"{engine}_p{jax.process_index()}.npz"), **results)
print(f"ENGINE_INFO {engine} {info.get('engine_why', '')}")
print("OK all")
