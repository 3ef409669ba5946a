"""Repeated spikes on weights no update changed, at an LR that did not rise (``Policy._ambiguous``):
two bad batches in a row look the same as damaged weights, so the guard waits for the evidence
(another batch on those weights, or a batch on restored ones) before it cuts the LR. One real run
(two garbage batches mid-run) and the decision's branches through the real core."""

from __future__ import annotations

import pytest
import torch

import gradguard as gg
from gradguard.policy import Policy
from tests.test_teaching import make_core, run, sig, warm


def _names(rep) -> list[str]:
    return [a.name for a in rep.actions]


def test_two_bad_batches_at_a_steady_lr_are_skipped_without_an_lr_cut(tmp_path):
    """Real training, a constant LR: batches 60 and 61 have garbage labels. Both are skipped (the
    second on the same weights as the first, nothing applied in between) and the next, clean,
    batch is applied: no rollback, no LR cut, and the run ends where the clean run ends."""
    from gradguard.demo_model import ByteBatches, TinyGPT, evaluate, load_corpus

    data = ByteBatches(load_corpus(200_000), 32)
    ev = data.eval_batches(32, 4)

    def train(bad: bool):
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(0)
        m = TinyGPT(n_layer=2, width=64, seq_len=32)
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
        cfg = gg.GuardConfig.preset("default", output={"dir": str(tmp_path), "console": False},
                                    recovery={"snapshot_interval": 20})
        guard = gg.Guard(m, opt, config=cfg)
        skipped = []
        for s in range(1, 151):
            x, y = data.train_batch(32, g)
            if bad and s in (60, 61):
                y = torch.zeros_like(y)
            loss = m(x, y)
            loss.backward()
            if not guard.step(loss).applied:
                skipped.append(s)
            opt.zero_grad()
        return evaluate(m, ev), guard.close(), skipped

    clean, _, _ = train(False)
    guarded, summary, skipped = train(True)
    assert skipped == [60, 61]
    assert "rollback" not in summary["actions"] and "lower_lr" not in summary["actions"]
    assert summary["lr_multiplier"] == 1.0
    assert guarded < 1.01 * clean


def _spike(step: int) -> gg.Finding:
    return gg.Finding("loss_spike", "warn", step, 9.0, 3.0, 2.0, message="loss spike")


def _chain(core, start: int, n: int, loss: float = 90.0):
    return [run(core, sig(start + i, loss=loss + i)) for i in range(n)]


def test_a_third_spike_rolls_back_without_a_cut_and_a_spike_after_it_blames_the_data(tmp_path):
    core = make_core(tmp_path, recovery={"snapshot_interval": 1, "confirm_steps": 2})
    warm(core, steps=30)
    first, second, third = _chain(core, 31, 3)
    assert not first.applied and not second.applied and not (first.actions or second.actions)
    assert "loss spike again" in second.skip_reason and not second.unstable
    assert third.rolled_back and not third.unstable
    rb = next(a for a in third.actions if a.name == "rollback")
    assert rb.params["ambiguous"] and "lower_lr" not in _names(third)
    assert core.lr.global_mult == 1.0 and core.policy.level == 0
    # the probation covers the replay of the steps lost, then two spike-confirm windows
    window = core.config.policy.spike_confirm_window
    assert core.policy.probation_until == third.step + rb.params["steps_lost"] + 2 * window
    # the restored weights meet bad data: the data was to blame, the weights the rollback left come back
    rep = run(core, sig(34, loss=500.0))
    assert rep.blamed_on_data and "undo_rollback" in _names(rep) and "revert_lr" not in _names(rep)
    assert core.policy.probation_until is None and core.lr.global_mult == 1.0
    core.close()


def test_a_clean_batch_after_the_rollback_takes_training_back_to_the_weights_it_left(tmp_path):
    """Three bad batches: the rollback's restored weights meet a clean batch, which says nothing of
    the weights it left. Training goes back to them (that step skipped) on trial: a clean batch on
    them clears them (one batch lost, not the rollback's steps, and no LR cut)."""
    core = make_core(tmp_path, recovery={"snapshot_interval": 1, "confirm_steps": 2})
    warm(core, steps=30)
    third = _chain(core, 31, 3)[-1]
    assert third.rolled_back and core.rollback.trial_due
    back = run(core, sig(34, loss=2.01))
    undo = next(a for a in back.actions if a.name == "undo_rollback")
    assert not back.applied and undo.params == {"to_step": third.step - 1, "trial": True}
    assert not core.rollback.verified and not core.rollback.trial_due
    window = core.config.policy.spike_confirm_window
    assert core.policy.probation_until == 34 + 2 * window
    assert run(core, sig(35, loss=2.02)).applied
    assert core.lr.global_mult == 1.0 and core.policy.level == 0 and core.lr.warm_left == 0
    core.close()


