"""Mosaic companions from the buffer of recently decoded images (Ultralytics' rule), seeded and resumable."""

import numpy as np
import torch

from yolofast.data import build_dataset


def _set(tmp_path, split_factory, n=40):
    return str(split_factory(tmp_path, {f"im{i:02d}": f"{i % 3} 0.5 0.5 0.5 0.5\n" for i in range(n)}))


def _count_decodes(ds):
    calls = []
    read = ds._read

    def counted(i):
        calls.append(i)
        return read(i)

    ds._read = counted
    return calls


def test_buffer_size_rule_and_one_decode_per_mosaic(tmp_path, split_factory):
    src = _set(tmp_path, split_factory)
    assert build_dataset(src, imgsz=64, nc=3, batch_size=2).max_buffer == 16  # 8 batches
    assert build_dataset(src, imgsz=64, nc=3, batch_size=16).max_buffer == 40  # all images
    assert build_dataset(src, imgsz=64, nc=3, augment=False).max_buffer == 0  # val: no buffer
    ds = build_dataset(src, imgsz=64, nc=3, batch_size=2, hyp=dict(mosaic=1.0))
    calls = _count_decodes(ds)
    for i in range(30):
        ds[i]
        assert len(ds.buffer) == min(i + 1, 16) and set(ds._recent) == set(ds.buffer)
        assert set(ds._norm_xyxy) <= set(ds.buffer)  # box corners are kept only while their image is
        assert ds.buffer[-1] == i  # the newest decode joins last; the oldest left
    assert calls == list(range(30))  # one decode per mosaic sample: the 3 companions were in memory
    val = build_dataset(src, imgsz=64, nc=3, augment=False)
    for i in range(10):
        val[i]
    assert not val._norm_xyxy  # no buffer: nothing kept


def test_companions_come_from_the_buffer_uniformly(tmp_path, split_factory):
    ds = build_dataset(_set(tmp_path, split_factory), imgsz=64, nc=3, batch_size=1, hyp=dict(mosaic=1.0))
    seen = []
    orig = ds._mosaic_companions
    ds._mosaic_companions = lambda rng: seen.append((list(ds.buffer), c := orig(rng))) or c
    for i in range(400):
        ds[i % len(ds)]
    counts = np.zeros(8)
    for buf, comp in seen:
        assert set(comp) <= set(buf)  # never an image outside the buffer (the current one is in it)
        if len(buf) == 8:
            for c in comp:
                counts[buf.index(c)] += 1
    # uniform with replacement over the 8 slots: each expects 1/8 of ~1180 draws (chi-square, 7 dof, p~1e-4)
    exp = counts.sum() / 8
    assert ((counts - exp) ** 2 / exp).sum() < 29


def test_same_seed_same_samples_and_resume_from_buffer_state(tmp_path, split_factory):
    src = _set(tmp_path, split_factory)
    a = build_dataset(src, imgsz=64, nc=3, batch_size=1)
    for i in range(12):
        a[i]
    state, buf = a.rng.bit_generator.state, a.buffer_state()
    rest = [a[i] for i in range(12, 20)]
    b = build_dataset(src, imgsz=64, nc=3, batch_size=1)  # a resumed process: nothing decoded yet
    b.rng.bit_generator.state = state
    b.set_buffer_state(buf)
    for x, y in zip(rest, (b[i] for i in range(12, 20))):
        assert torch.equal(x["img"], y["img"]) and torch.equal(x["bboxes"], y["bboxes"])
    a.reseed(5)
    assert a.buffer_state() == []  # a fresh stream starts with an empty buffer


def test_ram_cache_draws_from_the_whole_set(tmp_path, split_factory):
    ds = build_dataset(_set(tmp_path, split_factory), imgsz=64, nc=3, batch_size=1, cache="ram")
    calls = _count_decodes(ds)
    for i in range(10):
        ds[i]
    assert calls == [] and ds.buffer == []
