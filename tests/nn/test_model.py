import copy
import math
from pathlib import Path

import pytest
import torch
import yaml

from yolofast.nn import YOLOV8, Conv, DetectionModel, build_model

# Published YOLOv8 detection parameter counts (nc=80), including the 16 frozen DFL bin values.
PARAMS = {"n": 3_157_200, "s": 11_166_560, "m": 25_902_640, "l": 43_691_520, "x": 68_229_648}


@pytest.fixture(scope="module")
def nano():
    return build_model("yolov8n", nc=80)


def _count(m):
    return sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("scale", list(PARAMS))
def test_param_count(scale):
    m = build_model(f"yolov8{scale}")
    assert _count(m) == PARAMS[scale]
    # Only the DFL bins are frozen: everything else trains.
    assert _count(m) - sum(p.numel() for p in m.parameters() if p.requires_grad) == 16
    assert m.yaml["scale"] == scale and m.yaml["name"] == f"YOLOv8{scale}"


def test_attributes(nano):
    assert isinstance(nano, DetectionModel)
    assert nano.nc == 80 and nano.reg_max == 16
    assert nano.stride.dtype == torch.float32 and nano.stride.tolist() == [8.0, 16.0, 32.0]
    assert nano.names == {i: f"class{i}" for i in range(80)}
    assert nano.yaml["nc"] == 80


def test_names_setter():
    m = build_model("yolov8n", nc=3)
    m.names = ["a", "b", "c"]
    assert m.names == {0: "a", 1: "b", 2: "c"}
    m.names = {0: "x", 1: "y", 2: "z"}
    assert m.names[2] == "z"
    with pytest.raises(ValueError, match="nc=3"):
        m.names = ["only", "two"]


