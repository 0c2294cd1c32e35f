"""MoE dispatch/combine: strata_jax.moe against XLA pipelines built on jax.lax.all_to_all.

DeepEP-like shapes scaled to this machine (defaults: T=1024 tokens per rank, H=1024, E=32
experts, top-K=4, R=8 in-process CPU devices, float32), uniform random routing. Implementations,
all inside ``jax.jit(jax.shard_map(...))`` over one mesh axis of R devices:

* ``strata``: :func:`strata_jax.moe.dispatch` / :func:`strata_jax.moe.combine` (routing plan in
  JAX, rows pulled zero-copy from the peers' buffers, combine reduced on the expert ranks first).
* ``gshard``: the GShard formulation (Lepikhin et al. 2020): one-hot dispatch tensor
  [T, E, C_src] (C_src = ceil(capacity_factor * T * K / E) slots per source rank and expert),
  ``einsum('tec,th->ech')``, ``jax.lax.all_to_all`` to the expert ranks, the reverse
  ``all_to_all`` and ``einsum('tec,ech->th')`` with the weighted combine tensor.
* ``xla-gather`` (``--impl`` to include it; on by default): the same all_to_all pipeline with
  index gathers instead of one-hot einsums (what a tuned JAX MoE does), a stronger baseline.

strata's capacity is R * C_src per expert, so ``recv_x`` has the same shape [E/R, R*C_src, H] in
every implementation; with the default capacity factor nothing is dropped and the outputs of all
implementations must agree (checked on every run; drops are reported).

Timed phases (medians of --iters blocking calls after --warmup, implementations interleaved
round-robin): ``dispatch`` (x, routing -> recv_x), ``combine`` (expert rows, weights -> y) and
``d+c`` (one program: dispatch, a per-expert scale as the "expert", combine). Bandwidth: token
bytes moved per rank / time, where bytes = (token, destination rank) pairs * H * itemsize (the
rows a DeepEP-style dispatch sends and a combine receives), averaged over ranks.

Usage::

    python benchmarks/moe.py                       # defaults above
    python benchmarks/moe.py --tokens 512 --hidden 2048 --experts 64 --topk 8 --dtype bfloat16
    python benchmarks/moe.py --devices 4 --impl strata,xla-gather --iters 20

By default the script re-runs itself under ``LD_PRELOAD=libstrata_alloc.so`` (the deployment
shape, as ``strata-launch`` does), which serves every implementation's large XLA buffers from
reused, already-registered memory; ``--no-preload`` measures plain glibc (fresh pages each call).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import format_size, parse_list  # noqa: E402
from _machine import print_header, reexec_with_allocator  # noqa: E402
from _report import Table, write_csv, write_json  # noqa: E402
from _timing import median, stream_add_step, time_interleaved  # noqa: E402

IMPLS = ("strata", "gshard", "xla-gather")


def xla_gather_pipeline(axis: str, R: int, E: int, cs: int) -> SimpleNamespace:
    """The "xla-gather" MoE pipeline (sort/gather + ``jax.lax.all_to_all``), for use inside
    ``jax.shard_map`` over ``axis`` (size R): ``strata_jax.moe._sort``, the code of
    ``moe_mlp(impl="xla_sort")``, bound to one axis, expert count and per-source capacity
    ``cs`` (``cs`` = T: nothing is ever dropped). Token ids must be distinct per token.

    Returns a namespace with ``dispatch(x [T, H], idx [T, K]) -> recv [E/R, R*cs, H]``,
    ``combine(expert_y, idx, w [T, K]) -> y [T, H]`` and the pieces ``positions``,
    ``to_experts``, ``from_experts`` (shared with the GShard pipeline).
    """
    import jax
    import jax.numpy as jnp

    from strata_jax.moe import _sort as sort_pipe

    def positions(i):
        """[T, E] position of each token in its expert's per-source block, kept mask."""
        onehot = jax.nn.one_hot(i, E, dtype=jnp.int32).sum(1)  # [T, E] (distinct ids)
        pos = jnp.cumsum(onehot, axis=0) - onehot
        keep = (onehot > 0) & (pos < cs)
        return pos, keep

    def to_experts(xd):  # [E, cs, H] per source -> [E/R, R*cs, H] per expert rank
        return sort_pipe.to_experts(xd, axis, R)

    def from_experts(e):  # [E/R, R*cs, H] -> [E, cs, H] back at the source
        return sort_pipe.from_experts(e, axis, R)

    def dispatch(x, i):
        _, src = sort_pipe.slots(i, E, cs)
        return to_experts(sort_pipe.gather_blocks(x, src, E, cs))

    def combine(e, i, w):
        flat, _ = sort_pipe.slots(i, E, cs)
        return sort_pipe.combine_rows(from_experts(e), flat, w)

    return SimpleNamespace(
        positions=positions,
        to_experts=to_experts,
        from_experts=from_experts,
        dispatch=dispatch,
        combine=combine,
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tokens", type=int, default=1024, help="tokens per rank T (1024)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size H (1024)")
    p.add_argument("--experts", type=int, default=32, help="experts E, divisible by R (32)")
    p.add_argument("--topk", type=int, default=4, help="experts per token K (4)")
    p.add_argument("--devices", type=int, default=8, help="in-process CPU devices R (8)")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16, float16 (float32)")
    p.add_argument(
        "--capacity-factor",
        type=float,
        default=1.5,
        help="slots per (source rank, expert) = ceil(cf * T * K / E) (1.5)",
    )
    p.add_argument("--impl", default=",".join(IMPLS), help=f"comma list of {', '.join(IMPLS)}")
    p.add_argument("--iters", type=int, default=10, help="timed calls per phase (10)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up calls per phase (2)")
    p.add_argument(
        "--no-preload",
        action="store_true",
        help="do not re-run under LD_PRELOAD=libstrata_alloc.so (registration-on-"
        "allocation pool; without it every large XLA buffer is fresh mmapped "
        "pages and page faults dominate every implementation)",
    )
    p.add_argument(
        "--mode",
        choices=("normal", "low_latency"),
        default="normal",
        help="normal: bandwidth at --tokens (the table above); low_latency: per-call latency "
        "p50/p99 of dispatch and combine at decode sizes (--ll-tokens), strata's low-latency "
        "mode (pull and push) vs its normal mode vs xla-gather",
    )
    p.add_argument(
        "--ll-tokens", default="1,8,32,128", help="tokens per rank for --mode low_latency"
    )
    p.add_argument("--ll-iters", type=int, default=200, help="timed calls per point (200)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench_out"), help="folder for CSV/JSON")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    impls = parse_list(args.impl, IMPLS)
    allocator = reexec_with_allocator(not args.no_preload)
    args.allocator = allocator
    if "not found" in allocator:
        print("# warning    : libstrata_alloc.so not found; running without it", file=sys.stderr)
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}"
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import strata_jax as sj  # before jax creates its backend

    R, T, H, E, K = args.devices, args.tokens, args.hidden, args.experts, args.topk
    if E % R:
        raise SystemExit(f"--experts {E} must be divisible by --devices {R}")
    if len(jax.devices()) < R:
        raise SystemExit(f"need {R} devices, have {len(jax.devices())}")
    if args.mode == "low_latency":
        return low_latency(args)
    el = E // R
    cs = math.ceil(args.capacity_factor * T * K / E)  # slots per (source rank, expert)
    cap = R * cs
    dt = jnp.dtype(args.dtype)
    mesh = Mesh(np.array(jax.devices()[:R]), ("ep",))
    spec = P("ep")

    rng = np.random.default_rng(args.seed)
    # uniform routing, K distinct experts per token (as a softmax top-k gives)
    idx = np.argsort(rng.random((R * T, E)), axis=1)[:, :K].astype(np.int32)
    w = rng.random((R * T, K)).astype(np.float32)
    w /= w.sum(1, keepdims=True)
    # Every input already sharded over the mesh, as a model's activations are: the timed
    # phases then time the phase, not a host transfer or a resharding of their inputs.
    sharded = NamedSharding(mesh, spec)
    x = jax.device_put(jnp.asarray(rng.standard_normal((R * T, H)), dt), sharded)
    scale = jnp.asarray(rng.uniform(0.5, 1.5, E), dt)
    ey = jax.device_put(jnp.asarray(rng.standard_normal((E, cap, H)), dt), sharded)
    wj = jax.device_put(jnp.asarray(w, dt), sharded)
    idx_host = idx
    idx = jax.device_put(idx, sharded)

    def expert_scale(recv):  # the "expert": row-wise, so padding rows stay irrelevant
        s = jax.lax.dynamic_slice(scale, (jax.lax.axis_index("ep") * el,), (el,))
        return recv * s[:, None, None]

    def smap(body, n_in, out_specs):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * n_in, out_specs=out_specs))

    # ---- strata ----------------------------------------------------------------------
    def s_dispatch(x, i):
        recv, lay = sj.moe.dispatch(x, i, num_experts=E, axis_name="ep", capacity=cap)
        return recv, dataclasses.replace(lay, dropped=lay.dropped[None])  # rank-1 to leave

    def s_combine(e, lay, w):
        return sj.moe.combine(e, dataclasses.replace(lay, dropped=lay.dropped[0]), w)

    def s_full(x, i, w):
        recv, lay = sj.moe.dispatch(x, i, num_experts=E, axis_name="ep", capacity=cap)
        return sj.moe.combine(expert_scale(recv), lay, w), lay.dropped[None]

    # ---- GShard (one-hot einsums) and xla-gather, both over jax.lax.all_to_all ---------
    pipe = xla_gather_pipeline("ep", R, E, cs)
    positions, to_experts, from_experts = pipe.positions, pipe.to_experts, pipe.from_experts

    def g_tensors(i, w):
        pos, keep = positions(i)
        disp = jax.nn.one_hot(jnp.where(keep, pos, cs), cs, dtype=dt)  # [T, E, cs]
        we = jnp.zeros((T, E), w.dtype).at[jnp.arange(T)[:, None], i].add(w)
        return disp, disp * we[:, :, None]

    def g_dispatch(x, i):
        disp, _ = g_tensors(i, jnp.ones(i.shape, dt))  # weights unused here
        return to_experts(jnp.einsum("tec,th->ech", disp, x))

    def g_combine(e, i, w):
        _, comb = g_tensors(i, w)
        return jnp.einsum("tec,ech->th", comb, from_experts(e))

    def g_full(x, i, w):
        disp, comb = g_tensors(i, w)
        recv = to_experts(jnp.einsum("tec,th->ech", disp, x))
        return jnp.einsum("tec,ech->th", comb, from_experts(expert_scale(recv)))

    x_dispatch, x_combine = pipe.dispatch, pipe.combine

    def x_full(x, i, w):
        return x_combine(expert_scale(x_dispatch(x, i)), i, w)

    fns: dict[str, object] = {}
    lay_spec = None
    if "strata" in impls:
        f_sd = smap(s_dispatch, 2, spec)
        _, lay = f_sd(x, idx)
        lay_spec = jax.tree.map(lambda _: spec, lay)
        f_sc = jax.jit(
            jax.shard_map(s_combine, mesh=mesh, in_specs=(spec, lay_spec, spec), out_specs=spec)
        )
        f_sf = smap(s_full, 3, (spec, spec))
        fns["strata dispatch"] = lambda: f_sd(x, idx)[0]
        fns["strata combine"] = lambda: f_sc(ey, lay, wj)
        fns["strata d+c"] = lambda: f_sf(x, idx, wj)[0]
    baselines = {
        "gshard": (g_dispatch, g_combine, g_full),
        "xla-gather": (x_dispatch, x_combine, x_full),
    }
    for name, (disp, comb, full) in baselines.items():
        if name in impls:
            f_d, f_c, f_f = smap(disp, 2, spec), smap(comb, 3, spec), smap(full, 3, spec)
            fns[f"{name} dispatch"] = lambda f_d=f_d: f_d(x, idx)
            fns[f"{name} combine"] = lambda f_c=f_c: f_c(ey, idx, wj)
            fns[f"{name} d+c"] = lambda f_f=f_f: f_f(x, idx, wj)

    # ---- bytes and reference --------------------------------------------------------
    dest = idx_host // el
    pairs = sum(len(set(row.tolist())) for row in dest)  # (token, destination rank) pairs
    bytes_per_rank = pairs * H * dt.itemsize / R
    src_pos = np.zeros((R, E), np.int64)
    drops_src = 0
    for g in range(R * T):
        for e in idx_host[g]:
            s = g // T
            drops_src += src_pos[s, e] >= cs
            src_pos[s, e] += 1
    ref = np.zeros((R * T, H), np.float64)
    xs, sc = np.asarray(x, np.float64), np.asarray(scale, np.float64)
    wf = np.asarray(wj, np.float64)
    for k in range(K):
        ref += (wf[:, k] * sc[idx_host[:, k]])[:, None] * xs

    info = print_header(print, f"# allocator  : {args.allocator}")
    print(
        f"# moe        : R={R} T={T}/rank H={H} E={E} K={K} dtype={dt.name} "
        f"capacity={cap} per expert (= R * {cs}, cf {args.capacity_factor}), "
        f"{pairs / (R * T):.2f} destination ranks per token"
    )
    print(
        f"# bytes      : {format_size(bytes_per_rank)} of token rows per rank, one per (token, "
        f"destination rank); impls {', '.join(impls)}; {args.iters} iters after "
        f"{args.warmup} warm-up"
    )

    # The memory floor of a phase: the bytes its output forces it to move, all ranks, at the
    # bandwidth of these devices measured now (STREAM add). Dispatch reads each token row once
    # per destination rank and writes all of recv_x [E/R, cap, H]: every row of it is defined
    # (a routed token's row, or zeros past the count), so none can be skipped. Combine reads
    # each routed (token, expert) row once and writes y [T, H] (the run fails on any drop, so
    # every routed row is read). d+c adds the "expert"'s own pass: every rank reads its whole
    # recv_x and writes the scaled copy.
    recv_bytes = R * el * cap * H * dt.itemsize
    slot_rows = sum(len({e for e in row.tolist() if e >= 0}) for row in idx_host)
    traffic = {
        "dispatch": R * bytes_per_rank + recv_bytes,
        "combine": (slot_rows + R * T) * H * dt.itemsize,
    }
    expert_traffic = 2 * recv_bytes
    traffic["d+c"] = traffic["dispatch"] + traffic["combine"] + expert_traffic
    # STREAM add over the larger phase's traffic, timed in the same alternations as the phases
    # (its median under the same load, not a burst of its own before or after them).
    fns["stream add"], stream_bytes = stream_add_step(
        mesh, max(traffic["dispatch"], traffic["combine"])
    )
    times, outs = time_interleaved(fns, args.iters, args.warmup)
    med = {k: median(v) for k, v in times.items()}
    stream = stream_bytes / med.pop("stream add") / 1e9

    tol = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}.get(dt.name, 1e-4)
    checks = {}
    for name in impls:
        y = np.asarray(outs[f"{name} d+c"], np.float64)
        checks[name] = float(np.abs(y - ref).max() / max(1e-30, np.abs(ref).max()))
    strata_drops = int(np.asarray(f_sf(x, idx, wj)[1]).sum()) if "strata" in impls else 0

    table = Table.of(
        "impl 10 | phase 8 | time(ms) 9 .2f | GB/s/rank 9 .2f | floor(ms) 9 .2f | "
        "x floor 7 .2f | vs strata 9 .2f"
    )
    print(
        f"# floor      : the bytes each phase must move, all ranks (dispatch: token rows "
        f"read once per destination rank + all of recv_x written, "
        f"{format_size(traffic['dispatch'])}; combine: routed rows read + y written, "
        f"{format_size(traffic['combine'])}; d+c: both + the expert's read and write of "
        f"recv_x, {format_size(traffic['d+c'])}) at {stream:.1f} GB/s, the STREAM add "
        "bandwidth of these devices (median of its calls, timed in turns with the phases); "
        "x floor = time / floor (below 1 where streaming stores beat the in-place add); "
        "GB/s/rank = the floor's bytes per rank / time"
    )
    for line in table.header_lines():
        print(line)
    rows = []
    for name in impls:
        for phase in ("dispatch", "combine", "d+c"):
            t = med[f"{name} {phase}"]
            nbytes = traffic[phase] / R
            st = med.get(f"strata {phase}")
            ratio = t / st if st else None
            floor = traffic[phase] / (stream * 1e9)
            print(
                table.row([name, phase, t * 1e3, nbytes / t / 1e9, floor * 1e3, t / floor, ratio])
            )
            rows.append(
                dict(
                    impl=name,
                    phase=phase,
                    time_ms=t * 1e3,
                    gbps_per_rank=nbytes / t / 1e9,
                    floor_ms=floor * 1e3,
                    times_floor=t / floor,
                    stream_gbs=stream,
                    slowdown_vs_strata=ratio,
                )
            )
    print(
        "# check      : max |y - dense reference| / max |reference| = "
        + ", ".join(f"{k} {v:.2e}" for k, v in checks.items())
        + f" (tolerance {tol:g}); drops: strata {strata_drops}, per-source-capacity "
        f"pipelines {int(drops_src)}"
    )
    if "strata" in impls:
        for other in impls:
            if other != "strata":
                r = med[f"{other} d+c"] / med["strata d+c"]
                verdict = "meets" if r >= 1.5 else "misses"
                print(
                    f"# goal       : strata dispatch+combine is {r:.2f}x {other} "
                    f"({verdict} the 1.5x goal)"
                )
    ok = all(v <= tol for k, v in checks.items()) and strata_drops == 0 and drops_src == 0
    write_csv(args.out / "moe.csv", rows)
    write_json(args.out / "moe.json", dict(machine=info, args=vars(args), rows=rows, checks=checks))
    if not ok:
        print("# RESULT MISMATCH or drops: see the check line above", file=sys.stderr)
        return 1
    return 0


