"""Lightning, by the rule of transformers' resume tests (issue 16): a fit resumed from a mid
``ModelCheckpoint`` file ends with the guard state of the uninterrupted fit, and the file it resumed
from stays in the rollback tier. Plus the resume paths without a usable guard state (issue 12)."""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch

L = pytest.importorskip("lightning.pytorch")

import gradguard as gg  # noqa: E402
from gradguard.lightning import GradGuardCallback  # noqa: E402
from tests.test_lightning import LitGPT, cfg, flat, loader  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def fit(tmp_path, cb, steps: int = 10, ckpt_path=None, every: int = 5, **module_kw):
    """5 batches an epoch: the checkpoint of step 5 is written at the epoch's end (Lightning resumes a
    plain DataLoader exactly only from there)."""
    m = LitGPT(sched="step", **module_kw)
    mc = L.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=every, save_top_k=-1)
    t = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=[c for c in (cb, mc) if c is not None],
                  logger=False, enable_progress_bar=False, enable_model_summary=False,
                  default_root_dir=str(tmp_path), num_sanity_val_steps=0)
    t.fit(m, loader(8, 40), ckpt_path=ckpt_path)
    return m, t


def ckpt(tmp_path, step: int) -> str:
    return glob.glob(str(tmp_path / "ck" / f"*step={step}.ckpt"))[0]


def same(a, b) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


@pytest.mark.parametrize("preset, faults", [("default", {"spike_at": {3, 4}}), ("monitor", {})])
def test_resumed_fit_ends_with_the_uninterrupted_fits_guard_state(tmp_path, preset, faults):
    cb = GradGuardCallback(cfg(tmp_path, preset))
    m1, _ = fit(tmp_path, cb, **faults)
    if faults:
        assert cb.core.action_counts  # a non-trivial state crosses the resume
    want = cb.state_dict()
    path5 = ckpt(tmp_path, 5)
    # the file lists itself: Lightning collects callbacks' state before on_save_checkpoint
    saved = torch.load(path5, weights_only=True)["callbacks"][cb.state_key]["core"]
    assert [(e["step"], e["path"]) for e in saved["checkpoints"]] == [(5, path5)]
    os.remove(ckpt(tmp_path, 10))  # the run died after step 5; the resumed one writes step 10 again

    cb2 = GradGuardCallback(cfg(tmp_path, preset))
    m2, _ = fit(tmp_path, cb2, ckpt_path=path5, **faults)  # faults at steps 3, 4 are not run again
    assert torch.equal(flat(m1), flat(m2))
    assert same(cb2.state_dict(), want)  # the whole guard state, the rollback tier included
    assert [e["step"] for e in cb2.core.checkpoint_tier.state_dict()] == [5, 10]


def test_unusable_guard_state_is_an_error_when_acting_and_a_fresh_guard_in_monitor_mode(tmp_path):
    for preset in ("default", "monitor"):
        out = tmp_path / preset
        cb = GradGuardCallback(cfg(out, preset))
        fit(out, cb, steps=5)
        path = ckpt(out, 5)
        data = torch.load(path, weights_only=True)
        data["callbacks"][cb.state_key]["core"]["step_count"] = -3  # garbled
        torch.save(data, path)
        cb2 = GradGuardCallback(cfg(out, preset))
        if preset == "default":
            with pytest.raises(gg.StateError, match=r"step_count=-3.*Fix"):
                fit(out, cb2, steps=7, ckpt_path=path)
            assert cb2.core is None  # nothing of the guard left attached
        else:
            with pytest.warns(gg.GradGuardWarning, match="step_count=-3.*fresh guard state"):
                _, t = fit(out, cb2, steps=7, ckpt_path=path)
            assert t.global_step == 7 and cb2.core.step_count == 7 and cb2.core.applied_steps == 2


def test_callback_added_on_resume_numbers_steps_as_lightning(tmp_path):
    fit(tmp_path, None, steps=5)  # no guard in the first fit
    cb = GradGuardCallback(cfg(tmp_path))
    _, t = fit(tmp_path, cb, steps=10, ckpt_path=ckpt(tmp_path, 5))
    assert cb.core.step_count == t.global_step == 10 and cb.core.applied_steps == 5
    assert [e["step"] for e in cb.core.checkpoint_tier.state_dict()] == [10]
