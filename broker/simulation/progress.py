"""How a long ``gpush simulate`` shows that it is working: :class:`Progress` takes the
run's steps (a name and a count each) and, once the run has taken longer than
:data:`QUIET_SECONDS`, shows them on a stream (stderr: stdout keeps the summary or the
JSON). On a terminal that is a bar that goes away when the run ends; elsewhere (a log, a
CI job) a line every :data:`LINE_SECONDS`. :class:`Silent` shows nothing (the default
of :func:`broker.simulation.report.run_simulation`, and what tests use)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TextIO

# A run shorter than this shows nothing: the demo (about a second) stays as it was.
QUIET_SECONDS = 2.0
# Off a terminal, a line this often: enough to tell a slow run from a stuck one.
LINE_SECONDS = 5.0


class Silent:
    """Progress that shows nothing."""

    def step(self, name: str, total: int | None = None, unit: str = "") -> None:
        """Begin the next step, of ``total`` ``unit`` (jobs, runs, plots) when known."""

    def update(self, done: int) -> None:
        """``done`` units of the current step are done."""

    def close(self) -> None:
        """The run ended."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Progress(Silent):
    """Progress on ``stream`` once the run is older than ``quiet`` seconds: a transient
    rich bar when ``stream`` is a terminal, else a line every ``every`` seconds and one
    when the run ends. ``clock`` and ``terminal`` are for tests."""

    def __init__(
        self,
        stream: TextIO,
        *,
        quiet: float | None = None,
        every: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        terminal: bool | None = None,
    ) -> None:
        from rich.console import Console

        self.stream = stream
        self.quiet = QUIET_SECONDS if quiet is None else quiet
        self.every = LINE_SECONDS if every is None else every
        self.clock = clock
        self.console = Console(file=stream, highlight=False)
        self.terminal = self.console.is_terminal if terminal is None else terminal
        self.began = clock()
        self.name = ""
        self.total: int | None = None
        self.unit = ""
        self.done = 0
        self.steps = 0
        self.shown = False  # anything written yet
        self.last_line = -float("inf")
        self._bar = None
        self._task = None

    def step(self, name: str, total: int | None = None, unit: str = "") -> None:
        self.name, self.total, self.done, self.unit = name, total, 0, unit
        self.steps += 1
        if self._bar is not None:
            # A task of its own per step: reset() keeps the old total when the new one is unknown.
            self._bar.remove_task(self._task)
            self._task = self._bar.add_task(name, total=total)
        self._show(step_began=True)

    def update(self, done: int) -> None:
        self.done = done
        if self._bar is not None:
            self._bar.update(self._task, completed=done)
        self._show(step_began=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        elif self.shown:
            self._line(f"done in {self._elapsed()}")

    def _show(self, step_began: bool) -> None:
        now = self.clock()
        if now - self.began < self.quiet:
            return
        if self.terminal:
            if self._bar is None:
                self._start_bar()
            return
        # A line when one is due, and at each new step once lines have begun, so a log
        # says which step a slow run is in.
        if now - self.last_line >= self.every or (step_began and self.shown):
            self.last_line = now
            count = f": {self.done:,} of {self.total:,} {self.unit}".rstrip() if self.total and self.done else ""
            self._line(f"{self.name}{count} ({self._elapsed()} so far)")

    def _start_bar(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as Bar

        self._bar = Bar(
            TextColumn("gpush simulate: {task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
            transient=True,
        )
        self._task = self._bar.add_task(self.name, total=self.total, completed=self.done)
        self._bar.start()
        self.shown = True

    def _line(self, text: str) -> None:
        self.stream.write(f"gpush simulate: {text}\n")
        self.stream.flush()
        self.shown = True

    def _elapsed(self) -> str:
        return f"{self.clock() - self.began:.0f}s"
