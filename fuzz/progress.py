"""Campaign progress: a live rich panel on a terminal, plain lines in CI."""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, TextIO

from differential.errors import printable

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["CampaignStats", "Progress"]


@dataclass
class CampaignStats:
    """Counters a campaign updates as it goes.

    Attributes:
        examples: scenarios generated and judged.
        started: ``time.perf_counter()`` at the campaign start (after vLLM import).
        findings_by_kind: findings seen, duplicates included, by kind.
        distinct: distinct signatures seen.
        first_finding_s: seconds from start to the first finding, if any.
        coverage: scenarios run per ``class:value`` of the scenario space
            (drafter, protection, retention class, geometry scale).
        engine: (scheduler mode) what the scheduler-mode scenarios exercised:
            counts of scenarios that were concurrent, multi-turn (answer
            reused), speculative (drafts accepted / rejected, and with a
            draft rejected), decoding, with a Mamba group, with annotated
            draft groups, evicting and preempting, and sums of evicted
            blocks, preemptions, unreachable cached blocks and pool blocks,
            over every variant run.
    """

    examples: int = 0
    started: float = field(default_factory=time.perf_counter)
    findings_by_kind: Counter[str] = field(default_factory=Counter)
    distinct: int = 0
    first_finding_s: float | None = None
    coverage: Counter[str] = field(default_factory=Counter)
    engine: Counter[str] = field(default_factory=Counter)

    @property
    def elapsed_s(self) -> float:
        """Seconds since the start."""
        return time.perf_counter() - self.started

    @property
    def executions_per_s(self) -> float:
        """Scenarios judged per second so far."""
        return self.examples / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def line(self) -> str:
        """One plain status line."""
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.findings_by_kind.items())) or "none"
        return (
            f"{self.examples} examples, {self.executions_per_s:.1f}/s, "
            f"{self.elapsed_s:.0f} s, {self.distinct} distinct; findings: {kinds}"
        )


class Progress:
    """Shows :class:`CampaignStats` while a campaign runs.

    A live panel (rich) when ``stream`` is a terminal and CI is not set;
    otherwise a plain line every ``interval_s`` seconds and on each new
    distinct finding.
    """

    def __init__(
        self, stats: CampaignStats, *, stream: TextIO | None = None, interval_s: float = 5.0
    ) -> None:
        import os

        self.stats = stats
        self.stream = stream or sys.stderr
        self.interval_s = interval_s
        self._last = 0.0
        self._live = None
        if self.stream.isatty() and not os.environ.get("CI"):
            from rich.console import Console
            from rich.live import Live

            self._live = Live(
                console=Console(file=self.stream), refresh_per_second=4, transient=False
            )

    def _render(self) -> Table:
        from rich.table import Table

        stats = self.stats
        table = Table(title="kvfuzz fuzz", show_header=False)
        table.add_row("examples", str(stats.examples))
        table.add_row("executions / s", f"{stats.executions_per_s:.1f}")
        table.add_row("elapsed", f"{stats.elapsed_s:.0f} s")
        table.add_row("distinct findings", str(stats.distinct))
        for kind, n in sorted(stats.findings_by_kind.items()):
            table.add_row(f"  {kind}", str(n))
        return table

    def __enter__(self) -> Progress:
        if self._live is not None:
            self._live.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._live is not None:
            self._live.update(self._render())
            self._live.__exit__(exc_type, exc, tb)

    def tick(self, *, force: bool = False) -> None:
        """Refresh the display (rate-limited unless ``force``)."""
        now = time.perf_counter()
        if self._live is not None:
            if force or now - self._last >= 0.25:
                self._live.update(self._render())
                self._last = now
        elif force or now - self._last >= self.interval_s:
            print(self.stats.line(), file=self.stream, flush=True)
            self._last = now

    def note(self, message: str) -> None:
        """Print a message above the live display (or as a plain line)."""
        message = printable(message)  # file names may hold newlines and ANSI escapes
        if self._live is not None:
            self._live.console.print(message, markup=False, highlight=False)
        else:
            print(message, file=self.stream, flush=True)
