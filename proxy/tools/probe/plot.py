"""`--plot FILE` for `infertap probe` and `infertap compare`: the TTFT and TPOT distributions as a chart.

matplotlib is an optional extra (`pip install 'infertap[plot]'`), imported only when a chart is
asked for. pyplot is never imported: each chart is a `Figure` drawn on an explicit Agg canvas, so
no GUI backend is ever chosen and no global figure is left open. The size is fixed (12 x 5 in at
100 dpi: a 1200 x 500 px PNG), and the image format follows the file's extension (.png, .svg,
.pdf, ...; PNG when there is none).

compare: two panels, TTFT and TPOT, each with A and B as a box (median and quartiles, whiskers
at 1.5 IQR) over every request as a dot, on an axis that starts at 0 so the ratio can be seen;
each panel is titled with its verdict. probe: two histograms with the p50 and p90 marked.
"""

from __future__ import annotations

import random
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from proxy.tools.probe.histogram import bin_count
from proxy.tools.probe.stats import percentile
from proxy.tools.probe.target import ToolError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def install_hint() -> str:
    """How to install the plot extra: into this checkout's environment when run from one."""
    root = Path(__file__).resolve().parents[3]
    if (root / "pyproject.toml").is_file() and (root / "proxy").is_dir():
        return f"{Path(sys.executable)} -m pip install -e '{root}[plot]'"
    return "pip install 'infertap[plot]'"


FIGSIZE = (12.0, 5.0)
DPI = 100
COLOR_A = "#1f77b4"  # blue
COLOR_B = "#e66100"  # orange: the pair reads apart for colour-blind eyes too
PANELS: tuple[tuple[str, str], ...] = (("TTFT", "ttft_s"), ("TPOT", "tpot_s"))


