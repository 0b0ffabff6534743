"""``yolofast train|val|predict|export|doctor|info|build|bench`` (also ``python -m yolofast ...``),
Ultralytics' key=value style.

    yolofast train                                  # built-in shapes data, quick-start recipe
    yolofast train data=coco128.yaml epochs=10 imgsz=320 batch=8
    yolofast train --help                           # every key with its default
    yolofast val model=runs/train/train/weights/best.pt data=shapes imgsz=256
    yolofast doctor data=coco128.yaml imgsz=320      # trace, overfit and gradients of that recipe
    yolofast info                                   # versions, devices, threads, backend per op and why
    yolofast build                                  # build the C++/CUDA kernels now, and report

Bad keys, values or data print one line ``yolofast: error: ...`` and exit with code 2.
"""

from __future__ import annotations

import math
import os
import platform
import sys
from pathlib import Path

import yaml

from yolofast.cfg import DEFAULT_CFG_PATH, DEFAULTS, QUICKSTART, CfgError, check_keys

__all__ = ["main", "parse_args"]

USAGE = """usage: yolofast <command> [key=value ...]

commands:
  train   train a detector (no arguments: the built-in shapes data with the quick-start recipe)
  val     validate a checkpoint: yolofast val model=path/best.pt [data=...] [imgsz=...]
  predict run a model on images/videos: yolofast predict model=best.pt source=images/ [conf=0.25] [save=True]
  export  write ONNX / TorchScript / an Ultralytics checkpoint: yolofast export model=best.pt format=onnx
  doctor  check a recipe before training: trace one batch, overfit it, per-branch gradients (`--help`)
  info    versions, devices, threads and which kernel backend runs each op (and why)
  build   build (or load from cache) the C++/CUDA kernels and report (--cuda: also without a GPU)
  bench   kernel and train-step benchmarks against the references (`yolofast bench --help`)

`yolofast train --help` lists every key with its default. Ultralytics' task word is accepted:
`yolofast detect train ...` is `yolofast train ...`."""

_VAL_KEYS = ("model", "data", "imgsz", "batch", "conf", "iou", "max_det", "device", "workers", "half",
             "verbose", "split", "map_convention", "rect", "save_json", "single_cls", "quantize", "nms",
             "plots")
_SHAPES = ("shapes", "shapes.yaml")


class UsageError(ValueError):
    pass


def _parse_value(v: str):
    """'10' -> 10, '0.5' -> 0.5, 'True' -> True, 'None' -> None, '[1,2]' -> list; anything else a string."""
    if v.lower() in ("none", "null", ""):
        return None
    for cast in (int, float):  # before YAML: PyYAML reads "1e-3" as a string
        try:
            out = cast(v)
        except ValueError:
            continue
        # float() also reads "nan"/"inf": those stay strings (a run called name=nan), numeric keys still
        # convert them when their type asks for a float.
        if math.isfinite(out):
            return out
    try:
        out = yaml.safe_load(v)
    except yaml.YAMLError:
        return v
    return out if isinstance(out, (int, float, bool, list, dict)) else v


def parse_args(argv) -> dict:
    """['epochs=3', 'imgsz=128'] -> {'epochs': 3, 'imgsz': 128}; 'key value' pairs are not accepted."""
    out = {}
    for a in argv:
        if "=" not in a or a.startswith("="):
            raise UsageError(f"argument '{a}' is not key=value (e.g. epochs=10); `yolofast train --help` "
                             "lists the keys")
        k, v = a.split("=", 1)
        k = k.strip().lstrip("-").replace("-", "_")
        if k in out:
            raise UsageError(f"'{k}' is given twice")
        out[k] = _parse_value(v.strip())
    return out


def _help_train() -> str:
    """Every key with its default and the comment of default.yaml, plus the shapes quick-start values."""
    lines = ["usage: yolofast train [key=value ...]", "", "keys (default):"]
    comments = {}
    for line in DEFAULT_CFG_PATH.read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#") and ":" in line:
            k, rest = line.split(":", 1)
            comments[k.strip()] = rest.split("#", 1)[1].strip() if "#" in rest else ""
    for k, v in DEFAULTS.items():
        lines.append(f"  {k + '=' + str(v):<28} {comments.get(k, '')}")
    qs = " ".join(f"{k}={v}" for k, v in QUICKSTART.items())
    lines += ["", f"With data=shapes (the default) keys not given take the quick-start values: {qs}",
              "(sized to finish within minutes on a 2-core CPU; Trainer(...) in Python keeps the defaults "
              "above)."]
    return "\n".join(lines)


def _is_shapes(data) -> bool:
    return isinstance(data, str) and data in _SHAPES and not Path(data).exists()


