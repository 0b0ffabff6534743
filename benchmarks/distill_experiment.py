"""Does distillation help? Paired students with and without a teacher, one pair per seed, and the table.

    python benchmarks/distill_experiment.py TEACHER.pt [--seeds 0 1 2] [--dis 6.0] [--max-norm 10]
                                            [--project runs/distill] [key=value ...]

For each seed: a student trained without a teacher and one with ``distill_model=TEACHER.pt dis=DIS``, on
the same recipe (``yolofast train``'s: the quick-start defaults on the shapes data, then the key=value
arguments, e.g. ``epochs=15`` or ``data=my.yaml``). Prints each run's best mAP50-95 / mAP50 (best.pt's, what
``train()`` returns), the mean and spread over the seeds, and the paired gain. A run whose results.csv
already holds every epoch is read, not trained again, so the baselines are shared between calls that vary
``--dis`` or that were interrupted.

``--max-norm`` sets the gradient clip of both arms (``Trainer.max_norm``, Ultralytics' 10 by default): with
the loss x batch every step of these runs is clipped, which is one candidate reason for the teacher not to
help (its gradient then takes a share of a fixed-length step instead of adding to it); ``--max-norm 1e9``
turns clipping off to test that. The csv's ``grad/clip_frac`` (share of clipped steps) is printed too.
"""

from __future__ import annotations

import argparse
import csv
import statistics
from pathlib import Path

from yolofast.cfg import DEFAULTS, QUICKSTART


def _rows(csv_path: Path) -> list[dict]:
    if not csv_path.is_file():
        return []
    with open(csv_path, newline="") as f:
        return [{k.strip(): v for k, v in r.items()} for r in csv.DictReader(f)]


def _summary(rows: list[dict]) -> dict:
    """best.pt's row (max mAP50-95) and what the run's gradients and distillation term did."""
    best = max(rows, key=lambda r: float(r["metrics/mAP50-95(B)"]))
    clip = [float(r["grad/clip_frac"]) for r in rows if r.get("grad/clip_frac") not in (None, "", "nan")]
    return {"map": float(best["metrics/mAP50-95(B)"]), "map50": float(best["metrics/mAP50(B)"]),
            "best_epoch": int(float(best["epoch"])),
            "clip_frac": sum(clip) / len(clip) if clip else float("nan"),
            "grad_norm": float(rows[-1].get("grad/norm_mean") or "nan"),
            "dis_loss": float(rows[-1].get("train/dis_loss") or "nan")}


def train_student(name: str, project: Path, recipe: dict, seed: int, max_norm: float, teacher=None,
                  dis: float = 6.0) -> dict:
    """One student (trained unless its results.csv already holds every epoch); its ``_summary``."""
    from yolofast import Trainer

    rows = _rows(project / name / "results.csv")
    if len(rows) < int(recipe.get("epochs", DEFAULTS["epochs"])):
        clipped = type("ClipTrainer", (Trainer,), {"max_norm": float(max_norm)})
        extra = {"distill_model": str(teacher), "dis": dis} if teacher else {}
        clipped(**recipe, **extra, seed=seed, project=str(project), name=name, exist_ok=True).train()
        rows = _rows(project / name / "results.csv")
    return _summary(rows)


def run(teacher, seeds=(0, 1, 2), dis: float = 6.0, max_norm: float = 10.0, project="runs/distill",
        overrides: dict | None = None) -> list[dict]:
    """Both arms for every seed, base first; one dict per run: arm, seed and its ``_summary``."""
    recipe = dict(overrides or {})
    data = recipe.get("data", DEFAULTS["data"])
    if isinstance(data, str) and data in ("shapes", "shapes.yaml") and not Path(data).exists():
        recipe = {**QUICKSTART, **recipe}  # as `yolofast train` does on the built-in data
    project = Path(project)
    clip = "" if float(max_norm) == 10.0 else f"_clip{max_norm:g}"
    out = []
    for seed in seeds:
        for arm, t in (("base", None), (f"dis{dis:g}", teacher)):
            s = train_student(f"{arm}{clip}_s{seed}", project, recipe, seed, max_norm, t, dis)
            out.append({"arm": "without a teacher" if t is None else f"dis={dis:g}", "seed": seed, **s})
    return out


def _spread(xs: list[float]) -> str:
    mean = statistics.fmean(xs)
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{mean:.4f} ± {sd:.4f} (min {min(xs):.4f}, max {max(xs):.4f})"


def table(results: list[dict]) -> str:
    """Markdown: per run, then per arm the mean ± sample std over seeds, then the paired gain per seed."""
    lines = ["| arm | seed | mAP50-95 | mAP50 | best epoch | clipped steps | grad norm (last) | dis_loss |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        dis = "–" if r["dis_loss"] != r["dis_loss"] else f"{r['dis_loss']:.3f}"  # NaN: no teacher
        lines.append(f"| {r['arm']} | {r['seed']} | {r['map']:.4f} | {r['map50']:.4f} | {r['best_epoch']} | "
                     f"{r['clip_frac']:.0%} | {r['grad_norm']:.0f} | {dis} |")
    arms = list(dict.fromkeys(r["arm"] for r in results))
    lines += ["", "| arm | mAP50-95: mean ± std over seeds | mAP50 |", "| --- | --- | --- |"]
    for a in arms:
        rs = [r for r in results if r["arm"] == a]
        lines.append(f"| {a} | {_spread([r['map'] for r in rs])} | {_spread([r['map50'] for r in rs])} |")
    if len(arms) == 2:
        base = {r["seed"]: r for r in results if r["arm"] == arms[0]}
        gains = [(r["map"] - base[r["seed"]]["map"], r["map50"] - base[r["seed"]]["map50"])
                 for r in results if r["arm"] == arms[1] and r["seed"] in base]
        lines.append(f"| gain (paired by seed) | {_spread([g[0] for g in gains])} | "
                     f"{_spread([g[1] for g in gains])} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("teacher", help="the teacher's .pt (yolofast or Ultralytics YOLOv8 detect)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--dis", type=float, default=6.0)
    p.add_argument("--max-norm", type=float, default=10.0, help="gradient clip of both arms (default 10)")
    p.add_argument("--project", default="runs/distill")
    a, keys = p.parse_known_args(argv)
    from yolofast.cli import parse_args

    results = run(a.teacher, a.seeds, a.dis, a.max_norm, a.project, parse_args(keys))
    print(table(results), flush=True)


if __name__ == "__main__":
    main()
