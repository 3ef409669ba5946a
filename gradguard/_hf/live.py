"""The Trainer's own reporting integrations (``report_to``) as the guard's live sinks.

The Trainer already writes to a W&B run (``WandbCallback``) and a TensorBoard writer
(``TensorBoardCallback``) at its ``logging_steps``, keys prefixed ``train/`` and the x axis
``train/global_step``. gradguard writes into the same run and writer, on the same axis and
prefix: never a second run, never the same key twice (see ``GuardCore.after_step``)."""

from __future__ import annotations

import os
from typing import Any

from ..logdir import is_url
from ..sinks import (
    JSONLSink,
    M,
    Sink,
    TensorBoardSink,
    WandbSink,
    is_headline,
)
from .setup import log_entries

__all__ = ["PREFIX", "STEP_KEY", "bind_integrations", "is_logging_step", "layer_keys_out_of_print",
           "move_ahead_of_reporters", "add_to_logs", "event_log_with_wandb"]

PREFIX = "train/"  # transformers' rewrite_logs
STEP_KEY = "train/global_step"  # the x axis WandbCallback defines


def bind_integrations(callbacks: list[Any], sinks: list[Sink]) -> list[Sink]:
    """Sinks bound to the integrations found among ``callbacks`` (the Trainer's callback list).
    A user's unbound ``WandbSink`` on the same run is bound in place (so the run is not logged
    twice); returns the new sinks to add. Call once the integrations are set up (after the first
    step: they initialise in their own ``on_train_begin``)."""
    names = {type(cb).__name__: cb for cb in callbacks}
    new: list[Sink] = []
    if "WandbCallback" in names:
        try:
            import wandb
        except ImportError:  # pragma: no cover - the integration needs it
            wandb = None  # type: ignore[assignment]
        run = getattr(wandb, "run", None) if wandb is not None else None
        if run is not None:
            new.extend(event_log_with_wandb(run, callbacks, sinks))
            mine = [s for s in sinks if isinstance(s, WandbSink) and s.run is run]
            if mine:
                for s in mine:
                    s.bind(run, step_key=STEP_KEY, prefix=PREFIX)
            else:
                new.append(WandbSink(run=run, step_key=STEP_KEY, prefix=PREFIX))
    tb = names.get("TensorBoardCallback")
    writer = getattr(tb, "tb_writer", None)
    if writer is not None:
        sink = TensorBoardSink(writer=writer, prefix=PREFIX)
        sink.engine_bound = True
        new.append(sink)
    return new


def _callback_of(callbacks: list[Any], sinks: list[Sink]) -> Any:
    """The GradGuardCallback among ``callbacks`` whose core's sink list is ``sinks``."""
    for cb in callbacks:
        core = getattr(cb, "core", None)
        if core is not None and getattr(core, "sinks", None) is sinks:
            return cb
    return None


def event_log_with_wandb(run: Any, callbacks: list[Any], sinks: list[Sink]) -> list[Sink]:
    """Keep the event log with the W&B run, so a run that reports only to W&B still has it where
    its user looks. An event log elsewhere (``out_dir``, the TensorBoard folder) is saved to the run
    (``run.save``, uploaded as it grows, under ``gradguard/``); with none (``report_to=["wandb"]``
    and no ``out_dir``: no folder of the Trainer's to write into) the log is opened in the run's
    files folder (``run.dir/gradguard/events.jsonl``, uploaded with the run), starting with the
    ``start`` record, and the summary and console name it. Returns the sinks to add."""
    logs = [s for s in sinks if isinstance(s, JSONLSink)]
    if logs:
        for log in logs:
            if is_url(log.path):
                continue
            path = os.path.abspath(log.path)
            try:
                run.save(path, base_path=os.path.dirname(os.path.dirname(path)), policy="live")
            except Exception:  # noqa: BLE001 - an upload that cannot be set up never stops training
                pass
        return []
    cb = _callback_of(callbacks, sinks)
    folder = getattr(run, "dir", None)
    user_cfg = getattr(cb, "config", None)
    if cb is None or not folder or not getattr(getattr(user_cfg, "output", None), "jsonl", True):
        return []  # the user turned the event log off: none here either
    cb.core.open_event_log(os.path.join(folder, "gradguard", "events.jsonl"))  # the summary names it
    return []


def is_logging_step(args: Any, state: Any, step: int) -> bool:
    """Whether the Trainer logs at ``step`` (``logging_strategy="steps"``; the decision
    ``DefaultFlowCallback`` takes in ``on_step_end``)."""
    if str(getattr(args, "logging_strategy", "steps")).split(".")[-1].lower() != "steps":
        return False
    every = int(getattr(state, "logging_steps", 0) or getattr(args, "logging_steps", 0) or 0)
    if step == 1 and getattr(args, "logging_first_step", False):
        return True
    return every > 0 and step % every == 0


