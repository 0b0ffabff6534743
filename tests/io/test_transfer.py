"""Fine-tuning from a checkpoint: every tensor transfers, the head's class rows by class name."""

import copy

import pytest
import torch

from yolofast.data import make_shapes
from yolofast.io import read_checkpoint
from yolofast.io.transfer import class_row_keys, transfer_weights
from yolofast.nn import build_model

NEW = {0: "blue", 1: "square", 2: "red", 3: "circle"}  # rect3 has red, green, blue


def test_class_rows_follow_the_names(ultralytics_dir):
    src = read_checkpoint(ultralytics_dir / "yolov8n-rect3.pt")
    torch.manual_seed(0)
    model = build_model("yolov8n", nc=4)
    fresh = copy.deepcopy(model.state_dict())
    n = transfer_weights(model, src["state_dict"], src["names"], NEW)
    rows = class_row_keys(model)
    assert len(rows) == 6  # weight + bias of the last cv3 conv, 3 levels
    assert (n["tensors"], n["total"], n["rows"], n["classes"]) == (349, 355, 2, 4)
    assert n["matched"] == ["blue", "red"]
    sd = model.state_dict()
    for k in rows:
        old = src["state_dict"][k]
        assert torch.equal(sd[k][0], old[2]) and torch.equal(sd[k][2], old[0]), k  # blue, red moved
        assert torch.equal(sd[k][1], fresh[k][1]) and torch.equal(sd[k][3], fresh[k][3]), k  # new: fresh
    for k, v in sd.items():
        if k not in rows:
            assert torch.equal(v, src["state_dict"][k]), k


def test_same_classes_copy_everything(ultralytics_dir):
    src = read_checkpoint(ultralytics_dir / "yolov8n-rect3.pt")
    model = build_model("yolov8n", nc=3)
    n = transfer_weights(model, src["state_dict"], src["names"], dict(src["names"]))
    assert (n["tensors"], n["rows"]) == (355, 3)
    assert all(torch.equal(v, src["state_dict"][k]) for k, v in model.state_dict().items())


@pytest.mark.slow  # two 1-epoch yolov8n runs: ~2 min on the shared 2-core CPU
def test_yolo_train_and_cli_start_from_ultralytics_weights(ultralytics_dir, tmp_path, capsys):
    from yolofast import YOLO
    from yolofast.cli import main

    shapes = make_shapes(root=tmp_path / "s", n_train=4, n_val=2, imgsz=64)
    data = tmp_path / "partly.yaml"  # the shapes images under names that partly overlap rect3's
    data.write_text(f"path: {shapes.parent}\ntrain: images/train\nval: images/val\n"
                    f"names: [blue, square, red, circle, star]\n")
    y = YOLO(ultralytics_dir / "yolov8n-rect3.pt")
    assert y.model.nc == 3 and y.names == {0: "red", 1: "green", 2: "blue"}
    y.train(data=str(data), epochs=1, imgsz=64, batch=2, workers=0, plots=False, project=tmp_path, name="ft",
            lr0=0.0, warmup_epochs=0, verbose=True)
    assert "Transferred 349/355 tensors, 2/5 class rows" in capsys.readouterr().out
    assert y.model.nc == 5 and y.model.names[2] == "red"
    assert main(["train", f"model={ultralytics_dir / 'yolov8n-rect3.pt'}", f"data={data}", "epochs=1",
                 "imgsz=64", "batch=2", "workers=0", "plots=False", f"project={tmp_path}", "name=cli"]) == 0
    assert "Transferred 349/355 tensors, 2/5 class rows" in capsys.readouterr().out


def test_cls_remap_false_copies_rows_by_index(ultralytics_dir):
    """cls_remap=False: same class count -> rows copied by index whatever the names; other count -> fresh."""
    src = read_checkpoint(ultralytics_dir / "yolov8n-rect3.pt")
    model = build_model("yolov8n", nc=3)
    swapped = {0: "blue", 1: "green", 2: "red"}  # rect3: red, green, blue
    n = transfer_weights(model, src["state_dict"], src["names"], swapped, remap=False)
    assert n["rows"] == 3
    assert all(torch.equal(v, src["state_dict"][k]) for k, v in model.state_dict().items())
    remapped = build_model("yolov8n", nc=3)
    transfer_weights(remapped, src["state_dict"], src["names"], swapped)  # by name: red and blue trade rows
    k = class_row_keys(remapped)[0]
    assert torch.equal(remapped.state_dict()[k][0], src["state_dict"][k][2])
    torch.manual_seed(0)
    other = build_model("yolov8n", nc=4)
    fresh = copy.deepcopy(other.state_dict())
    n = transfer_weights(other, src["state_dict"], src["names"], NEW, remap=False)
    assert n["rows"] == 0 and all(torch.equal(other.state_dict()[k], fresh[k]) for k in class_row_keys(other))
