"""Reliability (issue 12, core parts): hooks come off on close, one guard per optimizer, disk
snapshots owned by one run and restored all-or-nothing, guard state validated before it is
applied, I/O faults degrade instead of killing the run, late-trainable parameters measured."""


import copy
import os
import socket

import pytest
import torch

import gradguard as gg
from gradguard.act import AttachError

from .conftest import TinyNet, make_batch


def _train(guard, model, steps, gen, opt=None):
    reports = []
    for _ in range(steps):
        loss = model(*make_batch(gen))
        loss.backward()
        reports.append(guard.step(loss))
        (opt or guard.user_optimizer).zero_grad()
    return reports


# -- optimizer hooks ---------------------------------------------------------------------------
def test_close_restores_optimizer_exactly_and_one_guard_per_optimizer(quiet_cfg):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    n_pre, n_post = len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)
    guard = gg.Guard(model, opt, config=quiet_cfg())
    with pytest.raises(AttachError, match=r"optimizer=SGD .*already has an acting guard attached.*Fix: call close\(\)"):
        gg.Guard(model, opt, config=quiet_cfg())
    gg.Guard(model, opt, config=quiet_cfg("monitor")).close()  # a monitor never touches the LR: allowed
    guard.core.lr.lower(factor=0.1)  # the guard cut the LR to 10%
    gen = torch.Generator().manual_seed(0)
    _train(guard, model, 2, gen)
    guard.close()
    assert (len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)) == (n_pre, n_post)
    # a plain step afterwards runs at the user's LR: update == lr * grad exactly
    before = [p.detach().clone() for p in model.parameters()]
    model(*make_batch(gen)).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    for p, b, g in zip(model.parameters(), before, grads):
        torch.testing.assert_close(p.detach(), b - 0.1 * g, rtol=0, atol=1e-7)
    opt.zero_grad()
    # a new guard on the same optimizer may attach now, and reports the multiplier it applies
    guard2 = gg.Guard(model, opt, config=quiet_cfg())
    assert guard2.core.lr.current() == 1.0 and guard2.step(model(*make_batch(gen))).lr_multiplier == 1.0
    guard2.close()
    guard2.close()  # idempotent


def test_close_mid_step_puts_the_users_lr_back(quiet_cfg):
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = gg.Guard(model, opt, config=quiet_cfg())
    guard.core.lr.lower(factor=0.5)
    model(*make_batch(torch.Generator().manual_seed(0))).backward()
    guard.core.lr._pre_hook(opt, (), {})  # a step in progress: the multiplier is applied
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    guard.close()
    assert opt.param_groups[0]["lr"] == 0.1


# -- snapshots on disk ---------------------------------------------------------------------------
def _disk_guard(tmp_path, model, opt, sink=None, **recovery):
    cfg = gg.GuardConfig.preset("default", output={"dir": str(tmp_path / "out"), "console": False},
                                recovery={"snapshot_interval": 2, "confirm_steps": 1,
                                          "disk_dir": str(tmp_path / "snaps"), **recovery})
    return gg.Guard(model, opt, config=cfg, sinks=[sink] if sink else None)


def test_two_runs_sharing_disk_dir_own_their_files_and_check_the_fingerprint(tmp_path):
    from gradguard.snapshot import SnapshotUnavailable

    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    a, b = TinyNet(width=16), TinyNet(width=8)
    opt_a, opt_b = torch.optim.AdamW(a.parameters(), lr=1e-2), torch.optim.AdamW(b.parameters(), lr=1e-2)
    ga, gb = _disk_guard(tmp_path, a, opt_a), _disk_guard(tmp_path, b, opt_b)
    _train(ga, a, 4, gen)
    _train(gb, b, 4, gen)
    dir_a, dir_b = ga.core.snapshots.disk.directory, gb.core.snapshots.disk.directory
    assert dir_a != dir_b and os.path.dirname(dir_a) == os.path.dirname(dir_b) == str(tmp_path / "snaps")
    assert {f for f in os.listdir(dir_a) if f.endswith(".pt")} >= {"snapshot-000000002.pt", "snapshot-000000004.pt"}
    # a foreign file under this run's name (a copy, a mix-up) is refused: the next older one is used
    snap = ga.core.snapshots.best()

    def overwrite_with_b(step):
        name = f"snapshot-{step:09d}.pt"
        for suffix in ("", ".sha256"):
            with open(os.path.join(dir_b, name + suffix), "rb") as src, \
                    open(os.path.join(dir_a, name + suffix), "wb") as dst:
                dst.write(src.read())

    overwrite_with_b(snap.step)
    restored = ga.core.snapshots.restore(snap, restore_schedule=False)
    assert restored.step < snap.step and "another model" in ga.core.snapshots.problems[0]
    # every file foreign: nothing is restored and nothing changes
    for step in ga.core.snapshots.disk.steps():
        overwrite_with_b(step)
    with torch.no_grad():
        a.lm_head.weight.add_(1.0)
    before = copy.deepcopy(a.state_dict())
    with pytest.raises(SnapshotUnavailable, match="another model"):
        ga.core.snapshots.restore(snap, restore_schedule=False)
    for k, v in a.state_dict().items():
        assert torch.equal(v, before[k])
    ga.close()
    gb.close()


