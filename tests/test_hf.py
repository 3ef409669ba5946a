"""GradGuardCallback inside a real transformers.Trainer (tiny GPT-2, CPU, offline byte text)."""

from __future__ import annotations

import json
import math
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import gradguard as gg  # noqa: E402
from gradguard.config import LRConfig  # noqa: E402
from gradguard.demo_model import load_corpus  # noqa: E402
from gradguard.hf import STATE_FILE, GradGuardCallback  # noqa: E402

#: the LR cut for an instability before the run learned anything (the default config)
EARLY = LRConfig().early_down_factor

transformers.logging.set_verbosity_error()
SEQ = 32
_DATA = load_corpus(60_000).long()


pytestmark = pytest.mark.usefixtures("one_thread")


class ByteDataset(torch.utils.data.Dataset):
    def __init__(self, n: int = 256) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = _DATA[i * SEQ:(i + 1) * SEQ]
        return {"input_ids": x, "labels": x}


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=256, n_positions=SEQ,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def cfg(tmp_path, preset: str = "default", **over) -> gg.GuardConfig:
    # report_to=[]: the Trainer keeps no log folder, so the event log goes to a named one
    over["output"] = {"console": False, "dir": str(tmp_path / "logs"), **over.get("output", {})}
    return gg.GuardConfig.preset(preset, **over)


def make_trainer(tmp_path, callbacks=(), steps: int = 8, model=None, **kw) -> Trainer:
    defaults = dict(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], max_steps=steps,
                    per_device_train_batch_size=4, learning_rate=2e-3, logging_steps=1, save_strategy="no",
                    disable_tqdm=True, seed=0, data_seed=0, dataloader_num_workers=0)
    eval_dataset = kw.pop("eval_dataset", None)
    defaults.update(kw)
    return Trainer(model=model or tiny_gpt2(), args=TrainingArguments(**defaults), train_dataset=ByteDataset(),
                   eval_dataset=eval_dataset, callbacks=list(callbacks))


def inject(trainer: Trainer, at: dict[int, float]) -> None:
    """Multiply the training loss of optimizer step ``k`` (1-based) by ``at[k]`` (nan allowed)."""

    def hook(module, args, output):
        if module.training and torch.is_grad_enabled():
            f = at.get(trainer.state.global_step + 1)
            if f is not None:
                output.loss = output.loss * f
        return output

    trainer.model.register_forward_hook(hook)


class Probe(TrainerCallback):
    """Records the Trainer's real state: weights, Adam step, LR schedule, effective LR, clipped grads."""

    def __init__(self) -> None:
        self.wte: list[torch.Tensor] = []
        self.adam_step: list[float] = []
        self.sched: list[int] = []
        self.eff_lr: dict[int, float] = {}
        self.sched_lr: dict[int, float] = {}
        self.grad_norm_at_step: dict[int, float] = {}
        self.batch_sizes: list[int] = []
        self.logs: list[dict] = []

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kw):
        self.model, self.opt, self.sched_obj, self.state = model, optimizer.optimizer, lr_scheduler, state
        self.wte.append(model.transformer.wte.weight.detach().clone())

        def pre(opt, a, k):  # runs after gradguard's own pre-hook: sees the effective LR and the final grads
            step = self.state.global_step + 1
            self.eff_lr[step] = opt.param_groups[0]["lr"]
            self.sched_lr[step] = self.sched_obj.get_last_lr()[0]
            grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
            self.grad_norm_at_step[step] = float(torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(x) for x in grads]))) if grads else 0.0

        self.opt.register_step_pre_hook(pre)
        model.register_forward_hook(
            lambda m, a, k, o: self.batch_sizes.append(k["input_ids"].shape[0]) if m.training else None,
            with_kwargs=True)

    def on_step_end(self, args, state, control, **kw):
        p = self.model.transformer.wte.weight
        self.wte.append(p.detach().clone())
        self.adam_step.append(float(self.opt.state[p]["step"]) if p in self.opt.state else 0.0)
        self.sched.append(self.sched_obj.last_epoch)

    def on_log(self, args, state, control, logs=None, **kw):
        self.logs.append(dict(logs))


def train_logs(trainer: Trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "loss" in h]


