"""What a report may replace in its folder: only what an earlier report wrote there.

A report is written into a run or bench folder that forgetless owns, yet a user may have put a
file of their own under one of its names. An earlier report is known by its contents: the
title line forgetless gives ``report.md`` and ``report.html``, and the software a plot names.
"""

from __future__ import annotations

from pathlib import Path

from forgetless.errors import ConfigError

RUN_PLOTS = ("accuracy_matrix", "task_curves", "kl_drift", "forgetting", "traces")
BENCH_PLOTS = ("tradeoff",)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TITLE = "forgetless "
"""How every report's title begins (``forgetless run: ...``, ``forgetless bench: ...``)."""


def _head(path: Path, size: int = 4096) -> bytes:
    with path.open("rb") as handle:
        return handle.read(size)


def _is_report_page(path: Path) -> bool:
    head = _head(path).decode("utf-8", errors="replace")
    if path.suffix == ".md":
        return head.startswith(f"# {TITLE}")
    return f"<title>{TITLE}" in head


def _is_plot(path: Path) -> bool:
    """A PNG that matplotlib wrote (its Software text names it), as the report's plots are."""
    head = _head(path)
    return head.startswith(PNG_SIGNATURE) and b"Software\x00Matplotlib" in head


def report_targets(folder: Path, bench: bool) -> list[Path]:
    """The files a report of ``folder`` writes that exist now."""
    plots = folder / "plots"
    names = [f"{n}.png" for n in (BENCH_PLOTS if bench else RUN_PLOTS)]
    found = [plots / n for n in names] + (sorted(plots.glob("matrix-*.png")) if bench else [])
    pages = [folder / "report.md", folder / "report.html"]
    return [p for p in pages + found if p.is_file()]


def check_report_targets(folder: Path, bench: bool) -> None:
    """Refuse, before anything is written, a report that would replace a file of the user's."""
    for path in report_targets(folder, bench):
        earlier = _is_plot(path) if path.suffix == ".png" else _is_report_page(path)
        if not earlier:
            raise ConfigError(
                f"{path}: exists and is not part of a forgetless report; move it away "
                "(forgetless never writes over files it did not write)"
            )
