"""PyTorch Lightning adapter: ``Trainer(callbacks=[GradGuardCallback()])``.

The callback only translates Lightning's hooks into :class:`gradguard.guard.GuardCore` calls; the
detection, the policy and every decision live in the core. The adapter owns the Lightning
plumbing that carries the core's actions out.

Hook mapping (automatic optimization, Lightning 2.4+):

* ``on_train_start``: builds the core on the LightningModule and the first optimizer (after a
  checkpoint restore, so the guard state of a resumed run is loaded into it), the scheduler and
  GradScaler of the run, a DDP all-reduce as the core's ``reduce``. It attaches the train
  DataLoader as the core's batch controller, the trainer's ``ModelCheckpoint`` files as a rollback
  source, and wraps ``training_step`` (an instance attribute of the module, removed at teardown)
  and, on one process in automatic optimization, ``trainer.strategy.backward`` (same).
* ``on_train_batch_start``: opens a data window step (skipped after a rollback: see below) and
  notes the paths of checkpoints written since the last batch.
* ``on_before_backward(loss)``: records the micro-batch loss (Lightning passes it divided by
  ``accumulate_grad_batches`` and multiplied by the loss scale: both are undone, without a sync).
* ``on_before_optimizer_step``: gradients are accumulated, DDP-synced, unscaled, not yet clipped:
  ``core.before_step`` measures, decides, clips, acts; a skipped step has its gradients dropped
  (the optimizer step becomes a no-op: weights, Adam moments and step count untouched) and the
  ``interval="step"`` schedulers are held for that step.
* ``on_train_batch_end`` (accumulation boundary): releases the held schedulers, ``core.after_step``,
  puts back the fp16 loss scale the core wants kept (``core.scale_to_keep``: the GradScaler updates
  inside Lightning's optimizer step, so the scale is restored after it), and on every batch applies
  a pending micro-batch change once the epoch's batch index is aligned.

Actions carried out by the adapter:

* **Batch size** (``core.attach_batches``): the loader's ``batch_sampler.batch_size`` is changed
  live (torch's ``BatchSampler`` re-reads it between batches; one with ``drop_last=True`` is given a
  subclass that does). The fit loop's cached epoch length (``fit_loop.max_batches`` =
  ``trainer.num_training_batches``, the combined loader's limits, the data fetcher's length and a
  fractional ``val_check_batch``) is recomputed from the samples left in the epoch, so the epoch
  neither ends early nor overruns. Global mode halves the loader batch (the core scales the LR);
  micro mode halves it and doubles ``trainer.accumulate_grad_batches`` at the next batch index that
  is a multiple of the new accumulation (global batch kept, no mixed window). Under DDP every rank
  resizes its own ``BatchSampler`` over its ``DistributedSampler`` identically.
* **Out of memory** (one process, automatic optimization, ``policy.act``): a
  ``torch.OutOfMemoryError`` in ``training_step`` or in the backward is caught; the same micro-batch
  is run again in halves (each piece's loss weighted by its share, the pieces' gradients summed
  exactly as one backward would), then the loader's micro-batch halves and the accumulation doubles
  at the next aligned boundary (``oom_shrink_micro``). A backward out-of-memory error in a later
  micro-batch of an accumulation window cannot be undone exactly: that optimizer step is skipped
  (``oom_skip_step``). Already at one sample: the error is raised.
* **Rollback from a ModelCheckpoint file** (``core.add_rollback_source``, used when the in-memory
  ring has nothing tested, e.g. ``recovery.snapshot_interval=0``): every checkpoint the trainer's
  ``ModelCheckpoint`` callbacks write is tracked (``on_save_checkpoint``), becomes restorable after
  ``recovery.confirm_steps`` healthy steps and is never used if an unstable step comes first. The
  newest such file is read and its module weights, optimizer states (current LRs kept unless
  ``recovery.restore_schedule``), GradScaler state and the guard's detector state are put back
  directly (Lightning's own restore would rewind the loops).
* **Data window after a rollback** (``recovery.skip_batches`` optimizer steps): in automatic
  optimization the wrapped ``training_step`` returns None, so no forward or backward runs (under
  DDP, where Lightning refuses None, it returns a zero loss touching every parameter: no model
  forward, the gradient all-reduce still runs on every rank); the step is dropped, its schedulers
  held, and the guard counts it (``core.discard_step``) so its step count follows ``global_step``.

Use ``gradguard.lightning`` with ``lightning.pytorch`` (falls back to ``pytorch_lightning`` when only
that is installed) and ``gradguard.pytorch_lightning`` with the standalone ``pytorch_lightning``
package; :func:`make_callback_class` builds the callback for any Lightning module object.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import hashlib
import inspect
import itertools
import json
import math
import os
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import Any

import torch
from torch.utils.data import BatchSampler

from .act import drop_grads, unwrap_optimizer
from .config import GuardConfig
from .data import batch_len, split_batch
from .errors import GradGuardHalt, UnsupportedSetupError, warn
from .guard import GuardCore, StepReport
from .policy import INSTABILITY_KINDS, Action
from .sinks import Sink

__all__ = ["GradGuardCallback", "make_callback_class", "LightningLoggerSink", "GradGuardHalt"]

ADAPTER_STATE_VERSION = 1
_MISSING = object()
#: findings that make a checkpoint written just before them unusable for a rollback
_BAD_KINDS = INSTABILITY_KINDS | {"nonfinite_loss", "nonfinite_grad"}


class LightningLoggerSink(Sink):
    """Forwards the core's metrics to every logger of the trainer (CSV, TensorBoard, W&B...)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for lg in self.trainer.loggers:
            lg.log_metrics(dict(metrics), step=self.trainer.global_step)


def _ddp_mean(packed: torch.Tensor) -> torch.Tensor:
    """One all-reduce (sum, then divide) of the step's packed measurements: identical values, and so
    identical decisions, on every rank. Non-finite values propagate to every rank."""
    world = torch.distributed.get_world_size()
    torch.distributed.all_reduce(packed, op=torch.distributed.ReduceOp.SUM)
    return packed / world


