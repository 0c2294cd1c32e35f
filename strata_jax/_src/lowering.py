"""The lowering helpers every strata primitive shares, and the one place that builds an FFI call.

A primitive module (``collectives.py``, ``ragged.py``, ``moe/_dispatch.py``, the hierarchical
collectives of ``hierarchy/``) keeps its public function, abstract evaluation, batching and
transpose rules; what they all need comes from here, by public names:

- axis names: :func:`axis_tuple`, :func:`check_axis_names`, :func:`axis_size`,
  :func:`check_no_groups`;
- vma (varying manual axes) typing: :func:`vma_on`, :func:`pvary_missing`,
  :func:`require_varying`, :func:`varying_out`; effects: :func:`effects`;
- placement: :func:`spmd_mesh`, :func:`mesh_placement`, :func:`mesh_groups`,
  :func:`partition_device_ids`, :func:`check_groups_inside_fabrics`;
- the registration block that ends each primitive: :func:`register`;
- the call: :func:`lower_strata_call`, which loads the native extension (``runtime.native()``)
  and emits the custom call with its rendezvous attributes, in program order
  (``program_order.py``).

This module imports only ``runtime``, ``topology`` and ``program_order`` of the package, so any
primitive module (and ``hierarchy/``) can import it without an import cycle.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from strata_jax._src import program_order, runtime, topology
from strata_jax._src.jax_compat import SPMDAxisContext, ad, batching, config, core, hlo, mlir

AxisName = Any

__all__ = [
    "register",
    "axis_size",
    "axis_tuple",
    "check_axis_names",
    "check_groups_inside_fabrics",
    "check_no_groups",
    "effects",
    "lower_strata_call",
    "mesh_groups",
    "mesh_placement",
    "partition_device_ids",
    "pvary_missing",
    "require_varying",
    "spmd_mesh",
    "varying_out",
    "vma_on",
]


def axis_tuple(axis_name: AxisName) -> tuple:
    """A jax.lax ``axis_name`` (one name, or a tuple/list of them) as a tuple of names."""
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def check_no_groups(axis_index_groups, api: str) -> None:
    """NotImplementedError when ``axis_index_groups`` is given (strata groups are mesh axes)."""
    if axis_index_groups is not None:
        raise NotImplementedError(
            f"strata_jax.{api} does not support axis_index_groups. Use a mesh axis for the "
            "group instead (e.g. reshape the mesh so the groups are one mesh axis), or call "
            f"jax.lax.{api} for this call."
        )


def check_axis_names(axes: tuple, api: str) -> None:
    """At trace time: ``axes`` are distinct named axes bound by an enclosing shard_map
    (ValueError on a repeat, TypeError on a positional axis, NameError on an unbound one)."""
    if len(set(axes)) != len(axes):
        raise ValueError(f"strata_jax.{api}: axis names {axes} repeat a name; name each axis once.")
    env = core.get_axis_env()
    for name in axes:
        if isinstance(name, int):
            raise TypeError(
                f"strata_jax.{api} takes named mesh axes only, got positional axis {name}; "
                "reduce positional axes with jnp first."
            )
        if not env.axis_exists(name):
            raise NameError(
                f"Found an unbound axis name: {name}. To fix this, call strata_jax.{api} "
                "under jax.shard_map over a mesh with that axis."
            )


def axis_size(axes: tuple) -> int:
    """The group size: the product of the sizes of the mesh axes ``axes``."""
    env = core.get_axis_env()
    return math.prod(env.axis_size(a) for a in axes)


def vma_on() -> bool:
    """Whether shard_map checks varying manual axes (``check_vma``) in this trace."""
    return bool(config._check_vma.value)


def pvary_missing(x, axes: tuple):
    """Casts x to varying over the axes it is not yet varying over (as jax.lax does)."""
    if not vma_on():
        return x
    missing = tuple(a for a in axes if a not in core.typeof(x).mat.varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def effects(axes: tuple):
    """Effects of a collective over ``axes`` (a NamedAxisEffect per axis), for abstract eval."""
    return {core.NamedAxisEffect(a) for a in axes}


def varying_out(aval, vma):
    """``aval`` typed as varying over exactly the axes ``vma``."""
    return aval.update(manual_axis_type=aval.mat.update(varying=frozenset(vma)))


def require_varying(api: str, aval, axes: tuple) -> None:
    """With vma checks on: ValueError unless ``aval`` varies over every axis in ``axes``."""
    if vma_on() and any(a not in aval.mat.varying for a in axes):
        raise ValueError(
            f"strata_jax.{api} needs an input that varies over {axes}; got "
            f"{aval.str_short(True)}. Call it through strata_jax.{api} (which casts) or "
            "jax.lax.pcast(x, axes, to='varying') first."
        )


def spmd_mesh(ctx, api: str):
    """The mesh of the enclosing shard_map at lowering; NotImplementedError outside shard_map or
    when some mesh axes are automatic."""
    axis_ctx = ctx.module_context.axis_context
    if not isinstance(axis_ctx, SPMDAxisContext):
        raise NotImplementedError(
            f"strata_jax.{api} runs inside jax.shard_map (got {type(axis_ctx).__name__}); "
            "wrap the computation in jax.shard_map over a Mesh."
        )
    mesh = axis_ctx.mesh
    names = tuple(mesh.axis_names)
    manual = axis_ctx.manual_axes
    if manual and frozenset(manual) != frozenset(names):
        raise NotImplementedError(
            f"strata_jax.{api} needs every mesh axis to be manual in jax.shard_map "
            f"(manual: {sorted(map(str, manual))}, mesh: {names}); drop axis_names= or use "
            "jax.lax for partially automatic meshes."
        )
    return mesh


def mesh_placement(ctx, axes: tuple, api: str):
    """(mesh shape, indices of ``axes`` in it) as int64 arrays, after checking the context."""
    mesh = spmd_mesh(ctx, api)
    names = tuple(mesh.axis_names)
    sizes = tuple(int(s) for s in mesh.axis_sizes)
    idx = tuple(names.index(a) for a in axes)
    return np.asarray(sizes, np.int64), np.asarray(idx, np.int64)


def mesh_groups(ctx, axes: tuple, api: str) -> np.ndarray:
    """The groups of a collective over mesh axes ``axes``, as jax.lax forms them.

    Returns an int64 array [num_groups, group_size] of partition indices (row-major positions
    in the mesh): row g lists the members of group g, in rank order (``axes`` in the given
    order, the first one major). Groups are ordered by the remaining axes' coordinates.
    """
    mesh_shape, idx = mesh_placement(ctx, axes, api)
    nd = len(mesh_shape)
    rest = [d for d in range(nd) if d not in set(idx.tolist())]
    parts = np.arange(int(np.prod(mesh_shape)), dtype=np.int64).reshape(tuple(mesh_shape))
    order = rest + [int(a) for a in idx]
    return parts.transpose(order).reshape(-1, int(np.prod(mesh_shape[idx])) if len(idx) else 1)


def partition_device_ids(ctx, num_partitions: int) -> np.ndarray:
    """Global device id of every partition (the program's device assignment, in partition
    order): the members of a communicator as every process names them."""
    try:
        ids = np.asarray([d.id for d in spmd_mesh(ctx, "collective").devices.flat], np.int64)
    except Exception:  # an abstract mesh has no devices: partitions name themselves
        ids = np.arange(num_partitions, dtype=np.int64)
    if ids.size != num_partitions:
        ids = np.arange(num_partitions, dtype=np.int64)
    return ids


def check_groups_inside_fabrics(ctx, groups: np.ndarray, api: str) -> None:
    """Raises NotImplementedError at lowering when a strata call's explicit group spans
    fabric domains: the shared-memory fabric cannot reach the other hosts, so such a call
    would only wait for peers that never arrive. Operators with a hierarchical form never get
    here with such a group (their split runs first); the others (ragged_all_to_all, the
    low-latency MoE pair) fail here with what to change."""
    if topology.num_fabrics() == 1:
        return
    axis_ctx = ctx.module_context.axis_context
    if not isinstance(axis_ctx, SPMDAxisContext):
        return
    fab = np.array([topology.fabric_of_device(d) for d in np.asarray(axis_ctx.mesh.devices).flat])
    gf = fab[np.asarray(groups)]
    bad = [row for row in gf if len(set(row.tolist())) > 1]
    if bad:
        raise NotImplementedError(
            f"strata_jax.{api} over a group that spans fabric domains (hosts) is not supported "
            f"yet (fabric of each member: {bad[0].tolist()}). Keep this axis inside one host "
            "(e.g. a ('host', 'local') mesh with the operator over 'local'), "
            + _ACROSS_HOSTS_INSTEAD.get(api, "or use an operator that runs across hosts.")
        )


# What runs across hosts instead, per operator refused there (check_groups_inside_fabrics).
# Not jax.lax.ragged_all_to_all: XLA:CPU does not implement it (the program fails to compile).
_ACROSS_HOSTS_INSTEAD = {
    "ragged_all_to_all": (
        "or across hosts pad each peer's rows to a fixed count and exchange them with "
        "strata_jax.all_to_all, which runs across hosts (for MoE: strata_jax.moe.dispatch and "
        "combine). jax.lax.ragged_all_to_all is no alternative on CPU: XLA:CPU does not "
        "implement it."
    ),
}


def lower_strata_call(
    ctx,
    target: str,
    api: str,
    operands: Sequence,
    groups,
    *,
    operand_output_aliases: dict[int, int] | None = None,
    **attrs,
):
    """Lowers one strata FFI call over explicit groups: the one place that builds the call.

    Args:
      ctx: the lowering context of the primitive (its ``avals_in`` describe ``operands``).
      target: the registered FFI target, e.g. ``"strata_all_reduce"``.
      api: the user-facing name for error messages, e.g. ``"psum"``.
      operands: the primitive's MLIR operands (the partition id is appended here).
      groups: int array [num_groups, group_size] of partition indices (row-major positions in
        the shard_map mesh); every partition in exactly one row; rank = position in the row.
        ``mesh_groups(ctx, axes, api)`` gives jax.lax's groups for mesh axes; any other
        partition of the devices (e.g. only the ranks of one fabric along an axis) works too.
      operand_output_aliases: as in ``jax.ffi.ffi_lowering`` (e.g. ``{1: 0}``: result 0
        reuses operand 1's buffer).
      **attrs: the handler's own attributes (reduce, root, sources, ...).

    The call gets the attributes ``op_id`` (``program_order.next_op_id``), ``groups`` (flattened),
    ``group_size`` and ``device_ids`` (global device id per partition): in one process calls
    meet by (run id, op id, occurrence, group); across processes by the communicator (the
    members' global device ids) and a per-communicator sequence number (native/fabric/shm.h).
    """
    runtime.native()
    mesh = spmd_mesh(ctx, api)
    num_partitions = int(np.prod([int(s) for s in mesh.axis_sizes]))
    g = np.asarray(groups, np.int64)
    if g.ndim != 2 or g.shape[1] < 1:
        raise ValueError(
            f"strata_jax.{api}: groups must be [num_groups, group_size], got {g.shape}"
        )
    if sorted(g.ravel().tolist()) != list(range(num_partitions)):
        raise ValueError(
            f"strata_jax.{api}: groups must list every one of the {num_partitions} partitions "
            f"exactly once, got {g.tolist()}"
        )
    check_groups_inside_fabrics(ctx, g, api)
    rule = jax.ffi.ffi_lowering(
        target, has_side_effect=True, operand_output_aliases=operand_output_aliases
    )
    return program_order.chained(
        ctx,
        rule,
        [*operands, hlo.partition_id()],
        [*ctx.avals_in, core.ShapedArray((), np.uint32)],
        op_id=program_order.next_op_id(ctx),
        groups=g.ravel(),
        group_size=np.int64(g.shape[1]),
        device_ids=partition_device_ids(ctx, num_partitions),
        **attrs,
    )


def register(
    prim: core.Primitive,
    abstract_eval,
    lowering,
    *,
    linear_transpose=None,
    transpose=None,
    jvp=None,
    batcher=None,
) -> None:
    """The registration block that ends each strata primitive (as in jax/_src/lax/parallel.py):
    its abstract evaluation (with effects), its transpose (``linear_transpose``: the primitive
    is linear, ``ad.deflinear2``; or ``transpose`` alone), its JVP (over the linear one), its
    batching rule, and its CPU lowering, never cached (each application gets op ids of its own:
    program_order.py)."""
    prim.def_effectful_abstract_eval(abstract_eval)
    if linear_transpose is not None:
        ad.deflinear2(prim, linear_transpose)
    if transpose is not None:
        ad.primitive_transposes[prim] = transpose
    if jvp is not None:
        ad.primitive_jvps[prim] = jvp
    if batcher is not None:
        batching.fancy_primitive_batchers[prim] = batcher
    mlir.register_lowering(prim, lowering, platform="cpu", cacheable=False)
