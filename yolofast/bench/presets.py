"""Named benchmark shapes: the CPU kernel goals (DESIGN §7) and the GPU shapes.

A preset fixes everything that decides the work of one call (batch, image size, classes, GT per image,
model), so two runs of the same preset on two commits time the same thing. ``yolofast bench``,
``benchmarks/gate.py`` and the pytest-benchmark suites (``benchmarks/bench_*.py``) all read them here:

    from yolofast.bench.presets import get_preset
    p = get_preset("loss-b8-640-50gt")          # p.batch, p.imgsz, p.nc, p.n_gt, p.ops, ...
"""

from __future__ import annotations

import dataclasses

__all__ = ["PRESETS", "KINDS", "Preset", "get_preset", "list_presets", "presets_for"]

# What a kind of preset times (ops of yolofast.ops, or composites the runner knows):
#   loss:   tal_assign, bbox_loss (forward + backward), loss_step (DetectionLoss: assign + losses, fwd + bwd)
#   assign: tal_assign only (the dense scenes, where the reference's B*M*A tensors dominate time and memory)
#   ema:    ema_update over a real model's state (plus the torch._foreach_lerp_ and flat-copy baselines)
#   step:   a whole train step of a real model (forward, DetectionLoss, backward, optimizer, EMA)
#   musgd:  one MuSGD optimizer step over a real model's parameters and fixed random gradients (plus
#           Ultralytics' MuSGD where it is importable, and the step's matmuls alone as plain torch.bmm)
#   loss26: loss26_step (YOLO26's E2EDetectionLoss: both heads' assignments + losses, fwd + bwd, reg_max 1)
KINDS = {
    "loss": ("tal_assign", "bbox_loss", "loss_step"),
    "loss26": ("loss26_step",),
    "assign": ("tal_assign",),
    "ema": ("ema_update",),
    "step": ("train_step",),
    "musgd": ("musgd_step",),
}


