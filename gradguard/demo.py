"""``gradguard demo``: the seed's explosive AdamW setting, unguarded vs guarded, on the CPU."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from .config import GuardConfig
from .demo_model import ByteBatches, TinyGPT, evaluate, load_corpus
from .guard import GradGuardHalt, Guard

__all__ = ["DemoSetting", "train_run", "main"]


@dataclass(kw_only=True)
class DemoSetting:
    """One training run of the demo model."""

    steps: int = 250
    """Optimizer steps."""
    batch_size: int = 64
    """Sequences per step (the seed's 'large batch')."""
    seq_len: int = 32
    """Bytes per sequence."""
    width: int = 128
    """Model width."""
    n_layer: int = 2
    """Transformer blocks."""
    lr: float = 0.1
    """Peak learning rate (the explosive setting is far too high)."""
    beta2: float = 0.999
    """Adam beta2."""
    eps: float = 1e-8
    """Adam eps."""
    warmup: int = 0
    """Linear warm-up steps."""
    clip: float | None = None
    """max_grad_norm for an unguarded run (None: no clipping)."""
    seed: int = 0
    """Seed for init and data order."""


EXPLOSIVE = DemoSetting()
TUNED = DemoSetting(lr=3e-3, warmup=30, clip=1.0)


def train_run(setting: DemoSetting, *, guard_config: GuardConfig | None = None, out_dir: str | None = None,
              data: ByteBatches | None = None, eval_batches: list | None = None,
              sinks: list | None = None, progress: Any = None) -> dict[str, Any]:
    """Train once; returns final eval loss, non-finite steps, loss curve and the guard's summary.
    ``progress(step, loss)`` is called after every step (the demo's progress bar)."""
    torch.manual_seed(setting.seed)
    gen = torch.Generator().manual_seed(setting.seed)
    data = data or ByteBatches(load_corpus(), setting.seq_len)
    eval_batches = eval_batches or data.eval_batches(64, 8)
    model = TinyGPT(n_layer=setting.n_layer, width=setting.width, seq_len=setting.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=setting.lr, betas=(0.9, setting.beta2), eps=setting.eps,
                            weight_decay=0.01)
    warm = setting.warmup
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
    guard = None
    if guard_config is not None:
        guard = Guard(model, opt, scheduler=sched, config=guard_config, out_dir=out_dir, sinks=sinks)
    losses: list[float] = []
    nonfinite = 0
    halted = None
    t0 = time.perf_counter()
    try:
        for _ in range(setting.steps):
            x, y = data.train_batch(setting.batch_size, gen)
            loss = model(x, y)
            loss.backward()
            if guard is not None:
                report = guard.step(loss)
                lv = report.loss if report.loss is not None else float("nan")
            else:
                if setting.clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), setting.clip)
                opt.step()
                sched.step()
                lv = loss.item()
            opt.zero_grad(set_to_none=True)
            nonfinite += not math.isfinite(lv)
            losses.append(lv)
            if progress is not None:
                progress(len(losses), lv)
    except GradGuardHalt as exc:
        halted = str(exc)
    finally:
        if progress is not None and hasattr(progress, "close"):
            progress.close()
    seconds = time.perf_counter() - t0
    ev = evaluate(model, eval_batches)
    summary = guard.close() if guard is not None else None
    return {"eval_loss": ev, "nonfinite_steps": nonfinite, "losses": losses, "seconds": seconds,
            "peak_loss": max((v for v in losses if math.isfinite(v)), default=float("nan")),
            "halted": halted, "guard": summary}


