"""Numpy reference of MoE routing, shared by the in-process and multi-process MoE tests."""

from __future__ import annotations

import numpy as np


def ref_plan(idx: np.ndarray, num_experts: int, capacity: int):
    """idx [N, K] global choices -> (src [E, C] token or -1, cidx [N, K] flat slot or -1,
    counts [E], dropped [E])."""
    n, k = idx.shape
    lists: list[list[int]] = [[] for _ in range(num_experts)]
    slot: dict[tuple[int, int], int] = {}
    for g in range(n):
        seen = set()
        for j in range(k):
            e = int(idx[g, j])
            if e < 0 or e >= num_experts or e in seen:
                continue
            seen.add(e)
            p = len(lists[e])
            lists[e].append(g)
            if p < capacity:
                slot[(g, e)] = p
    src = np.full((num_experts, capacity), -1, np.int64)
    for e in range(num_experts):
        for p, g in enumerate(lists[e][:capacity]):
            src[e, p] = g
    cidx = np.full((n, k), -1, np.int64)
    for g in range(n):
        for j in range(k):
            e = int(idx[g, j])
            if (g, e) in slot:
                cidx[g, j] = e * capacity + slot[(g, e)]
    counts = np.array([min(len(v), capacity) for v in lists], np.int32)
    dropped = np.array([max(0, len(v) - capacity) for v in lists], np.int32)
    return src, cidx, counts, dropped


def moe_idle_expert_reference(x, w, factor: float = 3.0):
    """An expert rank that receives nothing: every token routed to expert 0 (K=1), expert
    f(x) = factor x, capacity >= tokens of all ranks: y = w x factor; dy/dx = w factor (summed
    loss); dy/dw = factor sum_h x."""

    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)  # [T, 1]
    y = w * factor * x
    return y, np.broadcast_to(w * factor, x.shape), factor * x.sum(1, keepdims=True)
