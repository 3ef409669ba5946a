"""A guard the engine does not notice: runs the engines accept are never stopped by it, parameters
unfrozen later are followed, files land where the engine keeps its own logs, and a short noisy run
has no finding (issue: "Invisible in Lightning / in the HF Trainer")."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from torch import nn

import gradguard as gg
from gradguard.config import DetectConfig
from gradguard.detect import Detectors, Signals

pytestmark = pytest.mark.usefixtures("one_thread")


def _ours(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, gg.GradGuardWarning)]


# -- fine-tuning schedules: everything frozen at the start, unfrozen by epoch ---------------------------

def _lightning():
    return pytest.importorskip("lightning.pytorch")


def _finetune_module(L):
    class Finetune(L.LightningModule):
        """A backbone and a head, both frozen before training by the callback below."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.backbone = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16))
            self.head = nn.Linear(16, 2)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.head(self.backbone(x)), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.head.parameters(), lr=0.05)  # frozen when this runs

    return Finetune


def _finetune_callback(L):
    from lightning.pytorch.callbacks import BaseFinetuning

    class FreezeAllThenUnfreeze(BaseFinetuning):
        def freeze_before_training(self, pl_module):
            self.freeze(pl_module)  # everything: no trainable parameter when training starts

        def finetune_function(self, pl_module, epoch, optimizer):
            if epoch == 0:
                self.make_trainable(pl_module.head)
            if epoch == 1:
                self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, lr=0.01)

    return FreezeAllThenUnfreeze()


@pytest.mark.parametrize("preset", ["monitor", "default"])
def test_lightning_finetuning_that_freezes_everything_then_unfreezes_by_epoch(tmp_path, preset):
    L = _lightning()
    from gradguard.lightning import GradGuardCallback

    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, torch.stack([x[:, 0], x[:, 1] * x[:, 2]], 1))
    sink = gg.MemorySink()
    cb = GradGuardCallback(gg.GuardConfig.preset(preset, output={"console": False}), sinks=[sink],
                           out_dir=str(tmp_path))
    model = _finetune_module(L)()
    trainer = L.Trainer(accelerator="cpu", max_epochs=2, limit_train_batches=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[_finetune_callback(L), cb], default_root_dir=str(tmp_path))
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
    assert trainer.global_step == 6 and cb.core is not None
    joined = [e for e in sink.events if e["type"] == "layers_joined"]
    # the head joins at the first step of epoch 0, the backbone at the first step of epoch 1
    assert [(e["step"], e["layers"]) for e in joined] == [(1, ["head"]), (4, ["head", "backbone.0", "backbone.2"])], joined
    assert cb.core.layers.layer_names == ["head", "backbone.0", "backbone.2"]
    rep = cb.last_report
    assert rep.layer_norms["backbone.0"] > 0 and rep.layer_norms["head"] > 0
    # a larger total norm after the unfreeze is not a spike: the grad baseline starts over
    assert not [e for e in sink.events if e["type"] == "finding"], sink.events
    before = [p.detach().clone() for p in model.backbone.parameters()]
    assert all(torch.isfinite(p).all() for p in before)


def test_the_core_defers_a_model_frozen_at_attach_and_follows_the_optimizer():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    for p in model.parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD(model[1].parameters(), lr=0.1)
    guard = gg.Guard(model, opt, config=gg.GuardConfig.preset("monitor", output={"jsonl": False, "console": False}))
    assert guard.core.layers.layer_names == []
    model[1].requires_grad_(True)
    opt.add_param_group({"params": list(model[0].parameters())})
    model[0].requires_grad_(True)
    x = torch.randn(8, 4)
    for _ in range(3):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        report = guard.step()
    assert guard.core.layers.layer_names == ["0", "1"] and report.layer_norms["0"] > 0
    # a model none of whose parameters the optimizer holds is still refused (the wrong model)
    other = nn.Linear(4, 1)
    with pytest.raises(gg.UnsupportedSetupError, match="none of the model's trainable parameters"):
        gg.Guard(other, opt, config=gg.GuardConfig.preset("monitor", output={"jsonl": False, "console": False}))
    frozen = nn.Linear(4, 1).requires_grad_(False)
    with pytest.raises(gg.UnsupportedSetupError, match="no trainable parameters"):
        gg.Guard(frozen, opt, config=gg.GuardConfig.preset("monitor", output={"jsonl": False, "console": False}))


