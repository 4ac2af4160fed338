"""Rich progress bars for training and evaluation; plain lines where no bar is drawn."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.progress import Progress as RichProgress

from forgetless.errors import ConfigError

EVERY_VARIABLE = "FORGETLESS_PROGRESS_EVERY"
"""Seconds between plain progress lines (default 30, the first after 10): 0 prints every step."""


def line_interval(default: float = 30.0) -> float:
    """The seconds between plain progress lines: ``$FORGETLESS_PROGRESS_EVERY`` or ``default``."""
    raw = os.environ.get(EVERY_VARIABLE, "").strip()
    if not raw:
        return default
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        raise ConfigError(f"{EVERY_VARIABLE}={raw!r}: expected a number of seconds, e.g. 30")
    return seconds


def duration(seconds: float) -> str:
    """``45s``, ``3m20s``, ``2h05m``: the time left at a glance."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def rate_text(per_second: float) -> str:
    return f"{per_second:.0f}" if per_second >= 10 else f"{per_second:.2g}"


class Heartbeat:
    """Plain progress lines (``evaluate: 137/10000, 41/s, 4m00s left``) for work that no live
    bar shows: under ``--quiet``, or into a log that is not a terminal. The first comes
    ``first`` seconds (default 10) after the start, then one every ``every`` seconds (default
    ``line_interval()``) and one as each tenth of the work is passed, unless the line before is
    under ``first`` seconds old: short work prints nothing."""

    def __init__(
        self,
        say: Callable[[str], None],
        what: str,
        total: int,
        done: int = 0,
        first: float | None = None,
        every: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        unit: str = "",
    ) -> None:
        self.say, self.what, self.total, self.done, self.unit = say, what, total, done, unit
        self.every = line_interval() if every is None else every
        self.clock = clock
        self.start, self.start_done = clock(), done
        self.gap = min(10.0, self.every) if first is None else first
        self.soon = self.due = self.start + self.gap
        self.tenth = max(1, total // 10)
        self.mark = (done // self.tenth + 1) * self.tenth

    def beat(self, advance: int = 1) -> None:
        self.done += advance
        now = self.clock()
        tenth = self.done >= self.mark  # a tenth of the work is passed
        if tenth:
            self.mark = (self.done // self.tenth + 1) * self.tenth
        if now >= self.due or (tenth and now >= self.soon):
            self.say(self.line(now))
            self.due, self.soon = now + self.every, now + self.gap

    def count(self) -> str:
        shown = f"{self.done}/{self.total}"
        return f"{self.unit} {shown}" if self.unit else shown

    def line(self, now: float) -> str:
        """``what: step 120/500, 1.9 step/s, 3m20s left`` (the rate since this start)."""
        elapsed, moved = now - self.start, self.done - self.start_done
        if elapsed <= 0 or moved <= 0:
            return f"{self.what}: {self.count()}"
        rate = moved / elapsed
        left = duration(max(0, self.total - self.done) / rate)
        per = f"{rate_text(rate)} {self.unit}/s" if self.unit else f"{rate_text(rate)}/s"
        return f"{self.what}: {self.count()}, {per}, {left} left"


class Progress:
    """One live display shared by the runner; ``task`` yields an ``advance(loss)`` callable.
    Where the bar is not drawn live, a ``Heartbeat`` prints plain lines to the console."""

    def __init__(
        self, console: Console, enabled: bool = True, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.enabled = enabled
        self._console, self._clock = console, clock
        self._live = enabled and console.is_terminal
        self._rich = RichProgress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=True,
            disable=not enabled,
        )

    def __enter__(self) -> Progress:
        self._rich.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._rich.__exit__(None, None, None)

    @contextmanager
    def task(
        self, description: str, total: int, completed: int = 0, unit: str = ""
    ) -> Iterator[Callable[[float | None], None]]:
        """A bar for ``total`` units of work (``unit`` names them in plain lines: ``step``).
        Into a log that is not a terminal, the work's start is one plain line."""
        task_id = self._rich.add_task(description, total=total, completed=completed, info="")
        heartbeat = None if self._live else self._heartbeat(description, total, completed, unit)
        if heartbeat is not None and self.enabled:
            self._say(f"{description}: start, {heartbeat.count()}")

        def advance(loss: float | None = None) -> None:
            info = f"loss {loss:.4f}" if loss is not None else ""
            self._rich.update(task_id, advance=1, info=info)
            if heartbeat is not None:
                heartbeat.beat()

        try:
            yield advance
        finally:
            self._rich.remove_task(task_id)

    def _heartbeat(self, what: str, total: int, done: int, unit: str) -> Heartbeat:
        return Heartbeat(self._say, what, total, done, clock=self._clock, unit=unit)

    def _say(self, line: str) -> None:
        self._console.print(line, markup=False, highlight=False, soft_wrap=True)