# -- measurement ------------------------------------------------------------------------------------
def test_monitor_is_bit_identical_and_reports_the_trainers_grad_norm(tmp_path):
    plain = make_trainer(tmp_path / "a", steps=6)
    plain.train()
    cb = GradGuardCallback(config=cfg(tmp_path, "monitor"))
    guarded = make_trainer(tmp_path / "b", [cb], steps=6)
    guarded.train()
    for (n, p), (_, q) in zip(plain.model.named_parameters(), guarded.model.named_parameters()):
        assert torch.equal(p, q), n  # monitor changes nothing, the Trainer's own clipping (1.0) included
    la, lb = train_logs(plain), train_logs(guarded)
    assert [h["loss"] for h in la] == [h["loss"] for h in lb]
    for h in lb:  # pre-clip, post-unscale total norm == the Trainer's grad_norm
        assert h["gradguard/grad_norm/total"] == pytest.approx(h["grad_norm"], rel=1e-5)
        assert h["gradguard/loss"] == pytest.approx(h["loss"], rel=1e-6, abs=1e-4)  # 4.57 logs 4 digits
        assert "gradguard/grad_norm/transformer_h_0" not in h  # per-layer values: report_to only, not printed
    assert any(h["grad_norm"] > 1.0 for h in la)  # the clip really was in use
    assert guarded.args.max_grad_norm == 1.0  # the user's value is back after training
    events = tmp_path / "logs" / "gradguard" / "events.jsonl"
    lines = [json.loads(x) for x in events.read_text().splitlines()]
    assert lines[0]["type"] == "start" and lines[-1]["type"] == "summary" and lines[-1]["steps"] == 6


@pytest.mark.parametrize("loss_kwargs", [True, False])
def test_step_loss_under_gradient_accumulation(tmp_path, loss_kwargs):
    cb = GradGuardCallback(config=cfg(tmp_path, "monitor"))
    tr = make_trainer(tmp_path, [cb], steps=3, gradient_accumulation_steps=3, per_device_train_batch_size=2)
    tr.model_accepts_loss_kwargs = loss_kwargs  # sum/num_items_in_batch semantics vs mean per micro-batch
    tr.train()
    logs = train_logs(tr)
    assert len(logs) == 3
    for h in logs:
        assert h["gradguard/loss"] == pytest.approx(h["loss"], rel=1e-5, abs=1e-4)  # 4.57 logs 4 digits
    assert cb.run.runner.sum_semantics is loss_kwargs


# -- actions ----------------------------------------------------------------------------------------
def test_nan_step_is_skipped_and_surfaced(tmp_path):
    probe = Probe()
    cb = GradGuardCallback(config=cfg(tmp_path))
    tr = make_trainer(tmp_path, [cb, probe], steps=6)
    inject(tr, {3: float("nan")})
    tr.train()
    rep = {r.step: r for r in cb.reports}
    assert rep[3].skipped and "non-finite" in rep[3].skip_reason and rep[4].applied
    assert torch.equal(probe.wte[3], probe.wte[2])  # weights untouched by step 3
    assert not torch.equal(probe.wte[4], probe.wte[3])
    assert probe.adam_step[:5] == [1.0, 2.0, 2.0, 3.0, 4.0]  # Adam's step count did not advance
    assert probe.sched[:5] == [1, 2, 2, 3, 4]  # nor did the LR schedule
    assert all(torch.isfinite(p).all() for p in tr.model.parameters())
    log3 = next(h for h in probe.logs if h.get("gradguard/nonfinite_loss_steps") == 1.0)
    assert math.isfinite(log3["loss"]) and math.isnan(log3["gradguard/loss"])  # the Trainer hides it, we do not


