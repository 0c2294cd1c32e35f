"""The byte-level MoE transformer of ``train_moe.py``: pieces shared by training and serving.

``train_moe.py`` trains the model (full causal attention over each sequence); ``serve_moe.py``
serves it (prefill, then one token per step against a KV cache). Both build the model from the
functions here, so the two cannot drift apart:

* :func:`rms`: RMSNorm; :func:`attention`: causal self-attention over a whole sequence;
  :func:`attention_cached`: the same attention for positions ``pos .. pos + S - 1`` of a
  sequence whose earlier keys/values are in a cache (S = prompt length at prefill, 1 at decode);
* :func:`save_params` / :func:`load_params`: the trained parameters as a plain ``.npz`` (one
  array per leaf, keyed by its path, plus the model configuration as JSON).

Parameter layout (``train_moe.init_params``): ``dense`` = {embed [256, D], pos [S_max, D],
ln_f [D], layers: [{ln1, wqkv [D, 3D], wo [D, D], ln2, router [D, E]}]}, ``experts`` =
[{w1 [E, D, F], w2 [E, F, D]}] per layer (sharded on E over the expert-parallel axis).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

# Model options of train_moe.py that a checkpoint records (what serving needs to rebuild it).
MODEL_KEYS = ("seq", "d_model", "layers", "heads", "experts", "top_k", "d_ff")


def rms(x, g):
    """RMSNorm over the last axis with gain g."""
    import jax
    import jax.numpy as jnp

    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * g


def _qkv(x, p, heads: int):
    import jax.numpy as jnp

    b, s, d = x.shape
    return tuple(a.reshape(b, s, heads, d // heads) for a in jnp.split(x @ p["wqkv"], 3, axis=-1))


def _attend(q, k, v, mask, p):
    """softmax(q k^T / sqrt(dh), masked) v @ wo; q [B, Sq, h, dh], k/v [B, Sk, h, dh]."""
    import jax
    import jax.numpy as jnp

    b, s, h, dh = q.shape
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(dh)
    scores = jnp.where(mask, scores, -1e30)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
    return out.reshape(b, s, h * dh) @ p["wo"]


def attention(x, p, heads: int):
    """Causal self-attention of x [B, S, D] (training: the whole sequence at once)."""
    import jax.numpy as jnp

    s = x.shape[1]
    q, k, v = _qkv(x, p, heads)
    return _attend(q, k, v, jnp.tril(jnp.ones((s, s), bool)), p)


def attention_cached(x, p, heads: int, cache, pos):
    """Causal self-attention of positions pos .. pos + S - 1 against a KV cache.

    Args:
      x: [B, S, D] the new positions' inputs.
      p: the layer's parameters (wqkv, wo).
      heads: attention heads.
      cache: ``(k, v)``, each [B, S_max, heads, D // heads]; positions < pos are valid.
      pos: int32 scalar, the first new position (traced: one compiled decode step serves all).

    Returns:
      ``(out [B, S, D], cache)``: the cache with the new keys/values written at pos.
    """
    import jax
    import jax.numpy as jnp

    s = x.shape[1]
    q, k, v = _qkv(x, p, heads)
    ck, cv = cache
    ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (0, pos, 0, 0))
    cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (0, pos, 0, 0))
    qpos = pos + jnp.arange(s)[:, None]
    kpos = jnp.arange(ck.shape[1])[None, :]
    return _attend(q, ck, cv, kpos <= qpos, p), (ck, cv)


def _flatten(dense, experts) -> dict[str, Any]:
    import jax

    flat = {}
    for prefix, tree in (("dense", dense), ("experts", experts)):
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            flat[prefix + jax.tree_util.keystr(path)] = leaf
    return flat


def save_params(path: Path, dense, experts, config: dict[str, Any]) -> None:
    """Writes numpy trees (dense, experts) and the model config to ``path`` (.npz)."""
    import numpy as np

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {k: np.asarray(v) for k, v in _flatten(dense, experts).items()}
    cfg = {k: config[k] for k in MODEL_KEYS}
    np.savez(path, __config__=np.frombuffer(json.dumps(cfg).encode(), np.uint8), **arrays)


def load_params(path: Path, init_params) -> tuple[Any, Any, dict[str, Any]]:
    """Reads a :func:`save_params` file: ``(dense, experts, config)`` as numpy trees.

    ``init_params(namespace) -> (dense, experts)`` (``train_moe.init_params``) gives the tree
    structure; every leaf is then replaced by the saved array of the same path and shape.
    """
    import argparse

    import jax
    import numpy as np

    with np.load(Path(path)) as z:
        cfg = json.loads(bytes(z["__config__"]).decode())
        saved = {k: z[k] for k in z.files if k != "__config__"}
    dense, experts = init_params(argparse.Namespace(seed=0, **cfg))
    want = _flatten(dense, experts)
    if set(want) != set(saved):
        raise ValueError(f"{path}: parameters {sorted(set(want) ^ set(saved))} do not match")
    for k, v in want.items():
        if v.shape != saved[k].shape:
            raise ValueError(f"{path}: {k} has shape {saved[k].shape}, expected {v.shape}")
    leaves = iter(saved[k] for k in _flatten(dense, experts))
    treedef = jax.tree_util.tree_structure((dense, experts))
    dense, experts = jax.tree_util.tree_unflatten(treedef, list(leaves))
    return dense, experts, cfg
