"""The engines of the contract and fault-matrix tests: one runner per engine, the same tiny model.

Engines: the plain loop (``gradguard.Guard``), a real ``transformers.Trainer`` and a real
``lightning.Trainer``, all training the same tiny network (same parameter names, so the same layer
names and metric names) on the same byte data, a few CPU steps each. A new engine joins by adding
one runner to ``RUNNERS``; the scenarios (``tests/test_contract.py``, ``tests/test_fault_matrix.py``)
do not change.

Every runner takes ``injectors``: a function ``(model, optimizer, guard_or_callback) -> [Injector]``
called once the engine has built its optimizer (the injectors are attached by it and detached at
the end), and ``amp``: fp16 autocast with a real ``GradScaler`` (CPU).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import gradguard as gg
from gradguard.core import GuardCore
from gradguard.sinks import MemorySink

ENGINES = ["plain", "hf", "lightning"]
VOCAB, SEQ, BS = 64, 8, 4



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
    if kind == "lbfgs":  # a closure optimizer: refused at attach
        return torch.optim.LBFGS(params, lr=0.1)
    if kind == "adamw-fast":  # learns the toy mapping in ~20 steps (the fault matrix: faults hit a trained model)
        return torch.optim.AdamW(params, lr=2e-2)
    return torch.optim.AdamW(params, lr=3e-3)


def make_sched(opt, glitch: tuple[int, int] | None = None) -> torch.optim.lr_scheduler.LRScheduler:
    """A slow decay; ``glitch=(start, end)``: the LR x30 for the scheduler steps start..end-1."""
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (30.0 if glitch and glitch[0] <= s < glitch[1] else 1.0) / (1.0 + 0.05 * s))


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
        self.core: GuardCore | None = None
        self.guard: gg.Guard | None = None  # the plain engine's Guard (its state_dict adds the batches)
        self.callback = None
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler = None
        self.error: BaseException | None = None
        self.wrapped_training_step: list[bool] = []
        self.restored_state: dict | None = None
        self.saved_state: dict | None = None
        self.sink = MemorySink()
        self.injectors: list = []  # gradguard.testing injectors attached for the run
        self.log_path: str | None = None  # the guard's JSONL event log

    def events(self) -> list[dict]:
        """The run's events and metrics, as the JSONL log holds them."""
        return self.sink.events + [{"type": "metrics", "step": s, **m} for s, m in self.sink.metrics]

    def finish(self) -> None:
        for inj in self.injectors:
            inj.detach()
        core = self.core if self.core is not None else getattr(self.callback, "core", None)
        if core is not None:
            self.log_path = core.log_path

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
class PlainCheckpoints:
    """The plain loop's own checkpoint files as a ``gradguard.contract.CheckpointSource``: what any
    new engine writes to give the guard its checkpoints as a rollback tier."""

    def __init__(self, model: nn.Module, opt, sched) -> None:
        self.model, self.opt, self.sched = model, opt, sched

    def saved_paths(self, step: int) -> list[str]:
        return []

    def read(self, path: str, step: int) -> dict:
        from gradguard.recovery import check_weights, safe_load

        ck = safe_load(path)
        if ck["step"] != step:
            raise ValueError(f"holds step {ck['step']}, not {step}")
        check_weights(ck["model"], self.model.state_dict(), exact=True)
        return {"model": ck["model"], "optimizer": ck["opt"], "scheduler": ck["sched"], "scaler": None,
                "guard": json.loads(ck["guard"])}

    def restore(self, payload: dict) -> None:
        from gradguard.recovery import restore_training_state

        restore_training_state(self.model, self.opt, payload, restore_schedule=False, scheduler=self.sched)


