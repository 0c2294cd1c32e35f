"""numpy oracle of jax.lax.ragged_all_to_all's documented semantics, and random plans.

Shared by tests/test_ragged.py (in-process) and tests/mp_scripts/check_ragged.py (launcher).
The oracle follows the docstring of jax.lax.ragged_all_to_all (jax 0.10.2) literally: rank j
sends ``operand_j[input_offsets_j[i] : + send_sizes_j[i]]`` to the rank at position ``i // S``
of its group, which writes it at ``output_offsets_j[i]`` of its result (a copy of its output).
"""

from __future__ import annotations

import numpy as np


def ragged_reference(operands, outputs, in_off, send, out_off, recv, groups=None):
    """Per-rank lists in, per-rank results out (numpy); checks send == recv as documented."""
    n = len(operands)
    groups = groups or [list(range(n))]
    results = [np.array(o, copy=True) for o in outputs]
    for g in groups:
        per = len(in_off[g[0]]) // len(g)
        for p, j in enumerate(g):
            for i in range(len(in_off[j])):
                d = g[i // per]
                size = int(send[j][i])
                slot = p * per + i % per
                assert int(recv[d][slot]) == size, "send_sizes/recv_sizes disagree"
                o, s = int(out_off[j][i]), int(in_off[j][i])
                results[d][o : o + size] = operands[j][s : s + size]
    return results


def random_plan(
    rng, n: int, per: int, max_rows: int, spare: int = 2, groups=None, filled: int | None = None
):
    """A random valid plan for n ranks, `per` slices per (sender, receiver) pair.

    ``filled``: at most that many non-empty slices per sender (the others empty), so that a
    plan of many ranks with large slices stays small (the operand grows with n x filled, not
    n x n); None: every slice drawn.

    Slices are packed in the operand in a random order with random gaps; receivers lay out
    what they get in a random order with random gaps. Returns (N, M, in_off, send, out_off,
    recv) with [n, K] int arrays (K = group size * per) and N, M the row counts every rank
    uses (the same on every rank, as SPMD requires).
    """
    groups = groups or [list(range(n))]
    gs = len(groups[0])
    k = gs * per
    count = rng.integers(0, max_rows + 1, size=(n, k))  # rows rank j sends in its slice i
    if filled is not None and filled < k:
        for j in range(n):
            count[j, rng.permutation(k)[filled:]] = 0
    in_off = np.zeros((n, k), np.int64)
    out_off = np.zeros((n, k), np.int64)
    recv = np.zeros((n, k), np.int64)
    n_rows = m_rows = 1
    for j in range(n):
        pos = 0
        for i in rng.permutation(k):
            pos += int(rng.integers(0, spare + 1))
            in_off[j, i] = pos
            pos += count[j, i]
        n_rows = max(n_rows, pos)
    for g in groups:
        for q, d in enumerate(g):  # receiver d: slots (source position p, slice s)
            pos = 0
            for slot in rng.permutation(k):
                p, s = divmod(int(slot), per)
                j = g[p]
                i = q * per + s
                pos += int(rng.integers(0, spare + 1))
                out_off[j, i] = pos
                recv[d, slot] = count[j, i]
                pos += count[j, i]
            m_rows = max(m_rows, pos)
    return n_rows, m_rows, in_off, count, out_off, recv


def ragged_grad_reference(operand, w, input_offsets, send_sizes, output_offsets, n: int):
    """The gradients of ``sum(ragged_all_to_all(operand, output) * w)`` over ``n`` ranks (each
    plan array [n, K]): the operand's rows get the weights of the output rows they land in, the
    output's rows keep their weights where nothing lands. Returns (d operand, d output)."""
    d_operand = np.zeros_like(operand)
    d_output = np.array(w, copy=True)
    per = input_offsets.shape[1] // n
    for j in range(n):
        for i in range(input_offsets.shape[1]):
            d, s = i // per, input_offsets[j, i]
            o, c = output_offsets[j, i], send_sizes[j, i]
            d_operand[j, s : s + c] = w[d, o : o + c]
            d_output[d, o : o + c] = 0
    return d_operand, d_output
