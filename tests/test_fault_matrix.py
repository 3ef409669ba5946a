"""Fault matrix (issue 12): every ``gradguard.testing`` injector x engine x {default, monitor}.

Engines are the contract's (``tests/engines.py``): the plain ``Guard`` loop, a real
``transformers.Trainer`` and a real ``lightning.Trainer``, training the same tiny network on the same
data. Each cell trains with one rehearsed fault and checks:

* training finishes (or halts by policy with a diagnosis);
* default preset: parameters and optimizer state are finite, the event log records the fault and the
  guard's reaction (in memory and in the JSONL file on disk), and the checkpoints on disk load
  with ``weights_only=True`` -- gradguard's own snapshot files (checksummed), and the engine's: the
  Trainer's ``checkpoint-*`` folder (weights, optimizer, ``gradguard_state.json``) and Lightning's
  ``.ckpt`` (guard state included), written during the run;
* monitor preset: the fault is recorded, no action and no halt, and the weights are bit-identical to
  an unguarded run with the same fault (an out-of-memory error, which monitoring does not catch, ends
  the run as it ends the unguarded one).

The run writes a JSON summary of the matrix (one entry per cell, pass/fail) to
``$GRADGUARD_FAULT_MATRIX_JSON`` if set, else ``<pytest base tmp>/fault_matrix.json``; a copy of a
full run is kept in ``benchmarks/results/``.
"""

from __future__ import annotations

import errno
import glob
import json
import math
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import gradguard as gg
from gradguard.testing import (
    CorruptBatch,
    GradFault,
    Injector,
    LRSpike,
    NaNLoss,
    OutOfMemory,
    OverflowStreak,
    SinkFault,
    SnapshotIOFault,
)

from .conftest import TinyNet
from .engines import BS, ENGINES, RUNNERS, Record

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 24
SAVE_EVERY = 10  # engine checkpoints at steps 10 and 20
WARMUP = 8  # detect.warmup_steps: the toy model learns its mapping in ~10 steps


@dataclass
class Cell:
    """One fault: how to build its injectors, whether it needs a GradScaler, and the evidence of
    the guard's reaction expected in the default preset's event log."""

    name: str
    injectors: Callable[[], list[Injector]]
    fault: str  # the ``fault`` name of its fault_injected events
    expect: Callable[[list[dict[str, Any]]], bool]
    scaler: bool = False
    monitor_bitwise: bool = True  # monitor run bit-identical to the unguarded run with the same fault


def _findings(events, kind, layer=None):
    return [e for e in events if e.get("type") == "finding" and e.get("kind") == kind
            and (layer is None or layer in e.get("layers", []))]


def _actions(events, name):
    return [e for e in events if e.get("type") == "action" and e.get("name") == name]


def _skipped_at(events, step):
    return any(e.get("type") == "metrics" and e.get("step") == step and e.get(gg.M.SKIPPED, 0) >= 1 for e in events)


def _scaler_in_use(ev):
    return any(e.get("type") == "metrics" and e.get(gg.M.SCALE) is not None for e in ev)


def _rollback_unavailable_or_restored(ev):
    """Snapshots deleted, then NaN losses: the rollback rung either restores another source (an
    engine checkpoint) or says 'rollback unavailable' and takes the rung's other actions."""
    for a in _actions(ev, "rollback"):
        if a["params"].get("unavailable", "").startswith("rollback unavailable"):
            if _actions([x for x in ev if x.get("step") == a["step"]], "lower_lr"):
                return True
        elif a["params"].get("source") not in (None, "memory"):
            return True
    return False


