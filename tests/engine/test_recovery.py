"""Non-finite loss: skip the step, restore the last good state after 3 in a row, then a clear error."""

import copy
import re

import pytest
import torch

from yolofast import Trainer
from yolofast.data import make_shapes
from yolofast.engine.recovery import NonFiniteGuard, NonFiniteLossError
from yolofast.nn import YOLOV8

TINY = {k: v for k, v in copy.deepcopy(YOLOV8).items() if k != "scales"}
TINY.update(depth_multiple=0.33, width_multiple=0.125, max_channels=256)
# nbs=batch: accumulate 1, so every finite batch is exactly one optimizer + EMA step.
FAST = dict(model=TINY, imgsz=64, batch=2, nbs=2, workers=0, verbose=False, plots=False, val=False,
            mosaic=0.0, warmup_epochs=0.0)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """8 train + 2 val images of 64 px: 4 batches of 2 per epoch."""
    return str(make_shapes(root=tmp_path_factory.mktemp("shapes"), n_train=8, n_val=2, imgsz=64))



def _inject_nan(trainer, bad_calls):
    """Make the criterion return NaN on the given call numbers (0-based, counted over the whole run)."""
    calls = {"n": 0}

    def hook(t):
        crit = t.train_loss  # what the loop calls (the criterion, maybe compiled / world-size scaled)

        def poisoned(feats, batch):
            loss, items = crit(feats, batch)
            n = calls["n"]
            calls["n"] += 1
            if n in bad_calls:
                loss = loss * float("nan")
            return loss, items

        t.train_loss = poisoned

    trainer.add_callback("on_pretrain_routine_end", hook)


def test_nan_step_is_skipped_no_update(shapes, tmp_path):
    t = Trainer(data=shapes, epochs=1, project=tmp_path, name="skip", **FAST)
    _inject_nan(t, {1})
    steps = []
    t.add_callback("optimizer_step", lambda tr: steps.append(1))
    pattern = r"non-finite loss .* epoch 1 step 1: step skipped.*batch files: .*\.jpg"
    with pytest.warns(UserWarning, match=pattern):
        t.train()
    assert t.nonfinite.skipped == 1 and t.nonfinite.restores == 0
    assert len(steps) == 3  # 4 batches, one skipped: no optimizer step for it
    assert t.ema.updates == 3  # ... and no EMA update
    for p in t.model.parameters():
        assert torch.isfinite(p).all()


def test_three_in_a_row_restore_last_good_state(shapes, tmp_path):
    # Epoch 2 (calls 4..7): calls 5, 6, 7 are NaN -> restore to the start-of-epoch-2 state.
    t = Trainer(data=shapes, epochs=2, project=tmp_path, name="restore", **FAST)
    _inject_nan(t, {5, 6, 7})
    seen = {}

    def at_epoch_start(tr):
        if tr.epoch == 1:
            seen["w"] = {k: v.clone() for k, v in tr.model.state_dict().items()}
            seen["updates"] = tr.ema.updates

    t.add_callback("on_train_epoch_start", at_epoch_start)
    with pytest.warns(UserWarning, match="restored model, EMA, optimizer and scaler to the start of epoch 2"):
        t.train()
    assert t.nonfinite.restores == 1 and t.nonfinite.skipped == 3
    # the one good step of epoch 2 (call 4) was rolled back with the restore
    assert t.ema.updates == seen["updates"]
    for k, v in t.model.state_dict().items():
        torch.testing.assert_close(v, seen["w"][k], rtol=0, atol=0, msg=k)


def test_persistent_nan_ends_run_with_clear_error(shapes, tmp_path):
    t = Trainer(data=shapes, epochs=3, project=tmp_path, name="dead", **FAST)
    _inject_nan(t, set(range(4, 100)))  # epoch 1 good (last.pt written), NaN from epoch 2 on
    with pytest.warns(UserWarning), pytest.raises(NonFiniteLossError) as e:
        t.train()
    msg = str(e.value)
    assert re.search(r"stayed non-finite at epoch \d step \d", msg), msg
    assert str(t.last) in msg and "1 restore" in msg


def test_guard_unit_streak_resets():
    class Stub:
        pass

    g = NonFiniteGuard(Stub(), patience=3)
    ok, nan = torch.tensor(1.0), torch.tensor(float("nan"))
    with pytest.warns(UserWarning):
        assert not g.check(nan, {}, 0, 0)
        assert not g.check(torch.tensor(float("inf")), {}, 0, 1)
    assert g.check(ok, {}, 0, 2) and g.streak == 0
    with pytest.warns(UserWarning), pytest.raises(NonFiniteLossError, match="none written yet"):
        for s in range(3):  # no snapshot taken -> nothing to restore -> error on the third
            g.check(nan, {"im_file": ["a.jpg"]}, 0, 3 + s)
