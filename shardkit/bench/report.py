"""What a bench run tells the user: the table, the verdict in words, the JSON for machines.

The verdict only says what this run measured: it compares the formats and worker counts that
ran, in the one mode that ran, and says which knob to try and why, with the numbers behind it.
"""

from __future__ import annotations

import json
from dataclasses import replace

from ..fsutil import atomic_write_bytes
from ..loader.stats import NOT_INPUT_BOUND, PARTLY_AT, verdict_of
from .results import BenchResult, Row
from .stats import ALPHA, Comparison, welch

__all__ = ["format_table", "verdict", "to_json", "write_json"]

# The words and thresholds of "input-bound" are the training-time stats' (``ShardLoader.stats``):
# one vocabulary before training and during it. The runs fit when the wait is under PARTLY_AT.
#: Shortest timed run whose rate the verdict compares. Below it a run is a batch or two, and one
#: scheduler delay or page fault is a large share of it: a t-test on such runs (seen: runs of
#: ~0.5 ms called "real (p<0.001)") measures timer and scheduler noise, not the loader. 0.1 s
#: is tens of scheduler slices; the default runs are timed for 2 s.
MIN_JUDGED_S = 0.1


def _title(result: BenchResult) -> str:
    cfg = result.config
    parts = [
        f"mode={cfg.mode}",
        "cold cache" if cfg.cold else "warm cache",
        f"latency {cfg.latency_ms:g} ms/open",
    ]
    if cfg.step_ms:
        parts.append(f"step {cfg.step_ms:g} ms")
    parts.append(f"batch {cfg.batch_size}")
    return ", ".join(parts)


def load_line(result: BenchResult) -> str | None:
    """``load 1/5/15 min: 4.95/6.37/7.16 before, 5.10/6.20/7.00 after; 2 cores (cpu_count 2)``."""
    before, after = result.load_before, result.load_after
    if before is None and after is None:
        return None
    parts = [f"{x.text()} {w}" for w, x in (("before", before), ("after", after)) if x]
    ref = before or after
    return f"load 1/5/15 min: {', '.join(parts)}; {ref.cores} cores (cpu_count {ref.cpu_count})"


def format_table(result: BenchResult) -> str:
    """Format x workers: samples/s mean +- std, MB/s, first-batch time, wait and stall
    fractions, % of the decode ceiling."""
    has_ceiling = result.ceiling_single is not None
    head = ["format", "workers", "samples/s (mean ± std)", "MB/s", "first batch", "wait", "stall"]
    if has_ceiling:
        head.append("% of ceiling")
    lines = []
    for row in result.rows:
        mb = row.mb_per_s
        cells = [
            row.format,
            str(row.workers),
            f"{row.mean:,.0f} ± {row.std:,.0f}",
            f"{mb:,.1f}" if mb is not None else "-",
            f"{row.first_batch_s:.2f} s",
            f"{row.wait_fraction:.0%}",
            f"{row.stall_fraction:.0%}",
        ]
        if has_ceiling:
            frac = row.ceiling_fraction
            cells.append(f"{frac:.0%}" if frac is not None else "-")
        lines.append(cells)
    widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(head)]
    align = ["<", ">", ">", ">", ">", ">", ">", ">"]

    def fmt(cells: list[str]) -> str:
        padded = (f"{c:{a}{w}}" for c, a, w in zip(cells, align, widths, strict=False))
        return "  ".join(padded).rstrip()

    out = [_title(result)]
    out += [line for line in (load_line(result), result.load_warning()) if line]
    out += [fmt(head), fmt(["-" * w for w in widths])]
    prev = None
    for row, cells in zip(result.rows, lines, strict=True):
        if prev is not None and row.format != prev:
            out.append("")
        out.append(fmt(cells))
        prev = row.format
    if has_ceiling:
        out.append(
            f"ceiling: one process {result.config.mode}s {result.ceiling_single:,.0f} samples/s "
            f"from memory; x min(workers, {result.cores} cores)"
        )
    return "\n".join(out)


