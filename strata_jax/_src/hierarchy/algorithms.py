"""The hierarchical algorithms: strata inside each fabric, XLA's collectives between (traced with
jnp and lowered with ``mlir.lower_fun``; see the package's docstring for each one), and
:func:`lower_across_fabrics`, the hook of the collectives' lowering.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax._src import mpi_engine, operators, runtime
from strata_jax._src.hierarchy.checks import check_across, check_on, lower_checked
from strata_jax._src.hierarchy.plan import Plan, plan
from strata_jax._src.hierarchy.steps import (
    REDUCERS,
    a2a_divert_p,
    after_p,
    gate,
    partition_id_p,
    rs_divert_p,
    step,
    strata_step_done,
)
from strata_jax._src.jax_compat import mlir


def _slot_table(p: Plan) -> np.ndarray:
    """The fabric slot of every partition in its group ([num partitions] int32)."""
    table = np.zeros(p.groups.size, np.int32)
    for row in p.groups:
        table[row] = p.f
    return table


def _my_slot(p: Plan):
    """This partition's fabric slot in its group (int32 scalar, from the partition id)."""
    return jnp.asarray(_slot_table(p))[partition_id_p.bind().astype(jnp.int32)]


def _pairs(groups) -> list[tuple[int, int]]:
    """Both directions of every two-member group: the exchange of a two-fabric inter step."""
    return [(int(a), int(b)) for g in groups for a, b in ((g[0], g[1]), (g[1], g[0]))]


# From this many bytes per rank, the two-fabric exchange runs as two one-way rounds (below);
# STRATA_ONE_WAY_BYTES overrides it when a program is lowered (0: always; a huge value: never).
ONE_WAY_BYTES = 256 * 1024


def _one_way_bytes() -> int:
    return runtime.env_bytes("STRATA_ONE_WAY_BYTES", ONE_WAY_BYTES, "262144 or 256K; 0: always")


def _ring_psum() -> bool:
    """``STRATA_RING_PSUM=0`` (read when a program is lowered): the two-fabric psum crosses in
    the two one-way rounds of :func:`_exchange` instead of along :func:`_ring` (the form before
    the ring, kept for A/B measurements)."""
    return runtime.env_bool(
        "STRATA_RING_PSUM", True, "1, the default: along the ring; 0: two one-way rounds"
    )


def _nbytes(x) -> int:
    return int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize


def _ring(p: Plan):
    """The two-fabric ring: member l of fabric slot 0 sends to member l of slot 1, which sends
    to member l + 1 (mod L) of slot 0. Every rank sends once and receives once, all in one
    collective-permute, and every gloo connection carries one direction only: one connection
    carrying both directions of an exchange moves them by turns (see :func:`_exchange`),
    while here each host sends with all its members and receives with all of them at once.
    Needs L >= 2. Returns (pairs over every group, dst, src): ``dst[s][l]``/``src[s][l]`` the
    local index, in the other slot, that member l of slot s sends to / receives from."""
    dst = [[lo for lo in range(p.L)], [(lo + 1) % p.L for lo in range(p.L)]]
    src = [[(lo - 1) % p.L for lo in range(p.L)], [lo for lo in range(p.L)]]
    pairs = [
        (int(g[p.rank_of(s, lo)]), int(g[p.rank_of(1 - s, dst[s][lo])]))
        for g in p.groups
        for s in range(2)
        for lo in range(p.L)
    ]
    return pairs, dst, src


def _per_intra_group(p: Plan, rows) -> tuple[int, ...]:
    """A strata placement table, one row per intra-fabric group (native: the row of the group
    a member runs in): ``rows[s]`` for the groups of fabric slot s (one row: all alike)."""
    return tuple(
        int(b)
        for i in range(len(p.intra))
        for b in np.asarray(rows[i % p.F if len(rows) > 1 else 0]).ravel()
    )


