"""Progress for long steps (synth, scan, pack, verify, index), in one place.

On a terminal: a tqdm bar. When stderr is not a terminal (nohup, CI, a log file) a bar's carriage
returns are noise and tqdm's own choice is silence, which looks like a hang on a step that takes
minutes (a 1.28M-file pack printed nothing for 3 minutes under nohup). There we print one plain
line every ``SHARDKIT_PROGRESS_INTERVAL`` seconds (default 10), so a short step prints nothing and
a long one shows it is alive.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

__all__ = ["INTERVAL_ENV", "Progress", "progress", "track"]

INTERVAL_ENV = "SHARDKIT_PROGRESS_INTERVAL"
T = TypeVar("T")


class Progress:
    """``update(n)``, ``set_postfix_str(s)``, ``close()``: the part of tqdm's API we use."""

    def __init__(self, total: int | None, desc: str, unit: str, enabled: bool = True):
        self.total, self.desc, self.unit = total, desc, unit
        self.n = 0
        self.postfix = ""
        self.disable = not enabled
        self._bar = None
        self._start = self._last = time.monotonic()
        self._printed = False
        if self.disable:
            return
        stream = sys.stderr
        if stream is not None and stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, file=stream, smoothing=0.1)
        else:
            try:
                self._interval = float(os.environ.get(INTERVAL_ENV, "10"))
            except ValueError:
                self._interval = 10.0

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.disable:
            return
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self._last >= self._interval:
            self._last = now
            self._line(now)

    def set_postfix_str(self, s: str, refresh: bool = False) -> None:
        self.postfix = s
        if self._bar is not None:
            self._bar.set_postfix_str(s, refresh=refresh)

    def _line(self, now: float) -> None:
        secs = now - self._start
        of = f"/{self.total:,}" if self.total is not None and self.total >= 0 else ""
        pct = f" ({100 * self.n / self.total:.0f}%)" if of and self.total else ""
        rate = f", {self.n / secs:,.0f} {self.unit}/s" if secs > 0 else ""
        extra = f", {self.postfix}" if self.postfix else ""
        print(
            f"{self.desc}: {self.n:,}{of} {self.unit}{pct} after {secs:.0f} s{rate}{extra}",
            file=sys.stderr,
            flush=True,
        )
        self._printed = True

    def close(self) -> None:
        if self.disable:
            return
        if self._bar is not None:
            self._bar.close()
        elif self._printed:  # a log that showed progress also shows the end
            self._line(time.monotonic())
        self.disable = True

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(total: int | None, desc: str, unit: str, enabled: bool = True) -> Progress:
    return Progress(total, desc, unit, enabled)


def track(
    items: Iterable[T], desc: str, unit: str, enabled: bool = True, total: int | None = None
) -> Iterator[T]:
    """``items`` unchanged, with progress counted per item."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with Progress(total, desc, unit, enabled) as bar:
        for item in items:
            yield item
            bar.update(1)
