"""Where each collective of a compiled program runs: the part of :func:`strata_jax.coverage` that
reads what XLA compiled.

Lowering-time records (coverage.py) see only the collectives JAX lowers. A ``jax.jit`` program
with shardings (GSPMD/Shardy) has none at that point: XLA's partitioner inserts its all-reduces,
all-gathers, reduce-scatters, all-to-alls and collective-permutes while compiling. So after XLA
compiles a program, its optimized HLO is read here and every collective in it is counted with
where it runs and why:

- ``strata custom call``: strata's own operators (``strata_*`` custom calls);
- ``strata engine``: an XLA collective across processes while strata's engine runs XLA's
  collectives (engine.py: XLA's MPI collectives over ``libstrata_mpi.so``);
- ``XLA gloo`` / ``XLA MPI``: an XLA collective across processes over JAX's other engines
  (chosen, or strata's engine fell back: the reason is given);
- ``XLA in-process``: the program runs in one process, whose devices XLA's in-process
  communicator joins (strata's engine runs between processes; ``use_for_jax_lax()`` moves
  ``jax.lax`` collectives inside ``shard_map`` onto strata's custom calls there);
- ``refused by XLA's MPI path``: a reduction or all-gather of float16 or a float8 type, which
  XLA:CPU refuses on its MPI path before any MPI library is called ("Unsupported primitive type
  for reduction: f16"): the program fails when it runs it, under strata's engine as under XLA
  over MPI. A RuntimeWarning at compile time names the op and the fix.

How: ``jax._src.compiler.compile_or_get_cached`` (JAX's one entry to XLA compilation, used by
jit, pmap and shard_map programs alike) is wrapped at import (jax_compat.on_compiled); the
executable's ``hlo_modules()`` text is parsed for collective instructions (the ``-start`` half
of async pairs). ``STRATA_DEBUG=INFO`` logs one line per compiled program holding XLA's collectives.
"""

from __future__ import annotations

import re
import threading
import warnings

from strata_jax._src import debug

# HLO opcodes of XLA's collectives (an async pair is counted by its -start).
_OPS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "collective-broadcast",
    "ragged-all-to-all",
)
# ``%name = <shape> <opcode>(operands), attributes``: the shape (a tuple for combined or async
# collectives, possibly with ``/*index=5*/`` comments) lies between the first " = " and the
# opcode, which a blank precedes and "(" follows (an operand reads ``%all-reduce.17``).
_INSTR = re.compile(r"\s(?P<op>" + "|".join(re.escape(o) for o in _OPS) + r")(?P<start>-start)?\(")
_CUSTOM = re.compile(r'custom_call_target="(?P<target>strata_[a-z0-9_]+)"')
_DTYPE = re.compile(r"\b([a-z]+[0-9a-z]*)\[")

# What XLA:CPU refuses on its MPI path before calling MPI (measured with jax 0.10.2: psum, pmax,
# all_gather and psum_scatter of float16, and of the float8 types, which XLA:CPU computes in
# float16; all_to_all and ppermute move bytes and pass).
_REFUSED_OPS = ("all-reduce", "all-gather", "reduce-scatter")
_REFUSED_TYPES = ("f16", "f8e4m3fn", "f8e5m2", "f8e4m3", "f8e3m4", "f8e4m3b11fnuz", "f8e5m2fnuz",
                  "f8e4m3fnuz")  # fmt: skip

STRATA_CALL = "strata custom call"
STRATA_ENGINE = "strata engine"
REFUSED = "refused by XLA's MPI path"

_lock = threading.Lock()
_installed = False


def collectives_in(hlo_text: str) -> list[tuple[str, tuple[str, ...]]]:
    """Every collective instruction of an HLO module's text: (opcode, element types), strata's
    custom calls as (``custom-call:<target>``, ())."""
    out = []
    for line in hlo_text.splitlines():
        eq = line.find(" = ")
        m = _INSTR.search(line, eq + 2) if eq >= 0 else None
        if m:
            shape = line[eq + 3 : m.start()]
            out.append((m.group("op"), tuple(sorted(set(_DTYPE.findall(shape))))))
            continue
        c = _CUSTOM.search(line)
        if c and " custom-call(" in line:
            out.append((f"custom-call:{c.group('target')}", ()))
    return out


