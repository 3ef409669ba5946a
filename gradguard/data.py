"""Opt-in data plumbing for plain loops: a resizable, skippable batch controller with
OOM-safe gradient accumulation.

``BatchController`` hands out one optimizer step's worth of samples at a time (a ``StepBatch``),
split into micro-batches. Sizes change only between steps (always an aligned accumulation
boundary) and the epoch permutation is consumed by position, so a resize never drops or repeats
a sample. ``Guard(..., batches=controller)`` plugs it into the policy: ``shrink_batch`` halves the
global batch (LR scaled linearly) or the micro-batch, ``skip_data`` skips a window after a rollback,
and ``Guard.accumulate`` retries a step's data with half the micro-batch on an out-of-memory error.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import default_collate

from .errors import ConfigError

__all__ = ["StepBatch", "BatchController", "batch_len", "split_batch"]


@dataclass
class StepBatch:
    """The samples of one optimizer step, and how to split them into micro-batches."""

    indices: list[int]
    micro_batch_size: int
    epoch: int
    collate: Callable[[list[Any]], Any]
    dataset: Sequence[Any]

    def __len__(self) -> int:
        return len(self.indices)

    def micro_batches(self, micro_batch_size: int | None = None) -> Iterator[tuple[Any, int]]:
        """Yields (collated micro-batch, number of samples in it)."""
        size = micro_batch_size or self.micro_batch_size
        for i in range(0, len(self.indices), size):
            chunk = self.indices[i:i + size]
            yield self.collate([self.dataset[j] for j in chunk]), len(chunk)


class BatchController:
    """Iterates a map-style dataset in steps of ``batch_size`` samples split into micro-batches.

    ``batch_size`` is the global batch of one optimizer step, ``micro_batch_size`` the number of
    samples per forward/backward (default: the whole step). Shuffling uses its own seeded
    generator per epoch, so the order is reproducible and resumable from ``state_dict``.
    """

    def __init__(self, dataset: Sequence[Any], batch_size: int, *, micro_batch_size: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 collate_fn: Callable[[list[Any]], Any] | None = None, min_batch_size: int = 1,
                 epochs: int | None = 1) -> None:
        for name, value in (("batch_size", batch_size), ("min_batch_size", min_batch_size)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"BatchController.{name}={value!r}: must be a positive int. "
                                 f"Fix: pass e.g. {name}=32")
        micro = micro_batch_size or batch_size
        if not isinstance(micro, int) or not 1 <= micro <= batch_size:
            raise ConfigError(f"BatchController.micro_batch_size={micro_batch_size!r}: must be an int in "
                             f"[1, batch_size={batch_size}]. Fix: pass a divisor of batch_size, or None")
        if len(dataset) == 0:
            raise ConfigError("BatchController.dataset: is empty. Fix: pass a dataset with samples")
        self.dataset = dataset
        self.batch_size = batch_size
        self.micro_batch_size = micro
        self.base_batch_size = batch_size
        self.min_batch_size = min_batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.collate = collate_fn or default_collate
        self.epochs = epochs
        self.epoch = 0
        self.position = 0
        self.steps = 0
        self.skipped_indices: list[list[int]] = []
        self.recent: deque[list[int]] = deque(maxlen=8)
        self._perm: list[int] | None = None

    # -- iteration -------------------------------------------------------------------------
    def _permutation(self) -> list[int]:
        if self._perm is None:
            n = len(self.dataset)
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + self.epoch)
                self._perm = torch.randperm(n, generator=g).tolist()
            else:
                self._perm = list(range(n))
        return self._perm

    def _take(self, n: int) -> list[int] | None:
        """The next n indices of the current epoch (fewer at its end), advancing to the next
        epoch when this one is used up; None when all epochs are done."""
        while True:
            if self.epochs is not None and self.epoch >= self.epochs:
                return None
            perm = self._permutation()
            if self.position < len(perm):
                chunk = perm[self.position:self.position + n]
                if len(chunk) < n and self.drop_last:
                    self._next_epoch()
                    continue
                self.position += len(chunk)
                return chunk
            self._next_epoch()

    def _next_epoch(self) -> None:
        self.epoch += 1
        self.position = 0
        self._perm = None

    def __iter__(self) -> Iterator[StepBatch]:
        while True:
            idx = self._take(self.batch_size)
            if idx is None:
                return
            self.steps += 1
            self.recent.append(idx)
            yield StepBatch(idx, min(self.micro_batch_size, self.batch_size), self.epoch, self.collate,
                            self.dataset)

    # -- actions ---------------------------------------------------------------------------
    def skip(self, n_steps: int) -> list[list[int]]:
        """Skip the next ``n_steps`` steps' worth of samples; returns their indices."""
        skipped = []
        for _ in range(n_steps):
            idx = self._take(self.batch_size)
            if idx is None:
                break
            skipped.append(idx)
        self.skipped_indices.extend(skipped)
        return skipped

    def shrink_global(self) -> tuple[int, int] | None:
        """Halve the global batch (not below min_batch_size); returns (old, new) or None."""
        new = max(self.min_batch_size, self.batch_size // 2)
        if new == self.batch_size:
            return None
        old = self.batch_size
        self.batch_size = new
        self.micro_batch_size = min(self.micro_batch_size, new)
        return old, new

    def grow_global(self) -> tuple[int, int] | None:
        """Double the global batch back towards its original size."""
        if self.batch_size >= self.base_batch_size:
            return None
        old = self.batch_size
        self.batch_size = min(self.base_batch_size, self.batch_size * 2)
        return old, self.batch_size

    def shrink_micro(self) -> tuple[int, int] | None:
        """Halve the micro-batch, keeping the global batch (more accumulation)."""
        if self.micro_batch_size <= 1:
            return None
        old = self.micro_batch_size
        self.micro_batch_size = max(1, old // 2)
        return old, self.micro_batch_size

    @property
    def accumulation_steps(self) -> int:
        return -(-self.batch_size // self.micro_batch_size)

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "micro_batch_size": self.micro_batch_size,
                "base_batch_size": self.base_batch_size, "epoch": self.epoch, "position": self.position,
                "steps": self.steps, "seed": self.seed, "skipped_indices": [list(x) for x in self.skipped_indices]}

    @staticmethod
    def check_state(state: Any) -> None:
        """Raise ``gradguard.state.StateError`` unless ``state`` is a complete, consistent
        batch-controller state (nothing is changed)."""
        from .state import StateError, check_fields

        check_fields("batches", state, {"batch_size": int, "micro_batch_size": int, "base_batch_size": int,
                                        "epoch": int, "position": int, "steps": int, "seed": int,
                                        "skipped_indices": list})
        for key in ("batch_size", "micro_batch_size", "base_batch_size"):
            if state[key] < 1:
                raise StateError(f"gradguard state batches.{key}={state[key]!r}: must be >= 1. "
                                 "Fix: load a state saved by BatchController.state_dict()")
        if state["micro_batch_size"] > state["batch_size"]:
            raise StateError(f"gradguard state batches.micro_batch_size={state['micro_batch_size']!r}: above "
                             f"batch_size={state['batch_size']}. Fix: load a state saved by BatchController.state_dict()")
        for key in ("epoch", "position", "steps"):
            if state[key] < 0:
                raise StateError(f"gradguard state batches.{key}={state[key]!r}: must be >= 0. "
                                 "Fix: load a state saved by BatchController.state_dict()")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        self.batch_size = state["batch_size"]
        self.micro_batch_size = state["micro_batch_size"]
        self.base_batch_size = state["base_batch_size"]
        self.epoch = state["epoch"]
        self.position = state["position"]
        self.steps = state["steps"]
        self.seed = state["seed"]
        self.skipped_indices = [list(x) for x in state["skipped_indices"]]
        self._perm = None


# -- splitting a collated batch (out-of-memory retries in the adapters) ---------------------------
def batch_len(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (0 when there is none)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else 0
    if isinstance(batch, Mapping):
        items = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        items = list(batch)
    else:
        return 0
    for v in items:
        n = batch_len(v)
        if n:
            return n
    return 0


def _cut(x: Any, n: int, start: int, stop: int) -> Any:
    if isinstance(x, torch.Tensor):
        return x[start:stop] if x.dim() > 0 and x.shape[0] == n else x
    if isinstance(x, Mapping):
        vals = {k: _cut(v, n, start, stop) for k, v in x.items()}
        try:
            return type(x)(vals)
        except TypeError:
            return vals
    if isinstance(x, (list, tuple)):
        if len(x) == n and x and not any(isinstance(v, (torch.Tensor, Mapping, list, tuple)) for v in x):
            return x[start:stop]  # a collated list of strings, ids...
        vals = [_cut(v, n, start, stop) for v in x]
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(*vals)  # a namedtuple
        return tuple(vals) if isinstance(x, tuple) else vals
    return x


def split_batch(batch: Any, n: int, parts: int) -> list[tuple[Any, int]]:
    """``batch`` (n samples) split along the first dimension into ``parts`` pieces: (piece, samples)."""
    parts = max(1, min(parts, n))
    sizes = [n // parts + (1 if i < n % parts else 0) for i in range(parts)]
    out, start = [], 0
    for size in sizes:
        out.append((_cut(batch, n, start, start + size), size))
        start += size
    return out