def _exchange(send, p: Plan):
    """The partner's ``send``: the exchange of a two-fabric step over ``p.inter`` (groups of
    two, one member per fabric), by XLA's collective-permute.

    One collective-permute in both directions of every pair moves each pair's two messages
    over one gloo connection, and there they take turns: measured between simulated hosts
    over 1 Gbit/s links (launch --netns), 4 MiB each way took 65 ms where one way took 34 ms,
    the link's time. From ``ONE_WAY_BYTES`` per rank, psum's exchange therefore runs as two
    collective-permutes in which every pair moves one way, odd and even groups in opposite
    directions: in each round a host sends with half its members and receives with the other
    half, so both directions of its link are busy and each connection carries one message at a
    time. Each rank sends its buffer once and receives the partner's once, in one of the two
    rounds; the result is selected by the partition id (no arithmetic on the values).
    Measured at 1 Gbit/s (two A/B runs, load 23-28): psum 72-80 % of the link bound against
    46-57 % with one collective-permute, all_to_all 61-74 % against 48-52 %. (psum's shards,
    psum_scatter's and all_to_all's blocks now cross along :func:`_ring` instead, in one
    round; psum takes this form only with ``STRATA_RING_PSUM=0``.)
    """
    nbytes = int(np.prod(send.shape)) * send.dtype.itemsize
    groups = np.asarray(p.inter)
    one_round = nbytes < _one_way_bytes() or len(groups) < 2 or mpi_engine.selected()
    send = gate(send, carry=one_round)  # read by both rounds: after the call's check once
    # Not over XLA's MPI collectives: the two rounds are independent, and XLA's executor runs
    # one of them on a thread of its pool, where MPI refuses it ("MPI: Communicator requested
    # from a thread that is not the one MPI was initialized from"; every psum from 512 KiB per
    # rank failed so under mpirun between simulated hosts with 1 Gbit/s links). gloo's
    # both-ways turns are gloo's; MPI's one collective-permute reached 78 % of the link there.
    if one_round:
        return step(send, "permute", "xla", p.inter, pairs=_pairs(p.inter))
    first = [(int(g[i % 2]), int(g[1 - i % 2])) for i, g in enumerate(groups)]
    second = [(b, a) for a, b in first]
    got_first = step(send, "permute", "xla", p.inter, pairs=first)
    got_second = step(send, "permute", "xla", p.inter, pairs=second)
    table = np.zeros(groups.size, np.bool_)
    for _, b in first:
        table[b] = True  # receives in the first round
    in_first = jnp.asarray(table)[partition_id_p.bind().astype(jnp.int32)]
    return jax.lax.select(jnp.broadcast_to(in_first, send.shape), got_first, got_second)


_REDUCE_NAMES = {code: kind for kind, code in operators.REDUCE_CODES_BY_KIND.items()}


_KEY_TYPES = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32, 8: jnp.int64}


def _xla_all_reduce(x, groups, reduce: str):
    """XLA's all-reduce over ``groups``, with pmax/pmin of floats made to propagate NaN.

    gloo's max/min drop NaN (max(NaN, 5) = 5 on some ranks, NaN on others). Floats therefore
    cross as integer keys in IEEE-754 total order (the sign-magnitude bits with the magnitude
    flipped for negatives, so that integer order is float order), with every NaN made +NaN for
    max and -NaN for min, the ends of that order: a NaN anywhere wins on every rank. A tie of
    -0.0 and +0.0 gives +0.0 for max and -0.0 for min (IEEE-754 maximum/minimum). Same bytes,
    one collective.
    """
    if reduce not in ("max", "min") or not jnp.issubdtype(x.dtype, jnp.floating):
        return step(x, "all_reduce", "xla", groups, reduce=reduce)
    key_t = _KEY_TYPES[jnp.dtype(x.dtype).itemsize]
    flip = jnp.array(jnp.iinfo(key_t).max, key_t)  # every bit but the sign
    nan = jnp.array(jnp.nan if reduce == "max" else -jnp.nan, x.dtype)
    b = jax.lax.bitcast_convert_type(jnp.where(jnp.isnan(x), nan, x), key_t)
    k = jnp.where(b < 0, b ^ flip, b)
    k = step(k, "all_reduce", "xla", groups, reduce=reduce)
    return jax.lax.bitcast_convert_type(jnp.where(k < 0, k ^ flip, k), x.dtype)


