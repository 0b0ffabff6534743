"""Data yaml checking: resolve and validate a YOLO data description before any work starts."""

from __future__ import annotations

from pathlib import Path

import yaml

__all__ = ["DataError", "check_data", "IMG_FORMATS"]

# Image suffixes OpenCV decodes everywhere (no GIF: cv2.imread cannot read it).
IMG_FORMATS = {"bmp", "jpeg", "jpg", "png", "tif", "tiff", "webp"}
SPLITS = ("train", "val", "test")


class DataError(ValueError):
    """A data yaml or data set that cannot be used; the message names the key/file and the fix."""


def _load_yaml(file: Path) -> dict:
    if not file.exists():
        raise DataError(f"data file '{file}' not found: pass a data yaml that exists, a dict, or 'shapes'")
    try:
        with open(file, encoding="utf-8") as f:
            d = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise DataError(f"data file '{file}' is not valid YAML: {e}") from e
    if not isinstance(d, dict):
        raise DataError(f"data file '{file}' must hold a mapping with keys train, val, names; got "
                        f"{type(d).__name__}")
    return d


def _names(d: dict, where: str) -> dict[int, str]:
    names, nc = d.get("names"), d.get("nc")
    if nc is not None and (not isinstance(nc, int) or isinstance(nc, bool) or nc < 1):
        raise DataError(f"{where}: 'nc' must be a positive integer, got {nc!r}")
    if names is None:
        if nc is None:
            raise DataError(f"{where}: missing key 'names' (a list of class names, or a dict id -> name)")
        return {i: f"class{i}" for i in range(nc)}
    if isinstance(names, (list, tuple)):
        names = dict(enumerate(names))
    if not isinstance(names, dict) or not names:
        raise DataError(f"{where}: 'names' must be a non-empty list or dict id -> name, got {names!r}")
    try:
        names = {int(k): str(v) for k, v in names.items()}
    except (TypeError, ValueError) as e:
        raise DataError(f"{where}: 'names' keys must be integer class ids, got {list(names)}") from e
    if sorted(names) != list(range(len(names))):
        raise DataError(f"{where}: 'names' ids must be 0..{len(names) - 1} without gaps, got {sorted(names)}")
    if nc is not None and nc != len(names):
        raise DataError(f"{where}: 'nc' is {nc} but 'names' has {len(names)} entries; make them agree "
                        f"(or drop 'nc')")
    return names


def _resolve_split(value, root: Path, key: str, where: str):
    """A split is a folder of images, a .txt list of image paths, an image, or a list of those."""
    items = value if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise DataError(f"{where}: '{key}' is an empty list; give a folder of images or a .txt list")
    out = []
    for item in items:
        if not isinstance(item, (str, Path)):
            raise DataError(f"{where}: '{key}' must be a path or a list of paths, got {item!r}")
        p = Path(item).expanduser()
        p = (p if p.is_absolute() else root / p).resolve()
        if not p.exists():
            raise DataError(f"{where}: '{key}' path '{p}' does not exist (expected a folder of images or a "
                            f".txt list of image paths, relative to path '{root}')")
        out.append(str(p))
    return out if isinstance(value, (list, tuple)) else out[0]


def check_data(data) -> dict:
    """Validate a data description and return it with absolute paths.

    data: path to a data yaml, a dict with the same keys, or "shapes"/"shapes.yaml" for the built-in
    synthetic set. Keys: `path` (root, relative to the yaml's folder, default that folder), `train`, `val`
    (folders, .txt lists or lists of them, relative to `path`), `names` (list or dict), optional `nc`,
    `test`, `coco_json` (COCO annotations of the val images, for ``save_json``'s pycocotools evaluation).
    Returns a new dict with `path`, `train`, `val` (absolute str or list of str), `names`
    (dict int -> str), `nc`, `yaml_file` (absolute str, None for a dict) and any other keys unchanged.
    Raises DataError naming the key/path and what was expected.
    """
    yaml_file = None
    if isinstance(data, (str, Path)):
        s = str(data)
        if s in ("shapes", "shapes.yaml") and not Path(s).exists():
            from yolofast.data.shapes import make_shapes

            data = make_shapes()
        yaml_file = Path(data).expanduser().resolve()
        d = _load_yaml(yaml_file)
        where, base = f"data file '{yaml_file}'", yaml_file.parent
    elif isinstance(data, dict):
        d, where, base = dict(data), "data dict", Path.cwd()
    else:
        raise DataError(f"data must be a yaml path, a dict or 'shapes', got {type(data).__name__}")

    if "val" not in d and "validation" in d:
        d["val"] = d.pop("validation")
    for key in ("train", "val"):
        if d.get(key) in (None, ""):
            raise DataError(f"{where}: missing key '{key}' (a folder of images or a .txt list of image "
                            f"paths)")
    names = _names(d, where)

    root = Path(d.get("path") or ".").expanduser()
    root = (root if root.is_absolute() else base / root).resolve()
    if not root.is_dir():
        raise DataError(f"{where}: 'path' folder '{root}' does not exist (it is relative to "
                        f"{'the yaml folder' if yaml_file else 'the current folder'} '{base}')")

    out = dict(d)
    out.update(path=str(root), names=names, nc=len(names), yaml_file=str(yaml_file) if yaml_file else None)
    for key in SPLITS:
        if d.get(key) not in (None, ""):
            out[key] = _resolve_split(d[key], root, key, where)
    if d.get("coco_json") not in (None, ""):  # COCO annotations of the val split, for save_json
        p = Path(str(d["coco_json"])).expanduser()
        p = (p if p.is_absolute() else root / p).resolve()
        if not p.is_file():
            raise DataError(f"{where}: 'coco_json' file '{p}' does not exist (COCO instances json of the val "
                            f"images, relative to path '{root}')")
        out["coco_json"] = str(p)
    return out