# -- warm-up: no finding from too few observations ------------------------------------------------------

def _boring_losses(seed: int, steps: int) -> list[tuple[float, float]]:
    """Lightning's BoringModel in a plain loop: Linear(32, 2), SGD lr 0.1, one random sample per batch,
    MSE against ones. (loss, grad norm) per step."""
    torch.manual_seed(seed)
    layer = nn.Linear(32, 2)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    out = []
    for _ in range(steps):
        x = torch.randn(1, 32)
        loss = nn.functional.mse_loss(layer(x), torch.ones(1, 2))
        opt.zero_grad()
        loss.backward()
        gn = float(torch.cat([p.grad.reshape(-1) for p in layer.parameters()]).norm())
        out.append((float(loss.detach()), gn))
        opt.step()
    return out


def test_a_two_step_random_data_run_has_no_finding_over_many_seeds():
    """Two losses of a random-data run differ by 1.5x or more about a third of the time (72 of 200 seeds
    were flagged before the fix): a jump over the only earlier loss is held, not judged."""
    flagged = []
    for seed in range(200):
        det = Detectors(DetectConfig())
        for step, (loss, gn) in enumerate(_boring_losses(seed, 2), 1):
            found = [f for f in det.observe(Signals(step=step, loss=loss, total_norm=gn, layer_norms={"layer": gn}))
                     if f.severity != "info"]
            if found:
                flagged.append((seed, step, found[0].kind))
    assert flagged == []


def _losses(values: list[float]) -> tuple[Detectors, list[list[str]]]:
    det = Detectors(DetectConfig())
    out = []
    for step, v in enumerate(values, 1):
        out.append([f.kind for f in det.observe(Signals(step=step, loss=v, total_norm=1.0, layer_norms={"a": 1.0}))])
        det.settle(True)  # as a monitoring core does: every step's lesson is kept
    return det, out


def test_a_jump_that_stays_up_is_still_an_early_explosion_and_one_that_falls_back_is_noise():
    # the rescue benchmark's explosive GPT run (lr 0.1, no warm-up): 5.68, then 9.96 and 10.13
    det, found = _losses([5.68, 9.96, 10.13, 10.5])
    assert found == [[], [], ["loss_spike"], ["loss_spike"]]  # two findings: the policy escalates at step 4
    assert det.loss.base.count == 1  # neither the held loss nor the spikes joined the baseline
    det, found = _losses([5.68, 9.96, 5.5, 5.4])
    assert found == [[], [], [], []]
    assert det.loss.base.count == 4 and det.loss.held is None  # the held loss was noise: it joined
    # a lucky low first loss: the run of flags reaches three, and the losses flagged against that
    # reference join the baseline with the third one (they were the run's normal level)
    det, found = _losses([1.0, 3.0, 3.1, 2.9, 3.0, 3.05])
    assert found == [[], [], ["loss_spike"], ["loss_spike"], [], []]
    assert det.loss.base.count == 6 and det.loss.streak == []
    # a held loss survives a state round trip (a checkpoint taken between the two steps)
    det, _ = _losses([5.68, 9.96])
    again = Detectors(DetectConfig())
    again.load_state_dict(json.loads(json.dumps(det.state_dict())))
    assert again.loss.held == 9.96
    assert [f.kind for f in again.observe(Signals(step=3, loss=10.1, total_norm=1.0, layer_norms={"a": 1.0}))] == [
        "loss_spike"]


def test_a_two_step_boring_model_fit_has_no_finding_over_eight_seeds(tmp_path, monkeypatch):
    L = _lightning()
    from lightning.pytorch.demos.boring_classes import BoringModel

    from gradguard.lightning import GradGuardCallback

    monkeypatch.chdir(tmp_path)
    findings = []
    for seed in range(8):
        torch.manual_seed(seed)
        sink = gg.MemorySink()
        cb = GradGuardCallback(gg.GuardConfig.preset("monitor"), sinks=[sink])
        trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=[cb],
                            num_sanity_val_steps=0, limit_val_batches=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(BoringModel())
        assert cb.reports == 2
        findings += [(seed, e["step"], e["kind"]) for e in sink.events if e["type"] == "finding"]
    assert findings == []
    assert os.listdir(tmp_path) == []  # no logger, no root dir: nothing in the working directory


