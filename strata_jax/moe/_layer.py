"""An expert-parallel MoE MLP over strata's dispatch/combine, and its XLA twins.

:func:`moe_mlp` runs inside ``jax.shard_map`` over the expert-parallel axis. ``impl="strata"``
moves tokens with ``strata_jax.moe.dispatch`` / ``combine`` (zero-copy over the fabric);
``impl="strata_ragged"`` is dropless (MaxText-style: sort by expert, ragged exchange with
:func:`strata_jax.ragged_all_to_all`, grouped matmul with ``jax.lax.ragged_dot``, ragged
exchange back); ``impl="xla_sort"`` is what JAX MoE code does without ragged collectives
(sort/gather into capacity-padded blocks, ``jax.lax.all_to_all``: :mod:`strata_jax.moe._sort`);
``impl="xla"`` is the textbook GShard formulation (one-hot dispatch/combine tensors and
``jax.lax.all_to_all``); ``impl="reference"`` uses the pure-JAX oracle of
:mod:`strata_jax.moe._reference`.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax._src.collectives import all_gather
from strata_jax._src.ragged import ragged_all_to_all
from strata_jax.moe import _sort

AxisName = Any

__all__ = ["moe_mlp", "expert_mlp", "route", "IMPLS"]

IMPLS = ("strata", "strata_ragged", "xla_sort", "xla", "reference")


def route(x: jax.Array, router_w: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """Top-k softmax routing.

    Args:
      x: [T, H] tokens.
      router_w: [H, E] router weights.
      top_k: experts per token K (<= E).

    Returns:
      ``(topk_idx [T, K] int32, topk_weights [T, K])``: the K most probable experts
      (``jax.lax.top_k`` order, distinct) and their softmax probabilities renormalized to sum
      to one. Logits, softmax and weights are float32 (float64 when x or router_w is
      float64): the router runs on x and router_w as given, neither rounded to the other's
      dtype (a float32 router_w with bfloat16 x is not rounded to bfloat16; the weights are
      rounded once, where the layer's output is).
    """
    acc = jnp.promote_types(jnp.promote_types(x.dtype, router_w.dtype), jnp.float32)
    logits = jnp.dot(x.astype(acc), router_w.astype(acc), preferred_element_type=acc)
    probs = jax.nn.softmax(logits, axis=-1)
    top_p, top_i = jax.lax.top_k(probs, top_k)
    return top_i.astype(jnp.int32), top_p / top_p.sum(axis=-1, keepdims=True)


def _experts(
    h: jax.Array, w1: jax.Array, w2: jax.Array, activation: Callable[[jax.Array], jax.Array]
) -> jax.Array:
    """[E_local, N, H] -> [E_local, N, H]: one two-layer MLP per local expert, batched."""
    a = activation(jnp.einsum("enh,ehf->enf", h, w1.astype(h.dtype)))
    return jnp.einsum("enf,efh->enh", a, w2.astype(h.dtype))


# Up to this many tiles (local experts x blocks x chunks) the chunks are unrolled, one cond
# each; past it, one scan per expert. train_moe's step, 8 devices and launch -n 4 (16 tiles):
# unrolled 1.24-1.31x / 1.44-1.53x xla_sort, scanned 1.18-1.23x / 1.36-1.37x; at R = 8,
# T = 1024 (128 tiles) unrolled took 21.5 s to compile and ran slower than no chunks.
_UNROLL_TILES = 16


def _experts_in_chunks(
    h: jax.Array,
    counts: jax.Array,
    w1: jax.Array,
    w2: jax.Array,
    activation: Callable[[jax.Array], jax.Array],
    chunk: int,
) -> jax.Array:
    """The expert MLP over the rows in use only: [E_local, N, H] -> [E_local, N, H].

    Each local expert's N rows are ``nb = counts.shape[1]`` blocks of ``N // nb`` rows, block b
    filled from its first row with ``counts[e, b]`` rows (strata's packed layout: one block per
    expert; the sort/gather layout: one block per source rank). Every block runs in chunks of at
    most ``chunk`` rows (the last one zero-padded), one ``jax.lax.scan`` over an expert's chunks
    (unrolled up to ``_UNROLL_TILES`` tiles in all), and a chunk whose first row is past its
    block's count is skipped (``jax.lax.cond``; its rows
    are zero out of dispatch and zero here, as ``activation(0) == 0``). The idea of a masked
    grouped GEMM (DeepEP's low-latency layout feeds DeepGEMM's ``m_grouped_gemm_*_masked``),
    written with static shapes: the work follows the routed rows, not the capacity. The scan
    keeps the program's size independent of the number of chunks (one ``cond`` per chunk,
    unrolled, took 21.5 s to compile at R = 8, T = 1024 and ran slower than no chunks at all).
    Reverse-mode AD differentiates the scan and its cond, so the backward skips the same chunks.
    """
    el, n, hd = h.shape
    nb = counts.shape[1]
    per = n // nb
    if per == 0:  # capacity 0: no rows at all
        return h
    c = min(chunk, per)
    nch = -(-per // c)
    blocks = h.reshape(el, nb, per, hd)
    if nch * c != per:
        blocks = jnp.pad(blocks, ((0, 0), (0, 0), (0, nch * c - per), (0, 0)))
    tiles = blocks.reshape(el, nb * nch, c, hd)
    first = jnp.tile(jnp.arange(nch, dtype=jnp.int32) * c, nb)  # [nb * nch]
    # Clamped to [0, per] in the counts' own type before the int32 cast (an int64 2**40 must
    # not wrap to a small or negative count).
    info = jnp.iinfo(counts.dtype)
    if info.max > per:
        counts = jnp.minimum(counts, np.asarray(per, counts.dtype))
    if info.min < 0:
        counts = jnp.maximum(counts, np.asarray(0, counts.dtype))
    used = jnp.repeat(counts.astype(jnp.int32), nch, axis=1)  # [E_local, nb * nch]
    unroll = el * nb * nch <= _UNROLL_TILES
    out = []
    for e in range(el):
        a, b = w1[e].astype(h.dtype), w2[e].astype(h.dtype)

        def tile(_, xs, a=a, b=b):
            rows, lo, n_used = xs
            y = jax.lax.cond(
                lo < n_used, lambda r: jnp.dot(activation(jnp.dot(r, a)), b), jnp.zeros_like, rows
            )
            return None, y

        if unroll:  # a few tiles: one cond each, no loop (measured faster at this count)
            ys = [tile(None, (tiles[e, j], first[j], used[e, j]))[1] for j in range(nb * nch)]
            out.append(jnp.stack(ys))
        else:
            out.append(jax.lax.scan(tile, None, (tiles[e], first, used[e]))[1])
    y = jnp.stack(out).reshape(el, nb, nch * c, hd)[:, :, :per]
    return y.reshape(el, n, hd)


def _check_chunk(chunk: Any, name: str) -> int | None:
    """A row chunk argument: None, or a positive int (numpy ints too; not bool, not float)."""
    if chunk is None:
        return None
    try:
        c = operator.index(chunk)
    except TypeError:
        c = 0
    if isinstance(chunk, (bool, np.bool_)) or c <= 0:
        raise ValueError(f"{name} must be a positive int or None, got {chunk!r}")
    return c


def expert_mlp(
    recv_x: jax.Array,
    w1: jax.Array,
    w2: jax.Array,
    *,
    recv_counts: jax.Array | None = None,
    chunk: int | None = None,
    activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
) -> jax.Array:
    """The local experts' two-layer MLPs over received rows: ``activation(x @ W1_e) @ W2_e``.

    For the ``recv_x`` of :func:`strata_jax.moe.dispatch` or
    :func:`strata_jax.moe.low_latency_dispatch` (what :func:`moe_mlp` runs between the two).
    With ``chunk``, only the rows in use are computed: each expert's rows run in chunks of
    ``chunk`` rows and a chunk whose first row is past the receive count is skipped
    (``jax.lax.cond``, skipped in the backward too). That is the static-shape form of a masked
    grouped GEMM (DeepEP's low-latency layout feeding DeepGEMM's ``m_grouped_gemm_*_masked``):
    the work follows the routed rows, not the capacity, which for decode
    (``low_latency_dispatch`` reserves R * max_tokens rows per expert) is most of the buffer.

    Args:
      recv_x: [E_local, N, H] float rows; the MLP runs in this dtype.
      w1: [E_local, H, F] first layer per local expert.
      w2: [E_local, F, H] second layer.
      recv_counts: int rows in use: [E_local] (rows [0, count) of each expert, the layout of
        both dispatches) or [E_local, B] (each expert's N rows are B blocks of N // B rows, block
        b filled from its first row with ``counts[e, b]`` rows: the per-source layout of a
        sort/gather all_to_all pipeline). Needed with ``chunk``; ignored without.
      chunk: rows per chunk (a positive int), or None to run every row (one batched einsum).
      activation: elementwise, with ``activation(0) == 0`` (gelu, relu, silu): skipped chunks
        are returned as zeros, which is what the MLP gives the zero rows dispatch leaves there.

    Returns:
      [E_local, N, H] in recv_x's dtype. With ``chunk``, a chunk that starts past its count is
      zero; rows past the count inside a partly used chunk get the MLP of whatever they hold
      (zeros out of both dispatches, hence zeros). combine never reads rows past the counts.

    Raises:
      ValueError: shapes that do not match, N not a multiple of B, ``chunk`` not a positive int,
        or ``chunk`` without ``recv_counts``.
    """
    recv_x, w1, w2 = jnp.asarray(recv_x), jnp.asarray(w1), jnp.asarray(w2)
    if recv_x.ndim != 3 or not jnp.issubdtype(recv_x.dtype, jnp.floating):
        raise ValueError(
            f"recv_x must be a float [E_local, N, H] array, got {recv_x.dtype}{list(recv_x.shape)}"
        )
    el, n, h = recv_x.shape
    if w1.ndim != 3 or w1.shape[:2] != (el, h):
        raise ValueError(f"w1 must be [E_local={el}, H={h}, F], got {list(w1.shape)}")
    if w2.shape != (el, w1.shape[2], h):
        raise ValueError(f"w2 must be [E_local={el}, F={w1.shape[2]}, H={h}], got {list(w2.shape)}")
    chunk = _check_chunk(chunk, "chunk")
    if chunk is None:
        return _experts(recv_x, w1, w2, activation)
    if recv_counts is None:
        raise ValueError("chunk needs recv_counts (the rows in use per expert) to skip by")
    counts = jnp.asarray(recv_counts)
    if counts.ndim == 1:
        counts = counts[:, None]
    if counts.ndim != 2 or counts.shape[0] != el or not jnp.issubdtype(counts.dtype, jnp.integer):
        raise ValueError(
            f"recv_counts must be an int [E_local={el}] or [E_local, B] array, got "
            f"{counts.dtype}{list(counts.shape)}"
        )
    if counts.shape[1] == 0 or n % counts.shape[1]:
        raise ValueError(f"recv_x's N = {n} rows must split into B = {counts.shape[1]} blocks")
    return _experts_in_chunks(recv_x, counts, w1, w2, activation, chunk)


def _native_ops():
    try:
        from strata_jax.moe._dispatch import combine, dispatch  # noqa: PLC0415 (optional module)
    except ImportError as e:
        raise NotImplementedError(
            "moe_mlp(impl='strata') needs strata_jax.moe.dispatch and strata_jax.moe.combine, "
            "which this build does not have. Use impl='reference' (the pure-JAX oracle with "
            "the same semantics) or impl='xla'."
        ) from e
    return dispatch, combine


def moe_mlp(
    x: jax.Array,
    router_w: jax.Array,
    w1: jax.Array,
    w2: jax.Array,
    *,
    num_experts: int,
    top_k: int,
    axis_name: AxisName,
    capacity: int | None = None,
    impl: str = "strata",
    activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
    expert_chunk: int | None = None,
) -> jax.Array:
    """Expert-parallel mixture-of-experts MLP; call inside ``jax.shard_map``.

    ``y[t] = sum_k g[t, k] * W2_e act(W1_e x[t])`` over the top-k experts ``e = i[t, k]`` of
    the softmax router, with ``g`` the top-k probabilities renormalized to sum to one.
    Experts are sharded along ``axis_name`` (size R): expert ``e`` lives on rank
    ``e // E_local``. Tokens are per rank (data parallel over the same axis).

    Args:
      x: [T, H] this rank's tokens, float dtype (the expert MLP runs in x's dtype).
      router_w: [H, E] router weights (replicated).
      w1: [E_local, H, F] this rank's experts' first layer, ``E_local = num_experts // R``.
      w2: [E_local, F, H] their second layer.
      num_experts: E, a multiple of R.
      top_k: K experts per token, ``1 <= K <= E``.
      axis_name: the expert-parallel mesh axis.
      capacity: rows per expert C over *all* source ranks, filled in (source rank, token)
        order; ``None`` = ``R * T`` (nothing dropped). Dropped (token, expert) pairs
        contribute zero, so ``y`` then sums fewer than K experts (weights not renormalized).
        Must be ``None`` for ``"strata_ragged"`` (dropless).
      impl: ``"strata"`` (``strata_jax.moe.dispatch``/``combine``), ``"strata_ragged"``
        (dropless: :func:`strata_jax.ragged_all_to_all` and ``jax.lax.ragged_dot``; see
        :func:`_dropless`), ``"xla_sort"`` (index gather into ``[E, C_src, H]`` blocks,
        ``jax.lax.all_to_all`` there and back, weighted gather-sum), ``"xla"`` (GShard:
        one-hot dispatch tensor ``[T, E, C_src]``, ``jax.lax.all_to_all`` there and back,
        combine einsum) or ``"reference"`` (pure-JAX oracle of dispatch/combine).
      activation: elementwise activation with ``activation(0) == 0`` (unused capacity rows
        are zero and must stay zero only for speed, not correctness).
      expert_chunk: ``None`` runs the expert MLP over every capacity row (``R * T`` per
        expert with ``capacity=None``, most of them empty). A positive int runs it in chunks
        of at most this many rows and skips the chunks that hold no routed row
        (``jax.lax.cond`` on the receive counts: see :func:`_experts_in_chunks`). strata and
        ``reference`` keep each expert's rows packed from row 0 with their count in the
        layout; ``xla_sort`` and ``xla`` receive one partly filled block per source rank and
        exchange the per-block counts with one more ``jax.lax.all_to_all`` of [R, E_local]
        int32. Same values (the skipped rows are zero either way); not for
        ``"strata_ragged"``, whose ``ragged_dot`` already covers the received rows only.

    Returns:
      y [T, H] in x's dtype. Differentiable with respect to x, router_w, w1 and w2.

    Raises:
      ValueError: bad shapes, ``num_experts`` not a multiple of R, bad ``top_k``/``impl``,
        ``expert_chunk`` not positive or given with ``impl="strata_ragged"``.
      NotImplementedError: ``impl="strata"`` when ``strata_jax.moe.dispatch`` is missing.

    Capacity and drops: GShard (``xla``) and ``xla_sort`` allot each *source rank*
    ``C_src = ceil(C / R)`` rows per expert (so they run the expert MLP on about C rows per
    expert) and drop a source's pairs past ``C_src`` (one rule for both); strata drops the
    pairs past C over all sources; ``strata_ragged`` never drops. With ``capacity=None``
    nothing is dropped (``C_src = T``) and all give the same output up to float round-off;
    with a smaller capacity they agree as long as no source sends more than ``C_src`` tokens
    to one expert.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if x.ndim != 2:
        raise ValueError(f"x must be [T, H], got shape {x.shape}")
    t, h = x.shape
    nranks = jax.lax.axis_size(axis_name)
    if num_experts <= 0 or num_experts % nranks:
        raise ValueError(
            f"num_experts={num_experts} must be a positive multiple of the size "
            f"{nranks} of axis {axis_name!r}"
        )
    e_local = num_experts // nranks
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
    if router_w.shape != (h, num_experts):
        raise ValueError(f"router_w must be [H={h}, E={num_experts}], got {router_w.shape}")
    if w1.ndim != 3 or w1.shape[:2] != (e_local, h):
        raise ValueError(f"w1 must be [E_local={e_local}, H={h}, F], got {w1.shape}")
    if w2.shape != (e_local, w1.shape[2], h):
        raise ValueError(f"w2 must be [E_local={e_local}, F={w1.shape[2]}, H={h}], got {w2.shape}")
    if capacity is not None and capacity < 0:
        raise ValueError(f"capacity must be >= 0 or None, got {capacity}")
    if impl == "strata_ragged" and capacity is not None:
        raise ValueError(
            f"impl='strata_ragged' is dropless and takes capacity=None, got {capacity}; use "
            "impl='strata' or 'xla_sort' for a capacity-limited layer"
        )

    expert_chunk = _check_chunk(expert_chunk, "expert_chunk")
    if impl == "strata_ragged" and expert_chunk is not None:
        raise ValueError(
            "expert_chunk does not apply to impl='strata_ragged' (its ragged_dot runs over the "
            "received rows only); leave it None"
        )

    topk_idx, topk_w = route(x, router_w, top_k)

    def experts(recv, counts):
        if expert_chunk is None:
            return _experts(recv, w1, w2, activation)
        return _experts_in_chunks(recv, counts(), w1, w2, activation, expert_chunk)

    args = (x, topk_idx, topk_w, w1, w2)
    common = dict(num_experts=num_experts, axis_name=axis_name, activation=activation)
    if impl == "xla":
        return _gshard(*args, capacity=capacity, experts=experts, **common)

    if impl == "xla_sort":
        nr = jax.lax.axis_size(axis_name)
        c_src = t if capacity is None else min(t, math.ceil(capacity / nr))
        flat, src = _sort.slots(topk_idx, num_experts, c_src)
        recv = _sort.to_experts(_sort.gather_blocks(x, src, num_experts, c_src), axis_name, nr)

        def block_counts():
            sent = (src.reshape(num_experts, c_src) < t).sum(1, dtype=jnp.int32)  # [E]
            return _sort.counts_to_experts(sent, axis_name, nr)

        back = _sort.from_experts(experts(recv, block_counts), axis_name, nr)
        return _sort.combine_rows(back, flat, topk_w).astype(x.dtype)  # summed in float32

    if impl == "strata_ragged":
        return _dropless(*args, **common)

    if impl == "strata":
        dispatch, combine = _native_ops()
    else:
        from strata_jax.moe._reference import combine, dispatch  # noqa: PLC0415
    recv, layout = dispatch(
        x, topk_idx, num_experts=num_experts, axis_name=axis_name, capacity=capacity
    )
    expert_y = experts(recv, lambda: layout.recv_counts[:, None])
    return combine(expert_y, layout, topk_w).astype(x.dtype)


