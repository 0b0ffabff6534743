"""torchrun restarts (``--max-restarts=K``): a restarted worker group continues the run it was training.

torchrun restarts every worker after one dies and tells them so in ``TORCHELASTIC_RESTART_COUNT`` (> 0);
``TORCHELASTIC_RUN_ID`` stays the same for the whole job (a uuid with ``--standalone``, ``--rdzv-id``
across nodes). Rank 0 writes that id into its run folder (``RUN_ID_FILE``) when the run starts; a restarted
worker looks for the folder of ``project/name*`` holding its id and resumes from its ``weights/last.pt``,
so the run folder is not incremented and results.csv keeps one row per epoch. Restarted workers of every
node need to see that folder: across nodes, ``project`` must be on a shared file system.
"""

from __future__ import annotations

import os
from pathlib import Path

from yolofast.engine.distributed import restart_count

__all__ = ["RUN_ID_FILE", "torchrun_run_id", "mark_run", "restarted_run"]

RUN_ID_FILE = ".torchrun_run_id"


def torchrun_run_id() -> str | None:
    """The torchrun job's id, or None when this process was not started by torchrun."""
    return os.environ.get("TORCHELASTIC_RUN_ID") or None


def mark_run(save_dir: str | Path) -> None:
    """Record in ``save_dir`` that this torchrun job trains there (rank 0, when the run starts)."""
    run_id = torchrun_run_id()
    if run_id is not None:
        (Path(save_dir) / RUN_ID_FILE).write_text(run_id + "\n", encoding="utf-8")


def restarted_run(project: str | Path, name: str) -> Path | None:
    """The run folder a restarted torchrun worker continues: the newest ``project/name*`` folder marked
    with this job's id; None on a first attempt, outside torchrun, or when no folder was made yet."""
    run_id = torchrun_run_id()
    if run_id is None or restart_count() == 0:
        return None
    project = Path(project)
    marked = [d for d in project.glob(f"{name}*") if _run_id_of(d) == run_id] if project.is_dir() else []
    return max(marked, key=lambda d: (d / RUN_ID_FILE).stat().st_mtime, default=None)


def _run_id_of(folder: Path) -> str | None:
    try:
        return (folder / RUN_ID_FILE).read_text(encoding="utf-8").strip()
    except OSError:
        return None