def run_plain(tmp_path, config, steps, faults=None, opt_kind="adamw", guard=True, resume_from=None,
              save_at=None, engine_clip=None, hooks=None, injectors=None, amp=False, glitch=None) -> Record:
    """``Guard`` over a ``gradguard.data.BatchController`` (``guard.accumulate`` runs the step's
    micro-batches): the plain loop's loader handle, as the Trainers' loaders are theirs. With
    ``injectors`` (the fault matrix) see ``_run_plain_controller``."""
    from gradguard.data import BatchController

    if injectors is not None:
        return _run_plain_controller(tmp_path, config, steps, opt_kind, guard, injectors, amp)

    rec = Record()
    model = Net()
    model.faults = dict(faults or {})
    opt = make_opt(model.parameters(), opt_kind)
    sched = make_sched(opt, glitch)
    batches = BatchController(Data(), BS, shuffle=False)
    g = gg.Guard(model, opt, scheduler=sched, config=config, sinks=[rec.sink], batches=batches) if guard else None
    if g is not None:
        g.core.attach_checkpoints(PlainCheckpoints(model, opt, sched))
    start = 0
    if resume_from is not None:
        ck = torch.load(resume_from, weights_only=True)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        g.load_state_dict(json.loads(ck["guard"]))
        rec.restored_state = g.state_dict()
        start = ck["step"]
    rec.core, rec.model, rec.optimizer, rec.scheduler = (g.core if g else None), model, opt, sched
    rec.guard = g
    k = start
    model.step_fn = lambda: k + 1
    for hook in hooks or []:
        hook(model, lambda: k + 1)
    probe = _LRProbe(rec, lambda: k + 1)
    steps_iter = iter(batches)
    try:
        while k < steps:
            batch = next(steps_iter)
            report = None
            if g is None:
                (mb, _), = list(batch.micro_batches())
                model(**mb)["loss"].backward()
                if engine_clip is not None:  # the user's own clip, as the Trainers' max_grad_norm
                    torch.nn.utils.clip_grad_norm_(model.parameters(), engine_clip)
                opt.step()
                sched.step()
            else:
                try:
                    g.accumulate(batch, lambda mb: model(**mb)["loss"])
                    report = g.step()
                except gg.GradGuardHalt as exc:
                    rec.error = exc
            opt.zero_grad(set_to_none=True)
            k += 1
            rec.after_step(k, model, opt)
            if save_at and k % save_at == 0 and g is not None:
                path = str(tmp_path / f"plain-{k}.ckpt")
                g.core.checkpoint_saved(k, [path])  # before the guard's state is taken: it lists this file
                if k == save_at:
                    rec.saved_state = g.state_dict()
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                            "guard": json.dumps(g.state_dict()), "step": k}, path)
            if rec.error is not None or (report is not None and report.halt):
                break
    finally:
        probe.remove()
        if g is not None:
            g.close()
    return rec


def _run_plain_controller(tmp_path, config, steps, opt_kind, guard, injectors, amp) -> Record:
    from gradguard.data import BatchController

    rec = Record()
    model = Net()
    opt = make_opt(model.parameters(), opt_kind)
    sched = make_sched(opt)
    scaler = torch.amp.GradScaler("cpu") if amp else None
    batches = BatchController(Data(), batch_size=BS, shuffle=False, epochs=None)
    g = gg.Guard(model, opt, scheduler=sched, scaler=scaler, config=config, sinks=[rec.sink],
                 batches=batches) if guard else None
    rec.core, rec.model, rec.optimizer, rec.scheduler = (g.core if g else None), model, opt, sched
    rec.injectors = injectors(model, opt, g)
    k = 0
    try:
        for batch in batches:
            if k == steps:
                break
            report = None
            if g is not None:
                g.accumulate(batch, lambda mb: model(**mb)["loss"])
                report = g.step()
            else:
                (mb, _), = list(batch.micro_batches())
                loss = model(**mb)["loss"]
                if scaler is not None:
                    scaler.scale(loss).backward()
                    scaler.step(opt)
                    scaler.update()
                else:
                    loss.backward()
                    opt.step()
                sched.step()
            opt.zero_grad(set_to_none=True)
            k += 1
            rec.after_step(k, model, opt)
            if report is not None and report.halt:
                break
    except (gg.GradGuardHalt, torch.OutOfMemoryError) as exc:
        rec.error = exc
    finally:
        rec.finish()
        if g is not None:
            g.close()
    return rec


