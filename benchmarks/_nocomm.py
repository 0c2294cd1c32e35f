"""The communication-free bound of a workload (the ``nocomm`` and ``meet`` impls of
train_moe.py, train_recsys.py and serve_moe.py): the baseline's program with every jax.lax
exchange replaced by identity, optionally with a meeting of the ranks in its place.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

NOCOMM_DESC = (
    "the baseline's computation with every jax.lax exchange replaced by identity (wrong "
    "results: the bound no communication library can beat at this size)"
)


def _meeting(axis_name: Any) -> Callable[[Any], Any]:
    """Identity on a pytree that waits until every rank of ``axis_name`` has reached it: one
    strata psum of its arrays' first elements (float32, one per array: bytes that do not count),
    on which each array's first element then depends (+ 0), so everything after the exchange
    waits for it in the compiled program too, and no two meetings merge. Its VJP meets again,
    as the exchange it replaces has one in the backward pass (all_to_all's transpose is an
    all_to_all; psum's cotangent crosses back in shard_map). Leaves that are not JAX arrays
    (``psum(1, axis)``) pass through untouched, as in nocomm; with no array leaf there is no
    meeting."""
    import jax
    import jax.numpy as jnp

    import strata_jax

    def meet(xs: list[Any]) -> list[Any]:
        real = [i for i, x in enumerate(xs) if x.size and x.dtype != jax.dtypes.float0]
        if not real:
            return xs
        firsts = [xs[i].reshape(-1)[:1].astype(jnp.float32) for i in real]
        tok = strata_jax.psum(jnp.concatenate(firsts), axis_name)
        out = list(xs)
        for j, i in enumerate(real):
            # The data depend on the meeting: + 0 from the psum's result (nan_to_num: 0 whatever
            # the sum is), one elementwise pass that XLA fuses into the next loop fusion where
            # it can. An optimization barrier would not do: XLA:CPU drops it when compiling,
            # and the work after the exchange ran before the meeting; updating one element in
            # place made XLA copy the array twice.
            zero = jnp.nan_to_num(tok[j] * 0.0).astype(xs[i].dtype)
            out[i] = xs[i] + zero
        return out

    f = jax.custom_vjp(meet)
    f.defvjp(lambda xs: (meet(xs), None), lambda _, g: (meet(list(g)),))

    def apply(tree: Any) -> Any:
        leaves, treedef = jax.tree.flatten(tree)
        idx = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
        if not idx:
            return tree
        for i, x in zip(idx, f([leaves[i] for i in idx]), strict=True):
            leaves[i] = x
        return jax.tree.unflatten(treedef, leaves)

    return apply


@contextlib.contextmanager
def no_exchange(meet: bool = False):
    """While a program is traced: ``jax.lax.all_to_all``, ``psum`` and ``pmean`` return their
    operand unchanged (the shape-preserving exchanges the workloads use: all_to_all with equal
    split and concat axes). The program then does the baseline's computation and no
    communication; its step time is the bound that no communication library can beat at this
    size (the ``nocomm`` impl of train_moe.py, train_recsys.py and serve_moe.py). Its values are
    wrong by design and are never compared.

    ``meet=True`` (the ``meet`` impl): each replaced exchange still makes the ranks of its axis
    meet (:func:`_meeting`: a 1-element strata psum, forward and backward), so the step pays
    the synchronisation of every exchange but moves no bytes. ``meet - nocomm`` is the part of
    the exchange time that is waiting for the slowest rank (with more ranks than cores: for a
    core), which no synchronous exchange avoids; ``baseline - meet`` is what moving the bytes
    costs."""
    import jax

    def all_to_all(x, axis_name, split_axis, concat_axis, **kw):
        if split_axis != concat_axis:
            raise ValueError(
                "no_exchange: all_to_all with split_axis != concat_axis changes the shape"
            )
        return _meeting(axis_name)(x) if meet else x

    def reduce(x, axis_name, **kw):
        return _meeting(axis_name)(x) if meet else x

    saved = {k: getattr(jax.lax, k) for k in ("all_to_all", "psum", "pmean")}
    jax.lax.all_to_all = all_to_all
    jax.lax.psum = jax.lax.pmean = reduce
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(jax.lax, k, v)