def low_latency(args: argparse.Namespace) -> int:
    """--mode low_latency: per-call latency of dispatch and combine at decode sizes.

    For every T in --ll-tokens, all inside jit(shard_map) over R devices, implementations
    interleaved call by call (--ll-iters timed calls each after --warmup):
    ``strata-ll`` (low_latency_dispatch/combine, default algo "pull": destinations read),
    ``strata-ll-push`` (the same, sources write), ``strata`` (normal mode: ids all_gather
    + dispatch, two-phase combine; capacity R*T) and ``xla-gather`` (sort/gather +
    jax.lax.all_to_all, cs = T per source and expert). Every receive buffer is [E/R, R*T, H]
    and nothing is dropped; each implementation's dispatch -> combine (identity experts) is
    checked against the dense numpy result first.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import strata_jax as sj

    R, H, E, K = args.devices, args.hidden, args.experts, args.topk
    dt = jnp.dtype(args.dtype)
    mesh = Mesh(np.array(jax.devices()[:R]), ("ep",))
    spec = P("ep")
    tokens = [int(t) for t in parse_list(args.ll_tokens)]
    impls = ["strata-ll", "strata-ll-push", "strata", "xla-gather"]

    def smap(body, in_specs, out_specs):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))

    info = print_header(print, f"# allocator  : {args.allocator}")
    print(
        f"# moe ll     : R={R} H={H} E={E} K={K} dtype={dt.name}, T per rank {tokens}; "
        f"receive buffer [E/R, R*T, H] for every impl; {args.ll_iters} timed calls per "
        f"(impl, phase, T) after {args.warmup}, interleaved call by call; p50/p99 of "
        "per-call wall time (jitted shard_map, blocked)"
    )
    print(f"# impls      : {', '.join(impls)}")
    table = Table.of(
        "T/rank 6 | impl 14 | disp p50 us 11 .0f | disp p99 us 11 .0f | comb p50 us 11 .0f | "
        "comb p99 us 11 .0f | p50 speedup 11 .2f"
    )
    for line in table.header_lines():
        print(line)
    rows, ok = [], True
    rng = np.random.default_rng(args.seed)

    def point(T: int) -> bool:
        """Times one T; appends its rows; returns whether its checks passed."""
        ok = True

        # Inputs placed sharded over the mesh once (a single-device array would be resharded
        # on every call, and that copy would dominate the latencies measured here).
        def put(a):
            return jax.device_put(a, NamedSharding(mesh, spec))

        idx = put(np.argsort(rng.random((R * T, E)), axis=1)[:, :K].astype(np.int32))
        w = rng.random((R * T, K)).astype(np.float32)
        w /= w.sum(1, keepdims=True)
        x = put(jnp.asarray(rng.standard_normal((R * T, H)), dt))
        wj = put(jnp.asarray(w, dt))
        ey = put(jnp.asarray(rng.standard_normal((E, R * T, H)), dt))
        pipe = xla_gather_pipeline("ep", R, E, T)

        fns: dict[str, object] = {}
        full: dict[str, object] = {}
        for algo, name in (("pull", "strata-ll"), ("push", "strata-ll-push")):

            def d(x, i, algo=algo):
                recv, _, h = sj.moe.low_latency_dispatch(
                    x, i, num_experts=E, axis_name="ep", algo=algo
                )
                return recv, h

            def dc(x, i, w, algo=algo):
                recv, _, h = sj.moe.low_latency_dispatch(
                    x, i, num_experts=E, axis_name="ep", algo=algo
                )
                return sj.moe.low_latency_combine(recv, h, w)

            fd = smap(d, (spec, spec), spec)
            _, h = fd(x, idx)
            fc = smap(
                lambda e, h, w: sj.moe.low_latency_combine(e, h, w),
                (spec, jax.tree.map(lambda _: spec, h), spec),
                spec,
            )
            fns[f"{name} dispatch"] = lambda fd=fd: fd(x, idx)[0]
            fns[f"{name} combine"] = lambda fc=fc, h=h: fc(ey, h, wj)
            full[name] = smap(dc, (spec,) * 3, spec)

        def nd(x, i):
            recv, lay = sj.moe.dispatch(x, i, num_experts=E, axis_name="ep")
            return recv, dataclasses.replace(lay, dropped=lay.dropped[None])

        def nc(e, lay, w):
            return sj.moe.combine(e, dataclasses.replace(lay, dropped=lay.dropped[0]), w)

        def ndc(x, i, w):
            recv, lay = sj.moe.dispatch(x, i, num_experts=E, axis_name="ep")
            return sj.moe.combine(recv, lay, w)

        f_nd = smap(nd, (spec, spec), spec)
        _, lay = f_nd(x, idx)
        f_nc = smap(nc, (spec, jax.tree.map(lambda _: spec, lay), spec), spec)
        fns["strata dispatch"] = lambda: f_nd(x, idx)[0]
        fns["strata combine"] = lambda: f_nc(ey, lay, wj)
        full["strata"] = smap(ndc, (spec,) * 3, spec)
        f_xd = smap(pipe.dispatch, (spec, spec), spec)
        f_xc = smap(pipe.combine, (spec,) * 3, spec)
        fns["xla-gather dispatch"] = lambda: f_xd(x, idx)
        fns["xla-gather combine"] = lambda: f_xc(ey, idx, wj)
        full["xla-gather"] = smap(
            lambda x, i, w: pipe.combine(pipe.dispatch(x, i), i, w), (spec,) * 3, spec
        )

        ref = np.asarray(x, np.float64) * np.asarray(wj, np.float64).sum(1, keepdims=True)
        tol = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}.get(dt.name, 1e-4)
        errs = {}
        for name, f in full.items():
            y = np.asarray(f(x, idx, wj), np.float64)
            errs[name] = float(np.abs(y - ref).max() / max(1e-30, np.abs(ref).max()))
            ok &= errs[name] <= tol

        times, _ = time_interleaved(fns, args.ll_iters, args.warmup)
        base = float(np.median(times["strata-ll dispatch"]) + np.median(times["strata-ll combine"]))
        for name in impls:
            td, tc = np.array(times[f"{name} dispatch"]), np.array(times[f"{name} combine"])
            d50, d99 = np.percentile(td, [50, 99]) * 1e6
            c50, c99 = np.percentile(tc, [50, 99]) * 1e6
            speed = (d50 + c50) / 1e6 / base  # >1: strata-ll is faster than this impl
            print(table.row([T, name, d50, d99, c50, c99, speed]))
            rows.append(
                dict(
                    tokens=T,
                    impl=name,
                    dispatch_p50_us=d50,
                    dispatch_p99_us=d99,
                    combine_p50_us=c50,
                    combine_p99_us=c99,
                    strata_ll_speedup_p50=speed,
                    max_rel_err=errs[name],
                )
            )
        return ok

    for T in tokens:
        ok &= point(T)
    print(
        "# p50 speedup: (this impl's dispatch p50 + combine p50) / strata-ll's; > 1 means "
        "strata-ll (low-latency mode, pull) is faster than this impl"
    )
    print(
        "# check      : dispatch -> combine (identity experts) vs dense numpy, max rel err: "
        + ", ".join(
            f"T={r['tokens']} {r['impl']} {r['max_rel_err']:.1e}" for r in rows if r["impl"]
        )
    )
    write_csv(args.out / "moe_low_latency.csv", rows)
    write_json(args.out / "moe_low_latency.json", dict(machine=info, args=vars(args), rows=rows))
    if not ok:
        print("# RESULT MISMATCH: see the check line above", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
