"""Shared harness of the rescue and overhead benchmarks: models, data, scenarios, arms, one run.

Everything is offline and deterministic under a seed: the corpus is the Python standard library's
own sources (``gradguard.demo_model.load_corpus``), models are built from scratch.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import platform
import statistics
import tempfile
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import gradguard
from gradguard.demo_model import ByteBatches, TinyGPT, evaluate, load_corpus

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


# ----------------------------------------------------------------------------------------------
# models
class ConvLM(nn.Module):
    """A byte-level causal dilated-convolution LM (WaveNet/ByteNet style), the non-transformer
    architecture of the benchmark: tok_emb, blocks.N (pre-norm residual causal conv), ln_f, lm_head."""

    def __init__(self, width: int = 64, n_layer: int = 3, kernel: int = 3) -> None:
        super().__init__()
        self.kernel = kernel
        self.tok_emb = nn.Embedding(256, width)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"norm": nn.LayerNorm(width), "conv": nn.Conv1d(width, 2 * width, kernel, dilation=2 ** i),
                           "proj": nn.Linear(width, width)})
            for i in range(n_layer))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, 256, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok_emb(x)
        for i, b in enumerate(self.blocks):
            z = F.pad(b["norm"](h).transpose(1, 2), ((self.kernel - 1) * 2 ** i, 0))
            a, g = b["conv"](z).transpose(1, 2).chunk(2, dim=-1)
            h = h + b["proj"](torch.tanh(a) * torch.sigmoid(g))
        logits = self.lm_head(self.ln_f(h))
        if y is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


#: model name -> (constructor(seq_len, width), explosive LR, description)
MODELS: dict[str, dict[str, Any]] = {
    "gpt": {"make": lambda seq, width: TinyGPT(n_layer=2, width=width, n_head=4, seq_len=seq),
            "explosive_lr": 0.1, "desc": "byte-level GPT (gradguard.demo_model.TinyGPT, 2 blocks)"},
    "conv": {"make": lambda seq, width: ConvLM(width=width, n_layer=3),
             "explosive_lr": 0.1, "desc": "byte-level gated causal dilated CNN (benchmarks.common.ConvLM, 3 blocks)"},
}


def make_model(name: str, seq_len: int, width: int) -> nn.Module:
    return MODELS[name]["make"](seq_len, width)


_DATA: dict[int, ByteBatches] = {}


def get_data(seq_len: int) -> ByteBatches:
    if seq_len not in _DATA:
        _DATA[seq_len] = ByteBatches(load_corpus(), seq_len)
    return _DATA[seq_len]


# ----------------------------------------------------------------------------------------------
# scenarios
@dataclass(kw_only=True)
class Scenario:
    """One training setting and the fault injected into it (all steps 1-based)."""

    name: str
    desc: str
    steps: int = 100
    batch: int = 32
    seq_len: int = 32
    width: int = 64
    lr: float = 3e-3
    """Peak LR (None-like 0: the model's explosive LR)."""
    warmup: int = 20
    beta2: float = 0.999
    eps: float = 1e-8
    fp16: bool = False
    fault: str | None = None
    """None, 'lr_spike', 'corrupt', 'nan', 'overflow'."""
    fault_start: int = 0
    fault_len: int = 0
    fault_scale: float = 1.0

    fault_jitter: int = 7
    """The fault starts at fault_start + fault_jitter * seed: faults land at different points of the
    snapshot cycle (the harness sets ``seed``)."""
    seed: int = 0
    clip: float | None = None
    """The user's own max_grad_norm (None: no clipping). Arms without a clip of their own apply it
    (``unguarded``, ``olmo_skip``, ``kill_spike``, the gradguard monitor); gradguard's acting
    presets own clipping and start from it."""
    pre_steps: int = 0
    """Steps of tuned training (lr 3e-3, 20 warm-up steps, clip 1.0, other batches) before the run:
    a pretrained-like start for the fine-tuning scenario."""
    kind: str = "fault"
    """'fault' (a loud instability is injected), 'quiet' (an instability that shows no spike) or
    'healthy' (no fault: a guard must leave it alone; counts false alarms)."""
    min_seeds: int = 0
    """Run at least this many seeds (0..min_seeds-1) whatever ``--seeds`` says."""

    def in_fault(self, step: int) -> bool:
        start = self.fault_start + self.fault_jitter * self.seed
        return self.fault is not None and start <= step < start + self.fault_len

    def lr_for(self, model: str) -> float:
        return self.lr if self.lr > 0 else MODELS[model]["explosive_lr"]


def scenarios(quick: bool = False) -> dict[str, Scenario]:
    steps = 60 if quick else 100
    f0 = 30 if quick else 55  # fault start: after the base LR warm-up and the detectors' warm-up
    fp_steps = 30 if quick else 50
    out = [
        Scenario(name="explosive", steps=steps, lr=0.0, warmup=0, width=128, batch=64,
                 desc="the seed's setting: AdamW at lr 0.1, beta2 0.999, eps 1e-8, no warm-up, no clipping, "
                      "large batch (64), width 128"),
        Scenario(name="lr_spike", steps=steps, fault="lr_spike", fault_start=f0, fault_len=10, fault_scale=30.0,
                 desc=f"base run (lr 3e-3, 20 warm-up steps); the schedule multiplies the LR by 30 for 10 steps from step {f0} + 7 x seed"),
        Scenario(name="corrupt", steps=steps, fault="corrupt", fault_start=f0, fault_len=8, fault_scale=100.0,
                 desc=f"base run; 8 corrupted batches from step {f0} + 7 x seed: random input bytes, every label one "
                      "random byte per batch, token embeddings scaled x100"),
        Scenario(name="nan", steps=steps, fault="nan", fault_start=f0, fault_len=1,
                 desc=f"base run; one NaN appears in the embedding output at step {f0} + 7 x seed"),
        Scenario(name="fp16", steps=fp_steps, batch=16, fp16=True, fault="overflow", fault_start=fp_steps // 2 - 5,
                 fault_len=fp_steps // 4, fault_scale=1e4, fault_jitter=3,
                 desc=f"base run in fp16 autocast with a real GradScaler (CPU); the final hidden states are scaled "
                      f"x1e4 for {fp_steps // 4} steps from step {fp_steps // 2 - 5} + 3 x seed: the fp16 logits overflow at "
                      "every one and the GradScaler halves its scale each time"),
        Scenario(name="quiet", steps=steps + steps // 2, lr=0.0, warmup=0, clip=1.0, kind="quiet", min_seeds=4,
                 desc="the explosive LR (0.1, no warm-up, beta2 0.999) at width 64, batch 32, with the engines' "
                      "default clip 1.0 applied by the user: clipping bounds every update, so on most seeds the "
                      "loss never spikes; it plateaus 15-25% above the tuned run (a quiet failure)"),
        Scenario(name="stable", steps=steps, kind="healthy",
                 desc="base run (lr 3e-3, 20 warm-up steps, no clipping), no fault: counts false alarms"),
        Scenario(name="stable_lr1e-2", steps=steps, lr=1e-2, kind="healthy",
                 desc="a higher LR that still trains well (1e-2, 20 warm-up steps), no fault"),
        Scenario(name="stable_b4", steps=steps, batch=4, kind="healthy",
                 desc="batch 4 (noisy gradients and losses), lr 3e-3, 20 warm-up steps, no fault"),
        Scenario(name="stable_b8", steps=steps, batch=8, clip=1.0, kind="healthy",
                 desc="batch 8 with the user's clip 1.0, lr 3e-3, 20 warm-up steps, no fault"),
        Scenario(name="finetune", steps=steps, lr=3e-4, warmup=0, pre_steps=100, kind="healthy",
                 desc="fine-tuning-like: 100 steps of tuned pre-training first (a pretrained-like init), then "
                      "lr 3e-4 without warm-up, no fault"),
    ]
    return {s.name: s for s in out}


def oracle_of(sc: Scenario) -> Scenario:
    """The tuned target: lower LR + warm-up + clipping (clip added by the oracle arm), no fault;
    the same model, length, batch, precision and start (a fine-tuning run's pre-training)."""
    return replace(sc, name="oracle", lr=3e-3, warmup=20, fault=None, fault_start=0, fault_len=0, clip=None,
                   kind="oracle", desc="tuned: lr 3e-3, 20 warm-up steps, clip 1.0, no fault")


# ----------------------------------------------------------------------------------------------
# arms: each owns the optimizer step (clip, skip, scaler, scheduler)
@dataclass
class Outcome:
    applied: bool = True
    alarm: bool = False
    stop: bool = False
    loss: float = float("nan")
    steps_lost: int = 0


class Arm:
    name = "arm"
    desc = ""
    guard_preset: str | None = None

    user_clip: float | None = None  # the scenario's own clip (set by the harness)

    def attach(self, model: nn.Module, opt: torch.optim.Optimizer, sched: Any, scaler: Any, out_dir: str) -> None:
        self.model, self.opt, self.sched, self.scaler = model, opt, sched, scaler

    # the plain step of a user's loop, with an optional clip and skip
    def _plain(self, loss: torch.Tensor, *, clip: float | None = None, skip: bool = False,
               pre: Any = None) -> Outcome:
        out = Outcome(loss=float(loss.detach()))
        if self.scaler is not None:
            self.scaler.unscale_(self.opt)
        if pre is not None:
            skip = pre(out) or skip
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        if self.scaler is not None:
            before = self.scaler.get_scale()
            if not skip:
                self.scaler.step(self.opt)
            self.scaler.update()
            if self.scaler.get_scale() < before:  # the scaler found inf and skipped the step
                out.applied = False
        elif not skip:
            self.opt.step()
        if skip:
            out.applied = False
            out.alarm = True
        self.sched.step()
        return out

    def step(self, loss: torch.Tensor) -> Outcome:
        return self._plain(loss, clip=self.user_clip)

    def finish(self) -> dict[str, Any]:
        return {}


class Unguarded(Arm):
    name, desc = "unguarded", "plain loop, no clipping"


class Clip(Arm):
    def __init__(self, max_norm: float) -> None:
        self.max_norm = max_norm
        self.name = f"clip{max_norm:g}"
        self.desc = f"clip_grad_norm_({max_norm:g}) every step"

    def step(self, loss: torch.Tensor) -> Outcome:
        return self._plain(loss, clip=self.max_norm)


class Oracle(Clip):
    def __init__(self) -> None:
        super().__init__(1.0)
        self.name, self.desc = "oracle", "tuned: lr 3e-3, 20 warm-up steps, clip 1.0 (the target loss)"


class ZClipArm(Arm):
    """The ``zclip`` package as its README shows: ``zclip.step(model)`` after backward (after
    ``scaler.unscale_`` with AMP), defaults (zscore, adaptive_scaling, z 2.5, alpha 0.97, max_grad_norm 1.0)."""

    name, desc = "zclip", "zclip.ZClip() defaults: z-score 2.5 adaptive clipping, max_grad_norm 1.0"

    def attach(self, model, opt, sched, scaler, out_dir) -> None:  # noqa: ANN001
        super().attach(model, opt, sched, scaler, out_dir)
        from zclip import ZClip

        self.zclip = ZClip(mode="zscore", alpha=0.97, z_thresh=2.5, clip_option="adaptive_scaling",
                           max_grad_norm=1.0, clip_factor=1.0)
        self.spikes = 0
        orig = self.zclip._compute_clip_val

        def counted(grad_norm: float) -> Any:
            v = orig(grad_norm)
            self._spike = v is not None
            return v

        self.zclip._compute_clip_val = counted

    def step(self, loss: torch.Tensor) -> Outcome:
        def pre(out: Outcome) -> bool:
            self._spike = False
            self.zclip.step(self.model)
            out.alarm = self._spike
            return False

        o = self._plain(loss, pre=pre)
        o.alarm = self._spike
        return o


class ARCArm(Arm):
    """ARC (``arc-training``; AGPL, a benchmark-only dependency, never imported by gradguard) as its
    README shows: ``action = controller.step(loss)`` after backward, before the optimizer step, and no
    step when ``action.should_skip`` (ARC rolled back or refused the update itself). The user's
    clip stays on."""

    name, desc = "arc", "arc.Controller(model, optimizer) defaults, the user's clip kept"

    def attach(self, model, opt, sched, scaler, out_dir) -> None:  # noqa: ANN001
        super().attach(model, opt, sched, scaler, out_dir)
        import arc

        with contextlib.redirect_stdout(io.StringIO()):
            self.ctl = arc.Controller(model, opt)
        self.actions: dict[str, int] = {}

    def step(self, loss: torch.Tensor) -> Outcome:
        def pre(out: Outcome) -> bool:
            with contextlib.redirect_stdout(io.StringIO()):
                a = self.ctl.step(loss)
            for name in ("rolled_back", "lr_reduced"):
                if getattr(a, name, False):
                    self.actions[name] = self.actions.get(name, 0) + 1
            out.alarm = bool(getattr(a, "should_skip", False))
            if out.alarm:
                self.actions["skip"] = self.actions.get("skip", 0) + 1
            return out.alarm

        return self._plain(loss, clip=self.user_clip, pre=pre)

    def finish(self) -> dict[str, Any]:
        return {"guard_actions": dict(self.actions)}


class OLMoSkip(Arm):
    """OLMo-core style skip-step: skip the update when the loss or the total grad norm exceeds
    mean + 6 sigma of the last 128 steps (active once 64 values are in the window; a non-finite
    value fails the test and is skipped). No clipping."""

    name, desc = "olmo_skip", "skip when loss or grad norm > mean + 6 sigma over the last 128 steps (OLMo-core style)"

    def attach(self, model, opt, sched, scaler, out_dir) -> None:  # noqa: ANN001
        super().attach(model, opt, sched, scaler, out_dir)
        self.losses: deque[float] = deque(maxlen=129)
        self.norms: deque[float] = deque(maxlen=129)

    @staticmethod
    def _ok(hist: deque[float], x: float) -> bool:
        if len(hist) < 64 + 1:
            return True
        prev = [v for v in list(hist)[:-1] if math.isfinite(v)]
        if len(prev) < 2:
            return math.isfinite(x)
        mean = statistics.fmean(prev)
        return (x - mean) <= 6 * statistics.stdev(prev)  # False for nan

    def step(self, loss: torch.Tensor) -> Outcome:
        def pre(out: Outcome) -> bool:
            norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), float("inf")))
            self.losses.append(out.loss)
            self.norms.append(norm)
            return not (self._ok(self.losses, out.loss) and self._ok(self.norms, norm))

        return self._plain(loss, pre=pre, clip=self.user_clip)


