"""A Flax model trained data parallel with optax inside ``jax.shard_map``, on jax.lax and on
strata (``strata_jax.use_for_jax_lax()``), side by side.

The model code is plain Flax/optax/JAX, written against ``jax.lax``: a small CNN with
``BatchNorm(axis_name="data")`` (batch statistics averaged over the data axis), the loss
averaged over the data axis, the gradients averaged with ``jax.lax.pmean``, an optax adam
update, every device holding the parameters (``P()``) and its slice of the batch
(``P("data")``). Nothing in it names strata: ``use_for_jax_lax()`` lowers every collective of
the step to strata, the ones JAX inserts itself included (the psums that transpose the
implicit ``pvary`` of the replicated parameters under ``check_vma=True``).

It prints the losses of both (bitwise equal), the coverage line of each compiled step
(``strata_jax.coverage()``: how many collectives went to strata, in how many calls) and the
step times, jax.lax and strata alternated, medians. ``--per-leaf`` adds strata with the
all-reduce combiner off (``STRATA_COMBINE_BYTES=0``: one strata call per all-reduce)::

    python docs/examples/flax_data_parallel.py                    # 4 CPU devices, one process
    python -m strata_jax.launch -n 2 docs/examples/flax_data_parallel.py   # 2 processes
                                   # (jax.lax then runs over gloo, strata over shared memory)

Options: ``--devices`` (one process), ``--batch`` (per device), ``--image``, ``--steps`` (timed
steps per round), ``--rounds``, ``--no-batchnorm``, ``--no-check-vma``, ``--per-leaf``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=4, help="CPU devices in one process")
    p.add_argument("--batch", type=int, default=16, help="examples per device per step")
    p.add_argument("--image", type=int, default=16, help="image side (pixels)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds, jax.lax and strata alternated")
    p.add_argument("--batchnorm", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--check-vma", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--per-leaf",
        action="store_true",
        help="also time strata with one call per all-reduce (STRATA_COMBINE_BYTES=0)",
    )
    return p.parse_args(argv)


def start(devices: int):
    """Imports strata_jax before JAX creates its CPU backend; under strata_jax.launch connects
    the processes (strata_jax.init). Returns (strata_jax, jax)."""
    from strata_jax.launch import distributed_env

    denv = distributed_env()
    if denv is None:
        os.environ["JAX_NUM_CPU_DEVICES"] = str(devices)
    import strata_jax as sj  # noqa: I001  (before jax's backend: it sizes XLA's launch pool)
    import jax

    if denv is None:
        jax.config.update("jax_num_cpu_devices", devices)
    else:
        sj.init()
    return sj, jax


def build(
    mesh,
    *,
    batchnorm: bool = True,
    check_vma: bool = True,
    image: int = 16,
    features: tuple = ((8, 1), (16, 2)),
    hidden: int = 32,
):
    """The model, its initial state and the jitted training step over ``mesh`` (axis "data").

    The model: per (channels, stride) of ``features`` a 3x3 convolution, BatchNorm over the
    data axis (``batchnorm``) and relu; a mean over the image, a dense layer of ``hidden``
    units with relu, a dense layer of 10 logits.

    Returns (step, state): ``step(state, x, y) -> (state, loss)`` with state = (params,
    batch_stats, opt_state), replicated on every device; x [B, image, image, 3] float32 and y
    [B] int32 sharded over "data"; loss the mean over the whole batch (float32 scalar).
    """
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = True):
            for channels, stride in features:
                x = nn.Conv(channels, (3, 3), strides=stride)(x)
                if batchnorm:
                    x = nn.BatchNorm(use_running_average=not train, axis_name="data")(x)
                x = nn.relu(x)
            x = nn.relu(nn.Dense(hidden)(x.mean(axis=(1, 2))))
            return nn.Dense(10)(x)

    model = CNN()
    tx = optax.adam(1e-3)
    variables = model.init(jax.random.key(0), jnp.zeros((2, image, image, 3)), train=False)
    params = variables["params"]
    state = (params, variables.get("batch_stats", {}), tx.init(params))

    def step(state, x, y):
        params, stats, opt = state

        def loss_fn(p):
            if batchnorm:
                logits, upd = model.apply(
                    {"params": p, "batch_stats": stats}, x, mutable=["batch_stats"]
                )
                new_stats = upd["batch_stats"]
            else:
                logits, new_stats = model.apply({"params": p}, x), stats
            local = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return jax.lax.pmean(local, "data"), new_stats

        (loss, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        grads = jax.lax.pmean(grads, "data")  # as pmap-era code does (needed without check_vma)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), new_stats, opt), loss

    sharded = jax.shard_map(
        step,
        mesh=mesh,
        in_specs=(P(), P("data"), P("data")),
        out_specs=(P(), P()),
        check_vma=check_vma,
    )
    replicated = NamedSharding(mesh, P())
    state = jax.device_put(state, replicated)
    return jax.jit(sharded, donate_argnums=0), state


def batches(mesh, n: int, batch: int, image: int, seed: int = 1):
    """``n`` (x, y) batches of ``batch`` examples per device, sharded over "data" (the same
    random numbers on every process)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(seed)
    total = batch * mesh.devices.size
    data = NamedSharding(mesh, P("data"))
    out = []
    for _ in range(n):
        x = rng.standard_normal((total, image, image, 3)).astype(np.float32)
        y = rng.integers(0, 10, size=(total,)).astype(np.int32)
        out.append((jax.device_put(x, data), jax.device_put(y, data)))
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    sj, jax = start(args.devices)
    import numpy as np
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()), ("data",))
    main_rank = jax.process_index() == 0
    say = print if main_rank else (lambda *a, **k: None)
    data = batches(mesh, args.steps, args.batch, args.image)
    impls = {"jax.lax": False, "strata": True}
    if args.per_leaf:
        impls["per-leaf"] = True  # strata, compiled with STRATA_COMBINE_BYTES=0
    step, state0 = {}, {}
    for name in impls:
        step[name], state0[name] = build(
            mesh, batchnorm=args.batchnorm, check_vma=args.check_vma, image=args.image
        )
    say(
        f"{mesh.devices.size} devices in {jax.process_count()} process(es); batch "
        f"{args.batch}/device, {args.image}x{args.image} images, BatchNorm "
        f"{'on' if args.batchnorm else 'off'}, check_vma={args.check_vma}"
    )

    # Losses of the first steps from the same start, and each step's coverage line.
    losses = {}
    for name, on in impls.items():
        combine = os.environ.get("STRATA_COMBINE_BYTES")
        if name == "per-leaf":  # read when the step is lowered (its first call)
            os.environ["STRATA_COMBINE_BYTES"] = "0"
        with sj.use_for_jax_lax(on):
            state, ls = state0[name], []
            for x, y in data:
                state, loss = step[name](state, x, y)
                ls.append(float(loss))
            state0[name] = state
        if name == "per-leaf":
            os.environ.pop("STRATA_COMBINE_BYTES")
            if combine is not None:
                os.environ["STRATA_COMBINE_BYTES"] = combine
        losses[name] = ls
        rec = [r for r in sj.coverage() if r.program.startswith("jit_step")][-1]
        say(f"{name:8s} losses {' '.join(f'{v:.6f}' for v in ls)}")
        say(f"{name:8s} coverage: {rec}")
    same = all(ls == losses["jax.lax"] for ls in losses.values())
    say(f"losses bitwise equal: {same}")

    # Step times: rounds of --steps steps, jax.lax and strata alternated; medians.
    times = {name: [] for name in impls}
    for r in range(args.rounds):
        order = list(impls) if r % 2 == 0 else list(impls)[::-1]
        for name in order:
            with sj.use_for_jax_lax(impls[name]):
                state = state0[name]
                for x, y in data:
                    t = time.perf_counter()
                    state, loss = step[name](state, x, y)
                    loss.block_until_ready()
                    times[name].append(time.perf_counter() - t)
                state0[name] = state
    med = {name: statistics.median(ts) for name, ts in times.items()}
    load = os.getloadavg()[0]
    say(
        f"step time, median of {args.rounds} x {args.steps} (load {load:.1f} on "
        f"{os.cpu_count()} cores): jax.lax {med['jax.lax'] * 1e3:.2f} ms, strata "
        f"{med['strata'] * 1e3:.2f} ms: strata is {med['jax.lax'] / med['strata']:.2f}x "
        "faster than jax.lax"
    )
    if "per-leaf" in med:
        c = med["per-leaf"] / med["strata"]
        say(
            f"strata with one call per all-reduce {med['per-leaf'] * 1e3:.2f} ms: combined is "
            f"{max(c, 1 / c):.2f}x {'faster' if c >= 1 else 'slower'} than one call per "
            "all-reduce"
        )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