def test_orphan_temp_files_of_dead_writers_are_removed_at_start(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(proc.stdout)
    run = tmp_path / "snaps" / "run-old"
    run.mkdir(parents=True)
    host = socket.gethostname()
    orphan = run / f"snapshot-000000003.pt.tmp-{host}-{dead}"
    orphan.write_bytes(b"half a snapshot")
    legacy = run / f"snapshot-000000003.pt.sha256.tmp-{dead}"  # older name: pid only
    legacy.write_bytes(b"abc")
    live = run / f"snapshot-000000004.pt.tmp-{host}-{os.getppid()}"  # a writer that still runs
    live.write_bytes(b"being written")
    elsewhere = run / f"snapshot-000000004.pt.tmp-other-machine-{dead}"  # cannot tell: kept
    elsewhere.write_bytes(b"being written elsewhere")
    kept = run / "snapshot-000000002.pt"
    kept.write_bytes(b"complete")
    sink = gg.MemorySink()
    model = TinyNet()
    guard = _disk_guard(tmp_path, model, torch.optim.SGD(model.parameters(), lr=0.1), sink=sink)
    assert not orphan.exists() and not legacy.exists()
    assert live.exists() and elsewhere.exists() and kept.exists()
    ev = [e for e in sink.events if e["type"] == "snapshot_orphans_removed"]
    assert ev and sorted(ev[0]["paths"]) == sorted([str(orphan), str(legacy)])
    own = guard.core.snapshots.disk.directory
    _train(guard, model, 3, torch.Generator().manual_seed(0))
    assert os.listdir(own)
    guard.close()
    assert not os.path.exists(own) and kept.exists()  # close removes this run's folder only


def test_disk_full_mid_run_degrades_to_memory_and_training_goes_on(tmp_path):
    import errno

    from gradguard import _io

    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sink = gg.MemorySink()
    guard = _disk_guard(tmp_path, model, opt, sink=sink)
    gen = torch.Generator().manual_seed(0)
    _train(guard, model, 3, gen)
    fault = _io.add_fault(_io.IOFault(str(tmp_path), errno=errno.ENOSPC))  # the snapshots and the log
    try:
        with pytest.warns(RuntimeWarning, match="No space left on device"):
            reports = _train(guard, model, 4, gen)
    finally:
        _io.remove_fault(fault)
    assert all(r.applied for r in reports)
    kinds = {e["type"] for e in sink.events}
    assert {"snapshot_io_error", "sink_io_error"} <= kinds
    assert not guard.core.snapshots.disk_writable
    newest = max(guard.core.snapshots.ring + guard.core.snapshots.candidates, key=lambda s: s.step)
    assert newest.step == 6 and newest.state and "path" not in newest.meta  # kept in memory instead
    assert not [f for f in os.listdir(guard.core.snapshots.disk.directory) if ".tmp-" in f]  # no orphan left
    # rollback still works (from the memory tier)
    model(*make_batch(gen)).backward()
    a = gg.Action("rollback", 8)
    guard.core.execute(a)
    assert a.params["to_step"] == 6
    guard.close()


def test_snapshot_files_deleted_rollback_unavailable_changes_nothing(tmp_path):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sink = gg.MemorySink()
    guard = _disk_guard(tmp_path, model, opt, sink=sink)
    gen = torch.Generator().manual_seed(0)
    _train(guard, model, 5, gen)
    assert guard.core.snapshots.best() is not None
    for f in os.listdir(guard.core.snapshots.disk.directory):
        os.remove(os.path.join(guard.core.snapshots.disk.directory, f))
    before = copy.deepcopy(model.state_dict())
    opt_before = copy.deepcopy(opt.state_dict())
    a = gg.Action("rollback", 6)
    guard.core.execute(a)
    assert a.params["unavailable"].startswith("rollback unavailable (no valid snapshot")
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    assert opt.state_dict()["state"][0]["step"] == opt_before["state"][0]["step"]
    assert any(e["type"] == "snapshot_fallback" and e["restored"] is None for e in sink.events)
    guard.close()


# -- parameters that become trainable after attach ------------------------------------------------
def test_unfrozen_and_added_parameters_are_measured_and_rollback_stays_whole(quiet_cfg):
    from gradguard.snapshot import SnapshotUnavailable

    torch.manual_seed(0)
    model = TinyNet()
    model.lm_head.requires_grad_(False)
    model.embed.requires_grad_(False)
    body = [p for n, p in model.named_parameters() if not n.startswith(("lm_head", "embed"))]
    opt = torch.optim.AdamW(body + list(model.embed.parameters()), lr=1e-2)  # embed: in the optimizer, frozen
    sink = gg.MemorySink()
    guard = gg.Guard(model, opt, config=quiet_cfg(recovery={"snapshot_interval": 2, "confirm_steps": 1}),
                     sinks=[sink])
    gen = torch.Generator().manual_seed(0)
    _train(guard, model, 4, gen)
    assert "lm_head" not in guard.core.layers.layer_names and "embed" not in guard.core.layers.layer_names
    old = guard.core.snapshots.best()
    assert old is not None
    # unfreeze: embed (already in the optimizer) and lm_head (a new param group)
    model.embed.requires_grad_(True)
    model.lm_head.requires_grad_(True)
    opt.add_param_group({"params": list(model.lm_head.parameters()), "lr": 1e-3})
    loss = model(*make_batch(gen))
    loss.backward()
    model.lm_head.weight.grad[0, 0] = float("nan")  # a NaN in a parameter that joined late
    rep = guard.step(loss)
    opt.zero_grad()
    assert {"embed", "lm_head"} <= set(guard.core.layers.layer_names)
    assert not rep.applied and any(f.kind == "nonfinite_grad" and "lm_head" in f.layers for f in rep.findings)
    assert torch.isfinite(model.lm_head.weight).all()
    # the snapshots taken for the old optimizer layout are dropped, not half-restored
    assert any(e["type"] == "snapshot_invalidated" for e in sink.events)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(SnapshotUnavailable, match="param groups"):
        guard.core.snapshots.restore(old, restore_schedule=False)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    _train(guard, model, 4, gen)  # a fresh snapshot of the new layout is taken and confirmed
    a = gg.Action("rollback", guard.core.step_count + 1)
    model(*make_batch(gen)).backward()
    guard.core.execute(a)
    assert "to_step" in a.params and len(opt.param_groups) == 2
    guard.close()


def test_real_disk_full_mid_write_is_an_io_error_not_a_crash(tmp_path, monkeypatch):
    """A real ENOSPC (the snapshot's temp file is /dev/full) in the middle of torch.save, which
    torch reports as a bare RuntimeError: still a snapshot_io_error, training goes on. (Temp files
    get random names created with O_EXCL, so /dev/full is handed in where the temp file is opened.)"""
    from gradguard import _io

    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sink = gg.MemorySink()
    guard = _disk_guard(tmp_path, model, opt, sink=sink)
    gen = torch.Generator().manual_seed(0)
    _train(guard, model, 1, gen)
    create_new, opened = _io.create_new, []

    def full_disk(path, binary=False):  # writes to it fail with ENOSPC, as on a full disk
        if binary and "snapshot-000000002.pt" + _io.TMP_MARK in path:
            opened.append(path)
            open(path, "wb").close()  # the temp file exists, as the real one would
            return open("/dev/full", "wb")
        return create_new(path, binary)

    monkeypatch.setattr(_io, "create_new", full_disk)
    with pytest.warns(RuntimeWarning, match="No space left on device"):
        reports = _train(guard, model, 3, gen)
    assert all(r.applied for r in reports)
    err = [e for e in sink.events if e["type"] == "snapshot_io_error"]
    assert err and err[0]["errno"] == 28 and err[0]["step"] == 2
    assert opened and not os.path.lexists(opened[0])  # the temp file is cleaned up
    assert guard.core.snapshots.candidates[-1].state  # the snapshot is kept in memory instead
    guard.close()
