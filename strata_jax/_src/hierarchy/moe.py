"""MoE dispatch/combine across fabrics: the same semantics, layout, drop rule and gradients as
inside one fabric, with each token row crossing to each other fabric once.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from strata_jax._src import lowering, operators
from strata_jax._src.hierarchy.algorithms import all_gather, reduce_scatter
from strata_jax._src.hierarchy.checks import check_across, check_on, lower_checked
from strata_jax._src.hierarchy.plan import Plan, plan
from strata_jax._src.hierarchy.steps import step
from strata_jax._src.jax_compat import core, mlir


def _acc(dtype):
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


# dispatch inside one fabric of rows gathered across fabrics: x [F*T, H] (the tokens of the
# group ranks with this local index, fabric slot major), weights [F*T, K] or [0, K], slots [N, K]
# in that order, counts [E_local] -> recv [E_local, C, H]; the native dispatch over ``groups``.
_intra_dispatch_p = core.Primitive("strata_moe_dispatch_in_fabric")
_intra_dispatch_p.def_abstract_eval(
    lambda x, w, slots, counts, *, groups, capacity, weighted: x.update(
        shape=(counts.shape[0], capacity, x.shape[1])
    )
)
mlir.register_lowering(
    _intra_dispatch_p,
    lambda ctx, x, w, slots, counts, *, groups, capacity, weighted: lowering.lower_strata_call(
        ctx,
        "strata_moe_dispatch",
        "moe.dispatch",
        [x, w, slots, counts],
        np.asarray(groups, np.int64),
        weighted=np.int64(weighted),
    ),
    platform="cpu",
    cacheable=False,
)


def _moe_dispatch(x, w, slots, counts, p: Plan, out_shape, weighted: bool):
    """recv [E_local, C, H] on this rank from every rank's x, by this rank's slot plan.

    Uniform layouts (F fabrics of L members): each rank's token rows cross to each other fabric
    once, to the member with the same local index (XLA's all_gather over the inter groups), so
    every member holds the rows of its local index in every fabric; then strata's dispatch
    inside the fabric pulls into each expert slot the one row it needs from the member holding
    it (the slot plan re-indexed to that layout). Otherwise every row reaches every rank
    through the hierarchical all_gather and is scattered into its slots locally (a repeated
    expert shares one slot).
    """
    el, c, h = out_shape
    n, k = slots.shape
    if p.L > 1 and p.uniform:
        t = x.shape[0]
        xf = step(x, "all_gather", "xla", p.inter)  # [F*T, H], fabric slot order
        wf = step(w, "all_gather", "xla", p.inter) if weighted else w
        held = np.array(  # global token held at row j of fabric member l, (l, j) order
            [p.rank_of(f, lo) * t + i for lo in range(p.L) for f in range(p.F) for i in range(t)],
            np.int32,
        )
        return _intra_dispatch_p.bind(
            xf,
            wf,
            slots[held] if n else slots,
            counts,
            groups=tuple(map(tuple, p.intra)),
            capacity=c,
            weighted=weighted,
        )
    xa = all_gather(x, p)  # [N, H], global token order
    flat = slots.reshape(-1)
    tgt = jnp.where(flat >= 0, flat, el * c)
    rows = jnp.repeat(xa, k, axis=0)  # [(g, k), H]
    if weighted:
        wa = all_gather(w, p)  # [N, K]
        same = (slots[:, :, None] == slots[:, None, :]) & (slots[:, None, :] >= 0)
        wsum = (wa[:, None, :] * same).sum(-1)  # weights of the choices naming the slot
        rows = (rows.astype(wa.dtype) * wsum.reshape(-1)[:, None]).astype(x.dtype)
    recv = jnp.zeros((el * c, h), x.dtype).at[tgt].set(rows, mode="drop")
    return recv.reshape(el, c, h)


def _moe_partials(ey, w, slots, p: Plan):
    """[N, H] (accumulator dtype): each global token's weighted rows of this rank's experts."""
    el, c, h = ey.shape
    n, k = slots.shape
    wa = all_gather(w, p).astype(_acc(ey.dtype))  # [N, K]
    if el * c == 0:  # capacity 0: every pair dropped (and a gather from 0 rows is rejected)
        return jnp.zeros((n, h), wa.dtype)
    flat = slots.reshape(-1)
    valid = flat >= 0
    rows = ey.reshape(el * c, h)[jnp.where(valid, flat, 0)].astype(wa.dtype)
    rows = jnp.where(valid[:, None], rows * wa.reshape(-1)[:, None], 0)
    return rows.reshape(n, k, h).sum(1)


def lower_moe_across_fabrics(ctx, target: str, args, axes: tuple, attrs: dict):
    """The hook of the MoE primitives' lowering: when the expert axis spans fabrics, dispatch,
    combine and the weight-gradient gather are lowered as hierarchical collectives (the same
    semantics, layout, drop rule and gradients; the plan is computed in JAX as before):

    - dispatch: each token row crosses to each other fabric once (to the member with the same
      local index), then strata's dispatch inside the fabric pulls every slot's row from the
      member that holds it;
    - combine: each rank forms one partial row per global token from its experts (weighted,
      in the accumulator dtype), then a hierarchical psum_scatter: partial sums inside each
      fabric (strata) before the 1/L shard crosses back;
    - gather (d weights): the same psum_scatter on the per-choice scalars.

    Returns None when the axis lies inside one fabric.
    """
    p = plan(ctx, axes)
    if p is None:
        return None
    op = operators.api_of_target(target)
    extra = (
        tuple((a.shape, str(a.dtype)) for a in ctx.avals_in[1:]),
        tuple(sorted((k, np.asarray(v).tolist()) for k, v in attrs.items())),
    )

    if all(a.size == 0 for a in ctx.avals_out) or (
        target == "strata_moe_dispatch" and ctx.avals_in[0].size == 0
    ):
        avals = ctx.avals_out

        def nothing(first, *rest):  # no tokens anywhere: every slot stays zero
            if check_on():  # kept although unused: the check has a side effect
                check_across(p, op, extra, ctx.avals_in[0], ctx)
            return [jnp.zeros(a.shape, a.dtype) for a in avals]

        return mlir.lower_fun(nothing, multiple_results=True)(ctx, *args)

    if target == "strata_moe_dispatch":
        shape = ctx.avals_out[0].shape
        weighted = bool(int(attrs["weighted"]))

        def fn(x, w, slots, counts):
            return _moe_dispatch(x, w, slots, counts, p, shape, weighted)

        return lower_checked(fn, ctx, args, False, p, op, extra, ctx.avals_in[0])
    if target == "strata_moe_combine":
        part_aval = ctx.avals_out[1]

        def fn(ey, w, slots, rows):
            y = reduce_scatter(_moe_partials(ey, w, slots, p), p, "sum").astype(ey.dtype)
            return [y, jnp.zeros(part_aval.shape, part_aval.dtype)]

        return lower_checked(fn, ctx, args, True, p, op, extra, ctx.avals_in[0])
    if target == "strata_moe_gather":

        def fn(values, slots, idx):
            flat = values.reshape(-1)
            if flat.size == 0:  # capacity 0: every slot is -1 (a gather from 0 rows is rejected)
                v = jnp.zeros(slots.shape, values.dtype)
            else:
                v = jnp.where(slots >= 0, flat[jnp.where(slots >= 0, slots, 0)], 0)
            return reduce_scatter(v.astype(values.dtype), p, "sum")

        return lower_checked(fn, ctx, args, False, p, op, extra, ctx.avals_in[0])
    api = operators.api_of_target(target)
    raise NotImplementedError(
        f"strata_jax: {api} over a group that spans fabric domains (hosts) is not supported "
        "yet. Keep the expert axis inside one host (e.g. a ('host', 'expert') mesh with the "
        "experts on the inner axis), or use the normal-mode dispatch/combine across hosts."
    )
