"""The engine contract: each scenario written once, run against every engine.

Engines: the plain loop (``gradguard.Guard``), a real ``transformers.Trainer`` and a real
``lightning.Trainer``, all training the same tiny network (same parameter names, so the same layer
names and metric names) on the same byte data, a few CPU steps each. A new engine joins by adding
one runner below; the scenarios do not change.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from torch import nn

import gradguard as gg
from gradguard.sinks import MemorySink

ENGINES = ["plain", "hf", "lightning"]
VOCAB, SEQ, BS = 64, 8, 4


pytestmark = pytest.mark.usefixtures("one_thread")


# -- the model, written once ------------------------------------------------------------------------
def _build(module: nn.Module) -> None:
    torch.manual_seed(0)
    module.embed = nn.Embedding(VOCAB, 16)
    module.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
    module.head = nn.Linear(16, VOCAB)
    module.faults = {}  # optimizer step (1-based) -> loss factor (nan allowed)
    module.step_fn = lambda: 0


def _loss(module: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    h = module.embed(input_ids)
    h = h + module.block(h)
    logits = module.head(h)
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
    factor = module.faults.get(module.step_fn())
    return loss * factor if factor is not None else loss


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        _build(self)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": _loss(self, input_ids, labels)}


class Data(torch.utils.data.Dataset):
    def __init__(self, n: int = 128) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": (self.x[i] * 3 + 1) % VOCAB}


def make_opt(params, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05)
    return torch.optim.AdamW(params, lr=3e-3)


def make_sched(opt) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.05 * s))


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def flat_opt_state(opt: torch.optim.Optimizer) -> torch.Tensor:
    parts = []
    for st in opt.state_dict()["state"].values():
        for k in sorted(st):
            v = st[k]
            parts.append((v if isinstance(v, torch.Tensor) else torch.tensor(float(v))).detach().reshape(-1).float())
    return torch.cat(parts) if parts else torch.zeros(0)


def cfg(tmp_path, preset: str = "default", **over) -> gg.GuardConfig:
    over["output"] = {"console": False, "metrics_interval": 1, "dir": str(tmp_path / "guard"), **over.get("output", {})}
    return gg.GuardConfig.preset(preset, **over)


class Record:
    """What a run leaves behind, the same for every engine."""

    def __init__(self) -> None:
        self.weights: dict[int, torch.Tensor] = {}  # after optimizer step k
        self.opt_state: dict[int, torch.Tensor] = {}
        self.eff_lr: dict[int, float] = {}  # |delta p| / |grad| of step k (SGD), 0 when skipped
        self.sched_lr: dict[int, float] = {}  # the scheduler's LR (param group) when step k began
        self.core: gg.GuardCore | None = None
        self.callback = None
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler = None
        self.error: BaseException | None = None
        self.wrapped_training_step: list[bool] = []
        self.restored_state: dict | None = None
        self.saved_state: dict | None = None
        self.sink = MemorySink()

    def after_step(self, k: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.weights[k] = flat_params(model)
        self.opt_state[k] = flat_opt_state(opt)


class _LRProbe:
    """Global optimizer hooks: the scheduler's LR as the step starts (global pre-hooks run before the
    guard's multiplier), and the effective LR of the update (plain SGD: |delta p| / |grad|)."""

    def __init__(self, rec: Record, step_fn) -> None:
        self.rec, self.step_fn = rec, step_fn
        self._before: torch.Tensor | None = None
        self._k = 0
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self.handles = [register_optimizer_step_pre_hook(self.pre), register_optimizer_step_post_hook(self.post)]

    def pre(self, opt, args, kwargs) -> None:
        self._k = self.step_fn()
        self.rec.sched_lr[self._k] = float(opt.param_groups[0]["lr"])
        self._before = torch.cat([p.detach().reshape(-1).clone() for g in opt.param_groups for p in g["params"]])

    def post(self, opt, args, kwargs) -> None:
        params = [p for g in opt.param_groups for p in g["params"]]
        grads = [p.grad for p in params]
        if any(g is None for g in grads) or self._before is None:
            self.rec.eff_lr[self._k] = 0.0
            return
        after = torch.cat([p.detach().reshape(-1) for p in params])
        gn = torch.cat([g.reshape(-1) for g in grads]).norm()
        self.rec.eff_lr[self._k] = float((after - self._before).norm() / gn) if gn > 0 else 0.0

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


