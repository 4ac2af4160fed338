"""Rich progress bars for training and evaluation (silent when disabled)."""

from __future__ import annotations

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


class Progress:
    """One live display shared by the runner; ``task`` yields an ``advance(loss)`` callable."""

    def __init__(self, console: Console, enabled: bool = True) -> None:
        self.enabled = enabled
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

        def advance(loss: float | None = None) -> None:
            info = f"loss {loss:.4f}" if loss is not None else ""
            self._rich.update(task_id, advance=1, info=info)

        try:
            yield advance
        finally:
            self._rich.remove_task(task_id)