def test_a_spike_on_the_weights_taken_back_on_trial_climbs_the_ladder_with_the_cut(tmp_path):
    """Damaged weights: the weights taken back on trial spike on the next batch too, so the ladder
    climbs (rollback, LR cut); and within the probation a new pair of spikes is not ambiguous."""
    core = make_core(tmp_path, recovery={"snapshot_interval": 1, "confirm_steps": 2})
    warm(core, steps=30)
    _chain(core, 31, 3)
    assert not run(core, sig(34, loss=2.01)).applied  # back to the weights left, on trial
    damaged = run(core, sig(35, loss=95.0))
    assert damaged.unstable and damaged.rolled_back and "lower_lr" in _names(damaged)
    assert core.lr.global_mult < 1.0 and core.policy.level == 1
    core.close()
    # probation: an ambiguous rollback then clean steps, then two spikes in a row
    core = make_core(tmp_path, recovery={"snapshot_interval": 1, "confirm_steps": 2})
    warm(core, steps=30)
    _chain(core, 31, 3)
    window = core.config.policy.spike_confirm_window
    step = 34
    for i in range(step, step + window + 1):  # the trial step, then clean steps
        run(core, sig(i, loss=2.0 + 0.01 * (i % 3)))
    step += window + 1
    assert step <= core.policy.probation_until
    first, second = _chain(core, step, 2)
    assert not first.applied and "lower_lr" in _names(second) and second.unstable
    core.close()


def test_spikes_in_the_first_steps_or_a_rising_lr_escalate_at_once(tmp_path):
    """Before the run made progress (fewer applied steps than ``detect.warmup_steps``) or while the
    schedule rises, a repeated spike is the LR's: the second one climbs the ladder as before; and
    always with ``policy.ambiguous_spikes=False``."""
    # the policy alone: the same two spikes, with and without a rising LR
    for rose, cut, wait in ((True, True, True), (False, False, True), (False, True, False)):
        p = Policy(gg.GuardConfig(policy={"ambiguous_spikes": wait}).policy)
        p.decide(sig(50, loss=9.0), [_spike(50)], 1.0, lr_rose=rose)
        d = p.decide(sig(51, loss=9.0), [_spike(51)], 1.0, lr_rose=rose)
        assert ("lower_lr" in [a.name for a in d.actions]) is cut and d.unstable is cut
    # the core: 10 applied steps (< warmup_steps=20), then two spikes on the same weights
    core = make_core(tmp_path)
    assert core.config.detect.warmup_steps == 20
    for i in range(1, 11):
        run(core, sig(i, loss=2.0 + 0.01 * (i % 3)))
    first = run(core, sig(11, loss=1e4))
    assert not first.applied and "loss_spike" in {f.kind for f in first.findings}
    second = run(core, sig(12, loss=2e4))
    assert second.unstable and "lower_lr" in _names(second)
    core.close()


def test_policy_state_round_trips_the_chain_and_the_probation_and_loads_older_states():
    p = Policy(gg.GuardConfig().policy)
    p.spike_chain, p.probation_until = 2, 140
    q = Policy(gg.GuardConfig().policy)
    q.load_state_dict(p.state_dict())
    assert (q.spike_chain, q.probation_until) == (2, 140)
    legacy = {k: v for k, v in p.state_dict().items() if k not in ("spike_chain", "probation_until")}
    r = Policy(gg.GuardConfig().policy)
    r.load_state_dict(legacy)
    assert (r.spike_chain, r.probation_until) == (0, None)


def test_weights_taken_back_keep_their_batchnorm_statistics(tmp_path):
    """A return to the weights a rollback left brings their BatchNorm running statistics back with
    them: the skipped step's forward does not put the restored weights' statistics over them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = gg.GuardConfig.preset("default", output={"dir": str(tmp_path), "console": False},
                                recovery={"snapshot_interval": 10, "confirm_steps": 2})
    guard = gg.Guard(model, opt, config=cfg)
    bn, held, names = model[1], None, {}
    for step in range(1, 37):
        x = torch.randn(16, 4) + 0.05 * step  # drifting inputs: the statistics move every step
        loss = model(x).pow(2).mean() * (1000.0 if step in (31, 32, 33) else 1.0)
        loss.backward()
        rep = guard.step(loss)
        opt.zero_grad()
        names[step] = _names(rep)
        if step == 30:
            held = bn.running_mean.clone()
        if step == 34:
            assert "undo_rollback" in names[34] and not rep.applied
            assert torch.equal(bn.running_mean, held)
    guard.close()
    assert "rollback" in names[33] and "lower_lr" not in names[33]


@pytest.mark.parametrize("glitch", [True, False])
def test_an_lr_glitch_makes_repeated_spikes_the_lrs(glitch):
    """A scheduled LR that jumped x30 two steps ago (and decays a little inside the glitch) is the
    suspect: the second spike climbs the ladder at once. The same spikes at a steady LR are
    ambiguous: skipped, no cut."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def lam(s):
        return (30.0 if glitch and 40 <= s < 46 else 1.0) * (1 - s / 1000)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    guard = gg.Guard(model, opt, scheduler=sched, config=gg.GuardConfig(output={"console": False}))
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    cut_at = None
    for step in range(1, 46):
        loss = torch.nn.functional.mse_loss(model(x), y) * (1000.0 if step in (42, 43) else 1.0)
        loss.backward()
        rep = guard.step(loss)
        opt.zero_grad(set_to_none=True)
        if cut_at is None and "lower_lr" in _names(rep):
            cut_at = step
    guard.close()
    assert cut_at == (43 if glitch else None)
