"""Helpers for the tests of hybridspec's gate cycles (workers/runner.py _StepEnds): a stand-in CUDA event on CPU and
a _StepEnds that takes its CUDA paths with it, recording each timed cycle's clocks."""

from __future__ import annotations

import time

import workers.runner as runner_mod


class HostTimedEvent:
    """A stand-in CUDA event: done at once, timed by the host clock."""

    def record(self) -> None:
        self.t = time.perf_counter() * 1e3

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: "HostTimedEvent") -> float:
        return other.t - self.t


def record_cycle_clocks(monkeypatch) -> tuple[list[tuple[bool, bool, bool, bool | None]], list[bool]]:
    """Makes every runner built from now on time its gate on HostTimedEvents (the CUDA paths, on CPU). Returns
    (cycles, starts): per cycle a step hands to step_ended (its start on the host clock, its end on the host clock,
    the step drafted, the step before it drafted), and per cycle start (resumed) whether it is on the host clock."""
    cycles: list[tuple[bool, bool, bool, bool | None]] = []
    starts: list[bool] = []

    class Ends(runner_mod._StepEnds):
        def __init__(self, device, clock=time.perf_counter, new_event=None):
            super().__init__(device, clock, new_event or HostTimedEvent)

        def step_ended(self, started, ended, end, sample):
            if sample is not None and self.resume is not None:
                before = self.last_end[1] if self.last_end is not None else None
                cycles.append((self._on_host(self.resume[0]), self._on_host(end), sample[1], before))
            return super().step_ended(started, ended, end, sample)

        def resumed(self, sample_next=True, host=False):
            super().resumed(sample_next, host)
            if self.resume is not None:
                starts.append(self._on_host(self.resume[0]))
    monkeypatch.setattr(runner_mod, "_StepEnds", Ends)
    return cycles, starts
