"""GradGuardCallback recovery actions on a real Lightning Trainer (CPU, tiny GPT, a few steps each):
live batch shrink/grow, out-of-memory retry, rollback from a ModelCheckpoint file, fp16 scale."""

from __future__ import annotations

import copy
import math
import os
import pickle

import pytest
import torch

L = pytest.importorskip("lightning.pytorch")

import gradguard as gg  # noqa: E402
from gradguard.lightning import GradGuardCallback  # noqa: E402
from tests.test_lightning import LitGPT, Windows, cfg, events, flat  # noqa: E402


class IdxWindows(Windows):
    """Byte windows that also return their index, to check which samples each epoch saw."""

    def __getitem__(self, i: int):
        x, y = super().__getitem__(i)
        return x, y, i


class Rec(LitGPT):
    """LitGPT that records every micro-batch it computes (step, epoch, index in epoch, samples)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.seen: list[dict] = []

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        self.seen.append({"step": self._gstep(), "epoch": self.current_epoch, "bi": batch_idx,
                          "n": int(x.shape[0]), "idx": idx.tolist(), "acc": self.trainer.accumulate_grad_batches})
        return super().training_step((x, y), batch_idx)

    def sizes(self, step: int) -> list[int]:
        return [r["n"] for r in self.seen if r["step"] == step]


def trainer_for(tmp_path, callbacks, steps: int, **kw):
    kw.setdefault("enable_checkpointing", False)
    return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=list(callbacks), logger=False,
                     enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                     num_sanity_val_steps=0, **kw)


def idx_loader(bs: int, n: int, **kw):
    return torch.utils.data.DataLoader(IdxWindows(n), batch_size=bs, shuffle=False, **kw)


class Reports(L.Callback):
    """Keeps the guard's report of every step (runs after the guard's hook)."""

    def __init__(self, cb) -> None:
        self.cb, self.r = cb, {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.r[trainer.global_step + 1] = self.cb.last_report


def actions(cb, name: str) -> list[dict]:
    return [e for e in events(cb.core.log_path) if e["type"] == "action" and e["name"] == name]


# -- 1. live batch shrink / grow ------------------------------------------------------------------
def test_global_shrink_scales_lr_grows_back_with_tight_clip_and_keeps_the_epoch_whole(tmp_path):
    m = Rec(spike_at={3, 4})  # an isolated spike is skipped; the repeat climbs to the shrink_batch rung
    c = cfg(tmp_path, policy={"ladder": [["shrink_batch"]]},
            recovery={"snapshot_interval": 0, "grow_after": 4, "grow_clip": 0.1, "grow_clip_steps": 3})
    cb = GradGuardCallback(c)
    keep = Reports(cb)
    trainer = trainer_for(tmp_path, [cb, keep], steps=18)
    trainer.fit(m, idx_loader(8, 64))  # 8 batches of 8 per epoch
    shrink, grow = actions(cb, "shrink_batch"), actions(cb, "grow_batch")
    assert len(shrink) == 1 and shrink[0]["step"] == 4 and shrink[0]["params"]["batch"] == [8, 4]
    assert len(grow) == 1 and grow[0]["step"] == 8 and grow[0]["params"]["batch"] == [4, 8]
    assert [m.sizes(s)[0] for s in range(1, 13)] == [8] * 4 + [4] * 4 + [8] * 4
    # the LR the optimizer used: scaled linearly while the batch is halved, then back
    for s in (5, 6, 7, 8):
        assert m.step_lrs[s][0] == pytest.approx(m.base_lr[s] * 0.5)
    for s in (3, 9, 12):
        assert m.step_lrs[s][0] == pytest.approx(m.base_lr[s])
    # after the growth max_grad_norm is held at grow_clip for grow_clip_steps
    for s in (9, 10, 11):
        assert keep.r[s].clip_to == 0.1 and m.post_clip_norm[s] <= 0.1 + 1e-4
    assert keep.r[12].clip_to == 1.0
    # the epoch neither ended early nor overran: every sample exactly once, in 4 + 4 + 2 batches
    ep0 = [r for r in m.seen if r["epoch"] == 0]
    assert [r["n"] for r in ep0] == [8] * 4 + [4] * 4 + [8] * 2
    assert sorted(i for r in ep0 for i in r["idx"]) == list(range(64))
    ep1 = [r for r in m.seen if r["epoch"] == 1]
    assert [r["n"] for r in ep1] == [8] * 8 and sorted(i for r in ep1 for i in r["idx"]) == list(range(64))
    assert trainer.num_training_batches == 8 and trainer.global_step == 18
    assert all(math.isfinite(float(v)) for v in flat(m))


def test_micro_shrink_halves_the_loader_and_doubles_accumulation_at_an_aligned_boundary(tmp_path):
    m = Rec(spike_at={4, 5})  # (a jump at step 2, over a single earlier loss, is held for the next one)
    c = cfg(tmp_path, policy={"ladder": [["shrink_batch"]]},
            recovery={"snapshot_interval": 0, "shrink_mode": "micro"})
    cb = GradGuardCallback(c)
    keep = Reports(cb)
    trainer = trainer_for(tmp_path, [cb, keep], steps=8, accumulate_grad_batches=2)
    trainer.fit(m, idx_loader(8, 256))
    act = actions(cb, "shrink_batch")
    assert len(act) == 1 and act[0]["step"] == 5
    assert act[0]["params"]["micro_batch"] == [8, 4] and act[0]["params"]["accumulation"] == 4
    # decided after batch 10 (not a multiple of 4): step 6 still runs 2 x 8, then 4 x 4 from batch 13
    assert [m.sizes(s) for s in range(1, 9)] == [[8, 8]] * 6 + [[4, 4, 4, 4]] * 2
    assert trainer.accumulate_grad_batches == 4
    assert all(sum(m.sizes(s)) == 16 for s in range(1, 9))  # the global batch is kept
    assert cb.core.lr.batch_scale == 1.0 and m.step_lrs[7][0] == pytest.approx(m.base_lr[7])
    # the guard's step loss is the mean over the new micro-batches (Lightning's 1/4 undone)
    assert keep.r[7].loss == pytest.approx(sum(m.micro_losses[-8:-4]) / 4, rel=1e-5)
    # 12 batches of 8 were drawn, the 160 samples left make 40 batches of 4
    assert trainer.num_training_batches == 52
    assert all(math.isfinite(float(v)) for v in flat(m))


def test_drop_last_loader_is_resized_live_and_the_next_epoch_keeps_the_size(tmp_path):
    m = Rec(spike_at={3, 4})
    c = cfg(tmp_path, policy={"ladder": [["shrink_batch"]]}, recovery={"snapshot_interval": 0})
    cb = GradGuardCallback(c)
    trainer = trainer_for(tmp_path, [cb], steps=14)
    trainer.fit(m, idx_loader(8, 60, drop_last=True))  # 7 batches of 8 per epoch, 4 samples dropped
    ep0 = [r["n"] for r in m.seen if r["epoch"] == 0]
    assert ep0 == [8] * 4 + [4] * 7  # 28 samples were left after step 4: 7 batches of 4
    assert [r["n"] for r in m.seen if r["epoch"] == 1] == [4] * 3
    assert trainer.num_training_batches == 15  # the second epoch: 60 // 4


def test_resume_keeps_the_shrunk_batch_and_its_lr_scale(tmp_path):
    c = cfg(tmp_path, policy={"ladder": [["shrink_batch"]]}, recovery={"snapshot_interval": 0})
    m = Rec(spike_at={3, 4})
    cb = GradGuardCallback(c)
    t1 = trainer_for(tmp_path, [cb], steps=6)
    t1.fit(m, idx_loader(8, 256))
    ckpt = str(tmp_path / "a.ckpt")
    t1.save_checkpoint(ckpt)
    m2 = Rec()
    cb2 = GradGuardCallback(c)
    t2 = trainer_for(tmp_path, [cb2], steps=9)
    t2.fit(m2, idx_loader(8, 256), ckpt_path=ckpt)
    assert [m2.sizes(s) for s in (7, 8, 9)] == [[4]] * 3
    assert cb2.core.lr.batch_scale == 0.5 and m2.step_lrs[8][0] == pytest.approx(m2.base_lr[8] * 0.5)
    assert cb2.batches.base_batch_size == 8
    # the same checkpoint resumed with another batch size (the user's change): theirs stands, full LR
    m3, cb3 = Rec(), GradGuardCallback(c)
    t3 = trainer_for(tmp_path, [cb3], steps=9)
    t3.fit(m3, idx_loader(16, 256), ckpt_path=ckpt)
    assert [m3.sizes(s) for s in (7, 8, 9)] == [[16]] * 3
    assert cb3.core.lr.batch_scale == 1.0 and cb3.batches.base_batch_size == 16


# -- 2. out of memory ---------------------------------------------------------------------------
class OOMAbove:
    """Raises torch.OutOfMemoryError from a hook when the batch is larger than ``limit`` (from ``start``)."""

    def __init__(self, module: LitGPT, limit: int, start: int, where: str = "forward") -> None:
        self.m, self.limit, self.start, self.ok = module, limit, start, []
        if where == "forward":
            module.model.register_forward_pre_hook(self.forward)
        else:
            module.model.lm_head.register_full_backward_pre_hook(self.backward)

    def _fire(self, n: int) -> bool:
        return self.m._trainer is not None and self.m._gstep() >= self.start and n > self.limit

    def forward(self, module, args):
        n = args[0].shape[0]
        if self._fire(n):
            raise torch.OutOfMemoryError(f"fake: {n} samples > {self.limit}")
        self.ok.append(n)

    def backward(self, module, grad_output):
        n = grad_output[0].shape[0]
        if self._fire(n):
            raise torch.OutOfMemoryError(f"fake backward: {n} samples > {self.limit}")


def test_forward_oom_is_retried_in_halves_then_the_loader_micro_batch_halves(tmp_path):
    ref = Rec()
    ref_cb = GradGuardCallback(cfg(tmp_path / "ref"))
    ref_r = Reports(ref_cb)
    trainer_for(tmp_path / "ref", [ref_cb, ref_r], steps=8).fit(ref, idx_loader(8, 256))
    m = Rec()
    hook = OOMAbove(m, limit=4, start=3)
    cb = GradGuardCallback(cfg(tmp_path))
    keep = Reports(cb)
    trainer = trainer_for(tmp_path, [cb, keep], steps=8)
    trainer.fit(m, idx_loader(8, 256))
    shrink, retry = actions(cb, "oom_shrink_micro"), actions(cb, "oom_retry")
    assert len(shrink) == 1 and shrink[0]["step"] == 3
    assert shrink[0]["params"]["micro_batch"] == [8, 4] and shrink[0]["params"]["pieces"] == 2
    assert len(retry) == 1 and retry[0]["step"] == 4  # batch 4 was drawn before an aligned boundary
    assert max(hook.ok[2:]) <= 4  # no forward larger than the limit ran from step 3 on
    # steps 3 and 4: the 8 samples failed, then ran in two pieces; from batch 5 the loader gives 4, two per step
    assert [m.sizes(s) for s in (2, 3, 4, 5, 6)] == [[8], [8, 4, 4], [8, 4, 4], [4, 4], [4, 4]]
    assert trainer.accumulate_grad_batches == 2 and trainer.global_step == 8
    assert cb.core.skipped_steps == 0 and cb.core.step_count == 8
    # nothing was lost or counted twice: the same samples (64), the same updates as a run without OOM
    done = [i for r in m.seen if not (r["step"] >= 3 and r["n"] > 4) for i in r["idx"]]
    assert done == list(range(64)) == [i for r in ref.seen for i in r["idx"]]
    for step in range(1, 9):  # the pieces' losses and gradients are weighted by their share: same as one pass
        assert keep.r[step].loss == pytest.approx(ref_r.r[step].loss, rel=1e-5)
        assert keep.r[step].total_norm == pytest.approx(ref_r.r[step].total_norm, rel=1e-3)
    assert torch.allclose(flat(m), flat(ref), atol=2e-4)  # Adam amplifies float rounding on tiny gradients


def test_backward_oom_retries_the_first_micro_batch_and_skips_a_step_it_cannot_undo(tmp_path):
    m = Rec()
    OOMAbove(m, limit=4, start=3, where="backward")
    cb = GradGuardCallback(cfg(tmp_path, recovery={"snapshot_interval": 0}))
    trainer = trainer_for(tmp_path, [cb], steps=6, accumulate_grad_batches=2)
    trainer.fit(m, idx_loader(8, 256))
    names = [e["name"] for e in events(cb.core.log_path) if e["type"] == "action"]
    # step 3: the first micro-batch is retried in halves (exact); the second fails after gradients
    # of the first are in place: the step is skipped. Step 4 the same (batch 8 still drawn at 8).
    assert names.count("oom_shrink_micro") == 1 and names.count("oom_retry") == 1
    assert names.count("oom_skip_step") == 2
    assert torch.equal(m.params[2], m.params[4])  # the two broken steps changed nothing
    assert not torch.equal(m.params[4], m.params[5])
    assert cb.core.skipped_steps == 2 and cb.core.step_count == trainer.global_step == 6
    assert m.sizes(5) == [4, 4, 4, 4] and trainer.accumulate_grad_batches == 4
    assert m.rec[6]["adam_step"] == 4  # steps 1, 2, 5, 6
    assert all(math.isfinite(float(v)) for v in flat(m))


def test_oom_with_a_single_sample_is_raised(tmp_path):
    m = Rec()
    OOMAbove(m, limit=0, start=2)
    cb = GradGuardCallback(cfg(tmp_path))
    with pytest.raises(torch.OutOfMemoryError, match="1 samples"):
        trainer_for(tmp_path, [cb], steps=4).fit(m, idx_loader(1, 16))
    assert "training_step" not in vars(m)  # the wrapper is gone


# -- 3. rollback from a ModelCheckpoint file ----------------------------------------------------------
def test_rollback_restores_the_newest_healthy_modelcheckpoint_file(tmp_path):
    m = LitGPT(sched="step", spike_at={10, 11})
    c = cfg(tmp_path, recovery={"snapshot_interval": 0, "confirm_steps": 2})
    cb = GradGuardCallback(c)
    ckpt_dir = tmp_path / "ckpts"
    mc = L.callbacks.ModelCheckpoint(dirpath=str(ckpt_dir), every_n_train_steps=3, save_top_k=-1)
    detectors = {}

    class Det(L.Callback):  # after the guard's hook: the detector state the step leaves behind
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            detectors[trainer.global_step + 1] = copy.deepcopy(cb.core.detectors.state_dict())

    trainer = trainer_for(tmp_path, [cb, Det(), mc], steps=14, enable_checkpointing=True)
    trainer.fit(m, torch.utils.data.DataLoader(Windows(256), batch_size=8))
    rb = actions(cb, "rollback")
    assert len(rb) == 1 and rb[0]["step"] == 11
    p = rb[0]["params"]
    # step 9's file came right before the spike at step 10: never used; step 6's was tested by 7 and 8
    assert p["source"] == "checkpoint" and p["to_step"] == 6 and p["steps_lost"] == 4
    assert os.path.basename(p["path"]) == "epoch=0-step=6.ckpt"
    ckpt = torch.load(p["path"], weights_only=False)
    sd = ckpt["state_dict"]
    from_file = torch.cat([sd[n].reshape(-1) for n, _ in m.named_parameters()])
    assert torch.equal(m.params[11], from_file)  # bitwise, before the next update
    assert m.rec[11]["adam_step"] == 6  # the optimizer state came back too
    saved_det = dict(ckpt["callbacks"][cb.state_key]["core"]["detectors"])
    restored = dict(detectors[11])
    # the norm-takeover window starts afresh on restored weights (every rollback, every tier)
    assert restored.pop("takeover")["window"] == [] and saved_det.pop("takeover") is not None
    assert restored == saved_det != {k: v for k, v in detectors[10].items() if k != "takeover"}  # and the detectors
    assert m.rec[11]["lr"] == m.rec[10]["lr"] != m.rec[6]["lr"]  # the LR schedule kept its position
    assert not torch.equal(m.params[11], m.params[12])
    assert trainer.global_step == 14 and all(math.isfinite(float(v)) for v in flat(m))
    # the tracked files travel in the callback's checkpoint state, the file itself included (step 9's
    # entry went with the rollback to step 6)
    later = torch.load(str(ckpt_dir / "epoch=0-step=12.ckpt"), weights_only=False)
    entry = later["callbacks"][cb.state_key]
    assert "checkpoints" not in entry  # one copy of the trust tier: the core's
    tracked = entry["core"]["checkpoints"]
    assert [(e["step"], e["tested"], e["bad"]) for e in tracked] == [(3, True, False), (6, True, False),
                                                                     (12, False, False)]
    assert tracked[-1]["path"] == str(ckpt_dir / "epoch=0-step=12.ckpt")


class _Planted:
    """An object whose unpickling would create a folder: proof that a file was (or was not) unpickled."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def test_a_checkpoint_holding_pickled_objects_is_skipped_not_executed(tmp_path):
    m = LitGPT(sched="step", spike_at={10, 11})
    cb = GradGuardCallback(cfg(tmp_path, recovery={"snapshot_interval": 0, "confirm_steps": 2}))
    ckpt_dir = tmp_path / "ckpts"
    marker = tmp_path / "EXECUTED"
    mc = L.callbacks.ModelCheckpoint(dirpath=str(ckpt_dir), every_n_train_steps=3, save_top_k=-1)
    target = ckpt_dir / "epoch=0-step=6.ckpt"

    class Tamper(L.Callback):  # after step 6's file is written and trusted: plant an object in it
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 9 and not getattr(self, "done", False):
                self.done = True
                ckpt = torch.load(str(target), weights_only=True)  # the genuine file loads safely
                ckpt["hyper_parameters"] = {"planted": _Planted(str(marker))}
                torch.save(ckpt, str(target))

    trainer = trainer_for(tmp_path, [cb, Tamper(), mc], steps=14, enable_checkpointing=True)
    trainer.fit(m, torch.utils.data.DataLoader(Windows(256), batch_size=8))
    assert not marker.exists()  # never unpickled
    fb = [e for e in events(cb.core.log_path) if e["type"] == "snapshot_fallback"]
    assert len(fb) == 1 and fb[0]["wanted"] == 6 and fb[0]["path"] == str(target)
    problem = fb[0]["problems"][0]  # refused before unpickling: by its fingerprint (its size changed) or weights_only
    assert str(target) in problem and ("changed since it was saved" in problem or "weights_only=True" in problem)
    rb = [e for e in events(cb.core.log_path) if e["type"] == "action" and e["name"] == "rollback"]
    assert rb[0]["params"]["to_step"] == 3 and rb[0]["params"]["source"] == "checkpoint"  # the next older file
    assert not marker.exists()
    with pytest.raises(pickle.UnpicklingError):  # the planted file really would not load safely
        torch.load(str(target), weights_only=True)


