"""Shared helpers: meshes, random inputs of any dtype, running a body under shard_map, building
a test program of tests/native/ with the fabric's sources."""

from __future__ import annotations

import glob
import itertools
import math
import os
import re
import shutil
import subprocess

import jax
import jax.ffi
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import strata_jax as sj

ALL_DTYPES = [
    "float32",
    "float64",
    "bfloat16",
    "float16",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bool",
    "complex64",
    "complex128",
]
FLOAT_DTYPES = ["float32", "float64", "bfloat16", "float16"]


def grid(*lists) -> list[tuple]:
    """Every combination of the lists, as tuples (itertools.product)."""
    return list(itertools.product(*lists))


def rotation(cover: list, rotate: list[list], slow_rest: bool = True) -> list:
    """pytest params for the grid ``cover x product(*rotate)``, of which the default run keeps
    a rotation: every row of ``cover`` (the settings that must all run: tuples, single values,
    or pytest.param rows whose marks are kept), each with the next value of every ``rotate``
    list in turn, and more rows while some value of a ``rotate`` list has not run yet. So every
    cover row and every value of every rotate list runs by default; the rest of the grid is
    marked ``slow`` (``pytest -m slow`` runs it, and ``slow_rest=False`` leaves it out). Each
    param is ``(*cover row, *one value per list)``.

    Example: ``rotation([(0, 0), (1, 2)], [ALL_DTYPES])``: both axis settings, and the 15
    dtypes spread over them (15 cases instead of 30)."""
    rows = []
    for c in cover or [()]:
        if hasattr(c, "values") and hasattr(c, "marks"):  # a pytest.param
            rows.append((tuple(c.values), list(c.marks)))
        else:
            rows.append((c if isinstance(c, tuple) else (c,), []))
    n = max(len(rows), max((len(v) for v in rotate), default=1))
    chosen: dict[tuple, list] = {}
    for i in range(n):
        values, marks = rows[i % len(rows)]
        chosen.setdefault(values + tuple(v[i % len(v)] for v in rotate), marks)
    out = [pytest.param(*row, marks=marks, id=_param_id(row)) for row, marks in chosen.items()]
    if slow_rest:
        for values, marks in rows:
            for r in itertools.product(*rotate):
                if values + r not in chosen:
                    row = values + r
                    out.append(
                        pytest.param(*row, marks=[*marks, pytest.mark.slow], id=_param_id(row))
                    )
    return out


def _param_id(row: tuple) -> str:
    return "-".join(str(getattr(v, "__name__", v)).replace(" ", "") for v in row)


def mesh1d(n: int = 8) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), ("x",))


def mesh2d(a: int = 2, b: int = 4) -> Mesh:
    return Mesh(np.array(jax.devices()[: a * b]).reshape(a, b), ("a", "b"))


def random_array(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    dt = jnp.dtype(dtype)
    if dt == jnp.bool_:
        return rng.random(shape) < 0.5
    if jnp.issubdtype(dt, jnp.complexfloating):
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
    if jnp.issubdtype(dt, jnp.floating):
        return rng.standard_normal(shape).astype(np.float32).astype(dt)
    info = jnp.iinfo(dt)
    lo, hi = max(int(info.min), -100), min(int(info.max), 100)
    return rng.integers(lo, hi + 1, size=shape).astype(dt)


def shard_run(body, mesh, x, in_specs=None, out_specs=None, check_vma=True):
    names = mesh.axis_names
    in_specs = P(names) if in_specs is None else in_specs
    out_specs = P(names) if out_specs is None else out_specs
    f = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)
    )
    return np.asarray(f(x))


def assert_close(got, want, dtype, nranks=8, msg=""):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{msg}: shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"{msg}: dtype {got.dtype} != {want.dtype}"
    dt = jnp.dtype(dtype)
    if jnp.issubdtype(dt, jnp.inexact):
        tol = {
            "bfloat16": 2e-2,
            "float16": 4e-3,
            "float32": 1e-5,
            "float64": 1e-12,
            "complex64": 1e-5,
            "complex128": 1e-12,
        }[str(dt)] * nranks
        np.testing.assert_allclose(
            got.astype(np.complex128 if jnp.issubdtype(dt, jnp.complexfloating) else np.float64),
            want.astype(np.complex128 if jnp.issubdtype(dt, jnp.complexfloating) else np.float64),
            rtol=tol,
            atol=tol,
            err_msg=msg,
        )
    else:
        np.testing.assert_array_equal(got, want, err_msg=msg)