# -- runners: one per engine ---------------------------------------------------------------------------
def run_plain(tmp_path, config, steps, faults=None, opt_kind="adamw", guard=True, resume_from=None,
              save_at=None, engine_clip=None) -> Record:
    rec = Record()
    model = Net()
    model.faults = dict(faults or {})
    opt = make_opt(model.parameters(), opt_kind)
    sched = make_sched(opt)
    g = gg.Guard(model, opt, scheduler=sched, config=config, sinks=[rec.sink]) if guard else None
    start = 0
    if resume_from is not None:
        ck = torch.load(resume_from, weights_only=True)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        g.load_state_dict(json.loads(ck["guard"]))
        rec.restored_state = g.state_dict()
        start = ck["step"]
    rec.core, rec.model, rec.optimizer, rec.scheduler = g, model, opt, sched
    k = start
    model.step_fn = lambda: k + 1
    probe = _LRProbe(rec, lambda: k + 1)
    loader = torch.utils.data.DataLoader(Data(), batch_size=BS, shuffle=False)
    batches = iter(loader)
    try:
        while k < steps:
            batch = next(batches)
            loss = model(**batch)["loss"]
            loss.backward()
            report = None
            if g is None:
                opt.step()
                sched.step()
            else:
                try:
                    report = g.step(loss.detach())
                except gg.GradGuardHalt as exc:
                    rec.error = exc
            opt.zero_grad(set_to_none=True)
            k += 1
            rec.after_step(k, model, opt)
            if save_at == k:
                rec.saved_state = g.state_dict()
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                            "guard": json.dumps(g.state_dict()), "step": k}, str(tmp_path / "plain.ckpt"))
            if rec.error is not None or (report is not None and report.halt):
                break
    finally:
        probe.remove()
        if g is not None:
            g.close()
    return rec


def run_hf(tmp_path, config, steps, faults=None, opt_kind="adamw", guard=True, resume_from=None,
           save_at=None, engine_clip=None) -> Record:
    transformers = pytest.importorskip("transformers")
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from gradguard.hf import GradGuardCallback

    transformers.logging.set_verbosity_error()
    rec = Record()
    model = Net()
    model.faults = dict(faults or {})
    opt = make_opt(model.parameters(), opt_kind)
    sched = make_sched(opt)
    cb = GradGuardCallback(config=config, sinks=[rec.sink]) if guard else None
    rec.callback = cb

    class Probe(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            if cb is not None and cb.core is not None and state.global_step > 0:
                rec.restored_state = cb.core.state_dict()

        def on_step_begin(self, args, state, control, **kw):
            rec.wrapped_training_step.append("training_step" in vars(trainer))

        def on_step_end(self, args, state, control, **kw):
            rec.after_step(state.global_step, model, opt)
            if save_at == state.global_step and cb is not None:
                rec.saved_state = cb.core.state_dict()

    save = dict(save_strategy="steps", save_steps=save_at) if save_at else dict(save_strategy="no")
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), use_cpu=True, report_to=[], max_steps=steps,
                             per_device_train_batch_size=BS, logging_steps=1, disable_tqdm=True, seed=0,
                             data_seed=0, dataloader_num_workers=0, max_grad_norm=1.0 if engine_clip is None else engine_clip,
                             **save)
    trainer = Trainer(model=model, args=args, train_dataset=Data(), optimizers=(opt, sched),
                      callbacks=[c for c in (cb, Probe()) if c is not None])
    model.step_fn = lambda: trainer.state.global_step + 1
    probe = _LRProbe(rec, lambda: trainer.state.global_step + 1)
    rec.model, rec.optimizer, rec.scheduler = model, opt, sched
    try:
        trainer.train(resume_from_checkpoint=resume_from)
    except gg.GradGuardHalt as exc:
        rec.error = exc
    finally:
        probe.remove()
    rec.core = cb.core if cb is not None else None
    rec.trainer = trainer
    return rec