def test_loss_spike_rolls_back_lowers_lr_and_tightens_clip(tmp_path):
    probe = Probe()
    cb = GradGuardCallback(config=cfg(tmp_path))
    tr = make_trainer(tmp_path, [cb, probe], steps=8)
    inject(tr, {4: 4.0, 5: 4.0})  # an isolated spike is only skipped; a repeated one escalates
    tr.train()
    rep = {r.step: r for r in cb.reports}
    assert rep[4].skipped and not rep[4].actions
    names = [a.name for a in rep[5].actions]
    assert names[:3] == ["rollback", "lower_lr", "tighten_clip"] and rep[5].skipped
    assert torch.equal(probe.wte[5], probe.wte[0])  # restored to the initial snapshot, bitwise
    assert probe.adam_step[4] == 0.0  # optimizer state restored with it
    mult = cb.core.lr.global_mult
    assert mult == pytest.approx(EARLY)
    ratio = probe.eff_lr[6] / probe.sched_lr[6]  # the multiplier is applied inside the step only
    assert ratio == pytest.approx(EARLY / 26, rel=1e-6)  # the early cut, re-warm-up step 1 of 25
    assert tr.optimizer.param_groups[0]["lr"] == pytest.approx(tr.lr_scheduler.get_last_lr()[0])
    assert cb.max_grad_norm == 0.5
    for s in range(6, 9):  # the clip the Trainer's optimizer really saw
        assert probe.grad_norm_at_step[s] <= 0.5 + 1e-4
    assert any(rep[s].total_norm > 0.5 for s in range(6, 9))
    assert tr.args.max_grad_norm == 1.0


def test_adam_and_layer_lr_actions_change_the_trainers_optimizer(tmp_path):
    probe = Probe()
    conf = cfg(tmp_path, policy={"ladder": [["adam", "lower_layer_lr"]]}, recovery={"snapshot_interval": 0})
    cb = GradGuardCallback(config=conf)
    tr = make_trainer(tmp_path, [cb, probe], steps=5, adam_beta2=0.999, adam_epsilon=1e-8)
    assert tr.args.adam_beta2 == 0.999
    inject(tr, {3: 4.0, 4: 4.0})
    tr.train()
    for g in tr.optimizer.param_groups:
        assert g["betas"][1] == 0.95 and g["eps"] == 1e-6
    assert cb.core.lr.layer_mult and min(cb.core.lr.layer_mult.values()) == pytest.approx(0.1)


def test_skip_data_window_and_shrink_batch(tmp_path):
    probe = Probe()
    conf = cfg(tmp_path, policy={"ladder": [["rollback", "shrink_batch"]]}, recovery={"skip_batches": 2})
    cb = GradGuardCallback(config=conf)
    tr = make_trainer(tmp_path, [cb, probe], steps=9)
    inject(tr, {4: 4.0, 5: 4.0})
    tr.train()
    acts = [a.name for r in cb.reports for a in r.actions]
    assert "shrink_batch" in acts and cb.core.action_counts["skip_data"] == 1
    assert tr.callback_handler.train_dataloader.batch_sampler.batch_size == 2
    assert probe.batch_sizes[0] == 4 and probe.batch_sizes[-1] == 2
    assert torch.equal(probe.wte[5], probe.wte[0])  # rollback
    assert torch.equal(probe.wte[7], probe.wte[5])  # steps 6 and 7: the skipped data window
    assert not torch.equal(probe.wte[8], probe.wte[7])
    assert probe.sched[2:7] == [3, 3, 3, 3, 3]  # the schedule holds during skipped steps
    assert tr.state.global_step == 9  # counters keep moving
    assert len(probe.batch_sizes) == 9 - 2  # the window's batches were drawn but never computed
    logged = {h["step"]: h["loss"] for h in train_logs(tr)}
    assert logged[6] == logged[7] == pytest.approx(cb.reports[2].loss, rel=1e-3)  # last healthy loss (step 3)


def test_halt_stops_saves_and_raises_with_a_diagnosis(tmp_path):
    cb = GradGuardCallback(config=cfg(tmp_path, policy={"max_skip_streak": 2}))
    tr = make_trainer(tmp_path, [cb], steps=10)
    inject(tr, {3: float("nan"), 4: float("nan")})
    with pytest.raises(gg.GradGuardHalt, match="consecutive skipped"):
        tr.train()
    assert tr.state.global_step == 4
    out = tmp_path / "out"
    diag = json.loads((tmp_path / "logs" / "gradguard" / "diagnosis.json").read_text())  # beside the event log
    assert diag["step"] == 4 and "consecutive" in diag["reason"]
    ckpt = out / "checkpoint-4"
    assert (ckpt / "diagnosis.json").is_file() and (ckpt / STATE_FILE).is_file()
    assert json.loads((ckpt / STATE_FILE).read_text())["guard"]["skipped_steps"] == 2


