"""What a benchmark case is: a preset's op on one device with its variants (backends and baselines).

A leaf of ``yolofast.bench``, so that the case builders (``cases``, and ``musgd`` for the optimizer step)
share these types without importing each other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from yolofast.bench.presets import Preset


@dataclasses.dataclass
class Variant:
    name: str  # a yolofast backend ("ref", "cpp", ...), "auto", or a baseline ("foreach_lerp", "copy")
    fn: Callable[[], object] | None  # one unit of work; None when unavailable
    reason: str = ""  # why unavailable, or what it is (baselines, auto's choice)
    baseline: bool = False  # not a yolofast backend: shown for context, never compared or gated

    @property
    def available(self) -> bool:
        return self.fn is not None


@dataclasses.dataclass
class Case:
    preset: Preset
    op: str
    device: str
    variants: list[Variant]
    items_per_call: int = 0  # images per call (train_step): the runner reports images/s
    what: str = ""  # one line: what a call does
    split: Callable[[int], dict] | None = None  # train_step: split(n) -> seconds per phase of n auto steps

    def variant(self, name: str) -> Variant | None:
        return next((v for v in self.variants if v.name == name), None)
