"""Bad input end to end: a broken data set trains anyway with every problem reported once (file and line)
and counted; bad arguments fail before any work with the argument named and what is valid."""

import copy
import logging
import re
import shutil

import pytest
import torch
import yaml

from yolofast import Trainer
from yolofast.cfg import CfgError
from yolofast.data import DataError, make_shapes
from yolofast.engine.validate_args import check_imgsz
from yolofast.nn import YOLOV8

TINY = {k: v for k, v in copy.deepcopy(YOLOV8).items() if k != "scales"}
TINY.update(depth_multiple=0.33, width_multiple=0.125, max_channels=256)
FAST = dict(model=TINY, imgsz=64, batch=4, workers=0, verbose=False, plots=False)



@pytest.fixture
def broken(tmp_path):
    """8 good images plus one of each problem, all in the train split (names: 3 classes)."""
    y = make_shapes(root=tmp_path / "src", n_train=8, n_val=2, imgsz=64)
    root = tmp_path / "ds"
    shutil.copytree(y.parent, root)
    im, lb = root / "images" / "train", root / "labels" / "train"
    good = im / "000000.jpg"

    def add(name, label=None, image=None):
        if image is None:
            shutil.copy(good, im / f"{name}.jpg")
        else:
            (im / f"{name}.jpg").write_bytes(image)
        if label is not None:
            (lb / f"{name}.txt").write_text(label)
        return str(im / f"{name}.jpg"), str(lb / f"{name}.txt")

    files = {
        "corrupt": add("corrupt", "0 0.5 0.5 0.2 0.2\n", image=b"\xff\xd8\xff\xe0 this is not a jpeg" * 8),
        "malformed": add("malformed", "0 0.5 0.5 0.2 0.2\n0 0.5 0.5\n"),
        "bad_class": add("bad_class", "1 0.5 0.5 0.2 0.2\n\n99 0.5 0.5 0.2 0.2\n"),
        "empty": add("empty", ""),
        "unlabelled": add("unlabelled"),
        "dup_zero": add("dup_zero", "0 0.5 0.5 0.2 0.2\n0 0.5 0.5 0.2 0.2\n1 0.3 0.3 0.0 0.1\n"),
    }
    data = yaml.safe_load(y.read_text())
    data["path"] = str(root)
    (root / "shapes.yaml").write_text(yaml.safe_dump(data))
    return root / "shapes.yaml", files, len(data["names"])


def test_broken_dataset_trains_and_reports_each_problem_once(broken, tmp_path, caplog):
    yaml_file, files, nc = broken
    assert nc < 99
    caplog.set_level(logging.INFO, logger="yolofast")
    t = Trainer(data=str(yaml_file), epochs=1, project=tmp_path, name="bad", **FAST)
    metrics = t.train()
    assert "fitness" in metrics and (tmp_path / "bad/weights/last.pt").is_file()
    # memory and gradient norm per epoch: after Ultralytics' 15 columns, which stay first and unchanged
    header, row = (tmp_path / "bad/results.csv").read_text().splitlines()[:2]
    cols = header.split(",")
    assert cols[:3] == ["epoch", "time", "train/box_loss"] and cols[14] == "lr/pg2"
    assert cols[15:17] == ["mem/cpu_rss(GB)", "mem/cuda_reserved(GB)"]
    assert cols[17:] == ["grad/norm_mean", "grad/norm_max", "grad/clip_frac", "grad/nonfinite"]
    rss, cuda = (float(v) for v in row.split(",")[15:17])
    assert 0.05 < rss < 64 and cuda == 0.0
    for p in t.model.parameters():
        assert torch.isfinite(p).all()

    warns = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    expect = {
        "corrupt": (files["corrupt"][0], r"unreadable image|cannot"),
        "malformed": (files["malformed"][1] + ":2", r"expected 'class cx cy w h' \(5 values\), got 3"),
        "bad_class": (files["bad_class"][1] + ":3", r"class 99 out of range \[0, \d+\)"),
        "dup_zero": (files["dup_zero"][1],
                     r"1 zero-area box\(es\) \(line 3\).*1 duplicate box\(es\) \(line 2\)"),
    }
    for what, (where, pattern) in expect.items():
        hits = [m for m in warns if where in m]
        assert len(hits) == 1, f"{what}: expected one report naming {where}, got {hits}"
        assert re.search(pattern, hits[0]), (what, hits[0])
    # empty label files and images without labels are backgrounds: counted, not warned about
    assert not [m for m in warns if files["empty"][0] in m or files["unlabelled"][0] in m]

    # the train summary: 8 good + empty + unlabelled + dup_zero usable; 3 refused
    summary = [r.getMessage() for r in caplog.records if r.getMessage().startswith("train: ")
               and " corrupt, " in r.getMessage()]
    assert len(summary) == 1, summary
    s = summary[0]
    assert re.search(r"train: 11 images, 2 backgrounds \(1 without label file\), 3 corrupt, \d+ boxes, "
                     r"1 duplicate boxes removed, 1 zero-area boxes removed", s), s


def test_imgsz_not_multiple_of_32_names_nearest():
    with pytest.raises(CfgError, match=r"imgsz=100 is not a multiple of the max stride 32; the nearest valid "
                                       r"values are 96 or 128"):
        Trainer(imgsz=100, data="/nowhere/at/all.yaml")  # refused before the data is even looked at
    with pytest.raises(CfgError, match="imgsz=16 .* are 32"):
        check_imgsz(16)
    with pytest.raises(CfgError, match="imgsz=64.5 must be an integer"):
        check_imgsz(64.5)
    assert check_imgsz(640) == 640


def test_bad_arguments_fail_before_work(tmp_path):
    names = r"valid names: yolov8n, yolov8s, yolov8m, yolov8l, yolov8x, yolo11n, .*, yolo26x"
    with pytest.raises(CfgError, match=r"model='yolov9z' is not a known model; " + names):
        Trainer(model="yolov9z", data="/nowhere/at/all.yaml")
    with pytest.raises(CfgError, match=r"model='missing\.pt': checkpoint not found"):
        Trainer(model="missing.pt", data="/nowhere/at/all.yaml")
    if not torch.cuda.is_available():
        with pytest.raises(CfgError, match=r"device='cuda:0' asks for CUDA .* use device=cpu"):
            Trainer(device="cuda:0", **{k: v for k, v in FAST.items() if k != "model"})
    with pytest.raises(CfgError, match=r"device='tpu' is not a device"):
        Trainer(device="tpu")
    with pytest.raises(DataError, match=r"data file '.*nowhere.yaml' not found"):
        Trainer(data=str(tmp_path / "nowhere.yaml"), **FAST)
    (tmp_path / "images").mkdir()
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"path": str(tmp_path), "train": "images", "val": "images",
                                   "names": ["a", "b"], "nc": 3}))
    with pytest.raises(DataError, match="'nc' is 3 but 'names' has 2 entries"):
        Trainer(data=str(bad), **FAST)
    bad.write_text(yaml.safe_dump({"path": str(tmp_path), "train": "images", "val": "no/such/dir",
                                   "names": ["a"]}))
    with pytest.raises(DataError, match=r"'val' path '.*no/such/dir' does not exist"):
        Trainer(data=str(bad), **FAST)
    assert not (tmp_path / "runs").exists() and not list(tmp_path.glob("**/weights"))
