"""The engine arms of the compound benchmark (``benchmarks/compound.py --engine hf|lightning``).

Each runner trains one generated run exactly as ``compound.train`` does in the plain loop, but
inside an unmodified engine, unguarded or with that engine's ``GradGuardCallback`` (the default
preset, console off, the event log in a temporary folder):

* the same model at its start (the same seed; the pre-training of a fine-tuning run done before);
* the same data in the same order: the batches ``compound.batches`` draws, garbage at the fault
  steps, served in order (HF: an ``IterableDataset`` of their rows, batched by the Trainer's own
  loader at 16; Lightning: a ``DataLoader`` over the ready batches, ``batch_size=None``). More batches
  than steps follow (the same stream continued), so an engine that skips a data window after a
  rollback still finds data;
* the same optimizer and schedule: AdamW(0.9, 0.95), weight decay 0.01, and the run's ``LambdaLR``
  (warm-up then cosine, the LR x30 of an LR spike), handed to the engine (HF:
  ``optimizers=(opt, sched)``; Lightning: ``configure_optimizers`` with ``interval="step"``), which
  steps it after every optimizer step;
* the forward-hook faults (embeddings x100, a NaN) keyed on the engine's global step (the step
  being trained = ``global_step + 1``);
* the run's clip as the engine's own setting (HF ``max_grad_norm``, 0 without one; Lightning
  ``gradient_clip_val``, None without one): the guard starts from it as in the plain loop;
* the same eval batches after training.

The family model (forward ``(x, y) -> loss``) is wrapped: HF gets ``forward(input_ids, labels)``
returning ``{"loss": ...}``, Lightning a ``LightningModule`` whose ``training_step`` returns the loss.
The wrappers hold it as ``model``, so the guard's layer names carry a ``model.`` prefix.

``recipe`` is the ``compound`` module itself (``start``, ``optimizer``, ``batches``, ``fault_hooks``,
``eval_batches``, ``BATCH``): this file holds only what differs per engine.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import math
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import gradguard
from gradguard.demo_model import evaluate


def _quiet() -> None:
    for name in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with contextlib.suppress(ImportError):
        import transformers

        transformers.logging.set_verbosity_error()


def _guard_config(out_dir: str) -> gradguard.GuardConfig:
    return gradguard.GuardConfig.preset("default", output={"dir": out_dir, "console": False})


def _events(out_dir: str) -> list[dict[str, Any]]:
    """The guard's non-info findings, actions and halts (the first 40), as the plain arm reports them."""
    events: list[dict[str, Any]] = []
    for path in glob.glob(f"{out_dir}/**/events.jsonl", recursive=True):
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                e = json.loads(line)
                if e.get("type") == "finding" and e.get("severity") != "info":
                    events.append({"step": e["step"], "finding": e["kind"], "msg": e.get("message", "")})
                elif e.get("type") in ("action", "halt"):
                    params = {k: v for k, v in (e.get("params") or {}).items() if k != "rung"}
                    events.append({"step": e["step"], "action": e.get("name", e["type"]), "params": params})
    return events[:40]


def _result(model: nn.Module, data: Any, recipe: Any, summary: dict[str, Any] | None, halted: str | None,
            out_dir: str) -> dict[str, Any]:
    ev = evaluate(model, recipe.eval_batches(data))
    summary = summary or {}
    return {"eval": ev if math.isfinite(ev) else float("inf"), "skipped": int(summary.get("skipped", 0) or 0),
            "actions": dict(Counter(summary.get("actions", {}))), "halted": halted, "events": _events(out_dir)}


def _ready_batches(recipe: Any, run: Any, data: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The run's batches for its steps, then as many again from the same stream (data skipped after a
    rollback must not end the epoch early)."""
    return list(recipe.batches(run, data, 2 * run.steps))


# -- HF Trainer -------------------------------------------------------------------------------------
class _Rows(torch.utils.data.IterableDataset):
    """The ready batches row by row, in order: the Trainer's loader (batch 16, no sampler for an
    iterable dataset) puts them back together as they were."""

    def __init__(self, ready: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.ready = ready

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for x, y in self.ready:
            for i in range(len(x)):
                yield {"input_ids": x[i], "labels": y[i]}


class HFLM(nn.Module):
    """A family model as the Trainer calls it: ``forward(input_ids, labels) -> {"loss": ...}``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        if labels is None:
            return {"logits": self.model(input_ids)}
        return {"loss": self.model(input_ids, labels)}


