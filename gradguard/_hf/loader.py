"""The Trainer's train dataloader as a :class:`gradguard.contract.LoaderHandle`."""

from __future__ import annotations

from typing import Any

__all__ = ["TrainerLoader"]


class TrainerLoader:
    """Global size = loader batch x gradient accumulation steps (per device). ``shrink_global`` /
    ``grow_global`` change the loader's batch size live (the batch sampler re-reads it between
    batches; accelerate's ``BatchSamplerShard`` of a multi-process run is updated with its inner
    sampler); ``shrink_micro`` splits every micro-batch into more chunks inside ``training_step``
    (global batch and samples unchanged), through the step runner."""

    def __init__(self, dataloader: Any, accumulation: int, runner: Any) -> None:
        self.dl = dataloader
        self.accumulation = max(1, int(accumulation))
        self.runner = runner  # gradguard._hf.steps.StepRunner (chunking)
        self.base_loader_batch = self.loader_batch or 1

    def _holders(self) -> list[Any]:
        bs = getattr(self.dl, "batch_sampler", None)
        holders = []
        if bs is not None and hasattr(bs, "batch_size"):
            holders.append(bs)
            inner = getattr(bs, "batch_sampler", None)
            if inner is not None and hasattr(inner, "batch_size"):
                holders.append(inner)
        return holders

    @property
    def resizable(self) -> bool:
        return bool(self._holders())

    @property
    def loader_batch(self) -> int:
        h = self._holders()
        return int(h[-1].batch_size) if h else 0

    def set_loader_batch(self, size: int) -> None:
        for h in self._holders():
            h.batch_size = size

    @property
    def batch_size(self) -> int:
        return self.loader_batch * self.accumulation

    @property
    def base_batch_size(self) -> int:
        return self.base_loader_batch * self.accumulation

    @property
    def accumulation_steps(self) -> int:
        return self.accumulation * self.runner.splits

    def shrink_global(self) -> tuple[int, int] | None:
        old = self.loader_batch
        if not self.resizable or old <= 1:
            return None
        self.set_loader_batch(old // 2)
        self.runner.splits = max(1, min(self.runner.splits, old // 2))
        return old * self.accumulation, self.batch_size

    def grow_global(self) -> tuple[int, int] | None:
        old = self.loader_batch
        if not self.resizable or old >= self.base_loader_batch:
            return None
        self.set_loader_batch(min(self.base_loader_batch, old * 2))
        return old * self.accumulation, self.batch_size

    def shrink_micro(self) -> tuple[int, int] | None:
        if not self.runner.wrapped:
            return None  # training_step is not wrapped (monitor mode, or the Trainer was not found)
        size = self.loader_batch or self.runner.last_micro
        old = -(-size // self.runner.splits) if size else 0
        if old <= 1:
            return None
        self.runner.splits *= 2
        return old, -(-size // self.runner.splits)

    def state_dict(self) -> dict[str, Any]:
        return {"batch_size": self.loader_batch if self.resizable else None, "base_batch_size": self.base_loader_batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.resizable:
            return
        base = state.get("base_batch_size")
        if base and int(base) != self.base_loader_batch:
            return  # resumed with another batch size than the saved run's: the user's new one stands
        bs = state.get("batch_size")
        if bs and self.loader_batch != bs:
            self.set_loader_batch(int(bs))
