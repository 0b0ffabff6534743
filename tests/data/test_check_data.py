import functools
from pathlib import Path

import pytest
import yaml

from yolofast.data import DataError, check_data


def _write_yaml(path: Path, d: dict) -> Path:
    path.write_text(yaml.safe_dump(d))
    return path


@pytest.fixture
def layout(tmp_path):
    (tmp_path / "ds" / "images" / "train").mkdir(parents=True)
    (tmp_path / "ds" / "images" / "val").mkdir(parents=True)
    return tmp_path


def test_relative_paths_resolved_against_yaml_folder(layout, monkeypatch):
    f = _write_yaml(layout / "d.yaml", {"path": "ds", "train": "images/train", "val": "images/val",
                                        "names": ["a", "b"]})
    monkeypatch.chdir("/")  # the cwd must not matter for a yaml
    d = check_data(str(f))
    assert d["path"] == str((layout / "ds").resolve())
    assert d["train"] == str((layout / "ds" / "images" / "train").resolve())
    assert d["val"] == str((layout / "ds" / "images" / "val").resolve())
    assert d["names"] == {0: "a", 1: "b"} and d["nc"] == 2
    assert d["yaml_file"] == str(f.resolve())


def test_default_path_is_yaml_folder_and_lists(layout):
    f = _write_yaml(layout / "ds" / "d.yaml", {"train": ["images/train", "images/val"], "val": "images/val",
                                               "names": {0: "x"}, "nc": 1})
    d = check_data(f)
    assert d["train"] == [str(layout / "ds" / "images" / "train"), str(layout / "ds" / "images" / "val")]


def test_dict_input(layout):
    d = check_data({"path": str(layout / "ds"), "train": "images/train", "val": "images/val", "names": ["a"]})
    assert d["yaml_file"] is None and Path(d["train"]).is_absolute()


@pytest.mark.parametrize("key", ["train", "val", "names"])
def test_missing_key(layout, key):
    d = {"path": "ds", "train": "images/train", "val": "images/val", "names": ["a"]}
    del d[key]
    f = _write_yaml(layout / "d.yaml", d)
    with pytest.raises(DataError, match=f"missing key '{key}'") as e:
        check_data(f)
    assert str(f) in str(e.value)


def test_missing_yaml_file(tmp_path):
    with pytest.raises(DataError, match="not found"):
        check_data(tmp_path / "nope.yaml")


def test_bad_split_path(layout):
    f = _write_yaml(layout / "d.yaml", {"path": "ds", "train": "images/train", "val": "images/nothere",
                                        "names": ["a"]})
    with pytest.raises(DataError, match=r"'val' path '.*images/nothere' does not exist"):
        check_data(f)


def test_bad_root_path(layout):
    f = _write_yaml(layout / "d.yaml", {"path": "missing_root", "train": "a", "val": "b", "names": ["a"]})
    with pytest.raises(DataError, match=r"'path' folder '.*missing_root' does not exist"):
        check_data(f)


def test_names_nc_mismatch(layout):
    f = _write_yaml(layout / "d.yaml", {"path": "ds", "train": "images/train", "val": "images/val",
                                        "names": ["a", "b", "c"], "nc": 2})
    with pytest.raises(DataError, match="'nc' is 2 but 'names' has 3 entries"):
        check_data(f)


def test_names_with_gap(layout):
    f = _write_yaml(layout / "d.yaml", {"path": "ds", "train": "images/train", "val": "images/val",
                                        "names": {0: "a", 2: "c"}})
    with pytest.raises(DataError, match="without gaps"):
        check_data(f)


def test_error_is_value_error():
    assert issubclass(DataError, ValueError)


def test_coco128(coco128_yaml):
    d = check_data(coco128_yaml)
    assert d["nc"] == 80 and d["names"][0] == "person"
    assert Path(d["train"]).is_dir() and Path(d["val"]).is_dir()


def test_shapes_keyword(tmp_path, monkeypatch):
    import yolofast.data.shapes as shapes

    monkeypatch.setenv("YOLOFAST_CACHE", str(tmp_path))
    small = functools.partial(shapes.make_shapes, n_train=4, n_val=2, imgsz=64)
    monkeypatch.setattr(shapes, "make_shapes", small)
    d = check_data("shapes")
    assert d["nc"] == len(shapes.SHAPE_NAMES)
    assert Path(d["train"]).is_dir() and Path(d["train"]).is_relative_to(tmp_path)
    assert len(list(Path(d["train"]).glob("*.jpg"))) == 4
    assert check_data("shapes.yaml")["yaml_file"] == d["yaml_file"]
