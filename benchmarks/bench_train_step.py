"""The whole train step (forward, fp32 loss, backward, SGD step) of yolov8n (or ``--model yolo11n`` /
``yolo26n``, each with its family's criterion): images/s per variant, one run.

    python -m pytest benchmarks/bench_train_step.py --benchmark-columns=min,median,max,rounds
    python benchmarks/bench_train_step.py [VARIANT ...] [--rounds N] [--warmup N]   # images/s, no pytest
    python benchmarks/bench_train_step.py fp32 bf16_cl ultralytics --rounds 30      # yolofast vs Ultralytics
    python benchmarks/bench_train_step.py fp32 fp32_ref ultralytics --model yolo26n  # + the reference ops

CPU: 320 px batch 16, 2 threads. Variants: fp32 (NCHW, the baseline), bf16 autocast, channels_last (fp32 and
bf16), torch.compile (inductor; its first call compiles for minutes on 2 cores, outside the timing — set
YOLOFAST_BENCH_COMPILE=0 to skip it). Any variant with ``_dis`` appended (``bf16_cl_dis``, ...) is the same
step with knowledge distillation from a yolov8s teacher (``distill_model=``: the teacher's forward, the
projectors and the distillation loss; yolofast/engine/distill.py), to price a teacher; ``_ref`` appended
(``fp32_ref``) runs every fused op on its pure-PyTorch reference (``yolofast.ops.backend("ref")``).
GPU (``--device cuda``): 640 px batch 64, bf16 channels_last, eager vs CUDA graph (graph_bf16_cl) vs
compiled. Ultralytics' same step is measured beside them only when ``ultralytics`` is importable
(never a dependency: install it in a separate venv; only imported and called, no code of it is copied);
DESIGN §7 goal: >= 1.5x its images/s on CPU. Ultralytics trains fp32 NCHW on CPU (its ``check_amp`` returns
False for a CPU model and its bf16 autocast raises off CUDA), so "ultralytics" is that step.

The script times the variants round-robin: each round runs one step of every variant (the starting variant
rotates), so load from other processes on a shared 2-core machine hits all of them alike, and reports the
median. YOLOFAST_BENCH_DEBUG=1 prints the Ultralytics batch and its loss beside yolofast's at setup.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import os
import statistics
import time

import pytest
import torch

from yolofast.engine.compile import train_step_modules
from yolofast.engine.cudagraph import optimizer_kwargs
from yolofast.engine.distill import DistillLoss, DistillStep
from yolofast.loss import DetectionLoss, criterion_for, fp32_preds
from yolofast.nn import build_model
from yolofast.ops import backend

CPU = dict(imgsz=320, batch=16, nc=80)
GPU = dict(imgsz=640, batch=64, nc=80)
THREADS = 2  # DESIGN §6: the CI machines have 2 cores
GROUP_CPU = "train step yolov8n 320px b16 CPU"
GROUP_GPU = "train step yolov8n 640px b64 CUDA"
GOALS = [
    (GROUP_CPU, "compiled", "fp32", 1.0, "compiled step faster than eager fp32"),
    # time ratio <= 1/1.5 is >= 1.5x images/s (DESIGN §7); checked only when ultralytics ran too
    (GROUP_CPU, "fp32", "ultralytics", 1 / 1.5, "DESIGN §7 fp32 >= 1.5x Ultralytics images/s"),
    (GROUP_CPU, "bf16_cl", "ultralytics", 1 / 1.5, "DESIGN §7 bf16_cl >= 1.5x Ultralytics images/s"),
]
_YOLOFAST_VARIANTS = ("fp32", "bf16", "fp32_cl", "bf16_cl", "compiled", "compiled_bf16_cl", "graph_bf16_cl")
TEACHER = "yolov8s"  # the "_dis" variants' teacher (random weights: the time does not depend on them)
_CPU_VARIANTS = ["fp32", "bf16", "fp32_cl", "bf16_cl", "compiled"]
_DEBUG = os.environ.get("YOLOFAST_BENCH_DEBUG", "0") == "1"


def make_batch(imgsz, batch, nc, device, n_gt=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    img = torch.rand(batch, 3, imgsz, imgsz, generator=g)
    m = 16 * max(1, -(-n_gt // 16))  # padded GT bucket (data.collate.pad_targets)
    xy = torch.rand(batch, m, 2, generator=g) * 0.6 + 0.2
    wh = torch.rand(batch, m, 2, generator=g) * 0.2 + 0.05
    out = {"gt_cls": torch.randint(0, nc, (batch, m, 1), generator=g).float(),
           "gt_bboxes": torch.cat([xy, wh], -1),
           "gt_mask": (torch.arange(m)[None, :, None] < n_gt).float().expand(batch, m, 1).contiguous()}
    return img.to(device), {k: v.to(device) for k, v in out.items()}


def flat_targets(gt: dict) -> dict:
    """The padded targets of ``make_batch`` as Ultralytics' collated batch: ``batch_idx`` (N,) float32,
    ``cls`` (N,1) float32, ``bboxes`` (N,4) normalized xywh, only the real (mask 1) boxes."""
    mask = gt["gt_mask"][..., 0].bool()
    bidx = torch.arange(mask.shape[0], device=mask.device)[:, None].expand_as(mask)
    return {"batch_idx": bidx[mask].float(), "cls": gt["gt_cls"][mask], "bboxes": gt["gt_bboxes"][mask]}


def _init_model(nc: int, device: torch.device, model: str = "yolov8n"):
    torch.manual_seed(0)
    return build_model(model, nc=nc).to(device).train()


def _backward_step(loss, opt, device: torch.device, scaler=None):
    """The rest of a timed step, the same for yolofast and Ultralytics: backward, SGD step, zero_grad
    (through ``scaler`` for an fp16 step)."""
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return loss.detach()


def make_step(variant: str, imgsz: int, batch: int, nc: int, device: torch.device, n_gt: int = 8,
              model: str = "yolov8n"):
    """A zero-argument train step returning the detached loss; ``variant``: one of ``_YOLOFAST_VARIANTS``,
    optionally with ``_ref`` then ``_dis`` appended."""
    dis = variant.endswith("_dis")
    base = variant.removesuffix("_dis")
    ref = base.endswith("_ref")
    base = base.removesuffix("_ref")
    if base not in _YOLOFAST_VARIANTS:
        raise ValueError(f"bench_train_step: unknown variant {variant!r}; use one of "
                         f"{(*_YOLOFAST_VARIANTS, 'ultralytics')}, optionally with '_ref', '_dis' appended")
    model_name = model
    model = _init_model(nc, device, model_name)
    crit = criterion_for(model)
    if dis and model_name != "yolov8n":
        raise ValueError("bench_train_step: the '_dis' variants distill into yolov8n only")
    if dis:  # the student + projectors + frozen teacher, as the trainer runs them with distill_model=
        model, crit = DistillStep(model, build_model(TEACHER, nc=nc).to(device)), DistillLoss(crit)
    img, gt = make_batch(imgsz, batch, nc, device, n_gt=n_gt)
    cl = base.endswith("_cl")
    if cl:
        model.to(memory_format=torch.channels_last)
        img = img.contiguous(memory_format=torch.channels_last)
    dtype = torch.bfloat16 if "bf16" in base else None
    graph = base.startswith("graph")
    fwd, loss_fn = train_step_modules(model, crit, device, compile=base.startswith("compiled"))
    # A graph needs a tensor lr (a float is frozen into it) and a capturable optimizer (fused SGD).
    lr, kw = (torch.tensor(1e-4, device=device), optimizer_kwargs("sgd")) if graph else (1e-4, {})
    params = [p for p in model.parameters() if p.requires_grad]  # the teacher is frozen
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9, nesterov=True, **kw)

    def step():
        with backend("ref") if ref else contextlib.nullcontext():
            with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                feats = fwd(img)
            loss, _ = loss_fn(fp32_preds(feats), gt)
            return _backward_step(loss, opt, device)

    if graph:
        step()  # capture needs the optimizer's momentum buffers to exist (cudagraph.has_state)
        return _graph_step(model, crit, opt, {"img": img, **gt}, dtype, device)
    return step


def _graph_step(model, crit, opt, batch: dict, dtype, device):
    """The same step (plus grad clipping) captured in a CUDA graph (yolofast/engine/cudagraph.py)."""
    from yolofast.engine import cudagraph

    if device.type != cudagraph.GRAPH_DEVICE:
        raise ValueError("bench_train_step: graph_* variants need CUDA")
    graphed = cudagraph.capture_train_step(model, crit, opt, None, batch, amp_dtype=dtype)
    if graphed is None:
        raise RuntimeError("bench_train_step: CUDA-graph capture failed (reason in the log above)")

    def step():
        loss = graphed(batch)[0]
        cudagraph.GRAPHS.synchronize()
        return loss

    step.graphed = graphed
    return step


def ultralytics_available() -> bool:
    return importlib.util.find_spec("ultralytics") is not None


def _check_ultralytics_batch(ubatch: dict, batch: int, n_gt: int) -> None:
    """Its collated batch format: batch_idx (N,), cls (N,1), bboxes (N,4) normalized xywh, all float32."""
    n = batch * n_gt
    want = {"batch_idx": (n,), "cls": (n, 1), "bboxes": (n, 4)}
    got = {k: (tuple(ubatch[k].shape), ubatch[k].dtype) for k in want}
    bb = ubatch["bboxes"]
    counts = torch.bincount(ubatch["batch_idx"].long(), minlength=batch)
    if (any(got[k] != (want[k], torch.float32) for k in want) or float(bb.min()) < 0 or float(bb.max()) > 1
            or not bool((counts == n_gt).all())):
        raise RuntimeError(f"bench_train_step: Ultralytics batch malformed: {got} (want {want} float32), "
                           f"bboxes in [{float(bb.min()):.3f}, {float(bb.max()):.3f}] (want normalized), "
                           f"GT per image {counts.tolist()} (want {n_gt})")


def _debug_losses(m, ubatch: dict, img: torch.Tensor, gt: dict, nc: int) -> None:
    """Ultralytics' loss next to yolofast's on the same weights and batch: they should agree closely."""
    with torch.no_grad():
        uloss, uitems = m.loss(ubatch)
    print(f"[debug] ultralytics {type(m.criterion).__name__}, hyp box={m.args.box} cls={m.args.cls} "
          f"dfl={m.args.dfl}; batch img {tuple(ubatch['img'].shape)} {ubatch['img'].dtype}, batch_idx "
          f"{tuple(ubatch['batch_idx'].shape)}, cls {tuple(ubatch['cls'].shape)}, bboxes "
          f"{tuple(ubatch['bboxes'].shape)} in [{float(ubatch['bboxes'].min()):.3f}, "
          f"{float(ubatch['bboxes'].max()):.3f}] (normalized xywh)", flush=True)
    items = {k: round(float(v), 4) for k, v in uitems.items()}
    print(f"[debug] ultralytics loss (x B) {[round(float(v), 4) for v in uloss]} "
          f"sum {float(uloss.sum()):.4f}; items {items}", flush=True)
    if not bool(torch.isfinite(uloss).all()):
        raise RuntimeError(f"bench_train_step: Ultralytics loss is not finite: {uloss}")
    y = _init_model(nc, img.device)
    y.load_state_dict(m.state_dict())
    with torch.no_grad():
        ytotal, yitems = DetectionLoss(nc)(y(img), gt)
    print(f"[debug] yolofast    loss total {float(ytotal):.4f}; items [box, cls, dfl] "
          f"{[round(float(v), 4) for v in yitems]} (same weights, same batch)", flush=True)


def ultralytics_step(imgsz: int, batch: int, device: torch.device, nc: int = 80, n_gt: int = 8,
                     model: str = "yolov8n"):
    """Ultralytics' own model + loss for the same step, or pytest.skip when it is not installed.

    Same work as ``make_step("fp32", ...)`` on CPU (on CUDA in its default fp16 AMP, with its GradScaler):
    ``model`` (yolov8n) built from its yaml, the same initial weights (yolofast's seeded init, loaded by
    name: the two state dicts have the same keys and shapes), the same images and GT, ``model.loss``
    (forward + its criterion: v8DetectionLoss, or E2ELoss for YOLO26; box 7.5 cls 0.5 dfl 1.5), backward of
    the summed loss as its trainer does, SGD step, zero_grad. Its trainer's extras per step (grad-norm clip
    to 10, EMA update, GradScaler no-ops) are left out, as yolofast's step leaves them out.
    """
    # Its import resolves DNS names to decide ONLINE (ultralytics/utils/__init__.py is_online); offline:
    # building yolov8n from its bundled yaml downloads nothing.
    os.environ.setdefault("YOLO_OFFLINE", "1")
    pytest.importorskip("ultralytics")
    from ultralytics.cfg import get_cfg
    from ultralytics.nn.tasks import DetectionModel as UDetectionModel

    m = UDetectionModel(f"{model}.yaml", nc=nc, verbose=False).to(device).train()
    try:
        m.load_state_dict(_init_model(nc, device, model).state_dict())
    except RuntimeError as e:  # a renamed layer on either side: keep its own init, the timing barely changes
        first = str(e).splitlines()[0]
        print(f"bench_train_step: Ultralytics keeps its own init weights ({first})", flush=True)
    m.args = get_cfg(overrides={"box": 7.5, "cls": 0.5, "dfl": 1.5})  # its trainer sets model.args the same
    img, gt = make_batch(imgsz, batch, nc, device, n_gt=n_gt)
    ubatch = {**flat_targets(gt), "img": img}
    _check_ultralytics_batch(ubatch, batch, n_gt=int(gt["gt_mask"][0].sum()))
    if _DEBUG:
        _debug_losses(m, ubatch, img, gt, nc)
    opt = torch.optim.SGD(m.parameters(), lr=1e-4, momentum=0.9, nesterov=True)
    # Its trainer's default on CUDA is AMP: fp16 autocast + GradScaler (on CPU it trains fp32).
    amp = device.type == "cuda"
    scaler = torch.amp.GradScaler("cuda") if amp else None

    def step():
        with torch.autocast(device.type, dtype=torch.float16, enabled=amp):
            loss, _ = m.loss(ubatch)
        return _backward_step(loss.sum(), opt, device, scaler)

    return step


@pytest.mark.parametrize("variant", _CPU_VARIANTS)
def test_train_step_cpu(measure, variant):
    if variant.startswith("compiled") and os.environ.get("YOLOFAST_BENCH_COMPILE", "1") == "0":
        pytest.skip("YOLOFAST_BENCH_COMPILE=0")
    step = make_step(variant, device=torch.device("cpu"), **CPU)
    measure(step, group=GROUP_CPU, variant=variant, rounds=5, warmup_rounds=2)


def test_train_step_cpu_ultralytics(measure):
    step = ultralytics_step(CPU["imgsz"], CPU["batch"], torch.device("cpu"))
    measure(step, group=GROUP_CPU, variant="ultralytics", rounds=5, warmup_rounds=2)


@pytest.mark.parametrize("variant", ["bf16_cl_dis"])
def test_train_step_cpu_distill(measure, variant):
    """The default CPU step with a yolov8s teacher (distill_model=): compare with bf16_cl."""
    step = make_step(variant, device=torch.device("cpu"), **CPU)
    measure(step, group=GROUP_CPU, variant=variant, rounds=5, warmup_rounds=2)


@pytest.mark.cuda
@pytest.mark.parametrize("variant", ["bf16_cl", "graph_bf16_cl", "compiled_bf16_cl", "bf16_cl_dis",
                                     "graph_bf16_cl_dis"])
def test_train_step_cuda(measure, variant):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    step = make_step(variant, device=torch.device("cuda"), **GPU)
    measure(step, group=GROUP_GPU, variant=variant, rounds=20, warmup_rounds=3)


def _default_variants() -> list[str]:
    out = [v for v in _CPU_VARIANTS
           if not (v.startswith("compiled") and os.environ.get("YOLOFAST_BENCH_COMPILE", "1") == "0")]
    return out + (["ultralytics"] if ultralytics_available() else [])


def main(variants=None, rounds: int = 5, warmup: int = 2, device: str = "cpu", n_gt: int = 8,
         imgsz: int | None = None, batch: int | None = None, threads: int = THREADS,
         model: str = "yolov8n") -> dict:
    """images/s of each variant (median over ``rounds`` round-robin rounds after ``warmup`` ones),
    printed with the ratio to "ultralytics" when it ran (else to the first variant), and returned.
    ``device="cuda"``: the GPU shapes (640 px, batch 64)."""
    device = torch.device(device)
    shape = dict(GPU if device.type == "cuda" else CPU)
    shape.update({k: v for k, v in (("imgsz", imgsz), ("batch", batch)) if v})
    torch.set_num_threads(threads)
    steps = {}
    for v in variants or _default_variants():
        if v == "ultralytics":
            if not ultralytics_available():
                print("ultralytics: not importable, skipped (pip install ultralytics in a separate venv)")
                continue
            steps[v] = ultralytics_step(shape["imgsz"], shape["batch"], device, nc=shape["nc"], n_gt=n_gt,
                                        model=model)
        else:
            steps[v] = make_step(v, device=device, n_gt=n_gt, model=model, **shape)
    torch.set_num_threads(threads)  # importing ultralytics sets OMP_NUM_THREADS=1 when unset; keep 2 for all
    names = list(steps)
    times: dict[str, list[float]] = {v: [] for v in names}
    last = {}
    for r in range(warmup + rounds):
        for i in range(len(names)):
            v = names[(r + i) % len(names)]  # rotate who goes first: no variant always follows the same one
            t = time.perf_counter()
            last[v] = steps[v]()
            if r >= warmup:
                times[v].append(time.perf_counter() - t)
    bad = {v: float(x) for v, x in last.items() if not math.isfinite(float(x))}
    if bad:
        raise RuntimeError(f"bench_train_step: non-finite loss after {warmup + rounds} steps: {bad}")
    out = {v: shape["batch"] / statistics.median(t) for v, t in times.items()}
    base = "ultralytics" if "ultralytics" in out else (names[0] if names else None)
    print(f"train step {model} {shape['imgsz']} px b{shape['batch']} {n_gt} GT/img {device.type}, "
          f"{torch.get_num_threads()} threads, median of {rounds} round-robin rounds after {warmup} warm-up, "
          f"torch {torch.__version__}", flush=True)
    for v in names:
        lo, hi = shape["batch"] / max(times[v]), shape["batch"] / min(times[v])
        print(f"{v:>16}: {out[v]:7.2f} images/s  [{lo:6.2f} .. {hi:6.2f}]  ({out[v] / out[base]:.2f}x {base})"
              f"  {_paired(times[base], times[v])}  last loss {float(last[v]):.3f}", flush=True)
    return out


def _paired(base: list[float], other: list[float]) -> str:
    """The speed ratio to ``base`` taken within each round, then its median and quartiles: on a shared
    machine a slow spell hits both steps of a round, so these move less than a ratio of two medians."""
    if len(base) < 4 or base is other:
        return ""
    q1, med, q3 = statistics.quantiles([b / o for b, o in zip(base, other)], n=4)
    return f"paired {med:.3f}x [{q1:.3f} .. {q3:.3f}]"


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variants", nargs="*", help=f"{(*_YOLOFAST_VARIANTS, 'ultralytics')} (+ '_dis': with a "
                   f"{TEACHER} teacher); default: CPU ones")
    p.add_argument("--rounds", type=int, default=5, help="timed round-robin rounds (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    p.add_argument("--device", default="cpu", help="cpu (320 px b16) or cuda (640 px b64)")
    p.add_argument("--gt", type=int, default=8, help="GT boxes per image (default 8; dense scenes: 100+)")
    p.add_argument("--imgsz", type=int, help="image size (default: 320 CPU, 640 CUDA)")
    p.add_argument("--batch", type=int, help="batch size (default: 16 CPU, 64 CUDA)")
    p.add_argument("--threads", type=int, default=THREADS, help=f"torch threads (default {THREADS})")
    p.add_argument("--model", default="yolov8n",
                   help="yolov8n (default), yolo11n, yolo26n, ...: the model of both engines")
    a = p.parse_args()
    main(a.variants or None, rounds=a.rounds, warmup=a.warmup, device=a.device, n_gt=a.gt, imgsz=a.imgsz,
         batch=a.batch, threads=a.threads, model=a.model)