def run_lightning(tmp_path, config, steps, faults=None, opt_kind="adamw", guard=True, resume_from=None,
                  save_at=None, engine_clip=None) -> Record:
    L = pytest.importorskip("lightning.pytorch")
    from gradguard.lightning import GradGuardCallback

    rec = Record()

    class LitNet(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            _build(self)

        def training_step(self, batch, batch_idx):
            return _loss(self, batch["input_ids"], batch["labels"])

        def configure_optimizers(self):
            opt = make_opt(self.parameters(), opt_kind)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": make_sched(opt), "interval": "step"}}

    model = LitNet()
    model.faults = dict(faults or {})
    cb = GradGuardCallback(config, sinks=[rec.sink]) if guard else None
    rec.callback = cb

    class Probe(L.Callback):
        def on_train_start(self, trainer, pl_module):
            if cb is not None and cb.core is not None and trainer.global_step > 0:
                rec.restored_state = cb.core.state_dict()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            rec.wrapped_training_step.append("training_step" in vars(pl_module))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            rec.after_step(trainer.global_step, pl_module, trainer.optimizers[0])
            if save_at == trainer.global_step and cb is not None:
                rec.saved_state = cb.core.state_dict()

    callbacks = [c for c in (cb, Probe()) if c is not None]
    if save_at:
        callbacks.append(L.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "pl"), every_n_train_steps=save_at,
                                                     save_top_k=-1))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=callbacks, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=bool(save_at),
                        default_root_dir=str(tmp_path / "pl"), num_sanity_val_steps=0, gradient_clip_val=engine_clip)
    model.step_fn = lambda: trainer.global_step + 1
    probe = _LRProbe(rec, lambda: trainer.global_step + 1)
    rec.model = model
    try:
        trainer.fit(model, torch.utils.data.DataLoader(Data(), batch_size=BS, shuffle=False), ckpt_path=resume_from)
    except gg.GradGuardHalt as exc:
        rec.error = exc
    finally:
        probe.remove()
    rec.optimizer = trainer.optimizers[0] if trainer.optimizers else None
    rec.scheduler = trainer.lr_scheduler_configs[0].scheduler if trainer.lr_scheduler_configs else None
    rec.core = cb.core if cb is not None else None
    rec.trainer = trainer
    return rec


RUNNERS = {"plain": run_plain, "hf": run_hf, "lightning": run_lightning}


def checkpoint_of(engine: str, tmp_path, step: int) -> str:
    if engine == "plain":
        return str(tmp_path / "plain.ckpt")
    if engine == "hf":
        return str(tmp_path / "hf" / f"checkpoint-{step}")
    files = [f for f in os.listdir(tmp_path / "pl") if f.endswith(f"step={step}.ckpt")]
    return str(tmp_path / "pl" / files[0])


def actions(rec: Record, name: str) -> list[dict]:
    return [e for e in rec.sink.events if e["type"] == "action" and e["name"] == name]


def normalised(state: dict) -> dict:
    return json.loads(json.dumps(state, default=float))


