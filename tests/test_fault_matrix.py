"""Fault matrix (issue 12): every ``gradguard.testing`` injector x {default, monitor} x engine.

Each cell trains a tiny model with one rehearsed fault and checks: training finishes (or halts
by policy with a diagnosis); in default mode the parameters and optimizer state stay finite and
the event log records the fault and the guard's reaction; in monitor mode the fault is recorded
but nothing is done (no action, and the weights are bit-identical to an unguarded run with the
same fault). Engines are a parametrization (only the plain ``Guard`` loop for now: the HF and
Lightning harnesses join as more entries of ``ENGINES``).

The run writes a JSON summary of the matrix (one entry per cell, pass/fail) to
``$GRADGUARD_FAULT_MATRIX_JSON`` if set, else ``<pytest base tmp>/fault_matrix.json``.
"""

from __future__ import annotations

import errno
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import gradguard as gg
from gradguard.data import BatchController
from gradguard.testing import (
    CorruptBatch,
    GradFault,
    Injector,
    LRSpike,
    NaNLoss,
    OutOfMemory,
    OverflowStreak,
    SnapshotIOFault,
)

from .conftest import TinyNet

STEPS = 40
BATCH = 8


class Pairs(torch.utils.data.Dataset):
    def __init__(self, n=4096, t=6, vocab=32):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, vocab, (n, t), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": (self.x[i] + 1) % 32}


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