def cmd_train(argv) -> int:
    if any(a in ("-h", "--help", "help") for a in argv):
        print(_help_train())
        return 0
    args = parse_args(argv)
    check_keys(args)
    if _is_shapes(args.get("data", DEFAULTS["data"])) and not args.get("resume"):
        args = {**QUICKSTART, **args}
    from yolofast.engine.trainer import Trainer

    trainer = Trainer(**args)
    metrics = trainer.train()
    from yolofast.engine.distributed import is_main_process

    if not is_main_process():  # under torchrun only rank 0 reports
        return 0
    print(f"\nmAP50 {metrics.get('metrics/mAP50(B)', float('nan')):.4f}  mAP50-95 "
          f"{metrics.get('metrics/mAP50-95(B)', float('nan')):.4f}  ->  results in {trainer.save_dir}")
    return 0


_DOCTOR_HELP = """usage: yolofast doctor [key=value ...] [--steps N] [--fraction F]

Checks that a recipe can learn before a long run is spent on it (20 s on one CPU core with the
quick-start recipe), on the same keys as `yolofast train` (`yolofast train --help` lists them):
  trace      one batch through every stage: images (shape, dtype, range, NaN), targets (per image, classes
             and boxes out of range, duplicates), each head map, the assigner (positives per image and per
             level, GTs left without one and why), each loss branch and its share, against the standard loss
  gradients  each loss branch's gradient norm (box, cls, dfl, and anything else the loss adds, such as
             distillation) over the whole model, the head and each layer; a branch 10x the others or a
             non-finite gradient is flagged where it starts
  overfit    --steps (default {steps}) steps on that one batch (no augmentation, no warmup); PASS when the
             loss falls below --fraction (default {fraction}) of its start, else FAIL with the likely cause
Each finding has a name (e.g. labels-out-of-range, loss-branch-scaled, lr-zero, head-frozen) and a one-line
fix. The report is printed and saved as doctor.txt, doctor.json and overfit.png in project/name
(default runs/doctor/train, train2, ...). Exit code 0 when nothing FAILs, 1 otherwise.
From Python: Trainer(**recipe).doctor() returns the report (.ok, .names, .findings)."""


def cmd_doctor(argv) -> int:
    from yolofast.doctor import DEFAULT_FRACTION, DEFAULT_STEPS

    if any(a in ("-h", "--help", "help") for a in argv):
        print(_DOCTOR_HELP.format(steps=DEFAULT_STEPS, fraction=DEFAULT_FRACTION))
        return 0
    opts, keys = {}, []
    it = iter(argv)
    for a in it:  # --steps N / --steps=N: the doctor's own options, beside the recipe's key=value
        name = a.split("=", 1)[0]
        if name in ("--steps", "--fraction"):
            value = a.split("=", 1)[1] if "=" in a else next(it, None)
            try:
                opts[name[2:]] = int(value) if name == "--steps" else float(value)
            except (TypeError, ValueError):
                example = DEFAULT_STEPS if name == "--steps" else DEFAULT_FRACTION
                raise UsageError(f"{name} needs a number (e.g. {name} {example})") from None
        else:
            keys.append(a)
    args = parse_args(keys)
    check_keys(args)
    if _is_shapes(args.get("data", DEFAULTS["data"])) and not args.get("resume"):
        args = {**QUICKSTART, **args}
    args.setdefault("project", "runs/doctor")
    from yolofast.engine.trainer import Trainer

    try:
        report = Trainer(**args).doctor(**opts)
    except ValueError as e:
        if "doctor:" in str(e):
            raise UsageError(str(e)) from None
        raise
    return 0 if report.ok else 1


def cmd_val(argv) -> int:
    if any(a in ("-h", "--help", "help") for a in argv):
        print("usage: yolofast val model=path/best.pt [data=...] [imgsz=...] [batch=16] [conf=0.001] "
              "[iou=0.7] [max_det=300] [device=...] [workers=0] [half=False] [map_convention=coco] "
              "[plots=True]\n"
              "map_convention=ultralytics reproduces Ultralytics 8.4's val numbers (coco: pycocotools').\n"
              "data and imgsz default to the ones the checkpoint was trained with.")
        return 0
    args = parse_args(argv)
    _check_known_keys("val", args, _VAL_KEYS)
    if "model" not in args:
        raise UsageError("yolofast val needs model=path/to/weights.pt")
    path = Path(str(args["model"]))
    if not path.is_file():
        raise UsageError(f"model='{path}' not found")
    from yolofast.engine.checkpoint import load_checkpoint
    from yolofast.val import validate

    ckpt = load_checkpoint(path)
    train_args = ckpt.get("train_args") or {}
    data = args.pop("data", None) or train_args.get("data")
    if data is None:
        raise UsageError(f"'{path}' does not record its data; pass data=...")
    args.setdefault("imgsz", train_args.get("imgsz", 640))
    args.pop("split", None)
    args.pop("model")
    from yolofast.engine.trainer import select_device

    args["device"] = select_device(args.get("device"))
    args.setdefault("plots", DEFAULTS["plots"])  # pictures into runs/detect/val*, as Ultralytics' val
    metrics = validate(ckpt, data, **args)
    print(" ".join(f"{k}={v:.4f}" for k, v in metrics.items() if isinstance(v, float)))
    return 0