# -- scenarios -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ENGINES)
def test_nan_step_is_skipped_with_weights_and_optimizer_state_bit_identical(tmp_path, engine):
    rec = RUNNERS[engine](tmp_path, cfg(tmp_path), steps=6, faults={4: float("nan")})
    assert rec.error is None
    assert torch.equal(rec.weights[4], rec.weights[3])  # the NaN step changed no weight
    assert torch.equal(rec.opt_state[4], rec.opt_state[3])  # nor Adam's moments or step count
    assert not torch.equal(rec.weights[5], rec.weights[4])  # training went on
    assert rec.core.skipped_steps == 1 and rec.core.applied_steps == 5
    assert rec.scheduler.last_epoch == 5  # the schedule did not move for the skipped step
    assert any(e["type"] == "finding" and e["kind"] == "nonfinite_loss" and e["step"] == 4 for e in rec.sink.events)


@pytest.mark.parametrize("engine", ENGINES)
def test_spike_rolls_back_and_the_lr_multiplier_survives_the_scheduler(tmp_path, engine):
    c = cfg(tmp_path, recovery={"snapshot_interval": 3, "confirm_steps": 1}, lr={"rewarm_steps": 2})
    rec = RUNNERS[engine](tmp_path, c, steps=12, faults={7: 50.0, 8: 50.0}, opt_kind="sgd")
    assert rec.error is None
    rb = actions(rec, "rollback")
    assert len(rb) == 1 and rb[0]["step"] == 8 and rb[0]["params"]["to_step"] == 3
    assert torch.equal(rec.weights[8], rec.weights[3])  # exactly the healthy snapshot's weights
    assert len(actions(rec, "lower_lr")) == 1
    mult = rec.core.lr.current()
    assert mult < 0.5
    for k in (11, 12):  # after the re-warm-up: effective LR = the scheduler's LR x the multiplier
        assert rec.eff_lr[k] == pytest.approx(rec.sched_lr[k] * mult, rel=1e-3)
    assert rec.sched_lr[12] < rec.sched_lr[9]  # the scheduler kept its own course (decaying)
    # never baked into the schedule: outside a step the optimizer holds the scheduler's own value
    assert rec.optimizer.param_groups[0]["lr"] == pytest.approx(rec.scheduler.get_last_lr()[0])


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("raises", [True, False])
def test_halt_writes_the_diagnosis_then_raises_or_only_stops(tmp_path, engine, raises):
    c = cfg(tmp_path, policy={"ladder": [["halt"]]}, recovery={"snapshot_interval": 0},
            output={"halt_raises": raises})
    if raises:
        rec = RUNNERS[engine](tmp_path, c, steps=12, faults={6: 50.0, 7: 50.0})
    else:
        with pytest.warns(gg.GradGuardWarning, match="gradguard halted"):
            rec = RUNNERS[engine](tmp_path, c, steps=12, faults={6: 50.0, 7: 50.0})
    assert isinstance(rec.error, gg.GradGuardHalt) is raises
    assert max(rec.weights) == 7  # training stopped at the halting step
    assert torch.equal(rec.weights[7], rec.weights[6])  # which was not applied
    path = rec.core.diagnosis_path
    assert path is not None and os.path.isfile(path)
    with open(path, encoding="utf-8") as fh:
        diag = json.load(fh)
    assert diag["step"] == 7 and diag["recent_findings"][-1]["kind"] == "loss_spike"
    if raises:
        assert rec.error.diagnosis["step"] == 7
    halts = [e for e in rec.sink.events if e["type"] == "halt"]
    assert len(halts) == 1 and halts[0]["step"] == 7


@pytest.mark.parametrize("engine", ENGINES)
def test_resume_restores_the_guard_exactly(tmp_path, engine):
    c = cfg(tmp_path, recovery={"snapshot_interval": 2, "confirm_steps": 1})
    first = RUNNERS[engine](tmp_path, c, steps=8, faults={4: 50.0, 5: 50.0}, save_at=6)
    assert first.error is None and first.saved_state is not None
    assert first.saved_state["action_counts"].get("rollback") == 1  # a non-trivial state to restore
    resumed = RUNNERS[engine](tmp_path / "b", c, steps=7, resume_from=checkpoint_of(engine, tmp_path, 6))
    assert resumed.restored_state is not None
    want, got = normalised(first.saved_state), normalised(resumed.restored_state)
    if engine == "hf":
        # the Trainer writes trainer_state.json before callbacks' on_save: the newest checkpoint
        # entry of the tier is missing from the resumed state (issue 16)
        want.pop("checkpoints"), got.pop("checkpoints")
    assert got == want
    assert resumed.core.step_count == 7 and resumed.core.lr.global_mult == first.saved_state["lr"]["global_mult"]


