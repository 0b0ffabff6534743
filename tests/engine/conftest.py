import pytest
import torch


@pytest.fixture(autouse=True)
def _restore_determinism():
    # The trainer turns on torch.use_deterministic_algorithms (deterministic=True): keep other tests clean.
    yield
    torch.use_deterministic_algorithms(False)



@pytest.fixture
def resume_after_crash():
    """``resume_after_crash(recipe) -> Trainer``: trains ``recipe`` as run "cut" until epoch 1 is saved,
    crashes there (KeyboardInterrupt from on_fit_epoch_end), and returns a Trainer resumed from its
    last.pt, not yet trained."""
    from yolofast import Trainer
    from yolofast.engine.checkpoint import load_checkpoint

    def run(recipe: dict):
        def crash(trainer):
            if trainer.epoch == 0:
                raise KeyboardInterrupt("simulated crash after epoch 1 was saved")

        t = Trainer(name="cut", **recipe)
        t.add_callback("on_fit_epoch_end", crash)
        with pytest.raises(KeyboardInterrupt):
            t.train()
        last = t.save_dir / "weights" / "last.pt"
        assert load_checkpoint(last)["epoch"] == 0
        return Trainer(resume=str(last), verbose=False)

    return run