def _gshard(
    x, topk_idx, topk_w, w1, w2, *, num_experts, axis_name, capacity, activation, experts=None
):
    """GShard (Lepikhin et al. 2020) with per-source capacity ``C_src = ceil(C / R)``.

    The one-hot einsums multiply every row by the zeros of the slots it does not occupy, and
    0 x NaN = NaN: one NaN or infinite row (a padding row of a decode batch) would turn every
    slot it shares a rank with into NaN, then every token that reads one. So the einsums run on
    the finite values only (a non-finite input element, or expert output row, enters them as
    0) and a token whose input is not finite, or that reads a non-finite expert row, gets NaN:
    every other token's output is bitwise what it is without the bad row. The combine sums
    in float32 (float64 for float64) with the float32 weights, rounded once.
    """
    t, h = x.shape
    nranks = jax.lax.axis_size(axis_name)
    e_local = num_experts // nranks
    c_src = t if capacity is None else min(t, math.ceil(capacity / nranks))

    onehot = jax.nn.one_hot(topk_idx, num_experts, dtype=jnp.int32)  # [T, K, E]
    mask = jnp.minimum(onehot.sum(axis=1), 1)  # [T, E]; top_k indices are distinct
    pos = jnp.cumsum(mask, axis=0) - mask  # position among this rank's tokens for e
    keep = mask * (pos < c_src)
    dispatch_t = keep[:, :, None] * jax.nn.one_hot(pos, c_src, dtype=jnp.int32)  # [T, E, C]
    gates = jnp.einsum("tke,tk->te", onehot.astype(topk_w.dtype), topk_w)  # [T, E]
    combine_t = dispatch_t.astype(topk_w.dtype) * gates[:, :, None]  # [T, E, C]

    x_ok = jnp.isfinite(x)
    bad = ~x_ok.all(axis=1)  # [T] rows that would poison the einsum
    send = jnp.einsum("tec,th->ech", dispatch_t.astype(x.dtype), jnp.where(x_ok, x, 0))
    send = send.reshape(nranks, e_local, c_src, h)
    recv = jax.lax.all_to_all(send, axis_name, 0, 0)  # [R(source), E_local, C, H]
    recv = recv.transpose(1, 0, 2, 3).reshape(e_local, nranks * c_src, h)
    if experts is None:
        out = _experts(recv, w1, w2, activation)
    else:
        out = experts(
            recv,
            lambda: _sort.counts_to_experts(keep.sum(0, dtype=jnp.int32), axis_name, nranks),
        )
    out = out.reshape(e_local, nranks, c_src, h).transpose(1, 0, 2, 3)
    back = jax.lax.all_to_all(out, axis_name, 0, 0)  # [R(expert rank), E_local, C, H]
    back = back.reshape(num_experts, c_src, h)
    row_ok = jnp.isfinite(back).all(axis=2)  # [E, C]
    back = jnp.where(row_ok[:, :, None], back, 0)
    bad = bad | (jnp.einsum("tec,ec->t", dispatch_t, (~row_ok).astype(jnp.int32)) > 0)
    acc = jnp.promote_types(x.dtype, jnp.float32)
    y = jnp.einsum("tec,ech->th", combine_t.astype(acc), back.astype(acc))
    return jnp.where(bad[:, None], jnp.nan, y).astype(x.dtype)