IMPLS = {"strata": sj, "xla": jax.lax}


def unordered_strata_calls(compiled_hlo: str) -> list[tuple[str, str]]:
    """Pairs of strata custom calls (or of ops whose called computations hold one: a
    conditional, a while loop) of one computation in XLA's compiled text with no data path
    between them, so that a device may start either first. Empty when every device runs them
    in program order."""
    comps: dict[str, dict[str, tuple[list[str], list[str], bool]]] = {}
    cur = None
    for line in compiled_hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$", line)
        if head:
            cur = comps.setdefault(head.group(1), {})
            continue
        inst = re.match(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$", line)
        if cur is None or not inst:
            continue
        rest = inst.group(2)
        args = re.search(r"[\w\-]+\((.*?)\)(,|$)", rest)
        operands = re.findall(r"%([\w.\-]+)", args.group(1)) if args else []
        called = re.findall(r"(?:to_apply|body|condition|calls)=%([\w.\-]+)", rest)
        branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
        called += re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else []
        cur[inst.group(1)] = (operands, called, 'custom_call_target="strata_' in rest)

    memo: dict[str, bool] = {}

    def holds(comp: str) -> bool:
        if comp not in memo:
            memo[comp] = False
            memo[comp] = any(
                own or any(holds(c) for c in called)
                for _, called, own in comps.get(comp, {}).values()
            )
        return memo[comp]

    pairs = []
    for nodes in comps.values():
        calls = [n for n, (_, called, own) in nodes.items() if own or any(map(holds, called))]
        before: dict[str, set[str]] = {}
        for n in calls:
            seen, stack = set(), list(nodes[n][0])
            while stack:
                x = stack.pop()
                if x not in seen and x in nodes:
                    seen.add(x)
                    stack.extend(nodes[x][0])
            before[n] = seen
        pairs += [
            (x, y)
            for i, x in enumerate(calls)
            for y in calls[i + 1 :]
            if x not in before[y] and y not in before[x]
        ]
    return pairs


def on_one_and_two_fabrics(run, monkeypatch):
    """``run()`` as the machine is (one fabric), then with devices 0-1 and 2-3 as two fake
    fabrics (the hierarchical lowering; asserted to have moved inter-fabric bytes). Returns
    both results, to compare with each other or an oracle."""
    from strata_jax._src import topology

    single = run()
    monkeypatch.setattr(topology, "_map", topology.FabricMap(("a", "b"), 0))
    monkeypatch.setattr(topology, "fabric_of_device", lambda d: d.id // 2)
    before = sj.comm_stats()["inter_fabric_bytes"]
    split = run()
    assert sj.comm_stats()["inter_fabric_bytes"] > before  # the hierarchical path ran
    return single, split


def ppermute_reference(x, axes, perm, sizes=(("a", 2), ("b", 4))):
    """numpy's ppermute over a mesh of ``sizes`` whose devices hold the rows of ``x`` in
    mesh order: a group over several axes is indexed in the order they are named (the first
    major), as jax.lax.axis_index counts."""
    axes = axes if isinstance(axes, tuple) else (axes,)
    dims = dict(sizes)
    coords = list(np.ndindex(*dims.values()))  # mesh order
    out = np.zeros_like(x)
    for d, c in enumerate(coords):
        at = dict(zip(dims, c, strict=True))
        n = math.prod(dims[a] for a in axes)
        for src, dst in perm:
            if dst % n != np.ravel_multi_index([at[a] for a in axes], [dims[a] for a in axes]):
                continue
            want = dict(at)
            want.update(zip(axes, np.unravel_index(src % n, [dims[a] for a in axes]), strict=True))
            out[d] = x[coords.index(tuple(want[a] for a in dims))]
    return out


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_native_test(source: str, exe: str, *flags: str) -> subprocess.CompletedProcess:
    """Compiles tests/native/`source` with native/'s common, coll, fabric and sync sources
    (C++17, -O1, `flags`) into `exe`; returns the compiler's run. Skips the test where there is
    no C++ compiler (g++ or c++)."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    srcs = [os.path.join(ROOT, "tests", "native", source)]
    for d in ("common", "coll", "fabric", "sync"):
        srcs += sorted(glob.glob(os.path.join(ROOT, "native", d, "*.cc")))
    cmd = [cxx, "-std=c++17", "-O1", *flags, "-I", os.path.join(ROOT, "native")]
    cmd += ["-isystem", jax.ffi.include_dir(), *srcs, "-o", exe, "-lpthread"]
    return subprocess.run(cmd, capture_output=True, text=True)
