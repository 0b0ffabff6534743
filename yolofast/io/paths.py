"""Where a run writes: ``increment_path``, the run-folder rule that training, validation and prediction
share (runs/detect/train, train2, train3, ...), below all three so each imports it at the top."""

from __future__ import annotations

from pathlib import Path

__all__ = ["increment_path"]


def increment_path(path: str | Path, exist_ok: bool = False) -> Path:
    """runs/train/train -> train2, train3, ... unless ``exist_ok`` or the folder does not exist yet."""
    path = Path(path)
    if exist_ok or not path.exists():
        return path
    n = 2
    while (p := path.with_name(f"{path.name}{n}")).exists():
        n += 1
    return p