# The callbacks that print ``logs`` (progress bar, plain printer, notebook table).
_PRINTERS = ("ProgressCallback", "PrinterCallback", "NotebookProgressCallback")


def _is_layer_key(key: str) -> bool:
    return key.startswith("gradguard/") and not is_headline(key)


def _is_gradguard_key(key: str) -> bool:
    return key.startswith("gradguard/")


def layer_keys_out_of_print(callbacks: list[Any], everything: bool | None = None) -> None:
    """Per-layer ``gradguard/...`` values go into the Trainer's ``logs`` so that every
    ``report_to`` integration receives them (W&B, TensorBoard, MLflow, Comet, ...); this puts a
    filter right before the first callback that prints ``logs`` (the progress bar), which removes
    them there: the printed line keeps only the run-level keys. ``everything=True`` removes every
    ``gradguard/...`` key from the printed line (they still reach ``report_to``); None keeps the
    filter's current setting. Idempotent."""
    from transformers.trainer_callback import TrainerCallback

    found = next((cb for cb in callbacks if type(cb).__name__ == "_LayerKeysOutOfPrint"), None)
    if found is not None:
        if everything is not None:
            found.everything = everything
        return
    pos = next((i for i, cb in enumerate(callbacks) if type(cb).__name__ in _PRINTERS), None)
    if pos is None:
        return  # nothing prints the logs

    class _LayerKeysOutOfPrint(TrainerCallback):
        def __init__(self, everything: bool) -> None:
            self.everything = everything

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
                   **kwargs: Any) -> None:
            if logs:
                drop = _is_gradguard_key if self.everything else _is_layer_key
                for key in [k for k in logs if drop(k)]:
                    del logs[key]

    callbacks.insert(pos, _LayerKeysOutOfPrint(bool(everything)))


def add_to_logs(core: Any, state: Any, logs: dict[str, Any], window: list[float], layer_metrics: bool) -> None:
    """``on_log`` of a training log: the run-level ``gradguard/...`` metrics join ``logs`` (what the
    Trainer prints and hands to every ``report_to`` integration) and its ``log_history`` entry; the
    per-layer ones too (every integration receives them; :func:`layer_keys_out_of_print` keeps them
    off the printed line). ``window``: the guard losses of the logging window."""
    last = core.last_report
    this_step = core.pending_row is not None or (last is not None and last.step == state.global_step)
    row = core.pending_row if core.pending_row is not None else core.metrics(last)
    core.pending_row = None
    m = log_entries(row, window, True, M.NONFINITE_LOSS_STEPS)
    # one meaning per key: gradguard/loss is the logged step's loss, as in the JSONL log and every
    # other sink; the window's mean (what HF's own "loss" averages) has its own key
    if M.LOSS in m:
        m[M.LOSS_WINDOW_MEAN] = m.pop(M.LOSS)
    if M.LOSS in row and this_step:  # a step the engine discarded (no guard step) has no loss of its own
        m[M.LOSS] = row[M.LOSS]
    head = {k: v for k, v in m.items() if is_headline(k)}
    logs.update(head)  # what the Trainer prints and hands to every report_to integration
    if layer_metrics:  # per-layer values: to every report_to integration, not printed
        logs.update({k: v for k, v in m.items() if not is_headline(k)})
    hist = getattr(state, "log_history", None)
    if hist and hist[-1].get("step") == state.global_step and "loss" in hist[-1]:
        hist[-1].update(head)


def move_ahead_of_reporters(callback: object, cbs: list[Any], print_metrics: bool = True) -> bool:
    """User callbacks run after the reporting integrations; metrics added to ``logs`` in ``on_log``
    would miss them. Move ``callback`` (found by identity) right after ``DefaultFlowCallback`` in
    ``cbs`` (the Trainer's callback list), and keep the per-layer keys off the printed line (all of
    gradguard's keys when not ``print_metrics``); False when it is not there."""
    if callback not in cbs:
        return False
    from transformers.trainer_callback import DefaultFlowCallback

    cbs.remove(callback)
    pos = next((i + 1 for i, c in enumerate(cbs) if isinstance(c, DefaultFlowCallback)), 0)
    cbs.insert(pos, callback)
    # print_metrics=False: no gradguard key on the printed line (report_to gets them all)
    layer_keys_out_of_print(cbs, everything=not print_metrics)
    return True