class KillLossSpike(Arm):
    """LLM Foundry ``KillLossSpike`` style: over a window of recent losses, a loss >= 2 x the window
    mean is an outlier; more than ``patience`` (4) outliers in a row, or every loss of a full window
    above the cap (10), stops the run. Window 20 (LLM Foundry uses >= 100 for long runs; scaled down
    to these 100-step runs)."""

    name, desc = "kill_spike", "stop the run on a sustained loss spike (LLM Foundry KillLossSpike style, window 20)"

    def attach(self, model, opt, sched, scaler, out_dir) -> None:  # noqa: ANN001
        super().attach(model, opt, sched, scaler, out_dir)
        self.window: deque[float] = deque(maxlen=20)
        self.outliers = 0

    def step(self, loss: torch.Tensor) -> Outcome:
        out = self._plain(loss, clip=self.user_clip)
        x = out.loss
        if len(self.window) == self.window.maxlen:
            mean = statistics.fmean(self.window)
            if not math.isfinite(x) or x >= 2 * mean:
                self.outliers += 1
                out.alarm = True
                if self.outliers > 4:
                    out.stop = True
            else:
                self.outliers = 0
            if all(v > 10 for v in self.window):
                out.stop = out.alarm = True
        if math.isfinite(x) and not out.alarm:
            self.window.append(x)
        return out


