"""Where an epoch's time goes (``profile=True``): data wait, forward, loss, backward, optimizer + EMA,
validation, and the rest (callbacks, logging, saving).

The loop calls ``mark(phase)`` at each boundary: the time since the previous mark belongs to ``phase``.
On a CPU a mark reads ``time.perf_counter()``; on a GPU it records a CUDA event and the events are read at
the epoch's end (``split``), so a profiled step still never waits for the device. ``profile=False`` gets
``NullProfiler``, whose ``mark`` does nothing.

On a GPU the split is the device's timeline: "data" is the time the GPU sat idle waiting for the next
batch, and a phase the host enqueued ahead (forward while the GPU still ran the last step) is counted
where the GPU ran it.
"""

from __future__ import annotations

import time

import torch

__all__ = ["PHASES", "NullProfiler", "StepProfiler", "format_split", "make_profiler"]

PHASES = ("data", "forward", "loss", "backward", "optimizer", "graph_step", "val", "other")
_LABELS = {"optimizer": "optimizer+EMA", "graph_step": "graph step (fwd+loss+bwd+opt)"}


class NullProfiler:
    enabled = False

    def reset(self) -> None:
        pass

    def mark(self, phase: str) -> None:
        pass


class StepProfiler:
    enabled = True

    def __init__(self, device: torch.device | str = "cpu"):
        self.cuda = torch.device(device).type == "cuda"
        self.reset()

    def _stamp(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def reset(self) -> None:
        """Start a new epoch's split from now."""
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._pending = []  # CUDA: (phase, start event, end event) not yet read
        self._last = self._stamp()

    def mark(self, phase: str) -> None:
        now = self._stamp()
        if self.cuda:
            self._pending.append((phase, self._last, now))
            if len(self._pending) >= 4096:  # read the finished ones now: a long epoch keeps few events alive
                self._drain(block=False)
        else:
            self.seconds[phase] += now - self._last
        self._last = now

    def _drain(self, block: bool) -> None:
        keep = []
        for phase, start, end in self._pending:
            if block or end.query():
                if block:
                    end.synchronize()
                self.seconds[phase] += start.elapsed_time(end) / 1000
            else:
                keep.append((phase, start, end))
        self._pending = keep

    def split(self) -> dict:
        """Seconds per phase since ``reset`` (phases that never ran are left out)."""
        if self.cuda:
            self._drain(block=True)
        return {k: v for k, v in self.seconds.items() if v > 0}


def make_profiler(enabled: bool, device) -> StepProfiler | NullProfiler:
    return StepProfiler(device) if enabled else NullProfiler()


def format_split(seconds: dict) -> str:
    """'data 12.0%  forward 30.1%  ...  (of 41.2 s)': each phase's share of their total."""
    total = sum(seconds.values())
    if total <= 0:
        return "nothing timed"
    parts = [f"{_LABELS.get(k, k)} {100 * v / total:.1f}%" for k, v in seconds.items()]
    return "  ".join(parts) + f"  (of {total:.2f} s)"
