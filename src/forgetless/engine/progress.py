"""Rich progress bars for training and evaluation; plain lines where no bar is drawn."""

from __future__ import annotations

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


class Heartbeat:
    """Plain progress lines (``evaluate: 137/10000``) for work that no live bar shows: under
    ``--quiet``, or into a log that is not a terminal. The first comes ``first`` seconds after
    the start, then one every ``every`` seconds; short work prints nothing."""

    def __init__(
        self,
        say: Callable[[str], None],
        what: str,
        total: int,
        done: int = 0,
        first: float = 10.0,
        every: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.say, self.what, self.total, self.done = say, what, total, done
        self.every, self.clock = every, clock
        self.due = clock() + first

    def beat(self, advance: int = 1) -> None:
        self.done += advance
        now = self.clock()
        if now >= self.due:
            self.say(f"{self.what}: {self.done}/{self.total}")
            self.due = now + self.every


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
        self, description: str, total: int, completed: int = 0
    ) -> Iterator[Callable[[float | None], None]]:
        task_id = self._rich.add_task(description, total=total, completed=completed, info="")
        heartbeat = None if self._live else self._heartbeat(description, total, completed)

        def advance(loss: float | None = None) -> None:
            info = f"loss {loss:.4f}" if loss is not None else ""
            self._rich.update(task_id, advance=1, info=info)
            if heartbeat is not None:
                heartbeat.beat()

        try:
            yield advance
        finally:
            self._rich.remove_task(task_id)

    def _heartbeat(self, what: str, total: int, done: int) -> Heartbeat:
        def say(line: str) -> None:
            self._console.print(line, markup=False, highlight=False, soft_wrap=True)

        return Heartbeat(say, what, total, done, clock=self._clock)
