"""Benchmarks of yolofast: named presets, realistic inputs, interleaved timing, comparison, CI floors.

    from yolofast.bench import bench_main          # `yolofast bench ...` (argv after "bench") -> exit code
    from yolofast.bench.presets import get_preset  # shapes shared with benchmarks/*.py and the CI gate
    from yolofast.bench.inputs import loss_inputs, ema_inputs, step_inputs
    from yolofast.bench.cases import build_cases   # per-backend callables of one preset
"""

from yolofast.bench.presets import PRESETS, Preset, get_preset, list_presets

__all__ = ["PRESETS", "Preset", "bench_main", "get_preset", "list_presets"]


def bench_main(argv: list[str]) -> int:
    """``yolofast bench`` (imported lazily: importing the presets must not import torch's heavier parts)."""
    from yolofast.bench.cli import bench_main as _main

    return _main(argv)
