"""Pictures of a bench run: throughput with error bars, and one run's measured timeline.

matplotlib (the ``bench`` extra) through a bare ``Figure`` on an Agg canvas: no display needed,
and no ``matplotlib.use`` or pyplot state, so an interactive caller's backend and open figures
are left alone. Files are written under a temporary name and renamed, so a reader never sees
half a PNG.
"""

from __future__ import annotations

import os

from ..extras import require
from ..fsutil import temp_name
from .report import compare
from .results import BenchResult, Timeline

__all__ = ["plot_throughput", "plot_timeline", "throughput_figure", "timeline_figure"]

_COLOURS = {
    "folder": "#d62728",
    "tar": "#1f77b4",
    "lmdb": "#2ca02c",
    "memory": "#9467bd",
    "loader": "#ff7f0e",
}


def _figure(figsize: tuple[float, float]):
    """A figure drawn by the Agg canvas, outside pyplot (nothing global is switched)."""
    require("bench", "plotting (--plot, --timeline)")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = temp_name(path)
    try:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _title(result: BenchResult) -> str:
    cfg = result.config
    text = (
        f"mode={cfg.mode}, {'cold' if cfg.cold else 'warm'} cache, "
        f"latency {cfg.latency_ms:g} ms/open"
    )
    if cfg.step_ms:
        text += f", step {cfg.step_ms:g} ms"
    return text


def dataset_label(result: BenchResult) -> str:
    """``data/lfw (13,233 samples)``: the folder if one was read, else the first source."""
    if not result.sources:
        return "dataset unknown"
    fmt = "folder" if "folder" in result.sources else next(iter(result.sources))
    n = result.num_samples.get(fmt)
    return f"{result.sources[fmt]}" + (f" ({n:,} samples)" if n is not None else "")


def plot_throughput(result: BenchResult, path: str) -> None:
    """Write ``throughput_figure`` as a PNG at ``path``."""
    _save(throughput_figure(result), path)


