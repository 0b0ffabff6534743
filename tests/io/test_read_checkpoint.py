"""Real Ultralytics 8.4 files and yolofast's own (new and older format) read into yolofast models."""

import copy
import subprocess
import sys

import numpy as np
import torch

from yolofast.io import FORMAT, model_from_checkpoint, read_checkpoint
from yolofast.nn import YOLOV8, build_model

TINY = {k: v for k, v in copy.deepcopy(YOLOV8).items() if k != "scales"}
TINY.update(depth_multiple=0.33, width_multiple=0.125, max_channels=256)


def test_ultralytics_best_raw_output_matches(ultralytics_dir):
    info = read_checkpoint(ultralytics_dir / "yolov8n-rect3.pt")
    assert (info["source"], info["arch"], info["scale"], info["nc"]) == ("ultralytics", "yolov8n", "n", 3)
    assert info["names"] == {0: "red", 1: "green", 2: "blue"} and info["stride"] == [8.0, 16.0, 32.0]
    sd = info["state_dict"]
    assert len(sd) == 355 and all(v.dtype != torch.float16 for v in sd.values())
    assert info["train_args"]["imgsz"] == 224
    model = model_from_checkpoint(info)
    assert not model.training and model.nc == 3 and model.names[2] == "blue"
    x = torch.from_numpy(np.load(ultralytics_dir / "yolov8n-rect3-raw-input.npy"))
    want = np.load(ultralytics_dir / "yolov8n-rect3-raw-output.npy")
    with torch.no_grad():
        got = model(x).numpy()
    assert got.shape == want.shape == (1, 7, 1029)
    rel = np.abs(got - want) / np.maximum(np.abs(want), 1e-6 * np.abs(want).max())
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max() and np.median(rel) < 1e-4


def test_ultralytics_last_and_init_load(ultralytics_dir):
    last = read_checkpoint(ultralytics_dir / "yolov8n-rect3-epoch2-last.pt")
    assert last["ema_state_dict"] is not None and last["model_state_dict"] is None  # its model is None
    assert last["epoch"] == 1 and "state" in last["train_state"]["optimizer"]  # 0-based: its 2nd epoch
    model_from_checkpoint(last)
    init = model_from_checkpoint(ultralytics_dir / "yolov8s-init.pt")
    assert init.nc == 80 and init.yaml["scale"] == "s"
    ref = build_model("yolov8s")
    shapes = {k: v.shape for k, v in ref.state_dict().items()}
    assert {k: v.shape for k, v in init.state_dict().items()} == shapes


def test_ultralytics_is_never_imported(ultralytics_dir, tmp_path):
    # A package named ultralytics on the path that records being imported: reading must not touch it.
    fake = tmp_path / "site" / "ultralytics"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\n")
    code = ("import sys; from yolofast.io import model_from_checkpoint\n"
            f"model_from_checkpoint({str(ultralytics_dir / 'yolov8n-rect3-epoch2-last.pt')!r})\n"
            "assert not any(m.split('.')[0] == 'ultralytics' for m in sys.modules), 'imported'\n")
    site = str(tmp_path / "site")
    subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {site!r}); {code}"], check=True)
    assert not (tmp_path / "imported").exists()


def test_older_yolofast_checkpoint_with_pickled_modules(tmp_path):
    model = build_model(TINY, nc=2)
    model.names = {0: "cat", 1: "dog"}
    ema = copy.deepcopy(model).eval()
    with torch.no_grad():
        for p in ema.parameters():
            p.add_(1.0)
    path = tmp_path / "old.pt"
    # the format yolofast wrote before: whole modules, numpy RNG state (an ndarray) inside
    torch.save({"epoch": 0, "model": model, "ema": ema, "rng": {"numpy": np.random.get_state()},
                "train_args": {"epochs": 2}, "version": "0.1.0"}, path)
    info = read_checkpoint(path)
    assert (info["source"], info["format"], info["nc"], info["names"]) == ("yolofast", "yolofast/1", 2,
                                                                           {0: "cat", 1: "dog"})
    loaded = model_from_checkpoint(path)
    for k, v in ema.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k  # the EMA is preferred
    raw = model_from_checkpoint(path, weights="model")
    assert torch.equal(raw.state_dict()["model.0.conv.weight"], model.state_dict()["model.0.conv.weight"])
    assert isinstance(info["train_state"]["rng"]["numpy"][1], torch.Tensor)


def test_new_yolofast_checkpoint_reads_with_weights_only(tmp_path):
    from yolofast.engine.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state

    model = build_model(TINY, nc=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.rand(1, 3, 64, 64))[0].sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1 - e / 10)
    gen = torch.Generator().manual_seed(3)
    np.random.seed(5)
    state = rng_state({"loader": gen})
    path = save_checkpoint({"epoch": 0, "model": model, "ema": copy.deepcopy(model).eval(), "updates": 1,
                            "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                            "scaler": torch.amp.GradScaler("cpu", enabled=False).state_dict(),
                            "optimizer_auto": ("SGD", 0.01, 0.9), "train_args": {"epochs": 2, "data": "x"},
                            "train_metrics": {"fitness": np.float64(0.5)}, "rng": state}, tmp_path / "n.pt")
    raw = torch.load(path, weights_only=True)  # no pickled code can be in it
    assert raw["format"] == FORMAT and raw["model_cfg"]["nc"] == 3 and isinstance(raw["model"], dict)
    ck = load_checkpoint(path)
    for k, v in model.state_dict().items():
        assert torch.equal(ck["model"].state_dict()[k], v), k
    buf = opt.state_dict()["state"][0]["momentum_buffer"]
    assert ck["optimizer"]["state"][0]["momentum_buffer"].equal(buf)
    want = np.random.random(3)
    np.random.seed(0)
    gen.manual_seed(0)
    set_rng_state(ck["rng"], {"loader": gen})
    assert np.array_equal(np.random.random(3), want)
    assert read_checkpoint(path)["source"] == "yolofast"


def test_forced_weights_only_env_still_reads_yolofast_files(tmp_path, monkeypatch):
    from yolofast.engine.checkpoint import save_checkpoint

    model = build_model(TINY, nc=1)
    path = save_checkpoint({"epoch": 0, "model": model, "ema": None}, tmp_path / "w.pt")
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    assert read_checkpoint(path)["nc"] == 1
