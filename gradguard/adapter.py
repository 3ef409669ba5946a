"""What every engine adapter does the same way, implemented once.

* :func:`refuse_unsupported`: the setups an engine does not guard (:data:`ENGINE_REFUSALS`: DeepSpeed
  but ZeRO 1/2 in a plain loop and the HF Trainer, FSDP under the HF callback, FSDP1 flat parameters a torch's layout hides; optimizers that update
  inside backward): :class:`UnsupportedSetupError` at attach when the policy acts; in monitor mode a
  warning, and the guard stands aside (it must never be what stops a run the engine accepts).
* :func:`stand_aside`: a run with nothing to watch (Lightning's mock optimizer when
  ``configure_optimizers`` returns None): one warning and no attach, in every mode.
* Clipping (the rule, the controller, each engine's clip setting) has its own module:
  :mod:`gradguard.clip`.
* :func:`unusable_resume_state`: a saved guard state that cannot be restored on resume is a
  :class:`StateError` when the policy acts; in monitor mode a warning, and the guard starts fresh.
  :func:`restore_guard_state` applies a saved guard state with that rule.
* :func:`may_wrap`: monitor mode installs no wrapper anywhere (``training_step``, ``backward``).
* :class:`SchedulerHold`: a skipped optimizer step does not move the LR schedule (the engine's next
  ``scheduler.step()`` is swallowed).
* :class:`HaltLatch`: a halt stops the engine, writes ``diagnosis.json`` and, at the end of fit,
  raises :class:`GradGuardHalt` (``output.halt_raises=False``: only stops).
* :func:`free_memory`: after an out-of-memory error.
"""

from __future__ import annotations

import gc
from typing import Any

import torch

from ._compat import is_deepspeed_engine, shadow_method, unshadow_method
from .config import GuardConfig
from .errors import GradGuardHalt, StateError, UnsupportedSetupError, warn

__all__ = ["refuse_unsupported", "stand_aside", "unusable_resume_state", "ENGINE_REFUSALS", "engine_refusal", "sharding_problems", "refuse_setup", "may_wrap", "SchedulerHold", "HaltLatch", "free_memory",
           "halt_raises", "restore_guard_state"]


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def refuse_unsupported(config: GuardConfig, problems: dict[str, str]) -> bool:
    """``problems``: ``{setting: why it cannot be guarded}`` found by the adapter (an empty dict:
    supported). Acting: raises :class:`UnsupportedSetupError` for the first one. Monitor mode:
    warns and returns False (the adapter then does not attach). True when the run can be guarded."""
    if not problems:
        return True
    setting, why = next(iter(problems.items()))
    message = f"{setting}: {why}"
    if config.policy.act:
        raise UnsupportedSetupError(message)
    warn(f"gradguard: {message.split(' Fix:')[0]}. Monitor mode stands aside: this run is not watched")
    return False


def stand_aside(why: str) -> None:
    """A run with nothing the guard could watch (no optimizer step over the model's parameters):
    one warning, and the adapter does not attach, in every mode. The engine accepts such a run, so
    the guard must not be what stops it; there is also nothing to protect."""
    warn(f"gradguard: {why}: nothing to watch, the guard stands aside for this run")


def unusable_resume_state(config: GuardConfig, exc: StateError) -> None:
    """A resumed run's saved guard state cannot be used (unreadable file, another model, a garbled
    entry). Acting: the :class:`StateError` is raised before the first step (nothing was changed;
    resuming without the state would silently drop the LR cut or clip that rescued the run).
    Monitor mode: a warning, and the guard starts fresh (it must never be what stops a run the
    engine accepts)."""
    if config.policy.act:
        raise exc
    warn(f"gradguard: {exc} Monitor mode starts with a fresh guard state instead")


def restore_guard_state(core: Any, config: GuardConfig, guard: dict[str, Any] | None) -> bool:
    """Apply a resumed run's saved guard state (``core.state_dict()``; None: nothing saved) to
    ``core``, validated whole first. Returns False only for a
    guard state that cannot be used in monitor mode (warned, nothing changed: start fresh); when
    acting that is the :class:`StateError` of :func:`unusable_resume_state`."""
    if guard is not None:
        try:
            core.load_state_dict(guard)
        except StateError as exc:
            unusable_resume_state(config, exc)
            return False
    return True