def main(out: str | None = None, steps: int | None = None, seed: int = 0, quiet: bool = False) -> dict[str, Any]:
    out = out or os.path.join(os.getcwd(), "gradguard_demo")
    os.makedirs(out, exist_ok=True)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    kw = {"seed": seed} | ({"steps": steps} if steps else {})
    explosive = DemoSetting(**kw)
    tuned = DemoSetting(lr=TUNED.lr, warmup=TUNED.warmup, clip=TUNED.clip, **kw)
    data = ByteBatches(load_corpus(), explosive.seq_len)
    ev = data.eval_batches(64, 8)
    say = (lambda *a: None) if quiet else print
    say(f"gradguard demo: tiny byte-level GPT ({explosive.n_layer} layers, width {explosive.width}) on "
        f"Python stdlib text; AdamW lr={explosive.lr}, beta2={explosive.beta2}, eps={explosive.eps}, "
        f"no warmup, batch {explosive.batch_size}, no clipping; {explosive.steps} steps each.")
    runs = {}
    bar = (lambda name: None) if quiet else (lambda name: Progress(name, explosive.steps))
    say("[1/3] unguarded ...")
    runs["unguarded"] = train_run(explosive, data=data, eval_batches=ev, progress=bar("unguarded"))
    say("[2/3] guarded (GuardConfig()) ...")
    cfg = GuardConfig.preset("default", output={"dir": out, "console": not quiet, "metrics_interval": 1})
    runs["guarded"] = train_run(explosive, guard_config=cfg, out_dir=out, data=data, eval_batches=ev,
                                progress=bar("guarded"))
    say("[3/3] reference: hand-tuned (lr 3e-3, 30 warmup steps, clip 1.0) ...")
    runs["tuned"] = train_run(tuned, data=data, eval_batches=ev, progress=bar("tuned"))
    table = format_table(runs)
    say(table)
    report = _write_report(runs["guarded"]["guard"]["log"], say)
    runs["guarded"]["report"] = report
    summary = {k: {kk: vv for kk, vv in v.items() if kk != "losses"} for k, v in runs.items()}
    summary["curves"] = {k: v["losses"] for k, v in runs.items()}
    with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=1, default=str)
    say(f"event log: {runs['guarded']['guard']['log']}\nsummary: {os.path.join(out, 'summary.json')}")
    if report:
        say(f"report: {report}")
    return runs


class Progress:
    """A progress bar per demo arm on stderr: tqdm when installed, else one line every ``every``
    steps (the base install has only torch)."""

    def __init__(self, name: str, total: int, *, stream: Any = None, every: int | None = None) -> None:
        self.name, self.total = name, total
        self.stream = stream or sys.stderr
        self.every = every or max(1, total // 10)
        self.bar = None
        self.t0 = time.perf_counter()
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None  # type: ignore[assignment]
        if tqdm is not None and stream is None:
            self.bar = tqdm(total=total, desc=f"{name:>9}", unit="step", file=self.stream, leave=True,
                            dynamic_ncols=True)

    def __call__(self, step: int, loss: float) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"loss {loss:.3g}", refresh=False)
        elif step % self.every == 0 or step == self.total:
            rate = step / max(time.perf_counter() - self.t0, 1e-9)
            print(f"  {self.name}: step {step}/{self.total}, loss {loss:.3g}, {rate:.1f} steps/s",
                  file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _write_report(log: str | None, say: Any) -> str | None:
    """The guarded run's HTML report next to its log (None without plotly or without a log)."""
    if not log:
        return None
    try:
        from .report import write_report

        return write_report(log)
    except ImportError:
        say("report: not written: the HTML report needs plotly (pip install 'gradguard[report]')")
        return None


def format_table(runs: dict[str, dict[str, Any]]) -> str:
    tuned = runs.get("tuned", {}).get("eval_loss")
    rows = ["| run | final eval loss | vs tuned | peak train loss | non-finite steps | findings | actions | time |",
            "|---|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        g = r.get("guard") or {}
        acts = ", ".join(f"{k} x{v}" for k, v in (g.get("actions") or {}).items()) or "-"
        gap = f"{(r['eval_loss'] / tuned - 1) * 100:+.1f}%" if tuned else "-"
        rows.append(f"| {name} | {r['eval_loss']:.3f} | {gap} | {r['peak_loss']:.2f} | {r['nonfinite_steps']} | "
                    f"{g.get('findings', '-')} | {acts} | {r['seconds']:.0f}s |")
    return "\n".join(rows)