@pytest.mark.parametrize("hw", [(320, 320), (256, 320)])
def test_output_shapes(nano, hw):
    h, w = hw
    x = torch.rand(1, 3, h, w)
    nano.train()
    feats = nano(x)
    assert [tuple(f.shape) for f in feats] == [(1, 144, h // s, w // s) for s in (8, 16, 32)]
    nano.eval()
    with torch.no_grad():
        y = nano(x)
        raw = nano.forward_feats(x)
    a = sum((h // s) * (w // s) for s in (8, 16, 32))
    assert y.shape == (1, 84, a)
    assert torch.isfinite(y).all()
    assert [tuple(f.shape) for f in raw] == [(1, 144, h // s, w // s) for s in (8, 16, 32)]
    torch.testing.assert_close(nano.decode(raw), y)
    scores = y[:, 4:]
    assert (scores >= 0).all() and (scores <= 1).all()


def test_bias_init():
    for nc in (80, 3):
        head = build_model("yolov8n", nc=nc).head
        for box, cls, s in zip(head.cv2, head.cv3, (8, 16, 32)):
            assert torch.all(box[-1].bias == 2.0)  # 8.4.190's box-bias prior (was 1.0 before)
            expected = math.log(5 / nc / (640 / s) ** 2)
            torch.testing.assert_close(cls[-1].bias, torch.full((nc,), expected))
    # e.g. nc=80, stride 8: log(5/80/6400) = -11.5366...
    assert build_model("yolov8n").head.cv3[0][-1].bias[0].item() == pytest.approx(-11.5366, abs=1e-4)


def test_bn_settings(nano):
    bns = [m for m in nano.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(bns) == 57 and all(b.eps == 1e-3 and b.momentum == 0.03 for b in bns)
    acts = [m for m in nano.modules() if isinstance(m, torch.nn.SiLU)]
    assert acts and not any(a.inplace for a in acts)  # in place gains nothing under autograd


def _hand_decode(feats, b, level, i, j, nc, strides=(8, 16, 32), reg_max=16):
    """Oracle in float64 Python: softmax-expectation per side, anchor at cell centre, scaled to pixels."""
    f = feats[level][b, :, i, j].double()
    d = []
    for k in range(4):
        logits = f[k * reg_max:(k + 1) * reg_max].tolist()
        mx = max(logits)
        e = [math.exp(v - mx) for v in logits]
        d.append(sum(n * v for n, v in enumerate(e)) / sum(e))
    ax, ay = j + 0.5, i + 0.5
    x1, y1, x2, y2 = ax - d[0], ay - d[1], ax + d[2], ay + d[3]
    s = strides[level]
    box = [(x1 + x2) / 2 * s, (y1 + y2) / 2 * s, (x2 - x1) * s, (y2 - y1) * s]
    scores = [1 / (1 + math.exp(-v)) for v in f[4 * reg_max:4 * reg_max + nc].tolist()]
    return torch.tensor(box + scores, dtype=torch.float64)


def _index(sizes, level, i, j):
    return sum(h * w for h, w in sizes[:level]) + i * sizes[level][1] + j


def test_decode_matches_hand_computation():
    nc = 5
    m = build_model("yolov8n", nc=nc).eval()
    sizes = [(256 // s, 320 // s) for s in (8, 16, 32)]  # non-square: W != H catches x/y swaps
    feats = [torch.randn(2, 64 + nc, h, w) * 3 for h, w in sizes]
    out = m.decode(feats)
    assert out.shape == (2, 4 + nc, sum(h * w for h, w in sizes))
    for b, level, i, j in [(0, 0, 3, 7), (1, 0, 31, 39), (1, 1, 5, 2), (0, 2, 7, 9), (1, 2, 0, 0)]:
        got = out[b, :, _index(sizes, level, i, j)].double()
        torch.testing.assert_close(got, _hand_decode(feats, b, level, i, j, nc), rtol=1e-5, atol=1e-4)


def test_decode_is_fp32_for_low_precision_feats():
    m = build_model("yolov8n", nc=3).eval()
    feats = [torch.randn(1, 67, 80 // s, 640 // s).bfloat16() * 3 for s in (8, 16, 32)]
    out = m.decode(feats)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, m.decode([f.float() for f in feats]), rtol=0, atol=0)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert m(torch.rand(1, 3, 64, 64)).dtype == torch.float32


def test_decode_of_model_features():
    m = build_model("yolov8n", nc=80).eval()
    with torch.no_grad():
        feats = m.forward_feats(torch.rand(1, 3, 64, 96))
        out = m(torch.rand(1, 3, 64, 96))
        out_f = m.decode(feats)
    sizes = [(64 // s, 96 // s) for s in (8, 16, 32)]
    for level, i, j in [(0, 2, 5), (2, 1, 2)]:
        got = out_f[0, :, _index(sizes, level, i, j)].double()
        torch.testing.assert_close(got, _hand_decode(feats, 0, level, i, j, 80), rtol=1e-5, atol=1e-4)
    assert torch.isfinite(out).all()


def test_anchor_cache_follows_shape():
    m = build_model("yolov8n", nc=2).eval()
    with torch.no_grad():
        a = m(torch.rand(1, 3, 64, 64))
        b = m(torch.rand(1, 3, 64, 128))
        c = m(torch.rand(1, 3, 64, 64))
    assert a.shape[-1] == 64 + 16 + 4 and b.shape[-1] == 2 * (64 + 16 + 4) and c.shape == a.shape
    # the x centre of the last stride-8 anchor in the wide image: (16 - 0.5) * 8 px, up to its box offset
    assert b[0, 0, 8 * 16 - 1] > 64


def test_fuse_same_output():
    m = build_model("yolov8n", nc=80)
    # Non-trivial BN statistics, so a wrong fold cannot pass.
    g = torch.Generator().manual_seed(1)
    for mod in m.modules():
        if isinstance(mod, torch.nn.BatchNorm2d):
            n = mod.num_features
            mod.running_mean.copy_(torch.randn(n, generator=g) * 0.1)
            mod.running_var.copy_(torch.rand(n, generator=g) + 0.5)
            mod.weight.data.copy_(torch.rand(n, generator=g) + 0.5)
            mod.bias.data.copy_(torch.randn(n, generator=g) * 0.1)
    m.eval()
    x = torch.rand(2, 3, 128, 160)
    with torch.no_grad():
        ref = m(x)
        assert m.fuse() is m
        out = m(x)
    assert not any(isinstance(mod, torch.nn.BatchNorm2d) for mod in m.modules())
    assert all(mod.conv.bias is not None for mod in m.modules() if isinstance(mod, Conv))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_backward_and_frozen_dfl(nano):
    nano.train()
    feats = nano(torch.rand(2, 3, 64, 64))
    sum(f.float().square().mean() for f in feats).backward()
    assert nano.head.dfl.conv.weight.grad is None
    assert nano.model[0].conv.weight.grad is not None and nano.head.cv3[2][-1].bias.grad is not None
    nano.zero_grad(set_to_none=True)


def test_channels_last(nano):
    x = torch.rand(1, 3, 64, 96)
    nano.eval()
    with torch.no_grad():
        ref = nano(x)
        m = copy.deepcopy(nano).to(memory_format=torch.channels_last)
        out = m(x.to(memory_format=torch.channels_last))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-3)


def test_compile_fullgraph():
    """No graph breaks (fullgraph) in train and eval forward; 'eager' backend keeps it cheap on CPU."""
    torch._dynamo.reset()
    m = build_model({**copy.deepcopy(YOLOV8), "scale": "n", "width_multiple": 0.125}, nc=4)
    x = torch.rand(1, 3, 64, 64)
    cm = torch.compile(m, backend="eager", fullgraph=True)
    m.train()
    torch.testing.assert_close(cm(x)[0], m(x)[0])
    m.eval()
    with torch.no_grad():
        torch.testing.assert_close(cm(x), m(x))


def test_custom_width_dict():
    cfg = copy.deepcopy(YOLOV8)
    cfg["scales"]["t"] = [0.33, 0.125, 1024]
    cfg["scale"] = "t"
    m = build_model(cfg, nc=7)
    assert m.model[0].conv.out_channels == 8  # 64 * 0.125
    assert m.model[9].cv2.conv.out_channels == 128  # 1024 * 0.125
    assert _count(m) < PARAMS["n"]
    train = m(torch.rand(1, 3, 64, 64))
    assert [t.shape[1] for t in train] == [71] * 3
    # the same with explicit multiples (no scales table at all)
    cfg2 = {k: v for k, v in copy.deepcopy(YOLOV8).items() if k != "scales"}
    cfg2.update(depth_multiple=0.33, width_multiple=0.125, max_channels=1024)
    assert _count(build_model(cfg2, nc=7)) == _count(m)
    # caller's dict left untouched; the model's yaml rebuilds an identical architecture
    assert "depth_multiple" not in cfg
    rebuilt = build_model(m.yaml)
    assert rebuilt.nc == 7 and rebuilt.state_dict().keys() == m.state_dict().keys()
    assert _count(rebuilt) == _count(m)


def test_dict_nc_used_when_not_given():
    cfg = {**copy.deepcopy(YOLOV8), "nc": 3, "scale": "n"}
    assert build_model(cfg).nc == 3
    assert build_model(cfg, nc=5).nc == 5


def test_yaml_file_matches_builtin_and_loads(tmp_path):
    shipped = Path(__file__).resolve().parents[2] / "yolofast" / "nn" / "cfg" / "yolov8.yaml"
    d = yaml.safe_load(shipped.read_text())
    assert d["backbone"] == YOLOV8["backbone"] and d["head"] == YOLOV8["head"]
    assert d["scales"] == YOLOV8["scales"] and d["nc"] == YOLOV8["nc"]
    f = tmp_path / "yolov8s-mine.yaml"  # scale inferred from the file name
    f.write_text(shipped.read_text())
    m = build_model(str(f))
    assert _count(m) == PARAMS["s"] and m.yaml["scale"] == "s"


def test_input_channels():
    m = build_model("yolov8n", nc=2, ch=1)
    assert m.model[0].conv.in_channels == 1
    assert m(torch.rand(1, 1, 64, 64))[0].shape == (1, 66, 8, 8)


def test_info(nano, capsys):
    layers, n_p, gflops = nano.info(verbose=True)
    assert n_p == PARAMS["n"] and layers > 100
    assert gflops == pytest.approx(8.74, abs=0.05)  # published YOLOv8n: 8.7 GFLOPs at 640
    out = capsys.readouterr().out
    assert "YOLOv8n summary:" in out and "3,157,200 parameters, 3,157,184 gradients, 8.7 GFLOPs" in out


@pytest.mark.parametrize(
    "cfg, exc, match",
    [
        ("yolov9z", FileNotFoundError, "not a known model"),
        (42, TypeError, "expected a name"),
        ({**YOLOV8, "scale": "q"}, ValueError, "scale 'q'"),
        ({**YOLOV8, "scale": "n", "head": YOLOV8["head"][:-1]}, ValueError, "last layer must be Detect"),
        ({**YOLOV8, "scale": "n", "backbone": [[-1, 1, "Foo", [8]]] + YOLOV8["backbone"][1:]}, ValueError,
         "unknown module 'Foo'"),
        ({**YOLOV8, "scale": "n", "head": [[[-1, 4], 1, "Concat", [1]]] + YOLOV8["head"][2:]}, ValueError,
         "different strides"),
    ],
)
def test_config_errors(cfg, exc, match):
    with pytest.raises(exc, match=match):
        build_model(cfg)