def _guard(cls_path: str, guarded: bool, out_dir: str) -> Any:
    """The engine's GradGuardCallback (``cls_path``: its module) for a guarded run, else None."""
    if not guarded:
        return None
    import importlib

    return importlib.import_module(cls_path).GradGuardCallback(_guard_config(out_dir), out_dir=out_dir)


def _train(fit: Callable[[], Any], hooks: list[Any]) -> str | None:
    """Train (warnings off), remove the fault hooks; the halt's message, if the guard halted."""
    halted = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            fit()
        except gradguard.GradGuardHalt as exc:
            halted = str(exc)
    for h in hooks:
        h.remove()
    return halted


def run_hf(recipe: Any, run: Any, guarded: bool) -> dict[str, Any]:
    from transformers import PrinterCallback, Trainer, TrainingArguments

    _quiet()
    model, data = recipe.start(run)
    opt, sched = recipe.optimizer(run, model)
    tmp = tempfile.TemporaryDirectory(prefix="gg-compound-hf-")
    callback = _guard("gradguard.hf", guarded, tmp.name)
    callbacks = [callback] if callback is not None else []
    args = TrainingArguments(
        output_dir=tmp.name, use_cpu=True, report_to=[], seed=run.seed, max_steps=run.steps,
        per_device_train_batch_size=recipe.BATCH, max_grad_norm=run.clip or 0.0, logging_strategy="no",
        save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, dataloader_drop_last=True)
    trainer = Trainer(model=HFLM(model), args=args, train_dataset=_Rows(_ready_batches(recipe, run, data)),
                      optimizers=(opt, sched), callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # disable_tqdm's replacement prints the final metrics
    halted = _train(trainer.train, recipe.fault_hooks(run, model, lambda: trainer.state.global_step + 1))
    out = _result(model, data, recipe, callback.summary if callback is not None else None, halted, tmp.name)
    tmp.cleanup()
    return out


# -- Lightning --------------------------------------------------------------------------------------
def _lightning_module(model: nn.Module, opt: torch.optim.Optimizer, sched: Any) -> Any:
    import lightning.pytorch as pl

    class LitLM(pl.LightningModule):
        """A family model as Lightning calls it: ``training_step`` returns the loss; the run's
        optimizer and LambdaLR (stepped every optimizer step)."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return self.model(x, y)

        def configure_optimizers(self) -> Any:
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return LitLM()


def run_lightning(recipe: Any, run: Any, guarded: bool) -> dict[str, Any]:
    import lightning.pytorch as pl

    _quiet()
    model, data = recipe.start(run)
    opt, sched = recipe.optimizer(run, model)
    tmp = tempfile.TemporaryDirectory(prefix="gg-compound-pl-")
    callback = _guard("gradguard.lightning", guarded, tmp.name)
    callbacks = [callback] if callback is not None else []
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=run.steps, callbacks=callbacks, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp.name, num_sanity_val_steps=0, gradient_clip_val=run.clip)
    module = _lightning_module(model, opt, sched)
    loader = torch.utils.data.DataLoader(_ready_batches(recipe, run, data), batch_size=None, shuffle=False)
    halted = _train(lambda: trainer.fit(module, loader),
                    recipe.fault_hooks(run, model, lambda: trainer.global_step + 1))
    summary = callback.core.summary() if callback is not None and callback.core is not None else None
    out = _result(model, data, recipe, summary, halted, tmp.name)
    tmp.cleanup()
    return out


ENGINES: dict[str, Callable[[Any, Any, bool], dict[str, Any]]] = {"hf": run_hf, "lightning": run_lightning}
