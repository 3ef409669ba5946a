"""The engine contract: what a training engine provides so that gradguard can guard it.

gradguard's behaviour lives in :class:`gradguard.core.GuardCore` and the core modules beside it
(measurement, detection, policy, actuators, snapshots, checkpoint tier, rollback, halting). An
*engine adapter* (the plain loop :class:`gradguard.Guard`, ``gradguard.hf.GradGuardCallback``,
``gradguard.lightning.GradGuardCallback``) only

1. maps its engine's hooks onto the :class:`Event` vocabulary below (calling the core at each), and
2. implements the protocols of this module for its engine: a :class:`LoaderHandle` (batch size),
   a :data:`DataSkip` (skipping upcoming samples), a :class:`CheckpointSource` (the engine's own checkpoints, for the
   rollback disk tier) and a :class:`Collective` (the cross-process reduction and vote; the core's
   :class:`TorchCollective` serves every torch.distributed engine). An engine that runs the
   optimizer step itself (DeepSpeed) also implements :class:`SteppingEngine`.

A new engine (Accelerate, Fabric, a torchtitan-style loop) is guarded by writing those two pieces;
``tests/test_contract.py`` runs the same scenarios against every engine.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["Event", "LoaderHandle", "DataSkip", "CheckpointSource", "Collective", "TorchCollective",
           "LocalCollective", "collective", "SteppingEngine", "EngineSignals"]


class Event(enum.Enum):
    """The points of a training loop where the core is called; every engine maps its hooks onto
    these. The loop, in pseudocode (an optimizer step may accumulate several micro-batches)::

        FIT_START                  # core built on model/optimizer/scheduler/scaler; refusals
                                   # checked, clip conflict resolved, guard state restored
        for epoch:
            EPOCH_START            # loader handle: pending batch-size changes apply
            for optimizer step:
                STEP_START         # a data window skipped after a rollback is not computed
                for micro-batch:
                    forward                        # out of memory -> retried in pieces (OOM_RETRY)
                    MICRO_LOSS     # core.observe_loss(loss), unscaled, per micro-batch
                    backward
                BEFORE_OPTIMIZER_STEP  # grads final, unscaled, unclipped: core.before_step
                                       # measures (one collective reduction), detects, decides,
                                       # clips; a skip drops the grads and holds the scheduler
                optimizer.step()       # the core's LR multiplier applies around it
                scheduler.step()       # swallowed for a skipped step
                AFTER_OPTIMIZER_STEP   # core.after_step: counters, snapshots, metrics; the fp16
                                       # scale the core wants kept is put back; HALT below
            EPOCH_END
            CHECKPOINT_SAVED       # checkpoint source: the new file joins the trust tier
        FIT_END                    # summary written, sinks closed, adapter plumbing removed;
                                   # after a halt: GradGuardHalt raised (unless output.halt_raises
                                   # is False)

        An engine that runs the optimizer step itself (DeepSpeed: unscaling, clipping and the
        step happen inside its ``backward``/``step``; a :class:`SteppingEngine`) measures its own
        gradient buffers where it can (ZeRO's partitions) and calls ``core.decide(signals, grads)``
        at BEFORE_OPTIMIZER_STEP, skipping through its own mechanism; where it cannot (an offloaded
        optimizer) it replaces the two step events by:

                ENGINE_STEP_START      # gradguard.deepspeed.engine_step_begin: first snapshot, LR multiplier on
                engine.step()          # the engine clips (to the guard's threshold) and steps
                ENGINE_STEP_END        # gradguard.deepspeed.engine_step_end: the engine's norm, loss scale and
                                       # overflow flag, one reduction, detect, decide; a skip the
                                       # engine did not make itself becomes a rollback

        HALT                       # stop requested, diagnosis.json written, engine saves
        ROLLBACK                   # in-memory ring first, then CheckpointSource via the tier
        RESUME                     # engine checkpoint loaded: core.load_state_dict
    """

    FIT_START = "fit_start"
    EPOCH_START = "epoch_start"
    STEP_START = "step_start"
    MICRO_LOSS = "micro_loss"
    OOM_RETRY = "oom_retry"
    BEFORE_OPTIMIZER_STEP = "before_optimizer_step"
    AFTER_OPTIMIZER_STEP = "after_optimizer_step"
    ENGINE_STEP_START = "engine_step_start"
    ENGINE_STEP_END = "engine_step_end"
    EPOCH_END = "epoch_end"
    CHECKPOINT_SAVED = "checkpoint_saved"
    FIT_END = "fit_end"
    HALT = "halt"
    ROLLBACK = "rollback"
    RESUME = "resume"


@runtime_checkable
class LoaderHandle(Protocol):
    """The engine's training data, as the core's batch controller (``GuardCore.attach_batches``).

    Sizes count samples per optimizer step on this process (loader batch x accumulation)."""

    @property
    def batch_size(self) -> int:
        """Samples per optimizer step now (pending changes included)."""
        ...

    @property
    def base_batch_size(self) -> int:
        """Samples per optimizer step the run started with (growth stops there)."""
        ...

    def shrink_global(self) -> tuple[int, int] | None:
        """Halve the samples per step; ``(old, new)``, or None when it cannot."""
        ...

    def grow_global(self) -> tuple[int, int] | None:
        """Double the samples per step back towards the base; ``(old, new)`` or None."""
        ...

    def shrink_micro(self) -> tuple[int, int] | None:
        """Halve the micro-batch, keeping the samples per step (more accumulation); ``(old, new)`` or None."""
        ...

    def state_dict(self) -> dict[str, Any]:
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ...


#: "Skip upcoming samples" (``GuardCore.attach_data_skip``): called with the ``skip_data`` action
#: after a rollback; makes the data of the next ``action.params["batches"]`` optimizer steps not
#: computed (or its gradients dropped) and returns a dict saying how.
DataSkip = Callable[[Any], dict[str, Any]]


@runtime_checkable
class CheckpointSource(Protocol):
    """The engine's own checkpoints, as the rollback disk tier.

    The core decides *which* checkpoint (the trust tier) and runs the rollback loop; the source
    only knows where files are and what is in them. Every load uses ``torch.load(weights_only=True)``
    (or safetensors); a file that does not load that way is skipped, never unpickled."""

    def saved_paths(self, step: int) -> Sequence[str]:
        """The files (or folders) the engine wrote for its checkpoint at ``step`` (may be empty)."""
        ...

    def read(self, path: str, step: int) -> dict[str, Any]:
        """Read and check a checkpoint, changing nothing. Returns ``{"model": state_dict,
        "optimizer": state_dict, "scaler": state or None, "scheduler": state or None,
        "guard": the guard's state or None}``; raises on anything unusable (the message says why)."""
        ...

    def restore(self, payload: dict[str, Any]) -> None:
        """Put a read checkpoint back into training (usually :func:`gradguard.recovery.restore_training_state`)."""
        ...


class EngineSignals(Protocol):
    """What a :class:`SteppingEngine` measured in its last optimizer step."""

    total_norm: float | None
    """The global gradient norm before clipping, unscaled (inf on an overflow); None: not computed."""
    scale: float | None
    """The fp16 loss scale the step ran with (None without fp16)."""
    overflow: bool
    """The engine skipped the step itself (non-finite gradients)."""


@runtime_checkable
class SteppingEngine(Protocol):
    """An engine that runs the optimizer step itself, with its own loss scaling and clipping
    (DeepSpeed ZeRO: see :mod:`gradguard.deepspeed`). The core reads the step's signals from it
    afterwards, sets the clip it applies, and never skips a step (a skip becomes a rollback)."""

    name: str
    unavailable: dict[str, str]
    """``{action: why}``: the policy actions this engine cannot carry out (reported at attach)."""

    def signals(self) -> EngineSignals:
        ...

    def clip(self) -> float | None:
        """The max norm the engine clips to now (None: no clipping)."""
        ...

    def set_clip(self, max_norm: float | None) -> None:
        """Clip to ``max_norm`` from the next step on (None: no clipping)."""
        ...

    def snapshot_state(self) -> dict[str, tuple[Callable[[], Any], Callable[[Any], None]]]:
        """``{name: (get, set)}``: state beyond the module and the torch optimizer that a rollback
        must restore (fp32 master weights, the loss scaler)."""
        ...


@runtime_checkable
class Collective(Protocol):
    """Cross-process agreement: every process must take the same decision."""

    @property
    def world_size(self) -> int:
        ...

    def mean(self, packed: torch.Tensor) -> torch.Tensor:
        """The step's packed measurements averaged over processes (one reduction). Non-finite
        values propagate to every process."""
        ...

    def all_agree(self, ok: bool) -> bool:
        """True when ``ok`` holds on every process (one reduction)."""
        ...


class LocalCollective:
    """One process: nothing to combine."""

    world_size = 1

    def mean(self, packed: torch.Tensor) -> torch.Tensor:
        return packed

    def all_agree(self, ok: bool) -> bool:
        return bool(ok)


class TorchCollective:
    """:class:`Collective` over the default ``torch.distributed`` process group (DDP under any
    engine). ``mean`` is one all-reduce (sum, then divide by the world size; a host tensor goes to
    the GPU and back under NCCL); ``all_agree`` one
    all-reduce of a 0/1 flag with MIN, on the device the backend needs (CUDA for NCCL)."""

    def __init__(self) -> None:
        dist = torch.distributed
        self._world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    @property
    def world_size(self) -> int:
        return self._world

    def mean(self, packed: torch.Tensor) -> torch.Tensor:
        if self._world <= 1:
            return packed
        dist = torch.distributed
        if packed.device.type == "cpu" and dist.get_backend() == "nccl":  # NCCL reduces GPU tensors only
            on_gpu = packed.to(torch.device("cuda", torch.cuda.current_device()))
            dist.all_reduce(on_gpu, op=dist.ReduceOp.SUM)
            return (on_gpu / self._world).cpu()
        dist.all_reduce(packed, op=dist.ReduceOp.SUM)
        return packed / self._world

    def all_agree(self, ok: bool) -> bool:
        if self._world <= 1:
            return bool(ok)
        dist = torch.distributed
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        flag = torch.tensor([1 if ok else 0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())


def collective() -> LocalCollective | TorchCollective:
    """The collective of this process: :class:`TorchCollective` when torch.distributed runs with more
    than one process, else :class:`LocalCollective`."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return TorchCollective()
    return LocalCollective()