# -- where gradguard's files go: where the engine keeps its own logs, never among checkpoints ------------

def _boring_fit(cb, **kw):
    L = _lightning()
    from lightning.pytorch.demos.boring_classes import BoringModel

    kw = {"accelerator": "cpu", "max_steps": 3, "enable_progress_bar": False, "enable_model_summary": False,
          "num_sanity_val_steps": 0, "limit_val_batches": 0, **kw}
    trainer = L.Trainer(callbacks=[cb, *kw.pop("callbacks", [])], **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        trainer.fit(BoringModel())
    return trainer, _ours(caught)


def _events_at(fs, path):
    return [json.loads(x) for x in fs.cat(path).decode().splitlines()]


@pytest.mark.parametrize("logger", [False, "csv"])
def test_lightning_remote_root_dir_goes_through_fsspec(tmp_path, monkeypatch, logger):
    """default_root_dir="memory://...": Lightning's loggers and checkpoints write through fsspec, so does
    the event log (in the logger's folder); without a logger nothing is written, locally or remotely
    (before: a local folder literally named ./memory:/...)."""
    fsspec = pytest.importorskip("fsspec")
    from lightning.pytorch.loggers import CSVLogger

    from gradguard.lightning import GradGuardCallback

    monkeypatch.chdir(tmp_path)
    root = f"memory://gg-{logger}-{os.getpid()}/run"
    lg = CSVLogger(save_dir=root) if logger else False
    cb = GradGuardCallback(gg.GuardConfig.preset("monitor", output={"console": False}))
    trainer, ours = _boring_fit(cb, default_root_dir=root, logger=lg)
    fs = fsspec.filesystem("memory")
    if logger:
        assert ours == []
        expected = f"{trainer.log_dir}/gradguard/events.jsonl"
        assert cb.core.log_path == expected and expected.startswith(root)
        ev = _events_at(fs, expected)
        assert ev[0]["type"] == "start" and ev[-1]["type"] == "summary" and ev[-1]["steps"] == 3
    else:
        assert len(ours) == 1 and "no event log" in ours[0] and cb.core.log_path is None
        assert not fs.exists(f"{root}/gradguard")
    ckpts = trainer.checkpoint_callback.dirpath
    assert all(n.endswith(".ckpt") for n in fs.ls(ckpts, detail=False)), fs.ls(ckpts, detail=False)
    assert os.listdir(tmp_path) == []  # nothing local: no ./memory:/ folder


def test_lightning_without_logger_or_root_dir_writes_nothing_in_the_working_directory(tmp_path, monkeypatch):
    from gradguard.lightning import GradGuardCallback

    monkeypatch.chdir(tmp_path)
    cb = GradGuardCallback(gg.GuardConfig.preset("default", output={"console": False}))
    trainer, ours = _boring_fit(cb, logger=False)
    assert len(ours) == 1 and "no event log" in ours[0] and "out_dir" in ours[0], ours
    assert cb.core.log_path is None
    # Lightning's own checkpoint folder is all there is, and it holds checkpoints only
    assert os.listdir(tmp_path) == ["checkpoints"]
    assert all(n.endswith(".ckpt") for n in os.listdir(tmp_path / "checkpoints"))


def test_lightning_without_logger_never_writes_into_the_checkpoint_directory(tmp_path):
    """Lightning's tests (and users' scripts) list a checkpoint folder and load every entry. Without a
    logger, default_root_dir is where Lightning writes its HPC checkpoints (hpc_ckpt_*.ckpt): its own
    test_hpc_restore_attempt asserts os.listdir(root) == ["hpc_ckpt_3.ckpt"]."""
    L = _lightning()
    from gradguard.lightning import GradGuardCallback

    ckpt = L.callbacks.ModelCheckpoint(dirpath=str(tmp_path), save_last=True)
    cb = GradGuardCallback(gg.GuardConfig.preset("default", output={"console": False}))
    _, ours = _boring_fit(cb, logger=False, default_root_dir=str(tmp_path), callbacks=[ckpt])
    assert len(ours) == 1 and "no event log" in ours[0], ours
    names = os.listdir(tmp_path)
    assert names and all(n.endswith(".ckpt") and (tmp_path / n).is_file() for n in names), names
    # the pattern of Lightning's test_hpc_restore_attempt
    root = tmp_path / "root"
    cb = GradGuardCallback(gg.GuardConfig.preset("monitor", output={"console": False}))
    trainer, ours = _boring_fit(cb, logger=False, default_root_dir=str(root), enable_checkpointing=False)
    trainer.save_checkpoint(root / "hpc_ckpt_3.ckpt")
    assert os.listdir(root) == ["hpc_ckpt_3.ckpt"] and cb.core.log_path is None
    # with a logger the event log is in the logger's version folder, beside Lightning's checkpoints
    cb = GradGuardCallback(gg.GuardConfig.preset("default", output={"console": False}))
    trainer, ours = _boring_fit(cb, logger=L.loggers.CSVLogger(str(tmp_path / "logs")),
                                default_root_dir=str(tmp_path / "logs"))
    assert ours == [] and cb.core.log_path == os.path.join(trainer.log_dir, "gradguard", "events.jsonl")
    assert sorted(os.listdir(trainer.log_dir)) == ["checkpoints", "gradguard", "metrics.csv"]
    assert all(n.endswith(".ckpt") for n in os.listdir(os.path.join(trainer.log_dir, "checkpoints")))


def _hf_run(tmp_path, name, callbacks=(), **kw):
    pytest.importorskip("transformers")
    from tests.test_hf import make_trainer

    trainer = make_trainer(tmp_path / name, list(callbacks), steps=4, save_strategy="steps", save_steps=2, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    out = tmp_path / name / "out"
    return trainer, out, _ours(caught)


def test_hf_output_dir_holds_only_what_the_trainer_writes(tmp_path):
    """report_to none (transformers 5's default): the Trainer keeps no log folder, so gradguard writes no
    event log (one warning): output_dir lists only checkpoint-* and a checkpoint holds only the Trainer's
    files and the guard's state (its entry in the checkpoint, like the Trainer's own state)."""
    from gradguard.hf import GradGuardCallback

    _, plain, _ = _hf_run(tmp_path, "plain")
    cb = GradGuardCallback(config=gg.GuardConfig.preset("monitor", output={"console": False}))
    _, guarded, ours = _hf_run(tmp_path, "guarded", [cb])
    assert sorted(os.listdir(guarded)) == sorted(os.listdir(plain)) == ["checkpoint-2", "checkpoint-4"]
    extra = set(os.listdir(guarded / "checkpoint-2")) - set(os.listdir(plain / "checkpoint-2"))
    assert extra <= {"gradguard_state.json"}, extra
    assert len(ours) == 1 and "no event log" in ours[0] and "out_dir" in ours[0], ours
    assert cb.core.log_path is None
    # a folder the user names is used as given
    named = tmp_path / "logs"
    cb = GradGuardCallback(config=gg.GuardConfig.preset("monitor", output={"console": False}), out_dir=str(named))
    _, out, ours = _hf_run(tmp_path, "named", [cb])
    assert ours == [] and cb.core.log_path == str(named / "gradguard" / "events.jsonl")
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-4"]
    lines = [json.loads(x) for x in open(cb.core.log_path, encoding="utf-8")]
    assert lines[0]["type"] == "start" and lines[-1]["type"] == "summary" and lines[-1]["steps"] == 4


def test_hf_event_log_goes_to_the_trainers_tensorboard_folder(tmp_path):
    pytest.importorskip("tensorboard")
    from gradguard.hf import GradGuardCallback

    cb = GradGuardCallback(config=gg.GuardConfig.preset("monitor", output={"console": False}))
    _, out, ours = _hf_run(tmp_path, "tb", [cb], report_to=["tensorboard"])
    assert ours == []
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-4", "runs"]
    (run,) = os.listdir(out / "runs")  # one folder: the Trainer's TensorBoard files and gradguard's
    files = os.listdir(out / "runs" / run)
    assert "gradguard" in files and any(f.startswith("events.out.tfevents") for f in files), files
    assert cb.core.log_path == str(out / "runs" / run / "gradguard" / "events.jsonl")
    assert os.path.getsize(cb.core.log_path) > 0
