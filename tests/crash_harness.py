"""Run the forgetless CLI with a SIGKILL planted at a named point (fault-injection tests).

``python tests/crash_harness.py POINT N run CONFIG --out DIR ...`` kills this process with
SIGKILL at the N-th time the run reaches POINT; the rest of the arguments go to the CLI.
Points (each patches one function of this process only):

- ``step``: inside a training step, after the forward pass and before backward;
- ``step_checkpoint``: while a step checkpoint's tensors are written (the file half written);
- ``checkpoint``: while a task checkpoint's weights are written (the file half written);
- ``results``: while ``results.json`` is written (the temp file half written, never renamed);
- ``between_tasks``: right after a task's results were written, before the next task;
- ``task_end``: during the method's end-of-task work (Fisher, anchors, importance maps),
  after it changed the method's state in memory and before that state is saved;
- ``merge``: during a merging method's end of task, after the merge changed the model.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _kill() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _half(path: str | Path) -> None:
    """Cut a file to half its size: what a crash in the middle of writing it leaves."""
    size = os.path.getsize(path)
    with open(path, "r+b") as handle:
        handle.truncate(size // 2)


def _countdown(n: int) -> Callable[[], bool]:
    calls = [0]

    def reached() -> bool:
        calls[0] += 1
        return calls[0] == n

    return reached


def _patch(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    setattr(owner, name, make(getattr(owner, name)))


def plant(point: str, n: int) -> None:
    reached = _countdown(n)
    from forgetless.contract import registered_methods

    registered_methods()  # imports the built-in methods before their hooks are patched
    from forgetless.engine import loop, step_checkpoint

    if point == "step":

        def loss(original: Callable[..., Any]) -> Callable[..., Any]:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                out = original(*args, **kwargs)
                if reached():
                    _kill()
                return out

            return wrapped

        _patch(loop.StepLoop, "_loss", loss)
    elif point in ("step_checkpoint", "checkpoint"):
        if point == "step_checkpoint":
            module: Any = step_checkpoint
            name = "save_file"
        else:
            from forgetless.models import finetuner as module

            name = "save_model"

        def write(original: Callable[..., Any]) -> Callable[..., Any]:
            def wrapped(obj: Any, path: str, *args: Any, **kwargs: Any) -> Any:
                out = original(obj, path, *args, **kwargs)
                if reached():
                    _half(path)
                    _kill()
                return out

            return wrapped

        _patch(module, name, write)
    elif point == "results":
        real_replace = os.replace

        def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            if Path(dst).name == "results.json" and reached():
                _half(src)
                _kill()
            real_replace(src, dst, *args, **kwargs)

        os.replace = replace  # type: ignore[assignment]
    elif point == "between_tasks":
        from forgetless.training.results import Results

        def written(original: Callable[..., Any]) -> Callable[..., Any]:
            def wrapped(self: Any, out_dir: Path) -> None:
                original(self, out_dir)
                if self.completed_tasks >= 1 and reached():
                    _kill()

            return wrapped

        _patch(Results, "write", written)
    elif point in ("task_end", "merge"):
        _plant_method_end(point, reached)
    else:
        raise SystemExit(f"unknown point {point!r}")


def _plant_method_end(point: str, reached: Callable[[], bool]) -> None:
    from forgetless.contract import method as base

    hook = "on_task_end" if point == "task_end" else "train_task"

    def after(original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(self, *args, **kwargs)
            if reached():
                _kill()
            return out

        return wrapped

    # patch each class that defines the hook, a shared base (ContinualMerge) once
    methods = base.registered_methods().values()
    owners = {next(k for k in cls.__mro__ if hook in vars(k)) for cls in methods}
    for owner in owners - {base.Method}:
        _patch(owner, hook, after)


def main() -> None:
    point, n, rest = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    plant(point, n)
    from forgetless.cli.app import main as cli

    sys.argv = ["forgetless", *rest]
    cli()


if __name__ == "__main__":
    main()
