import numpy as np
import pytest
import torch

from yolofast.data import collate_fn, pad_targets


def _manual_pad(batch_idx, cls, bboxes, b, bucket=16):
    counts = [int((batch_idx == i).sum()) for i in range(b)]
    mp = bucket * max(int(np.ceil(max(counts + [0]) / bucket)), 1)
    gc, gb, gm = torch.zeros(b, mp, 1), torch.zeros(b, mp, 4), torch.zeros(b, mp, 1)
    fill = [0] * b
    for j in range(len(batch_idx)):
        i = int(batch_idx[j])
        gc[i, fill[i]] = cls[j]
        gb[i, fill[i]] = bboxes[j]
        gm[i, fill[i]] = 1
        fill[i] += 1
    return gc, gb, gm


@pytest.mark.parametrize("n,b", [(0, 3), (1, 1), (16, 1), (17, 2), (40, 5)])
def test_pad_targets_matches_loop(n, b):
    g = torch.Generator().manual_seed(n)
    batch_idx = torch.randint(0, b, (n,), generator=g).float()  # unsorted on purpose
    if n >= 16 and b == 1:
        batch_idx.zero_()
    cls = torch.randint(0, 80, (n, 1), generator=g).float()
    bboxes = torch.rand(n, 4, generator=g)
    got = pad_targets(batch_idx, cls, bboxes, b)
    want = _manual_pad(batch_idx, cls, bboxes, b)
    for x, y in zip(got, want):
        assert x.dtype == torch.float32
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_pad_bucket_sizes():
    for n, mp in [(0, 16), (1, 16), (16, 16), (17, 32), (33, 48)]:
        gc, gb, gm = pad_targets(torch.zeros(n), torch.zeros(n, 1), torch.zeros(n, 4), 2)
        assert gc.shape == (2, mp, 1) and gb.shape == (2, mp, 4) and gm.shape == (2, mp, 1)
        assert gm.sum() == n
    gc, _, _ = pad_targets(torch.zeros(5), torch.zeros(5, 1), torch.zeros(5, 4), 1, bucket=4)
    assert gc.shape == (1, 8, 1)


def test_pad_rejects_bad_index():
    with pytest.raises(ValueError, match="batch_size"):
        pad_targets(torch.tensor([0.0, 3.0]), torch.zeros(2, 1), torch.zeros(2, 4), 2)


def _sample(n, s=32, name="a.jpg"):
    return {"img": torch.full((3, s, s), n, dtype=torch.uint8), "cls": torch.arange(n).float().view(-1, 1),
            "bboxes": torch.rand(n, 4), "im_file": name, "ori_shape": (s, s + 1), "resized_shape": (s, s),
            "ratio_pad": None}


def test_collate_shapes_dtypes_and_empty_image():
    batch = collate_fn([_sample(2, name="a"), _sample(0, name="b"), _sample(3, name="c")])
    assert batch["img"].shape == (3, 3, 32, 32) and batch["img"].dtype == torch.uint8
    assert batch["batch_idx"].tolist() == [0, 0, 2, 2, 2] and batch["batch_idx"].dtype == torch.float32
    assert batch["cls"].shape == (5, 1) and batch["cls"].dtype == torch.float32
    assert batch["bboxes"].shape == (5, 4) and batch["bboxes"].dtype == torch.float32
    assert batch["im_file"] == ["a", "b", "c"] and batch["ori_shape"] == [(32, 33)] * 3
    assert batch["gt_cls"].shape == (3, 16, 1) and batch["gt_bboxes"].shape == (3, 16, 4)
    assert batch["gt_mask"][:, :, 0].sum(1).tolist() == [2, 0, 3]
    torch.testing.assert_close(batch["gt_bboxes"][2, :3], batch["bboxes"][2:])
    assert batch["gt_cls"][2, :3, 0].tolist() == [0, 1, 2]


def test_collate_all_empty():
    batch = collate_fn([_sample(0), _sample(0)])
    assert batch["cls"].shape == (0, 1) and batch["bboxes"].shape == (0, 4)
    assert batch["batch_idx"].shape == (0,)
    assert batch["gt_mask"].shape == (2, 16, 1) and batch["gt_mask"].sum() == 0
