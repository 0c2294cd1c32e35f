"""What a benchmark prints and writes: nccl-tests-style tables (:class:`Table`), the sentences
that compare two times ("strata is N.NNx faster than X"), the communication share of a
workload's step, CSV and JSON files, progress bars, plots, and the header and result files the
workload scripts (train_moe.py, train_recsys.py, serve_moe.py) share.
"""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Column:
    header: str
    width: int
    fmt: str = ""  # format spec for numbers, e.g. ".2f"; "" = str()


@dataclass
class Table:
    """Fixed-width text table in the style of nccl-tests (right-aligned columns, '#' headers).

    ``groups`` are optional labels printed above runs of columns, e.g. one per implementation.
    """

    columns: list[Column]
    groups: list[tuple[str, int]] = field(default_factory=list)  # (label, number of columns)
    sep: str = "  "

    def _cell(self, col: Column, value: Any) -> str:
        if value is None:
            s = "-"
        elif isinstance(value, float) and col.fmt:
            s = "nan" if value != value else format(value, col.fmt)
        else:
            s = str(value)
        return s.rjust(col.width)

    def header_lines(self) -> list[str]:
        lines = []
        if self.groups:
            parts = []
            i = 0
            for label, n in self.groups:
                cols = self.columns[i : i + n]
                w = sum(c.width for c in cols) + len(self.sep) * (n - 1)
                parts.append(label.center(w, "-") if label else " " * w)
                i += n
            lines.append("#" + self.sep.join(parts))
        lines.append("#" + self.sep.join(c.header.rjust(c.width) for c in self.columns))
        return lines

    @classmethod
    def of(cls, spec: str) -> Table:
        """A table from ``"impl 13 | first loss 10 .4f | ..."``: each column's header, its width
        and, for numbers, its format spec, columns separated by ``|``."""
        columns = []
        for part in spec.split("|"):
            words = part.split()
            fmt = words.pop() if words[-1][0] in ".," else ""
            width = int(words.pop())
            columns.append(Column(" ".join(words), width, fmt))
        return cls(columns)

    def row(self, values: Sequence[Any]) -> str:
        return " " + self.sep.join(
            self._cell(c, v) for c, v in zip(self.columns, values, strict=True)
        )


def speed_sentence(name: str, t_this: float, base: str, t_base: float, goal: float = 1.3) -> str:
    """One line that says which side is faster: "# speed: strata step is 1.97x faster than
    xla (271.9 vs 535.0 ms median; goal >= 1.3x faster: met)". Times in seconds."""
    s = t_base / t_this
    return (
        f"# speed: {name} step is {max(s, 1 / s):.2f}x {'faster' if s >= 1 else 'slower'} than "
        f"{base} ({1e3 * t_this:.1f} vs {1e3 * t_base:.1f} ms median; goal >= {goal:g}x "
        f"faster: {'met' if s >= goal else 'not met'})"
    )


def communication_share(
    t_base: float,
    t_strata: float,
    t_nocomm: float,
    base: str,
    what: str = "step",
    t_meet: float | None = None,
) -> tuple[list[str], dict[str, Any]]:
    """How much of the baseline's time is exchange, and how much of that strata removes.

    ``share = (t_base - t_nocomm) / t_base``: the baseline's time spent exchanging, measured
    against ``nocomm`` (the baseline's computation with every exchange free);
    ``removed = (t_base - t_strata) / (t_base - t_nocomm)``: the part of that time strata
    does not spend (1 = as fast as free exchanges; above 1 when strata's own computation is
    also cheaper; undefined, None, when nocomm is not faster than the baseline). Times in
    seconds (medians of the same turns). Returns the two ``#`` lines and the numbers for the
    JSON (``comm_share``, ``strata_removes``, the three times).

    With ``t_meet`` (the ``meet`` impl: nocomm whose exchanges still make the ranks meet, see
    :func:`no_exchange`) a third line splits the exchange time: ``meeting = (t_meet - t_nocomm)
    / (t_base - t_nocomm)`` is the part spent waiting for the slowest rank, which no synchronous
    exchange avoids, and ``removed_moving = (t_base - t_strata) / (t_base - t_meet)`` is how much
    of the rest (moving the bytes) strata removes (JSON: ``meet_s``, ``meeting_share``,
    ``strata_removes_of_moving``; None where undefined).
    """
    exch = t_base - t_nocomm
    share = exch / t_base if t_base > 0 else float("nan")
    removed = (t_base - t_strata) / exch if exch > 0 else None
    lines = [
        f"# communication: the {base} {what} spends {100 * share:.0f}% of its time exchanging "
        f"(against nocomm: {1e3 * t_base:.2f} vs {1e3 * t_nocomm:.2f} ms median)",
        (
            f"# strata removes {100 * removed:.0f}% of that time (({base} - strata) / "
            f"({base} - nocomm) = ({1e3 * t_base:.2f} - {1e3 * t_strata:.2f}) / "
            f"({1e3 * t_base:.2f} - {1e3 * t_nocomm:.2f}); goal >= 85%: "
            f"{'met' if removed >= 0.85 else 'not met'}"
            + (
                "; above 100%: strata's step also computes less than the baseline's)"
                if removed > 1
                else ")"
            )
            if removed is not None
            else f"# strata removes: undefined (nocomm is not faster than {base} here)"
        ),
    ]
    data = {
        "baseline": base,
        "what": what,
        "baseline_s": t_base,
        "strata_s": t_strata,
        "nocomm_s": t_nocomm,
        "comm_share": share,
        "strata_removes": removed,
    }
    if t_meet is not None:
        meeting = (t_meet - t_nocomm) / exch if exch > 0 else None
        moving = t_base - t_meet
        # Below 2% of the baseline's time the ratio is noise over noise (800% in a short run).
        removed_moving = (t_base - t_strata) / moving if moving > 0.02 * t_base else None
        lines.append(
            f"# meeting: with the ranks still meeting at every exchange but no bytes moved "
            f"(meet, {1e3 * t_meet:.2f} ms median) "
            + (
                f"{100 * meeting:.0f}% of the exchange time is waiting for the slowest rank, "
                f"which no synchronous exchange avoids"
                if meeting is not None
                else "the split is undefined (nocomm is not faster than the baseline)"
            )
            + (
                f"; strata removes {100 * removed_moving:.0f}% of the rest (({base} - strata) / "
                f"({base} - meet))"
                if removed_moving is not None
                else f"; meet is within 2% of {base}'s time: moving the bytes costs too little "
                "here to say how much of it strata removes"
            )
        )
        data.update(meet_s=t_meet, meeting_share=meeting, strata_removes_of_moving=removed_moving)
    return lines, data