class GradGuardArm(Arm):
    def __init__(self, preset: str, name: str | None = None, **overrides: Any) -> None:
        self.preset, self.overrides = preset, overrides
        self.name = name or f"gradguard_{preset}"
        extra = "".join(f", {k}={v!r}" for k, v in overrides.items())
        self.desc = f"gradguard.Guard(GuardConfig.preset({preset!r}{extra})) owning clip + step"

    def attach(self, model, opt, sched, scaler, out_dir) -> None:  # noqa: ANN001
        super().attach(model, opt, sched, scaler, out_dir)
        overrides = dict(self.overrides)
        if self.user_clip is not None:  # an acting guard owns clipping and starts from the user's value
            overrides["clip"] = {"max_norm": self.user_clip, **overrides.get("clip", {})}
        cfg = gradguard.GuardConfig.preset(self.preset, output={"dir": out_dir, "console": False}, **overrides)
        self.guard = gradguard.Guard(model, opt, scheduler=sched, scaler=scaler, config=cfg)
        self.halted: str | None = None
        self.replay_clip = self.user_clip if cfg.clip.mode == "off" else None  # monitor: the user clips

    def step(self, loss: torch.Tensor) -> Outcome:
        if self.replay_clip is not None:
            if self.scaler is not None:
                self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.replay_clip)
        try:
            r = self.guard.step(loss)
        except gradguard.GradGuardHalt as exc:
            self.halted = str(exc)
            return Outcome(applied=False, alarm=True, stop=True, loss=float(loss.detach()))
        lost = sum(int(a.params.get("steps_lost", 0)) for a in r.actions if a.name == "rollback")
        alarm = any(f.severity != "info" for f in r.findings)
        return Outcome(applied=r.applied, alarm=alarm, loss=r.loss if r.loss is not None else float("nan"),
                       steps_lost=lost)

    def finish(self) -> dict[str, Any]:
        summary = self.guard.close()
        events: list[dict[str, Any]] = []
        findings: Counter[str] = Counter()
        if summary.get("log") and os.path.exists(summary["log"]):
            with open(summary["log"], encoding="utf-8") as fh:
                for line in fh:
                    e = json.loads(line)
                    if e.get("type") == "finding":
                        findings[e["kind"]] += 1
                        if e.get("severity") != "info" and len(events) < 40:
                            events.append({"step": e["step"], "finding": e["kind"], "msg": e.get("message", "")})
                    elif e.get("type") in ("action", "halt") and len(events) < 40:
                        params = {k: v for k, v in (e.get("params") or {}).items() if k != "rung"}
                        events.append({"step": e["step"], "action": e.get("name", e["type"]), "params": params})
        return {"guard_actions": summary.get("actions", {}), "guard_findings": dict(findings),
                "guard_skipped": summary.get("skipped", 0), "halted": self.halted, "events": events,
                "transfers": getattr(self.guard, "core", self.guard).measurer.transfers}


