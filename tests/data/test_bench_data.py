"""``yolofast bench data``: the table it prints (no timings asserted)."""

import yaml

from yolofast.bench.cli import bench_main


def _data_yaml(tmp_path, split_factory):
    """A one-class data yaml over 8 generated images (train and val the same split)."""
    split_factory(tmp_path, {f"im{i}": "0 0.5 0.5 0.5 0.5\n" for i in range(8)})
    y = tmp_path / "d.yaml"
    y.write_text(yaml.safe_dump(dict(path=str(tmp_path), train="images/train", val="images/train",
                                     names={0: "a"})))
    return y


def test_bench_data_prints_rates_and_feed(tmp_path, split_factory, capsys):
    y = _data_yaml(tmp_path, split_factory)
    rc = bench_main(["data", "--data", str(y), "--imgsz", "64", "--blocks", "2", "--block-size", "4",
                     "--no-ultralytics", "--batch", "2", "--workers", "4"])
    out = capsys.readouterr().out
    assert rc == 0 and "training samples per second per core" in out and "yolofast" in out
    assert "with workers=4" in out and "batch-2 train step faster than" in out
    assert bench_main(["data", "--data", str(tmp_path / "missing.yaml")]) == 2


def test_bench_data_loader_table(tmp_path, split_factory, capsys):
    y = _data_yaml(tmp_path, split_factory)
    rc = bench_main(["data", "--data", str(y), "--imgsz", "64", "--blocks", "1", "--block-size", "2",
                     "--no-ultralytics", "--batch", "2", "--loader", "2", "--loader-rounds", "2",
                     "--loader-batches", "3"])
    out = capsys.readouterr().out
    assert rc == 0 and "2 alternating rounds of 3 batches" in out and "workers=2" in out
    assert "CPU seconds per batch, all processes" in out and "nan" not in out
    assert "min(8 x batch, 1000) images, holds all 8 of this split" in out  # 8 x batch 2 >= 8 images