def compare(a: Row, b: Row) -> Comparison:
    """Welch's t-test of ``a``'s per-run rates against ``b``'s; not real when a run of either
    was timed under ``MIN_JUDGED_S`` (then ``short_s`` says how short)."""
    c = welch(a.rates, b.rates)
    shortest = min((r.timed_s for r in (*a.runs, *b.runs)), default=None)
    if shortest is not None and shortest < MIN_JUDGED_S:
        return replace(c, short_s=shortest)
    return c


def too_short_line(result: BenchResult) -> str | None:
    """What to do when runs were too short for the verdict to compare them."""
    runs = [r for row in result.rows for r in row.runs]
    short = [r for r in runs if r.timed_s < MIN_JUDGED_S]
    if not short:
        return None
    return (
        f"{len(short)} of {len(runs)} runs were timed under {MIN_JUDGED_S:g} s (shortest "
        f"{min(r.timed_s for r in short) * 1000:.3g} ms): too short to judge, so no difference "
        "involving them is called real; time longer runs with --min-seconds and --min-samples "
        "(or more --batches)."
    )


def _pm(row: Row) -> str:
    return f"{row.mean:,.0f} ± {row.std:,.0f}"


def best_workers_line(result: BenchResult, fmt: str) -> str:
    """The fastest worker count of ``fmt``, and which others are within noise of it or slower.

    Only a significant difference (Welch, 95%) ranks two worker counts; the others are named as
    within noise, so two runs of the same command cannot name different "best" counts without
    saying that the choice between them is noise.
    """
    rows = sorted((r for r in result.rows if r.format == fmt), key=lambda r: r.workers)
    best = result.best(fmt)
    text = f"{fmt}: fastest mean at {best.workers} workers, {_pm(best)} samples/s"
    tied, slower, short = [], [], []
    for row in rows:
        if row is not best:
            c = compare(best, row)
            (short if c.short_s is not None else slower if c.real else tied).append((row, c))
    if tied:
        text += "; within noise of " + ", ".join(
            f"{r.workers} workers ({_pm(r)}, {c.describe()})" for r, c in tied
        )
        fewest = min([best, *(r for r, _ in tied)], key=lambda r: r.workers)
        if fewest is not best:
            text += f", so {fewest.workers} workers do as well as far as this run can tell"
    if short:
        text += (
            "; not compared with "
            + ", ".join(f"{r.workers} workers ({_pm(r)})" for r, _ in short)
            + f" ({short[0][1].describe()})"
        )
    if slower:
        text += "; faster than " + ", ".join(
            f"{r.workers} workers ({r.mean:,.0f}, {c.describe()})" for r, c in slower
        )
    return text + "."


def vs_line(result: BenchResult, fmt: str, base_fmt: str = "folder") -> str:
    """``tar vs folder, each at its best: 1.2x (408 ± 223 vs 336 ± 188 samples/s): within noise
    (p=0.59).``"""
    best, base = result.best(fmt), result.best(base_fmt)
    c = compare(best, base)
    text = (
        f"{fmt} vs {base_fmt}, each at its best: {c.ratio:.1f}x ({_pm(best)} vs {_pm(base)} "
        f"samples/s"
    )
    if c.real:
        return text + f", {c.describe()}: a real difference)."
    if c.short_s is not None:
        return text + f"): {c.describe()}."
    return text + f"): within noise ({c.describe()})."