def _distributed(trainer: Any) -> bool:
    return bool(trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized())


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- batches ----------------------------------------------------------------------------------
class _LiveBatchSampler(BatchSampler):
    """torch's ``BatchSampler`` re-reads ``batch_size`` between batches only without ``drop_last``
    (with it, the size is fixed when the epoch's iterator starts). This one re-reads it in both
    cases; it yields the same batches as torch's while the size does not change."""

    def __iter__(self) -> Iterator[list[int]]:
        it = iter(self.sampler)
        while True:
            batch = list(itertools.islice(it, self.batch_size))
            if not batch or (self.drop_last and len(batch) < self.batch_size):
                return
            yield batch


def _loss_of(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        return output.get("loss")
    return None


class _PartialGrads(Exception):
    """A backward failed half-way: some gradients of the failed piece were already accumulated."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


class _LoaderBatches:
    """The trainer's train DataLoader as the core's batch controller (``GuardCore.attach_batches``).

    Sizes are per rank: global = loader batch x ``accumulate_grad_batches``. A global shrink/grow
    changes ``batch_sampler.batch_size`` at once (the next batch drawn has the new size). A micro
    shrink is *pending* until the number of batches drawn in the epoch is a multiple of the new
    accumulation: then the loader batch changes, and ``accumulate_grad_batches`` follows when the
    epoch's batch index reaches that point (the same batch without a loader look-ahead; a multi-
    worker loader has already drawn a few batches at the old size). Each change recomputes the
    epoch's length from the samples left in it."""

    def __init__(self, trainer: Any, sampler: BatchSampler) -> None:
        self.trainer = trainer
        self.base_loader = int(sampler.batch_size)
        self.base_acc = int(trainer.accumulate_grad_batches)
        self.cap = self.base_loader  # micro-batch ceiling (lowered by micro shrinks and OOM)
        self.pending: dict[str, int] | None = None  # {"loader", "acc"}: waiting for alignment
        self.scheduled: dict[str, int] | None = None  # {"acc", "at"}: loader resized, acc follows at "at"
        self._mark = (0, 0)  # (batches drawn, samples drawn) in this epoch at the last resize
        self._touched = False  # the fit loop's cached epoch length was changed by us
        self._static_epoch = -1  # the epoch whose iterator cannot be resized (drop_last, multi-worker)

    # -- the loader ------------------------------------------------------------------------
    @staticmethod
    def find_sampler(trainer: Any) -> BatchSampler | None:
        """The train loader's ``BatchSampler`` if its size can be changed live, else None."""
        loader = getattr(trainer.fit_loop, "_combined_loader", None)
        flat = getattr(loader, "flattened", None) or []
        if len(flat) != 1:
            return None
        bs = getattr(flat[0], "batch_sampler", None)
        if not isinstance(bs, BatchSampler) or type(bs).__iter__ not in (BatchSampler.__iter__, _LiveBatchSampler.__iter__):
            return None
        return bs

    def sampler(self) -> BatchSampler | None:
        return self.find_sampler(self.trainer)

    def make_live(self) -> None:
        """Give a ``drop_last=True`` sampler the re-reading ``__iter__`` (before the epoch draws)."""
        bs = self.sampler()
        if bs is None or type(bs) is not BatchSampler or not bs.drop_last:
            return
        bs.__class__ = _LiveBatchSampler
        it = self._loader_iter()
        if it is not None and hasattr(it, "_num_yielded") and not hasattr(it, "_send_idx") and it._num_yielded == 0:
            it._sampler_iter = iter(it._index_sampler)  # nothing drawn yet: start it with the live sampler
        elif it is not None:
            self._static_epoch = int(self.trainer.current_epoch)  # this epoch's size is fixed

    def _loader_iter(self) -> Any:
        mode_iter = getattr(getattr(self.trainer.fit_loop, "_combined_loader", None), "_iterator", None)
        its = getattr(mode_iter, "iterators", None)
        return its[0] if its else None

    def live(self) -> bool:
        return self.sampler() is not None and int(self.trainer.current_epoch) != self._static_epoch

    def drawn(self) -> int:
        """Batches drawn from the sampler in this epoch (a multi-worker loader draws ahead)."""
        it = self._loader_iter()
        if it is not None:
            if hasattr(it, "_send_idx"):
                return int(it._send_idx)
            if hasattr(it, "_num_yielded"):
                return int(it._num_yielded)
        fetcher = self.trainer.fit_loop._data_fetcher
        return int(fetcher.fetched) if fetcher is not None else self._ready()

    def _ready(self) -> int:
        return int(self.trainer.fit_loop.epoch_loop.batch_progress.current.ready)

    # -- sizes -----------------------------------------------------------------------------
    @property
    def loader_batch(self) -> int:
        bs = self.sampler()
        return int(bs.batch_size) if bs is not None else self.base_loader

    def target(self) -> tuple[int, int]:
        """(loader batch, accumulation) once every pending change is applied."""
        if self.pending is not None:
            return self.pending["loader"], self.pending["acc"]
        if self.scheduled is not None:
            return self.loader_batch, self.scheduled["acc"]
        return self.loader_batch, int(self.trainer.accumulate_grad_batches)

    @property
    def batch_size(self) -> int:
        loader, acc = self.target()
        return loader * acc

    @property
    def base_batch_size(self) -> int:
        return self.base_loader * self.base_acc

    @property
    def accumulation_steps(self) -> int:
        return self.target()[1]

    def _micro_ok(self) -> bool:
        tr = self.trainer
        if not tr.lightning_module.automatic_optimization or tr.strategy.handles_gradient_accumulation:
            return False
        return not any(type(c).__name__ == "GradientAccumulationScheduler" for c in tr.callbacks)

    # -- the controller API (GuardCore.attach_batches) --------------------------------------
    def shrink_global(self) -> tuple[int, int] | None:
        if not self.live():
            return None
        loader, acc = self.target()
        new = max(1, loader // 2)
        if new == loader:
            return None
        self._set_target_loader(new)
        return loader * acc, new * acc

    def grow_global(self) -> tuple[int, int] | None:
        if not self.live():
            return None
        loader, acc = self.target()
        limit = min(self.base_loader, self.cap)
        if loader >= limit:
            return None
        new = min(limit, loader * 2)
        self._set_target_loader(new)
        return loader * acc, new * acc

    def shrink_micro(self) -> tuple[int, int] | None:
        if not self.live() or not self._micro_ok():
            return None
        loader, acc = self.target()
        if loader <= 1:
            return None
        new = (loader + 1) // 2  # ceil: the global batch never falls below what it was
        self.pending = {"loader": new, "acc": acc * 2}
        self.cap = min(self.cap, new)
        return loader, new

    def _set_target_loader(self, new: int) -> None:
        if self.pending is not None:
            self.pending["loader"] = new
        else:
            self._resize(new)

    # -- applying ----------------------------------------------------------------------------
    def poll(self) -> None:
        """After every batch: start a pending micro change once the draws are aligned, and switch
        the accumulation when training reaches the point where the new loader batch starts."""
        if self.pending is not None and self.scheduled is None and self.live():
            d = self.drawn()
            if d % self.pending["acc"] == 0:
                self._resize(self.pending["loader"], d)
                self.scheduled = {"acc": self.pending["acc"], "at": d}
                self.pending = None
        if self.scheduled is not None and self._ready() >= self.scheduled["at"]:
            self.trainer.accumulate_grad_batches = self.scheduled["acc"]
            self.scheduled = None

    def epoch_start(self) -> None:
        """Before the epoch's iterator draws: everything pending applies now (an epoch starts a
        window), and the epoch's length is computed for the loader batch in force."""
        loader, acc = self.target()
        self.pending = self.scheduled = None
        bs = self.sampler()
        if bs is None:
            return
        bs.batch_size = loader
        self.trainer.accumulate_grad_batches = acc
        self._mark = (0, 0)
        if self._touched or loader != self.base_loader:
            self._fix_limits(self._total(0, 0, loader))

    def _resize(self, new: int, d: int | None = None) -> None:
        bs = self.sampler()
        if bs is None:
            return
        old = int(bs.batch_size)
        d = self.drawn() if d is None else d
        samples = self._mark[1] + (d - self._mark[0]) * old
        self._mark = (d, samples)
        bs.batch_size = new
        self._fix_limits(self._total(d, samples, new))

    def _total(self, drawn: int, samples: int, size: int) -> int | None:
        """Batches in this epoch: those drawn plus the rest of the epoch's samples at ``size``.
        ``limit_train_batches`` keeps its sample budget (counted in batches of the original size)."""
        bs = self.sampler()
        try:
            n = len(bs.sampler)  # type: ignore[union-attr, arg-type]
        except TypeError:
            return None  # an iterable dataset: no cached length to fix
        drop = bool(bs.drop_last)  # type: ignore[union-attr]
        base_len = n // self.base_loader if drop else -(-n // self.base_loader)
        limit = self.trainer.limit_train_batches
        lim = min(base_len, limit) if isinstance(limit, int) else int(base_len * float(limit))
        budget = n if lim >= base_len else min(n, lim * self.base_loader)
        left_budget, left_data = max(0, budget - samples), max(0, n - samples)
        more = min(-(-left_budget // size), left_data // size if drop else -(-left_data // size))
        return drawn + more

    def _fix_limits(self, total: int | None) -> None:
        if total is None:
            return
        self._touched = True
        tr = self.trainer
        fl = tr.fit_loop
        if fl._combined_loader is not None:
            fl._combined_loader.limits = [total]
        if fl.max_batches != float("inf"):
            fl.max_batches = total
        fetcher = fl._data_fetcher
        if fetcher is not None and fetcher.length is not None:
            fetcher.length = total
            fetcher.done = fetcher.fetched >= total
        vci = tr.val_check_interval
        if (isinstance(vci, float) and getattr(tr, "_val_check_time_interval", None) is None
                and tr.val_check_batch not in (None, float("inf"))):
            tr.val_check_batch = max(1, int(total * vci))

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        loader, acc = self.target()
        return {"loader": loader, "acc": acc, "base_loader": self.base_loader, "base_acc": self.base_acc,
                "cap": self.cap}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.base_loader, self.base_acc = int(state["base_loader"]), int(state["base_acc"])
        self.cap = int(state["cap"])
        if (int(state["loader"]), int(state["acc"])) != self.target():
            self.pending = {"loader": int(state["loader"]), "acc": int(state["acc"])}
        self.epoch_start()


class _CheckpointTier:
    """The checkpoint files written by the trainer's ``ModelCheckpoint`` callbacks, as the rollback
    disk tier. A file becomes restorable after ``confirm_steps`` healthy steps after it; an unstable
    step first (spike, non-finite, overflow rate, scale collapse) marks it bad."""

    def __init__(self, confirm_steps: int) -> None:
        self.confirm_steps = confirm_steps
        self.entries: list[dict[str, Any]] = []  # {"step", "path", "healthy", "tested", "bad"}
        self._pending: set[int] = set()  # steps saved whose file path is not known yet
        self._seen: set[str] = set()

    def saved(self, step: int) -> None:
        self._pending.add(int(step))

    def resolve(self, trainer: Any) -> None:
        """Learn the paths of the files saved since the last call (``ModelCheckpoint`` records the
        last one it wrote, and its top-k paths)."""
        if not self._pending:
            return
        for cb in getattr(trainer, "checkpoint_callbacks", []) or []:
            step = getattr(cb, "_last_global_step_saved", None)
            if step not in self._pending:
                continue
            paths = [getattr(cb, "_last_checkpoint_saved", "") or getattr(cb, "last_model_path", "")]
            paths += [p for p in (getattr(cb, "best_k_models", None) or {}) if p not in self._seen]
            for p in paths:
                if p:
                    self._add(int(step), str(p))
        for cb in getattr(trainer, "checkpoint_callbacks", []) or []:
            self._seen.update(str(p) for p in (getattr(cb, "best_k_models", None) or {}))
        self._pending.clear()

    def _add(self, step: int, path: str) -> None:
        self.entries = [e for e in self.entries if e["path"] != path]  # a re-used name: old content gone
        self.entries.append({"step": step, "path": path, "healthy": 0, "tested": False, "bad": False})

    def observe(self, step: int, report: StepReport) -> None:
        bad = any(f.kind in _BAD_KINDS for f in report.findings)
        healthy = bool(report.healthy and report.loss is not None and math.isfinite(report.loss))
        for e in self.entries:
            if e["tested"] or e["bad"] or step <= e["step"]:
                continue
            if bad:
                e["bad"] = True
            elif healthy:
                e["healthy"] += 1
                e["tested"] = e["healthy"] >= self.confirm_steps

    def candidates(self) -> list[dict[str, Any]]:
        return sorted((e for e in self.entries if e["tested"] and not e["bad"]), key=lambda e: e["step"], reverse=True)

    def forget(self, entry: dict[str, Any]) -> None:
        self.entries = [e for e in self.entries if e is not entry]

    def drop_after(self, step: int) -> None:
        """Files newer than a restored one describe a discarded future."""
        self.entries = [e for e in self.entries if e["step"] <= step]

    def state_dict(self) -> list[dict[str, Any]]:
        return [dict(e) for e in self.entries]

    def load_state_dict(self, state: list[dict[str, Any]] | None) -> None:
        self.entries = [dict(e) for e in (state or [])]


class _GradGuardMixin:
    """The adapter logic; combined with a Lightning ``Callback`` base by :func:`make_callback_class`."""

    def __init__(self, config: GuardConfig | None = None, *, name: str | None = None,
                 sinks: list[Sink] | None = None, out_dir: str | None = None, layer_fn: Any = None,
                 log_to_loggers: bool = True) -> None:
        """
        Args:
            config: the guard's configuration (default ``GuardConfig()``).
            name: distinguishes the checkpoint state of several guards; default a hash of the config.
            sinks: extra sinks (on global rank 0 only).
            out_dir: folder of the JSONL log (``<out_dir>/gradguard/``); default ``config.output.dir``,
                else ``trainer.log_dir`` (the logger's version folder), else ``default_root_dir``.
            layer_fn: parameter name -> layer name (see ``gradguard.measure.LayerMap``).
            log_to_loggers: send the core's metrics to the trainer's loggers.
        """
        super().__init__()
        self.config = config = GuardConfig.coerce(config, "GradGuardCallback(config)")
        self.name = name or hashlib.sha1(json.dumps(config.to_dict(), sort_keys=True, default=str)
                                         .encode()).hexdigest()[:10]
        self.extra_sinks = list(sinks or [])
        self.out_dir = out_dir
        self.layer_fn = layer_fn
        self.log_to_loggers = log_to_loggers
        self.core: GuardCore | None = None
        self.scaler: Any = None
        self.last_report: StepReport | None = None
        self.reports: int = 0
        self.halted: dict[str, Any] | None = None
        self.diagnosis_path: str | None = None
        self.batches: _LoaderBatches | None = None
        self.checkpoints = _CheckpointTier(config.recovery.confirm_steps)
        self._pending_state: dict[str, Any] | None = None
        self._trainer: Any = None
        self._manage_clip = False
        self._hook_handles: list[Any] = []
        self._in_opt_step = False
        self._report: StepReport | None = None
        self._held: list[tuple[Any, dict[str, Any], list[float]]] = []
        self._skip_left = 0
        self._window_step = False
        self._poisoned = False  # an out-of-memory error left this step's gradients unusable
        self._stepped = False
        self._wrapped: list[tuple[Any, str, Any, Any]] = []  # (object, attribute, wrapper, previous)
        self._current: tuple[tuple[Any, ...], dict[str, Any]] | None = None  # training_step's arguments
        self._stash: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.data_skipped_steps = 0
        self.oom_events = 0

    # -- identity / checkpoint state --------------------------------------------------------
    @property
    def state_key(self) -> str:
        return self._generate_state_key(name=self.name)  # type: ignore[attr-defined]

    def state_dict(self) -> dict[str, Any]:
        pending = self._pending_state or {}
        core_state = self.core.state_dict() if self.core is not None else pending.get("core")
        batches = self.batches.state_dict() if self.batches is not None else pending.get("batches")
        return {"version": ADAPTER_STATE_VERSION, "core": core_state, "skip_left": self._skip_left,
                "data_skipped_steps": self.data_skipped_steps, "batches": batches,
                "checkpoints": self.checkpoints.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning restores callbacks before the optimizers exist: applied in on_train_start.
        self._pending_state = copy.deepcopy(state_dict)
        self.checkpoints.load_state_dict(state_dict.get("checkpoints"))
        if self.core is not None:
            self._apply_pending()

    def _apply_pending(self) -> None:
        st, self._pending_state = self._pending_state, None
        if not st:
            return
        if st.get("core") is not None and self.core is not None:
            self.core.load_state_dict(st["core"])
        self._skip_left = int(st.get("skip_left", 0))
        self.data_skipped_steps = int(st.get("data_skipped_steps", 0))
        if st.get("batches") and self.batches is not None:
            self.batches.load_state_dict(st["batches"])

    # -- lifecycle -------------------------------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.optimizers:
            raise UnsupportedSetupError("gradguard: the trainer has no optimizer. Fix: return one from configure_optimizers")
        opt = unwrap_optimizer(trainer.optimizers[0])
        if len(trainer.optimizers) > 1:
            warn("gradguard: several optimizers: only the first one is guarded", stacklevel=2)
        log_dir = trainer.log_dir  # a collective under DDP: called on every rank
        self._trainer = trainer
        if self.core is not None and self.core.optimizer is opt:
            self._setup_clip(trainer)
            self._attach(trainer, pl_module)
            return
        if self.core is not None:
            self._teardown_core()
        cfg = self.config
        rank0 = trainer.global_rank == 0
        self._manage_clip = bool(cfg.policy.act and cfg.clip.mode != "off" and pl_module.automatic_optimization)
        if self._manage_clip and trainer.gradient_clip_val:
            algo = str(trainer.gradient_clip_algorithm or "norm").lower()
            if algo.endswith("norm"):
                val = float(trainer.gradient_clip_val)
                if val != cfg.clip.max_norm:
                    warn(f"gradguard: Trainer(gradient_clip_val={val:g}) becomes the guard's clip.max_norm "
                                  "(the guard owns norm clipping and tightens/relaxes it)", stacklevel=2)
                    cfg = dataclasses.replace(cfg, clip=dataclasses.replace(
                        cfg.clip, max_norm=val, floor=min(cfg.clip.floor, val)))
        if not rank0:  # one event log and one console per run
            cfg = dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, jsonl=False, console=False))
        sinks: list[Sink] = []
        if rank0:
            sinks = list(self.extra_sinks)
            if self.log_to_loggers and trainer.loggers:
                sinks.append(LightningLoggerSink(trainer))
        out_dir = self.out_dir or cfg.output.dir or log_dir or trainer.default_root_dir
        self.scaler = getattr(trainer.precision_plugin, "scaler", None)
        sched = trainer.lr_scheduler_configs[0].scheduler if trainer.lr_scheduler_configs else None
        reduce = _ddp_mean if _distributed(trainer) else None
        self.core = GuardCore(pl_module, opt, config=cfg, sinks=sinks, out_dir=out_dir, layer_fn=self.layer_fn,
                              scheduler=sched, scaler=self.scaler, reduce=reduce)
        self.core.register_actuator("skip_data", self._skip_data)
        # after the core's LR-multiplier hooks: tells whether the core's pre-hook already ran when
        # on_before_optimizer_step fires (Lightning runs the closure inside optimizer.step()).
        self._hook_handles = [opt.register_step_pre_hook(self._pre_hook),
                              opt.register_step_post_hook(self._post_hook)]
        self._attach(trainer, pl_module)
        self._apply_pending()
        self._setup_clip(trainer)

    def _attach(self, trainer: Any, pl_module: Any) -> None:
        """Plug the engine-side actuators in: batch controller, checkpoint tier, step wrappers."""
        core = self.core
        assert core is not None
        self.batches = None
        if core.config.policy.act:
            sampler = _LoaderBatches.find_sampler(trainer)
            if sampler is not None:
                self.batches = _LoaderBatches(trainer, sampler)
                self.batches.make_live()
                core.attach_batches(self.batches)
            if getattr(trainer, "checkpoint_callbacks", None):
                core.add_rollback_source(self._rollback_to_checkpoint)
        self._install_wrappers(trainer, pl_module)

    def _setup_clip(self, trainer: Any) -> None:
        if self._manage_clip and self.core is not None:
            trainer.gradient_clip_val = self.core.clip.max_norm
            trainer.gradient_clip_algorithm = "norm"

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self.batches is not None:
            self.batches.epoch_start()

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self.checkpoints.saved(trainer.global_step)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.core is not None:
            self.core.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._remove_wrappers()
        if self.core is not None:
            self.core.close()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._remove_wrappers()
            if self.core is not None:
                self.core.close()

    def _teardown_core(self) -> None:
        for h in self._hook_handles:
            h.remove()
        self._hook_handles = []
        self._remove_wrappers()
        if self.core is not None:
            self.core.lr.remove()
            self.core.close()
        self.core = None

    # -- wrappers: training_step (data window, out of memory) and strategy.backward ------------
    def _install_wrappers(self, trainer: Any, pl_module: Any) -> None:
        self._remove_wrappers()
        orig = pl_module.training_step
        try:
            params = inspect.signature(orig).parameters
        except (TypeError, ValueError):
            params = {}  # type: ignore[assignment]
        if "dataloader_iter" in params:
            return  # the step fetches its own batches: nothing to skip or split

        @functools.wraps(orig)
        def training_step(*args: Any, **kwargs: Any) -> Any:
            return self._training_step(orig, *args, **kwargs)

        self._wrap(pl_module, "training_step", training_step)
        self._orig_training_step = orig
        if trainer.world_size == 1 and self.config.policy.act and pl_module.automatic_optimization:
            strategy = trainer.strategy
            orig_backward = strategy.backward

            @functools.wraps(orig_backward)
            def backward(closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
                return self._backward(orig_backward, closure_loss, optimizer, *args, **kwargs)

            self._wrap(strategy, "backward", backward)

    def _wrap(self, obj: Any, attr: str, wrapper: Any) -> None:
        previous = vars(obj).get(attr, _MISSING)
        object.__setattr__(obj, attr, wrapper)
        self._wrapped.append((obj, attr, wrapper, previous))

    def _remove_wrappers(self) -> None:
        for obj, attr, wrapper, previous in reversed(self._wrapped):
            if vars(obj).get(attr) is not wrapper:
                continue  # replaced by someone else since: leave theirs
            if previous is _MISSING:
                object.__delattr__(obj, attr)
            else:
                object.__setattr__(obj, attr, previous)
        self._wrapped = []
        self._current = None
        self._restore_stash()

    def _trainable(self, pl_module: Any) -> list[torch.nn.Parameter]:
        return [p for p in pl_module.parameters() if p.requires_grad]

    def _training_step(self, orig: Any, *args: Any, **kwargs: Any) -> Any:
        trainer = self._trainer
        pl_module = trainer.lightning_module
        self._current = (args, kwargs)
        if pl_module.automatic_optimization and (self._window_step or self._poisoned):
            if trainer.world_size > 1:
                # Lightning refuses None under DDP: a zero loss that touches every parameter keeps the
                # gradient all-reduce of every rank in step (no model forward runs)
                return sum((p.reshape(-1)[:1].sum() for p in self._trainable(pl_module)),
                           torch.zeros((), device=pl_module.device)) * 0.0
            return None  # no forward/backward; the step is dropped in on_before_optimizer_step
        try:
            return orig(*args, **kwargs)
        except torch.OutOfMemoryError as exc:
            if not self._oom_recoverable(trainer, pl_module, args):
                raise
            message = str(exc)[:200]
        # outside the except block: the failed forward's frames (and activations) are released
        _free_memory()
        return self._oom_retry(orig, args, kwargs, message, in_forward=True)

    def _backward(self, orig_backward: Any, closure_loss: torch.Tensor, optimizer: Any, *args: Any,
                  **kwargs: Any) -> Any:
        try:
            return orig_backward(closure_loss, optimizer, *args, **kwargs)
        except torch.OutOfMemoryError as exc:
            trainer = self._trainer
            pl_module = trainer.lightning_module
            if self._current is None or not self._oom_recoverable(trainer, pl_module, self._current[0]):
                raise
            message = str(exc)[:200]
        closure_loss = closure_loss.detach()  # drop the (partly freed) graph
        _free_memory()
        args_, kwargs_ = self._current  # type: ignore[misc]
        done = self._oom_retry(self._orig_training_step, args_, kwargs_, message, in_forward=False)
        if done is not None:  # the pieces' gradients are in place: run Lightning's after-backward hooks
            strategy = self._trainer.strategy
            closure_loss = strategy.precision_plugin.post_backward(closure_loss, self._trainer.lightning_module)
            strategy.post_backward(closure_loss)
        return closure_loss

    def _oom_recoverable(self, trainer: Any, pl_module: Any, args: tuple[Any, ...]) -> bool:
        return bool(self.core is not None and self.config.policy.act and pl_module.automatic_optimization
                    and trainer.world_size == 1 and args and batch_len(args[0]) > 1)

    def _oom_retry(self, orig: Any, args: tuple[Any, ...], kwargs: dict[str, Any], message: str,
                   in_forward: bool) -> Any:
        """Run the micro-batch whose forward or backward ran out of memory again in halves (quarters...
        when a half fails too). Exact: a forward failure added no gradient; a backward failure in
        the first micro-batch of an accumulation window is undone by dropping the gradients (Lightning
        zeroes them for this window anyway). A backward failure later in a window is not: the step
        is skipped. Returns the training_step output for Lightning (``in_forward``), else True, or
        None for a skipped step."""
        trainer = self._trainer
        pl_module = trainer.lightning_module
        acc = int(trainer.accumulate_grad_batches)
        first = trainer.fit_loop.epoch_loop.batch_idx % acc == 0
        params = self._trainable(pl_module)
        n = batch_len(args[0])
        if first:
            drop_grads(params)  # the previous step's (Lightning zero-grads after training_step)
        elif not in_forward:
            return self._poison(params, message, n)
        parts, smallest_failed = 2, n
        ctx = contextlib.nullcontext if in_forward else trainer.precision_plugin.train_step_context
        while True:
            try:
                total, output, failed = self._run_pieces(orig, args, kwargs, parts, acc, ctx)
                smallest_failed = min(smallest_failed, failed)
                break
            except _PartialGrads as partial:
                smallest_failed = min(smallest_failed, partial.size)
            _free_memory()
            if not first:
                return self._poison(params, message, n)
            drop_grads(params)
            parts *= 2
            if parts > 2 * n or smallest_failed <= 1:
                raise torch.OutOfMemoryError(message)
        self._after_oom(message, n, -(-smallest_failed // 2), in_forward)
        if not in_forward:
            return True
        if total is None:
            return None
        # Lightning zero-grads the first micro-batch of a window after training_step, then runs the
        # backward of what is returned: park the pieces' gradients until on_before_backward, and
        # return a leaf holding the micro-batch's loss (its backward touches no parameter).
        self._stash = [(p, p.grad) for p in params if p.grad is not None]
        for p, _ in self._stash:
            p.grad = None
        placeholder = total.detach().clone().requires_grad_(True)
        if isinstance(output, Mapping):
            return {**{k: v for k, v in output.items() if k != "loss"}, "loss": placeholder}
        return placeholder

    def _run_pieces(self, orig: Any, args: tuple[Any, ...], kwargs: dict[str, Any], parts: int, acc: int,
                    ctx: Any) -> tuple[torch.Tensor | None, Any, int]:
        """Forward and backward of one micro-batch in pieces, each loss weighted by its share of the
        micro-batch (and 1/accumulation, as Lightning does). A piece whose forward fails is split
        again. Returns (the micro-batch's loss, the last piece's output, the smallest size that
        failed). Raises ``_PartialGrads`` when a backward fails."""
        batch, rest = args[0], args[1:]
        n = batch_len(batch)
        queue = split_batch(batch, n, parts)
        scaler = self.scaler if self.scaler is not None and self.scaler.is_enabled() else None
        total: torch.Tensor | None = None
        output: Any = None
        failed = n
        while queue:
            piece, size = queue.pop(0)
            out, ran = None, False
            try:
                with ctx():
                    out = orig(piece, *rest, **kwargs)
                ran = True
            except torch.OutOfMemoryError:
                if size <= 1:
                    raise
            if not ran:
                failed = min(failed, size)
                _free_memory()
                queue[0:0] = split_batch(piece, size, 2)
                continue
            loss = _loss_of(out)
            if loss is None:
                continue
            weight = size / n
            ok = False
            try:
                with torch.autocast(loss.device.type, enabled=False):
                    scaled = loss * (weight / acc)
                    (scaler.scale(scaled) if scaler is not None else scaled).backward()
                ok = True
            except torch.OutOfMemoryError:
                pass
            if not ok:
                raise _PartialGrads(size)
            value = loss.detach().float() * weight
            total = value if total is None else total + value
            output = out
            del loss, out
        return total, output, failed

    def _poison(self, params: list[torch.nn.Parameter], message: str, n: int) -> None:
        drop_grads(params)
        self._poisoned = True  # the rest of the window is not computed; the step is skipped
        self.oom_events += 1
        if self.core is not None:
            self.core.record(Action("oom_skip_step", self.core.step_count + 1, f"out of memory: {message}",
                                    {"samples": n, "why": "a backward failed after earlier micro-batches of the "
                                     "accumulation window: their gradients cannot be separated"}))
        return None

    def _after_oom(self, message: str, n: int, fits: int, in_forward: bool) -> None:
        """Record the retry and halve the loader's micro-batch until it is at most ``fits``."""
        core = self.core
        assert core is not None
        self.oom_events += 1
        params: dict[str, Any] = {"samples": n, "retried_pieces_of": fits, "in": "forward" if in_forward else "backward"}
        moved = None
        ctl = self.batches
        if ctl is not None:
            start = ctl.target()[0]
            while ctl.target()[0] > fits and ctl.shrink_micro() is not None:
                pass
            if ctl.target()[0] < start:
                moved = (start, ctl.target()[0])
            params["micro_batch"] = list(moved) if moved else [start, start]
            params["accumulation"] = ctl.accumulation_steps
        else:
            params["unavailable"] = ("the train DataLoader's batch sampler cannot be resized: each such batch is "
                                     "retried in pieces")
        core.record(Action("oom_shrink_micro" if moved else "oom_retry", core.step_count + 1,
                           f"out of memory: {message}", params))

    def _restore_stash(self) -> None:
        stash, self._stash = self._stash, None
        for p, g in stash or []:
            p.grad = g if p.grad is None else p.grad + g

    # -- per step --------------------------------------------------------------------------
    def _pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._in_opt_step = True

    def _post_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._in_opt_step = False

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.checkpoints.resolve(trainer)
        acc = int(trainer.accumulate_grad_batches) if pl_module.automatic_optimization else 1
        if self._skip_left > 0 and batch_idx % acc == 0:  # a window counts optimizer steps
            self._skip_left -= 1
            self._window_step = True

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        self._restore_stash()  # gradients of a micro-batch retried in pieces (after Lightning's zero_grad)
        if self.core is None or self._window_step or self._poisoned or not trainer.training:
            return
        value = loss.detach()
        if pl_module.automatic_optimization and trainer.accumulate_grad_batches != 1:
            value = value * trainer.accumulate_grad_batches
        if self.scaler is not None and self.scaler.is_enabled() and getattr(self.scaler, "_scale", None) is not None:
            value = value.float() / self.scaler._scale.to(value.device)  # no host sync
        self.core.observe_loss(value)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        core = self.core
        if core is None or unwrap_optimizer(optimizer) is not core.optimizer:
            return
        self._restore_stash()
        lrm = core.lr
        rearm = self._in_opt_step
        if rearm:
            # Without a GradScaler, Lightning calls the closure (and so this hook) inside
            # optimizer.step(): the core's LR pre-hook already multiplied the LRs with the
            # multiplier of *before* this step's decision. Undo it, decide, then apply it again.
            lrm.suspend()
        skip = False
        self._stepped = True
        if self._window_step or self._poisoned:
            # a step of the data window skipped after a rollback, or one an out-of-memory error broke
            core.discard_loss()  # forget the observed losses of this step
            drop_grads(core.layers.params)
            if self._window_step:
                self.data_skipped_steps += 1
            core.discard_step()  # the guard's step count follows Lightning's global_step
            skip = True
            self._report = None
        else:
            report = core.before_step(scaler=self.scaler, drop_on_skip=True)
            self._report = report
            self.last_report = report
            self.reports += 1
            self.checkpoints.observe(report.step, report)
            if report.halt:
                drop_grads(core.layers.params)
                self._halt(trainer, report)
            skip = report.skipped
        if skip and pl_module.automatic_optimization:
            self._hold_schedulers(trainer)
        if self._manage_clip:
            trainer.gradient_clip_val = None  # clipped by the core already: no second pass
        if rearm:
            lrm.rearm()

    def _hold_schedulers(self, trainer: Any) -> None:
        """Lightning steps the schedulers after every optimizer step, skipped or not: remember
        the state of the ``interval='step'`` ones, put back in on_train_batch_end."""
        self._held = []
        for c in trainer.lr_scheduler_configs:
            if c.interval != "step" or c.reduce_on_plateau:
                continue
            s = c.scheduler
            self._held.append((s, copy.deepcopy(s.state_dict()), [g["lr"] for g in s.optimizer.param_groups]))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._current = None
        core = self.core
        if core is None:
            return
        if self._stepped:  # an optimizer-step boundary (not accumulating, the guarded optimizer)
            self._stepped = False
            self._restore_stash()
            for sched, state, lrs in self._held:
                sched.load_state_dict(state)
                for g, lr in zip(sched.optimizer.param_groups, lrs):
                    g["lr"] = lr
            self._held = []
            report = self._report
            if report is not None:
                core.after_step(report)
                self._keep_scale(report)
            self._report = None
            self._window_step = False
            self._poisoned = False
            self._setup_clip(trainer)
        if self.batches is not None:
            self.batches.poll()

    def _keep_scale(self, report: StepReport) -> None:
        """Lightning's GradScaler updated inside the optimizer step: put back the scale the core
        wants kept (an overflow streak, or overflows on restored weights, are not cured by halving)."""
        scaler = self.scaler
        if scaler is None or not scaler.is_enabled() or getattr(scaler, "_scale", None) is None:
            return
        keep = self.core.scale_to_keep(report) if self.core is not None else None
        if keep is not None:
            scaler._scale.fill_(keep)

    # -- actions ---------------------------------------------------------------------------
    def _skip_data(self, action: Action) -> dict[str, Any]:
        n = int(action.params.get("batches", 0))
        self._skip_left += n
        trainer = self._trainer
        automatic = trainer is not None and trainer.lightning_module.automatic_optimization
        if automatic and self._wrapped:
            mode = ("the next optimizer steps' batches are drawn but not computed (training_step returns None)"
                    if trainer.world_size == 1 else
                    "the next optimizer steps' batches are drawn but not computed (a zero loss keeps DDP in step)")
        else:
            mode = "the next optimizer steps' batches run but their gradients are dropped"
        return {"mode": mode, "optimizer_steps": n}

    def _rollback_to_checkpoint(self, action: Action) -> dict[str, Any] | None:
        """Disk tier: restore the newest tested ``ModelCheckpoint`` file of this run."""
        trainer = self._trainer
        core = self.core
        if trainer is None or core is None:
            return None
        self.checkpoints.resolve(trainer)
        for entry in self.checkpoints.candidates():
            ckpt, problem = self._read_checkpoint(trainer, entry)
            if not self._all_ranks_ok(trainer, ckpt is not None):  # every rank restores, or none does
                self.checkpoints.forget(entry)
                core.emit({"type": "snapshot_fallback", "step": action.step, "wanted": entry["step"],
                           "problems": [problem or "unreadable on another rank"]})
                continue
            assert ckpt is not None
            self._restore_checkpoint(trainer, ckpt)
            self.checkpoints.drop_after(entry["step"])
            return {"to_step": entry["step"], "path": entry["path"], "source": "checkpoint"}
        return None

    def _read_checkpoint(self, trainer: Any, entry: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
        """Read and check a checkpoint file before anything is changed."""
        path = entry["path"]
        try:
            try:
                ckpt = trainer.strategy.load_checkpoint(path, weights_only=True)
            except FileNotFoundError:
                raise
            except Exception:  # hyperparameters or other objects: the file was written by this run
                ckpt = trainer.strategy.load_checkpoint(path, weights_only=False)
            if int(ckpt.get("global_step", -1)) != int(entry["step"]):
                raise ValueError(f"holds step {ckpt.get('global_step')}, not {entry['step']} (overwritten)")
            if "optimizer_states" not in ckpt or len(ckpt["optimizer_states"]) < len(trainer.optimizers):
                raise ValueError("has no optimizer state (save_weights_only)")
            own = trainer.lightning_module.state_dict()
            weights = ckpt["state_dict"]
            if set(weights) != set(own):
                raise ValueError(f"weights do not match the module (keys {sorted(set(weights) ^ set(own))[:3]})")
            for k, v in weights.items():
                if tuple(v.shape) != tuple(own[k].shape):
                    raise ValueError(f"weight {k} has shape {tuple(v.shape)}, the module {tuple(own[k].shape)}")
            return ckpt, ""
        except Exception as exc:
            return None, f"{path}: {type(exc).__name__}: {exc}"[:300]

    def _all_ranks_ok(self, trainer: Any, ok: bool) -> bool:
        if not _distributed(trainer):
            return ok
        flag = torch.tensor([1.0 if ok else 0.0], device=trainer.lightning_module.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return bool(flag.item() > 0)

    def _restore_checkpoint(self, trainer: Any, ckpt: dict[str, Any]) -> None:
        """Module weights, optimizer states (LRs and the guard's Adam moves kept unless
        ``restore_schedule``), schedulers (only with ``restore_schedule``), GradScaler, detectors."""
        core = self.core
        assert core is not None
        restore_schedule = core.config.recovery.restore_schedule
        with torch.no_grad():
            trainer.lightning_module.load_state_dict(ckpt["state_dict"])  # copies into the parameters
        for opt, state in zip(trainer.optimizers, ckpt["optimizer_states"]):
            opt = unwrap_optimizer(opt)
            kept = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
            opt.load_state_dict(state)
            for g, hp in zip(opt.param_groups, kept):
                for k in ("betas", "eps"):
                    if k in hp:
                        g[k] = hp[k]  # the policy's Adam changes survive a rollback
                if not restore_schedule:
                    for k in ("lr", "initial_lr"):
                        if k in hp:
                            g[k] = hp[k]
        if restore_schedule:
            for conf, state in zip(trainer.lr_scheduler_configs, ckpt.get("lr_schedulers", [])):
                conf.scheduler.load_state_dict(state)
        key = type(trainer.precision_plugin).__qualname__
        if self.scaler is not None and self.scaler.is_enabled() and ckpt.get(key):
            self.scaler.load_state_dict(ckpt[key])
        mine = (ckpt.get("callbacks") or {}).get(self.state_key) or {}
        detectors = (mine.get("core") or {}).get("detectors")
        if detectors:
            core.detectors.load_state_dict(detectors)

    def _halt(self, trainer: Any, report: StepReport) -> None:
        self.halted = report.diagnosis or {}
        trainer.should_stop = True
        core = self.core
        if trainer.global_rank == 0 and core is not None and core.log_path is not None:
            path = os.path.join(os.path.dirname(core.log_path), "diagnosis.json")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as fh:
                json.dump(self.halted, fh, indent=1, default=str)
            self.diagnosis_path = path
        warn(str(GradGuardHalt(self.halted)), stacklevel=2)


def make_callback_class(pl: ModuleType) -> type:
    """``GradGuardCallback`` for a Lightning package: ``lightning.pytorch`` or ``pytorch_lightning``."""
    base = pl.Callback
    doc = (_GradGuardMixin.__doc__ or "") + "\n\n" + (__doc__ or "")
    return type("GradGuardCallback", (_GradGuardMixin, base),
                {"__module__": __name__, "__doc__": doc, "__qualname__": "GradGuardCallback"})


def _import_lightning() -> ModuleType:
    try:
        import lightning.pytorch as pl
    except ImportError:
        try:
            import pytorch_lightning as pl  # type: ignore[no-redef]
        except ImportError as exc:
            raise ImportError("gradguard.lightning needs Lightning: pip install 'gradguard[lightning]' "
                              "(or pytorch-lightning)") from exc
    return pl


GradGuardCallback = make_callback_class(_import_lightning())
