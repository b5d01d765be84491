"""The progress bar of an experiment run: cells done, time elapsed and the ETA, on stderr.

The bar is weighted by each cell's estimated cost (:attr:`Experiment.cost
<refkv.experiments.design.Experiment.cost>`), so a grid whose last cells are cheap does not
report a pessimistic ETA; the runner starts the most expensive cells first.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

__all__ = ["Progress"]


def _clock(seconds: float) -> str:
    seconds = round(max(seconds, 0.0))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


class Progress:
    """A one-line progress bar with ETA, weighted by cell cost.

    On a terminal the line is redrawn in place; otherwise (a log file, a pipe) one line
    is printed per finished cell.

    Parameters
    ----------
    total_cells : int
    total_cost : float
        Sum of the estimated costs of the cells to run.
    stream : file, default sys.stderr
    width : int
        Characters of the bar.
    clock : callable
        Returns the time in seconds (injectable for tests).
    """

    def __init__(self, total_cells: int, total_cost: float, stream=None, width: int = 24,
                 clock: Callable[[], float] = time.monotonic):
        self.total_cells = total_cells
        self.total_cost = float(total_cost) if total_cost > 0 else float(max(total_cells, 1))
        self.stream = sys.stderr if stream is None else stream
        self.width = width
        self.clock = clock
        self.start = clock()
        self.cells = 0
        self.cost = 0.0
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def eta(self) -> float | None:
        """Seconds left, extrapolated from the cost done so far (None before any)."""
        if self.cost <= 0:
            return None
        elapsed = self.clock() - self.start
        return elapsed * (self.total_cost - self.cost) / self.cost

    def line(self, label: str = "") -> str:
        """The text of the bar."""
        fraction = min(self.cost / self.total_cost, 1.0)
        filled = round(fraction * self.width)
        eta = self.eta()
        elapsed = self.clock() - self.start
        text = (f"[{'#' * filled}{'.' * (self.width - filled)}] {self.cells}/{self.total_cells} cells "
                f"{_clock(elapsed)} elapsed, ETA {'?' if eta is None else _clock(eta)}")
        return f"{text}  {label}" if label else text

    def advance(self, cost: float, label: str = "") -> None:
        """Count one finished cell of estimated ``cost`` and redraw."""
        self.cells += 1
        self.cost += float(cost)
        text = self.line(label)
        if self.tty:
            self.stream.write("\r\x1b[2K" + text[:160])
            if self.cells >= self.total_cells:
                self.stream.write("\n")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

