"""A plain progress bar on stderr: redrawn in place on a terminal, a line every few seconds otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total: int | None, duration: float | None, *, label: str = "loadtest",
                 stream: TextIO | None = None, enabled: bool = True, width: int = 28):
        self.total, self.duration, self.label, self.width = total, duration, label, width
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every = 0.1 if self.tty else 5.0
        self.t0 = time.monotonic()
        self._last = float("-inf")
        self._line = ""
        self.started = self.done = self.errors = self.cancelled = self.tokens = 0

    def request_started(self) -> None:
        self.started += 1

    def request_ended(self, status: str, tokens: int) -> None:
        """`status`: OK or the gRPC status name the request ended with (CANCELLED: we cancelled it)."""
        self.done += 1
        self.cancelled += status == "CANCELLED"
        self.errors += status not in ("OK", "CANCELLED")
        self.tokens += tokens
        self.render()

    def line(self) -> str:
        elapsed = time.monotonic() - self.t0
        fractions = []
        if self.total:
            fractions.append(self.done / self.total)
        if self.duration:
            fractions.append(elapsed / self.duration)
        frac = min(max(fractions, default=0.0), 1.0)
        filled = int(frac * self.width)
        bar = "#" * filled + "-" * (self.width - filled)
        count = f"{self.done}/{self.total}" if self.total else f"{self.done}"
        return (f"{self.label} [{bar}] {count} req  {self.errors} err  {self.cancelled} cancelled  "
                f"{self.started - self.done} in flight  "
                f"{self.tokens / max(elapsed, 1e-9):.1f} tok/s  {elapsed:.1f}s")

    def render(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < self.every:
            return
        line = self.line()
        if not self.tty and line == self._line:
            return
        self._last, self._line = now, line
        if self.tty:
            self.stream.write("\r" + line + "\x1b[K")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.render(force=True)
            if self.tty:
                self.stream.write("\n")
                self.stream.flush()