def all_reduce(x, p: Plan, reduce: str):
    if p.L == 1 or not p.uniform:
        return _xla_all_reduce(x, p.groups, reduce)
    v = x.reshape(-1)
    m = v.shape[0]
    chunk = -(-m // p.L)
    if chunk * p.L != m:  # padding stays inside: sliced off before returning
        v = jnp.pad(v, (0, chunk * p.L - m))
    v = step(v, "reduce_scatter", "strata", p.intra, reduce=reduce)
    if p.F == 2:
        ring = _ring_psum() and _nbytes(v) >= _one_way_bytes()
        # crosses, and all_gather_reduce reads it too: after the call's check once
        v = gate(v, carry=not ring)
        # Two fabrics: one exchange of the shard with the partner (the same bytes as gloo's
        # ring all-reduce, one round instead of two), combined with the own shard inside the
        # intra-fabric all_gather (native all_gather_reduce: one pass, no XLA reduction). Both
        # partners put fabric slot 0's shard first (z_first), so every rank holds the same bits.
        #
        # From ONE_WAY_BYTES per rank the shards cross along the ring (_ring: one
        # collective-permute, every rank sends its shard and receives one at once, every
        # connection one way) instead of the two one-way rounds of _exchange: member l of slot s
        # receives the other fabric's partial sum of shard src[s][l], whose own partial is the
        # x of member src[s][l] of its own fabric (x_from; in slot 1 that is itself, in slot 0
        # the member before it), and the all_gather_reduce pairs them there. No select of two
        # rounds' results (one pass over the shard) and no zero-filled buffer of the round in
        # which a rank receives nothing. The same sums (two operands, slot 0's first).
        if ring:
            pairs, _, src = _ring(p)
            x_from = np.full(p.groups.size, -1, np.int64)
            for g in p.groups:
                for s in range(2):
                    for lo in range(p.L):
                        x_from[g[p.rank_of(s, lo)]] = g[p.rank_of(s, src[s][lo])]
            z = step(v, "permute", "xla", p.groups, pairs=pairs)
        else:
            x_from = ()
            z = _exchange(v, p)
        v = step(
            v,
            "all_gather_reduce",
            "strata",
            p.intra,
            reduce=reduce,
            z=z,
            z_first=_slot_table(p),
            x_from=x_from,
        )
    else:
        v = _xla_all_reduce(v, p.inter, reduce)
        v = step(v, "all_gather", "strata", p.intra)
    return v[:m].reshape(x.shape)


def all_gather(x, p: Plan):
    if p.L == 1 or not p.uniform:
        return step(x, "all_gather", "xla", p.groups)
    if p.F == 2 and 0 < _nbytes(x) >= _one_way_bytes():
        # Two fabrics, from ONE_WAY_BYTES per rank: the own block crosses along the ring
        # (_ring: one collective-permute, every connection one way; member l of slot s receives
        # the block of member src[s][l] of the other slot), and the gather inside runs in two
        # parts into one output: the own fabric's blocks between the check and the crossing,
        # the blocks that crossed after it, written into the same buffer (aliased; no
        # concatenation of own and received blocks, none copied twice). Under launch --netns at
        # 1 Gbit/s (two A/B runs, load 6-7): 83-85/86-90 % of the link bound at 4/16 MiB
        # against 76-79/76-79 % with gloo's all-gather of the pairs (below); the crossing
        # started at once after the check instead of after the own blocks: 84-89/89 %, the same
        # within the noise, but two independent calls on a device are what the program-order
        # chain exists to avoid (docs/design.md), so the crossing reads the first part.
        # (A ring whose two blocks were concatenated for one gather inside gave no clear gain
        # over the pairs: 64-89/74-91 % against 72-74/51-82 % in four A/B runs, load 4-16; with
        # the check right before the crossing it was 62-72 % at 4 MiB in three.)
        pairs, _, src = _ring(p)
        rows = [
            [
                p.rank_of(s, lo) if f == 0 else p.rank_of(1 - s, src[s][lo])
                for lo in range(p.L)
                for f in range(2)
            ]
            for s in range(2)
        ]
        place = _per_intra_group(p, rows)
        own = step(x, "all_gather_part", "strata", p.intra, placement=place, part=0)
        # The crossing after the first part (which comes after the check: program-order chain)
        got = step(after_p.bind(x, own), "permute", "xla", p.groups, pairs=pairs)
        return step(got, "all_gather_part", "strata", p.intra, z=own, placement=place, part=1)
    v = step(x, "all_gather", "xla", p.inter)  # [F*k]: own local index, every fabric
    # Inside the fabric, block (l, f) goes straight to its place in group order, perm_lf()[l*F
    # + f]: no reorder pass over the whole output afterwards.
    return step(v, "all_gather", "strata", p.intra, placement=_per_intra_group(p, [p.perm_lf()]))


def reduce_scatter(x, p: Plan, reduce: str):
    if p.L == 1 or not p.uniform:
        return step(x, "reduce_scatter", "xla", p.groups, reduce=reduce)
    n = p.F * p.L
    k = x.shape[0] // n
    # Inside the fabric, member l sums the blocks (l, f), f < F, i.e. group blocks perm_lf()[l*F
    # + f], read where they are: no reorder pass over the whole input first.
    if k == 0:  # nothing to reduce (XLA rejects empty collectives at verification)
        return jnp.zeros((0, *x.shape[1:]), x.dtype)
    if p.F == 2:
        # Two fabrics: send the partner's block, reduce the one received into the own (the
        # same bytes as gloo's reduce-scatter, measured 1.5x faster at 16 MiB, 7x at 64 KiB).
        # Strata writes the partner's block to a result of its own (no slice copied out).
        # From ONE_WAY_BYTES per rank the block crosses along the ring (_ring): each member
        # sends the block of the member it sends to, and receives its own from another, so the
        # intra-fabric step's rows differ per fabric. Under launch --netns (two A/B runs against
        # the pairs' exchange, load 9-16): 83-88/87-89 % of the link bound at 4/16 MiB and
        # 1 Gbit/s against 60-81/52-84 %, 27-32/34-44 % at 10 Gbit/s against 28-29/32-33 %.
        ring = _nbytes(x) // n >= _one_way_bytes()
        if ring:
            pairs, dst, _ = _ring(p)
            rows = [
                [
                    p.rank_of(s, lo) if f == s else p.rank_of(1 - s, dst[s][lo])
                    for lo in range(p.L)
                    for f in range(2)
                ]
                for s in range(2)
            ]
        else:
            rows = [p.perm_lf()]
        v, send = rs_divert_p.bind(
            x,
            groups=tuple(map(tuple, p.intra)),
            reduce=reduce,
            placement=_per_intra_group(p, rows),
            divert=tuple(int(o) for o in 1 - _slot_table(p)),
        )
        strata_step_done()  # the call's check, chained after this strata step
        if ring:
            got = step(send, "permute", "xla", p.groups, pairs=pairs)
        else:
            got = step(send, "permute", "xla", p.inter, pairs=_pairs(p.inter))
        w = v.reshape(2, k, *x.shape[1:])
        return REDUCERS[reduce].bind(
            jax.lax.dynamic_index_in_dim(w, _my_slot(p), keepdims=False), got
        )
    v = step(
        x,
        "reduce_scatter",
        "strata",
        p.intra,
        reduce=reduce,
        placement=_per_intra_group(p, [p.perm_lf()]),
    )
    return step(v, "reduce_scatter", "xla", p.inter, reduce=reduce)


def all_to_all(x, p: Plan, split_axis: int, concat_axis: int):
    """Tiled all_to_all, with no data movement besides the two exchanges.

    x's split axis is viewed as [F (dest fabric slot), L*b] (a free reshape). Inside the
    fabric, strata splits the L*b part by destination local index and concatenates what it
    receives along the concat axis (source local index major): each member then holds, for
    every destination fabric, one contiguous-by-slot aggregate of everything its fabric sends
    to its own local index there. Across fabrics, XLA's all_to_all splits the F axis and
    concatenates along the same concat axis (source fabric major), so the concat axis ends up
    in (f, l) order: group order whenever the group lists each fabric's members together (else
    one static reorder of the n source blocks). No transposes: the strata copy is strided.
    """
    n = len(p.groups[0])
    if p.L == 1 or not p.uniform:
        return step(x, "all_to_all", "xla", p.groups, split=split_axis, concat=concat_axis)
    s, c = split_axis, concat_axis
    fl = p.perm_fl()  # group ranks in (f, l) order
    in_order = np.array_equal(fl, np.arange(n))
    shape = x.shape
    b = shape[s] // n
    if not in_order:  # destination blocks into (f, l) order (one static gather)
        x = _take_blocks(x, s, n, fl)
    v = x.reshape(*shape[:s], p.F, p.L * b, *shape[s + 1 :])
    c1 = c if c < s else c + 1  # the concat axis in v (c == s: the L*b part)
    if p.F == 2:
        # Two fabrics: only the partner fabric's aggregate moves (one collective-permute of
        # half the buffer; XLA's all_to_all copies both halves out and back in). Strata writes
        # it to a second result, so it crosses with no slice copied out of v, and what comes
        # back is written in place of the half strata left unwritten (v has no other reader).
        others = 1 - _slot_table(p)  # the partner fabric's slot, per partition
        k = c1 - 1 if c1 > s else c1  # where F goes: just before the concat part
        # From ONE_WAY_BYTES per rank (the half that crosses) the aggregates cross along the
        # ring (_ring, one collective-permute, every connection one way): each member gathers
        # the aggregate of the member it sends to (dest: its local index, per partition).
        # Under launch --netns against the two one-way rounds (two A/B runs, load 11-16), %
        # of the link bound at 4/16 MiB: 1 Gbit/s 82-92/89-91 against 90/58-84, 10 Gbit/s
        # 35-42/45-47 against 27-34/29-49.
        ring = _nbytes(x) // 2 >= _one_way_bytes()
        dest = np.zeros(p.groups.size, np.int64)
        pairs, dst, _ = _ring(p)
        for g in p.groups:
            for j in range(n):
                dest[g[j]] = dst[p.f[j]][p.loc[j]] if ring else p.loc[j]
        v, send = a2a_divert_p.bind(
            v,
            groups=tuple(map(tuple, p.intra)),
            split=s + 1,
            concat=c1,
            divert_axis=s,
            divert=tuple(int(o) for o in others),
            move_to=k,
            divert_dest=tuple(int(d) for d in dest),
        )
        strata_step_done()  # the call's check, chained after this strata step
        # v comes in the final layout: F moved to k and merged with the concat part (strata
        # writes it so; no transpose). The block that comes back has F of size 1, so its bytes
        # are already in that order, and the update is the last op on v (a reshape or a
        # transpose fused with it made XLA copy the whole of v first).
        if ring:
            got = step(send, "permute", "xla", p.groups, pairs=pairs)
        else:
            got = _exchange(send, p)
        width = send.shape[c1]
        got = got.reshape(*v.shape[:k], width, *v.shape[k + 1 :])
        v = jax.lax.dynamic_update_slice_in_dim(v, got, (1 - _my_slot(p)) * width, axis=k)
    else:
        v = step(v, "all_to_all", "strata", p.intra, split=s + 1, concat=c1)
        v = step(v, "all_to_all", "xla", p.inter, split=s, concat=c1)  # axis s: F -> 1
        v = v.reshape(*v.shape[:s], *v.shape[s + 1 :])  # c1 - 1 == c when c >= s
    if not in_order:  # source blocks from (f, l) order back into group order
        v = _take_blocks(v, c, n, np.argsort(fl))
    return v


def _take_blocks(v, axis: int, n: int, order: np.ndarray):
    """v with its ``axis`` cut into n equal blocks, block i of the result = block order[i]."""
    w = v.reshape(*v.shape[:axis], n, v.shape[axis] // n, *v.shape[axis + 1 :])
    return jnp.take(w, order, axis=axis).reshape(v.shape)


def _bits_or(a, b):
    if a.dtype == np.bool_:
        return a | b
    if jnp.issubdtype(a.dtype, jnp.integer):
        return a | b
    u = jnp.dtype(f"uint{8 * a.dtype.itemsize}")
    return jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(a, u) | jax.lax.bitcast_convert_type(b, u), a.dtype
    )


def permute(x, p: Plan, sources: np.ndarray):
    pairs = [(int(s), d) for d, s in enumerate(sources.tolist()) if s >= 0]
    full = [(int(g[s]), int(g[d])) for g in p.groups for s, d in pairs]
    if p.L == 1 or not p.uniform or jnp.issubdtype(x.dtype, jnp.complexfloating):
        return step(x, "permute", "xla", p.groups, pairs=full)
    fab = np.array([p.f[s] == p.f[d] for s, d in pairs], bool)
    inside = [pr for pr, same in zip(pairs, fab, strict=True) if same]
    across = [pr for pr, same in zip(pairs, fab, strict=True) if not same]
    out = None
    if across:
        cross = [(int(g[s]), int(g[d])) for g in p.groups for s, d in across]
        out = step(x, "permute", "xla", p.groups, pairs=cross)
    if inside:
        # Partition pairs of the intra steps; strata runs them when every fabric slot has the
        # same local pattern (one permutation for all intra groups).
        local = {(int(p.f[s]), int(p.loc[s]), int(p.loc[d])) for s, d in inside}
        per_slot = [{(a, b) for f, a, b in local if f == s} for s in range(p.F)]
        intra_pairs = [(int(g[s]), int(g[d])) for g in p.groups for s, d in inside]
        if all(ps == per_slot[0] for ps in per_slot):
            lp = sorted(per_slot[0])
            ip = [(grp[a], grp[b]) for grp in p.intra for a, b in lp]
            y = step(x, "permute", "strata", p.intra, pairs=ip)
        else:
            y = step(x, "permute", "xla", p.groups, pairs=intra_pairs)
        out = y if out is None else _bits_or(out, y)
    if out is None:
        out = jnp.zeros_like(x)
    return out


def _permute_rides(p: Plan, sources: np.ndarray) -> bool:
    """Whether :func:`permute`'s step between fabrics can cross inside the check's message
    (checks.PendingCheck.carry): each of its pairs joins members of one check group (the same
    local index in both fabrics; any pair when XLA's step takes the whole group). A ring's
    pairs do not (local 1 of one fabric sends to local 0 of the next): its check is not held
    back for a step that cannot ride in it."""
    if p.L == 1 or not p.uniform:
        return True
    pairs = [(int(s), d) for d, s in enumerate(sources.tolist()) if s >= 0]
    across = [(s, d) for s, d in pairs if p.f[s] != p.f[d]]
    return bool(across) and all(p.loc[s] == p.loc[d] for s, d in across)


def broadcast(x, p: Plan, root: int):
    if p.L == 1 or not p.uniform:
        v = step(x.reshape(1, *x.shape), "all_gather", "xla", p.groups)
        return v[root]
    fs, ls = int(p.f[root]), int(p.loc[root])
    v = step(x.reshape(1, *x.shape), "all_gather", "xla", p.inter)[fs]  # x of (fs, my l)
    v = step(v.reshape(1, *x.shape), "all_gather", "strata", p.intra)
    return v[ls]


def lower_across_fabrics(ctx, x, target: str, axes: tuple, attrs: dict):
    """The hook of ``collectives.ffi_call_lowering``: lowers ``target`` hierarchically when
    its groups span fabrics; returns None when every group lies inside one fabric."""
    p = plan(ctx, axes)
    if p is None:
        return None
    op = operators.api_of_target(target, attrs.get("reduce"))
    extra = tuple(sorted((k, np.asarray(v).tolist()) for k, v in attrs.items()))
    if ctx.avals_in[0].size == 0:
        (out_aval,) = ctx.avals_out

        def nothing(v):
            if check_on():  # kept although unused: the check has a side effect
                check_across(p, op, extra, ctx.avals_in[0], ctx)
            return jnp.zeros(out_aval.shape, out_aval.dtype)

        return mlir.lower_fun(nothing, multiple_results=False)(ctx, x)
    defer = True
    if target == "strata_all_reduce":
        fn = lambda v: all_reduce(v, p, _REDUCE_NAMES[int(attrs["reduce"])])  # noqa: E731
    elif target == "strata_psum_scatter":
        fn = lambda v: reduce_scatter(v, p, _REDUCE_NAMES[int(attrs["reduce"])])  # noqa: E731
    elif target == "strata_all_gather":
        fn = lambda v: all_gather(v, p)  # noqa: E731
    elif target == "strata_all_to_all":
        s, c = int(attrs["split_axis"]), int(attrs["concat_axis"])
        fn = lambda v: all_to_all(v, p, s, c)  # noqa: E731
    elif target == "strata_ppermute":
        src = np.asarray(attrs["sources"])
        fn = lambda v: permute(v, p, src)  # noqa: E731
        defer = _permute_rides(p, src)
    elif target == "strata_pbroadcast":
        r = int(attrs["root"])
        fn = lambda v: broadcast(v, p, r)  # noqa: E731
    else:
        raise NotImplementedError(
            f"strata_jax: {target} over a group that spans fabric domains is not supported yet "
            f"(groups {p.groups.tolist()} cross fabrics); keep its axis inside one host."
        )
    return lower_checked(fn, ctx, [x], False, p, op, extra, ctx.avals_in[0], defer)
