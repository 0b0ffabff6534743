"""Every key of Ultralytics 8.4.190's default.yaml: accepted with its default, or refused naming its task."""

import copy
import re
from pathlib import Path

import pytest
import yaml

from yolofast import cli
from yolofast.cfg import DEFAULTS, OTHER_TASK_KEYS, CfgError, get_cfg, quantize_half
from yolofast.cfg.keys_table import DIFFERENT_DEFAULTS, ULTRALYTICS_DEFAULTS, markdown

ULTRA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "ultralytics"
UL_CKPT = ULTRA / "yolov8n-rect3.pt"
KEYS_DOC = Path(__file__).resolve().parents[2] / "docs" / "recipe-keys.md"


@pytest.fixture(scope="module")
def ul_train_args():
    if not UL_CKPT.exists():
        pytest.skip("../shared/data/ultralytics is not present")
    from yolofast.io import read_checkpoint

    return read_checkpoint(UL_CKPT)["train_args"]


def test_every_key_of_an_ultralytics_run_is_accepted_or_refused_with_its_task(ul_train_args):
    """The checkpoint's train_args hold all 113 keys of 8.4.190 with that run's values."""
    assert set(ul_train_args) == set(ULTRALYTICS_DEFAULTS) and len(ul_train_args) == 113
    accepted = refused = 0
    for k, v in ul_train_args.items():
        if k in OTHER_TASK_KEYS:
            with pytest.raises(CfgError, match=rf"'{k}' belongs to Ultralytics' \w+ (task|mode)"):
                get_cfg(**{k: v})
            refused += 1
            continue
        if k in ("data", "project"):  # a temporary folder of the run that made the file
            v = DEFAULTS[k]
        cfg = get_cfg(**{k: v})
        assert getattr(cfg, k) == v, k
        accepted += 1
    assert (accepted, refused) == (100, 13)


def test_defaults_are_ultralytics_unless_documented():
    for k, v in ULTRALYTICS_DEFAULTS.items():
        if k in OTHER_TASK_KEYS:
            assert k not in DEFAULTS
        elif k in DIFFERENT_DEFAULTS:
            assert DEFAULTS[k] != v, f"{k}: same default now, drop it from DIFFERENT_DEFAULTS"
        else:
            assert DEFAULTS[k] == v and type(DEFAULTS[k]) is type(v), k


def test_distillation_keys_are_the_last_lines():
    lines = [ln for ln in Path(cli.DEFAULT_CFG_PATH).read_text().splitlines() if ln.strip()]
    assert lines[-3:] == [
        "# Distillation (train)",
        "distill_model:          # teacher checkpoint (.pt: yolofast or Ultralytics v8 detect, the student's "
        "classes); None: off",
        "dis: 6.0                # distillation loss gain",
    ]


def test_unknown_keys_still_fail_with_a_suggestion():
    with pytest.raises(CfgError, match="'fraktion' is not a valid yolofast key; did you mean 'fraction'"):
        get_cfg(fraktion=0.5)
    with pytest.raises(CfgError, match="'single_class'.*did you mean 'single_cls'"):
        get_cfg(single_class=True)


@pytest.mark.parametrize("kw, msg", [
    (dict(task="segment"), "detectors only"),
    (dict(mode="track"), "mode='track' must be one of"),
    (dict(quantize=8), "quantization-aware training is not supported"),
    (dict(nms=True), "nms=True"),
    (dict(freeze="backbone"), "freeze="),
    (dict(fraction=1.5), "a ratio is at most 1.0"),
    (dict(multi_scale=1.0), r"multi_scale=1.0 must be in \[0.0, 1.0\)"),
    (dict(cls_pw=2.0), r"cls_pw=2.0 must be in \[0.0, 1.0\]"),
    (dict(copy_paste_mode="paste"), "copy_paste_mode"),
    (dict(pretrained="weights.bin"), "pretrained="),
    (dict(channels_last="yes"), "channels_last="),
])
def test_bad_values_name_the_key(kw, msg):
    with pytest.raises(CfgError, match=msg):
        get_cfg(**kw)