CELLS = [
    Cell("nan_loss", lambda: [NaNLoss(at_step=12)], "nan_loss",
         lambda ev: bool(_findings(ev, "nonfinite_loss")) and _skipped_at(ev, 12)),
    Cell("inf_grad_layer", lambda: [GradFault("blocks.0", at_step=12, kind="inf")], "grad_fault",
         lambda ev: bool(_findings(ev, "nonfinite_grad", "blocks.0")) and _skipped_at(ev, 12)),
    Cell("huge_grad_layer", lambda: [GradFault("blocks.1", at_step=28, steps=3, kind="huge", factor=1e4)],
         "grad_fault", lambda ev: bool(_findings(ev, "grad_spike")) and _skipped_at(ev, 28)),
    Cell("lr_spike", lambda: [LRSpike(factor=300.0, at_step=26, steps=4)], "lr_spike",
         lambda ev: bool(_findings(ev, "loss_spike")) and bool(_actions(ev, "rollback") or _actions(ev, "lower_lr"))),
    Cell("corrupt_batch", lambda: [CorruptBatch(at_step=26, steps=6)], "corrupt_batch",
         lambda ev: bool(_findings(ev, "loss_spike")) and any(
             e.get("type") == "metrics" and e.get(gg.M.SKIPPED, 0) >= 1 for e in ev)),
    Cell("out_of_memory", lambda: [OutOfMemory(at_step=12, above_batch=BATCH // 2)], "out_of_memory",
         lambda ev: bool(_actions(ev, "oom_shrink_micro")), monitor_bitwise=False),
    Cell("fp16_overflow_streak", lambda: [OverflowStreak(at_step=12, steps=6)], "overflow_streak",
         lambda ev: bool(_findings(ev, "overflow_streak")), scaler=True),
    Cell("snapshot_disk_full", lambda: [SnapshotIOFault(at_step=12, target="snapshots", errno=errno.ENOSPC)],
         "io_fault", lambda ev: any(e.get("type") == "snapshot_io_error" for e in ev)),
    Cell("snapshot_readonly", lambda: [SnapshotIOFault(at_step=12, target="snapshots", errno=errno.EROFS)],
         "io_fault", lambda ev: any(e.get("type") == "snapshot_io_error" and e["errno"] == errno.EROFS for e in ev)),
    Cell("events_log_disk_full", lambda: [SnapshotIOFault(at_step=12, target="events", errno=errno.ENOSPC)],
         "io_fault", lambda ev: any(e.get("type") == "sink_io_error" for e in ev)),
    Cell("snapshots_deleted_then_nan", lambda: [SnapshotIOFault(at_step=12, mode="delete"),
                                                NaNLoss(at_step=13, steps=4)], "io_fault",
         lambda ev: any(a["params"].get("unavailable", "").startswith("rollback unavailable")
                        and _actions([x for x in ev if x.get("step") == a["step"]], "lower_lr")
                        for a in _actions(ev, "rollback"))),
]


@dataclass
class RunResult:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    events: list[dict[str, Any]]
    log_events: list[dict[str, Any]]
    halted: gg.GradGuardHalt | None
    injectors: list[Injector]
    warnings: list[str] = field(default_factory=list)


def _setup(cell: Cell):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu") if cell.scaler else None
    batches = BatchController(Pairs(), batch_size=BATCH, shuffle=False, epochs=None)
    return model, opt, scaler, batches


def run_plain(cell: Cell, preset: str | None, tmp_path) -> RunResult:
    """The plain-``Guard`` engine (``preset=None``: no guard at all, the reference loop)."""
    model, opt, scaler, batches = _setup(cell)
    injectors = cell.injectors()
    if preset is None:  # no guard: faults of gradguard's own files do not apply
        injectors = [i for i in injectors if not isinstance(i, SnapshotIOFault)]
    sink = gg.MemorySink()
    guard = None
    if preset is not None:
        cfg = gg.GuardConfig.preset(preset, output={"dir": str(tmp_path / "out"), "console": False},
                                    recovery={"disk_dir": str(tmp_path / "snaps"), "snapshot_interval": 5,
                                              "confirm_steps": 2})
        guard = gg.Guard(model, opt, scaler=scaler, config=cfg, sinks=[sink], batches=batches)
    for inj in injectors:
        inj.attach(model, opt, guard=guard)
    halted = None
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for i, step in enumerate(batches):
                if i == STEPS:
                    break
                if guard is not None:
                    guard.accumulate(step, lambda mb: model(mb["x"], mb["y"]))
                    guard.step()
                else:
                    (mb, _), = list(step.micro_batches())
                    loss = model(mb["x"], mb["y"]) * 1.0
                    if scaler is not None:
                        scaler.scale(loss).backward()
                        scaler.step(opt)
                        scaler.update()
                    else:
                        loss.backward()
                        opt.step()
                opt.zero_grad()
        except gg.GradGuardHalt as exc:
            halted = exc
        finally:
            for inj in injectors:
                inj.detach()
            if guard is not None:
                guard.close()
    log_events = []
    if guard is not None and guard.log_path and os.path.exists(guard.log_path):
        with open(guard.log_path, encoding="utf-8") as fh:
            log_events = [json.loads(line) for line in fh]
    events = sink.events + [{"type": "metrics", "step": s, **m} for s, m in sink.metrics]  # as in the JSONL log
    return RunResult(model, opt, events, log_events, halted, injectors, [str(w.message) for w in caught])


ENGINES = {"plain": run_plain}
RESULTS: list[dict[str, Any]] = []


@pytest.fixture(scope="module", autouse=True)
def matrix_summary(tmp_path_factory):
    yield
    out = os.environ.get("GRADGUARD_FAULT_MATRIX_JSON") or str(tmp_path_factory.getbasetemp() / "fault_matrix.json")
    summary = {"cells": RESULTS, "total": len(RESULTS), "passed": sum(r["passed"] for r in RESULTS),
               "engines": sorted(ENGINES), "injectors": [c.name for c in CELLS], "presets": ["default", "monitor"]}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=1)
    print(f"\nfault matrix: {summary['passed']}/{summary['total']} cells passed -> {out}")


def _finite_state(model, opt) -> bool:
    if not all(torch.isfinite(p).all() for p in model.parameters()):
        return False
    for st in opt.state_dict()["state"].values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.is_floating_point() and not torch.isfinite(v).all():
                return False
    return True


def _same(a: torch.nn.Module, b: torch.nn.Module, exact: bool) -> bool:
    for p, q in zip(a.parameters(), b.parameters()):
        if exact:
            if not torch.equal(torch.nan_to_num(p, nan=1234.5), torch.nan_to_num(q, nan=1234.5)):
                return False
        elif not torch.allclose(p, q, rtol=1e-4, atol=1e-5, equal_nan=True):
            return False
    return True


@pytest.mark.parametrize("preset", ["default", "monitor"])
@pytest.mark.parametrize("cell", CELLS, ids=[c.name for c in CELLS])
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_fault_cell(engine, cell, preset, tmp_path):
    checks: dict[str, bool] = {}
    res = None
    try:
        res = _check_cell(ENGINES[engine], cell, preset, tmp_path, checks)
    except Exception as exc:
        checks[f"raised {type(exc).__name__}: {exc}"[:200]] = False
        raise
    finally:
        RESULTS.append({"engine": engine, "injector": cell.name, "preset": preset, "passed": all(checks.values()),
                        "halted": None if res is None or res.halted is None else res.halted.diagnosis.get("reason"),
                        "checks": checks})
    assert all(checks.values()), (f"{engine} x {cell.name} x {preset}: failed checks "
                                  f"{[k for k, v in checks.items() if not v]}")


def _check_cell(run, cell: Cell, preset: str, tmp_path, checks: dict[str, bool]) -> RunResult:
    res = run(cell, preset, tmp_path)
    events = res.events
    checks["fault_fired"] = all(inj.fired for inj in res.injectors)
    checks["fault_logged"] = any(e.get("type") == "fault_injected" and e.get("fault") == cell.fault for e in events)
    checks["finished_or_diagnosed_halt"] = res.halted is None or bool(res.halted.diagnosis.get("reason"))
    if preset == "default":
        checks["state_finite"] = _finite_state(res.model, res.optimizer)
        checks["reaction_logged"] = cell.expect(events)
        if cell.name != "events_log_disk_full":  # the JSONL log on disk holds the same record
            checks["jsonl_has_fault"] = any(e.get("type") == "fault_injected" for e in res.log_events)
    else:
        checks["monitor_no_action"] = not [e for e in events if e.get("type") == "action"
                                           and e.get("name") != "oom_shrink_micro"]
        checks["monitor_no_halt"] = res.halted is None
        if cell.monitor_bitwise:
            ref = run(cell, None, tmp_path / "ref")
            checks["monitor_bit_identical_to_unguarded"] = _same(res.model, ref.model, exact=True)
        else:  # the OOM retry splits the batch: same samples, same gradient up to rounding
            clean = Cell(cell.name, lambda: [], cell.fault, cell.expect, cell.scaler)
            ref = run(clean, None, tmp_path / "ref")
            checks["monitor_same_as_fault_free"] = _same(res.model, ref.model, exact=False)
    return res


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
    guard.lr.global_mult = 0.5
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