ARMS = {
    "unguarded": Unguarded, "clip1": lambda: Clip(1.0), "clip0.5": lambda: Clip(0.5), "zclip": ZClipArm,
    "olmo_skip": OLMoSkip, "kill_spike": KillLossSpike, "gradguard_default": lambda: GradGuardArm("default"),
    "gradguard_monitor": lambda: GradGuardArm("monitor"),
}
#: Arms outside the default suite, selectable with ``--arms`` (other presets, settings under study).
EXTRA_ARMS = {
    "gradguard_adaptive": lambda: GradGuardArm("adaptive"),
    "gradguard_conservative": lambda: GradGuardArm("conservative"),
    "gradguard_snap10": lambda: GradGuardArm("default", "gradguard_snap10", recovery={"snapshot_interval": 10}),
    # the closest rival (``pip install arc-training``; AGPL, a benchmark-only dependency)
    "arc": ARCArm,
}
ALL_ARMS = {**ARMS, **EXTRA_ARMS}


# ----------------------------------------------------------------------------------------------
# one run
class FaultHooks:
    """Forward hook on the token embedding that injects the scenario's activation faults."""

    def __init__(self, model: nn.Module, sc: Scenario) -> None:
        self.sc = sc
        self.step = 0
        self.handle = model.tok_emb.register_forward_hook(self._hook)
        self.handle2 = model.ln_f.register_forward_hook(self._hook_final)

    def remove(self) -> None:
        self.handle.remove()
        self.handle2.remove()

    def _hook_final(self, mod: nn.Module, inp: Any, out: torch.Tensor) -> torch.Tensor | None:
        if mod.training and self.sc.fault == "overflow" and self.sc.in_fault(self.step):
            return out * self.sc.fault_scale
        return None

    def _hook(self, mod: nn.Module, inp: Any, out: torch.Tensor) -> torch.Tensor | None:
        if not mod.training or not self.sc.in_fault(self.step):
            return None
        if self.sc.fault == "nan":
            out = out.clone()
            out[0, 0, 0] = float("nan")
            return out
        if self.sc.fault == "corrupt":
            return out * self.sc.fault_scale
        return None