# What two implementations' loss curves (same model, seed and batches) must agree to. They sum
# in different orders, so their float32 losses differ by round-off, which training amplifies.
LOSS_FIRST_STEPS = 10  # steps held to LOSS_FIRST_TOL
LOSS_FIRST_TOL = 1e-5  # |diff| over those; measured: <= 4.8e-7 (1 ulp of a loss near 4-5)
LOSS_WINDOW = 20  # steps per moving mean in the relative check
LOSS_REL_TOL = 1e-2  # |diff of moving means| / loss; measured: <= 4.2e-3 over 400 steps


def compare_loss_curves(
    a: Sequence[float],
    b: Sequence[float],
    first_steps: int = LOSS_FIRST_STEPS,
    first_tol: float = LOSS_FIRST_TOL,
    rel_tol: float = LOSS_REL_TOL,
    window: int = LOSS_WINDOW,
) -> dict[str, Any]:
    """Whether two loss curves (one float per step) agree as two correct implementations do.

    Two checks. Over the first ``first_steps`` steps, ``|a - b| <= first_tol`` (absolute): both
    start from the same parameters and batches, so there the losses differ by a few float32
    round-offs only, and wrong values show at once (a wrong forward pass at step 0, a wrong
    gradient from step 1 on: an error of 1e-4 added to 1% of the gradient elements moved the loss
    by 1.2e-4 within 12 steps). Over every step, the moving means of ``window`` steps must agree
    to ``rel_tol`` of the loss: the round-off of the different summation orders is amplified by
    every update until the two trainings are as apart as two runs of equal quality (train_moe on
    4 processes, strata vs xla_sort: 4.8e-7 up to step 80, 2.5e-3 at step 144 (0.09% of the
    loss), then per step up to 2.8% by step 365, but the 20-step means within 0.42% over 400
    steps); a training that goes wrong drifts away in the mean. NaN or inf anywhere fails.
    Returns ``ok`` and the figures: ``max_abs``/``at_step`` (per step, all steps),
    ``first10_max_abs`` (the first ``first_steps``; the key keeps its earlier name),
    ``max_rel``/``at_rel_step`` (the moving means; the step a window ends at) and the
    tolerances. Raises ValueError on curves of different lengths.
    """
    import numpy as np

    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1 or x.size == 0:
        raise ValueError(f"loss curves of different or no lengths: {x.shape} vs {y.shape}")
    d = np.abs(x - y)
    w = max(1, min(window, x.size))
    k = np.full(w, 1.0 / w)
    mx, my = np.convolve(x, k, "valid"), np.convolve(y, k, "valid")
    scale = np.maximum(np.maximum(np.abs(mx), np.abs(my)), np.finfo(np.float32).tiny)
    rel = np.abs(mx - my) / scale
    first = d[:first_steps]
    finite = bool(np.all(np.isfinite(x)) and np.all(np.isfinite(y)))
    ok = finite and bool(first.max() <= first_tol and rel.max() <= rel_tol)
    return {
        "ok": ok,
        "max_abs": float(d.max()),
        "at_step": int(d.argmax()),
        "first10_max_abs": float(first.max()),
        "first_steps": int(min(first_steps, d.size)),
        "max_rel": float(rel.max()),
        "at_rel_step": int(rel.argmax()) + w - 1,
        "window": w,
        "first_tol": first_tol,
        "rel_tol": rel_tol,
    }