def _canvas() -> tuple[type[Figure], Any]:
    """(Figure, FigureCanvasAgg), or ToolError with the install hint when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401  (the package first, so a missing install says "matplotlib")
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ToolError(f"--plot needs matplotlib, an optional extra: {install_hint()} ({e})") from None
    return Figure, FigureCanvasAgg


def check_output(path: str) -> str:
    """Fail early, before any request is sent: matplotlib must be there, the format known and the
    folder present. Returns the image format."""
    _, canvas = _canvas()
    p = Path(path)
    fmt = p.suffix.lower().removeprefix(".") or "png"
    supported = canvas.get_supported_filetypes()
    if fmt not in supported:
        raise ToolError(f"--plot {path}: unknown image format .{fmt} (use .png, .svg or .pdf)")
    if not p.parent.is_dir():
        raise ToolError(f"--plot {path}: the folder {p.parent} does not exist")
    return fmt


def _new_figure() -> Figure:
    figure_cls, canvas = _canvas()
    fig = figure_cls(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    canvas(fig)
    return fig


def _save(fig: Figure, path: str) -> None:
    fmt = check_output(path)
    try:
        # No bbox_inches="tight": it would change the pixel size.
        fig.savefig(path, format=fmt, dpi=DPI, facecolor="white")
    except OSError as e:
        raise ToolError(f"--plot {path}: cannot write: {e.strerror or e}") from None


def ok_values_ms(run: dict[str, Any], key: str) -> list[float]:
    """The metric of every successful request of a probe report, in milliseconds."""
    return [r[key] * 1000 for r in run["results"] if r["ok"] and r.get(key) is not None]


def fmt_ms(v: float) -> str:
    digits = 0 if v >= 99.95 else 1 if v >= 9.995 else 2  # "10.0 ms", never "10.00 ms"
    return f"{v:.{digits}f} ms"


# -- compare ----------------------------------------------------------------------------------


def _ab_panel(ax: Axes, name: str, series: Sequence[tuple[str, list[float], str]]) -> None:
    rng = random.Random(0)  # the dots' sideways jitter: the same picture for the same numbers
    top = max((max(values) for _, values, _ in series if values), default=1.0)
    for pos, (_, values, color) in enumerate(series, start=1):
        if not values:
            ax.text(pos, top * 0.5, "no successful\nrequests", ha="center", va="center", color="0.4")
            continue
        ax.boxplot(
            [values],
            positions=[pos],
            widths=0.5,
            showfliers=False,  # every point is drawn as a dot anyway
            patch_artist=True,
            boxprops={"facecolor": color, "alpha": 0.25, "edgecolor": color},
            whiskerprops={"color": color},
            capprops={"color": color},
            medianprops={"color": color, "linewidth": 2.5},
        )
        xs = [pos + rng.uniform(-0.15, 0.15) for _ in values]
        ax.scatter(xs, values, s=22, color=color, alpha=0.75, edgecolors="white", linewidths=0.5, zorder=3)
        median = percentile(values, 50)
        ax.annotate(
            f"median {fmt_ms(median)}",
            xy=(pos + 0.27, median),
            xytext=(6, 0),
            textcoords="offset points",
            va="center",
            fontsize=10,
            color=color,
            fontweight="bold",
        )
    ax.set_xticks(range(1, len(series) + 1), [f"{label}\n(n={len(values)})" for label, values, _ in series])
    ax.set_xlim(0.4, len(series) + 1.05)
    ax.set_ylim(0, top * 1.12)
    ax.set_ylabel(f"{name} (ms)")
    ax.grid(axis="y", color="0.9")
    ax.set_axisbelow(True)


def panel_title(verdict: str, width: int = 60) -> str:
    """The verdict on one line when it fits the panel, else on two, broken where it reads well:
    "TTFT: no clear difference" / "(B/A 1.02×, 95% CI 0.95–1.10×)", or "TPOT 3.1× higher in B," /
    "95% CI 2.8–3.4×"."""
    if len(verdict) <= width:
        return verdict
    head, sep, tail = verdict.partition(" (")
    if sep:
        return f"{head}\n({tail}"
    head, sep, tail = verdict.partition(", ")
    if sep:
        return f"{head},\n{tail}"
    return textwrap.fill(verdict, width=width)


def compare_chart(report: dict[str, Any], path: str) -> None:
    """A vs B for TTFT and TPOT, side by side; each panel titled with its verdict."""
    la, lb = report["labels"]["a"], report["labels"]["b"]
    fig = _new_figure()
    axes = fig.subplots(1, len(PANELS))
    for ax, (name, key) in zip(axes, PANELS, strict=True):
        series = [
            (la, ok_values_ms(report["a"], key), COLOR_A),
            (lb, ok_values_ms(report["b"], key), COLOR_B),
        ]
        _ab_panel(ax, name, series)
        ax.set_title(panel_title(report["metrics"][key]["verdict"]), fontsize=11, fontweight="bold")
    boot = report["bootstrap"]
    fig.suptitle(
        f"{la} vs {lb}, the same prompts in interleaved rounds "
        f"(concurrency {report['a']['concurrency']}); verdicts: ratio of medians {lb}/{la}, "
        f"{boot['confidence'] * 100:g}% bootstrap CI",
        fontsize=10,
        color="0.3",
    )
    _save(fig, path)


# -- probe ------------------------------------------------------------------------------------


def _histogram_panel(ax: Axes, name: str, values: list[float]) -> None:
    if not values:
        ax.text(0.5, 0.5, "no successful requests", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(name)
        return
    ax.hist(values, bins=max(bin_count(len(values)), 5), color=COLOR_A, edgecolor="white")
    p50, p90 = percentile(values, 50), percentile(values, 90)
    ax.axvline(p50, color="black", linewidth=2, label=f"p50 {fmt_ms(p50)}")
    ax.axvline(p90, color=COLOR_B, linewidth=2, linestyle="--", label=f"p90 {fmt_ms(p90)}")
    ax.legend(loc="upper right")
    ax.set_title(f"{name}: p50 {fmt_ms(p50)}, p90 {fmt_ms(p90)} (n={len(values)})", fontweight="bold")
    ax.set_xlabel(f"{name} (ms)")
    ax.set_ylabel("requests")
    from matplotlib.ticker import MaxNLocator  # matplotlib is there: _new_figure checked

    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(axis="y", color="0.9")
    ax.set_axisbelow(True)


def probe_chart(report: dict[str, Any], path: str) -> None:
    """The run's TTFT and TPOT histograms, side by side."""
    fig = _new_figure()
    axes = fig.subplots(1, len(PANELS))
    for ax, (name, key) in zip(axes, PANELS, strict=True):
        _histogram_panel(ax, name, ok_values_ms(report, key))
    t = report["target"]
    fig.suptitle(
        f"{t['base_url']}  model {t['model']}: {report['ok']} ok, {report['failed']} failed, "
        f"concurrency {report['concurrency']}",
        fontsize=10,
        color="0.3",
    )
    _save(fig, path)


def write_chart(
    draw: Callable[[dict[str, Any], str], None], report: dict[str, Any], path: str, prog: str
) -> int | None:
    """Draws `report` to `path` and says so on stderr; returns exit status 2 when it cannot."""
    try:
        draw(report, path)
    except ToolError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    print(f"{prog}: chart written to {path}", file=sys.stderr)
    return None