_PREDICT_KEYS = ("model", "source", "imgsz", "conf", "iou", "max_det", "classes", "agnostic_nms", "half",
                 "device", "batch", "save", "save_txt", "save_conf", "project", "name", "exist_ok", "verbose",
                 "line_width", "show_labels", "show_conf", "nms")
_EXPORT_KEYS = ("model", "format", "imgsz", "dynamic", "opset", "half", "simplify", "batch", "device", "nms",
                "max_det")
_TASKS = ("detect", "segment", "pose", "obb", "classify")


def _check_known_keys(cmd: str, args: dict, allowed) -> None:
    """A key ``cmd`` does not take is an error naming the closest ones it does."""
    import difflib

    bad = [k for k in args if k not in allowed]
    if bad:
        near = difflib.get_close_matches(bad[0], allowed, n=2, cutoff=0.5)
        hint = f"; did you mean {' or '.join(repr(n) for n in near)}?" if near else ""
        raise UsageError(f"'{bad[0]}' is not a {cmd} key{hint} (keys: {', '.join(allowed)})")


def _check_cmd_keys(cmd: str, args: dict, allowed) -> None:
    _check_known_keys(cmd, args, allowed)
    if "model" not in args:
        raise UsageError(f"yolofast {cmd} needs model=path/to/weights.pt (or yolov8n for random weights)")


def cmd_predict(argv) -> int:
    if any(a in ("-h", "--help", "help") for a in argv):
        print("usage: yolofast predict model=best.pt source=PATH [key=value ...]\n"
              "source: image/video file, folder, glob ('imgs/*.jpg') or .txt list of paths\n"
              f"keys: {', '.join(_PREDICT_KEYS)}\n"
              "conf defaults to 0.25, save to True (annotated images under runs/detect/predict*)")
        return 0
    args = parse_args(argv)
    _check_cmd_keys("predict", args, _PREDICT_KEYS)
    if args.get("source") is None:
        raise UsageError("yolofast predict needs source=... (an image or video file, a folder, a glob or a "
                         ".txt list)")
    from yolofast import YOLO

    model = YOLO(str(args.pop("model")))
    args.setdefault("save", True)  # the CLI saves by default, as Ultralytics' does
    n = 0
    for r in model.predict(stream=True, **args):
        n += 1
        if args.get("verbose", True):
            h, w = r.orig_shape
            print(f"{r.path}: {h}x{w} {r.verbose()}{r.speed.get('inference', 0):.1f}ms")
    print(f"{n} image(s) processed")
    return 0


def cmd_export(argv) -> int:
    if any(a in ("-h", "--help", "help") for a in argv):
        print("usage: yolofast export model=best.pt format=onnx [imgsz=640] [dynamic=False] [opset=17] "
              "[half=False] [simplify=False]\nformats: onnx, torchscript, ultralytics")
        return 0
    args = parse_args(argv)
    _check_cmd_keys("export", args, _EXPORT_KEYS)
    from yolofast import YOLO

    model = YOLO(str(args.pop("model")))
    print(f"exported: {model.export(**{'format': DEFAULTS['format'], **args})}")
    return 0


