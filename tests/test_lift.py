"""An LR cut the schedule has passed lifts (``LRConfig.glitch_window``): an LR glitch ends, the
scheduler itself takes the LR far below the level that failed, and the cut stops costing the rest
of the run. A cut in a smooth decay stays; a lifted cut comes back if the schedule climbs again."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

import gradguard as gg
from gradguard.act import LRMultiplier
from gradguard.measure import LayerMap
from gradguard.state import StateError


def _multiplier(**lr):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    return LRMultiplier(gg.GuardConfig(lr=lr).lr, opt, LayerMap(model), hooks=False)


def _feed(m: LRMultiplier, lrs):
    """One scheduled LR per step; the names of the moves the multiplier made."""
    moves = []
    for lr in lrs:
        m.observe_schedule(lr)
        moved = m.follow_schedule()
        moves.append(moved[0] if moved else None)
    return moves


def test_a_glitch_cut_lifts_when_the_schedule_falls_and_comes_back_if_it_climbs_again():
    m = _multiplier()
    _feed(m, [1.0, 1.0, 30.0, 30.0])  # a glitch: x30
    assert m.lower() == (1.0, pytest.approx(0.3))
    assert _feed(m, [30.0, 29.0]) == [None, None]  # still inside the glitch: the cut holds
    assert m.global_mult == pytest.approx(0.3)
    assert _feed(m, [1.0]) == ["lift_lr"]  # the glitch ended: the scheduler runs below the cut
    assert m.global_mult == 1.0 and m.global_ceiling == 1.0
    assert _feed(m, [0.99] * 20) == [None] * 20
    assert _feed(m, [9.5]) == ["recut_lr"]  # the schedule climbed above the cut again: it is back
    assert m.global_mult == pytest.approx(0.3) and m.global_ceiling <= 0.5
    assert m.liftable == {"failed_lr": 30.0, "mult": 1.0}


def test_a_cut_in_a_smooth_decay_or_a_late_drop_stays():
    """A cosine or a fast linear decay never falls 3.3x in one step (but at its very end, far below
    the failed LR), and a drop more than ``glitch_window`` steps after the schedule left the failed
    LR is the run's own course: the cut stays. A schedule held at the failed LR that then drops
    10x in one step (a step schedule) runs below the cut's own level: it lifts."""
    m = _multiplier()
    cosine = [0.5 * (1 + math.cos(math.pi * t / 300)) for t in range(300)]
    _feed(m, cosine[:100])
    m.lower()
    assert _feed(m, cosine[100:]) == [None] * 200
    assert m.global_mult == pytest.approx(0.3) and m.liftable is None
    fast = _multiplier()  # a linear decay to zero over 14 steps, cut half-way: it falls 7x in 7 steps
    _feed(fast, [1 - t / 14 for t in range(8)])
    fast.lower()
    assert _feed(fast, [1 - t / 14 for t in range(8, 15)]) == [None] * 7
    late = _multiplier(glitch_window=8)
    _feed(late, [1.0] * 5)
    late.lower()
    decay = [1 - 0.06 * t for t in range(1, 11)] + [0.4] * 8  # leaves the failed LR slowly
    assert _feed(late, decay + [0.1] * 5) == [None] * 23  # the drop came 9 steps after it was below half
    assert late.liftable is None
    assert late.global_mult == pytest.approx(0.3)
    soon = _multiplier(glitch_window=8)
    _feed(soon, [1.0] * 5)
    soon.lower()
    assert _feed(soon, [1.0] * 30 + [0.1]) == [None] * 30 + ["lift_lr"]
    off = _multiplier(glitch_window=0)
    _feed(off, [30.0] * 3)
    off.lower()
    assert _feed(off, [1.0] * 5) == [None] * 5 and off.global_mult == pytest.approx(0.3)


def test_a_later_rung_in_the_same_glitch_lifts_back_to_before_the_first_cut():
    m = _multiplier()
    _feed(m, [1.0, 30.0])
    m.lower()
    _feed(m, [30.0])
    m.lower()
    assert m.global_mult == pytest.approx(0.09)
    assert _feed(m, [1.0]) == ["lift_lr"] and m.global_mult == 1.0