def run_one(model_name: str, sc: Scenario, arm_name: str, seed: int, eval_batches: int = 4) -> dict[str, Any]:
    """Train one (model, scenario, arm, seed); returns the per-run record."""
    torch.manual_seed(seed)
    sc = replace(sc, seed=seed)
    data = get_data(sc.seq_len)
    gen = torch.Generator().manual_seed(seed)
    noise = torch.Generator().manual_seed(10_000 + seed)
    evb = data.eval_batches(64, eval_batches)
    model = make_model(model_name, sc.seq_len, sc.width)
    if sc.pre_steps:  # a pretrained-like start: tuned training on batches of its own
        pre_gen = torch.Generator().manual_seed(20_000 + seed)
        pre_opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        for s in range(sc.pre_steps):
            for g in pre_opt.param_groups:
                g["lr"] = 3e-3 * min(1.0, (s + 1) / 20)
            x, y = data.train_batch(32, pre_gen)
            model(x, y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            pre_opt.step()
            pre_opt.zero_grad(set_to_none=True)
        del pre_opt
    lr = sc.lr_for(model_name)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, sc.beta2), eps=sc.eps, weight_decay=0.01)
    warm = sc.warmup

    def lam(s: int) -> float:  # s: scheduler steps taken (0-based), the user's schedule
        f = min(1.0, (s + 1) / warm) if warm else 1.0
        if sc.fault == "lr_spike" and sc.in_fault(s + 1):
            f *= sc.fault_scale
        return f

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    scaler = torch.amp.GradScaler("cpu") if sc.fp16 else None
    arm = Oracle() if arm_name == "oracle" else ALL_ARMS[arm_name]()
    arm.user_clip = sc.clip
    tmp = tempfile.TemporaryDirectory(prefix="gg-bench-")
    arm.attach(model, opt, sched, scaler, tmp.name)
    hooks = FaultHooks(model, sc)
    losses: list[float] = []
    applied = skipped = skipped_outside = alarms = nonfinite = lost = 0
    stopped_at: int | None = None
    t0 = time.perf_counter()
    for step in range(1, sc.steps + 1):
        hooks.step = step
        x, y = data.train_batch(sc.batch, gen)
        if sc.fault == "corrupt" and sc.in_fault(step):
            x = torch.randint(0, 256, x.shape, generator=noise)
            y = torch.randint(0, 256, (y.shape[0], 1), generator=noise).expand_as(y).contiguous()
        with torch.autocast("cpu", dtype=torch.float16, enabled=sc.fp16):
            loss = model(x, y)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        o = arm.step(loss)
        opt.zero_grad(set_to_none=True)
        losses.append(o.loss)
        nonfinite += not math.isfinite(o.loss)
        alarms += o.alarm
        lost += o.steps_lost
        if o.applied:
            applied += 1
        else:
            skipped += 1
            skipped_outside += not sc.in_fault(step)
        if o.stop:
            stopped_at = step
            break
    seconds = time.perf_counter() - t0
    hooks.remove()
    ev = evaluate(model, evb)
    extra = arm.finish()
    tmp.cleanup()
    n_done = len(losses)
    steps_lost = skipped + lost + (sc.steps - n_done)
    step_s = seconds / max(1, n_done)
    finite = [v for v in losses if math.isfinite(v)]
    rec = {
        "model": model_name, "scenario": sc.name, "arm": arm_name, "seed": seed, "steps": sc.steps,
        "eval_loss": ev if math.isfinite(ev) else None, "finite": math.isfinite(ev),
        "final_train_loss": statistics.fmean(finite[-10:]) if finite else None,
        "peak_train_loss": max(finite) if finite else None,
        "nonfinite_steps": nonfinite, "applied": applied, "skipped": skipped, "skipped_outside_fault": skipped_outside,
        "stopped_at": stopped_at, "alarms": alarms, "steps_lost": steps_lost,
        "time_lost_s": round(steps_lost * step_s, 3), "seconds": round(seconds, 3),
        "step_ms": round(step_s * 1000, 2),
        "losses": [round(v, 4) if math.isfinite(v) else None for v in losses],
    }
    rec.update(extra)
    return rec


