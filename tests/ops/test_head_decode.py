"""head_decode (the assigner's inputs decoded from the head's maps: sigmoid scores, xyxy pixel boxes):
the C++ kernel and its ``.boxes`` variant against the reference decode, and the public wrapper on each
backend."""

from __future__ import annotations

import pytest
import torch
from op_inputs import make_maps

from yolofast.boxes import make_anchors
from yolofast.ops import reference
from yolofast.ops._backend import backend
from yolofast.ops.bbox_loss import maps_to_rows


def ref_decode(feats, strides, reg_max):
    pd, ps = maps_to_rows([f.double() for f in feats], reg_max)
    anc, st = make_anchors([f.double() for f in feats], strides)
    return ps.sigmoid(), reference.bbox_decode(pd, anc) * st


@pytest.mark.parametrize("seed", range(4))
def test_head_decode_matches_reference(lib, seed):
    g = torch.Generator().manual_seed(seed)
    sizes = [(int(torch.randint(1, 30, (1,), generator=g)), int(torch.randint(1, 30, (1,), generator=g)))
             for _ in range(3)]
    feats, *_ = make_maps(2, 17, sizes, seed, reg_max=16)
    scores, boxes = lib.head_decode(feats, (8, 16, 32), 16)
    want_s, want_b = ref_decode(feats, (8, 16, 32), 16)
    assert scores.dtype == boxes.dtype == torch.float32
    torch.testing.assert_close(scores.double(), want_s, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(boxes.double(), want_b, rtol=1e-6, atol=1e-4)  # px: ~1e-6 of 640
    s64, b64 = lib.head_decode([f.double() for f in feats], (8, 16, 32), 16)
    torch.testing.assert_close(s64, want_s, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(b64, want_b, rtol=1e-13, atol=1e-11)
    with backend("ref"):
        from yolofast.ops import head_decode

        rs, rb = head_decode(feats, (8, 16, 32), 16)
    torch.testing.assert_close(rs, scores, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(rb, boxes, rtol=1e-6, atol=1e-4)


def test_head_decode_boxes_alone(lib):
    """head_decode.boxes (the loss's decode: its assigner reads the logits itself) gives head_decode's boxes
    bit for bit, in both dtypes and on strided maps; the public wrapper's scores=False agrees on both
    backends."""
    from yolofast.ops import head_decode

    feats, *_ = make_maps(2, 7, [(9, 7), (5, 4), (3, 2)], 21, reg_max=16)
    for fs in (feats, [f.double() for f in feats], [f.to(memory_format=torch.channels_last) for f in feats]):
        _, want = lib.head_decode(fs, (8, 16, 32), 16)
        got = torch.ops.yolofast.head_decode.boxes(fs, [8.0, 16.0, 32.0], 16)
        assert got.dtype == want.dtype and torch.equal(got, want)
    for name in ("cpp", "ref"):
        with backend(name):
            s, b = head_decode(feats, (8, 16, 32), 16, scores=False)
        assert s is None
        if name == "cpp":
            assert torch.equal(b, want)
        else:
            torch.testing.assert_close(b, want, rtol=1e-6, atol=1e-4)
    torch.library.opcheck(torch.ops.yolofast.head_decode.boxes, (feats, [8.0, 16.0, 32.0], 16))


def test_head_decode_reg_max_1_is_the_composed_form_bit_for_bit(lib):
    """reg_max 1 (YOLO26: the four channels are the distances, possibly negative): the C++ decode and its
    ``.boxes`` give the composed form's values bit for bit (same operations: the box in grid units, then x
    stride), in both dtypes and on strided maps; the public wrapper routes reg_max 1 to the C++ form."""
    from yolofast.ops import _composed, head_decode

    feats, *_ = make_maps(2, 7, [(9, 7), (5, 4), (3, 2)], 22, reg_max=1)
    feats = [f * 4 for f in feats]  # distances of a few cells, negative ones included
    for fs in (feats, [f.double() for f in feats], [f.to(memory_format=torch.channels_last) for f in feats]):
        want_s, want_b = _composed.head_decode(fs, (8, 16, 32), 1)
        s, b = lib.head_decode(fs, (8, 16, 32), 1)
        assert torch.equal(b, want_b)
        torch.testing.assert_close(s, want_s, rtol=1e-6, atol=1e-7)  # the sigmoid as for reg_max 16
        assert torch.equal(torch.ops.yolofast.head_decode.boxes(fs, [8.0, 16.0, 32.0], 1), want_b)
    with backend("cpp"):
        _, b = head_decode(feats, (8, 16, 32), 1, scores=False)
    assert torch.equal(b, _composed.head_decode_boxes(feats, (8, 16, 32), 1))
    torch.library.opcheck(torch.ops.yolofast.head_decode.boxes, (feats, [8.0, 16.0, 32.0], 1))
