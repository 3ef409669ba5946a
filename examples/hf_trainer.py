"""gradguard in an unmodified HF Trainer script: the one-line change is ``callbacks=[GradGuardCallback()]``.

A tiny GPT-2 from config trained on offline byte text (Python standard-library sources) with the
explosive settings from the user's notes: AdamW at a high LR, beta2 0.999, eps 1e-8, no warm-up,
a big batch, no clipping (max_grad_norm=0). Unguarded it diverges; guarded it recovers.
Needs the ``hf`` extra (``pip install -e ".[hf]"``; ``--tensorboard``: ``[tensorboard]``, ``--wandb``: ``[wandb]``).

    python examples/hf_trainer.py --no-guard      # unguarded
    python examples/hf_trainer.py                 # guarded
    python examples/hf_trainer.py --compare --out /tmp/hf_demo --tensorboard --wandb
                                                  # both, with TensorBoard and (offline) W&B
    python examples/hf_trainer.py --overhead      # monitor-mode step time vs no callback

Everything goes under ``--out`` (default: a new temporary folder): ``<out>/<run>/`` is the
Trainer's ``output_dir``, the guard's event log is ``<out>/<run>/gradguard/events.jsonl``
(``gradguard report <out>/<run>`` turns it into an HTML report), TensorBoard writes to
``<out>/<run>/tb`` and W&B to ``<out>/wandb`` (offline unless ``WANDB_API_KEY`` is set).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging as hf_logging

from gradguard import GuardConfig
from gradguard.demo_model import load_corpus
from gradguard.hf import GradGuardCallback

SEQ = 64


class Windows(torch.utils.data.Dataset):
    def __init__(self, data: torch.Tensor, stride: int) -> None:
        self.data, self.stride = data, stride
        self.n = (len(data) - SEQ - 1) // stride

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = self.data[i * self.stride:i * self.stride + SEQ]
        return {"input_ids": x, "labels": x}


def build(out: str, steps: int, lr: float, callbacks: list, seed: int = 0, report_to: list[str] | None = None,
          progress: bool = False, name: str | None = None) -> Trainer:
    data = load_corpus(600_000).long()
    split = int(len(data) * 0.9)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=SEQ,
                                       bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(
        output_dir=out, use_cpu=True, report_to=report_to or [], seed=seed, max_steps=steps, run_name=name,
        per_device_train_batch_size=64, learning_rate=lr, adam_beta2=0.999, adam_epsilon=1e-8,
        warmup_steps=0, lr_scheduler_type="constant", max_grad_norm=0.0,   # the user's explosive setting
        logging_steps=10, save_strategy="no", disable_tqdm=not progress, per_device_eval_batch_size=64,
    )
    return Trainer(model=model, args=args, train_dataset=Windows(data[:split], SEQ // 2),
                   eval_dataset=torch.utils.data.Subset(Windows(data[split:], SEQ), range(64 * 4)),
                   callbacks=callbacks)


class StepTimer(TrainerCallback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._t = 0.0

    def on_step_begin(self, args, state, control, **kw):
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.times.append(time.perf_counter() - self._t)


def overhead(steps: int, rounds: int) -> None:
    """Monitor mode vs no callback, interleaved in one process: median step time ratio."""
    med = {"none": [], "monitor": []}
    for _ in range(rounds):
        for kind in ("none", "monitor"):
            timer = StepTimer()
            cbs: list = [timer]
            if kind == "monitor":
                cbs.append(GradGuardCallback(GuardConfig.preset("monitor", output={"console": False})))
            with tempfile.TemporaryDirectory() as tmp:
                build(tmp, steps, 1e-3, cbs).train()
            t = sorted(timer.times[2:])
            med[kind].append(t[len(t) // 2])
    a, b = sorted(med["none"]), sorted(med["monitor"])
    ma, mb = a[len(a) // 2], b[len(b) // 2]
    print(f"median step: no callback {ma * 1e3:.1f} ms, monitor {mb * 1e3:.1f} ms, ratio {mb / ma:.3f}")


def run(guard: bool, steps: int, lr: float, out: str, *, tensorboard: bool = False, use_wandb: bool = False,
        progress: bool = True) -> dict:
    name = "guarded" if guard else "unguarded"
    folder = os.path.join(out, name)
    report_to = []
    if tensorboard:
        report_to.append("tensorboard")
        os.environ["TENSORBOARD_LOGGING_DIR"] = os.path.join(folder, "tb")  # transformers 5: no logging_dir
    if use_wandb:
        report_to.append("wandb")
    callbacks = [GradGuardCallback(out_dir=folder)] if guard else []   # <- the one-line change
    trainer = build(folder, steps, lr, callbacks, report_to=report_to, progress=progress, name=name)
    t0 = time.time()
    trainer.train()
    peak = max((h["loss"] for h in trainer.state.log_history if "loss" in h), default=float("nan"))
    ev = trainer.evaluate()["eval_loss"]
    summary = callbacks[0].summary if guard else {}
    if use_wandb:
        import wandb

        wandb.finish()  # one W&B run per arm
    return {"eval_loss": ev, "peak_train_loss": peak, "seconds": time.time() - t0,
            "actions": summary.get("actions", {}), "log": summary.get("log"), "out": folder}


def summary_line(name: str, r: dict) -> str:
    """One readable line per run, and where its event log is."""
    acts = ", ".join(f"{k} x{v}" for k, v in r["actions"].items()) or "none"
    line = (f"{name:9s}: final eval loss {r['eval_loss']:.3f}, peak logged train loss {r['peak_train_loss']:.3f}, "
            f"{r['seconds']:.0f}s, gradguard actions: {acts}")
    if r.get("log"):
        line += f"\n{'':11s}event log: {r['log']}  (HTML report: gradguard report {r['log']})"
    return line


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--guard", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--compare", action="store_true", help="unguarded and guarded, one after the other")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--out", default=None, help="folder for everything (default: a new temporary folder)")
    p.add_argument("--tensorboard", action="store_true", help="report_to tensorboard (<out>/<run>/tb)")
    p.add_argument("--wandb", action="store_true", help="report_to wandb (offline unless WANDB_API_KEY is set)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="hide the Trainer's progress bar")
    p.add_argument("--overhead", action="store_true", help="measure monitor-mode overhead instead")
    a = p.parse_args(argv)
    out = os.path.abspath(a.out or tempfile.mkdtemp(prefix="gradguard-hf-"))
    os.makedirs(out, exist_ok=True)
    if a.wandb:
        if not os.environ.get("WANDB_API_KEY"):
            os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_DIR", out)
        os.environ.setdefault("WANDB_PROJECT", "gradguard-examples")
    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)  # tiny model: one thread is fastest on a shared CPU
    if a.overhead:
        overhead(steps=30, rounds=3)
        return {}
    kinds = [False, True] if a.compare else [a.guard]
    res = {}
    for guard in kinds:
        name = "guarded" if guard else "unguarded"
        res[name] = run(guard, a.steps, a.lr, out, tensorboard=a.tensorboard, use_wandb=a.wandb, progress=a.progress)
    print()
    for name, r in res.items():
        print(summary_line(name, r))
    print(f"outputs: {out}" + (f"  (tensorboard --logdir {out})" if a.tensorboard else "")
          + (f"  (W&B offline runs: wandb sync {os.path.join(out, 'wandb')}/offline-run-*)"
             if a.wandb and os.environ.get("WANDB_MODE") == "offline" else ""))
    return res


if __name__ == "__main__":
    main()