def test_quantize_sets_val_precision(monkeypatch):
    assert quantize_half(16, False) and quantize_half("fp16", False)
    assert not quantize_half(32, True) and not quantize_half("fp32", True)
    assert quantize_half(None, True) and not quantize_half(None, False)
    from yolofast.val import validator as V

    seen = []
    monkeypatch.setattr(V.Validator, "__call__", lambda self, model: seen.append(self.half) or {})
    monkeypatch.setattr(V, "DetMetrics", lambda *a: None)
    data = str(ULTRA / "rect3" / "data.yaml")
    if not Path(data).is_file():
        pytest.skip("../shared/data/ultralytics is not present")
    from yolofast.nn import build_model

    model = build_model("yolov8n", nc=3)
    for q, want in ((16, True), ("fp32", False), (None, False)):
        V.validate(model, data, imgsz=64, verbose=False, quantize=q)
        assert seen[-1] is want


def test_cfg_file_replaces_defaults_and_direct_keys_win(tmp_path):
    f = tmp_path / "my.yaml"
    f.write_text("epochs: 7\nfreeze: 10\nsingle_cls: true\n")
    c = get_cfg(cfg=str(f), epochs=3)
    assert (c.epochs, c.freeze, c.single_cls) == (3, 10, True)
    f.write_text("pose: 12.0\n")
    with pytest.raises(CfgError, match="pose task"):
        get_cfg(cfg=str(f))
    with pytest.raises(CfgError, match="not found"):
        get_cfg(cfg=str(tmp_path / "none.yaml"))


def test_help_shows_every_key_with_its_default(capsys):
    assert cli.main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    for k in ("fraction=1.0", "freeze=None", "multi_scale=0.0", "cls_pw=0.0", "rect=False",
              "single_cls=False", "pretrained=True", "cls_remap=True", "copy_paste_mode=flip", "bgr=0.0",
              "cutmix=0.0", "save_json=False",
              "profile=False", "distill_model=None", "dis=6.0", "vid_stride=1", "workspace=None"):
        assert re.search(rf"^  {re.escape(k)}\s", out, re.M), k


def test_args_yaml_round_trips_every_key(tmp_path):
    """The trainer writes args.yaml with every key; reading it back gives the same config."""
    from yolofast import Trainer
    from yolofast.data import make_shapes
    from yolofast.nn import YOLOV8

    tiny = {k: v for k, v in copy.deepcopy(YOLOV8).items() if k != "scales"}
    tiny.update(depth_multiple=0.33, width_multiple=0.125, max_channels=256)
    data = str(make_shapes(root=tmp_path / "d", n_train=4, n_val=2, imgsz=64))
    keys = dict(freeze=[0, "1.conv"], fraction=[1.0, 1.0], quantize="fp32", cls_pw=0.5, multi_scale=0.25,
                pretrained=False, channels_last=False, vid_stride=2, copy_paste_mode="mixup", cutmix=0.1)
    t = Trainer(model=tiny, data=data, imgsz=64, batch=2, workers=0, epochs=1, verbose=False, plots=False,
                project=str(tmp_path / "runs"), **keys)
    t.train()
    saved = yaml.safe_load((t.save_dir / "args.yaml").read_text())
    assert set(saved) == set(DEFAULTS)
    saved.pop("model")  # the dict model is stored by name only
    again = vars(get_cfg(**saved))
    for k, v in keys.items():
        assert saved[k] == v and again[k] == v, k


def test_docs_key_table_is_current():
    text = KEYS_DOC.read_text(encoding="utf-8")
    assert markdown() in text, (
        "docs/recipe-keys.md's key table is stale: paste `python -m yolofast.cfg.keys_table`")