def loss_curves_sentence(a: str, b: str, c: dict[str, Any]) -> str:
    """One line for :func:`compare_loss_curves`'s result ``c`` (without a verdict)."""
    return (
        f"# loss curves {a} vs {b}: first {c['first_steps']} steps max |diff| "
        f"{c['first10_max_abs']:.2e} (tolerance {c['first_tol']:g}); {c['window']}-step means "
        f"max |diff|/loss {c['max_rel']:.2e} at step {c['at_rel_step']} (tolerance "
        f"{c['rel_tol']:g}); per step max |diff| {c['max_abs']:.2e} at step {c['at_step']}"
    )


def bound_sentence(t_nocomm: float, base: str, t_base: float) -> str:
    """The communication-free bound, in the words of :func:`speed_sentence`. Times in seconds."""
    return (
        f"# bound: {base} with free communication (nocomm) is {t_base / t_nocomm:.2f}x faster "
        f"than {base} ({1e3 * t_nocomm:.1f} vs {1e3 * t_base:.1f} ms median): the most that any "
        f"faster exchange can give {base}'s computation at these sizes"
    )


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """Write dict rows to CSV; the header is the union of keys in first-seen order."""
    keys: dict[str, None] = {}
    for r in rows:
        keys.update(dict.fromkeys(r))
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(keys), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if v is None else v) for k, v in r.items()})


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):  # numpy scalars
        return o.item()
    if isinstance(o, Path):
        return str(o)
    return str(o)


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=_json_default) + "\n")


class _NoBar:
    """Stand-in for a tqdm bar when tqdm is missing or output is disabled."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass

    @staticmethod
    def write(s: str) -> None:
        print(s, flush=True)


def progress(total: int, desc: str = "", enable: bool = True) -> Any:
    """A tqdm progress bar on stderr (tqdm is in the optional ``bench`` extra); a no-op without it.

    Print through ``bar.write(line)`` so table rows and the bar do not interleave.
    """
    if enable:
        try:
            from tqdm import tqdm

            bar = tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=False)
            bar.write = lambda s: tqdm.write(s, file=sys.stdout)  # type: ignore[method-assign]
            return bar
        except ImportError:
            pass
    return _NoBar()


NO_MATPLOTLIB = "no plot: matplotlib is not installed (pip install '.[bench]')"


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or None when matplotlib is not installed (the
    ``bench`` extra brings it); callers say so with :data:`NO_MATPLOTLIB`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_lines(
    path: Path,
    panels: dict[str, dict[str, tuple[Sequence[float], Sequence[float]]]],
    *,
    xlabel: str,
    ylabel: str,
    title: str = "",
    logx2: bool = True,
) -> bool:
    """One subplot per panel, one line per series: ``panels[panel][series] = (xs, ys)``.

    Uses matplotlib's Agg backend; returns False (and writes nothing) if matplotlib is missing.
    """
    plt = pyplot()
    if plt is None:
        return False
    n = max(1, len(panels))
    ncols = min(n, 3)
    nrows = (n + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 4 * nrows), squeeze=False)
    for ax, (name, series) in zip(list(axes.flat)[: len(panels)], panels.items(), strict=True):
        for label, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o", markersize=3, label=label)
        if logx2:
            ax.set_xscale("log", base=2)
        ax.set_title(name)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def args_record(args: Any) -> dict[str, Any]:
    """A run's arguments as its JSON records them (paths as strings)."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


def write_results(
    out: Path,
    name: str,
    record: dict[str, Any],
    say: Callable[[str], Any],
    plot: Callable[[Any], Any] | None = None,
) -> None:
    """The files a workload writes at the end of a run, under ``out``: ``<name>.png``, the figure
    ``plot(plt)`` returns (pyplot; without matplotlib a line says so), and ``<name>.json``, the
    ``record``; ``say`` names each file written."""
    out.mkdir(parents=True, exist_ok=True)
    if plot is not None:
        plt = pyplot()
        if plt is None:
            say(f"# {NO_MATPLOTLIB}")
        else:
            png = out / f"{name}.png"
            fig = plot(plt)
            for ax in fig.axes:
                ax.grid(True, alpha=0.3)
                if ax.get_legend_handles_labels()[0]:
                    ax.legend()
            fig.tight_layout()
            fig.savefig(png, dpi=110)
            plt.close(fig)
            say(f"# wrote {png}")
    js = out / f"{name}.json"
    write_json(js, record)
    say(f"# wrote {js}")


def lead_print() -> Callable[..., Any]:
    """``print`` in process 0 of the job, a no-op in the others: the lines a run prints once."""
    import jax

    return print if jax.process_index() == 0 else (lambda *a, **k: None)