@pytest.mark.parametrize("engine", ENGINES)
def test_monitor_mode_is_bit_identical_to_no_guard(tmp_path, engine):
    faults = {4: 5.0}
    plain = RUNNERS[engine](tmp_path / "a", None, steps=6, faults=faults, guard=False)
    mon = RUNNERS[engine](tmp_path / "b", cfg(tmp_path, "monitor"), steps=6, faults=faults)
    for k in range(1, 7):
        assert torch.equal(plain.weights[k], mon.weights[k]) and torch.equal(plain.opt_state[k], mon.opt_state[k])
    assert mon.core.step_count == 6 and mon.core.skipped_steps == 0 and not mon.core.action_counts
    assert not any(mon.wrapped_training_step)  # monitor mode installs no training_step wrapper


def test_metric_names_are_identical_across_engines(tmp_path):
    names = {}
    for engine in ENGINES:
        rec = RUNNERS[engine](tmp_path / engine, cfg(tmp_path / engine), steps=3)
        assert rec.sink.metrics, engine
        names[engine] = set().union(*(m.keys() for _, m in rec.sink.metrics))
    assert names["plain"] == names["hf"] == names["lightning"]
    assert "gradguard/grad_norm/total" in names["plain"] and any("/grad_norm/block" in n for n in names["plain"])


@pytest.mark.parametrize("engine", ENGINES)
def test_trust_rule_is_the_same_in_every_engine(tmp_path, engine):
    """A checkpoint is trusted after recovery.confirm_steps healthy steps (3 here), in every engine."""
    if engine == "plain":
        pytest.skip("the plain loop has no engine checkpoints: its snapshots follow the same rule (test_snapshot)")
    c = cfg(tmp_path, recovery={"snapshot_interval": 0, "confirm_steps": 3})
    rec = RUNNERS[engine](tmp_path, c, steps=6, save_at=2)
    tier = {e["step"]: e for e in rec.core.checkpoint_tier.state_dict()}
    assert tier[2]["tested"] and tier[2]["healthy"] == 3  # steps 3, 4, 5 confirmed it
    assert 4 in tier and not tier[4]["tested"] and tier[4]["healthy"] == 2  # only steps 5 and 6 so far
    assert all(not math.isnan(e["step"]) for e in tier.values())


@pytest.mark.parametrize("engine", ["hf", "lightning"])
def test_clip_conflict_is_resolved_the_same_way_in_every_engine(tmp_path, engine):
    """The engine's clip setting becomes the guard's starting clip.max_norm; set both differently: error."""
    adopted = RUNNERS[engine](tmp_path / "a", cfg(tmp_path / "a"), steps=2, engine_clip=0.3)
    assert adopted.core.clip.max_norm == 0.3 and adopted.core.max_grad_norm == 0.3
    with pytest.raises(gg.ConfigError, match=r"0\.3.*conflicts with GuardConfig.clip.max_norm=0\.5.*Fix:"):
        RUNNERS[engine](tmp_path / "b", cfg(tmp_path / "b", clip={"max_norm": 0.5}), steps=2, engine_clip=0.3)
    # the guard does not clip (monitor): the engine's own clipping is left in force, as without a guard
    mon = RUNNERS[engine](tmp_path / "c", cfg(tmp_path / "c", "monitor"), steps=3, engine_clip=0.3, faults={2: 5.0})
    ref = RUNNERS[engine](tmp_path / "d", None, steps=3, engine_clip=0.3, guard=False, faults={2: 5.0})
    assert mon.core.max_grad_norm is None and torch.equal(mon.weights[3], ref.weights[3])