@dataclasses.dataclass(frozen=True)
class Preset:
    """One benchmark shape. ``n_gt`` real GTs per image, padded to ``16*ceil(n_gt/16)`` like the collate."""

    name: str
    kind: str  # a key of KINDS
    batch: int = 1
    imgsz: int = 640
    nc: int = 80
    n_gt: int = 0
    model: str = ""  # ema/step: the model whose state/step is timed
    device: str = "cpu"  # "cpu" or "cuda": the device the preset is meant for
    gate: bool = False  # small enough (1 thread) for the CI ratio gate
    note: str = ""

    @property
    def ops(self) -> tuple[str, ...]:
        return KINDS[self.kind]

    @property
    def n_anchors(self) -> int:
        """A for a 3-level (stride 8/16/32) head: 8400 at 640 px, 21504 at 1024 px."""
        return sum((self.imgsz // s) ** 2 for s in (8, 16, 32))

    @property
    def m_padded(self) -> int:
        return 16 * max(-(-self.n_gt // 16), 1)

    def describe(self) -> str:
        if self.kind in ("loss", "assign", "loss26"):
            shape = f"B={self.batch}, {self.imgsz} px (A={self.n_anchors}), C={self.nc}, {self.n_gt} GT/img"
        elif self.kind in ("ema", "musgd"):
            shape = f"{self.model} state"
        else:
            shape = f"{self.model}, B={self.batch}, {self.imgsz} px, C={self.nc}, {self.n_gt} GT/img"
        return f"{shape}; {self.device}" + (f"; {self.note}" if self.note else "")


_ALL = [
    # --- CPU: the kernel goals and DESIGN §7 -------------------------------------------------------------
    Preset("loss-b8-640-50gt", "loss", 8, 640, 80, 50, gate=True,
           note="goal: loss step >= 5x the reference"),
    Preset("assign-dense-b2-640-1000gt", "assign", 2, 640, 80, 1000,
           note="goal: >= 20x faster, >= 20x less peak memory"),
    Preset("assign-dense-b1-1024-3000gt", "assign", 1, 1024, 80, 3000,
           note="goal: >= 20x faster, >= 20x less peak memory"),
    Preset("assign-dense-b1-1024-5000gt", "assign", 1, 1024, 80, 5000,
           note="DESIGN §7 shape; the reference needs ~10 GB here"),
    Preset("ema-yolov8s", "ema", model="yolov8s", gate=True,
           note="goal: <= 1.0x torch._foreach_lerp_, <= 1.2x one flat copy"),
    Preset("step-yolov8n-320-b16", "step", 16, 320, 80, 8, model="yolov8n",
           note="DESIGN §7: images/s, backend ref vs auto"),
    Preset("step-yolo11n-320-b16", "step", 16, 320, 80, 8, model="yolo11n",
           note="images/s, backend ref vs auto (the v8 criterion)"),
    Preset("step-yolo26n-320-b16", "step", 16, 320, 80, 8, model="yolo26n",
           note="images/s, backend ref vs auto (the end-to-end criterion, both heads)"),
    Preset("musgd-yolo26n", "musgd", model="yolo26n", gate=True,
           note="goals: >= 2x Ultralytics' MuSGD (native bf16 CPU), <= 1.3x its matmuls alone"),
    Preset("musgd-yolo26s", "musgd", model="yolo26s",
           note="goals: >= 2x Ultralytics' MuSGD (native bf16 CPU), <= 1.3x its matmuls alone"),
    # --- CPU: YOLO26's loss step (both heads); the shapes of its goals vs Ultralytics' E2ELoss ------------
    Preset("loss26-b8-640-50gt", "loss26", 8, 640, 80, 50, gate=True,
           note="YOLO26 loss step (one-to-many + one-to-one), gate shape"),
    Preset("loss26-b16-320-20gt", "loss26", 16, 320, 80, 20),
    Preset("loss26-b4-640-200gt", "loss26", 4, 640, 80, 200),
    Preset("loss26-b2-640-1000gt", "loss26", 2, 640, 80, 1000),
    # --- CPU: smaller shapes for the 1-thread CI gate (under 3 minutes on 2 cores in all) ----------------
    Preset("assign-dense-b1-640-500gt", "assign", 1, 640, 80, 500, gate=True,
           note="a dense scene small enough for the CI gate"),
    # --- tiny shapes for tests and smoke runs ------------------------------------------------------------
    Preset("tiny-loss", "loss", 2, 128, 4, 6, note="tests/smoke only"),
    Preset("tiny-loss26", "loss26", 2, 128, 4, 6, note="tests/smoke only"),
    Preset("tiny-ema", "ema", model="tiny", note="tests/smoke only: a 3-tensor state"),
    Preset("tiny-step", "step", 2, 64, 4, 3, model="yolov8n", note="tests/smoke only"),
    Preset("tiny-step26", "step", 2, 64, 4, 3, model="yolo26n", note="tests/smoke only"),
    # --- CUDA: B=16/64, 640 px, 80 classes, 50 and 1000 GT/img (DESIGN §7) --------------------------------
    Preset("gpu-loss-b16-640-50gt", "loss", 16, 640, 80, 50, device="cuda"),
    Preset("gpu-loss-b64-640-50gt", "loss", 64, 640, 80, 50, device="cuda",
           note="goal: each fused op >= 5x the reference"),
    Preset("gpu-loss-b16-640-1000gt", "loss", 16, 640, 80, 1000, device="cuda"),
    Preset("gpu-loss-b64-640-1000gt", "loss", 64, 640, 80, 1000, device="cuda",
           note="goal: assigner >= 50x faster and >= 50x less memory"),
    Preset("gpu-loss26-b16-640-50gt", "loss26", 16, 640, 80, 50, device="cuda",
           note="YOLO26 loss step: the assigner with topk2, reg_max 1 losses"),
    Preset("gpu-ema-yolov8s", "ema", model="yolov8s", device="cuda"),
    Preset("gpu-musgd-yolo26n", "musgd", model="yolo26n", device="cuda",
           note="the fused Newton-Schulz on cuda and triton vs the reference and its matmuls alone"),
    Preset("gpu-step-yolov8n-640-b64", "step", 64, 640, 80, 8, model="yolov8n", device="cuda",
           note="DESIGN §7: images/s, backend ref vs auto"),
]
PRESETS: dict[str, Preset] = {p.name: p for p in _ALL}

# `--preset` groups: every non-tiny preset of a device, or the gate's.
_DEFAULT_EXCLUDE = ("tiny-", "assign-dense-b1-1024-5000gt")


def get_preset(name: str) -> Preset:
    """The preset called ``name``; a KeyError that lists the valid names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown benchmark preset {name!r}; choose one of: {', '.join(PRESETS)}") from None


def list_presets(device: str | None = None) -> list[Preset]:
    """All presets, or those meant for ``device`` ("cpu" or "cuda")."""
    return [p for p in _ALL if device is None or p.device == device]


def presets_for(what: str, device: str = "cpu", names=None) -> list[Preset]:
    """The presets a ``yolofast bench ops|step|all`` run uses on ``device``.

    names: explicit preset names (any kind: an explicit choice wins over ``what``), else the default set:
    every preset of the device except the tiny ones and the ~10 GB 5000-GT scene.
    """
    kinds = {"ops": ("loss", "assign", "ema", "musgd", "loss26"), "step": ("step",), "all": tuple(KINDS)}
    if what not in kinds:
        raise ValueError(f"benchmark {what!r} is not one of ops, step, all")
    if names:
        return [get_preset(n) for n in names]
    return [
        p for p in _ALL
        if p.device == device and p.kind in kinds[what] and not p.name.startswith(_DEFAULT_EXCLUDE)
    ]
