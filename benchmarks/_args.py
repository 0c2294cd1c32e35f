"""A benchmark's command line and placement: sizes (``4K``, ``1M``), lists, size sweeps,
iteration counts, named presets (``--preset paper``) picked by where the run is placed (one
process, or several under ``strata_jax.launch``, mpirun or srun), and the MoE scripts' shared
flags. Nothing here imports jax: a benchmark parses its arguments before it imports strata_jax.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)

_SIZE_MULT = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str | int) -> int:
    """Parse a byte count: ``"8"``, ``"4K"``, ``"64M"``, ``"1G"``, ``"16MiB"`` (binary units)."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 8, 4K, 64M, 1G)")
    return int(float(m.group(1)) * _SIZE_MULT[m.group(2).lower()])


def format_size(nbytes: float) -> str:
    """Human form of a byte count in binary units: 8 B, 4 KiB, 64 MiB."""
    for unit, mult in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= mult:
            v = nbytes / mult
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{nbytes:.0f} B"


def parse_list(
    text: str, choices: Sequence[str] | None = None, *, all_word: str = "all"
) -> list[str]:
    """Parse a comma list (``"a,b"``); ``all_word`` expands to every choice; validates choices."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if choices is not None:
        if all_word in items:
            return list(choices)
        bad = [t for t in items if t not in choices]
        if bad:
            raise ValueError(f"unknown value(s) {bad}; choose from {list(choices)} or {all_word!r}")
    # de-duplicate, keep order
    return list(dict.fromkeys(items))


def size_sweep(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """Sizes min, min*factor, min*factor**2, ... <= max (nccl-tests' ``-b/-e/-f``); ascending."""
    if min_bytes <= 0 or max_bytes < min_bytes or factor < 2:
        raise ValueError(f"bad sweep: min={min_bytes} max={max_bytes} factor={factor}")
    sizes = []
    s = min_bytes
    while s <= max_bytes:
        sizes.append(s)
        s *= factor
    return sizes


PRESET_PLACES = ("one_process", "launch")


def processes_env() -> dict[str, Any] | None:
    """This run's processes when there are several, else None (one process, in-process devices).

    Under ``strata_jax.launch``: its environment. Under mpirun or srun (a cluster launcher's
    variables, :func:`strata_jax.launch.cluster_env`): ``num_processes`` and ``process_id`` from
    them and ``local_device_count`` from ``JAX_NUM_CPU_DEVICES`` (default 1); the script then
    calls ``strata_jax.init()``, which starts ``jax.distributed`` from the same variables.
    Returns ``{"num_processes", "process_id", "local_device_count", "by"}`` (``by``:
    ``"strata_jax.launch"`` or the launcher's size variable). Safe before jax is imported.
    """
    from strata_jax.launch import cluster_env, distributed_env  # noqa: PLC0415 (no jax yet)

    d = distributed_env()
    if d is not None:
        return {**d, "by": "strata_jax.launch"}
    var, n, rank = cluster_env()
    if n < 2:
        return None
    devices = os.environ.get("JAX_NUM_CPU_DEVICES", "1")
    return {
        "num_processes": n,
        "process_id": rank,
        "local_device_count": int(devices) if devices.isdigit() else 1,
        "by": var,
    }


def preset_place() -> str:
    """Where this run is, for :func:`add_preset`: ``"launch"`` with several processes (under
    ``strata_jax.launch``, mpirun or srun), else ``"one_process"`` (in-process devices). Reads
    the launchers' environment only: safe before jax is imported."""
    return "one_process" if processes_env() is None else "launch"


def preset_flags(values: dict[str, Any]) -> str:
    """A preset's values as the command-line flags they stand for: ``--d-model 256 --batch 1``."""
    return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in values.items())


def add_preset(
    parser: Any,
    presets: dict[str, dict[str, dict[str, Any]]],
    argv: Sequence[str] | None,
    why: str = "",
) -> None:
    """Add ``--preset NAME`` to ``parser`` and, when ``argv`` names one, make its values the
    parser's defaults (``parser.set_defaults``): flags given on the command line still win,
    wherever they stand. Call before ``parser.parse_args(argv)``.

    ``presets[name][place]`` maps argparse destinations to values, for each place of
    :data:`PRESET_PLACES` (``"one_process"``: in-process devices; ``"launch"``: several
    processes, under ``strata_jax.launch``, mpirun or srun): a preset may pick its
    configuration by how the run is placed.
    ``--help`` lists every preset's flags per place (after ``--preset NAME``, the defaults shown
    are the preset's). After parsing, ``args.preset`` is the name (or None) and
    ``args.preset_place`` the place it was picked for and ``args.preset_flags`` its values as
    flags, so the JSON written from ``vars(args)`` records all three.
    """
    import argparse  # noqa: PLC0415

    lines = []
    for name, places in presets.items():
        for place in PRESET_PLACES:
            where = "one process" if place == "one_process" else "several processes: launch, mpirun"
            lines.append(f"{name} ({where}): {preset_flags(places[place])}")
    parser.add_argument(
        "--preset",
        choices=sorted(presets),
        default=None,
        help=f"a named configuration; its values become the defaults, so flags given "
        f"explicitly still override them. {why} " + "; ".join(lines),
    )
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", choices=sorted(presets), default=None)
    known, _ = pre.parse_known_args(argv)
    place = preset_place()
    parser.set_defaults(preset_place=place if known.preset else None, preset_flags=None)
    if known.preset:
        values = presets[known.preset][place]
        parser.set_defaults(preset_flags=preset_flags(values), **values)