CELLS = [
    Cell("nan_loss", lambda: [NaNLoss(at_step=10)], "nan_loss",
         lambda ev: bool(_findings(ev, "nonfinite_loss")) and _skipped_at(ev, 10)),
    Cell("inf_grad_layer", lambda: [GradFault("block", at_step=10, kind="inf")], "grad_fault",
         lambda ev: bool(_findings(ev, "nonfinite_grad", "block.0")) and _skipped_at(ev, 10)),
    Cell("huge_grad_layer", lambda: [GradFault("block", at_step=16, steps=3, kind="huge", factor=1e4)],
         "grad_fault", lambda ev: bool(_findings(ev, "grad_spike")) and _skipped_at(ev, 16)),
    Cell("lr_spike", lambda: [LRSpike(factor=300.0, at_step=16, steps=4)], "lr_spike",
         lambda ev: bool(_findings(ev, "loss_spike")) and bool(_actions(ev, "rollback") or _actions(ev, "lower_lr"))),
    Cell("corrupt_batch", lambda: [CorruptBatch(at_step=16, steps=6)], "corrupt_batch",
         lambda ev: bool(_findings(ev, "loss_spike")) and any(
             e.get("type") == "metrics" and e.get(gg.M.SKIPPED, 0) >= 1 for e in ev)),
    Cell("out_of_memory", lambda: [OutOfMemory(at_step=10, above_batch=BS // 2)], "out_of_memory",
         lambda ev: any(e.get("type") == "action" and e.get("name", "").startswith("oom_") for e in ev),
         monitor_bitwise=False),
    # fp16 with a real GradScaler (plain loop, Lightning); the HF Trainer (accelerate) has no GradScaler
    # on CPU: there the streak is non-finite gradients, skipped
    Cell("fp16_overflow_streak", lambda: [OverflowStreak(at_step=10, steps=6)], "overflow_streak",
         lambda ev: bool(_findings(ev, "overflow_streak")) or (
             not _scaler_in_use(ev) and bool(_findings(ev, "nonfinite_grad")) and _skipped_at(ev, 10)), scaler=True),
    Cell("snapshot_disk_full", lambda: [SnapshotIOFault(at_step=10, target="snapshots", errno=errno.ENOSPC)],
         "io_fault", lambda ev: any(e.get("type") == "snapshot_io_error" for e in ev)),
    Cell("snapshot_readonly", lambda: [SnapshotIOFault(at_step=10, target="snapshots", errno=errno.EROFS)],
         "io_fault", lambda ev: any(e.get("type") == "snapshot_io_error" and e["errno"] == errno.EROFS for e in ev)),
    Cell("events_log_disk_full", lambda: [SnapshotIOFault(at_step=10, target="events", errno=errno.ENOSPC)],
         "io_fault", lambda ev: any(e.get("type") == "sink_io_error" for e in ev)),
    Cell("snapshots_deleted_then_nan", lambda: [SnapshotIOFault(at_step=10, mode="delete"),
                                                NaNLoss(at_step=11, steps=4)], "io_fault",
         _rollback_unavailable_or_restored),
    # round three (issue 28): a sink that raises (a finished W&B run) is absorbed: training goes on
    Cell("sink_raises", lambda: [SinkFault(at_step=10)], "sink_fault",
         lambda ev: any(e.get("type") == "sink_error" and e.get("sink") == "FailingSink" for e in ev)),
]


class SnapshotProbe(Injector):
    """Not a fault: at step ``at_step`` it loads every snapshot file the guard has on disk with the
    guard's own reader (checksum, then ``torch.load(weights_only=True)``), before the run's end
    removes them."""

    name = "probe"

    def __init__(self, *, at_step: int) -> None:
        super().__init__(at_step=at_step, steps=None)
        self.loaded: list[int] = []
        self.failed: list[str] = []

    def _install(self) -> None:
        assert self.model is not None
        self._handles.append(self.model.register_forward_pre_hook(self._tick))

    def _tick(self, module, args) -> None:
        core = getattr(self.guard, "core", self.guard)
        if self.fired or core is None or not module.training or not self.active():
            return
        self.fired.append(self.step())
        disk = getattr(core.snapshots, "disk", None) if core.snapshots is not None else None
        for step in disk.steps() if disk is not None else []:
            try:
                state = disk.load(step)
                assert all(torch.isfinite(t).all() for t in state["model"].values())
                self.loaded.append(step)
            except Exception as exc:  # a check, reported as such
                self.failed.append(f"{step}: {type(exc).__name__}: {exc}"[:160])


def _injectors(cell: Cell, guarded: bool, probe: SnapshotProbe | None):
    def make(model, opt, guard):
        injs = cell.injectors()
        if not guarded:  # no guard: faults of gradguard's own files and sinks do not apply
            injs = [i for i in injs if not isinstance(i, (SnapshotIOFault, SinkFault))]
        if probe is not None:
            injs.append(probe)
        return [i.attach(model, opt, guard=guard) for i in injs]
    return make


def _config(tmp_path, preset: str) -> gg.GuardConfig:
    return gg.GuardConfig.preset(preset, output={"dir": str(tmp_path / "out"), "console": False, "metrics_interval": 1},
                                 recovery={"disk_dir": str(tmp_path / "snaps"), "snapshot_interval": 4,
                                           "confirm_steps": 2}, detect={"warmup_steps": WARMUP})


def run_cell(engine: str, cell: Cell, preset: str | None, tmp_path, probe: SnapshotProbe | None = None) -> Record:
    """One run of ``cell`` (``preset=None``: no guard at all, the reference run)."""
    config = _config(tmp_path, preset) if preset is not None else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return RUNNERS[engine](tmp_path, config, STEPS, guard=preset is not None,
                               injectors=_injectors(cell, preset is not None, probe), amp=cell.scaler, opt_kind="adamw-fast",
                               save_at=SAVE_EVERY if engine != "plain" else None)


RESULTS: list[dict[str, Any]] = []
#: unguarded reference runs by (engine, the faults left without a guard, fp16): the cells whose only
#: faults are gradguard's own (files, sinks) share one fault-free reference per engine
_REFERENCES: dict[tuple[Any, ...], Record] = {}


def reference(engine: str, cell: Cell, tmp_path) -> Record:
    """The unguarded run of ``cell`` (its faults of gradguard's own files and sinks left out), run once."""
    left = tuple(sorted(type(i).__name__ + repr(sorted(vars(i).items())) for i in cell.injectors()
                        if not isinstance(i, (SnapshotIOFault, SinkFault))))
    key = (engine, left, cell.scaler)
    if key not in _REFERENCES:
        _REFERENCES[key] = run_cell(engine, cell, None, tmp_path / "ref")
    return _REFERENCES[key]


@pytest.fixture(scope="module", autouse=True)
def matrix_summary(tmp_path_factory):
    yield
    out = os.environ.get("GRADGUARD_FAULT_MATRIX_JSON") or str(tmp_path_factory.getbasetemp() / "fault_matrix.json")
    from gradguard._compat import versions

    summary = {"cells": RESULTS, "total": len(RESULTS), "passed": sum(r["passed"] for r in RESULTS),
               "engines": list(ENGINES), "injectors": [c.name for c in CELLS], "presets": ["default", "monitor"],
               "steps": STEPS, "seconds": round(sum(r["seconds"] for r in RESULTS), 1), "versions": versions()}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=1)
    print(f"\nfault matrix: {summary['passed']}/{summary['total']} cells passed -> {out}")


def _finite(tensors) -> bool:
    return all(torch.isfinite(t).all() for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point())


def _finite_state(model, opt) -> bool:
    return _finite(model.parameters()) and all(
        _finite(st.values()) for st in opt.state_dict()["state"].values())


def _same(a: torch.nn.Module, b: torch.nn.Module, exact: bool) -> bool:
    for p, q in zip(a.parameters(), b.parameters()):
        if exact:
            if not torch.equal(torch.nan_to_num(p, nan=1234.5), torch.nan_to_num(q, nan=1234.5)):
                return False
        elif not torch.allclose(p, q, rtol=1e-4, atol=1e-5, equal_nan=True):
            return False
    return True


def _engine_checkpoints_load(engine: str, tmp_path, rec: Record) -> bool:
    """Every checkpoint the engine wrote during the run loads with weights_only=True, finite, with
    the guard's state in it."""
    if engine == "hf":
        from gradguard._hf.checkpoints import STATE_FILE, read_weights

        folders = sorted(glob.glob(str(tmp_path / "hf" / "checkpoint-*")))
        for folder in folders:
            weights = read_weights(folder)
            opt = torch.load(os.path.join(folder, "optimizer.pt"), map_location="cpu", weights_only=True)
            with open(os.path.join(folder, STATE_FILE), encoding="utf-8") as fh:
                guard_state = json.load(fh)
            if not (_finite(weights.values()) and all(_finite(s.values()) for s in opt["state"].values())
                    and guard_state.get("guard")):
                return False
    else:
        folders = sorted(glob.glob(str(tmp_path / "pl" / "*.ckpt")))
        for f in folders:
            ck = torch.load(f, map_location="cpu", weights_only=True)
            guard_states = [v for k, v in ck["callbacks"].items() if k.startswith("GradGuardCallback")]
            if not (_finite(ck["state_dict"].values()) and guard_states and guard_states[0].get("core")
                    and all(_finite(s.values()) for o in ck["optimizer_states"] for s in o["state"].values())):
                return False
    last = max(rec.weights) if rec.weights else 0
    return bool(folders) or last < SAVE_EVERY  # a run halted before the first save wrote none


@pytest.mark.parametrize("preset", ["default", "monitor"])
@pytest.mark.parametrize("cell", CELLS, ids=[c.name for c in CELLS])
@pytest.mark.parametrize("engine", ENGINES)
def test_fault_cell(engine, cell, preset, tmp_path):
    if engine != "plain":
        pytest.importorskip("transformers" if engine == "hf" else "lightning")
    checks: dict[str, bool] = {}
    rec = None
    start = time.perf_counter()
    try:
        rec = _check_cell(engine, cell, preset, tmp_path, checks)
    except Exception as exc:
        checks[f"raised {type(exc).__name__}: {exc}"[:200]] = False
        raise
    finally:
        halted = rec.error if rec is not None and isinstance(rec.error, gg.GradGuardHalt) else None
        RESULTS.append({"engine": engine, "injector": cell.name, "preset": preset, "passed": all(checks.values()),
                        "halted": None if halted is None else halted.diagnosis.get("reason"), "checks": checks,
                        "seconds": round(time.perf_counter() - start, 2)})
    assert all(checks.values()), (f"{engine} x {cell.name} x {preset}: failed checks "
                                  f"{[k for k, v in checks.items() if not v]}")


def _check_cell(engine: str, cell: Cell, preset: str, tmp_path, checks: dict[str, bool]) -> Record:
    probe = SnapshotProbe(at_step=STEPS) if preset == "default" else None
    rec = run_cell(engine, cell, preset, tmp_path, probe)
    events = rec.events()
    faults = [i for i in rec.injectors if i is not probe]
    checks["fault_fired"] = bool(faults) and all(inj.fired for inj in faults)
    checks["fault_logged"] = any(e.get("type") == "fault_injected" and e.get("fault") == cell.fault for e in events)
    oom_unhandled = isinstance(rec.error, torch.OutOfMemoryError)
    halted = rec.error if isinstance(rec.error, gg.GradGuardHalt) else None
    if cell.scaler and engine != "hf":  # the engine's GradScaler was found by the guard (HF on CPU has none)
        checks["scaler_found"] = _scaler_in_use(events)
    if preset == "default":
        checks["finished_or_diagnosed_halt"] = rec.error is None or bool(halted and halted.diagnosis.get("reason"))
        checks["state_finite"] = _finite_state(rec.model, rec.optimizer)
        checks["reaction_logged"] = cell.expect(events)
        if cell.name != "events_log_disk_full":  # the JSONL log on disk holds the same record
            log = []
            if rec.log_path and os.path.exists(rec.log_path):
                with open(rec.log_path, encoding="utf-8") as fh:
                    log = [json.loads(line) for line in fh]
            checks["jsonl_has_fault"] = any(e.get("type") == "fault_injected" for e in log)
        if not cell.name.startswith(("snapshot", "events")) and (halted is None or max(rec.weights) >= STEPS):
            checks["snapshot_files_load"] = bool(probe.loaded) and not probe.failed
        elif probe.failed:
            checks["snapshot_files_load"] = False
        if engine != "plain":
            checks["engine_checkpoints_load"] = _engine_checkpoints_load(engine, tmp_path, rec)
    else:
        # (the plain loop's Guard.accumulate retries an out-of-memory micro-batch in any mode)
        checks["monitor_no_action"] = not [e for e in events if e.get("type") == "action"
                                           and not (engine == "plain" and e.get("name") == "oom_shrink_micro")]
        checks["monitor_no_halt"] = halted is None
        if cell.monitor_bitwise:
            ref = reference(engine, cell, tmp_path)
            checks["monitor_bit_identical_to_unguarded"] = _same(rec.model, ref.model, exact=True)
        elif engine == "plain":  # Guard.accumulate retries the OOM: same samples, same gradient up to rounding
            clean = Cell(cell.name, lambda: [], cell.fault, cell.expect, cell.scaler)
            ref = run_cell(engine, clean, None, tmp_path / "ref")
            checks["monitor_same_as_fault_free"] = not oom_unhandled and _same(rec.model, ref.model, exact=False)
        else:  # monitoring wraps nothing: the engine's out-of-memory error ends the run as without a guard
            ref = run_cell(engine, cell, None, tmp_path / "ref")
            checks["monitor_oom_as_unguarded"] = (oom_unhandled and isinstance(ref.error, torch.OutOfMemoryError)
                                                  and _same(rec.model, ref.model, exact=True))
    if not (preset == "monitor" and cell.name == "out_of_memory" and engine != "plain"):
        checks["no_unhandled_error"] = not oom_unhandled
    return rec


def test_lr_spike_is_undone_and_nests_with_the_guards_hook(tmp_path):
    """The LR spike lasts exactly its window, on top of the guard's multiplier, and leaves the
    user's LR untouched afterwards (whichever was attached first)."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    spike = LRSpike(factor=10.0, at_step=2, steps=2).attach(model, opt)  # before the guard
    cfg = gg.GuardConfig.preset("default", output={"console": False, "jsonl": False})
    guard = gg.Guard(model, opt, config=cfg)
    seen = []  # the LR the update uses (registered after the guard's hook)
    opt.register_step_pre_hook(lambda o, a, k: seen.append(o.param_groups[0]["lr"]))
    guard.core.lr.global_mult = 0.5
    from .conftest import make_batch

    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        loss = model(*make_batch(gen))
        loss.backward()
        guard.step(loss)
        opt.zero_grad()
    assert seen == pytest.approx([0.05, 0.5, 0.5, 0.05, 0.05])
    assert spike.fired == [2, 3]
    spike.detach()
    guard.close()
    assert opt.param_groups[0]["lr"] == 0.1 and math.isfinite(opt.param_groups[0]["lr"])