#: Distributed setups refused in every engine alike: ``{kind: (why, alternative)}``. The plain loop
#: (:class:`gradguard.Guard`) and the Lightning callback (``strategy="ddp"``, ``ModelParallelStrategy``,
#: ``FSDPStrategy``) guard DDP, FSDP2 (``fully_shard``) and FSDP1 with or without ``use_orig_params``;
#: the HF callback guards DDP (its FSDP: ``"fsdp"``). FSDP1 flat parameters whose private layout this
#: torch does not expose are refused everywhere (:func:`sharding_problems`).
ENGINE_REFUSALS: dict[str, tuple[str, str]] = {
    "deepspeed": ("this DeepSpeed setup is not guarded: DeepSpeed steps the optimizer, scales the loss and clips inside "
                  "its engine, and gradguard reads that engine's signals (global norm, loss scale, overflow) only where "
                  "it is tested: ZeRO 1/2 from deepspeed.initialize in a plain loop and under the HF Trainer. "
                  "Lightning's DeepSpeedStrategy runs only on CUDA GPUs, where it has not been tested",
                  "pass the engine to gradguard.deepspeed.DeepSpeedGuard(engine) in a plain loop, or use the HF Trainer with "
                  "TrainingArguments(deepspeed=...) and ZeRO stage 1 or 2; or shard with FSDP2 "
                  "(Lightning's ModelParallelStrategy, or torch.distributed.fsdp.fully_shard in a plain loop); "
                  "or remove gradguard"),
    "fsdp": ("the HF Trainer's FSDP (through accelerate) is not guarded: accelerate shards only on an accelerator "
             "(on the CPU it refuses FSDP1 and trains FSDP2 settings as plain DDP), so gradguard's handling of its "
             "wrapping, clipping and sharded checkpoints has not been tested",
             "train with DDP under the HF Trainer, or shard with Lightning (ModelParallelStrategy with fully_shard, "
             "or FSDPStrategy) or in a plain loop (torch.distributed.fsdp.fully_shard) guarded by gradguard.Guard; "
             "or remove the callback"),
}


def engine_refusal(kind: str, setting: str, detail: str = "") -> dict[str, str]:
    """``{setting: why + the fix}`` for a setup of :data:`ENGINE_REFUSALS` (``detail`` joins the why)."""
    why, fix = ENGINE_REFUSALS[kind]
    return {setting: f"{why}{detail}. Fix: {fix}"}


def sharding_problems(model: Any) -> dict[str, str]:
    """The model's layouts no engine guards (FSDP1 flat parameters of an unknown layout, a DeepSpeed engine), as
    :func:`refuse_unsupported` takes them; every adapter adds these to its own."""
    from ._shard import unsupported_sharding

    if is_deepspeed_engine(model):  # guarded by its own entry points (gradguard.deepspeed), which check it
        return engine_refusal("deepspeed", f"model={type(model).__name__}")
    return unsupported_sharding(model)


def refuse_setup(model: Any) -> None:
    """The plain loop's refusal (its user built the guard explicitly, so monitor mode refuses too):
    :class:`UnsupportedSetupError` naming the setting, the reason and the alternative."""
    problems = sharding_problems(model) if isinstance(model, torch.nn.Module) else {}
    if problems:
        setting, why = next(iter(problems.items()))
        raise UnsupportedSetupError(f"gradguard: {setting}: {why}")


def may_wrap(config: GuardConfig) -> bool:
    """Whether an adapter may wrap engine methods (``training_step``, ``backward``): only when the
    policy acts. Monitor mode changes nothing, out-of-memory handling included."""
    return bool(config.policy.act)


def halt_raises(config: GuardConfig, override: bool | None = None) -> bool:
    return bool(config.output.halt_raises if override is None else override)


class SchedulerHold:
    """Makes the next ``step()`` of each held scheduler a no-op (a skipped optimizer step must not
    move the LR schedule), by shadowing the bound method on the instance until released."""

    def __init__(self, schedulers: list[Any] | None = None) -> None:
        self.schedulers = [s for s in (schedulers or []) if s is not None and hasattr(s, "step")]
        self._held: list[tuple[Any, Any, Any]] = []  # (scheduler, shadow, previous)
        self.swallowed = 0

    @property
    def held(self) -> bool:
        return bool(self._held)

    def hold(self) -> None:
        if self._held:
            return
        for s in self.schedulers:
            def _skip(*args: Any, _s: Any = s, **kwargs: Any) -> None:
                self.swallowed += 1
                self._release_one(_s)

            self._held.append((s, _skip, shadow_method(s, "step", _skip)))

    def _release_one(self, sched: Any) -> None:
        for entry in [e for e in self._held if e[0] is sched]:
            unshadow_method(entry[0], "step", entry[1], entry[2])
            self._held.remove(entry)

    def release(self) -> None:
        for s, fn, previous in self._held:
            unshadow_method(s, "step", fn, previous)
        self._held = []


class HaltLatch:
    """Halting, the same in every engine: the step is not applied, the engine is told to stop (and
    to save), ``diagnosis.json`` is written next to the event log, and at the end of fit
    :class:`GradGuardHalt` is raised unless ``output.halt_raises`` is False."""

    def __init__(self, raises: bool) -> None:
        self.raises = raises
        self.diagnosis: dict[str, Any] | None = None

    @property
    def halted(self) -> bool:
        return self.diagnosis is not None

    def trip(self, diagnosis: dict[str, Any] | None) -> None:
        self.diagnosis = diagnosis or {}

    def finish(self) -> None:
        """At the end of fit: raise if halted and raising (else one warning with the summary)."""
        if self.diagnosis is None:
            return
        if self.raises:
            raise GradGuardHalt(self.diagnosis)
        warn(str(GradGuardHalt(self.diagnosis)), stacklevel=3)