def test_refusal_is_an_error_when_acting_and_a_stand_aside_warning_in_monitor_mode():
    """The refusal rule every adapter applies to a setup it cannot guard (DeepSpeed, FSDP, LOMO)."""
    from gradguard.adapter import refuse_unsupported

    problems = {"Trainer(strategy=DeepSpeedStrategy)": "DeepSpeed steps inside its engine. Fix: train with DDP"}
    with pytest.raises(gg.UnsupportedSetupError, match="DeepSpeedStrategy.*Fix: train with DDP"):
        refuse_unsupported(gg.GuardConfig(), problems)
    with pytest.warns(gg.GradGuardWarning, match="stands aside"):
        assert refuse_unsupported(gg.GuardConfig.preset("monitor"), problems) is False
    assert refuse_unsupported(gg.GuardConfig(), {}) is True


@pytest.mark.parametrize("preset", ["default", "monitor"])
def test_an_optimizer_less_module_trains_with_one_warning_and_the_guard_aside(tmp_path, monkeypatch, preset):
    """configure_optimizers returning None: Lightning trains with its mock optimizer (and a warning of
    its own); the guard has nothing to watch, says so once and stands aside in every mode: fit is never
    stopped by it."""
    import warnings

    L = pytest.importorskip("lightning.pytorch")
    from gradguard.lightning import GradGuardCallback

    class NoOpt(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            _build(self)

        def training_step(self, batch, batch_idx):
            return _loss(self, batch["input_ids"], batch["labels"])

        def configure_optimizers(self):
            return None

    monkeypatch.chdir(tmp_path)
    cb = GradGuardCallback(gg.GuardConfig.preset(preset))
    trainer = L.Trainer(accelerator="cpu", max_steps=2, callbacks=[cb], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(NoOpt(), torch.utils.data.DataLoader(Data(16), batch_size=BS))
    ours = [w for w in caught if issubclass(w.category, gg.GradGuardWarning)]
    assert len(ours) == 1 and "stands aside" in str(ours[0].message), [str(w.message) for w in ours]
    assert "configure_optimizers" in str(ours[0].message)
    assert cb.core is None and trainer.global_step == 2  # the run Lightning accepts is not stopped
    assert os.listdir(tmp_path) == []  # and nothing of gradguard's was written


def test_stateful_pieces_round_trip_their_state(tmp_path):
    from gradguard._hf.steps import StepRunner
    from gradguard.recovery import CheckpointTier

    tier = CheckpointTier(2)
    tier.saved(3, ["a.ckpt"])
    tier.saved(6, ["b.ckpt"])
    tier.observe(4, healthy=True, bad=False)
    tier.observe(5, healthy=True, bad=False)
    tier.observe(7, healthy=False, bad=True)
    again = CheckpointTier(2)
    again.load_state_dict(json.loads(json.dumps(tier.state_dict())))
    assert again.state_dict() == tier.state_dict() and [e["step"] for e in again.candidates()] == [3]
    runner = StepRunner(core=None, args=None, params=[])
    runner.discard_left, runner.splits, runner.last_step_loss = 2, 4, 1.5
    other = StepRunner(core=None, args=None, params=[])
    other.load_state_dict(json.loads(json.dumps(runner.state_dict())))
    assert other.state_dict() == runner.state_dict()
    rec = run_plain(tmp_path, cfg(tmp_path, recovery={"snapshot_interval": 2, "confirm_steps": 1}), steps=6,
                    faults={3: 50.0, 4: 50.0})
    state = json.loads(json.dumps(rec.core.state_dict()))
    net = Net()
    fresh = gg.Guard(net, torch.optim.AdamW(net.parameters()), config=cfg(tmp_path / "x"))
    fresh.load_state_dict(state)
    assert normalised(fresh.state_dict()) == normalised(state)