def cmd_info(argv) -> int:
    import torch

    from yolofast import __version__
    from yolofast.ops import _backend

    try:
        import triton

        triton_v = triton.__version__
    except ImportError:
        triton_v = "not installed"
    print(f"yolofast {__version__}  python {platform.python_version()}  torch {torch.__version__}  "
          f"triton {triton_v}")
    print(f"platform {platform.platform()}  cpu threads {torch.get_num_threads()} (os.cpu_count "
          f"{os.cpu_count()})")
    devices = ["cpu"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.1f} GiB, capability {p.major}.{p.minor} "
                  f"(CUDA {torch.version.cuda})")
        devices.append("cuda")
    else:
        built = f"with CUDA {torch.version.cuda}" if torch.version.cuda else "for CPU only"
        print(f"cuda: not available (torch built {built})")
    env = {k: v for k, v in os.environ.items() if k.startswith("YOLOFAST_BACKEND")}
    if env:
        print("forced: " + ", ".join(f"{k}={v}" for k, v in sorted(env.items())))
    from yolofast.ops import _build

    for kind in ("cpp", "cuda"):
        ok, why = _build.extension_status(kind)
        print(f"{kind} extension: {'loaded' if ok else 'not loaded'} ({why})")
        if kind == "cpp" and ok:
            print(f"cpp build: -march={_build.cpu_arch()} (set {_build.CPU_ARCH_ENV}, e.g. x86-64-v3 for "
                  f"AVX2 CPUs), {_backend.simd_lanes()} floats per SIMD vector")
    for dev in devices:
        print(f"\nbackends on {dev}:")
        for op, chosen, why in _backend.describe(dev):
            print(f"  {op:<12} {chosen:<7} {why}")
    print(f"\ndata loader HSV augmentation: {_hsv_line()}")
    return 0


def _hsv_line() -> str:
    """Which HSV implementation the training loader runs (the compiled one-pass kernel or OpenCV), and why."""
    from yolofast.data import augment
    from yolofast.ops import _backend

    try:
        which = augment.hsv_backend()
    except _backend.BackendUnavailable as e:
        return f"error ({e})"
    if which == "cpp":
        return "cpp (one-pass C++ kernel, the same bytes as OpenCV)"
    why = _backend.availability("hsv_augment", "cpp", "cpu")[1]
    forced = _backend.requested_backend("hsv_augment")[0] == "ref"
    return "ref (OpenCV: " + ("asked for" if forced else f"no kernel: {why}") + ")"


def cmd_build(argv) -> int:
    try:
        from yolofast.ops._build import build
    except ImportError:
        print("yolofast build: kernel building is not available in this version")
        return 1
    unknown = [a for a in argv if a not in ("--cuda", "--no-cuda", "cuda=True", "cuda=False")]
    if unknown:
        raise UsageError(f"yolofast build: unknown argument '{unknown[0]}' (options: --cuda, --no-cuda)")
    cuda = None  # None: CUDA kernels only when a GPU is visible
    if {"--cuda", "cuda=True"} & set(argv):
        cuda = True
    elif {"--no-cuda", "cuda=False"} & set(argv):
        cuda = False
    report = build(verbose=True, cuda=cuda)
    print(report)
    return 0 if getattr(report, "ok", True) else 1


def cmd_bench(argv) -> int:
    try:  # the benchmark runner lives in yolofast/bench (its own argparse options: --help lists them)
        from yolofast.bench.cli import bench_main
    except ImportError:
        print("yolofast bench: not available in this version (benchmarks/ has the pytest-benchmark suites)")
        return 1
    return bench_main(argv)


COMMANDS = {"train": cmd_train, "val": cmd_val, "predict": cmd_predict, "export": cmd_export,
            "info": cmd_info, "build": cmd_build, "bench": cmd_bench, "doctor": cmd_doctor}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if argv[0] in ("-V", "--version", "version"):
        from yolofast import __version__

        print(__version__)
        return 0
    if argv[0] in _TASKS:  # Ultralytics' `yolo detect train ...`: the task word comes first
        if argv[0] != "detect":
            print(f"yolofast: error: task '{argv[0]}' is not supported: yolofast trains and runs detection "
                  f"models only (YOLOv8 detect); use `yolofast detect {' '.join(argv[1:2]) or 'train'} ...` "
                  "for detection, or Ultralytics for segment/pose/obb/classify", file=sys.stderr)
            return 2
        argv = argv[1:] or ["--help"]
        if argv[0] in ("-h", "--help", "help"):
            print(USAGE)
            return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"yolofast: error: unknown command '{cmd}'\n\n{USAGE}", file=sys.stderr)
        return 2
    import torch

    from yolofast.data import DataError
    from yolofast.engine.distributed import PeerFailedError, is_main_process
    from yolofast.engine.recovery import NonFiniteLossError
    from yolofast.ops._build import CpuArchError

    try:
        return COMMANDS[cmd](rest)
    except (CfgError, UsageError, DataError, FileNotFoundError, ImportError, CpuArchError) as e:
        print(f"yolofast: error: {e}", file=sys.stderr)
        return 2
    except NonFiniteLossError as e:  # the run gave up after restoring; its message names the checkpoint
        if is_main_process():  # under torchrun every rank gives up together (the check is all-reduced)
            print(f"yolofast: error: {e}", file=sys.stderr)
        return 1
    except (torch.OutOfMemoryError, PeerFailedError) as e:  # their messages say what to do (or look at)
        print(f"yolofast: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nyolofast: interrupted", file=sys.stderr)
        return 130
