"""YOLO11 and YOLO26 from the one builder: parameter counts, names, blocks, Ultralytics' golden outputs."""

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from yolofast.nn import C2PSA, SPPF, Attention, Bottleneck, C3k, C3k2, DWConv, PSABlock, build_model

GOLDEN = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "ultralytics" / "golden"

# Ultralytics 8.4.190's parameter counts at nc=80 and nc=3 (YOLO11_YOLO26.md section 1).
PARAMS = {
    "yolo11n": (2_624_080, 2_590_425), "yolo11s": (9_458_752, 9_428_953), "yolo11m": (20_114_688, 20_055_321),
    "yolo11l": (25_372_160, 25_312_793), "yolo11x": (56_966_176, 56_877_241),
    "yolo26n": (2_572_280, 2_504_970), "yolo26s": (10_009_784, 9_950_186),
    "yolo26m": (21_896_248, 21_777_514),
    "yolo26l": (26_299_704, 26_180_970), "yolo26x": (58_993_368, 58_815_498),
}


def _count(m, trainable=False):
    return sum(p.numel() for p in m.parameters() if p.requires_grad or not trainable)


@pytest.mark.parametrize("name", list(PARAMS))
def test_param_counts(name):
    n80, n3 = PARAMS[name]
    m = build_model(name)
    assert _count(m) == n80
    # YOLO11 freezes the 16 DFL bin values, as v8; YOLO26 (reg_max 1) has no DFL
    assert _count(m) - _count(m, trainable=True) == (16 if name.startswith("yolo11") else 0)
    assert _count(build_model(f"{name}.yaml", nc=3)) == n3
    assert m.yaml["scale"] == name[-1] and m.nc == 80


def test_names_and_yaml_paths(tmp_path):
    cfg = Path(__file__).resolve().parents[2] / "yolofast" / "nn" / "cfg"
    a = build_model("yolo26n", nc=3)
    b = build_model("YOLO26n.yaml", nc=3)
    copy = tmp_path / "yolo26n.yaml"  # a user's copy of the family file, scale taken from its name
    shutil.copy(cfg / "yolo26.yaml", copy)
    c = build_model(str(copy), nc=3)
    assert c.yaml["scale"] == "n" and c.yaml["yaml_file"] == str(copy)
    shapes = {k: v.shape for k, v in a.state_dict().items()}
    for m in (b, c):
        assert {k: v.shape for k, v in m.state_dict().items()} == shapes
    assert a.end2end and a.reg_max == 1 and not build_model("yolo11n").end2end
    with pytest.raises(FileNotFoundError, match="yolo26n/s/m/l/x"):
        build_model("yolo27n")


def _rows(m):
    return {i: layer for i, layer in enumerate(m.model)}


def test_resolved_blocks():
    n = _rows(build_model("yolo26n"))
    assert isinstance(n[2].m[0], Bottleneck) and isinstance(n[6].m[0], C3k) and isinstance(n[13].m[0], C3k)
    at = n[22].m[0]
    assert isinstance(at, nn.Sequential) and isinstance(at[0], Bottleneck) and isinstance(at[1], PSABlock)
    assert at[1].attn.num_heads == 2 and at[1].attn.key_dim == 32 and at[1].attn.head_dim == 64
    # SPPF: YOLO26's cv1 is linear and adds a residual; YOLO11's keeps SiLU, no residual
    assert isinstance(n[9], SPPF) and n[9].add and isinstance(n[9].cv1.act, nn.Identity)
    e = _rows(build_model("yolo11n"))
    assert not e[9].add and isinstance(e[9].cv1.act, nn.SiLU)
    assert isinstance(e[13].m[0], Bottleneck) and isinstance(e[22].m[0], C3k)
    assert isinstance(e[10], C2PSA) and len(e[10].m) == 1
    # m: every C3k2 row gets C3k blocks (the yaml says False for rows 2/4/13/...), YOLO26's row 22 stays AT
    m = _rows(build_model("yolo11m"))
    assert all(isinstance(m[i].m[0], C3k) for i in (2, 4, 13, 16, 19))
    m26 = _rows(build_model("yolo26m"))
    assert isinstance(m26[22].m[0][1], PSABlock) and len(m26[22].m) == 1
    assert len(_rows(build_model("yolo11l"))[10].m) == 2  # depth 1.0: 2 PSABlocks
    # the head's class branch: depthwise 3x3 + 1x1 twice, then the 1x1 to nc
    head = build_model("yolo26n").head
    assert isinstance(head.cv3[0][0][0], DWConv) and head.cv3[0][0][0].conv.groups == 64
    assert not head.legacy and build_model("yolov8n").head.legacy


