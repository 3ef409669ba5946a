"""Found by transformers' own Trainer suite run with the callback attached (benchmarks/engine_suites):
``test_resume_training_with_different_batch_size`` (transformers issue 43708) and
``test_compare_trainer_and_checkpoint_args_logging`` resume a checkpoint with another
``per_device_train_batch_size``. The Trainer then trains with the new batch size; the guard's
restored state must not put the old one back (it did, in monitor mode too)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from gradguard.hf import GradGuardCallback  # noqa: E402
from tests.test_hf import cfg, make_trainer, tiny_gpt2  # noqa: E402


def _sizes(trainer) -> list[int]:
    sizes: list[int] = []
    trainer.model.register_forward_hook(
        lambda m, a, k, o: sizes.append(k["input_ids"].shape[0]) if m.training else None, with_kwargs=True)
    return sizes


@pytest.mark.parametrize("preset", ["none", "monitor", "default"])
def test_resume_with_a_new_batch_size_trains_with_the_new_batch_size(tmp_path, preset):
    def callbacks():
        return [] if preset == "none" else [GradGuardCallback(config=cfg(tmp_path, preset))]

    first = make_trainer(tmp_path, callbacks(), steps=2, per_device_train_batch_size=2, save_strategy="steps",
                         save_steps=1)
    first.train()
    model = tiny_gpt2()
    resumed = make_trainer(tmp_path, callbacks(), steps=4, model=model, per_device_train_batch_size=4,
                           save_strategy="steps", save_steps=1)
    sizes = _sizes(resumed)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-1"))
    assert resumed.state.global_step == 4
    assert sizes == [4, 4, 4], sizes  # steps 2..4 with the batch size of the resumed run's arguments
    assert torch.isfinite(next(model.parameters())).all()


@pytest.mark.parametrize("new_batch", [4, 8])
def test_a_shrunk_batch_resumes_shrunk_unless_the_batch_size_was_changed(tmp_path, new_batch):
    from tests.test_hf import inject

    conf = {"policy": {"ladder": [["shrink_batch"]]}, "recovery": {"snapshot_interval": 0, "grow_after": 100}}
    cb = GradGuardCallback(config=cfg(tmp_path, **conf))
    first = make_trainer(tmp_path, [cb], steps=6, save_strategy="steps", save_steps=6)
    inject(first, {4: 4.0, 5: 4.0})
    first.train()
    assert any(a.name == "shrink_batch" for r in cb.reports for a in r.actions)
    cb2 = GradGuardCallback(config=cfg(tmp_path, **conf))
    resumed = make_trainer(tmp_path, [cb2], steps=8, per_device_train_batch_size=new_batch, save_strategy="no")
    sizes = _sizes(resumed)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-6"))
    if new_batch == 4:  # same arguments: the guard's shrink (4 -> 2) and its LR scaling carry over
        assert sizes == [2, 2] and cb2.core.lr.batch_scale == 0.5
    else:  # the user changed the batch size: theirs stands, at full LR
        assert sizes == [8, 8] and cb2.core.lr.batch_scale == 1.0