def verdict(result: BenchResult) -> list[str]:  # noqa: C901 (one if-block per sentence)
    """Plain-words conclusions, each grounded in numbers from this run.

    A difference between two configurations is called real only when Welch's t-test on their
    per-run rates says so (p < ``stats.ALPHA``); otherwise the verdict says "within noise".
    """
    cfg = result.config
    lines: list[str] = []
    formats = result.formats()
    bests = {f: result.best(f) for f in formats}
    max_w = max(cfg.workers)

    for fmt in bests:
        lines.append(best_workers_line(result, fmt))

    for fmt, best in bests.items():
        with_workers = [r for r in result.rows if r.format == fmt and r.workers > 0]
        if best.workers > 0 and not cfg.step_ms and best.stall_fraction < best.wait_fraction / 4:
            lines.append(
                f"{fmt} at {best.workers} workers: the loop stalled on loading only "
                f"{best.stall_fraction:.0%} of the time; the rest it was receiving batches the "
                "workers had already finished: the DataLoader's hand-over from worker to main "
                "process is the limit there, not storage or decoding."
            )
        if best.workers == 0 and with_workers and not cfg.step_ms:
            top = max(with_workers, key=lambda r: r.mean)
            if top.stall_fraction < top.wait_fraction / 2 and compare(best, top).real:
                lines.append(
                    f"{fmt}: with workers its batches were mostly ready before the loop asked "
                    f"(stalled {top.stall_fraction:.0%} of the time at {top.workers} workers): "
                    f"handing batches from workers to the main process caps it at "
                    f"{top.mean:,.0f} samples/s, below the {best.mean:,.0f} one process reads "
                    "alone."
                )

    if "folder" in bests:
        for fmt in bests:
            if fmt not in ("folder", "memory"):
                lines.append(vs_line(result, fmt))

    if "memory" in bests:
        ref = bests["memory"]
        parts = []
        for fmt, best in bests.items():
            if fmt != "memory":
                noise = "" if compare(best, ref).real else " (within noise)"
                parts.append(f"{fmt} {best.mean / ref.mean:.0%}{noise}")
        lines.append(
            f"memory reference (the same bytes in RAM, same {cfg.mode}, same DataLoader): "
            f"{ref.mean:,.0f} samples/s at {ref.workers} workers; each format at its best "
            f"reaches {', '.join(parts)} of it. What a format misses of it is its storage and "
            "reading cost."
        )
        frac = ref.ceiling_fraction
        if frac is not None and not cfg.step_ms and frac < 0.8:
            lines.append(
                f"Even with no storage at all, the DataLoader delivers {frac:.0%} of the "
                f"{cfg.mode} ceiling: that gap is not the data format."
            )

    if cfg.latency_ms:
        parts = []
        for fmt, best in bests.items():
            opens = [r.opens for r in best.runs if r.opens is not None]
            if opens:
                per = sum(opens) / max(1, sum(r.timed_samples for r in best.runs))
                parts.append(f"{fmt} {per:.3g} opens/sample")
        if parts:
            lines.append(
                f"Each open paid {cfg.latency_ms:g} ms (folder: one per image; shards: one per "
                f"shard slice a worker opens): {', '.join(parts)} (prefetch included)."
            )

    if result.ceiling_single is not None:
        parts = []
        for fmt, best in bests.items():
            frac = best.ceiling_fraction
            if frac is not None:
                parts.append(f"{fmt} {frac:.0%} at {best.workers} workers")
        lines.append(
            f"{cfg.mode} ceiling: one process {cfg.mode}s {result.ceiling_single:,.0f} samples/s "
            f"in memory, {result.ceiling(max_w):,.0f} with {min(max(max_w, 1), result.cores)} "
            f"processes; reached: {', '.join(parts)}."
        )
        at_ceiling = [f for f, b in bests.items() if (b.ceiling_fraction or 0) >= 0.8]
        if cfg.step_ms:
            lines.append(
                f"(With --step-ms, a run that is not input-bound is paced by the {cfg.step_ms:g} "
                "ms step, not by the loader: compare with the ceiling from a run without it.)"
            )
        elif not at_ceiling and "memory" not in bests:
            lines.append(
                f"No format reaches 80% of the {cfg.mode} ceiling; add memory to --formats to "
                "see how much of the gap is storage and how much the DataLoader itself."
            )
        elif at_ceiling:
            lines.append(
                f"{', '.join(at_ceiling)} run at >= 80% of what the {result.cores} cores can "
                f"{cfg.mode}: the loader is CPU-bound on {cfg.mode}, not on storage; fewer "
                "pixels per sample are the lever (`shardkit pack --resize-short N`)"
                + (", and a cheaper augmentation" if cfg.mode == "augment" else "")
                + "."
            )
    elif cfg.mode == "raw":
        lines.append(
            "This run read bytes only (--mode raw): it measures storage and transport, not "
            "decoding; run --mode decode to see whether JPEG decoding is the limit."
        )

    lines.extend(_run_length_lines(result))
    short = too_short_line(result)
    if short:
        lines.append(short)
    lines.append(
        f"Differences are called real when Welch's t-test on the {cfg.repeats} per-run rates "
        f"gives p < {ALPHA:g}; otherwise within noise."
    )

    if cfg.step_ms:
        need = cfg.batch_size / (cfg.step_ms / 1000.0)
        lines.append(
            f"A {cfg.step_ms:g} ms step at batch {cfg.batch_size} consumes up to {need:,.0f} "
            "samples/s."
        )
        for fmt, best in bests.items():
            lines.append(_step_advice(result, fmt, best, need))
    return lines