# ----------------------------------------------------------------------------------------------
# scoring
DIVERGED_RATIO = 1.25
"""A run diverged when its eval loss is non-finite or above 1.25 x the oracle's."""
RESCUE_RATIO = 1.10
"""A run is rescued when it finished (not stopped), its eval loss is finite and within 10% of the
oracle's (the fault-free base run without clipping already ends up to ~5% above the clipped oracle
after 100 steps, so a tighter bound would fail clean runs) (same model, seed, precision, steps), and at most 10% of its steps were skipped outside
the fault window."""
MAX_SKIP_FRAC = 0.10


def score(rec: dict[str, Any], oracle_loss: float) -> dict[str, Any]:
    ev = rec["eval_loss"]
    gap = None if ev is None else ev / oracle_loss - 1
    diverged = ev is None or ev > DIVERGED_RATIO * oracle_loss
    too_many_skips = rec["skipped_outside_fault"] > MAX_SKIP_FRAC * rec["steps"]
    rescued = (ev is not None and ev <= RESCUE_RATIO * oracle_loss and rec["stopped_at"] is None
               and not too_many_skips)
    return {"oracle_loss": oracle_loss, "gap": gap, "diverged": diverged, "rescued": rescued,
            "too_many_skips": too_many_skips}


def machine_tag() -> str:
    dev = "cpu"
    return f"{dev}{torch.get_num_threads()}"


def _git() -> dict[str, Any]:
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "gradguard"], cwd=root, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"git_commit": head, "gradguard_uncommitted_changes": bool(dirty)}


def environment() -> dict[str, Any]:
    return _git() | {"python": platform.python_version(), "torch": torch.__version__, "gradguard": gradguard.__version__
            if hasattr(gradguard, "__version__") else "dev", "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def write_json(path: str, obj: Any) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=1, default=str)


def write_results(stem: str, doc: dict[str, Any], md: str) -> None:
    """A benchmark's results: ``<stem>.json`` (the whole document) and ``<stem>.md`` (its table)."""
    write_json(stem + ".json", doc)
    with open(stem + ".md", "w", encoding="utf-8") as fh:
        fh.write(md)


def as_dict(sc: Scenario) -> dict[str, Any]:
    return asdict(sc)


__all__ = ["ConvLM", "MODELS", "Scenario", "scenarios", "oracle_of", "ARMS", "EXTRA_ARMS", "ALL_ARMS", "run_one", "score",
           "RESCUE_RATIO", "DIVERGED_RATIO", "MAX_SKIP_FRAC", "machine_tag", "environment", "write_json", "write_results",
           "as_dict", "RESULTS_DIR", "field"]
