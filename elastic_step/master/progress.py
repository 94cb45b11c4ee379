"""A progress bar for local training (rich), or a plain line every few seconds when the
output is not a terminal (CI logs, pipeline pods)."""

from __future__ import annotations

import logging
import sys
import time

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from elastic_step.master.events import notable_log

BAR_EVERY_S = 0.25  # the bar's own refresh is 10 per second; the status behind it costs the master CPU


class ProgressDisplay:
    def __init__(self, enabled: bool = True, every_s: float = 5.0):
        self.enabled = enabled
        self.interactive = enabled and sys.stderr.isatty()
        self.every_s = every_s
        self._last_line = 0.0
        self._progress: Progress | None = None
        self._task = None
        self._rebound: list[tuple[logging.StreamHandler, object]] = []  # (handler, the stream it had)

    def __enter__(self):
        if self.interactive:
            terminal = sys.stderr
            self._progress = Progress(
                TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(), TextColumn("rows"),
                TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=False,
            )
            self._progress.__enter__()
            self._task = self._progress.add_task("train", total=None, info="")
            self._log_above_the_bar(terminal, sys.stderr)
        return self

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.__exit__(*exc)
        for handler, stream in self._rebound:
            handler.setStream(stream)
        self._rebound = []

    def _log_above_the_bar(self, terminal, proxy) -> None:
        """Log lines (warnings, the job's notable events) go above the bar. rich put a proxy in
        sys.stderr's place that prints them there, but the handlers made before the bar still hold
        the terminal itself, where a line ran on from the end of the bar's."""
        if proxy is terminal:
            return
        for logger in (logging.getLogger(), notable_log):
            for handler in logger.handlers:
                if isinstance(handler, logging.StreamHandler) and handler.stream is terminal:
                    self._rebound.append((handler, handler.setStream(proxy)))

    def due(self) -> bool:
        """Whether update() would show something now. The master builds its status only then:
        at its 20 ticks a second that was CPU taken from every step."""
        if not self.enabled:
            return False
        return time.monotonic() - self._last_line > (BAR_EVERY_S if self._progress is not None else self.every_s)

    def update(self, status: dict) -> None:
        if not self.enabled:
            return
        info = (
            f"epoch {status['epoch'] + 1}/{status['epochs']}  workers {status['world_size']}  "
            f"round {status['round']}  loss {status['loss'] if status['loss'] is not None else float('nan'):.4f}  {status['samples_per_s']:.0f} samples/s"
        )
        if self._progress is not None:
            self._last_line = time.monotonic()
            self._progress.update(self._task, completed=status["rows_done"], total=status["rows_total"], info=info)
        elif time.monotonic() - self._last_line > self.every_s:
            self._last_line = time.monotonic()
            print(f"training: {status['rows_done']}/{status['rows_total']} rows  {info}", file=sys.stderr, flush=True)
