"""The Trainer's ``training_step``, run by gradguard: micro-batch losses, out-of-memory retries in
smaller chunks, and data windows skipped after a rollback (not computed)."""

from __future__ import annotations

from typing import Any

import torch

from .._compat import ddp_wrapper, shadow_method, unshadow_method
from ..data import batch_len, split_batch
from ..errors import warn_once
from ..oom import SKIPPED, EveryRank, OomRecovery, PieceFailed
from ..policy import Action

__all__ = ["StepRunner"]


def output_loss(output: Any, kwargs: dict[str, Any]) -> Any:
    """The training loss in a model's forward output: ``outputs.loss``, ``output["loss"]``, or the
    first element of a tuple when labels were passed (None if there is none)."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, (tuple, list)) and output and kwargs.get("labels") is not None:
        loss = output[0]
    return loss


class StepRunner:
    """Per-run micro-batch state of the HF adapter, and the ``training_step`` wrapper (installed only
    when the policy acts: monitor mode changes nothing)."""

    def __init__(self, core: Any, args: Any, params: list[torch.nn.Parameter]) -> None:
        self.core = core
        self.args = args
        self.params = params
        self.trainer: Any = None
        self.losses: list[torch.Tensor] = []  # this step's micro-batch losses (the forward hook)
        self.sum_semantics = False  # the Trainer passed num_items_in_batch: losses are already normalised
        self.splits = 1  # every micro-batch runs as this many chunks (after an out-of-memory error)
        self.micro_in_step = 0
        self.last_micro = 0
        self.poisoned = False  # an out-of-memory error left this step's gradients half-accumulated
        self.discard_left = 0  # upcoming optimizer steps whose data is skipped (after a rollback)
        self.last_step_loss: float | None = None
        self.oom: OomRecovery | None = OomRecovery(core, lambda: self.params, self.shrink_to) if core is not None else None
        self._orig: Any = None
        self._wrapper: Any = None
        self._previous: Any = None
        self.ranks: EveryRank | None = None  # recovery.oom_all_ranks under DDP
        self._every_rank: bool | None = None  # decided at the first step

    @property
    def wrapped(self) -> bool:
        return self._orig is not None

    # -- the step's loss ----------------------------------------------------------------------
    def forward_hook(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        """A forward hook on the model: ``outputs.loss`` of every training micro-batch."""
        if not module.training or not torch.is_grad_enabled():
            return
        loss = output_loss(output, kwargs)
        if isinstance(loss, torch.Tensor):
            self.losses.append(loss.detach().float().mean())
            self.sum_semantics = kwargs.get("num_items_in_batch") is not None

    def take_step_loss(self) -> torch.Tensor | None:
        if not self.losses:
            return None
        stacked = torch.stack(self.losses)
        self.losses = []
        if not self.sum_semantics:
            return stacked.mean()
        # with num_items_in_batch each micro-batch loss is already divided by the whole step's count;
        # with average_tokens_across_devices that count spans every process (the Trainer multiplies
        # the loss by the process count afterwards; the mean over ranks then gives the true loss)
        loss = stacked.sum()
        world = int(getattr(self.args, "world_size", 1) or 1)
        if world > 1 and getattr(self.args, "average_tokens_across_devices", False):
            loss = loss * world
        return loss

    # -- the wrapper ----------------------------------------------------------------------------
    def wrap(self, trainer: Any) -> None:
        self.trainer = trainer
        orig = trainer.training_step
        self._orig = orig

        def training_step(model: Any, inputs: Any, num_items_in_batch: Any = None, *args: Any, **kwargs: Any) -> Any:
            return self._guarded(orig, model, inputs, num_items_in_batch, *args, **kwargs)

        self._wrapper = training_step
        self._previous = shadow_method(trainer, "training_step", training_step)

    def open_step(self) -> None:
        """``on_step_begin``: with ``recovery.oom_all_ranks`` under DDP, the core's every-rank rule
        (:class:`gradguard.oom.EveryRank`), bound to the Trainer's DDP wrapper at the first step."""
        if self._every_rank is None:
            self._every_rank = False
            world = int(getattr(self.args, "world_size", 1) or 1)
            if world > 1 and self.oom is not None and self.core.config.recovery.oom_all_ranks and self.wrapped:
                ddp = ddp_wrapper(getattr(self.trainer, "model_wrapped", None))
                if ddp is None:
                    warn_once("oom-all-ranks-hf", "gradguard: recovery.oom_all_ranks applies to DDP only; this "
                              "Trainer's model is not DDP-wrapped, so an out-of-memory error is raised on its rank")
                else:
                    self.ranks = EveryRank(self.oom, ddp, self.core.collective)
                    self._every_rank = True
        if self.ranks is not None:
            self.ranks.open_step()

    def close_step(self) -> bool:
        """Before the step's decision: the vote and the gradient average. True: every rank skips."""
        return self.ranks is not None and self.ranks.close_step(self.params, self.last_micro)

    def unwrap(self) -> None:
        if self.ranks is not None:
            self.ranks.release()  # DDP's own sync again after the run
            self.ranks = None
        if self.trainer is not None and self._orig is not None:
            unshadow_method(self.trainer, "training_step", self._wrapper, self._previous)
        self._orig = None

    def skip_data(self, action: Action) -> dict[str, Any]:
        """The core's data-skip actuator: the next optimizer steps' batches are not computed."""
        n = int(action.params.get("batches", 0))
        self.discard_left += n
        return {"mode": "the batches of the next optimizer steps are drawn but not computed (no forward/backward)",
                "optimizer_steps": n}

    def placeholder_loss(self) -> torch.Tensor:
        """What a not-computed micro-batch reports to the Trainer's loss log: the last healthy
        step's loss, spread over the step's micro-batches (so the logged loss stays truthful)."""
        tr = self.trainer
        g = getattr(tr, "current_gradient_accumulation_steps", None) or tr.args.gradient_accumulation_steps
        v = self.last_step_loss if self.last_step_loss is not None else 0.0
        return torch.tensor(v / max(1, g), device=tr.args.device)

    def _guarded(self, orig: Any, model: Any, inputs: Any, num_items_in_batch: Any, *args: Any, **kwargs: Any) -> Any:
        if self.discard_left > 0 or self.poisoned:
            return self.placeholder_loss()  # this step's data is skipped: no forward, no backward
        first = self.micro_in_step == 0
        self.micro_in_step += 1
        size = batch_len(inputs)
        self.last_micro = size or self.last_micro
        start = len(self.losses)
        try:
            return self._run_chunks(orig, model, inputs, num_items_in_batch, self.splits, *args, **kwargs)
        except torch.OutOfMemoryError as exc:
            touched = len(self.losses) > start  # a forward finished: its backward may have touched grads
            del self.losses[start:]
            chunk = -(-size // self.splits) if size else 0
            world = 1 if self.ranks is not None else getattr(self.args, "world_size", 1)
            if self.oom is None or not self.oom.can_recover(chunk, world):
                raise  # nothing left to split; or several processes, which must stay in lockstep
            message = f"{type(exc).__name__}: {exc}"[:160]
        splits = self.splits

        def attempt(parts: int) -> Any:
            mark = len(self.losses)
            try:
                return self._run_chunks(orig, model, inputs, num_items_in_batch, splits * parts, *args, **kwargs)
            except torch.OutOfMemoryError:
                touched = len(self.losses) > mark
                del self.losses[mark:]
                raise PieceFailed(touched) from None

        where = "backward" if touched else "forward"
        if self.ranks is not None:  # this rank retries alone; every rank responds together in close_step
            out = self.ranks.retry(attempt, samples=chunk, message=message, touched=touched, keep_earlier=not first,
                                   where=where)
        else:
            out = self.oom.recover(attempt, samples=chunk, message=message, touched=touched, earlier_grads=not first,
                                   where=where)
        if out is SKIPPED:
            self.poisoned = True  # the rest of the step is not computed; the step is skipped
            return self.placeholder_loss()
        return out

    def shrink_to(self, fits: int) -> tuple[int, int] | None:
        """The OOM rule's resize for the Trainer: every micro-batch runs as more chunks (the Trainer's
        loader and accumulation stay as they are)."""
        size = self.last_micro
        if not size:
            return None
        old = -(-size // self.splits)
        while -(-size // self.splits) > fits and self.splits < size:
            self.splits *= 2
        new = -(-size // self.splits)
        return (old, new) if new < old else None

    def _run_chunks(self, orig: Any, model: Any, inputs: Any, num_items_in_batch: Any, splits: int, *args: Any,
                    **kwargs: Any) -> Any:
        tr = self.trainer
        attr = "current_gradient_accumulation_steps"
        n = batch_len(inputs)
        chunks = split_batch(inputs, n, splits) if n and splits > 1 and hasattr(tr, attr) else []
        if len(chunks) <= 1:
            return orig(model, inputs, num_items_in_batch, *args, **kwargs)
        total = sum(n for _, n in chunks)
        g = getattr(tr, attr)
        start = len(self.losses)
        out = None
        try:
            for chunk, n in chunks:
                # mean-loss semantics: each chunk weighs n / total of the micro-batch (the Trainer
                # divides by this attribute); with num_items_in_batch the loss is already exact
                setattr(tr, attr, g * total / n)
                r = orig(model, chunk, num_items_in_batch, *args, **kwargs)
                out = r if out is None else out + r
        finally:
            setattr(tr, attr, g)
        vals = self.losses[start:]
        if len(vals) == len(chunks):
            if self.sum_semantics:
                self.losses[start:] = [torch.stack(vals).sum()]
            else:
                self.losses[start:] = [sum(v * (n / total) for v, (_, n) in zip(vals, chunks))]
        return out

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"discard_left": self.discard_left, "splits": self.splits, "last_step_loss": self.last_step_loss}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.discard_left = int(state.get("discard_left", 0))
        self.splits = int(state.get("splits", 1))
        self.last_step_loss = state.get("last_step_loss")
