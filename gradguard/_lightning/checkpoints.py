"""The files of the trainer's ``ModelCheckpoint`` callbacks as a :class:`gradguard.contract.CheckpointSource`.

Files are read with ``weights_only=True`` only: a checkpoint that holds pickled objects (or was
tampered with) is skipped with a ``snapshot_fallback`` event, never unpickled."""

from __future__ import annotations

import inspect
from typing import Any

from .._compat import pl_checkpoint_last_saved
from ..act import unwrap_optimizer
from ..recovery import check_weights, load_optimizer_keeping_settings, safe_load

__all__ = ["ModelCheckpointFiles"]


class ModelCheckpointFiles:
    """Tracks the files written by ``ModelCheckpoint`` callbacks (their paths are known after the
    save, so :meth:`resolve` runs at the next batch) and reads / restores one for a rollback:
    module weights, every optimizer's state (current settings kept), schedulers (only with
    ``restore_schedule``), the GradScaler, and the guard's detectors (by the rollback loop)."""

    def __init__(self, state_key: str) -> None:
        self.state_key = state_key
        self.trainer: Any = None
        self.scaler: Any = None
        self.restore_schedule = False
        self._pending: set[int] = set()  # steps saved whose file path is not known yet
        self._seen: set[str] = set()

    def bind(self, trainer: Any, scaler: Any, restore_schedule: bool) -> None:
        self.trainer, self.scaler, self.restore_schedule = trainer, scaler, restore_schedule

    # -- tracking --------------------------------------------------------------------------------
    def saved(self, step: int) -> None:
        self._pending.add(int(step))

    def resolve(self, trainer: Any, core: Any) -> None:
        """Report the files saved since the last call to the core's trust tier."""
        if not self._pending:
            return
        cbs = getattr(trainer, "checkpoint_callbacks", []) or []
        for cb in cbs:
            step, paths = pl_checkpoint_last_saved(cb)
            if step not in self._pending:
                continue
            new = [p for i, p in enumerate(paths) if i == 0 or p not in self._seen]
            if new and core is not None:
                core.checkpoint_saved(step, list(dict.fromkeys(new)))
        for cb in cbs:
            self._seen.update(pl_checkpoint_last_saved(cb)[1][1:])
        self._pending.clear()

    @property
    def roots(self) -> list[str] | None:
        """The run's checkpoint folders (every ``ModelCheckpoint``'s ``dirpath``, the trainer's
        ``default_root_dir``): only checkpoints inside them are rolled back to."""
        trainer = self.trainer
        if trainer is None:
            return None
        out = [getattr(cb, "dirpath", None) for cb in getattr(trainer, "checkpoint_callbacks", []) or []]
        out.append(getattr(trainer, "default_root_dir", None))
        return [str(r) for r in out if r]

    def saved_paths(self, step: int) -> list[str]:
        return []  # known only after the save (see resolve)

    # -- reading and restoring ---------------------------------------------------------------------
    def _loader(self) -> Any:
        load = getattr(getattr(self.trainer, "strategy", None), "load_checkpoint", None)
        try:
            if load is not None and "weights_only" in inspect.signature(load).parameters:
                return load  # the strategy's reader (remote filesystems), asked for weights_only=True
        except (TypeError, ValueError):  # pragma: no cover
            pass
        return None

    def read(self, path: str, step: int) -> dict[str, Any]:
        trainer = self.trainer
        ckpt = safe_load(path, loader=self._loader())
        if int(ckpt.get("global_step", -1)) != int(step):
            raise ValueError(f"holds step {ckpt.get('global_step')}, not {step} (overwritten)")
        if "optimizer_states" not in ckpt or len(ckpt["optimizer_states"]) < len(trainer.optimizers):
            raise ValueError("has no optimizer state (save_weights_only)")
        check_weights(ckpt["state_dict"], trainer.lightning_module.state_dict(), exact=True)
        mine = (ckpt.get("callbacks") or {}).get(self.state_key) or {}
        key = type(trainer.precision_plugin).__qualname__
        return {"model": ckpt["state_dict"], "optimizers": ckpt["optimizer_states"],
                "optimizer": ckpt["optimizer_states"][0], "schedulers": ckpt.get("lr_schedulers", []),
                "scaler": ckpt.get(key), "guard": mine.get("core")}

    def restore(self, payload: dict[str, Any]) -> None:
        trainer = self.trainer
        import torch

        with torch.no_grad():
            trainer.lightning_module.load_state_dict(payload["model"])  # copies into the parameters
        for opt, state in zip(trainer.optimizers, payload["optimizers"]):
            load_optimizer_keeping_settings(unwrap_optimizer(opt), state, restore_schedule=self.restore_schedule)
        if self.restore_schedule:
            for conf, state in zip(trainer.lr_scheduler_configs, payload["schedulers"]):
                conf.scheduler.load_state_dict(state)
        if self.scaler is not None and self.scaler.is_enabled() and payload.get("scaler"):
            self.scaler.load_state_dict(payload["scaler"])