def _run_length_lines(result: BenchResult) -> list[str]:
    """Say when runs were cut short: by the time cap or by the end of the data."""
    cfg = result.config
    runs = [r for row in result.rows for r in row.runs]
    lines = []
    capped = sum(r.stopped == "max_seconds" for r in runs)
    ran_out = sum(r.stopped == "data" for r in runs)
    if capped:
        lines.append(
            f"{capped} of {len(runs)} runs reached max_seconds ({cfg.max_seconds:g} s) before "
            f"{cfg.min_samples} samples: their rates rest on fewer samples."
        )
    if ran_out:
        lines.append(
            f"{ran_out} of {len(runs)} runs reached the end of the data before their minimum "
            "time: a bigger data set gives longer, steadier runs."
        )
    return lines


def _step_advice(result: BenchResult, fmt: str, best: Row, need: float) -> str:
    cfg = result.config
    wait = best.wait_fraction
    rows = [r for r in result.rows if r.format == fmt]
    said = verdict_of(wait)
    if said == NOT_INPUT_BOUND:
        enough = [r for r in rows if r.wait_fraction < PARTLY_AT]
        fewest = min(enough, key=lambda r: r.workers)
        return (
            f"{fmt}: {said}: the loop waits {wait:.0%} of its time at {best.workers} "
            f"workers; {fewest.workers} workers already keep the wait under {PARTLY_AT:.0%}."
        )
    stall = best.stall_fraction
    if stall < wait / 2:
        per_batch = (wait - stall) * (1000.0 / max(best.mean / cfg.batch_size, 1e-9))
        return (
            f"{fmt}: {said} by transfer, not loading: the loop waits {wait:.0%} of its time "
            f"at {best.workers} workers but only {stall:.0%} before a batch was ready; the rest, "
            f"~{per_batch:.1f} ms per batch, is the DataLoader handing a ready batch over. Fewer "
            "bytes per batch help (pre-resize with `shardkit pack --resize-short N`, crop in the "
            "worker); more workers do not."
        )
    fixes = []
    other_ok = [
        f
        for f in result.formats()
        if f not in (fmt, "folder", "memory") and result.best(f).wait_fraction < PARTLY_AT
    ]
    if fmt == "folder" and other_ok:
        fixes.append(
            f"switch to shards ({', '.join(other_ok)} kept the wait under {PARTLY_AT:.0%})"
        )
    by_w = sorted(rows, key=lambda r: r.workers)
    if best.workers == by_w[-1].workers and len(by_w) > 1 and compare(by_w[-1], by_w[-2]).real:
        fixes.append("more workers (the rate still rose at the largest count tried)")
    frac = best.ceiling_fraction
    if frac is not None and frac >= 0.5:
        if cfg.mode == "augment":
            fixes.append(
                f"less CPU per sample: the loader already runs at {frac:.0%} of what the cores "
                "can augment, so use a cheaper augmentation (or run it on the GPU), and "
                "pre-resize with `shardkit pack --resize-short N` to cut the decode share"
            )
        else:
            fixes.append(
                f"fewer pixels per sample: the loader already runs at {frac:.0%} of what the "
                f"cores can {cfg.mode}, so pre-resize with `shardkit pack --resize-short N`"
            )
    elif cfg.mode == "augment":
        fixes.append("a cheaper augmentation, or pre-resize with `shardkit pack --resize-short N`")
    if cfg.mode == "raw" and fmt != "folder":
        fixes.append("more workers or larger reads; storage is the limit in raw mode")
    if not fixes:
        fixes.append(
            "more workers, shards, or pre-resizing; this run cannot tell which limit dominates"
        )
    return (
        f"{fmt}: {said}: the loop waits {wait:.0%} of its time even at its best "
        f"({best.workers} workers, {best.mean:,.0f} of the {need:,.0f} samples/s the step could "
        f"take). Try: {'; '.join(fixes)}."
    )


