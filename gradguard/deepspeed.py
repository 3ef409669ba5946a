"""gradguard for DeepSpeed ZeRO stages 1 and 2 (``deepspeed.initialize``), in a plain loop and under
the HF Trainer (``TrainingArguments(deepspeed=...)``).

DeepSpeed runs the optimizer step itself: it unscales the fp16 loss, reduces and partitions the
gradients, computes the global norm, clips and steps inside ``engine.backward``/``engine.step``.
Plain loop::

    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    guard = gradguard.deepspeed.DeepSpeedGuard(engine)
    for batch in loader:
        loss = engine(batch)
        engine.backward(loss)
        guard.step(loss)          # in place of engine.step(), on every micro-batch

Before the engine's step (:func:`run_engine_step`) the guard reads each rank's partition of the
reduced gradients (:func:`gradguard._compat.ds_partition_grads`): the pieces are disjoint across
ranks, so their per-layer squared norms, summed by the step's one reduction, are the model's. It
decides as in any engine, clips the partition in place (the engine's own clip is turned off; its
``gradient_clipping`` is the guard's starting ``clip.max_norm``) and skips through DeepSpeed's own
overflow path (:class:`gradguard._compat.ds_forced_overflow`). The LR multiplier goes on the param
groups around the engine's step. A rollback restores each rank's module weights, fp32 master
partition, optimizer state and fp16 loss-scaler counters (:meth:`DeepSpeedEngineHandle.snapshot_state`).

With the optimizer offloaded the partition is not readable: the guard then reads the engine's
global norm, loss scale and overflow flag after its step, as a
:class:`gradguard.contract.SteppingEngine` (``GuardCore.engine_step_end``); a skip then becomes a
rollback. What is available either way is stated in the ``engine`` event at attach
(:data:`AVAILABLE`, :data:`UNAVAILABLE`): no per-layer LR (ZeRO's optimizer updates flat
partitions), no batch shrinking (DeepSpeed fixes ``train_batch_size``).

Refused at attach (:func:`problems`), with the reason and the alternative: ZeRO stage 0 (that is data
parallelism: use DDP), stage 3 (parameters partitioned: use FSDP2), pipeline engines, and a ZeRO
optimizer whose pieces this DeepSpeed version does not expose.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ._compat import (
    ds_clip,
    ds_forced_overflow,
    ds_global_norm,
    ds_load_scaler_state,
    ds_loss_scale,
    ds_master_partitions,
    ds_overflow,
    ds_partition_grads,
    ds_pre_step_readable,
    ds_scaler_state,
    ds_set_reported_norm,
    ds_stage,
    ds_zero_optimizer,
    is_deepspeed_engine,
)
from .clip import DeepSpeedClip, check_ladder, resolve_clip
from .config import GuardConfig
from .core import GuardCore, finish_halt
from .detect import Signals as StepSignals
from .errors import UnsupportedSetupError, is_rank0, warn_once
from .guard import LoopGuard

__all__ = ["DeepSpeedEngineHandle", "DeepSpeedGuard", "problems", "AVAILABLE", "UNAVAILABLE", "is_deepspeed_engine"]

#: The policy actions a DeepSpeed ZeRO 1/2 run can take.
AVAILABLE = ("lower_lr", "adam", "tighten_clip", "rollback", "skip_data", "halt")
#: ``{action: why not}`` under DeepSpeed.
UNAVAILABLE: dict[str, str] = {
    "skip": "with the optimizer offloaded (offload_optimizer) the gradient partition cannot be read before "
            "DeepSpeed applies the step: a skip becomes a rollback to the last healthy snapshot (an overflow "
            "step is skipped by DeepSpeed itself)",
    "lower_layer_lr": "ZeRO's optimizer updates flat partitions of the parameters: no per-layer LR under DeepSpeed",
    "shrink_batch": "DeepSpeed fixes train_batch_size at deepspeed.initialize",
}


def problems(engine: Any) -> dict[str, str]:
    """``{setting: why it cannot be guarded + the fix}`` for a DeepSpeed engine (empty: supported)."""
    name = type(engine).__name__
    if any(c.__name__ == "PipelineEngine" for c in type(engine).__mro__):
        return {f"model={name}": "DeepSpeed's pipeline engine runs its own schedule of micro-batches, which "
                "gradguard does not follow. Fix: train without pipeline parallelism (ZeRO 1/2, or FSDP2), "
                "or remove gradguard"}
    stage = ds_stage(engine)
    if stage == 0:
        return {"zero_optimization.stage=0": "DeepSpeed without ZeRO is plain data parallelism, where its engine "
                "keeps the global gradient norm to itself. Fix: use zero_optimization.stage 1 or 2, or train "
                "with torch's DistributedDataParallel, which gradguard guards fully"}
    if stage >= 3:
        return {f"zero_optimization.stage={stage}": "ZeRO-3 partitions the parameters themselves, which "
                "gradguard cannot snapshot and restore per process. Fix: use stage 1 or 2, or shard with FSDP2 "
                "(torch.distributed.fsdp.fully_shard) in a plain loop or under Lightning's ModelParallelStrategy"}
    opt = ds_zero_optimizer(engine)
    if opt is None:
        import deepspeed

        return {f"optimizer={type(engine.optimizer).__name__}": "this DeepSpeed version's ZeRO optimizer "
                f"(deepspeed {deepspeed.__version__}) does not expose the fp32 partitions and the clip that "
                "gradguard reads. Fix: use deepspeed 0.19, or train with DDP/FSDP2"}
    if not getattr(opt, "compute_grad_norm", True):
        return {"compute_grad_norm=False": "the ZeRO optimizer does not compute the global gradient norm, the "
                "signal gradguard reads. Fix: leave the norm on (the default)"}
    return {}


@dataclass
class EngineReading:
    """What the engine measured in its last optimizer step (see :class:`gradguard.contract.EngineSignals`)."""

    total_norm: float | None
    scale: float | None
    overflow: bool


class DeepSpeedEngineHandle:
    """A ``DeepSpeedEngine`` (ZeRO 1/2) as a :class:`gradguard.contract.SteppingEngine`.

    ``pre_step`` (the usual case: no optimizer offload, data parallelism over every process): the
    guard reads this process's partition of the reduced gradients before the engine's step, so it
    measures per-layer norms (each rank its disjoint pieces, summed by the step's one reduction),
    clips them in place and skips a step through DeepSpeed's own overflow path. Otherwise the
    guard reads the engine's signals after its step (:func:`engine_step_end`)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.stage = ds_stage(engine)
        self.name = f"DeepSpeed ZeRO-{self.stage}"
        dist = torch.distributed
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        group = getattr(engine.optimizer, "dp_process_group", None)
        dp = dist.get_world_size(group) if world > 1 and group is not None else 1
        self.pre_step = ds_pre_step_readable(engine) and dp == world
        self.unavailable = {k: v for k, v in UNAVAILABLE.items() if k != "skip"}
        self._index: dict[int, int] = {}  # id(module parameter) -> its layer, rebuilt when layers join
        self._index_version = -1
        self.clip_setting = DeepSpeedClip(engine)  # the engine's gradient_clipping (gradguard.clip)

    # -- before the engine's step ----------------------------------------------------------
    def measure(self, core: Any, loss: Any) -> tuple[StepSignals, list[torch.Tensor]] | None:
        """The step's signals from this process's gradient partition, combined over processes in
        one reduction (per-layer squared norms, loss, loss scale); None when the partition cannot
        be read this step."""
        found = ds_partition_grads(self.engine)
        layers = core.layers
        if self._index_version != layers.version:
            self._index = {id(p): layers.layer_index[i] for i, p in enumerate(layers.params)}
            self._index_version = layers.version
        n_layers = len(layers.layer_names)
        pieces = [g for _, g in found] if found else []
        # the partition's device (a GPU's under NCCL); nothing leaves it before the one host read
        device = pieces[0].device if pieces else torch.device("cpu")
        sq = torch.zeros(n_layers, dtype=torch.float32, device=device)
        owners = [self._index.get(id(p), -1) for p, _ in found or []]
        unreadable = found is None or -1 in owners
        if pieces and not unreadable:
            norms = torch.stack(torch._foreach_norm(pieces)).float()
            sq.index_add_(0, torch.tensor(owners, dtype=torch.long, device=device), norms * norms)
        scale = ds_loss_scale(self.engine)
        if scale:
            sq = sq / (scale * scale)  # fp16: the partitions still carry the loss scale
        world = core.collective.world_size
        loss_t = (loss.detach().float().reshape(1).to(device) if isinstance(loss, torch.Tensor)
                  else torch.tensor([float("nan") if loss is None else float(loss)], device=device))
        rest = torch.tensor([scale or 0.0, 1.0 if unreadable else 0.0], device=device)
        # every rank reduces, also one that could not read its partition (its flag makes all fall back)
        packed = torch.cat([sq * world, loss_t, rest])
        if core.reduce is not None:
            packed = core.reduce(packed)  # mean over ranks: the disjoint pieces' squares summed, the loss averaged
        values = packed.tolist()  # the step's one host read
        layer_sq, loss_f, scale_f = values[:n_layers], values[n_layers], values[n_layers + 1]
        if values[n_layers + 2] > 0:
            return None
        names = list(layers.layer_names)
        norms_by_layer = {n: math.sqrt(v) if v >= 0 else float("nan") for n, v in zip(names, layer_sq)}
        total = math.sqrt(sum(layer_sq)) if all(math.isfinite(v) for v in layer_sq) else float(
            "nan" if any(math.isnan(v) for v in layer_sq) else "inf")
        bad = [n for n, v in zip(names, layer_sq) if not math.isfinite(v)]
        sig = StepSignals(step=core.step_count + 1, loss=None if loss is None else loss_f, total_norm=total,
                          layer_norms=norms_by_layer, nonfinite_layers=bad,
                          scale=None if scale is None else scale_f, overflow=bool(scale is not None and bad))
        return sig, pieces

    def signals(self) -> EngineReading:
        eng = self.engine
        return EngineReading(total_norm=ds_global_norm(eng), scale=ds_loss_scale(eng), overflow=ds_overflow(eng))

    def clip(self) -> float | None:
        return self.clip_setting.current()

    def set_clip(self, max_norm: float | None) -> None:
        self.clip_setting.set(max_norm)

    def snapshot_state(self) -> dict[str, tuple[Callable[[], Any], Callable[[Any], None]]]:
        eng = self.engine

        def master() -> list[torch.Tensor]:
            return [t.detach() for t in ds_master_partitions(eng)]

        @torch.no_grad()
        def put_master(saved: list[torch.Tensor]) -> None:
            live = ds_master_partitions(eng)
            if len(saved) != len(live) or any(a.shape != b.shape for a, b in zip(saved, live)):
                raise ValueError("the fp32 master partitions changed shape since the snapshot")
            for dst, src in zip(live, saved):
                dst.copy_(src)

        return {"deepspeed_master": (master, put_master),
                "deepspeed_loss_scaler": (lambda: ds_scaler_state(eng), lambda s: ds_load_scaler_state(eng, s))}

    def describe(self) -> dict[str, Any]:
        unavailable = dict(self.unavailable) if self.pre_step else dict(UNAVAILABLE)
        available = [*AVAILABLE, "skip"] if self.pre_step else list(AVAILABLE)
        return {"type": "engine", "step": 0, "engine": self.name, "available": available,
                "unavailable": unavailable, "measures": "per-layer gradient norms of each rank's partition, "
                "before the step" if self.pre_step else "the engine's global norm, after its step",
                "clip": self.clip()}

    def attach(self, core: Any) -> None:
        """At attach: the engine clips to the guard's threshold after its step, or not at all when
        the guard clips the partitions itself before it (``pre_step``)."""
        self.clip_setting.take_over(core.config, core.clip.threshold(0.0), self.pre_step)
        core.emit(self.describe())

    def release(self) -> None:
        """At close: the engine's own clip as the user configured it."""
        self.clip_setting.release()


def run_engine_step(core: Any, handle: DeepSpeedEngineHandle, step_fn: Callable[[], Any],
                    loss: Any = None) -> tuple[Any, Any]:
    """One optimizer step of the engine under the guard (at an accumulation boundary): measure,
    decide, clip before ``step_fn`` (the engine's own step) when the partition is readable, else
    read the engine's signals after it. Returns ``(report, step_fn's result)``; then call
    ``core.after_step(report)``."""
    if handle.pre_step:
        core.first_snapshot()
        loss_v = core.take_loss(loss)
        measured = handle.measure(core, loss_v)
        if measured is not None:
            sig, pieces = measured
            report = core.decide(sig, pieces)
            act = core.config.policy.act
            skip = act and not report.applied
            # a skip, a rollback or a halt: the engine's own overflow path drops this step (an
            # fp16 overflow also lowers its loss scale; a skip the guard decided does not)
            with ds_forced_overflow(handle.engine, pieces, keep_scale=not sig.overflow) if skip else contextlib.nullcontext():
                if act:
                    core.lr.engine_begin()
                try:
                    out = step_fn()
                finally:
                    if act:
                        core.lr.engine_end()
            if not skip and ds_overflow(handle.engine):  # DeepSpeed skipped it on its own (monitor mode)
                core.engine_skipped(report, f"{handle.name} skipped the step (overflow)")
            elif not skip:  # the engine's reported norm is the one before the guard's clip, as unguarded
                ds_set_reported_norm(handle.engine, sig.total_norm)
            return report, out
        warn_once("deepspeed-partition", "gradguard: this step's DeepSpeed gradient partition could not be read; "
                  "the guard reads the engine's norm after its step instead (no per-layer norms, no skip)")
        if loss_v is not None:
            core.observe_loss(loss_v)
    engine_step_begin(core)
    out = step_fn()
    return engine_step_end(core, handle, loss if not handle.pre_step else None), out


def engine_step_begin(core: Any) -> None:
    """ENGINE_STEP_START: before the engine runs its optimizer step (the offloaded path): the first
    snapshot (the weights before any update) and the LR multiplier put on the optimizer's groups."""
    core.first_snapshot()
    if core.config.policy.act:
        core.lr.engine_begin()


def engine_step_end(core: Any, handle: DeepSpeedEngineHandle, loss: Any = None) -> Any:
    """ENGINE_STEP_END: after the engine stepped. Reads its global norm, loss scale and overflow
    flag, combines them and the loss over processes (one reduction), then ``core.decide``; the
    engine's next step clips to the guard's threshold. A skip the engine did not make itself
    becomes a rollback to the last healthy snapshot. Then call ``core.after_step`` as usual."""
    core.lr.engine_end()
    loss_v = core.take_loss(loss)
    got = handle.signals()
    norm = got.total_norm if got.total_norm is not None else float("nan")
    values = [float("nan") if loss_v is None else loss_v, norm, got.scale or 0.0, 1.0 if got.overflow else 0.0]
    packed = torch.stack([v.detach().float().reshape(()).cpu() if isinstance(v, torch.Tensor)
                          else torch.tensor(float(v)) for v in values])
    if core.reduce is not None:
        packed = core.reduce(packed)
    loss_f, norm_f, scale_f, overflow_f = packed.tolist()  # the step's one host read
    sig = StepSignals(step=core.step_count + 1, loss=None if loss_v is None else loss_f, total_norm=norm_f,
                      layer_norms={}, nonfinite_layers=[], scale=None if got.scale is None else scale_f,
                      overflow=overflow_f > 0)
    return core.decide(sig, [], engine_skipped=overflow_f > 0)


def build_config(config: GuardConfig, engine: Any) -> GuardConfig:
    """The config a DeepSpeed run is guarded with: the engine's ``gradient_clipping`` becomes the
    starting ``clip.max_norm`` (the one clip rule of :func:`gradguard.clip.resolve_clip`)."""
    config, _ = resolve_clip(config, ds_clip(engine) or None, engine_default=0.0, setting="gradient_clipping")
    check_ladder(config)
    return config


class DeepSpeedGuard(LoopGuard):
    """gradguard over a ``DeepSpeedEngine`` (ZeRO 1/2): ``gradguard.deepspeed.DeepSpeedGuard(engine)``.

    Call ``guard.step(loss)`` in place of ``engine.step()`` after every micro-batch's
    ``engine.backward(loss)``; it returns the step's :class:`gradguard.core.StepReport` on an
    accumulation boundary and None between. ``optimizer`` and ``scheduler`` default to the
    engine's. Like :class:`gradguard.Guard`, it composes a :class:`gradguard.core.GuardCore`."""

    def __init__(self, engine: Any, optimizer: Any = None, *, scheduler: Any = None, scaler: Any = None,
                 config: GuardConfig | None = None, sinks: list[Any] | None = None, out_dir: str | None = None,
                 layer_fn: Callable[[str], str] | None = None, batches: Any = None) -> None:
        if not is_deepspeed_engine(engine):
            raise UnsupportedSetupError(f"gradguard: engine={type(engine).__name__} is not a DeepSpeedEngine. "
                                        "Fix: pass what deepspeed.initialize returned, or use gradguard.Guard")
        found = problems(engine)
        if found:
            setting, why = next(iter(found.items()))
            raise UnsupportedSetupError(f"gradguard: {setting}: {why}")
        if scaler is not None:
            raise UnsupportedSetupError("gradguard: scaler= with a DeepSpeed engine: DeepSpeed scales the loss "
                                        "itself (its fp16 section). Fix: leave scaler out")
        config = build_config(GuardConfig.coerce(config), engine)
        if not is_rank0():
            config = dataclasses.replace(config, output=dataclasses.replace(config.output, jsonl=False, console=False))
        self.engine = engine
        self.handle = DeepSpeedEngineHandle(engine)
        self.core = GuardCore(engine.module, optimizer if optimizer is not None else engine.optimizer,
                              config=config, sinks=sinks, out_dir=out_dir, layer_fn=layer_fn,
                              scheduler=scheduler if scheduler is not None else engine.lr_scheduler,
                              stepping=self.handle, engine="deepspeed")
        self.config = self.core.config
        self.batches = batches
        self.halted: dict[str, Any] | None = None
        self.handle.attach(self.core)
        if batches is not None:
            self.core.attach_data_skip(self._skip_data)

    def accumulate(self, batch: Any, loss_fn: Callable[[Any], torch.Tensor]) -> float:
        raise UnsupportedSetupError("gradguard: Guard.accumulate with a DeepSpeed engine: DeepSpeed accumulates "
                                    "itself (gradient_accumulation_steps). Fix: call engine.backward(loss) and "
                                    "guard.step(loss) on every micro-batch")

    def step(self, loss: torch.Tensor | float | None = None) -> Any:
        eng, core = self.engine, self.core
        if not eng.is_gradient_accumulation_boundary():
            if loss is not None:
                core.observe_loss(loss)
            eng.step()
            return None
        if loss is not None and core.has_loss:
            core.observe_loss(loss)  # the boundary's micro-batch joins the accumulated ones
            loss = None
        report, _ = run_engine_step(core, self.handle, eng.step, loss)
        core.after_step(report)
        if report.halt:
            self.halted = report.diagnosis or {}
            finish_halt(core, self.halted)
        return report