def test_worked_row_and_head_counts():
    """Per-row counts printed by Ultralytics 8.4.190 (spec section 2.2) and the two heads (section 3.2)."""
    r11, r26 = _rows(build_model("yolo11n")), _rows(build_model("yolo26n"))
    assert _count(r11[6]) == 87_040
    assert _count(r26[22]) == 463_104 and _count(r26[9]) == 164_608 and _count(r26[10]) == 249_728
    assert _count(r11[23]) == 464_912 and _count(r26[23]) == 309_656


def test_attention_head_layout():
    """qkv's rows are per-head slabs [q | k | v]: permuting the heads' slabs permutes the heads' outputs."""
    torch.manual_seed(0)
    a = Attention(128, num_heads=2).eval()
    x = torch.randn(1, 128, 4, 5)
    y = a(x)
    assert y.shape == x.shape
    with torch.no_grad():  # reference: the same maths per head, written out
        qkv = a.qkv(x).view(1, 2, 128, 20)
        outs = []
        for h in range(2):
            q, k, v = qkv[0, h, :32], qkv[0, h, 32:64], qkv[0, h, 64:]
            p = (q.T @ k * 32 ** -0.5).softmax(-1)
            outs.append(v @ p.T)
        o = torch.cat(outs).view(1, 128, 4, 5) + a.pe(qkv[:, :, 64:].reshape(1, 128, 4, 5))
        torch.testing.assert_close(a.proj(o), y)


def test_c3k2_dataflow():
    m = C3k2(32, 48, n=2, c3k=False, e=0.25).eval()
    assert m.c == 12 and m.cv2.conv.in_channels == 4 * 12
    assert m(torch.randn(2, 32, 8, 8)).shape == (2, 48, 8, 8)


def _golden(name):
    path = GOLDEN / f"{name}_nc5_seed0.pt"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    return torch.load(path, weights_only=True)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("name", ["yolo11n", "yolo26n"])
def test_golden_seeded_init_and_outputs(name):
    """Seed 0 gives Ultralytics' initial weights bit for bit (same module order, same bias init); the
    golden state dict reproduces its train-mode head outputs and eval outputs to 1e-5 relative."""
    g = _golden(name)
    torch.manual_seed(0)
    m = build_model(name, nc=5)
    sd = m.state_dict()
    assert list(sd) == list(g["state_dict"])  # the same names in the same order (499 / 708 keys)
    assert all(torch.equal(v, g["state_dict"][k]) for k, v in sd.items())
    m.load_state_dict(g["state_dict"])
    m.train()
    out = m(g["x"])
    if name == "yolo11n":
        flat = torch.cat([f.flatten(2) for f in out], 2)
        assert _rel(flat[:, :64], g["train_boxes"]) < 1e-5 and _rel(flat[:, 64:], g["train_scores"]) < 1e-5
    else:
        for br in ("one2many", "one2one"):
            assert _rel(out[br]["boxes"], g[f"train_{br}_boxes"]) < 1e-5
            assert _rel(out[br]["scores"], g[f"train_{br}_scores"]) < 1e-5
    m.load_state_dict(g["state_dict"])  # fresh running statistics, as the golden eval tensors
    m.eval()
    with torch.no_grad():
        assert _rel(m(g["x"]), g["eval_default"]) < 1e-5
        if name == "yolo26n":
            m.head.nms_free = True
            y = m(g["x"])
            assert y.shape == (2, 300, 6)
            assert _rel(y, g["eval_end2end_maxdet300"]) < 1e-5


def test_one2one_branch_is_detached():
    """The one-to-one loss must train only its own branches: no gradient reaches the neck from it."""
    torch.manual_seed(0)
    m = build_model("yolo26n", nc=3).train()
    out = m(torch.rand(1, 3, 64, 64))
    assert set(out) == {"one2many", "one2one"}
    o2o = out["one2one"]
    assert all(not f.requires_grad for f in o2o["feats"])
    assert [tuple(x.shape) for x in o2o["maps"]] == [(1, 7, 8, 8), (1, 7, 4, 4), (1, 7, 2, 2)]
    (o2o["boxes"].sum() + o2o["scores"].sum()).backward()
    assert m.model[0].conv.weight.grad is None
    assert m.head.one2one_cv2[0][0].conv.weight.grad is not None and m.head.cv2[0][0].conv.weight.grad is None


def test_conv_gflops_count_both_heads():
    """2 x conv multiply-adds at 640 (spec section 1, 'conv-only'): YOLO26 counts both head branch sets."""
    assert build_model("yolo11n").info(verbose=False)[2] == pytest.approx(6.48, abs=0.005)
    assert build_model("yolo26n").info(verbose=False)[2] == pytest.approx(5.96, abs=0.005)