def test_the_lift_state_round_trips_and_bad_states_are_named():
    m = _multiplier()
    _feed(m, [1.0, 30.0])
    m.lower()
    fresh = _multiplier()
    fresh.load_state_dict(m.state_dict())
    assert fresh.state_dict() == m.state_dict()
    assert _feed(fresh, [1.0]) == ["lift_lr"]
    older = {k: v for k, v in m.state_dict().items() if k not in ("recent_lrs", "liftable", "lifted")}
    fresh.load_state_dict(older)  # a state saved before the lift existed
    assert fresh.liftable is None and not fresh.recent_lrs
    with pytest.raises(StateError, match=r"lr\.liftable"):
        fresh.load_state_dict({**m.state_dict(), "liftable": {"failed_lr": float("nan"), "mult": 1.0}})
    with pytest.raises(StateError, match=r"lr\.recent_lrs"):
        fresh.load_state_dict({**m.state_dict(), "recent_lrs": [1.0, -2.0]})
    with pytest.raises(StateError, match=r"lr\.global_mult"):  # the older fields are still checked
        fresh.load_state_dict({**m.state_dict(), "global_mult": float("inf")})
    with pytest.raises(StateError, match=r"lr\.layer_mult\['lm_head'\]"):
        fresh.load_state_dict({**m.state_dict(), "layer_mult": {"lm_head": 0.0}})
    assert fresh.state_dict() == {**older, "recent_lrs": [], "liftable": None, "lifted": None}  # nothing applied


def test_a_glitch_in_a_real_run_is_cut_then_lifted_and_the_advice_keeps_the_lr():
    """The core end to end: the scheduled LR jumps x30 for steps 40-45 and spikes follow; the
    guard rolls back and cuts, then lifts the cut the step the schedule falls back (the scheduler is
    held on the two skipped steps), and the effective LR is the schedule's again."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (30.0 if 40 <= s < 46 else 1.0) * (1 - s / 1000))
    guard = gg.Guard(model, opt, scheduler=sched,
                     config=gg.GuardConfig(output={"console": False, "jsonl": False}, lr={"rewarm_steps": 0}))
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    names, seen = {}, {}
    opt.register_step_pre_hook(lambda o, a, k: seen.__setitem__(  # the LR the update uses, and the schedule's
        guard.core.step_count + 1, (o.param_groups[0]["lr"], guard.core.lr.scheduled_lrs()[0])))
    for step in range(1, 61):
        loss = torch.nn.functional.mse_loss(model(x), y) * (1000.0 if step in (42, 43) else 1.0)
        loss.backward()
        names[step] = [a.name for a in guard.step(loss).actions]
        opt.zero_grad(set_to_none=True)
    summary = guard.close()
    assert "lower_lr" in names[43]
    lifted = [s for s, n in names.items() if "lift_lr" in n]
    assert lifted == [49]  # the schedule's step 46 (two steps held), the first after the glitch
    assert guard.core.lr.global_mult == 1.0
    assert seen[47][0] == pytest.approx(0.3 * seen[47][1])  # the cut in force inside the glitch
    assert all(seen[s][0] == seen[s][1] for s in range(49, 61))  # the schedule's own LR again
    assert "lr_factor" not in summary["advice"]["settings"]  # nothing to tell the user about the LR


def test_after_an_lr_glitch_late_in_a_cosine_the_lifted_run_ends_better_than_the_kept_cut():
    """End to end (``benchmarks/unseen.py``, spike/constant_lr, seed 0): the LR x30 for 4 steps at step
    200 of 300. The guard rolls back and cuts; a cut kept through the rest of the cosine tail costs
    the run (the scheduler itself had taken the LR back down 30x)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import unseen

    lifted = unseen.run("constant_lr", "spike", "guard", seed=0)
    kept = unseen.run("constant_lr", "spike", "guard", seed=0, guard_config={"lr": {"glitch_window": 0}})
    assert lifted["actions"].get("lift_lr") == 1 and "lift_lr" not in kept["actions"]
    assert lifted["final"] < kept["final"] / 1.005, (lifted["final"], kept["final"])