def run_hf(tmp_path, config, steps, faults=None, opt_kind="adamw", guard=True, resume_from=None,
           save_at=None, engine_clip=None, injectors=None, amp=False, hooks=None, glitch=None) -> Record:
    transformers = pytest.importorskip("transformers")
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from gradguard.hf import GradGuardCallback

    transformers.logging.set_verbosity_error()
    rec = Record()
    model = Net()
    model.faults = dict(faults or {})
    opt = make_opt(model.parameters(), opt_kind)
    sched = make_sched(opt, glitch)
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
                             fp16=amp, **save)
    trainer = Trainer(model=model, args=args, train_dataset=Data(), optimizers=(opt, sched),
                      callbacks=[c for c in (cb, Probe()) if c is not None])
    model.step_fn = lambda: trainer.state.global_step + 1
    for hook in hooks or []:
        hook(model, model.step_fn)
    probe = _LRProbe(rec, lambda: trainer.state.global_step + 1)
    rec.model, rec.optimizer, rec.scheduler = model, opt, sched
    if injectors is not None:
        rec.injectors = injectors(model, opt, cb)
    try:
        trainer.train(resume_from_checkpoint=resume_from)
    except (gg.GradGuardHalt, torch.OutOfMemoryError) as exc:
        rec.error = exc
    finally:
        probe.remove()
        rec.finish()
    rec.core = cb.core if cb is not None else None
    rec.trainer = trainer
    return rec


def run_lightning(tmp_path, config, steps, faults=None, opt_kind="adamw", guard=True, resume_from=None,
                  save_at=None, engine_clip=None, injectors=None, amp=False, hooks=None, glitch=None) -> Record:
    L = pytest.importorskip("lightning.pytorch")
    from gradguard.lightning import GradGuardCallback

    rec = Record()

    class LitNet(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            _build(self)

        def forward(self, input_ids, labels):
            return _loss(self, input_ids, labels)

        def training_step(self, batch, batch_idx):
            return self(batch["input_ids"], batch["labels"])  # through forward: its hooks see the step

        def configure_optimizers(self):
            opt = make_opt(self.parameters(), opt_kind)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": make_sched(opt, glitch), "interval": "step"}}

    model = LitNet()
    model.faults = dict(faults or {})
    cb = GradGuardCallback(config, sinks=[rec.sink]) if guard else None
    rec.callback = cb

    class Probe(L.Callback):
        def on_train_start(self, trainer, pl_module):
            if cb is not None and cb.core is not None and trainer.global_step > 0:
                rec.restored_state = cb.core.state_dict()
            if injectors is not None and not rec.injectors:  # the optimizer exists from here on
                rec.injectors = injectors(pl_module, trainer.optimizers[0], cb)

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
    plugins = []
    if amp:
        from lightning.pytorch.plugins import MixedPrecision

        plugins.append(MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu")))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=callbacks, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=bool(save_at),
                        default_root_dir=str(tmp_path / "pl"), num_sanity_val_steps=0, gradient_clip_val=engine_clip,
                        plugins=plugins)
    model.step_fn = lambda: trainer.global_step + 1
    for hook in hooks or []:
        hook(model, model.step_fn)
    probe = _LRProbe(rec, lambda: trainer.global_step + 1)
    rec.model = model
    try:
        trainer.fit(model, torch.utils.data.DataLoader(Data(), batch_size=BS, shuffle=False), ckpt_path=resume_from)
    except (gg.GradGuardHalt, torch.OutOfMemoryError) as exc:
        rec.error = exc
    finally:
        probe.remove()
        rec.finish()
    rec.optimizer = trainer.optimizers[0] if trainer.optimizers else None
    rec.scheduler = trainer.lr_scheduler_configs[0].scheduler if trainer.lr_scheduler_configs else None
    rec.core = cb.core if cb is not None else None
    rec.trainer = trainer
    return rec


RUNNERS = {"plain": run_plain, "hf": run_hf, "lightning": run_lightning}


def checkpoint_of(engine: str, tmp_path, step: int) -> str:
    if engine == "plain":
        return str(tmp_path / f"plain-{step}.ckpt")
    if engine == "hf":
        return str(tmp_path / "hf" / f"checkpoint-{step}")
    files = [f for f in os.listdir(tmp_path / "pl") if f.endswith(f"step={step}.ckpt")]
    return str(tmp_path / "pl" / files[0])


def actions(rec: Record, name: str) -> list[dict]:
    return [e for e in rec.sink.events if e["type"] == "action" and e["name"] == name]


def normalised(state: dict) -> dict:
    return json.loads(json.dumps(state, default=float))