def preset_line(args: Any, presets: dict[str, dict[str, dict[str, Any]]]) -> str | None:
    """The header line of a run made with ``--preset`` (None without): its name, the place it
    was picked for and its flags (explicit flags on the command line override them)."""
    if not getattr(args, "preset", None):
        return None
    where = "one process" if args.preset_place == "one_process" else "several processes"
    values = presets[args.preset][args.preset_place]
    mine = {k: getattr(args, k) for k in values if getattr(args, k) != values[k]}
    over = f"; overridden on the command line: {preset_flags(mine)}" if mine else ""
    return f"# preset     : {args.preset} ({where}): {preset_flags(values)}{over}"


def auto_iters(nbytes: int, budget: float = 5e8, lo: int = 5, hi: int = 200) -> int:
    """Iterations for one timed point: ``clamp(budget / bytes, lo, hi)``."""
    return int(min(hi, max(lo, budget // max(nbytes, 1))))


def add_loss_tolerance_args(group) -> None:
    """``--tol-steps``, ``--tol-first``, ``--tol-rel`` and ``--tol-window``: what two
    implementations' loss curves must agree to (train_moe.py, train_recsys.py;
    ``_report.compare_loss_curves`` says why)."""
    from _report import LOSS_FIRST_STEPS, LOSS_FIRST_TOL, LOSS_REL_TOL, LOSS_WINDOW

    group.add_argument(
        "--tol-steps",
        type=int,
        default=LOSS_FIRST_STEPS,
        help="the first steps, held to --tol-first (same parameters and batches: round-off only)",
    )
    group.add_argument(
        "--tol-first",
        type=float,
        default=LOSS_FIRST_TOL,
        help="max |loss_a - loss_b| over the first --tol-steps steps",
    )
    group.add_argument(
        "--tol-rel",
        type=float,
        default=LOSS_REL_TOL,
        help="max |diff| / loss of the --tol-window-step moving means of the two curves (float32 "
        "round-off of the different summation orders grows over training)",
    )
    group.add_argument(
        "--tol-window",
        type=int,
        default=LOSS_WINDOW,
        help="steps per moving mean in the --tol-rel check",
    )


def add_expert_chunk_args(group) -> None:
    """``--expert-chunk`` and ``--baseline-expert-chunk`` (train_moe.py, serve_moe.py)."""
    group.add_argument(
        "--expert-chunk",
        type=expert_chunk_arg,
        default=128,
        help="run each expert MLP in chunks of this many rows and skip the chunks no token "
        "was routed to (moe_mlp(expert_chunk=...); strata's low-latency path: on its receive "
        "counts; not strata_ragged, whose ragged_dot covers the received rows only); 'none': "
        "over every capacity row",
    )
    group.add_argument(
        "--baseline-expert-chunk",
        type=expert_chunk_arg,
        default=128,
        help="--expert-chunk for the XLA baselines (xla_sort, xla, nocomm): their blocks per "
        "source rank hold fewer rows each, so their best setting can differ (at 8 experts per "
        "device 'none' measured faster for xla_sort)",
    )
    group.add_argument(
        "--no-preload",
        dest="preload",
        action="store_false",
        help="turn off the in-process re-run under LD_PRELOAD=libstrata_alloc.so (preload: "
        "%(default)s; without it plain glibc: XLA's large buffers of every impl are fresh "
        "mmapped pages each step); under strata_jax.launch the launcher's setting applies",
    )


def expert_chunk_arg(value: str) -> int | None:
    """argparse type of ``--expert-chunk``: a positive int, or ``none``."""
    if value.strip().lower() == "none":
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n <= 0:
        import argparse  # noqa: PLC0415

        raise argparse.ArgumentTypeError(
            f"--expert-chunk must be a positive number of rows or 'none', got {value!r}"
        )
    return n


def impl_list(parser: Any, text: str, choices: Sequence[str]) -> list[str]:
    """``--impl``'s comma list as names of ``choices`` (:func:`parse_list`), or the parser's
    error saying what is wrong: an unknown name, or none at all."""
    try:
        names = parse_list(text, choices)
    except ValueError as e:
        parser.error(f"--impl: {e}")
    if not names:
        parser.error(f"--impl: name at least one of {tuple(choices)}")
    return names
