"""EMA of a yolov8s-sized state: the fused kernel vs torch._foreach_lerp_ vs one flat copy_ (2 threads).

    python -m pytest benchmarks/bench_ema_update.py --benchmark-columns=min,median,max,rounds

The state: every floating tensor of yolofast.nn.build_model("yolov8s") (parameters and BN statistics,
11.19 M floats). Variants over the same bytes:
  foreach_lerp  torch._foreach_lerp_(ema tensors, model tensors, w)   -- the baseline to beat (DESIGN §2.3)
  copy          ema_flat.copy_(model_flat): one pass over the bytes    -- the floor of any one-pass update
  ref           reference.ema_update_ref on the flat buffers (ema.lerp_)
  cpp           the fused kernel on the flat buffers
Goals (DESIGN §7): cpp <= 1.0x foreach_lerp and <= 1.2x copy.
"""

from __future__ import annotations

import pytest
import torch

GROUP = "ema_update yolov8s (11.2 M floats)"
GOALS = [
    (GROUP, "cpp", "foreach_lerp", 1.0, "EMA no slower than torch._foreach_lerp_"),
    (GROUP, "cpp", "copy", 1.2, "EMA within 1.2x of one flat copy"),
]
DECAY = 0.9999


def state_shapes() -> list[torch.Size]:
    try:
        from yolofast.nn import build_model

        model = build_model("yolov8s")
        return [t.shape for t in model.state_dict().values() if t.is_floating_point()]
    except ImportError:  # the model package is not there: the same total size in layer-like chunks
        return [torch.Size([256, 256, 3, 3])] * 18 + [torch.Size([4000])] * 5 + [torch.Size([3232])]


@pytest.fixture(scope="module")
def state():
    shapes = state_shapes()
    g = torch.Generator().manual_seed(0)
    model = [torch.randn(s, generator=g) for s in shapes]
    ema = [t + 0.01 for t in model]
    model_flat = torch.cat([t.reshape(-1) for t in model])
    ema_flat = torch.cat([t.reshape(-1) for t in ema])
    return ema, model, ema_flat, model_flat


def _cpp():
    from yolofast.ops import _build

    ok, why = _build.extension_status("cpp")
    if not ok:
        pytest.skip(f"C++ extension unavailable: {why}")
    from yolofast.ops import _backend

    return _backend.implementation("ema_update", "cpp")


@pytest.mark.parametrize("variant", ["foreach_lerp", "copy", "ref", "cpp"])
def test_ema_update(measure, state, variant):
    ema, model, ema_flat, model_flat = state
    d = torch.tensor(DECAY)
    if variant == "foreach_lerp":
        def fn():
            torch._foreach_lerp_(ema, model, 1 - DECAY)
    elif variant == "copy":
        def fn():
            ema_flat.copy_(model_flat)
    elif variant == "ref":
        from yolofast.ops.reference import ema_update_ref

        def fn():
            ema_update_ref(ema_flat, model_flat, d)
    else:
        op = _cpp()

        def fn():
            op(ema_flat, model_flat, d)

    measure(fn, group=GROUP, variant=variant, rounds=40, warmup_rounds=3)
