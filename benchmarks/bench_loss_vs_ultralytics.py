"""The loss step (decode, assign, losses, forward + backward): yolofast next to Ultralytics' v8DetectionLoss.

    python benchmarks/bench_loss_vs_ultralytics.py                      # yolofast default vs its reference
    python benchmarks/bench_loss_vs_ultralytics.py --ultralytics        # ... and vs Ultralytics' loss
    python benchmarks/bench_loss_vs_ultralytics.py --ultralytics --threads 2 --rounds 9

Ultralytics is never a dependency of yolofast: ``--ultralytics`` imports it (with YOLO_OFFLINE=1, so its
import resolves no DNS name), and only then; install it in a separate environment that reuses this torch
(benchmarks/README.md, "Tools"). Shapes: b16/320 px/20 GT, b8/640 px/50 GT and b4/640 px/200 GT per image,
80 classes,
reg_max 16, GT sides log-uniform in 8..320 px (as benchmarks/bench_loss_step.py).

What each variant times, from the same leaves (the Detect head's three (B, 144, H, W) maps, requires_grad)
to their gradients:
- ``yolofast``: ``DetectionLoss`` with the default backend (the C++ kernels here), backward to the maps;
- ``reference``: the same with every op forced to the pure-PyTorch reference (``backend("ref")``);
- ``ultralytics``: the maps cat into its head's ``boxes`` (B, 64, A) / ``scores`` (B, 80, A) (what its
  Detect.forward does in training), ``v8DetectionLoss``, backward to the maps;
- ``ultralytics_head``: ``v8DetectionLoss`` alone, from ``boxes``/``scores`` leaves (its cat left out: the
  stricter comparison, as that cat is part of its model's forward).
Rounds are interleaved (each round calls every variant once, in turn) and the ratio is the median of the
per-round time ratios: ratios in one run, never absolute times. The losses of the first call are printed
side by side: they must agree (the same assignment and loss formulas) for the timing to mean anything.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import types

SHAPES = {"b16-320-20gt": (16, 320, 20), "b8-640-50gt": (8, 640, 50), "b4-640-200gt": (4, 640, 200)}
NC, REG_MAX, STRIDES = 80, 16, (8, 16, 32)


def make_inputs(batch: int, imgsz: int, n_gt: int, seed: int = 0):
    """(maps [(B, 144, H, W)], padded GT for yolofast, flat GT for Ultralytics), one generator."""
    import torch

    g = torch.Generator().manual_seed(seed)
    maps = [torch.randn(batch, 4 * REG_MAX + NC, imgsz // s, imgsz // s, generator=g) for s in STRIDES]
    lo, hi = math.log(8 / imgsz), math.log(min(320, imgsz) / imgsz)
    wh = torch.exp(torch.rand(batch, n_gt, 2, generator=g) * (hi - lo) + lo)
    xy = wh / 2 + torch.rand(batch, n_gt, 2, generator=g) * (1 - wh)
    cls = torch.randint(0, NC, (batch, n_gt, 1), generator=g).float()
    padded = {"gt_cls": cls, "gt_bboxes": torch.cat((xy, wh), -1), "gt_mask": torch.ones(batch, n_gt, 1)}
    flat = {
        "batch_idx": torch.arange(batch).repeat_interleave(n_gt).float(),
        "cls": cls.reshape(-1, 1),
        "bboxes": padded["gt_bboxes"].reshape(-1, 4),
    }
    return maps, padded, flat


def yolofast_step(maps, padded, backend_name: str | None):
    from yolofast.loss import DetectionLoss
    from yolofast.ops import backend

    leaves = [m.clone().requires_grad_(True) for m in maps]
    crit = DetectionLoss(NC, REG_MAX, STRIDES)

    def step():
        for f in leaves:
            f.grad = None
        if backend_name is None:
            total, items = crit(leaves, padded)
        else:
            with backend(backend_name):
                total, items = crit(leaves, padded)
        total.backward()
        return items

    return step


def ultralytics_criterion():
    """v8DetectionLoss on a minimal model object: the hyper-parameters of its default.yaml (box 7.5, cls 0.5,
    dfl 1.5) and a Detect-like last module (nc 80, reg_max 16, strides 8/16/32) -- all it reads."""
    os.environ.setdefault("YOLO_OFFLINE", "1")
    import torch
    from ultralytics.utils.loss import v8DetectionLoss

    head = torch.nn.Module()
    head.nc, head.reg_max, head.stride = NC, REG_MAX, torch.tensor(STRIDES, dtype=torch.float32)
    model = torch.nn.Module()
    model.model = torch.nn.ModuleList([head])
    model.anchor = torch.nn.Parameter(torch.zeros(1))  # v8DetectionLoss takes its device from a parameter
    model.args = types.SimpleNamespace(box=7.5, cls=0.5, dfl=1.5)
    return v8DetectionLoss(model, tal_topk=10)


def ultralytics_step(maps, flat, with_cat: bool):
    import torch

    crit = ultralytics_criterion()
    b = maps[0].shape[0]
    r4 = 4 * REG_MAX
    if with_cat:
        leaves = [m.clone().requires_grad_(True) for m in maps]
    else:  # its head's outputs as the leaves
        boxes = torch.cat([m[:, :r4].reshape(b, r4, -1) for m in maps], -1).requires_grad_(True)
        scores = torch.cat([m[:, r4:].reshape(b, NC, -1) for m in maps], -1).requires_grad_(True)
        shapes = [m[:, :0] for m in maps]  # make_anchors reads only the maps' shapes, dtype and device
        leaves = [boxes, scores]

    def step():
        for t in leaves:
            t.grad = None
        if with_cat:
            bx = torch.cat([m[:, :r4].reshape(b, r4, -1) for m in leaves], -1)
            sc = torch.cat([m[:, r4:].reshape(b, NC, -1) for m in leaves], -1)
            preds = {"boxes": bx, "scores": sc, "feats": leaves}
        else:
            preds = {"boxes": boxes, "scores": scores, "feats": shapes}
        total, items = crit(preds, flat)
        total.sum().backward()
        return torch.stack(list(items.values())) if isinstance(items, dict) else items

    return step


def run(shape: str, variants: list[str], rounds: int) -> dict[str, float]:
    import torch

    batch, imgsz, n_gt = SHAPES[shape]
    maps, padded, flat = make_inputs(batch, imgsz, n_gt)
    steps = {}
    for v in variants:
        if v == "yolofast":
            steps[v] = yolofast_step(maps, padded, None)
        elif v == "reference":
            steps[v] = yolofast_step(maps, padded, "ref")
        else:
            steps[v] = ultralytics_step(maps, flat, with_cat=v == "ultralytics")
    items = {v: [round(float(x), 5) for x in fn()] for v, fn in steps.items()}  # warm-up + the check
    shown = "; ".join(f"{v} {it}" for v, it in items.items())
    print(f"{shape}: loss items [box, cls, dfl] {shown}", flush=True)
    times = {v: [] for v in variants}
    for _ in range(rounds):
        for v, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            times[v].append(time.perf_counter() - t0)
    med = {v: statistics.median(t) for v, t in times.items()}
    out = {}
    for v in variants:
        if v == "yolofast":
            continue
        ratios = [a / b for a, b in zip(times[v], times["yolofast"])]
        out[v] = statistics.median(ratios)
    cols = "  ".join(f"{v} {med[v] * 1e3:.1f} ms" for v in variants)
    vs = "  ".join(f"yolofast {out[v]:.2f}x faster than {v}" for v in out)
    print(f"{shape}: {torch.get_num_threads()} thread(s), {rounds} rounds, median  {cols}\n    {vs}",
          flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ultralytics", action="store_true",
                    help="also time Ultralytics' v8DetectionLoss (imports ultralytics, installed separately)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)  # importing ultralytics may set OMP_NUM_THREADS; keep ours for all
    shapes = [s for s in args.shapes.split(",") if s]
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        ap.error(f"--shapes: unknown {bad}; choose from {', '.join(SHAPES)}")
    variants = ["yolofast", "reference"]
    if args.ultralytics:
        try:
            import ultralytics  # noqa: F401
        except ImportError:
            print("--ultralytics: ultralytics is not importable here; install it in a separate venv that "
                  "reuses this torch (benchmarks/README.md, Tools)", file=sys.stderr)
            return 2
        variants += ["ultralytics", "ultralytics_head"]
        torch.set_num_threads(args.threads)
    from yolofast.ops._backend import describe

    print("yolofast backends: " + ", ".join(f"{op}={b}" for op, b, _ in describe("cpu")), flush=True)
    for s in shapes:
        run(s, variants, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
