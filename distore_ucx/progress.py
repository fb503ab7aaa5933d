"""Progress of long work: a tqdm bar on a terminal, plain lines elsewhere.

Used by `distore bench`, `distore demo`, a storage node's start-up and
re-join, and a control plane restoring a checkpoint. On a terminal (and
without --json) a bar is drawn on stderr; otherwise each step is one plain
line (printed, or logged by services), at most one every `every` seconds,
so that logs and pipes get readable text and --json keeps stdout pure.
"""

from __future__ import annotations

import logging
import shutil
import sys
import time
from typing import IO


class Progress:
    """Progress of `total` units of work (None: unknown).

    >>> with Progress("restoring", total=10_000, unit="items") as p:
    ...     p.update(5_000)          # a bar on a terminal, a line elsewhere

    `stream` (default stderr) is where the bar or lines go; `logger`: send
    plain lines to this logger (services) instead of printing them;
    `plain=True` never draws a bar (--json, or not a terminal).
    """

    def __init__(self, desc: str, total: float | None = None, unit: str = "",
                 stream: IO[str] | None = None, logger: logging.Logger | None = None,
                 plain: bool = False, every: float = 1.0):
        self.desc, self.total, self.unit = desc, total, unit
        self.stream = stream if stream is not None else sys.stderr
        self.logger = logger
        self.every = every
        self.n: float = 0
        self._t0 = time.monotonic()
        self._last_line = float("-inf")  # the first update prints at once
        self._closed = False
        self._shown: float | None = None  # units when the last plain line was written
        self._bar = None
        if not plain and _is_terminal(self.stream):
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=f" {unit}" if unit else "it",
                             file=self.stream, unit_scale=False, leave=True,
                             # a terminal that reports no size (0 x 0) would hide the
                             # bar: it gets 80 x 24, as shutil assumes
                             ncols=shutil.get_terminal_size().columns,
                             nrows=shutil.get_terminal_size().lines)

    @property
    def is_bar(self) -> bool:
        """Whether a bar is drawn (a terminal), rather than plain lines."""
        return self._bar is not None

    def update(self, n: float = 1, note: str = "") -> None:
        """Count `n` more units done; `note` is shown beside the bar or line."""
        self.set(self.n + n, note)

    def set(self, n: float, note: str = "") -> None:
        """Set the units done to `n`."""
        if self._bar is not None:
            self._bar.update(n - self.n)
            if note:
                self._bar.set_postfix_str(note, refresh=True)
            self.n = n
            return
        self.n = n
        now = time.monotonic()
        if now - self._last_line >= self.every or (self.total is not None and n >= self.total):
            self._last_line = now
            self._line(note)

    def write(self, text: str) -> None:
        """A line of other output, printed without breaking the bar."""
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        elif self.logger is not None:
            self.logger.info("%s", text)
        else:
            print(text, file=self.stream, flush=True)

    def _line(self, note: str = "") -> None:
        unit = f" {self.unit}" if self.unit else ""
        if self.total:
            text = (f"{self.desc}: {self.n:,.0f} of {self.total:,.0f}{unit} "
                    f"({int(100 * self.n / self.total)}%)")
        else:
            text = f"{self.desc}: {self.n:,.0f}{unit}"
        text += f", {time.monotonic() - self._t0:.1f} s" + (f"; {note}" if note else "")
        self._shown = self.n
        if self.logger is not None:
            self.logger.info("%s", text)
        else:
            print(text, file=self.stream, flush=True)

    def close(self, note: str = "") -> None:
        """Finish: the bar's last state, or a closing line. Idempotent."""
        if self._bar is not None:
            if note:
                self._bar.set_postfix_str(note, refresh=False)
            self._bar.close()
            self._bar = None
        elif not self._closed and (note or self.n != self._shown):
            self._line(note)
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


__all__ = ["Progress"]