def _dropless(x, topk_idx, topk_w, w1, w2, *, num_experts, axis_name, activation):
    """Dropless expert parallelism over :func:`strata_jax.ragged_all_to_all` (MaxText-style).

    1. Sort this rank's T*K (token, expert) pairs by expert id (stable): the rows for expert
       rank d, local expert l, form one contiguous slice (d, l) of the sorted rows.
    2. Exchange the per-expert counts first (``strata_jax.all_gather`` of [E] int32: every
       rank then knows every (source, expert) count and computes every offset locally).
    3. Ragged exchange with R * E_local slices (``E_local`` slices per peer): the expert rank
       receives its rows grouped by local expert (source order inside a group), so
    4. the expert MLP is two ``jax.lax.ragged_dot`` grouped matmuls over the received rows;
    5. the reverse ragged exchange (same counts, roles swapped) brings every row back to its
       sorted position at the source; un-sort and sum each token's K rows with its weights.

    Output buffer bound (static shapes, no drops): a token's K experts are distinct, so it
    sends at most ``min(K, E_local)`` rows to one expert rank, and an expert rank receives at
    most ``M = R * T * min(K, E_local)`` rows (every token of every rank routed there). The
    received buffer is [M, H]; rows past the received count are never read.
    """
    t, h = x.shape
    k = topk_idx.shape[1]
    nr = jax.lax.axis_size(axis_name)
    el = num_experts // nr
    me = jax.lax.axis_index(axis_name)
    i32 = jnp.int32

    flat_e = topk_idx.reshape(-1).astype(i32)  # [T*K]
    order = jnp.argsort(flat_e, stable=True)
    rows = x[order // k]  # [T*K, H] sorted by expert
    counts = jnp.zeros((num_experts,), i32).at[flat_e].add(1)  # [E] = (d, l)
    all_counts = all_gather(counts, axis_name)  # [R(source), E]
    c3 = all_counts.reshape(nr, nr, el)  # [source j, expert rank d, local expert l]
    total = c3.sum(0)  # [d, l]: rows expert (d, l) receives
    start = jnp.cumsum(total, axis=1) - total  # [d, l]: its region in d's buffer
    before = jnp.cumsum(c3, axis=0) - c3  # [j, d, l]: rows of earlier sources in the region
    where = start[None] + before  # [j, d, l]: offset of slice (j -> d, l) in d's buffer

    in_off = jnp.cumsum(counts) - counts  # my slices (d, l) in my sorted rows
    m = nr * t * min(k, el)
    recv = ragged_all_to_all(
        rows,
        jnp.zeros((m, h), x.dtype),
        in_off,
        counts,
        where[me].reshape(-1),
        c3[:, me, :].reshape(-1),
        axis_name=axis_name,
    )
    sizes = total[me]  # [E_local] rows per local expert, contiguous from row 0
    hid = activation(jax.lax.ragged_dot(recv, w1.astype(x.dtype), sizes))
    out = jax.lax.ragged_dot(hid, w2.astype(x.dtype), sizes)  # [M, H]

    src_off = (jnp.cumsum(all_counts, axis=1) - all_counts).reshape(nr, nr, el)
    back = ragged_all_to_all(
        out,
        jnp.zeros((t * k, h), x.dtype),
        where[:, me, :].reshape(-1),  # slice (j, l): rows of source j for my expert l
        c3[:, me, :].reshape(-1),
        src_off[:, me, :].reshape(-1),  # back to where source j took them from
        counts,
        axis_name=axis_name,
    )
    pairs = jnp.zeros_like(back).at[order].set(back).reshape(t, k, h)
    acc = jnp.promote_types(x.dtype, jnp.float32)  # float32 weights, one rounding at the end
    return jnp.einsum("tk,tkh->th", topk_w.astype(acc), pairs.astype(acc)).astype(x.dtype)
