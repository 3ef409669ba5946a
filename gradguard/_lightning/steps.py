"""The Lightning step wrappers: ``training_step`` (a data window skipped after a rollback is not
computed; an out-of-memory error is retried in pieces) and, on one process in automatic
optimization, ``trainer.strategy.backward`` (an out-of-memory error in the backward). Installed
only when the policy acts (monitor mode wraps nothing); removed at teardown."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Mapping
from typing import Any

import torch

from .._compat import ddp_wrapper, shadow_method, unshadow_method
from .._shard import zero_touching
from ..act import drop_grads
from ..data import batch_len, split_batch
from ..errors import warn_once
from ..oom import SKIPPED, EveryRank, OomRecovery, PieceFailed

__all__ = ["StepWrappers"]


def _loss_of(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        return output.get("loss")
    return None


class StepWrappers:
    """Owns the wrappers and the out-of-memory state of one Lightning run; reads the run's
    (:class:`gradguard._lightning.run.LightningRun`) trainer, core, scaler, batch controller and
    data-window flag."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self._wrapped: list[tuple[Any, str, Any, Any]] = []  # (object, attribute, wrapper, previous)
        self._current: tuple[tuple[Any, ...], dict[str, Any]] | None = None  # training_step's arguments
        self._stash: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._orig_training_step: Any = None
        self.poisoned = False  # an out-of-memory error left this step's gradients unusable
        self.oom: OomRecovery | None = None  # the core's rule, bound in install()
        self.ranks: EveryRank | None = None  # recovery.oom_all_ranks under DDP

    @property
    def _trainer(self) -> Any:
        return self.run.trainer

    @property
    def core(self) -> Any:
        return self.run.core

    @property
    def config(self) -> Any:
        return self.run.config

    @property
    def scaler(self) -> Any:
        return self.run.scaler

    @property
    def batches(self) -> Any:
        return self.run.batches

    @property
    def _window_step(self) -> bool:
        return bool(self.run.window_step)

    @property
    def wrapped(self) -> bool:
        """Whether any wrapper is installed."""
        return bool(self._wrapped)

    def end_batch(self) -> None:
        """The batch is over: its ``training_step`` arguments are dropped."""
        self._current = None

    def install(self, trainer: Any, pl_module: Any) -> None:
        self.remove()
        if self.core is not None:
            self.oom = OomRecovery(self.core, lambda: self._trainable(self._trainer.lightning_module), self._shrink_to)
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
        self._every_rank(trainer, pl_module)
        if (trainer.world_size == 1 or self.ranks is not None) and self.config.policy.act \
                and pl_module.automatic_optimization:
            strategy = trainer.strategy
            orig_backward = strategy.backward

            @functools.wraps(orig_backward)
            def backward(closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
                return self._backward(orig_backward, closure_loss, optimizer, *args, **kwargs)

            self._wrap(strategy, "backward", backward)

    def _every_rank(self, trainer: Any, pl_module: Any) -> None:
        """``recovery.oom_all_ranks`` under DDP: the core's every-rank rule bound to the DDP wrapper."""
        self.ranks = None
        if trainer.world_size <= 1 or not self.config.recovery.oom_all_ranks or self.oom is None:
            return
        if not (self.config.policy.act and pl_module.automatic_optimization):
            return
        ddp = ddp_wrapper(getattr(trainer.strategy, "model", None))
        if ddp is None:
            warn_once("oom-all-ranks-ddp", "gradguard: recovery.oom_all_ranks applies to strategy='ddp' only; under "
                      f"{type(trainer.strategy).__name__} an out-of-memory error is raised on its rank as before")
            return
        self.ranks = EveryRank(self.oom, ddp, self.core.collective)

    def open_step(self) -> None:
        """The first micro-batch of an optimizer step: see :class:`gradguard.oom.EveryRank`."""
        if self.ranks is not None:
            self.ranks.open_step()

    def close_step(self) -> None:
        """Before the optimizer step: the vote and the gradient average (a step every rank skips
        is dropped as a poisoned one)."""
        if self.ranks is not None:
            samples = batch_len(self._current[0][0]) if self._current and self._current[0] else 0
            if self.ranks.close_step(self._trainable(self._trainer.lightning_module), samples):
                self.poisoned = True

    def _wrap(self, obj: Any, attr: str, wrapper: Any) -> None:
        self._wrapped.append((obj, attr, wrapper, shadow_method(obj, attr, wrapper)))

    def remove(self) -> None:
        if self.ranks is not None:
            self.ranks.release()  # DDP's own sync again after the run
            self.ranks = None
        for obj, attr, wrapper, previous in reversed(self._wrapped):
            unshadow_method(obj, attr, wrapper, previous)  # someone else's later wrapper is left in place
        self._wrapped = []
        self._current = None
        self.restore_stash()

    def _trainable(self, pl_module: Any) -> list[torch.nn.Parameter]:
        return [p for p in pl_module.parameters() if p.requires_grad]

    def _training_step(self, orig: Any, *args: Any, **kwargs: Any) -> Any:
        trainer = self._trainer
        pl_module = trainer.lightning_module
        self._current = (args, kwargs)
        if pl_module.automatic_optimization and (self._window_step or self.poisoned):
            if trainer.world_size > 1:
                # Lightning refuses None under DDP: a zero loss that touches every parameter keeps the
                # gradient all-reduce of every rank in step (no model forward runs)
                return zero_touching(self._trainable(pl_module), pl_module.device)
            return None  # no forward/backward; the step is dropped in on_before_optimizer_step
        try:
            return orig(*args, **kwargs)
        except torch.OutOfMemoryError as exc:
            if not self._oom_recoverable(trainer, pl_module, args):
                raise
            message = str(exc)[:200]
        # outside the except block: the failed forward's frames (and activations) can be released
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
        args_, kwargs_ = self._current  # type: ignore[misc]
        done = self._oom_retry(self._orig_training_step, args_, kwargs_, message, in_forward=False)
        if done is not None:  # the pieces' gradients are in place: run Lightning's after-backward hooks
            strategy = self._trainer.strategy
            closure_loss = strategy.precision_plugin.post_backward(closure_loss, self._trainer.lightning_module)
            strategy.post_backward(closure_loss)
        return closure_loss

    def _oom_recoverable(self, trainer: Any, pl_module: Any, args: tuple[Any, ...]) -> bool:
        return bool(self.oom is not None and pl_module.automatic_optimization and args
                    and self.oom.can_recover(batch_len(args[0]), 1 if self.ranks is not None else trainer.world_size))

    def _shrink_to(self, fits: int) -> tuple[int, int] | None:
        """The OOM rule's resize for Lightning: the loader's micro-batch halves (more accumulation)."""
        ctl = self.batches
        if ctl is None:
            return None  # the train DataLoader's batch sampler cannot be resized: each batch is split
        start = ctl.target()[0]
        while ctl.target()[0] > fits and ctl.shrink_micro() is not None:
            pass
        return (start, ctl.target()[0]) if ctl.target()[0] < start else None

    def _oom_retry(self, orig: Any, args: tuple[Any, ...], kwargs: dict[str, Any], message: str,
                   in_forward: bool) -> Any:
        """Hand a micro-batch whose forward or backward ran out of memory to the core's rule
        (:mod:`gradguard.oom`), running its pieces Lightning's way. Returns the training_step output
        for Lightning (``in_forward``), else True, or None for a skipped step."""
        trainer = self._trainer
        pl_module = trainer.lightning_module
        acc = int(trainer.accumulate_grad_batches)
        first = trainer.fit_loop.epoch_loop.batch_idx % acc == 0
        params = self._trainable(pl_module)
        if first:
            drop_grads(params)  # the previous step's (Lightning zero-grads after training_step)
        ctx = contextlib.nullcontext if in_forward else trainer.precision_plugin.train_step_context
        assert self.oom is not None
        samples, where = batch_len(args[0]), "forward" if in_forward else "backward"
        if self.ranks is not None:  # this rank retries alone; every rank responds together in close_step
            out = self.ranks.retry(lambda n: self._run_pieces(orig, args, kwargs, n, acc, ctx), samples=samples,
                                   message=message, touched=not in_forward, keep_earlier=not first, where=where)
            if out is SKIPPED:  # the rest of the window runs no forward (a zero loss keeps DDP in step)
                self.poisoned = True
                return zero_touching(params, pl_module.device) if in_forward else True
        else:
            out = self.oom.recover(lambda parts: self._run_pieces(orig, args, kwargs, parts, acc, ctx),
                                   samples=samples, message=message, touched=not in_forward,
                                   earlier_grads=not first, where=where)
        if out is SKIPPED:
            self.poisoned = True  # the rest of the window is not computed; the step is skipped
            return None
        if not in_forward:
            return True
        total, output = out
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
                    ctx: Any) -> tuple[torch.Tensor | None, Any]:
        """Forward and backward of one micro-batch in ``parts`` pieces, each loss weighted by its
        share of the micro-batch (and 1/accumulation, as Lightning does). Returns (the micro-batch's
        loss, the last piece's output); raises :class:`gradguard.oom.PieceFailed` when a piece
        runs out of memory."""
        batch, rest = args[0], args[1:]
        n = batch_len(batch)
        scaler = self.scaler if self.scaler is not None and self.scaler.is_enabled() else None
        total: torch.Tensor | None = None
        output: Any = None
        touched = False  # a backward ran (or failed half-way): gradients may be in place
        for piece, size in split_batch(batch, n, parts):
            try:
                with ctx():
                    out = orig(piece, *rest, **kwargs)
                loss = _loss_of(out)
                if loss is None:
                    continue
                touched = True
                with torch.autocast(loss.device.type, enabled=False):
                    scaled = loss * (size / n / acc)
                    (scaler.scale(scaled) if scaler is not None else scaled).backward()
            except torch.OutOfMemoryError:
                raise PieceFailed(touched) from None
            value = loss.detach().float() * (size / n)
            total = value if total is None else total + value
            output = out
            del loss, out
        return total, output

    def restore_stash(self) -> None:
        stash, self._stash = self._stash, None
        for p, g in stash or []:
            p.grad = g if p.grad is None else p.grad + g
