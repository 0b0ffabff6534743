"""The restricted unpickler: crafted malicious files are refused before anything runs, naming the global;
other architectures and tasks are refused naming what was found."""

import io
import os
import subprocess
import sys

import pytest
import torch
from crafted import fake_checkpoint

from yolofast.io import (
    CheckpointError,
    UnsafeCheckpointError,
    UnsupportedCheckpointError,
    model_from_checkpoint,
    read_checkpoint,
)


class _Reduce:
    """Pickles as ``func(*args)``: what a malicious checkpoint does to run code while it loads."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


@pytest.mark.parametrize("func, args, named", [
    (os.system, ("touch {marker}",), "system"),
    (eval, ("open({marker!r}, 'w')",), "builtins.eval"),
    (subprocess.Popen, (["touch", "{marker}"],), "subprocess.Popen"),
    (getattr, ("", "join"), "builtins.getattr"),
    (__import__, ("os",), r"builtins.__import__"),
])
def test_malicious_reduce_is_refused_and_nothing_runs(tmp_path, func, args, named):
    marker = tmp_path / "ran"
    args = tuple(a.format(marker=str(marker)) if isinstance(a, str) else
                 [x.format(marker=str(marker)) for x in a] if isinstance(a, list) else a for a in args)
    path = tmp_path / "evil.pt"
    # hidden inside an otherwise ordinary-looking checkpoint, next to real tensors
    torch.save({"model": {"w": torch.ones(2)}, "ema": None, "train_args": _Reduce(func, *args)}, path)
    with pytest.raises(UnsafeCheckpointError, match=rf"evil\.pt.*{named}.*does not load") as e:
        read_checkpoint(path)
    assert isinstance(e.value, CheckpointError)
    assert not marker.exists()


def test_hand_built_pickle_bytes_are_refused(tmp_path):
    marker = tmp_path / "ran"
    # protocol 0: GLOBAL 'posix system', a string argument, TUPLE, REDUCE — no torch involved at all
    def payload(target):
        return f"cposix\nsystem\n(Vtouch {target}\ntR.".encode()

    live = tmp_path / "plain-pickle-ran"  # the payload is live: plain pickle runs it (in a child process)
    subprocess.run([sys.executable, "-c", f"import pickle; pickle.loads({payload(live)!r})"], check=True)
    assert live.exists()
    payload = payload(marker)
    path = tmp_path / "raw.pt"
    path.write_bytes(payload)  # not a zip: torch.load's legacy path unpickles it with our module
    with pytest.raises(UnsafeCheckpointError, match="posix.system"):
        read_checkpoint(path)
    assert not marker.exists()
    from yolofast.io import safe_pickle

    with pytest.raises(UnsafeCheckpointError, match="posix.system"):
        safe_pickle.loads(payload)
    assert not marker.exists()


def test_stubs_keep_state_and_run_nothing(tmp_path):
    from yolofast.io import safe_pickle

    buf = io.BytesIO()
    torch.save({"m": torch.nn.Conv2d(2, 4, 1)}, buf)
    obj = torch.load(io.BytesIO(buf.getvalue()), pickle_module=safe_pickle, weights_only=False)["m"]
    assert safe_pickle.stub_name(obj) == "torch.nn.modules.conv.Conv2d"
    assert not isinstance(obj, torch.nn.Module)  # inert: no forward, no hooks
    assert obj._parameters["weight"].shape == (4, 2, 1, 1) and obj.out_channels == 4


@pytest.mark.parametrize("top, layers, head, yaml_file, attrs, match", [
    ("SegmentationModel", ["Conv", "C2f"], "Segment", "yolov8n-seg.yaml", {}, r"segment model.*Segment"),
    ("PoseModel", ["Conv"], "Pose", "yolov8n-pose.yaml", {}, r"pose model"),
    ("OBBModel", ["Conv"], "OBB", "yolov8n-obb.yaml", {}, r"obb model"),
    ("ClassificationModel", ["Conv"], "Classify", "yolov8n-cls.yaml", {}, r"classify model"),
    ("DetectionModel", ["Conv", "A2C2f", "C3k2"], "Detect", "yolo12n.yaml", {},
     r"YOLO12 .*yolo12n\.yaml.*A2C2f"),
    ("DetectionModel", ["Conv", "C3", "SPPF"], "Detect", "yolov5nu.yaml", {}, r"YOLOv5u .*C3"),
    ("DetectionModel", ["Conv", "C2f"], "v10Detect", "yolov10n.yaml", {}, r"head v10Detect"),
])
def test_unsupported_architectures_are_named(tmp_path, top, layers, head, yaml_file, attrs, match):
    path = fake_checkpoint(tmp_path / "other.pt", top, layers, head, yaml_file, **attrs)
    with pytest.raises(UnsupportedCheckpointError, match=match) as e:
        read_checkpoint(path)
    assert "yolofast supports YOLOv8, YOLO11 and YOLO26 detection" in str(e.value)
    assert "other.pt" in str(e.value)
    with pytest.raises(UnsupportedCheckpointError):
        model_from_checkpoint(path)
    assert "ultralytics" not in sys.modules


def test_a_module_that_contains_itself_is_refused(tmp_path):
    from crafted import fake_ultralytics

    with fake_ultralytics({"ultralytics.nn.tasks": ["DetectionModel"],
                           "ultralytics.nn.modules.head": ["Detect"]}) as c:
        model, head = c["DetectionModel"](), c["Detect"]()
        model.model = torch.nn.Sequential(head)
        head._modules["loop"] = model  # a cycle nn.Module itself would never build
        model.yaml, model.names = {"backbone": [], "head": []}, {0: "a"}
        head.nc = 1
        torch.save({"model": model, "ema": None}, tmp_path / "loop.pt")
    with pytest.raises(CheckpointError, match="loop.pt"):
        read_checkpoint(tmp_path / "loop.pt")