def test_no_logger_writes_no_package_shadowing_folder_in_the_working_directory(tmp_path, monkeypatch):
    """logger=False and no default_root_dir: Lightning's root is the working directory, where
    gradguard writes nothing (one warning says how to name a folder); a ./gradguard folder there
    would also shadow the package."""
    monkeypatch.chdir(tmp_path)
    cb = GradGuardCallback(cfg(tmp_path, output={"dir": None}))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, callbacks=[cb], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    with pytest.warns(gg.GradGuardWarning, match="no event log for this Lightning run"):
        trainer.fit(LitGPT(), torch.utils.data.DataLoader(Windows(64), batch_size=8))
    assert os.listdir(tmp_path) == [] and cb.core.log_path is None
    # the same run with the working directory named explicitly: ./gradguard_runs/, never ./gradguard/
    cb = GradGuardCallback(cfg(tmp_path, output={"dir": None}), out_dir=str(tmp_path))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, callbacks=[cb], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(LitGPT(), torch.utils.data.DataLoader(Windows(64), batch_size=8))
    assert not (tmp_path / "gradguard").exists()
    assert cb.core.log_path == os.path.join(str(tmp_path), "gradguard_runs", "events.jsonl")
    assert os.path.isfile(cb.core.log_path)
    probe = __import__("subprocess").run(
        [__import__("sys").executable, "-c", "import gradguard; print(gradguard.GuardConfig.__name__)"],
        cwd=str(tmp_path), capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})
    assert probe.returncode == 0 and probe.stdout.strip() == "GuardConfig", probe.stderr[-500:]
