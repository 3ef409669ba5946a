"""Reliability (issue 12, core parts): hooks come off on close, one guard per optimizer, disk
snapshots owned by one run and restored all-or-nothing, guard state validated before it is
applied, I/O faults degrade instead of killing the run, late-trainable parameters measured."""


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
    with pytest.raises(AttachError, match=r"optimizer=SGD .*already has a guard attached.*Fix: call close\(\)"):
        gg.Guard(model, opt, config=quiet_cfg())
    guard.lr.lower(factor=0.1)  # the guard cut the LR to 10%
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
    assert guard2.lr.current() == 1.0 and guard2.step(model(*make_batch(gen))).lr_multiplier == 1.0
    guard2.close()
    guard2.close()  # idempotent


def test_close_mid_step_puts_the_users_lr_back(quiet_cfg):
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = gg.Guard(model, opt, config=quiet_cfg())
    guard.lr.lower(factor=0.5)
    model(*make_batch(torch.Generator().manual_seed(0))).backward()
    guard.lr._pre_hook(opt, (), {})  # a step in progress: the multiplier is applied
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    guard.close()
    assert opt.param_groups[0]["lr"] == 0.1