def throughput_figure(result: BenchResult):
    """Worker count on x, samples/s on y, error bars = std over repeats, one line per format.

    Each format's fastest mean is starred; worker counts within noise of it (Welch, 95%) get a
    ring, so the eye does not pick a "best" the repeats cannot tell apart. The legend sits
    outside the axes, right of them, so it can never cover a point.
    """
    cfg = result.config
    fig = _figure((9, 4.5))
    ax = fig.subplots()
    for fmt in result.formats():
        rows = sorted((r for r in result.rows if r.format == fmt), key=lambda r: r.workers)
        colour = _COLOURS.get(fmt)
        lines = ax.errorbar(
            [r.workers for r in rows],
            [r.mean for r in rows],
            yerr=[r.std for r in rows],
            marker="o",
            capsize=4,
            linestyle=":" if fmt == "memory" else "-",
            label="memory (reference: bytes in RAM)" if fmt == "memory" else fmt,
            color=colour,
        )
        colour = lines[0].get_color()
        best = result.best(fmt)
        ax.plot(
            [best.workers],
            [best.mean],
            marker="*",
            markersize=16,
            color=colour,
            markeredgecolor="black",
            linestyle="none",
            gid=f"best-{fmt}",
            zorder=5,
        )
        tied = [r for r in rows if r is not best and not compare(best, r).real]
        if tied:
            ax.plot(
                [r.workers for r in tied],
                [r.mean for r in tied],
                marker="o",
                markersize=13,
                markerfacecolor="none",
                markeredgecolor=colour,
                linestyle="none",
                gid=f"tied-{fmt}",
                zorder=4,
            )
    if result.ceiling_single is not None:
        ws = sorted(cfg.workers)
        ax.plot(
            ws,
            [result.ceiling(w) for w in ws],
            linestyle="--",
            color="grey",
            label=f"{cfg.mode} ceiling (1 process x min(workers, {result.cores} cores))",
        )
    from matplotlib.lines import Line2D

    handles, _labels = ax.get_legend_handles_labels()
    handles += [
        Line2D(
            [],
            [],
            marker="*",
            markersize=12,
            color="grey",
            markeredgecolor="black",
            linestyle="none",
            label="fastest mean of the format",
        ),
        Line2D(
            [],
            [],
            marker="o",
            markersize=10,
            markerfacecolor="none",
            markeredgecolor="grey",
            linestyle="none",
            label="within noise of it (Welch's t, 95%)",
        ),
    ]
    ax.set_xticks(sorted(cfg.workers))
    ax.set_xlabel("DataLoader workers")
    ax.set_ylabel("samples/s (mean ± std over repeats)")
    ax.set_ylim(bottom=0)
    load = f", load {result.load_before.load_1m:.1f}" if result.load_before else ""
    ax.set_title(
        f"shardkit bench: {dataset_label(result)}\n{_title(result)}, batch {cfg.batch_size}, "
        f"{cfg.repeats} repeats, {result.cores} cores{load}",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend(
        handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0
    )
    fig.tight_layout()
    return fig


def plot_timeline(timeline: Timeline, path: str, result: BenchResult | None = None) -> None:
    """Write ``timeline_figure`` as a PNG at ``path``."""
    _save(timeline_figure(timeline, result), path)


#: Worker batches alternate two shades by round (one batch per worker per round), so that
#: neighbouring batches of one worker stay apart.
_SHADES = ("#1f77b4", "#6baed6")


def timeline_figure(timeline: Timeline, result: BenchResult | None = None):
    """One run over time: a row per worker with its batches, and the main loop's waits/steps.

    Worker rows show when each consumed batch was being produced (first sample requested to
    batch collated) and are numbered by the order the loop consumed them; the main row shows
    the time in ``next(loader)``, split into stalled (red: the batch was not ready yet) and
    receiving (orange: the batch was ready, the DataLoader was handing it over), and the step
    (green). Input-bound training shows as red in the main row while every worker is busy.
    """
    workers = sorted({b[0] for b in timeline.batches})
    labels = ["main loop"] + [("main (no workers)" if w < 0 else f"worker {w}") for w in workers]
    height = 1.2 + 0.45 * len(labels)
    fig = _figure((11, max(2.8, height)))
    ax = fig.subplots()
    from matplotlib.patches import Patch  # after _figure: the extra is checked

    y_main = len(workers)
    ax.broken_barh([(0, timeline.started)], (y_main - 0.4, 0.8), color="#999999")
    # Each wait splits where its batch was ready in the worker: before, the loop stalled on
    # loading (red); after, it was receiving a finished batch (orange).
    stalls, transfers = [], []
    for (tw, tr), (_w, _start, ready, _got) in zip(timeline.waits, timeline.batches, strict=True):
        cut = min(max(ready, tw), tr)
        stalls.append((tw, cut - tw))
        transfers.append((cut, tr - cut))
    ax.broken_barh(stalls, (y_main - 0.4, 0.8), color="#d62728")
    ax.broken_barh(transfers, (y_main - 0.4, 0.8), color="#ff9f1c")
    if timeline.steps:
        ax.broken_barh(
            [(a, b - a) for a, b in timeline.steps], (y_main - 0.4, 0.8), color="#2ca02c"
        )
    shades = _SHADES
    numbered = len(timeline.batches) <= 60
    for n, (w, start, end, _got) in enumerate(timeline.batches):
        y = len(workers) - 1 - workers.index(w)
        colour = "#bbbbbb" if n < timeline.warmup else shades[(n // len(workers)) % 2]
        ax.broken_barh(
            [(start, end - start)],
            (y - 0.35, 0.7),
            color=colour,
            edgecolor="white",
            linewidth=0.6,
        )
        if numbered:
            ax.text(
                (start + end) / 2,
                y,
                str(n),
                ha="center",
                va="center",
                fontsize=6,
                color="white",
            )
    if len(timeline.batches) > timeline.warmup:
        t_timed = timeline.waits[timeline.warmup][0]
        ax.axvline(t_timed, color="black", linestyle=":", linewidth=1)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(list(reversed(labels[1:])) + [labels[0]])
    ax.set_xlabel("seconds since the DataLoader was started")
    ax.set_xlim(left=0)
    title = f"{timeline.format}, {timeline.workers} workers, repeat {timeline.repeat + 1}"
    if result is not None:
        title += f" - {_title(result)}, batch {result.config.batch_size}"
    ax.set_title(title, fontsize=10)
    from matplotlib.lines import Line2D

    number = " n (white number: the order the loop consumed it)" if numbered else ""
    handles = [
        Patch(color=_SHADES[0], label=f"worker producing batch{number}"),
        Patch(color=_SHADES[1], label="same, next round (shades alternate per round)"),
        Patch(color="#bbbbbb", label="warm-up batches (untimed)"),
        Patch(color="#999999", label="main loop starting the workers (iter(loader))"),
        Patch(color="#d62728", label="main loop stalled: batch not ready yet"),
        Patch(color="#ff9f1c", label="main loop receiving a ready batch"),
    ]
    if timeline.steps:
        handles.append(
            Patch(color="#2ca02c", label=f"main loop step ({timeline.step_ms:g} ms sleep)")
        )
    if len(timeline.batches) > timeline.warmup:
        handles.append(
            Line2D(
                [],
                [],
                color="black",
                linestyle=":",
                linewidth=1,
                label="timing starts (warm-up over)",
            )
        )
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig
