"""GradGuardCallback on a real Lightning Trainer (CPU, tiny byte-level GPT, a few steps each)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

L = pytest.importorskip("lightning.pytorch")

import gradguard as gg  # noqa: E402
from gradguard.config import LRConfig  # noqa: E402
from gradguard.demo_model import TinyGPT, load_corpus  # noqa: E402
from gradguard.lightning import GradGuardCallback  # noqa: E402

#: the LR cut for an instability before the run learned anything (the default config)
EARLY = LRConfig().early_down_factor

SEQ = 16
_CORPUS = load_corpus(60_000).long()


class Windows(torch.utils.data.Dataset):
    """Fixed byte windows of real text (deterministic)."""

    def __init__(self, n: int = 256, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, len(_CORPUS) - SEQ - 1, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int):
        c = _CORPUS[self.starts[i]: self.starts[i] + SEQ + 1]
        return c[:-1], c[1:]


def loader(bs: int = 8, n: int = 256):
    return torch.utils.data.DataLoader(Windows(n), batch_size=bs, shuffle=False)


def flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


class LitGPT(L.LightningModule):
    """TinyGPT with fault injection by guard step number (1-based) and per-step records."""

    def __init__(self, lr: float = 3e-3, sched: str | None = None, spike_at=(), spike=50.0, nan_at=(),
                 inf_at=(), grad_mult_at=(), grad_mult=30.0, manual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyGPT(n_layer=1, width=32, n_head=2, seq_len=SEQ)
        self.lr, self.sched = lr, sched
        self.spike_at, self.spike, self.nan_at, self.inf_at = set(spike_at), spike, set(nan_at), set(inf_at)
        self.grad_mult_at, self.grad_mult = set(grad_mult_at), grad_mult
        self.automatic_optimization = not manual
        self.micro_losses: list[float] = []
        self.rec: dict[int, dict] = {}
        self.step_lrs: dict[int, list[float]] = {}
        self.pre_clip: dict[int, dict[str, float]] = {}
        self.post_clip_norm: dict[int, float] = {}
        self.params: dict[int, torch.Tensor] = {}
        self.base_lr: dict[int, float] = {}

    def _gstep(self) -> int:
        return self.trainer.global_step + 1

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.model(x, y)
        self.micro_losses.append(float(loss.detach()))
        if self._gstep() in self.spike_at:
            loss = loss * self.spike
        self.log("train_loss", loss.detach(), on_step=True, prog_bar=False)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            return None
        return loss

    def on_after_backward(self):
        s = self._gstep()
        p = self.model.lm_head.weight
        if s in self.nan_at:
            p.grad[0, 0] = float("nan")
        if s in self.inf_at:
            p.grad[0, 0] = float("inf")
        if s in self.grad_mult_at:
            for q in self.parameters():
                if q.grad is not None:
                    q.grad.mul_(self.grad_mult)

    def on_train_start(self):
        self.params[0] = flat(self)

    def on_train_batch_start(self, batch, batch_idx):
        self.base_lr[self._gstep()] = float(self.trainer.optimizers[0].param_groups[0]["lr"])

    def on_before_optimizer_step(self, optimizer):  # runs after the callbacks' hook
        s = self._gstep()
        self.step_lrs[s] = [float(g["lr"]) for g in optimizer.param_groups]
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.post_clip_norm[s] = float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0

    def on_train_batch_end(self, outputs, batch, batch_idx):
        s = self.trainer.global_step
        opt = self.trainer.optimizers[0]
        st = [v.get("step") for v in opt.state.values()]
        sched = self.trainer.lr_scheduler_configs[0].scheduler if self.trainer.lr_scheduler_configs else None
        self.params[s] = flat(self)
        self.rec[s] = {"lr": [float(g["lr"]) for g in opt.param_groups],
                       "adam_step": float(st[0]) if st and st[0] is not None else 0.0,
                       "sched_epoch": getattr(sched, "last_epoch", None)}

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.999), eps=1e-8)
        if self.sched is None:
            return opt
        if self.sched == "step":
            s = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + 0.05 * k))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": s, "interval": "step"}}
        if self.sched == "epoch":
            s = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": s, "interval": "epoch"}}
        if self.sched == "plateau":
            s = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": s, "interval": "step",
                                                        "monitor": "train_loss"}}
        raise ValueError(self.sched)


def cfg(tmp_path, preset: str = "default", **over) -> gg.GuardConfig:
    # logger=False (fit's default here): Lightning keeps no log folder, so the event log goes to a named one
    over["output"] = {"console": False, "metrics_interval": 1, "dir": str(tmp_path / "logs"), **over.get("output", {})}
    return gg.GuardConfig.preset(preset, **over)


def fit(module, callbacks=(), tmp_path=None, steps: int = 12, bs: int = 8, n: int = 256, pl=L, **kw):
    kw.setdefault("logger", False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=list(callbacks),
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         default_root_dir=str(tmp_path), num_sanity_val_steps=0, **kw)
    trainer.fit(module, loader(bs, n))
    return trainer


def events(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


# -- observe ---------------------------------------------------------------------------------
def test_monitor_mode_is_bit_identical_and_logs_to_the_run_dir(tmp_path):
    plain = LitGPT(lr=1e-2, sched="step")
    fit(plain, tmp_path=tmp_path / "a", gradient_clip_val=0.5)
    guarded = LitGPT(lr=1e-2, sched="step")
    cb = GradGuardCallback(cfg(tmp_path, "monitor"))
    trainer = fit(guarded, [cb], tmp_path=tmp_path / "b", gradient_clip_val=0.5)
    assert torch.equal(flat(plain), flat(guarded))
    assert trainer.gradient_clip_val == 0.5  # monitor mode leaves the user's clipping alone
    assert cb.core.step_count == 12 and cb.core.skipped_steps == 0
    log = os.path.join(str(tmp_path / "logs"), "gradguard", "events.jsonl")
    assert cb.core.log_path == log and os.path.isfile(log)
    assert events(log)[-1]["type"] == "summary"


def test_layer_norms_pre_clip_and_loss_per_step_under_accumulation(tmp_path):
    class Probe(L.Callback):  # runs after the guard: sees the grads the guard measured (monitor)
        def __init__(self):
            self.norms = {}

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            out = {}
            for name, p in pl_module.named_parameters():
                layer = gg.measure.default_layer_name(name)
                out[layer] = out.get(layer, 0.0) + float(p.grad.double().norm() ** 2)
            self.norms[trainer.global_step + 1] = {k: math.sqrt(v) for k, v in out.items()}

    m = LitGPT(lr=1e-2)
    cb = GradGuardCallback(cfg(tmp_path, "monitor"))
    probe = Probe()
    reports = {}

    class Keep(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            reports[trainer.global_step + 1] = cb.last_report

    fit(m, [cb, probe, Keep()], tmp_path=tmp_path, steps=4, accumulate_grad_batches=3)
    assert cb.core.step_count == 4
    for step, rep in reports.items():
        micro = m.micro_losses[3 * (step - 1): 3 * step]
        assert rep.loss == pytest.approx(sum(micro) / 3, rel=1e-5)  # undivided, mean of the micro-batches
        for layer, v in probe.norms[step].items():
            assert rep.layer_norms[layer] == pytest.approx(v, rel=1e-4)


def test_metrics_reach_the_lightning_logger(tmp_path):
    logger = L.loggers.CSVLogger(str(tmp_path), name="run")
    cb = GradGuardCallback(cfg(tmp_path / "cfgdir", "monitor", output={"dir": None}))
    trainer = fit(LitGPT(), [cb], tmp_path=tmp_path, steps=4, logger=logger, log_every_n_steps=1)
    with open(os.path.join(logger.log_dir, "metrics.csv"), encoding="utf-8") as fh:
        header = fh.readline().strip().split(",")
    assert gg.M.LOSS in header and gg.M.GRAD_NORM in header
    assert any(h.startswith(gg.M.GRAD_NORM_LAYER + "/model_blocks_0") for h in header)
    assert cb.core.log_path == os.path.join(trainer.log_dir, "gradguard", "events.jsonl")


# -- act ---------------------------------------------------------------------------------------
def test_nonfinite_step_is_skipped_and_holds_adam_and_the_scheduler(tmp_path):
    m = LitGPT(sched="step", nan_at={4})
    cb = GradGuardCallback(cfg(tmp_path, recovery={"snapshot_interval": 0}))
    trainer = fit(m, [cb], tmp_path=tmp_path, steps=8)
    assert trainer.global_step == 8  # Lightning counts the step
    assert cb.core.skipped_steps == 1
    assert torch.equal(m.params[3], m.params[4])  # weights untouched by the skipped step
    assert not torch.equal(m.params[4], m.params[5])
    assert m.rec[4]["adam_step"] == 3 and m.rec[8]["adam_step"] == 7
    assert m.rec[4]["sched_epoch"] == 3 and m.rec[8]["sched_epoch"] == 7  # scheduler held once
    assert m.rec[4]["lr"] == m.rec[3]["lr"]
    assert all(math.isfinite(float(v)) for v in m.params[8])


def test_loss_spike_rolls_back_lowers_lr_tightens_then_relaxes_clip(tmp_path):
    m = LitGPT(sched="step", spike_at={7, 8})  # an isolated spike is only skipped; a repeat escalates
    c = cfg(tmp_path, recovery={"snapshot_interval": 3, "confirm_steps": 1}, clip={"relax_after": 4},
            lr={"rewarm_steps": 4})
    cb = GradGuardCallback(c)
    seen_clip = {}

    class Clip(L.Callback):
        def on_train_batch_end(self, trainer, *a):
            seen_clip[trainer.global_step] = trainer.gradient_clip_val

    trainer = fit(m, [cb, Clip()], tmp_path=tmp_path, steps=14, gradient_clip_val=1.0)
    acts = cb.core.action_counts
    assert acts["rollback"] == 1 and acts["lower_lr"] == 1 and acts["tighten_clip"] == 1
    ev = [e for e in events(cb.core.log_path) if e["type"] == "action" and e["name"] == "rollback"]
    to_step = ev[0]["params"]["to_step"]
    assert to_step == 3 and ev[0]["step"] == 8  # the snapshot after step 6 failed its test (spike at 7)
    assert torch.equal(m.params[8], m.params[to_step])  # exactly the healthy snapshot's weights
    assert torch.equal(m.params[6], m.params[7])  # the isolated spike was skipped
    assert seen_clip[8] == 0.5 and seen_clip[14] == 1.0  # tightened, then relaxed after 4 healthy steps
    assert acts["relax_clip"] == 1
    mult = cb.core.lr.global_mult
    low = next(e for e in events(cb.core.log_path) if e["type"] == "action" and e["name"] == "lower_lr")
    # the loss had fallen before the spike (the run was learning): the ordinary cut, not the deep one
    # of a run that never progressed (gradguard.core: early)
    assert low["params"]["early"] is False and mult == pytest.approx(c.lr.down_factor)
    # the multiplier acts inside the step (re-warm-up ramp after the rollback) but is never baked in
    sched = trainer.lr_scheduler_configs[0].scheduler
    base = sched.get_last_lr()[0]
    assert m.rec[14]["lr"][0] == pytest.approx(base)
    assert m.step_lrs[9][0] == pytest.approx(m.rec[8]["lr"][0] * mult * 1 / 5)
    assert m.step_lrs[13][0] == pytest.approx(m.rec[12]["lr"][0] * mult)


def test_adaptive_clipping_clips_a_grad_spike(tmp_path):
    m = LitGPT(grad_mult_at={12}, grad_mult=20.0)
    c = cfg(tmp_path, "adaptive", clip={"adaptive_warmup": 5, "max_norm": 100.0},
            recovery={"snapshot_interval": 0})
    cb = GradGuardCallback(c)
    reports = {}

    class Keep(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            reports[trainer.global_step + 1] = cb.last_report

    fit(m, [cb, Keep()], tmp_path=tmp_path, steps=13)
    r = reports[12]
    assert r.clipped and r.clip_to < 100.0 and r.total_norm > r.clip_to
    assert m.post_clip_norm[12] == pytest.approx(r.clip_to, rel=1e-3)  # Lightning did not re-clip
    assert not reports[11].clipped


def test_adam_beta2_eps_action(tmp_path):
    m = LitGPT(spike_at={6, 7})
    cb = GradGuardCallback(cfg(tmp_path, policy={"ladder": [["adam"]]}, recovery={"snapshot_interval": 0}))
    trainer = fit(m, [cb], tmp_path=tmp_path, steps=8)
    g = trainer.optimizers[0].param_groups[0]
    assert g["betas"] == (0.9, 0.95) and g["eps"] == 1e-6
    assert cb.core.action_counts["adam"] == 1


def test_halt_stops_the_trainer_with_a_diagnosis(tmp_path):
    m = LitGPT(spike_at={6, 7})
    cb = GradGuardCallback(cfg(tmp_path, policy={"ladder": [["halt"]]}, recovery={"snapshot_interval": 0}))
    trainer = None
    with pytest.raises(gg.GradGuardHalt, match="gradguard halted") as exc:  # one halt rule in every engine
        fit(m, [cb], tmp_path=tmp_path, steps=20)
    trainer = cb.run.trainer
    assert exc.value.diagnosis == cb.diagnosis and cb.diagnosis_path is not None
    assert trainer.should_stop and trainer.global_step == 7
    assert torch.equal(m.params[6], m.params[7])  # the halting step was not applied
    with open(os.path.join(str(tmp_path), "logs", "gradguard", "diagnosis.json"), encoding="utf-8") as fh:
        diag = json.load(fh)
    assert diag["step"] == 7 and "loss" in diag["recent_findings"][-1]["kind"]


@pytest.mark.parametrize("sched", ["epoch", "plateau"])
def test_lr_multiplier_holds_with_epoch_and_plateau_schedulers(tmp_path, sched):
    m = LitGPT(sched=sched, spike_at={5, 6})
    c = cfg(tmp_path, policy={"ladder": [["lower_lr"]]}, recovery={"snapshot_interval": 0}, lr={"rewarm_steps": 0})
    cb = GradGuardCallback(c)
    trainer = fit(m, [cb], tmp_path=tmp_path, steps=12, n=48)  # 6 batches per epoch
    mult = cb.core.lr.global_mult
    assert mult == pytest.approx(EARLY)
    s = trainer.lr_scheduler_configs[0].scheduler
    for step in (7, 10, 12):
        assert m.step_lrs[step][0] == pytest.approx(m.base_lr[step] * mult)  # in force inside the step
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(s._last_lr[0])  # never baked in
    if sched == "epoch":
        assert m.base_lr[12] == pytest.approx(3e-3 * 0.5)  # StepLR kept its own course (halved per epoch)
        assert m.rec[12]["lr"][0] == pytest.approx(3e-3 * 0.25)


def test_skip_data_window_after_rollback(tmp_path):
    m = LitGPT(sched="step", spike_at={6, 7})
    c = cfg(tmp_path, recovery={"snapshot_interval": 2, "confirm_steps": 1, "skip_batches": 2})
    cb = GradGuardCallback(c)
    trainer = fit(m, [cb], tmp_path=tmp_path, steps=10)
    assert cb.data_skipped_steps == 2
    assert torch.equal(m.params[7], m.params[9])  # the two window batches changed nothing
    assert not torch.equal(m.params[9], m.params[10])
    assert len(m.micro_losses) == 8  # the window's batches were not computed (no forward/backward)
    assert m.rec[9]["adam_step"] == m.rec[7]["adam_step"]  # nor stepped
    assert m.rec[9]["sched_epoch"] == m.rec[7]["sched_epoch"]  # schedulers held through the window
    assert m.rec[10]["sched_epoch"] == m.rec[9]["sched_epoch"] + 1
    assert trainer.global_step == 10
    assert cb.core.step_count == 10  # the guard counts them as skipped steps: its steps follow global_step
    assert cb.core.skipped_steps >= 3  # the rollback step and the window


def test_resume_restores_guard_state_per_instance(tmp_path):
    m = LitGPT(sched="step", spike_at={3, 4})
    c = cfg(tmp_path, policy={"ladder": [["lower_lr"]]}, recovery={"snapshot_interval": 0})
    cb = GradGuardCallback(c)
    mon = GradGuardCallback(cfg(tmp_path / "mon", "monitor"), name="monitor")
    t1 = fit(m, [cb, mon], tmp_path=tmp_path, steps=6)
    ckpt = str(tmp_path / "a.ckpt")
    t1.save_checkpoint(ckpt)
    keys = torch.load(ckpt, weights_only=False)["callbacks"].keys()
    assert cb.state_key in keys and mon.state_key in keys and cb.state_key != mon.state_key
    mult, n_find = cb.core.lr.global_mult, cb.core.n_findings
    assert mult < 1
    m2 = LitGPT(sched="step")
    cb2 = GradGuardCallback(c)
    mon2 = GradGuardCallback(cfg(tmp_path / "mon", "monitor"), name="monitor")
    t2 = L.Trainer(accelerator="cpu", max_steps=9, callbacks=[cb2, mon2], logger=False, enable_progress_bar=False,
                   enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path))
    t2.fit(m2, loader(), ckpt_path=ckpt)
    assert cb2.core.step_count == 9 and mon2.core.step_count == 9  # continued from step 6
    assert cb2.core.lr.global_mult == mult and cb2.core.n_findings == n_find
    assert m2.step_lrs[8][0] == pytest.approx(m2.rec[7]["lr"][0] * mult)


def test_fp16_overflows_skip_and_streak_is_found(tmp_path):
    from lightning.pytorch.plugins import MixedPrecision

    m = LitGPT(inf_at={3, 4, 5, 6, 7, 8, 9})
    c = cfg(tmp_path, policy={"ladder": [["lower_lr"]]}, recovery={"snapshot_interval": 0})
    cb = GradGuardCallback(c)
    scales = {}

    class Keep(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            scales[trainer.global_step + 1] = cb.last_report

    trainer = fit(m, [cb, Keep()], tmp_path=tmp_path, steps=11, plugins=[MixedPrecision("16-mixed", "cpu")])
    scaler = trainer.precision_plugin.scaler
    assert scaler is not None
    r = scales
    assert r[2].scale == 65536.0 and not r[2].overflow
    assert all(r[s].overflow and r[s].skipped for s in (3, 4, 5, 6, 7, 8, 9))
    assert [r[s].scale for s in (4, 5, 6, 7)] == [r[3].scale / 2 ** k for k in (1, 2, 3, 4)]  # the scaler halves
    # from the 5th overflow in a row (step 7) the halvings evidently cure nothing: the scale is frozen
    assert r[8].scale == r[9].scale == r[10].scale == r[7].scale == 4096.0
    assert scaler.get_scale() == 4096.0
    assert r[10].applied and not r[10].overflow
    assert torch.equal(m.params[2], m.params[9])
    kinds = [e["kind"] for e in events(cb.core.log_path) if e["type"] == "finding"]
    # a streak is reported; the scaler already skips those steps, so it does not climb the ladder
    assert "overflow_streak" in kinds and cb.core.action_counts["lower_lr"] == 0
    assert r[2].loss == pytest.approx(m.micro_losses[1], rel=1e-3)  # unscaled loss


def test_manual_optimization_skips_nonfinite_steps(tmp_path):
    m = LitGPT(manual=True, nan_at={3})
    cb = GradGuardCallback(cfg(tmp_path, recovery={"snapshot_interval": 0}))
    fit(m, [cb], tmp_path=tmp_path, steps=5)
    assert cb.core.step_count == 5 and cb.core.skipped_steps == 1
    assert torch.equal(m.params[2], m.params[3])


def test_standalone_pytorch_lightning_package(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    from gradguard.pytorch_lightning import GradGuardCallback as PLCallback

    class PLModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = TinyGPT(n_layer=1, width=32, n_head=2, seq_len=SEQ)

        def training_step(self, batch, batch_idx):
            loss = self.model(*batch)
            return loss * 50 if self.trainer.global_step in (5, 6) else loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    assert issubclass(PLCallback, pl.Callback) and not issubclass(PLCallback, L.Callback)
    cb = PLCallback(cfg(tmp_path, policy={"ladder": [["lower_lr"]]}, recovery={"snapshot_interval": 0}))
    trainer = fit(PLModule(), [cb], tmp_path=tmp_path, steps=8, pl=pl)
    assert trainer.global_step == 8 and cb.core.step_count == 8
    assert cb.core.action_counts["lower_lr"] == 1


DDP_SCRIPT = textwrap.dedent('''
    import json, os, sys
    import torch
    sys.path.insert(0, {tests!r})
    from test_lightning import LitGPT, loader, cfg, flat
    import lightning.pytorch as L
    from gradguard.lightning import GradGuardCallback
    from pathlib import Path

    out = Path({out!r})

    class OneRank(LitGPT):
        def on_after_backward(self):  # a fault on rank 1 only, after the DDP gradient sync
            if self.global_rank == 1 and self.trainer.global_step + 1 == 4:
                self.model.lm_head.weight.grad[0, 0] = float("nan")

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            if self.global_rank == 1 and self.trainer.global_step + 1 in (7, 8):
                loss = loss * 50  # a loss spike seen by rank 1 only
            return loss

    torch.set_num_threads(1)
    extra = []
    if {mode!r} == "memory":
        cb = GradGuardCallback(cfg(out, policy={{"ladder": [["rollback", "shrink_batch", "lower_lr", "tighten_clip"]]}},
                                   recovery={{"snapshot_interval": 2, "confirm_steps": 1, "skip_batches": 1}}))
    else:  # rollback to ModelCheckpoint files (written by rank 0, read by every rank)
        from lightning.pytorch.callbacks import ModelCheckpoint
        cb = GradGuardCallback(cfg(out, policy={{"ladder": [["rollback", "lower_lr"]]}},
                                   recovery={{"snapshot_interval": 0, "confirm_steps": 1}}))
        extra = [ModelCheckpoint(dirpath=str(out / "ckpt"), every_n_train_steps=2, save_top_k=-1)]
    rollbacks = {{}}

    class Rec(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            r = cb.last_report
            for a in (r.actions if r is not None else []):
                if a.name == "rollback":
                    rollbacks[r.step] = a.params.get("to_step")

    m = OneRank()
    t = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=10, callbacks=[cb, Rec()] + extra,
                  logger=False, enable_progress_bar=False, enable_model_summary=False,
                  enable_checkpointing=bool(extra), default_root_dir=str(out))
    t.fit(m, loader(4, 160))
    res = {{"rank": t.global_rank, "rollbacks": rollbacks, "params": flat(m).tolist()[:4000], "sum": float(flat(m).double().sum()),
            "actions": dict(cb.core.action_counts), "skipped": cb.core.skipped_steps,
            "mult": cb.core.lr.global_mult, "clip": cb.core.clip.max_norm, "loader": cb.batches.loader_batch,
            "batches": t.num_training_batches, "window": cb.data_skipped_steps, "steps": cb.core.step_count,
            "computed": len(m.micro_losses)}}
    (out / f"rank{{t.global_rank}}.json").write_text(json.dumps(res))
    del t, m, cb, extra, res  # the trainer, its DDP wrapper and the callbacks: garbage before the group goes
    from _dist import shutdown
    shutdown()
''')


def run_ddp(tmp_path, mode: str) -> tuple[dict, dict]:
    script = tmp_path / "ddp_run.py"
    script.write_text(DDP_SCRIPT.format(tests=os.path.dirname(__file__), out=str(tmp_path), mode=mode))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script)], cwd=str(tmp_path), env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tuple(json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))  # type: ignore[return-value]


@pytest.mark.slow
def test_ddp_rollback_from_a_model_checkpoint_file_on_every_rank(tmp_path):
    r0, r1 = run_ddp(tmp_path, "checkpoint")
    assert r0["rollbacks"] == r1["rollbacks"] and r0["rollbacks"]  # the same file restored on both ranks
    assert all(to is not None and to % 2 == 0 for to in r0["rollbacks"].values())
    assert r0["params"] == r1["params"] and r0["sum"] == r1["sum"]
    assert r0["actions"] == r1["actions"]


@pytest.mark.slow
def test_ddp_two_ranks_fault_on_one_rank_identical_actions_and_params(tmp_path):
    r0, r1 = run_ddp(tmp_path, "memory")
    assert r0["params"] == r1["params"] and r0["sum"] == r1["sum"]
    assert r0["actions"] == r1["actions"] and r0["skipped"] == r1["skipped"] >= 2
    assert r0["actions"].get("rollback") == 1 and r0["mult"] == r1["mult"] < 1
    # the rollback's rung also halved each rank's loader batch (a BatchSampler over a DistributedSampler):
    # 8 batches of 4 drawn of 80 samples per rank, 48 left in batches of 2
    assert r0["actions"].get("shrink_batch") == 1 and r0["loader"] == r1["loader"] == 2
    assert r0["batches"] == r1["batches"] == 32
    # the data window after the rollback (1 step) ran no forward on either rank (zero loss under DDP)
    assert r0["window"] == r1["window"] == 1 and r0["steps"] == r1["steps"] == 10
    assert r0["computed"] == r1["computed"] == 9


def test_model_parallel_strategy_fsdp2_is_guarded_with_the_unsharded_layer_names(tmp_path):
    """FSDP2 through Lightning (ModelParallelStrategy, ``fully_shard`` in ``configure_model``), one
    process: guarded (the 2-process runs are in tests/test_scale_engines.py)."""
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.tensor import DTensor

    class Sharded(LitGPT):
        def configure_model(self):
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.model)

    cb = GradGuardCallback(cfg(tmp_path))
    env = dict(os.environ)
    module = Sharded()
    try:
        fit(module, [cb], tmp_path=tmp_path, steps=3, strategy=ModelParallelStrategy())
    finally:
        if torch.distributed.is_initialized():  # the strategy's one-process group: not left to later tests
            torch.distributed.destroy_process_group()
        os.environ.clear()  # nor its MASTER_PORT / WORLD_SIZE / RANK variables (a later child process
        os.environ.update(env)  # would take them for a distributed launch)
    assert isinstance(next(module.parameters()), DTensor) and cb.core.measurer.sharding is not None
    assert cb.core.step_count == 3 and cb.last_report.total_norm > 0
    assert not any("_fsdp" in name or "_flat_param" in name for name in cb.last_report.layer_norms)


def test_the_callback_pickles_with_the_trainer(tmp_path):
    """``torch.save(trainer)`` / ``copy.deepcopy`` (Lightning's own test_model_torch_save): the
    callback pickles as constructed plus its guard state, without the attached run."""
    import copy
    import io
    import pickle

    from gradguard.lightning import GradGuardCallback

    cb = GradGuardCallback(cfg(tmp_path, "default"))
    trainer = fit(LitGPT(lr=1e-3), [cb], tmp_path=tmp_path, steps=4)
    torch.save(trainer, io.BytesIO())  # raised "Can't pickle local object" before
    for clone in (pickle.loads(pickle.dumps(cb)), copy.deepcopy(cb)):
        assert clone.core is None and clone.config == cb.config and clone.state_key == cb.state_key
        assert clone.state_dict()["core"]["step_count"] == cb.state_dict()["core"]["step_count"] == 4