def where(op: str, dtypes: tuple[str, ...], processes: int) -> tuple[str, str]:
    """(where the collective runs, why) for a program spanning ``processes`` processes."""
    from strata_jax._src import engine, mpi_engine

    if op.startswith("custom-call:"):
        return STRATA_CALL, "strata's own operator"
    if processes <= 1:
        return (
            "XLA in-process",
            "one process: XLA's in-process communicator joins its devices (strata's engine "
            "runs between processes; inside shard_map, use_for_jax_lax() moves jax.lax "
            "collectives to strata's custom calls)",
        )
    if engine.active():
        if op in _REFUSED_OPS and any(t in _REFUSED_TYPES for t in dtypes):
            return REFUSED, (
                f"XLA:CPU refuses {'/'.join(dtypes)} {op} on its MPI path before the engine is "
                "called; run with STRATA_ENGINE=gloo, or keep these values in float32/bfloat16"
            )
        return STRATA_ENGINE, "XLA's MPI collectives over libstrata_mpi.so (strata's fabric)"
    why = engine.state["why"] or "jax's configuration"
    if mpi_engine.selected():
        return "XLA MPI", why
    return "XLA gloo", why


def record_compiled(program: str, hlo_text: str, processes: int) -> None:
    """Counts the collectives of a compiled program into its coverage record (coverage.py)."""
    from strata_jax._src import coverage

    found = collectives_in(hlo_text)
    if not found:
        return
    counts: dict[str, dict[str, int]] = {}
    refused = []
    for op, dtypes in found:
        name = op.split(":", 1)[1] if op.startswith("custom-call:") else op
        loc, why = where(op, dtypes, processes)
        key = f"{loc}: {why}"
        bucket = counts.setdefault(name, {})
        bucket[key] = bucket.get(key, 0) + 1
        if loc == REFUSED:
            refused.append(f"{op} of {'/'.join(dtypes)}")
    coverage.record_compiled(program, counts)
    if refused:
        warnings.warn(
            f"strata_jax: the compiled program {program} has {len(refused)} collective(s) that "
            f"XLA:CPU refuses on its MPI path ({', '.join(sorted(set(refused)))}): it fails "
            "with 'Unsupported primitive type for reduction' when it runs them, whatever MPI "
            "library is underneath. Run the job with JAX's gloo engine (STRATA_ENGINE=gloo, or "
            "`python -m strata_jax.launch --engine gloo`), or compute these values in float32 "
            "or bfloat16 (docs/guide/processes.md).",
            RuntimeWarning,
            stacklevel=3,
        )
    if debug.level() and any(not w.startswith(STRATA_CALL) for ws in counts.values() for w in ws):
        parts = [f"{op} {n} ({w})" for op, ws in sorted(counts.items()) for w, n in ws.items()]
        debug.log(f"compiled {program}: " + "; ".join(parts))


def install() -> None:
    """Has every compilation from now on inspected (see the module doc) once."""
    global _installed
    with _lock:
        if _installed:
            return
        from strata_jax._src.jax_compat import on_compiled

        on_compiled(_after_compile)
        _installed = True


def _after_compile(executable, computation, devices) -> None:
    try:
        _inspect(executable, computation, devices)
    except Warning:
        raise
    except Exception:  # noqa: BLE001 - coverage must never break a compilation
        pass


def _inspect(executable, computation, devices) -> None:
    try:
        name = str(computation.operation.attributes["sym_name"].value)
    except Exception:  # noqa: BLE001
        name = "<unnamed>"
    processes = len({d.process_index for d in devices.flatten()})
    text = "\n".join(m.to_string() for m in executable.hlo_modules())
    record_compiled(name, text, processes)
