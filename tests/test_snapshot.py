"""Snapshots and rollback on a real optimizer."""

import copy

import torch

import gradguard as gg
from gradguard.snapshot import SnapshotRing

from .conftest import TinyNet, make_batch


def _step(model, opt, gen):
    model(*make_batch(gen)).backward()
    opt.step()
    opt.zero_grad()


def test_snapshot_lifecycle_and_bitwise_restore():
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    ring = SnapshotRing(model, opt, ring_size=2, confirm_steps=3)
    _step(model, opt, gen)
    snap = ring.take(1)
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    assert ring.best() is None  # untested candidate: never restorable
    ring.observe(2, healthy=True)
    assert ring.best() is snap and not snap.confirmed  # tested by the loss at step 2
    for s in (3, 4):
        ring.observe(s, healthy=True)
    assert snap.confirmed and ring.ring == [snap]
    for _ in range(5):
        _step(model, opt, gen)
    ring.restore(snap, restore_schedule=True)
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved_model[k])
    st = opt.state_dict()["state"]
    for i, s in saved_opt["state"].items():
        for k, v in s.items():
            assert torch.equal(st[i][k], v)
    # later steps must not mutate the snapshot (Optimizer.load_state_dict keeps given tensors)
    for _ in range(3):
        _step(model, opt, gen)
    for i, s in saved_opt["state"].items():
        for k, v in s.items():
            assert torch.equal(snap.state["optimizer"]["state"][i][k], v)
    for k, v in saved_model.items():
        assert torch.equal(snap.state["model"][k], v)


def test_candidate_after_bad_update_is_dropped():
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ring = SnapshotRing(model, opt, ring_size=2, confirm_steps=2)
    ring.take(0)
    ring.observe(1, healthy=True)
    ring.observe(2, healthy=True)
    good = ring.ring[-1]
    ring.take(5)
    ring.observe(6, healthy=False)  # the weights after update 5 failed their direct test
    assert ring.best() is good and ring.candidates == []


def test_rollback_in_guard_restores_snapshot_and_keeps_counters(quiet_cfg):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = quiet_cfg(recovery={"snapshot_interval": 5, "confirm_steps": 2})
    guard = gg.Guard(model, opt, config=cfg)
    gen = torch.Generator().manual_seed(0)
    for _ in range(10):
        loss = model(*make_batch(gen))
        loss.backward()
        guard.step(loss)
        opt.zero_grad()
    snap = guard.core.snapshots.best()
    assert snap is not None and snap.confirmed and snap.step == 5
    expect = copy.deepcopy(snap.state["model"])
    model(*make_batch(gen)).backward()
    a = gg.Action("rollback", 11)
    guard.core.execute(a)
    assert a.params["to_step"] == 5 and a.params["steps_lost"] == 5
    for k, v in model.state_dict().items():
        assert torch.equal(v, expect[k])
    assert guard.core.step_count == 10  # user-visible counters never move backwards
