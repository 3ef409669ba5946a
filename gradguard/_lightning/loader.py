"""The Lightning trainer's train DataLoader as a :class:`gradguard.contract.LoaderHandle`.

The batch sampler's ``batch_size`` is changed live and the fit loop's cached epoch length is
recomputed; the fit loop's private pieces are reached through :mod:`gradguard._compat`."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from torch.utils.data import BatchSampler

from .._compat import (
    pl_combined_loader,
    pl_data_fetcher,
    pl_iterator_drawn,
    pl_loader_iterator,
    pl_restart_sampler_iter,
    pl_set_epoch_length,
    swap_class,
)

__all__ = ["LiveBatchSampler", "TrainerLoader"]


class LiveBatchSampler(BatchSampler):
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


class TrainerLoader:
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
        flat = getattr(pl_combined_loader(trainer), "flattened", None) or []
        if len(flat) != 1:
            return None
        bs = getattr(flat[0], "batch_sampler", None)
        if not isinstance(bs, BatchSampler) or type(bs).__iter__ not in (BatchSampler.__iter__, LiveBatchSampler.__iter__):
            return None
        return bs

    def sampler(self) -> BatchSampler | None:
        return self.find_sampler(self.trainer)

    def make_live(self) -> None:
        """Give a ``drop_last=True`` sampler the re-reading ``__iter__`` (before the epoch draws)."""
        bs = self.sampler()
        if bs is None or type(bs) is not BatchSampler or not bs.drop_last:
            return
        swap_class(bs, LiveBatchSampler)
        it = pl_loader_iterator(self.trainer)
        if it is not None and pl_restart_sampler_iter(it):
            pass  # nothing drawn yet: the iterator starts again with the live sampler
        elif it is not None:
            self._static_epoch = int(self.trainer.current_epoch)  # this epoch's size is fixed

    def live(self) -> bool:
        return self.sampler() is not None and int(self.trainer.current_epoch) != self._static_epoch

    def drawn(self) -> int:
        """Batches drawn from the sampler in this epoch (a multi-worker loader draws ahead)."""
        drawn = pl_iterator_drawn(pl_loader_iterator(self.trainer))
        if drawn is not None:
            return drawn
        fetcher = pl_data_fetcher(self.trainer)
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
        pl_set_epoch_length(self.trainer, total)

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        loader, acc = self.target()
        return {"loader": loader, "acc": acc, "base_loader": self.base_loader, "base_acc": self.base_acc,
                "cap": self.cap}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (int(state["base_loader"]), int(state["base_acc"])) != (self.base_loader, self.base_acc):
            return  # resumed with another batch size / accumulation than the saved run's: the user's stand
        self.cap = int(state["cap"])
        if (int(state["loader"]), int(state["acc"])) != self.target():
            self.pending = {"loader": int(state["loader"]), "acc": int(state["acc"])}
        self.epoch_start()