def to_json(result: BenchResult) -> dict:
    """One row per (format, workers) plus the configuration and machine facts."""
    cfg = result.config
    rows = []
    for r in result.rows:
        rows.append(
            {
                "format": r.format,
                "workers": r.workers,
                "mean_samples_per_s": r.mean,
                "std_samples_per_s": r.std,
                "runs": [run.samples_per_s for run in r.runs],
                "first_batch_s": r.first_batch_s,
                "wait_fraction": r.wait_fraction,
                "stall_fraction": r.stall_fraction,
                "mb_per_s": r.mb_per_s,
                "ceiling_samples_per_s": r.ceiling,
                "ceiling_fraction": r.ceiling_fraction,
                "first_batch_s_runs": [run.first_batch_s for run in r.runs],
                "wait_fraction_runs": [run.wait_fraction for run in r.runs],
                "opens_runs": [run.opens for run in r.runs],
                "timed_samples_runs": [run.timed_samples for run in r.runs],
                "resident_before_runs": [run.resident_before for run in r.runs],
                "timed_s_runs": [run.timed_s for run in r.runs],
                "wall_s_runs": [run.wall_s for run in r.runs],
                "stopped_runs": [run.stopped for run in r.runs],
            }
        )
    return {
        "shardkit_bench": 1,
        "config": cfg.as_dict(),
        "sources": result.sources,
        "bytes_per_sample": result.bytes_per_sample,
        "machine": result.machine,
        "load": {
            "before": result.load_before.as_dict() if result.load_before else None,
            "after": result.load_after.as_dict() if result.load_after else None,
        },
        "load_warning": result.load_warning(),
        "decode_ceiling_single_process": result.ceiling_single,
        "seconds": result.seconds,
        "estimate_s": result.estimate_s,
        "rows": rows,
        "verdict": verdict(result),
        "notes": result.notes,
        "definitions": {
            "samples_per_s": "timed samples / timed wall time; warm-up: first max(1, workers) "
            "batches excluded",
            "mb_per_s": "samples_per_s x stored bytes per sample (image files for folder, shard "
            "bytes for shards)",
            "first_batch_s": "DataLoader start to the first batch in hand",
            "wait_fraction": "time blocked in next(loader) / timed wall time",
            "stall_fraction": "the part of that wait before the batch was ready in its worker",
            "opens": "storage opens (each charged latency_ms) during the run, prefetch included",
            "ceiling": "one process decoding the same JPEG bytes x min(max(workers,1), cores)",
            "load": "os.getloadavg() (1, 5, 15 min) with the usable cores and os.cpu_count(), "
            "before and after the whole bench",
            "within noise": "Welch's t-test on the per-run rates gives p >= 0.05",
        },
    }


def write_json(result: BenchResult, path: str) -> None:
    """Write ``to_json`` atomically (temporary name, then rename)."""
    text = json.dumps(to_json(result), indent=1, ensure_ascii=False)
    atomic_write_bytes(path, text.encode() + b"\n")