def test_fp16_overflow_is_detected_and_skipped(tmp_path):
    probe = Probe()
    cb = GradGuardCallback(config=cfg(tmp_path))
    tr = make_trainer(tmp_path, [cb, probe], steps=6)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    acc = tr.accelerator  # use_cpu + fp16 trains fp32: set up a real CPU GradScaler path by hand
    acc.scaler = scaler
    acc.unscale_gradients = lambda optimizer=None: scaler.unscale_(tr.optimizer.optimizer)

    class Blow(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step + 1 == 3:
                scaler._scale.fill_(3e38)  # loss x scale overflows fp32

    tr.add_callback(Blow())
    tr.train()
    rep = {r.step: r for r in cb.reports}
    assert rep[3].overflow and rep[3].skipped and "overflow" in rep[3].skip_reason
    assert rep[2].applied and not rep[2].overflow and rep[2].scale == 2.0 ** 10
    assert torch.equal(probe.wte[3], probe.wte[2])
    assert probe.sched[2] == probe.sched[1]
    assert scaler.get_scale() < 3e38
    assert any(f.kind == "overflow" for f in rep[3].findings) or rep[3].overflow


# -- logging, state ---------------------------------------------------------------------------------
def test_metrics_reach_reporters_added_before_the_callback(tmp_path):
    class Reporter(TrainerCallback):  # stands in for a report_to integration (they run first)
        def __init__(self):
            self.seen = []

        def on_log(self, args, state, control, logs=None, **kw):
            self.seen.append(dict(logs))

    rep = Reporter()
    cb = GradGuardCallback(config=cfg(tmp_path, "monitor"), layer_metrics=False)
    tr = make_trainer(tmp_path, [rep, cb], steps=4, logging_steps=2)
    tr.train()
    names = [type(c).__name__ for c in tr.callback_handler.callbacks]
    assert names.index("GradGuardCallback") < names.index("Reporter")
    train = [s for s in rep.seen if "loss" in s]
    assert len(train) == 2 and all("gradguard/grad_norm/total" in s for s in train)
    assert not any(k.startswith("gradguard/grad_norm/transformer") for k in train[0])


def test_checkpoint_carries_guard_state_and_resume_continues_it(tmp_path):
    cb = GradGuardCallback(config=cfg(tmp_path))
    tr = make_trainer(tmp_path, [cb], steps=6, save_strategy="steps", save_steps=6)
    inject(tr, {3: 4.0, 4: 4.0})
    tr.train()
    ckpt = tmp_path / "out" / "checkpoint-6"
    saved = json.loads((ckpt / STATE_FILE).read_text())["guard"]
    assert saved["step_count"] == 6 and saved["clip"]["max_norm"] == 0.5
    assert torch.load(ckpt / "training_args.bin", weights_only=False).max_grad_norm == 0.5
    ts = json.loads((ckpt / "trainer_state.json").read_text())
    assert ts["stateful_callbacks"]["GradGuardCallback"]["attributes"]["_resume_state"]["guard"]["step_count"] == 6

    probe = Probe()
    cb2 = GradGuardCallback(config=cfg(tmp_path))
    tr2 = make_trainer(tmp_path, [cb2, probe], steps=8, save_strategy="no")
    tr2.train(resume_from_checkpoint=str(ckpt))
    core = cb2.core
    assert core.step_count == 8 and cb2.reports[0].step == 7
    assert core.clip.max_norm == 0.5 and core.lr.global_mult == pytest.approx(cb.core.lr.global_mult)
    assert core.action_counts["rollback"] == 1
    ratio = probe.eff_lr[7] / probe.sched_lr[7]
    assert 0 < ratio < EARLY  # the lowered LR multiplier (the early cut, re-warming) survived the resume
    assert probe.grad_norm_at_step[7] <= 0.5 + 1e-4


# -- attach-time validation -------------------------------------------------------------------------
def _args(**kw):
    base = dict(deepspeed=None, fsdp="", optim="adamw_torch", max_grad_norm=1.0)
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_validation_errors_name_field_value_and_fix(tmp_path):
    from gradguard._hf.setup import validate

    cb = GradGuardCallback(config=cfg(tmp_path))
    opt = torch.optim.AdamW(tiny_gpt2().parameters())
    with pytest.raises(gg.ConfigError, match=r"deepspeed=.*gradient_clipping.*1\.0.*engine was not found.*Fix:"):
        validate(cb.config, _args(deepspeed={"gradient_clipping": 1.0}), opt)
    with pytest.raises(gg.UnsupportedSetupError, match=r"fsdp='full_shard'.*accelerate shards only on an "
                       r"accelerator.*Fix: .*ModelParallelStrategy.*fully_shard.*gradguard\.Guard"):
        validate(cb.config, _args(fsdp="full_shard"), opt)
    # FSDP / DeepSpeed enabled by `accelerate launch` (its plugin, not TrainingArguments): the Trainer says so
    launched = make_trainer(tmp_path, [], steps=2)
    launched.is_fsdp_enabled = True  # as accelerate's FSDP plugin sets it (on an accelerator only)
    with pytest.raises(gg.UnsupportedSetupError, match=r"Trainer\.is_fsdp_enabled=True.*Fix: "):
        validate(cb.config, _args(), opt, launched)
    launched.is_fsdp_enabled, launched.is_deepspeed_enabled = False, True
    with pytest.raises(gg.UnsupportedSetupError, match=r"Trainer\.is_deepspeed_enabled=True.*DeepSpeed steps.*Fix: "):
        validate(cb.config, _args(), opt, launched)
    launched.is_deepspeed_enabled = False
    assert validate(cb.config, _args(), opt, launched)  # the plain CPU Trainer: guarded
    with pytest.raises(gg.ConfigError, match=r"optim='adalomo'.*Fix:"):
        validate(cb.config, _args(optim="adalomo"), opt)
    with pytest.raises(gg.ConfigError, match=r"optimizer=object.*param_groups.*Fix:"):
        validate(cb.config, _args(), object())
    off = GradGuardCallback(config=cfg(tmp_path, clip={"mode": "off"}))
    with pytest.raises(gg.ConfigError, match=r"clip.mode='off'.*tighten_clip.*Fix:"):
        validate(off.config, _args(), opt)
    conflict = GradGuardCallback(config=cfg(tmp_path, clip={"max_norm": 0.5}))
    tr = make_trainer(tmp_path, [conflict], steps=2, max_grad_norm=0.3)
    with pytest.raises(gg.ConfigError, match=r"max_grad_norm=0\.3.*clip.max_norm=0\.5.*Fix:"):
        tr.train()
    with pytest.raises(TypeError, match="GuardConfig"):
        GradGuardCallback(config=42)


SCHEDULERS = {
    "linear": {}, "cosine": {}, "cosine_with_restarts": {"num_cycles": 2}, "polynomial": {"power": 2.0},
    "constant": {}, "constant_with_warmup": {}, "inverse_sqrt": {}, "cosine_with_min_lr": {"min_lr": 1e-4},
    "warmup_stable_decay": {"num_decay_steps": 3}, "reduce_lr_on_plateau": {"patience": 0, "factor": 0.5},
}


@pytest.mark.parametrize("kind", sorted(SCHEDULERS))
def test_lr_multiplier_holds_under_every_hf_scheduler(tmp_path, kind):
    probe = Probe()
    cb = GradGuardCallback(config=cfg(tmp_path))

    class Lower(TrainerCallback):  # the state after a lower_lr x0.3 (runs after gradguard's on_train_begin)
        def on_train_begin(self, args, state, control, **kw):
            cb.core.lr.global_mult = 0.3

    extra = {}
    if kind == "reduce_lr_on_plateau":
        extra = dict(eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=8, eval_dataset=ByteDataset(16))
    try:
        tr = make_trainer(tmp_path, [cb, Lower(), probe], steps=8, lr_scheduler_type=kind, warmup_steps=2,
                          lr_scheduler_kwargs=SCHEDULERS[kind], **extra)
    except ValueError as exc:  # not in this transformers version
        pytest.skip(str(exc)[:100])
    tr.train()
    seen = [s for s in probe.eff_lr if probe.sched_lr[s] > 0]
    assert len(seen) >= 6
    for s in seen:  # x0.3 inside every optimizer step, whatever the schedule did
        assert probe.eff_lr[s] == pytest.approx(0.3 * probe.sched_lr[s], rel=1e-6)
    # the schedule itself is untouched: between steps the optimizer holds the scheduler's value
    assert tr.optimizer.param_groups[0]["lr"] == pytest.approx(tr.lr_scheduler.get_last_lr()[0])
    assert len({round(probe.sched_lr[s], 9) for s in seen}) > 1 or kind in ("constant", "reduce_lr_on_plateau")
